"""A run's in-memory checkpoints (``checkpoint.memory_interval``): every N steps each rank's
shard goes into its node's memory directory through the background save's host copy, is
committed at the point ``checkpoint.async_save`` commits (the end of the next step, before the
next save, at the end of the run), and then replicated to the next node
(``threefold.weights.checkpoint_memory``). Storage checkpoints go on at ``checkpoint.interval``.

Host memory stays bounded: a node keeps the newest committed step (its own part and its
peer's). The step before it is removed once the newer one and its replica are both in place,
never earlier, so that some whole copy is in memory at every moment; the most a node holds is
two steps, while the newer one is written and sent. A fresh run clears what an earlier run
left in its memory directory; a run that ends with its final storage checkpoint gives the
memory back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from threefold.config import ConfigError
from threefold.weights.checkpoint import unwritable
from threefold.weights.checkpoint_async import AsyncSaver
from threefold.weights.checkpoint_memory import (REPLICA_AXIS, clear_memory, memory_root,
                                                 prune_below, replica_rings, send_replica)
from threefold.training.resume import node_group, save

if TYPE_CHECKING:  # annotations only
    from threefold.training.run import Run

KEEP = 2  # committed steps kept by the commit's own pruning; the older goes after the replica


class MemorySaves:
    """One rank's in-memory checkpoints. Collective to build (the replica axis is a new
    process group on a multi-node run) and at every call, at points fixed by the step count."""

    def __init__(self, run: Run, start: int):
        lay = run.world
        self.run = run
        self.group = node_group(lay)
        self.rank = lay.rank
        self.root = memory_root(run.cfg.checkpoint.memory_dir, run.out,
                                self.group.node_of[lay.rank])
        self.saver = AsyncSaver()
        self.comm = None
        rings = replica_rings(self.group.node_of)
        if rings is not None:
            lay.control.add_axis(REPLICA_AXIS, rings)
            self.comm = lay.control
        self.leader = self.group.is_leader(lay.rank)
        why = unwritable(self.root) if self.leader else None
        for node, bad in zip(self.group.node_of, self.group.all_gather(why)):
            if bad:  # said now, not at the first commit
                raise ConfigError(f"checkpoint.memory_dir: memory checkpoints of node {node} "
                                  f"cannot be written: {bad}")
        if start == 0 and self.leader:  # nothing of an earlier run is resumed from
            clear_memory(self.root)
        self.seconds = 0.0

    def after_step(self, step: int) -> None:
        """After 0-based ``step``, before its storage checkpoint (a kill while storage is
        written then finds the memory save in flight committed): commit the memory save in
        flight, then start this step's if one is due."""
        if self.saver.pending_step is not None:
            self._commit()
        every = self.run.cfg.checkpoint.memory_interval  # auto: a count once decided
        if isinstance(every, int) and every > 0 and (step + 1) % every == 0:
            t0 = time.perf_counter()
            save(self.run, step + 1, self.saver, root=self.root, keep_last=KEEP)
            self.seconds = time.perf_counter() - t0
            self.run.memory["memory_checkpoint_tensor_bytes"] = self.saver.copy_bytes

    def close(self, release: bool) -> None:
        """At the end of the run: commit the save in flight; with ``release`` (the final
        storage checkpoint is written) remove this node's memory checkpoints."""
        if self.saver.pending_step is not None:
            self._commit()
        if release:
            self.group.barrier()
            if self.leader:
                clear_memory(self.root)

    def _commit(self) -> None:
        """Commit the save in flight, send its replica, then drop the older step."""
        t0 = time.perf_counter()
        step, _ = self.saver.finish()
        mem = self.run.memory
        files = [f"rank{self.rank}.json", f"rank{self.rank}.safetensors"] + \
            (["state.json"] if self.rank == 0 else [])
        mem["memory_checkpoint_bytes"] = sum((self.root / str(step) / f).stat().st_size
                                             for f in files)
        if self.comm is not None:  # the sent bytes as the communication layer counts them
            before = self.comm.totals().get(REPLICA_AXIS, {}).get("all_to_all", 0)
            _, received = send_replica(self.comm, self.root, step, self.rank, self.group)
            mem["memory_replica_bytes_sent"] = \
                self.comm.totals()[REPLICA_AXIS]["all_to_all"] - before
            mem["memory_replica_bytes_received"] = received
        self.group.barrier()  # every copy of ``step`` is in place before the older goes
        if self.leader:
            prune_below(self.root, step)
        mem["memory_save_seconds"] = round(self.seconds + time.perf_counter() - t0, 6)
