"""Replica groups that fail and heal without restarting the others (torchft).

The job is ``ft.replica_groups`` replica groups, each started by its own launcher (torchrun
with ``--max-restarts``) with threefold's normal layout inside; a torchft Lighthouse (``python3
-m threefold.parallel.ft_replicas``, or one already running) forms a quorum of the live groups
at every step. This is HSDP's replicate axis made elastic: rank r of every group sums its
gradients with rank r of the others through torchft's ``Manager`` over torchft's
reconfigurable gloo group.

What torchft does: the Lighthouse's quorum (which groups train this step, and which must
heal), the Manager's gloo group rebuilt on each new quorum under a new store prefix, the
fault-tolerant all-reduce (a failed peer turns into an error, not a hang), ``should_commit``
(every group agrees whether the step's gradients are whole), and the heal: a group behind the
quorum's step fetches a live group's state from its memory over torchft's checkpoint
transport (HTTP), no storage read.

What threefold does (here): the step's batch is this group's share of the global batch
(``dp_rank``/``dp_size`` span every group); the token count, the logged sums and the
gradients are summed over the quorum, so a step trains on exactly the participants' rows; a
step whose commit fails is run again on the same batch after a new quorum; the state a
rank heals with is the same rank's of a live group (its trained tensors or ZeRO shards, their
AdamW moments and step; every group has one layout) plus the step, which also fixes the
sampler (a pure function of the step). Gradients are summed rank to rank likewise: each
rank's local gradients (ZeRO: its reduced shards) after the group's own reduction. The bytes of the cross-group all-reduces are
counted per step under the axes "replica" (gradients; the step's closed form is
``threefold.accounting.replica_gradient_bytes``) and "replica_log" (counts and logged sums),
and the state a group serves to heal another under "replica_heal".
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch

from threefold.accounting import ring_all_reduce_bytes
from threefold.comm import faults
from threefold.parallel.engines.engine import LocalEngine
from threefold.parallel.engines.rank_state import (load_rank_state, rank_digest,
                                                   rank_gradients, rank_state)
from threefold.parallel.engines.zero import ZeroEngine

MAX_ATTEMPTS = 50  # failed commits of one step before the run gives up
START_WAIT_S = 60.0  # how long a fresh job's first step waits for every replica group


def _state_bytes(state) -> int:
    """Bytes of the tensors in a (nested) state dict."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    return 0


