"""One kind of collective a rank issues, and the bytes each call sends as threefold's counted
communication layer (``threefold.comm.counted.Comm``) counts them: the unit every traffic figure of
the accounting is made of.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Collective:
    """One kind of collective a rank issues: ``count`` calls of ``op`` on a buffer of ``numel``
    elements of ``elem`` bytes over ``group`` ranks of mesh axis ``axis``; per microbatch when
    ``per_microbatch``. ``overlap`` says what may hide it: 'none' (on the critical path),
    'hidden' (overlapped entirely), 'forward'/'backward' (that microbatch's compute, except one
    bucket), 'last' (the last microbatch's backward, except one bucket), 'step' (after the
    step, exposed), 'attention-forward'/'attention-backward' (each call behind the compute of
    one ring-attention block, forward or backward), 'tp-chunks' (a sequence-parallel
    collective cut into chunks, each but one behind a neighbouring chunk's matmul:
    ``parallel.tp_overlap``)."""

    axis: str
    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | p2p
    numel: int
    elem: int
    count: int
    group: int
    per_microbatch: bool
    overlap: str

    @property
    def size(self) -> int:
        """Bytes of the buffer (all_gather: the gathered output, reduce_scatter: the input)."""
        return self.numel * self.elem

    def bytes_sent(self, index: int = 0) -> int:
        """Bytes the rank with coordinate ``index`` on the axis sends per call, exactly as
        ``threefold.comm.counted.Comm`` counts them."""
        n, numel = self.group, self.numel
        if self.op == "all_reduce":  # every chunk but its own, twice (tensor_split chunks)
            q, r = divmod(numel, n)
            return 2 * (numel - q - (1 if index < r else 0)) * self.elem
        if self.op in ("all_gather", "reduce_scatter", "all_to_all"):  # all_to_all: even split
            return (n - 1) * numel // n * self.elem
        return numel * self.elem  # p2p
