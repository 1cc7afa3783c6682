"""What the accounting computes from a ``Layout`` and a ``Workload`` besides parameters:
tokens per rank, microbatches, overlapped tensor-parallel chunks. ``Layout`` and ``Workload``
are the one description of a run's layout (``threefold.layout``), and the rules a layout must
meet are the rule book's (``threefold.layout.rules``).
"""

from __future__ import annotations

from threefold.layout import Layout, Workload, rules


def overlap_chunks(local_tokens: int, wanted: int) -> int:
    """The chunks overlapped tensor parallelism (``parallel.tp_overlap``) cuts each collective
    into: the largest divisor of ``local_tokens`` (a rank's tokens of one sequence under
    sequence parallelism) not above ``wanted``; 1 = no overlap. Shapes decide it, the same on
    every rank."""
    top = max(1, min(wanted, local_tokens))
    return max(d for d in range(1, top + 1) if local_tokens % d == 0)


def tp_chunks(layout: Layout, work: Workload) -> int:
    """The chunks per sequence-parallel collective the runtime uses for ``layout`` and
    ``work`` (``overlap_chunks`` of a rank's seq_len / cp / tp tokens); 1 = not overlapped."""
    if not layout.sp or layout.tp_overlap < 2:
        return 1
    return overlap_chunks(local_seq_len(layout, work) // layout.tp, layout.tp_overlap)


def local_seq_len(layout: Layout, work: Workload) -> int:
    """Tokens of each sequence one rank holds: seq_len / cp."""
    return work.seq_len // layout.cp


def microbatches(layout: Layout, work: Workload) -> int:
    """Microbatches per step on each pipeline (gradient-accumulation steps without pp)."""
    per_replica, rem = divmod(work.global_batch, layout.dp * layout.microbatch_size)
    if rem or not per_replica:  # the rule book's refusal
        rules.batch_over_dp(work.global_batch, layout.dp)
        rules.micro_batch_divides(work.global_batch, layout.dp, layout.microbatch_size)
    return per_replica