def _make_manager(cfg, rank: int, world_size: int, state, load, counted: dict):
    """torchft's Manager for this rank of the group: a synchronous quorum at each step start
    (a heal is applied before the step's forward), its gloo group, the HTTP checkpoint
    transport with the bytes it serves counted."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every step at info
    # a warning at every quorum that NCCL's flight recorder (absent on gloo) was not reset
    logging.getLogger("torchft.manager").addFilter(
        lambda record: "flight recorder" not in record.getMessage())
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing import HTTPTransport

    class CountedTransport(HTTPTransport):
        def send_checkpoint(self, dst_ranks, step, state_dict, timeout):
            counted["replica_heal"] += _state_bytes(state_dict) * len(dst_ranks)
            return super().send_checkpoint(dst_ranks, step, state_dict, timeout)

    t = timedelta(seconds=cfg.ft.timeout_s)
    store = {}
    if "MASTER_PORT" not in os.environ:  # not under torchrun: a store of this group's own
        from torch.distributed import TCPStore

        server = TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
        store = {"store_addr": socket.gethostname(), "store_port": server.port,
                 "_server": server}
    server = store.pop("_server", None)
    pg = ProcessGroupGloo(timeout=t)
    manager = Manager(pg=pg, load_state_dict=load, state_dict=state,
                      min_replica_size=cfg.ft.min_replicas, use_async_quorum=False, timeout=t,
                      quorum_timeout=max(t, timedelta(seconds=60)), connect_timeout=t,
                      rank=rank, world_size=world_size, lighthouse_addr=cfg.ft.lighthouse,
                      replica_id=f"threefold_{cfg.ft.replica_group}", init_sync=False,
                      checkpoint_transport=CountedTransport(timeout=t, num_chunks=0), **store)
    return manager, pg, server


class ReplicaWorld:
    """The layout of one rank of a replica group: the group's own layout (``inner``, every
    name not defined here is its), with the batch split over every group and the sums the
    step needs taken over the quorum too."""

    def __init__(self, inner, cfg):
        self._inner, self._cfg = inner, cfg
        self.manager = None
        self.engine: ReplicaEngine | None = None
        self._sent = {"replica": 0, "replica_log": 0, "replica_heal": 0}
        self._participants, self._attempts, self._ready = 0, 0, False
        self._events: dict = {}
        self._steps: list[dict] = []  # each step's cross-group bytes, for the summary

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def dp_rank(self) -> int:
        return self._cfg.ft.replica_group * self._inner.dp_size + self._inner.dp_rank

    @property
    def dp_size(self) -> int:
        return self._cfg.ft.replica_groups * self._inner.dp_size

    # ------------------------------------------------------------- joining, the step
    def join(self, run, start: int) -> int:
        """After the group's own resume (``start``: its step): the Manager, the engine's
        commits through it, and the first quorum, which heals this group from a live one's
        memory when it is behind (at step 0, repeated until every group is in it). Returns
        the step the loop starts at."""
        if not isinstance(run.engine, (LocalEngine, ZeroEngine)):
            raise RuntimeError("ft.lighthouse: replica groups need a data-parallel or ZeRO "
                               "engine in each group")
        self.engine = ReplicaEngine(run.engine, self)
        self.manager, self._pg, self._store = _make_manager(
            self._cfg, self._inner.rank, self._inner.world_size, self.engine.state,
            self.engine.load, self._sent)
        if start:
            self.manager.load_state_dict({"step": start, "batches_committed": 0})
        run.engine = self.engine
        self._quorum()
        # a fresh job starts with every group (else whichever started first trains alone
        # until the others heal from it); a group that comes back later finds the others
        # there, and one that never comes is waited for START_WAIT_S at most
        deadline = time.monotonic() + START_WAIT_S
        while self.manager.current_step() == 0 and time.monotonic() < deadline \
                and self._participants < self._cfg.ft.replica_groups:
            time.sleep(0.1)
            self._quorum()
        return self.manager.current_step()

    def _quorum(self) -> None:
        """A new quorum (synchronous: a heal is applied before it returns). The weights'
        digest is kept for the log whenever the participants change: a healed group's equals
        the groups' it joined, and the digest of the group that served it (kept whenever this
        group served a heal)."""
        before, served = self.manager.current_step(), self._sent["replica_heal"]
        self.manager.start_quorum()
        now, n = self.manager.current_step(), self.manager.num_participants()
        if now != before:
            self._events["ft_healed_from_step"] = before
            if self._inner.is_writer:
                print(f"threefold: replica group {self._cfg.ft.replica_group} healed at step "
                      f"{now} from a live group's memory (torchft; it was at step {before})",
                      flush=True)
        if n != self._participants or self._sent["replica_heal"] != served:
            self._events["ft_weights_sha256"] = self.engine.digest()
        self._participants, self._ready = n, True

    def run_step(self, step: int, fn):
        """``fn()`` (the step) after a quorum, again after a new quorum on the same batch
        until every participant commits it."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            if not self._ready:
                self._quorum()
            self._ready = False
            if self.manager.current_step() != step:
                raise RuntimeError(f"replica group at step {self.manager.current_step()}, the "
                                   f"loop at {step}")
            out = fn()
            if self.engine.committed:
                self._attempts = attempt
                return out
        raise RuntimeError(f"step {step + 1}: no commit in {MAX_ATTEMPTS} quorums")

    def reduce(self, tensors: list[torch.Tensor], axis: str) -> None:
        """Sum ``tensors`` in place over the quorum (one torchft all-reduce each, waited);
        an error is the Manager's (the step will not commit), never raised here."""
        n, index = self.manager.num_participants(), self.manager.participating_rank() or 0
        works = [self.manager.allreduce(t, reduce_op=torch.distributed.ReduceOp.SUM)
                 for t in tensors]
        for w in works:
            w.wait()
        self._sent[axis] += sum(ring_all_reduce_bytes(t.numel(), t.element_size(), n, index)
                                for t in tensors)

    def _sum_float(self, x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64)
        self.reduce([t], "replica_log")
        return float(t[0])

    # ------------------------------------------------------------- the world's sums
    def global_token_count(self, local_count: int) -> int:
        return round(self._sum_float(self._inner.global_token_count(local_count)))

    def sum_over_dp(self, value: torch.Tensor) -> float:
        return self._sum_float(self._inner.sum_over_dp(value))

    def sum_logged(self, v: torch.Tensor, over_stages: bool = False) -> torch.Tensor:
        v = self._inner.sum_logged(v, over_stages)
        self.reduce([v], "replica_log")
        return v

    def before_step(self, step: int) -> None:
        self._inner.before_step(step)
        if self._inner.comm is None:  # one process per group: the faults are fired here
            faults.at_step(self._inner.rank, step)

    def step_metrics(self, count: bool = True) -> dict:
        """The group's own, with the cross-group bytes among ``comm_bytes``, the quorum's
        size, the attempts the step took, this process's id, the wall clock at the step's
        end; the weights' digest and the heal on the steps where they happened."""
        out = self._inner.step_metrics(count)
        sent = dict(self._sent)  # zeroed in place: the transport counts into the same dict
        self._sent.update(dict.fromkeys(sent, 0))
        if not count:
            return out
        self._steps.append(sent)
        events, self._events = self._events, {}
        return {**out, "comm_bytes": {**out.get("comm_bytes", {}), **sent},
                "ft_participants": self._participants, "ft_attempts": self._attempts,
                "pid": os.getpid(), "time": time.time(), **events}

    def summary_metrics(self) -> dict:
        """The group's own, with the cross-group axes' mean bytes per step among
        ``comm_bytes_per_step``."""
        out = self._inner.summary_metrics()
        steps = self._steps or [{}]
        mean = {a: sum(s.get(a, 0) for s in steps) / len(steps) for a in self._sent}
        return {**out, "comm_bytes_per_step": {**out.get("comm_bytes_per_step", {}), **mean}}

    def describe(self) -> str:
        f = self._cfg.ft
        return (f"{self._inner.describe()}; replica group {f.replica_group} of "
                f"{f.replica_groups} (torchft)")

    def close(self) -> None:
        """Stop the Manager's servers, then drop the gloo group now (its threads are joined
        while the interpreter is whole, as ``threefold.comm.distributed.shutdown`` does for
        threefold's own groups), then the group's own layout."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self._pg.shutdown()
            self.manager = self._pg = self._store = None
        self._inner.close()


class ReplicaEngine:
    """The group's engine (every name not defined here is its) with the gradients summed
    over the quorum after its own reduction, and the optimiser step taken only when every
    participant commits (``committed``); otherwise the gradients are zeroed for the retry.
    The sum and the heal go rank to rank on what the rank holds
    (``threefold.parallel.engines.rank_state``: whole local tensors, or ZeRO's shards)."""

    def __init__(self, inner, world: ReplicaWorld):
        self._inner, self._world = inner, world
        self.committed = False

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def finish_gradients(self) -> None:
        self._inner.finish_gradients()
        self._world.reduce(rank_gradients(self._inner), "replica")

    def step(self, lr: float) -> None:
        self.committed = self._world.manager.should_commit()
        if self.committed:
            self._inner.step(lr)
        else:
            with torch.no_grad():
                for g in rank_gradients(self._inner):
                    g.zero_()

    # the state a group heals with: this rank's (its step is the Manager's)
    def state(self) -> dict:
        return rank_state(self._inner)

    def load(self, state: dict) -> None:
        load_rank_state(self._inner, state)

    def digest(self) -> str:
        """SHA-256 of this rank's trained tensors' bytes."""
        return rank_digest(self._inner)


class QuorumRows:
    """A sampler of one process that replays a replica-group run: at each step the rows of
    the groups that trained it (``groups[step]``, 0-based: every group's, or one group's
    share), as ``local_batch(step, g, groups)`` gave them. What a run that healed trained on,
    for the losses and weights a single process must reproduce."""

    def __init__(self, sampler, groups: dict[int, set[int]], replica_groups: int = 2):
        self.sampler, self.groups, self.n = sampler, groups, replica_groups

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def local_batch(self, step, dp_rank, dp_size):
        which = self.groups[step]
        if len(which) == self.n:
            return self.sampler.local_batch(step, 0, 1)
        if len(which) != 1:  # several but not all: their shares are not one row range
            raise ValueError(f"step {step + 1}: groups {sorted(which)} of {self.n}")
        return self.sampler.local_batch(step, next(iter(which)), self.n)


def main(argv: list[str] | None = None) -> int:
    """A torchft Lighthouse for the replica groups, until SIGTERM or SIGINT; its address
    (give it as ``--ft.lighthouse``) is the first line printed."""
    ap = argparse.ArgumentParser(prog="python3 -m threefold.parallel.ft_replicas")
    ap.add_argument("--port", type=int, default=29510, help="0: any free port")
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--join-timeout-ms", type=int, default=1000,
                    help="how long a quorum waits for heartbeating groups to ask for it")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=1000,
                    help="silence after which a group is taken as gone")
    a = ap.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # else a line per quorum, several per step
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind=f"[::]:{a.port}", min_replicas=a.min_replicas,
                          join_timeout_ms=a.join_timeout_ms, quorum_tick_ms=50,
                          heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    print(f"threefold: torchft Lighthouse at {lh.address()}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    lh.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
