"""Process-group start-up and shut-down from torchrun's environment.

``init_distributed`` reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_RESTART_COUNT, chooses the backend at run time (NCCL for CUDA devices, with gloo
beside it for CPU tensors; gloo alone on CPU) and joins the default process group through a
store whose keys are prefixed per restart attempt. A world of one starts no process group.

Why the per-attempt prefix: when torchrun restarts workers, a second attempt that reuses the
first attempt's keys in the agent's store sees stale addresses; with two launchers this failed
every time, and prefixing the keys with the attempt number fixed it (3 of 3 runs passed). A
store of the workers' own (torchrun without the shared store, as an elastic launch runs it) is
new every attempt and takes no prefix: the nodes of one attempt may count different restarts.

This module holds no state: the process group is torch's, and everything above it reaches
groups through the mesh (``threefold.comm.mesh``) and the communication layer
(``threefold.comm.counted``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: rank, world, local rank, device and backend (None: no group)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    restart_count: int = 0

    @property
    def is_distributed(self) -> bool:
        """True when a process group was initialised."""
        return self.backend is not None


def pick_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto``: this local rank's GPU when CUDA is available, else the CPU."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got '{device}'")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but CUDA is not available")
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return default if value in (None, "") else int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


def _store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """A TCPStore client of torchrun's agent store, or (without an agent) hosted by rank 0."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set; launch with "
                           "torchrun (or `threefold train --nproc-per-node N`)")
    # torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT and says so with this
    # variable; without an agent, rank 0 serves it (as torch's env:// rendezvous does).
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(addr, int(port), world_size, is_master=(not agent and rank == 0),
                         timeout=timeout, wait_for_workers=False, multi_tenant=not agent)


