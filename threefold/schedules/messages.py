"""The communication layout of a schedule: where each rank's sends and receives go, given the
order of its compute actions (``place_by_step``: Megatron's lockstep batches; ``place_by_gap``:
against a unit-cost timeline, for split backward), and ``all_ranks``, every rank's full list.

Communication contract for the executor: each maximal run of consecutive SEND/RECV actions is
posted as one ``batch_isend_irecv`` and waited on before the next compute action. Messages
between a pair of ranks match in posting order (FIFO, like NCCL, and gloo with one tag), so the
k-th send from r to r' must be the k-th receive on r' from r. check.py replays every rank
together to prove the result.
"""

from __future__ import annotations

import bisect
import functools
import math
from typing import Callable

from threefold.schedules.actions import (
    Action,
    ActionKind,
    completes,
    message_key,
    needs,
    stage_rank,
)

Steps = list[list[Action]]  # one rank's compute actions, grouped into steps (see place_by_step)
_BACKWARD_INPUTS = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)  # make the input grad


def _recv_for(a: Action, rank: int, p: int, n: int, vshape: bool = False) -> Action | None:
    """The receive compute action ``a`` needs first, if its input is made on another rank."""
    s, mb = a.stage, a.microbatch
    if a.kind is ActionKind.FORWARD and s > 0 and (q := stage_rank(s - 1, p, vshape)) != rank:
        return Action(ActionKind.RECV_FORWARD, mb, a.chunk, s, q)
    if a.kind in _BACKWARD_INPUTS and s < n - 1 and (q := stage_rank(s + 1, p, vshape)) != rank:
        return Action(ActionKind.RECV_BACKWARD, mb, a.chunk, s, q)
    return None


def _send_for(a: Action, rank: int, p: int, n: int, vshape: bool = False) -> Action | None:
    """The send that carries ``a``'s output on, if the stage that needs it is on another rank."""
    s, mb = a.stage, a.microbatch
    if a.kind is ActionKind.FORWARD and s < n - 1 and (q := stage_rank(s + 1, p, vshape)) != rank:
        return Action(ActionKind.SEND_FORWARD, mb, a.chunk, s, q)
    if a.kind in _BACKWARD_INPUTS and s > 0 and (q := stage_rank(s - 1, p, vshape)) != rank:
        return Action(ActionKind.SEND_BACKWARD, mb, a.chunk, s, q)
    return None


def place_by_step(steps_all: list[Steps], p: int, n: int, vshape: bool = False
                  ) -> list[list[Action]]:
    """Megatron-LM's layout: after each step one batch holding the sends of what the step
    made and the receives the next step needs (send_forward_recv_backward and kin). With
    steps of one compute this is plain 1F1B; interleaved 1F1B's steady steps are an (F, B)
    pair, and its 2·(p-r-1) warm-up offset is what keeps neighbours' batches in lockstep."""
    lists = []
    for r, steps in enumerate(steps_all):
        acts = [x for a in steps[0] if (x := _recv_for(a, r, p, n, vshape))]
        for j, step in enumerate(steps):
            nxt = steps[j + 1] if j + 1 < len(steps) else []
            acts += step
            acts += [x for a in step if (x := _send_for(a, r, p, n, vshape))]
            acts += [x for a in nxt if (x := _recv_for(a, r, p, n, vshape))]
        lists.append(acts)
    return lists


def _unit_times(orders: list[list[Action]], n: int) -> list[list[tuple[int, int]]]:
    """(start, end) of every compute when each takes one time unit and messages arrive at
    once: the reference timeline place_by_gap lays messages out against."""
    done: dict[tuple[str, int, int], int] = {}
    times: list[list[tuple[int, int]]] = [[] for _ in orders]
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while len(times[r]) < len(order):
                deps = needs(order[len(times[r])], n)
                if any(d not in done for d in deps):
                    break
                start = max([times[r][-1][1] if times[r] else 0] + [done[d] for d in deps])
                times[r].append((start, start + 1))
                done[completes(order[len(times[r]) - 1])] = start + 1
                progress = True
    if any(len(t) < len(o) for t, o in zip(times, orders)):
        raise RuntimeError("internal error: a schedule's compute order waits on itself")
    return times


def place_by_gap(steps_all: list[Steps], p: int, n: int, vshape: bool = False
                 ) -> list[list[Action]]:
    """Layout against the unit-cost timeline, for split-backward schedules (where a lockstep
    pair would hold B's gradient back behind a W). A "gap" is the span between two computes
    of a rank. A receive goes in the gap right before its consumer; its send in the sender's
    first gap after the producer that overlaps the receiver's gap in time (one exists, as
    every compute is one unit long). So (1) at unit costs no rank waits longer than the
    reference timeline does, and (2) no positive costs can deadlock the lists: a rank blocked
    in a gap waits on a partner whose gap overlaps its own, so in a cycle of waiting ranks
    each gap would end strictly before the previous one ends. Messages of one channel are
    sorted by the partner's gap on both sides, keeping the FIFO order consistent."""
    orders = [[a for step in steps for a in step] for steps in steps_all]
    times = _unit_times(orders, n)
    where = {completes(a): (r, i) for r, acts in enumerate(orders) for i, a in enumerate(acts)}
    gaps = [[(t[j - 1][1] if j else 0, t[j][0] if j < len(t) else math.inf)
             for j in range(len(t) + 1)] for t in times]  # gaps[r][j]: just before compute j
    gap_ends = [[gap[1] for gap in g] for g in gaps]
    batches: list[list[list]] = [[[] for _ in g] for g in gaps]
    for r, order in enumerate(orders):
        for q, a in enumerate(order):
            recv = _recv_for(a, r, p, n, vshape)
            if recv is None:
                continue
            src, i = where[needs(a, n)[-1]]  # the remote input is always the last one
            lo, hi = gaps[r][q]
            g = bisect.bisect_left(gap_ends[src], lo, i + 1)
            if gaps[src][g][0] > hi:  # impossible with unit costs; guards a future edit
                raise RuntimeError("internal error: no overlapping gap for a message")
            send = _send_for(orders[src][i], src, p, n, vshape)
            batches[src][g].append(((0, r, q, message_key(send)), send))  # sends first
            batches[r][q].append(((1, src, g, message_key(recv)), recv))
    lists = []
    for order, rank_batches in zip(orders, batches):
        acts: list[Action] = []
        for j, batch in enumerate(rank_batches):
            acts += [x for _, x in sorted(batch, key=lambda kx: kx[0])] + order[j:j + 1]
        lists.append(acts)
    return lists


@functools.lru_cache(maxsize=32)
def all_ranks(steps_fn: Callable, place: Callable, p: int, m: int, v: int, n: int,
              vshape: bool = False):
    """Every rank's full list for one schedule and size, cached: each rank's list depends on
    the others' through the communication layout."""
    return tuple(tuple(x) for x in place([steps_fn(p, m, v, r) for r in range(p)], p, n, vshape))
