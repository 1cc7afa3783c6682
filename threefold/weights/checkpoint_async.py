"""Checkpoints written while training goes on (``checkpoint.async_save``).

A collective save (``threefold.weights.checkpoint.save_sharded``) is three parts: preparing the
temporary directory (collective), each rank writing its own files (no collective), and the
commit (collective: node parts, rename, index, prune). ``AsyncSaver`` runs the middle part on
a background thread, one per rank: at the save point the main thread prepares the directory
and copies what the rank writes to host memory, so the step after it may update the
parameters and the optimiser's moments in place while the copy is written; the writer also
takes its files' SHA-256 (which a synchronous save's node leader reads the files again for);
at the commit point the main thread waits for its writer and runs the commit's collectives,
the writers' digests and errors gathered in one all-gather.

When the commit happens is the caller's to fix from the step count alone, the same on every
rank (the training loop commits at the end of the step after the save, before another save,
before a preemption's save and at the end of the run), so every rank issues the same
collectives in the same order however fast its disk is. A writer never issues a collective:
the control channel is the main thread's.

A writer that fails (a full disk, a damaged file system) does not commit: at the commit point
every rank learns, by one all-gather, whether any writer failed, and every rank raises the
same ``CheckpointError`` naming the failed ranks, so nobody waits in a barrier for a rank that
has given up. The half-written ``.tmp-<step>`` directory has no index and is never listed; a
process killed while its writer runs leaves the same. The previous checkpoint stays the newest
committed one.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import torch

from threefold.weights.checkpoint_verify import CheckpointError, NodeGroup, Piece
from threefold.weights.checkpoint import finish_save, prepare_save, rank_digests, write_rank


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory that training cannot change: a new CPU tensor even when
    ``t`` already is one (the optimiser updates the parameters and moments in place), pinned
    for a GPU tensor so that its copy is a DMA the caller synchronises once."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def snapshot(pieces: list[Piece], rank_tensors: dict[str, torch.Tensor]
             ) -> tuple[list[Piece], dict[str, torch.Tensor], int]:
    """Host copies of a rank's pieces and per-rank tensors, and their bytes."""
    copied = [dataclasses.replace(p, data=host_copy(p.data)) for p in pieces]
    extra = {k: host_copy(t) for k, t in rank_tensors.items()}
    if torch.cuda.is_available() and any(p.data.is_cuda for p in pieces):
        torch.cuda.synchronize()  # the pinned copies are complete before the step goes on
    nbytes = sum(p.data.nbytes for p in copied) + sum(t.nbytes for t in extra.values())
    return copied, extra, nbytes


@dataclasses.dataclass
class _Pending:
    """One save whose files are being written: what its commit needs."""

    root: Path
    step: int
    rank: int
    world: int
    owner: bool
    keep_last: int
    group: NodeGroup
    thread: threading.Thread | None = None
    error: BaseException | None = None
    digests: dict | None = None  # this rank's files' sizes and SHA-256, taken by the writer


class AsyncSaver:
    """One rank's background checkpoint writer: at most one save in flight.

    ``start`` (collective) begins a save and returns at once; ``finish`` (collective) waits
    for it and commits it. ``copy_bytes`` is the largest host copy taken, the extra host
    memory a save holds while in flight."""

    def __init__(self) -> None:
        self._pending: _Pending | None = None
        self.copy_bytes = 0

    @property
    def pending_step(self) -> int | None:
        """The step of the save in flight (started, not yet committed), or None."""
        return self._pending.step if self._pending else None

    def start(self, root: Path, step: int, rank: int, world: int, pieces: list[Piece],
              rank_tensors: dict[str, torch.Tensor], state: dict[str, Any] | None,
              keep_last: int, group: NodeGroup) -> None:
        """Collective: prepare checkpoint ``step``'s directory, copy this rank's share to host
        memory and start writing it in the background. A save in flight must have been
        finished first (the caller's commit points guarantee it)."""
        if self._pending is not None:
            raise RuntimeError(f"checkpoint {self._pending.step} is still in flight; finish "
                               f"it before starting checkpoint {step}")
        tmp, owner = prepare_save(root, step, rank, group)
        copied, extra, nbytes = snapshot(pieces, rank_tensors)
        self.copy_bytes = max(self.copy_bytes, nbytes)
        pending = _Pending(root, step, rank, world, owner, keep_last, group)

        def write() -> None:
            try:
                write_rank(tmp, step, rank, copied, extra, state)
                pending.digests = rank_digests(tmp, rank)  # off the main thread too
            except BaseException as e:  # handed to the main thread at the commit
                pending.error = e
            finally:
                copied.clear()  # the host copy is released with the write, not at the commit
                extra.clear()

        # daemon: a run that fails elsewhere must not hang at exit on a write nobody commits
        pending.thread = threading.Thread(target=write, name=f"threefold-save-{step}",
                                          daemon=True)
        self._pending = pending
        pending.thread.start()

    def finish(self) -> tuple[int, float | None] | None:
        """Collective: wait for the save in flight, then commit it (every rank, at the same
        point). Returns (its step, seconds this rank waited for its writer, None when the
        writer had already finished), or None when no save was in flight. Raises
        ``CheckpointError`` on every rank if any rank's writer failed."""
        p = self._pending
        if p is None:
            return None
        self._pending = None
        t0, in_flight = time.perf_counter(), p.thread.is_alive()
        p.thread.join()
        waited = time.perf_counter() - t0 if in_flight else None
        mine = (None if p.error is None else f"{type(p.error).__name__}: {p.error}", p.digests)
        gathered = p.group.all_gather(mine)
        bad = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
        if bad:
            raise CheckpointError(
                f"checkpoint {p.step}: the background write failed on "
                + "; ".join(f"rank {r} ({e})" for r, e in bad)
                + "; it was not committed, the previous checkpoint stays the newest") \
                from p.error
        finish_save(p.root, p.step, p.rank, p.world, p.owner, p.keep_last, p.group,
                    digests={r: d for r, (_, d) in enumerate(gathered)})
        return p.step, waited