def flight_recorder_env(trace_buf_size: int, dump_dir: str | os.PathLike) -> dict[str, str]:
    """The environment that turns on NCCL's flight recorder (the last ``trace_buf_size``
    collectives of each rank, dumped to ``dump_dir/rank<N>`` when a collective times out; read
    with ``python -m torch.distributed.flight_recorder.fr_trace``), as torchtitan's
    ``comm.trace_buf_size`` does. Variables the user set are kept. Read when the NCCL process
    group is created, so set before ``init_distributed``."""
    if trace_buf_size <= 0:
        return {}
    prefix = str(Path(dump_dir) / "rank")
    want = {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(trace_buf_size),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            # torch >= 2.6 reads the first name, older releases the second
            "TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}
    return {k: v for k, v in want.items() if k not in os.environ}


def init_distributed(timeout_s: float = 600.0, device: str = "auto", trace_buf_size: int = 0,
                     trace_dir: str | os.PathLike | None = None) -> DistEnv:
    """Join the default process group described by torchrun's environment.

    ``timeout_s`` bounds the store rendezvous and every collective until ``set_timeout``
    changes it. On CUDA, ``trace_buf_size`` > 0 turns on NCCL's flight recorder, dumping to
    ``trace_dir`` (``flight_recorder_env``). Calling it again once a group exists returns the
    same environment.
    """
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    restart = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    dev = pick_device(device, local_rank)
    if world <= 1:
        return DistEnv(0, 1, local_rank, dev, None, restart)
    if not 0 <= rank < world:
        raise RuntimeError(f"RANK={rank} is outside WORLD_SIZE={world}")
    # NCCL moves the CUDA tensors; gloo next to it serves CPU tensors (small metadata,
    # checkpoint headers) without a device round trip.
    backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world):
            raise RuntimeError("a process group already exists with a different rank/world")
        existing = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        return DistEnv(rank, world, local_rank, dev, existing, restart)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        if trace_dir is not None:
            os.environ.update(flight_recorder_env(trace_buf_size, trace_dir))
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
    timeout = timedelta(seconds=timeout_s)
    _import_before_the_group()
    # the agent's store outlives an attempt, so its keys are prefixed per attempt; without it
    # (an elastic launch) each round's rank 0 hosts a fresh store, on which a node that joins
    # a grown group (restart count 0, the survivors' higher) must meet the others' keys
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.PrefixStore(f"threefold/attempt{restart}" if agent else "threefold",
                             _store(rank, world, timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=dev if dev.type == "cuda" else None)
    return DistEnv(rank, world, local_rank, dev, _name(dev), restart)


def _import_before_the_group() -> None:
    """Import ``torch.distributed.nn.functional`` while no process group exists.

    Its functions take ``group=group.WORLD`` as default arguments (torch 2.13,
    torch/distributed/nn/functional.py: broadcast, gather, scatter, reduce, reduce_scatter,
    all_gather, _all_gather_base, all_to_all, all_to_all_single, all_reduce), evaluated at
    import. torch imports it lazily (the first meta-device ``normal_`` of a model build goes
    through torch._refs -> torch._dynamo -> torch.distributed.fsdp -> _shard ->
    sharded_tensor.reshard), so after ``init_process_group`` those ten defaults would hold the
    default group until the interpreter exits, and ``shutdown`` could not destroy it (see
    there). Imported first, the defaults are None, which every one of them reads as the
    default group. 13 ms."""
    import torch.distributed.nn.functional


def _name(dev: torch.device) -> str:
    """The backend that moves this device's tensors."""
    return "nccl" if dev.type == "cuda" else "gloo"


def c10d_store():
    """The default process group's store (the rendezvous store, prefixed per attempt)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def set_timeout(seconds: float, groups: Iterable | None = None) -> int:
    """Change the collective timeout of ``groups`` (default: every group of this process).

    torch 2.13 has no public call for this; ``distributed_c10d._set_pg_timeout`` (private,
    present in 2.13) sets it on gloo and NCCL backends for collectives issued afterwards. The
    use: a generous timeout for start-up and the first step, then a short one, so that a dead
    rank turns into an error within seconds. Returns how many groups were changed.
    """
    if not dist.is_initialized():
        return 0
    from torch.distributed import distributed_c10d as c10d

    if groups is None:
        groups = list(getattr(c10d._world, "pg_map", {}) or [dist.group.WORLD])
    count = 0
    for g in groups:
        g = dist.group.WORLD if g is None else g
        if g is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        wrapped = _debug_wrapped(g)
        if wrapped:  # TORCH_DISTRIBUTED_DEBUG=DETAIL: _set_pg_timeout sees only the wrapper
            for backend in wrapped:
                backend._set_default_timeout(timedelta(seconds=seconds))
        else:
            c10d._set_pg_timeout(timedelta(seconds=seconds), g)
        count += 1
    return count


def _debug_wrapped(group) -> list:
    """The gloo/NCCL backends inside ``group``'s debug wrappers (TORCH_DISTRIBUTED_DEBUG=DETAIL
    wraps each backend to check every collective's op and shapes); [] when unwrapped. The
    wrapper's own helper group, which runs those checks, keeps the timeout it was made with."""
    try:
        from torch._C._distributed_c10d import _ProcessGroupWrapper
    except ImportError:  # a build without gloo has no wrappers
        return []
    out = []
    for dev in group._device_types:
        backend = group._get_backend(dev)
        if isinstance(backend, _ProcessGroupWrapper):
            out.append(backend.wrapped_pg)
    return out


def shutdown(barrier_timeout_s: float | None = 60.0, comms: Iterable = (),
             meshes: Iterable = ()) -> None:
    """Barrier, destroy every process group, and let each backend's threads end while the
    interpreter is still whole; a no-op without a group.

    The barrier lets every rank finish its last collective before any rank tears its group
    down. Pass ``barrier_timeout_s=None`` to skip it (e.g. after an error on this rank, when
    peers may never reach it).

    ``comms`` and ``meshes``: the ``Comm``s and DeviceMeshes that hold this process's groups.
    ``destroy_process_group`` only forgets torch's own references: gloo's ``shutdown`` is
    Backend's empty default in torch 2.13 (torch/csrc/distributed/c10d/Backend.hpp,
    ``Backend::shutdown``; ProcessGroupGloo does not override it), so each group's worker
    threads ("pt_gloo_runloop") keep running until ``~ProcessGroupGloo`` joins them, when the
    last reference goes. A run's meshes and Comms stay referenced (the engines' hooks hold
    the Comm in cycles; torch itself held the default group, ``_import_before_the_group``),
    so without this that was at interpreter exit: a worker thread that
    frees its last collective's tensors there (``ProcessGroupGloo::runLoop`` drops a finished
    barrier, whose weak references to earlier works free a gather's Python-owned tensors)
    must take the GIL, and a thread that takes the GIL of a finalising interpreter is ended
    with ``pthread_exit``, whose unwinding through that noexcept destructor calls
    std::terminate: "terminate called without an active exception", SIGABRT, after a run
    that had finished. Dropping the last references here destroys each group now: torch's
    Python holder of a group releases the GIL while the destructor joins the threads, so
    they finish their work with the interpreter alive.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if barrier_timeout_s is not None:
            dist.barrier(timeout=timedelta(seconds=barrier_timeout_s))
    finally:
        dist.destroy_process_group()
        for comm in comms:
            comm.release_groups()
        for mesh in meshes:
            # torch 2.13 keeps every group of a mesh, its flattened ones included, in the
            # root mesh's private registry, which destroy_process_group leaves as it is
            # (other releases may have none)
            root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
            registry = getattr(root, "_pg_registry", None)
            if registry is not None:
                registry.clear()
