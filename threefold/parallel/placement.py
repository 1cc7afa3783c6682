"""Where a parameter's values come from: one placement record per parameter.

Every parallelism that slices a weight says so here, and nowhere else: tensor parallelism
(which dimension is split over tp, this rank's index, the logical size before vocabulary
padding), expert parallelism (this rank's run of experts along dim 0) and the pipeline's tied
head (a copy of the embedding on the last stage). The engines (norms, gradient reduction),
checkpoints (where a piece sits in the logical tensor) and sharded start-up (which region of
the logical tensor to initialise or read, ``threefold.parallel.materialize``) all read the
same record through the accessors below, never through attributes of their own.

A parameter nobody sliced has the default record: whole, replicated, its own logical name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


_ATTR = "_threefold_placement"


@dataclass(frozen=True)
class Placement:
    """How this rank's tensor relates to the logical (whole, HF-named) one."""

    tp_dim: int | None = None     # dimension split over tp (None: whole on every tp rank)
    tp_full: int | None = None    # logical size along tp_dim (the vocabulary before padding)
    tp_index: int = 0             # this rank's slice along tp_dim
    tp_count: int = 1             # slices along tp_dim (each ceil(tp_full / tp_count) long)
    tp_grad_reduced: bool = False  # the gradient is summed over tp in backward (SP norms, k/v)
    ep_index: int = 0             # this rank's run of experts along dim 0 ...
    ep_count: int = 1             # ... out of ep_count equal runs (1: all experts)
    tied_replica: bool = False    # a pipeline's last-stage copy of the tied embedding
    source: str | None = None     # the logical tensor it is cut from, if not its own name

    @property
    def ep_sharded(self) -> bool:
        """Whether this rank holds only some of the experts (gradients over "edp")."""
        return self.ep_count > 1


def placement(p: torch.Tensor) -> Placement:
    """``p``'s placement record (the default: whole and replicated)."""
    return getattr(p, _ATTR, None) or Placement()


def place(p: torch.Tensor, **fields) -> Placement:
    """Update ``p``'s record with ``fields`` and return it."""
    rec = dataclasses.replace(placement(p), **fields)
    setattr(p, _ATTR, rec)
    return rec


def tp_shard_dim(p: torch.Tensor) -> int | None:
    """Which dimension of ``p`` tensor parallelism split (None: whole on every tp rank)."""
    return placement(p).tp_dim


def ep_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` holds only this rank's experts (its gradient is reduced over "edp")."""
    return placement(p).ep_sharded


def tied_replica(p: torch.Tensor) -> bool:
    """Whether ``p`` is a copy of a weight another pipeline stage owns (the tied head)."""
    return placement(p).tied_replica


def source_name(name: str, p: torch.Tensor) -> str:
    """The logical tensor ``p`` (named ``name`` in its model) is cut from."""
    return placement(p).source or name


def logical_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor ``p`` is this rank's part of (vocabulary unpadded)."""
    rec, shape = placement(p), list(p.shape)
    if rec.ep_count > 1:
        shape[0] *= rec.ep_count
    if rec.tp_dim is not None:
        shape[rec.tp_dim] = rec.tp_full
    return tuple(shape)


def logical_box(p: torch.Tensor, rows: tuple[int, int] | None = None
                ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(box in the logical tensor, box in ``p``) of the elements of ``p`` that exist in the
    logical tensor, for ``p``'s dim-0 positions ``rows`` (default all): padding past the
    logical end (the last vocabulary slice) is in neither. Boxes are [start, stop) per dim."""
    rec, shape = placement(p), list(p.shape)
    r0, r1 = rows if rows is not None else (0, shape[0] if shape else 1)
    if not shape:
        return [], []
    offsets = [0] * len(shape)
    if rec.ep_count > 1:
        offsets[0] = rec.ep_index * shape[0]
    full = list(logical_shape(p))
    if rec.tp_dim is not None:
        offsets[rec.tp_dim] = rec.tp_index * shape[rec.tp_dim]
    src, dst = [], []
    for d, n in enumerate(shape):
        lo, hi = (r0, r1) if d == 0 else (0, n)
        a, b = offsets[d] + lo, min(offsets[d] + hi, full[d])
        b = max(a, b)
        src.append((a, b))
        dst.append((lo, lo + b - a))
    return src, dst


def row_span(shape: tuple[int, ...], start: int, end: int) -> tuple[int, int]:
    """The dim-0 positions whose elements cover the flat range [start, end) of a tensor of
    ``shape`` (a ZeRO shard's slice of one parameter)."""
    if not shape:
        return 0, 1
    row = math.prod(shape[1:])
    return start // row, -(-end // row)
