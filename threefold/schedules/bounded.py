"""Interleaved 1F1B with a bound on the activations in flight (``parallel.pipeline_inflight``):
memory traded against bubble, as Llama 3 does at scale (arXiv 2407.21783 §3.3.2), instead of
Megatron's fixed warm-up (2(p - r - 1) + (v - 1)p chunk forwards on rank r, whose peak is
p + (p - 1)/v microbatches of the rank's layers).

The order is built by list scheduling on a unit-time timeline (F = B = W = 1, messages free):
every rank, whenever it is idle, runs the next backward of Megatron's backward order if its
output gradient is there, else the next forward of Megatron's forward order if its input is
there and fewer than ``cap`` chunk activations are held; after a forward it prefers a
backward and after a backward a forward (1F1B's alternation). A backward runs as B, with its W
right after (one unit each): the upstream rank gets its gradient one unit sooner, and
``messages.place_by_gap``'s layout, made against the same unit timeline, is exact.

By Little's law a rank needs about v·p chunk activations in flight (one round trip of a
microbatch through the pipeline) to keep busy. At ``cap`` >= v·p the replayed bubble is
2(p - 1)/(3·v·m), two thirds of Megatron's (p - 1)/(v·m): B alone is on the critical path
back; below v·p it grows (``bubble_estimate``); below (v - 1)·p + 1 the first backward can
never start, which ``validate_inflight`` refuses.
Imports no torch.
"""

from __future__ import annotations

import functools

from threefold.schedules.actions import Action, ActionKind
from threefold.schedules.messages import Steps

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def min_inflight(p: int, v: int) -> int:
    """The smallest bound that can run: rank p - 1 must hold the (v - 1)·p forwards that come
    before microbatch 0's last chunk in Megatron's order, plus that one."""
    return (v - 1) * p + 1


def validate_inflight(name: str, p: int, v: int, inflight: int) -> None:
    """Refuse a bound that cannot run, naming the smallest that can."""
    if not isinstance(inflight, int) or isinstance(inflight, bool) or inflight < 0:
        raise ValueError(f"{name}: pipeline_inflight must be an integer >= 0, got {inflight!r}")
    if inflight and inflight < min_inflight(p, v):
        raise ValueError(f"{name}: pipeline_inflight={inflight} chunk activations cannot run "
                         f"with pp={p}, vpp={v}: the first backward needs at least "
                         f"(vpp-1)·pp + 1 = {min_inflight(p, v)}; raise it, or 0 for "
                         "Megatron's warm-up")


def bubble_estimate(p: int, m: int, v: int, inflight: int) -> float:
    """The bubble over the ideal time where the replay is too long to run (the planner's
    search above a few thousand actions): 2(p - 1)/(3·v·m) (exact at ``inflight`` >= v·p),
    plus, below a round trip's v·p chunks, (v·p - cap)/(2v·(cap - (v - 1)·p)), a fit to the
    replay (within a third of it on tests/test_schedules.py's grid, exact at several points):
    no formula is published for this schedule."""
    short = max(0, v * p - inflight) / (2 * v * (inflight - (v - 1) * p))
    return 2 * (p - 1) / (3 * v * m) + short


def _order(p: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """Megatron's (microbatch, chunk) order: groups of p microbatches per chunk, chunks
    forwards in order and backwards in reverse."""
    out = []
    for k in range(m * v):
        group = (k // p) % v
        out.append(((k // (p * v)) * p + k % p, v - 1 - group if backward else group))
    return out


@functools.lru_cache(maxsize=32)
def bounded_orders(p: int, m: int, v: int, cap: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's compute order (see the module doc)."""
    n, total = p * v, m * v
    fwd, bwd = _order(p, m, v, False), _order(p, m, v, True)
    nf, nb, held, free, last = [0] * p, [0] * p, [0] * p, [0] * p, [B] * p
    f_done: dict[tuple[int, int], int] = {}
    b_done: dict[tuple[int, int], int] = {}
    orders: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while any(k < total for k in nb):
        acted = False
        for r in range(p):
            if free[r] > t:
                continue
            ready = {}
            if nb[r] < total:
                mb, c = bwd[nb[r]]
                s = c * p + r
                if f_done.get((mb, s), t + 1) <= t and (s == n - 1 or
                                                         b_done.get((mb, s + 1), t + 1) <= t):
                    ready[B] = (mb, c, s)
            if nf[r] < total and held[r] < cap:
                mb, c = fwd[nf[r]]
                s = c * p + r
                if s == 0 or f_done.get((mb, s - 1), t + 1) <= t:
                    ready[F] = (mb, c, s)
            kind = next((k for k in ((B, F) if last[r] is F else (F, B)) if k in ready), None)
            if kind is None:
                continue
            mb, c, s = ready[kind]
            last[r], acted = kind, True
            if kind is F:
                nf[r], held[r], free[r] = nf[r] + 1, held[r] + 1, t + 1
                f_done[(mb, s)] = t + 1
                orders[r].append(Action(F, mb, c, s))
            else:
                nb[r], held[r], free[r] = nb[r] + 1, held[r] - 1, t + 2
                b_done[(mb, s)] = t + 1
                orders[r] += [Action(B, mb, c, s), Action(W, mb, c, s)]
        if not acted and all(f <= t for f in free):  # nothing runs, nothing will finish
            raise ValueError(f"pipeline_inflight={cap} cannot run with pp={p}, vpp={v}, "
                             f"microbatches={m}; raise it")
        t += 1
    return tuple(tuple(o) for o in orders)


@functools.lru_cache(maxsize=64)
def bounded_steps(cap: int):
    """A steps function (``messages.all_ranks``' first argument) for bound ``cap``; one per
    bound, so that ``all_ranks``' cache keys on it."""
    def steps(p: int, m: int, v: int, rank: int) -> Steps:
        return [[a] for a in bounded_orders(p, m, v, cap)[rank]]
    return steps
