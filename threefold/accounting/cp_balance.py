"""Which tokens of a packed row each context-parallel rank holds, and the attention work that
gives it: pure functions of the documents' lengths, so the runtime, the planner's simulator
and the benchmarks compute the same schedule and the same figures (no torch).

Attention work of a rank = the sum over its query tokens of the keys each may see. Under a
plain causal mask the token at position p sees p + 1 keys; under packed documents
(``data.document_mask``) only the keys of its own document up to itself, o + 1 for the
token at offset o in its document.

Two schedules, both giving each of the N ranks exactly T/N tokens (T divisible by 2N):

- ``causal`` (``headtail_spans``): chunks i and 2N−1−i of 2N equal chunks of the whole row
  (Megatron's and the zig-zag ring's balance). Equal work under the causal mask; under
  packed documents a rank whose chunks fall in short documents does far less than one whose
  chunks end a long document.
- ``documents`` (``document_spans``): the same head-tail split applied to each document on
  its own (as Megatron does for variable-length "THD" batches, which it pads to 2N; here
  nothing is padded). A document of length L = 2N·q + r gives its last 2N·q tokens to the
  ranks in 2N chunks of q, chunks i and 2N−1−i to rank i: every rank the same 2q tokens and
  exactly the same work of that document. Its first r < 2N tokens (the cheapest: offsets
  below 2N) are pooled over the row and dealt out in serpentine order, most work first
  (0, 1, …, N−1, N−1, …, 0, …), which gives each rank the same number of them and work
  within 2N of each other. A row with one document is exactly the ``causal`` schedule.

Spans are (start, length) runs of positions, each rank's in increasing order.
"""

from __future__ import annotations

import bisect

Spans = list[tuple[int, int]]


def _check(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        raise ValueError(f"context parallel: sequence length {seq_len} is not divisible by "
                         f"2·cp = {2 * cp}")


def headtail_spans(seq_len: int, cp: int) -> list[Spans]:
    """Per rank, its two chunks of 2·cp equal chunks of the row: chunks r and 2·cp−1−r."""
    _check(seq_len, cp)
    c = seq_len // (2 * cp)
    return [[(r * c, c), ((2 * cp - 1 - r) * c, c)] for r in range(cp)]


def _merged(spans: Spans) -> Spans:
    """Sorted, with touching runs joined, empty ones dropped."""
    out: Spans = []
    for s, n in sorted(x for x in spans if x[1] > 0):
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return out


def document_spans(lengths: list[int], cp: int) -> list[Spans]:
    """Per rank, its runs of a row packed with documents of ``lengths`` (in order, summing to
    the row's length): each document head-tail split over the ranks, the documents'
    first (length mod 2·cp) tokens dealt out serpentine, most work first."""
    seq_len = sum(lengths)
    _check(seq_len, cp)
    spans: list[Spans] = [[] for _ in range(cp)]
    spare = []  # (work, position) of the tokens the documents' chunks leave over
    start = 0
    for length in lengths:
        q, r = divmod(length, 2 * cp)
        spare += [(o + 1, start + o) for o in range(r)]
        body = start + r
        for c in range(cp):
            spans[c] += [(body + c * q, q), (body + (2 * cp - 1 - c) * q, q)]
        start += length
    spare.sort(key=lambda wp: (-wp[0], wp[1]))
    for i, (_, pos) in enumerate(spare):
        lap, k = divmod(i, cp)
        spans[k if lap % 2 == 0 else cp - 1 - k].append((pos, 1))
    return [_merged(s) for s in spans]


def row_spans(lengths: list[int], cp: int, balance: str) -> list[Spans]:
    """The spans of ``balance`` (``documents`` or ``causal``: ``parallel.cp_balance``) for a
    row of these documents."""
    if balance == "documents":
        return document_spans(lengths, cp)
    return headtail_spans(sum(lengths), cp)


def _offset_sum(a: int, b: int) -> int:
    """Sum of (o + 1) for o in [a, b)."""
    return (b * (b + 1) - a * (a + 1)) // 2


def attention_work(lengths: list[int], spans: list[Spans]) -> list[int]:
    """Per rank, the keys its queries see under the document mask of ``lengths`` (a single
    length: the plain causal mask)."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    out = []
    for rank_spans in spans:
        work = 0
        for s, n in rank_spans:
            pos, end = s, s + n
            while pos < end:  # the run, cut at document boundaries
                d = bisect.bisect_right(starts, pos) - 1
                stop = min(end, starts[d + 1])
                work += _offset_sum(pos - starts[d], stop - starts[d])
                pos = stop
        out.append(work)
    return out


def imbalance(work: list[int]) -> float:
    """max/mean of the ranks' work (1.0 is perfect balance)."""
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0
