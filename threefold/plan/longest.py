"""The longest sequence a model fits on a cluster, for each context-parallel split (``threefold
plan --max-seq-len``): the long-context user's first question.

For each split — cp degree, algorithm (every name in ``CP_ALGORITHMS``; the bytes each
moves are ``threefold.accounting.cp_bytes_per_attention``'s, so an algorithm added there is
planned here too) and, where the runtime has Ulysses, each hybrid's Ulysses degree
(``search.cp_splits``) — a binary search over the sequence length, in steps of ``granule`` tokens,
for the longest at which some layout of the rest (tp, pp, vpp, ZeRO, recompute, offload as
``space`` allows; micro-batches of one sequence) fits in memory, at its step and at
start-up. Memory grows with the length for every layout, so "some layout fits" is monotone
and the bisection exact to the granule. The search runs the memory model only (about 0.1 ms
a layout); the fastest layout at the longest length is then predicted in full, for its time
per token.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from threefold.config import ModelConfig
from threefold.layout import Layout, Workload
from threefold.plan.candidates import Candidate, SearchSpace
from threefold.plan.cluster import Cluster
from threefold.plan.memory import memory_per_rank
from threefold.plan.search import cp_splits, enumerate_layouts, search
from threefold.plan.startup import startup_peaks
from threefold.plan.states import RUNTIME_OVERHEAD_BYTES

MAX_SEQ_LEN = 1 << 24  # 16M tokens: the bisection's ceiling


class Longest(NamedTuple):
    """One split's answer: the longest ``seq_len`` (0: not even one granule fits), the
    sequences per step there (``batch``) and the fastest layout (None when nothing fits)."""

    cp: int
    algorithm: str
    ulysses: int  # a hybrid's all-to-all degree inside cp (1: the algorithm alone)
    seq_len: int
    batch: int
    best: Candidate | None

    @property
    def seconds_per_token(self) -> float:
        """The cluster's step time per token trained at that length (0 when nothing fits)."""
        if self.best is None:
            return 0.0
        return self.best.step.step_time_s / (self.batch * self.seq_len)


def _work(work: Workload, seq_len: int, batch_tokens: int) -> Workload:
    """``work`` at ``seq_len``: ``batch_tokens`` per step (at least one sequence); layouts
    whose data-parallel degree the batch does not divide are the rule book's to skip."""
    return dataclasses.replace(work, seq_len=seq_len, global_batch=max(1, batch_tokens // seq_len))


def _fits(cfg: ModelConfig, world: int, work: Workload, space: SearchSpace,
          limit: float) -> Layout | None:
    """A layout in ``space`` that fits in ``limit`` at ``work``'s length, or None."""
    for lay in enumerate_layouts(cfg, world, work, space):
        if memory_per_rank(cfg, lay, work, checked=True).total > limit:  # checked: enumerated
            continue
        if startup_peaks(cfg, lay, work, checked=True).startup + RUNTIME_OVERHEAD_BYTES <= limit:
            return lay
    return None


def longest_for(cfg: ModelConfig, cluster: Cluster, work: Workload, space: SearchSpace,
                cp: int, algorithm: str, batch_tokens: int, granule: int = 1024,
                limit: float | None = None, ulysses: int = 1) -> Longest:
    """The longest sequence, a multiple of ``granule`` (and of 2·cp), that some layout with
    this cp split (``ulysses`` > 1: a hybrid) fits, and the fastest layout there."""
    limit = cluster.hardware.memory_bytes if limit is None else limit
    step = granule * 2 * cp // _gcd(granule, 2 * cp)
    one = dataclasses.replace(space, cp=(cp,), cp_algorithm=(algorithm,),
                              cp_ulysses=(ulysses,), microbatch_size=(1,))
    world = cluster.num_gpus

    def ok(n: int) -> bool:
        return _fits(cfg, world, _work(work, n * step, batch_tokens), one, limit) \
            is not None

    if not ok(1):
        return Longest(cp, algorithm, ulysses, 0, 0, None)
    lo, hi = 1, 2
    while hi * step <= MAX_SEQ_LEN and ok(hi):  # double until it does not fit
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_SEQ_LEN // step + 1)
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    seq = lo * step
    at = _work(work, seq, batch_tokens)
    found = search(cfg, cluster, at, one, memory_limit=limit, keep=1)
    return Longest(cp, algorithm, ulysses, seq, at.global_batch,
                   found.ranked[0] if found.ranked else None)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def longest_sequences(cfg: ModelConfig, cluster: Cluster, work: Workload,
                      space: SearchSpace, batch_tokens: int, granule: int = 1024,
                      limit: float | None = None) -> list[Longest]:
    """``longest_for`` every split in ``space``: cp degrees (None: every divisor of the
    world; a mixture of experts only 1, as the runtime runs it) times the splits
    ``search.cp_splits`` gives at each (one row at cp = 1, where none is used)."""
    world = cluster.num_gpus
    experts = bool(cfg.num_local_experts)
    degrees = space.cp or [d for d in range(1, world + 1) if world % d == 0 and
                           (d == 1 or not experts)]
    rows = []
    for cp in degrees:
        for alg, hybrid in cp_splits(cp, space):
            rows.append(longest_for(cfg, cluster, work, space, cp, alg, batch_tokens,
                                    granule, limit, hybrid.get("cp_ulysses", 1)))
    return rows
