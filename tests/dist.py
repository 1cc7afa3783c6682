"""Run a function on N local processes joined by a gloo process group (the test launcher).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, each joins the
group through ``threefold.comm.distributed.init_distributed`` (as under torchrun: this process
serves the store, the children are its clients) and calls ``fn(rank, world_size, *args)``.
It returns the per-rank results ordered by rank, or raises AssertionError with the failing
rank's traceback, or, on timeout, with the ranks that did not finish and their stacks.

``fn`` must be a module-level function of an importable module (it is pickled by name) and
its arguments and result must be picklable. Children see the launcher's environment variables
and ``sys.path`` as they are at the launch (torch itself is imported earlier, by the
forkserver; of the variables read at ``import torch``, ``TORCH_DISTRIBUTED_DEBUG`` is read
again by each child); each uses one CPU thread. Every launch still pays for process-group
set-up, so batch several checks into one launch with ``run_checks``.

``hash_seeds``: children forked from one forkserver share its hash seed, so every rank
iterates a set of strings in the same order and the tests cannot see code whose collective
order depends on it. With ``hash_seeds=(0, 1)`` each rank is a fresh interpreter (spawn,
about 3 s more per rank on 2 cores) started with ``PYTHONHASHSEED`` = seeds[rank % len],
which put ``{"dp", "edp"}`` in opposite orders.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

# forkserver: the server imports torch once, then every child is a fork of that clean,
# single-threaded process. Measured on 2 cores: a 4-rank launch takes 0.2 s this way against
# 13.7 s with spawn (each child importing torch). Children share nothing with pytest's
# process. "spawn" is the fallback where forkserver is missing (it exists on Linux and macOS).
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
ERROR_GRACE_S = 5.0  # after one rank fails, how long the others get to report before a kill


def _context(method: str):
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Takes effect only if this process has not started its forkserver yet.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "threefold.comm.distributed"])
    return ctx


def _child(rank: int, world_size: int, port: int, timeout: float, blob: bytes, parent: dict,
           results, stack_dir: str) -> None:
    """One rank: environment as torchrun sets it, join the group, run ``fn``, report."""
    # The forkserver was started with an older environment and import path: take the
    # launcher's current ones before ``fn`` is unpickled (and its module imported).
    os.environ.clear()
    os.environ.update(parent["environ"])
    sys.path[:] = parent["path"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT="0", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from threefold.comm.distributed import init_distributed, shutdown

    # read at ``import torch``, which the forkserver did before the launcher's environment
    # was taken: TORCH_DISTRIBUTED_DEBUG=DETAIL checks op and shapes of every collective
    dist.set_debug_level_from_env()

    torch.set_num_threads(1)  # a small machine shared by N ranks: one thread each
    stacks = open(Path(stack_dir) / f"rank{rank}.txt", "w")
    if hasattr(signal, "SIGUSR1"):  # the launcher asks for stacks before killing a hung rank
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    ok = False
    try:
        fn, args = pickle.loads(blob)
        init_distributed(timeout_s=timeout, device="cpu")
        payload = pickle.dumps(fn(rank, world_size, *args))  # here, so errors are reported
        ok = True
    except BaseException:
        payload = traceback.format_exc()
    results.put((rank, ok, payload))
    # Flush the report before tearing the group down: a failing rank's report then arrives
    # before the errors its departure causes on its peers, so the launcher names it first.
    results.close()
    results.join_thread()
    # After a failure peers may never reach a barrier: tear down without one.
    shutdown(barrier_timeout_s=timeout if ok else None)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
                    start_method: str | None = None, hash_seeds: tuple[int, ...] = ()) -> list:
    """``[fn(rank, world_size, *args) for each rank]``, each rank in its own process (with
    its own ``PYTHONHASHSEED`` from ``hash_seeds``, when given)."""
    import torch.distributed as dist

    ctx = _context("spawn" if hash_seeds else start_method or START_METHOD)
    blob = pickle.dumps((fn, args))  # fails here, clearly, for a lambda or a local function
    parent = {"environ": dict(os.environ), "path": list(sys.path)}
    # This process serves the rendezvous store (as torchrun's agent does) on a port the OS
    # picks, so there is no race for a "free" port between launches.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="threefold-dist-") as stack_dir:
        procs = [ctx.Process(target=_child, daemon=True, name=f"rank{r}",
                             args=(r, world_size, store.port, timeout, blob, parent, results,
                                   stack_dir))
                 for r in range(world_size)]
        unfinished = list(range(world_size))  # until reports say otherwise
        for rank, p in enumerate(procs):
            with _hash_seed(hash_seeds[rank % len(hash_seeds)] if hash_seeds else None):
                p.start()
        try:
            done, errors, unfinished = _collect(procs, results, timeout)
            stacks = _stacks(procs, unfinished, stack_dir) if unfinished and not errors else ""
        finally:
            _stop(procs, unfinished)
            del store
    name = getattr(fn, "__name__", repr(fn))
    if errors:
        # Reports arrive in order of failure: the first is usually the cause, later ones
        # (peers losing their connection to it) the consequence.
        msg = "\n".join(f"--- rank {r} failed{' first' if i == 0 else ''}:\n{tb}"
                        for i, (r, tb) in enumerate(errors.items()))
        if unfinished:
            msg += f"\nranks {unfinished} did not finish (stopped after the failure)"
        raise AssertionError(f"run_distributed({name}, world_size={world_size}):\n{msg}")
    if unfinished:
        raise AssertionError(f"run_distributed({name}, world_size={world_size}) timed out after "
                             f"{timeout:.0f} s; ranks {unfinished} did not finish.\n{stacks}")
    return [pickle.loads(done[r]) for r in range(world_size)]


@contextlib.contextmanager
def _hash_seed(seed: int | None):
    """``PYTHONHASHSEED`` set to ``seed`` while a spawned child starts (it reads it then)."""
    if seed is None:
        yield
        return
    old = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = str(seed)
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = old


def _collect(procs: list, results, timeout: float) -> tuple[dict, dict, list[int]]:
    """Read reports until every rank answered, one failed (plus a grace), or time ran out."""
    done, errors, dead_since = {}, {}, {}
    deadline = time.monotonic() + timeout
    while len(done) + len(errors) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in done or r in errors or p.is_alive():
                    continue
                # A rank that exits right after reporting may still have its report in the
                # pipe: call it dead only after a second without one.
                if now - dead_since.setdefault(r, now) > 1.0:
                    errors[r] = (f"process exited with code {p.exitcode} without reporting "
                                 "(killed, crashed, or called os._exit)")
                    deadline = min(deadline, now + ERROR_GRACE_S)
            continue
        if ok:
            done[rank] = payload
        else:
            errors[rank] = payload
            deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
    unfinished = [r for r in range(len(procs)) if r not in done and r not in errors]
    return done, errors, unfinished


def _stacks(procs: list, ranks: list[int], stack_dir: str) -> str:
    """Ask hung ranks for their Python stacks (faulthandler on SIGUSR1) and read them."""
    if not hasattr(signal, "SIGUSR1"):
        return ""
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)
    out = []
    for r in ranks:
        text = (Path(stack_dir) / f"rank{r}.txt").read_text(errors="replace").strip()
        out.append(f"--- rank {r} stack:\n{text or '(none written)'}")
    return "\n".join(out)


def _stop(procs: list, hung: list[int]) -> None:
    """Kill ranks that never reported; give the others a moment to exit, then kill them too."""
    for r in hung:
        procs[r].kill()
    deadline = time.monotonic() + 10.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def _run_checks(rank: int, world_size: int, checks: list[tuple[Callable, tuple]]) -> list:
    """Run each check in turn on this rank; a barrier between checks keeps them apart."""
    import torch.distributed as dist

    out = []
    for fn, args in checks:
        try:
            out.append(fn(rank, world_size, *args))
        except BaseException as e:
            raise AssertionError(f"check {fn.__name__} failed on rank {rank}") from e
        dist.barrier()
    return out


def run_checks(world_size: int, checks: list, timeout: float = 180.0,
               hash_seeds: tuple[int, ...] = ()) -> list[list]:
    """Several checks in one launch: ``checks`` holds functions or (function, args) pairs.

    Returns one list of per-rank results per check, in the order given.
    """
    norm = [(c, ()) if callable(c) else (c[0], tuple(c[1])) for c in checks]
    per_rank = run_distributed(_run_checks, world_size, norm, timeout=timeout,
                               hash_seeds=hash_seeds)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(norm))]


def train_runs(rank: int, world: int, overrides: Callable, root: Path, runs: list,
               task: Callable | None = None) -> bool:
    """A ``run_distributed`` body: on this rank, train each ``(name, extra)`` of ``runs``
    under torchrun-style ``Distributed`` in the shared group, into ``root / name``, with the
    config overrides ``overrides(out, **extra)`` (e.g. a ``functools.partial`` of
    ``conftest.tiny_overrides``) and the task ``task()`` (pre-training when None)."""
    from threefold.config import load_config
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    for name, extra in runs:
        cfg = load_config(None, overrides(Path(root) / name, **extra))
        train(cfg, Distributed(cfg), task=task() if task else None)
    return True


def local_object_collectives(dist) -> None:
    """For one rank of a big job on torch's fake process group, which moves no bytes, so that
    pickled objects cannot cross it: replace ``dist``'s object collectives so that every rank
    is answered with its own object (all ranks of such a run see the same files)."""
    def broadcast_object_list(objects, src=None, group=None, **_kw):
        return None

    def all_gather_object(out, obj, group=None):
        out[:] = [obj] * len(out)

    def gather_object(obj, out=None, dst=0, group=None, **_kw):
        if out is not None:
            out[:] = [obj] * len(out)

    dist.broadcast_object_list = broadcast_object_list
    dist.all_gather_object = all_gather_object
    dist.gather_object = gather_object
