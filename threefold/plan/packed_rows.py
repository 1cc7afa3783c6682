"""How unevenly packed rows load the context-parallel ranks: a simulator of attention work
(``threefold.accounting.attention_work``) over rows packed from documents whose lengths are
drawn from stated distributions, split head-tail over the whole row (``causal``) or per
document (``documents``, ``parallel.cp_balance``). No data is read: the mixtures are
synthetic and seeded, so every figure can be reproduced.

Mixtures (lengths in tokens, drawn until the stream fills the rows; a document that does not
fit the rest of a row continues in the next one, as the sampler cuts its stream):

- ``chat``: log-normal turns, median 300 tokens, σ 1.0 (chat and instruction data: most turns
  a few hundred tokens, a few thousands).
- ``documents``: Pareto (α 1.1, from 200 tokens): long-tailed web and code documents, some
  as long as the row.
- ``mixed``: three chat turns for each long-tailed document.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from threefold.accounting import attention_work, imbalance, row_spans

MIXTURES = ("chat", "documents", "mixed")


def _draw(mixture: str, rng: random.Random) -> int:
    if mixture == "chat" or (mixture == "mixed" and rng.random() < 0.75):
        return max(1, round(rng.lognormvariate(5.704, 1.0)))  # ln 300 = 5.704
    return max(1, round(200 * rng.paretovariate(1.1)))


def packed_rows(mixture: str, seq_len: int, rows: int, seed: int = 0) -> list[list[int]]:
    """Document lengths of ``rows`` rows of ``seq_len`` tokens packed from ``mixture``."""
    if mixture not in MIXTURES:
        raise ValueError(f"unknown length mixture {mixture!r}; use one of {', '.join(MIXTURES)}")
    rng = random.Random(seed)
    out, row, left = [], [], 0  # left: tokens of the current document still to place
    while len(out) < rows:
        if left == 0:
            left = _draw(mixture, rng)
        take = min(left, seq_len - sum(row))
        row.append(take)
        left -= take
        if sum(row) == seq_len:
            out.append(row)
            row = []
    return out


class Imbalance(NamedTuple):
    """max/mean of the cp ranks' attention work per row: the mean over rows and the worst."""

    mean: float
    worst: float


def work_imbalance(rows: list[list[int]], cp: int, balance: str) -> Imbalance:
    """The imbalance of ``balance``'s split of these rows (document lengths) over ``cp`` ranks."""
    per_row = [imbalance(attention_work(r, row_spans(r, cp, balance))) for r in rows]
    return Imbalance(sum(per_row) / len(per_row), max(per_row))


def imbalance_table(seq_len: int, cps: tuple[int, ...], rows: int = 64, seed: int = 0
                    ) -> list[dict]:
    """One record per (mixture, cp): the imbalance before (``causal``) and after
    (``documents``)."""
    out = []
    for mixture in MIXTURES:
        packed = packed_rows(mixture, seq_len, rows, seed)
        docs = sum(len(r) for r in packed) / rows
        for cp in cps:
            before, after = (work_imbalance(packed, cp, b) for b in ("causal", "documents"))
            out.append({"mixture": mixture, "seq_len": seq_len, "cp": cp,
                        "docs_per_row": round(docs, 1), "before_mean": before.mean,
                        "before_worst": before.worst, "after_mean": after.mean,
                        "after_worst": after.worst})
    return out
