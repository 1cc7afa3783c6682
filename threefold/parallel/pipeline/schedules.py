"""Pipeline schedules as data: pure functions ``(p, m, v, rank) -> list[Action]``.

A schedule says, for one rank, in which order it runs forward (F), backward (B: input grad,
W: weight grad, or BW: both fused) and the point-to-point sends and receives that move
activations down the pipeline and gradients back up. The same lists drive the executor, the
checker (check.py), the simulator and the timeline picture (simulate.py, timeline.py).

Layout (Megatron's, Narayanan et al. 2021 §2.2.2): there are ``S = v·p`` virtual stages;
stage ``s`` lives on rank ``s % p`` as its model chunk ``s // p``. Without interleaving
(v = 1) stage and rank coincide.

Communication contract for the executor: each maximal run of consecutive SEND/RECV actions is
posted as one ``batch_isend_irecv`` and waited on before the next compute action. Messages
between a pair of ranks match in posting order (FIFO, like NCCL, and gloo with one tag), so the
k-th send from r to r' must be the k-th receive on r' from r. Two layouts place the messages
(``_place_by_step``: Megatron's lockstep batches; ``_place_by_gap``: against a unit-cost
timeline, for split backward); check.py replays every rank together to prove the result.

This module imports no torch: the planner uses it to predict bubbles cheaply.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
import math
from dataclasses import dataclass
from typing import Callable


class ActionKind(enum.Enum):
    """What an action does. BACKWARD is the full backward (input and weight grads fused)."""

    FORWARD = "F"
    BACKWARD_INPUT = "B"
    BACKWARD_WEIGHT = "W"
    BACKWARD = "BW"
    SEND_FORWARD = "SEND_F"  # send this stage's output activation to the next stage
    RECV_FORWARD = "RECV_F"  # receive this stage's input activation from the previous stage
    SEND_BACKWARD = "SEND_B"  # send the gradient of this stage's input to the previous stage
    RECV_BACKWARD = "RECV_B"  # receive the gradient of this stage's output from the next stage

    @property
    def is_compute(self) -> bool:
        """True for F, B, W and BW; False for sends and receives."""
        return self in COMPUTE_KINDS


COMPUTE_KINDS = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD_INPUT,
                           ActionKind.BACKWARD_WEIGHT, ActionKind.BACKWARD})
SENDS = frozenset({ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD})
RECEIVES = frozenset({ActionKind.RECV_FORWARD, ActionKind.RECV_BACKWARD})


@dataclass(frozen=True)
class Action:
    """One step of one rank's schedule.

    ``stage`` is the global virtual stage this action belongs to (for a send or receive: the
    local stage whose output is sent or whose input is received), ``chunk`` the model chunk
    index on this rank (``stage // p``), ``peer`` the other rank of a send or receive.
    """

    kind: ActionKind
    microbatch: int
    chunk: int
    stage: int
    peer: int | None = None

    def __str__(self) -> str:
        peer = f"->r{self.peer}" if self.kind in SENDS else f"<-r{self.peer}"
        tail = "" if self.peer is None else peer
        return f"{self.kind.value} mb{self.microbatch} s{self.stage}{tail}"

    @classmethod
    def parse(cls, text: str, p: int | None = None) -> "Action":
        """The action ``str(action)`` wrote (e.g. a trace record's name, "F mb3 s1" or
        "SEND_F mb0 s0->r1"); ``chunk`` is ``stage // p`` when ``p`` is given, else 0.
        Raises ValueError on anything else."""
        try:
            kind, mb, where = text.split()
            if not (mb.startswith("mb") and where.startswith("s")):
                raise ValueError
            stage, _, peer = where[1:].replace("<-", "->").partition("->")
            if peer and not peer.startswith("r"):
                raise ValueError
            a = cls(ActionKind(kind), int(mb[2:]), 0, int(stage),
                     int(peer[1:]) if peer else None)
        except (ValueError, IndexError):
            raise ValueError(f"not a pipeline action: {text!r}") from None
        return dataclasses.replace(a, chunk=a.stage // p) if p else a


def stage_rank(stage: int, p: int) -> int:
    """The rank that holds virtual stage ``stage`` (Megatron's interleaved layout)."""
    return stage % p


def message_key(action: Action) -> tuple[str, int, int, int]:
    """What a send or receive carries: (direction, microbatch, from stage, to stage).

    A send and the receive it pairs with have equal keys; that is how the checker matches them.
    """
    s, mb = action.stage, action.microbatch
    return {
        ActionKind.SEND_FORWARD: ("activation", mb, s, s + 1),
        ActionKind.RECV_FORWARD: ("activation", mb, s - 1, s),
        ActionKind.SEND_BACKWARD: ("gradient", mb, s, s - 1),
        ActionKind.RECV_BACKWARD: ("gradient", mb, s + 1, s),
    }[action.kind]


def completes(a: Action) -> tuple[str, int, int]:
    """What a compute action makes: ("F" | "B" | "W", microbatch, stage); BW makes B (and W).
    A send carries, and a receive brings, a "F" or "B" of the neighbouring stage."""
    tag = {ActionKind.FORWARD: "F", ActionKind.BACKWARD_WEIGHT: "W"}.get(a.kind, "B")
    return tag, a.microbatch, a.stage


def needs(a: Action, n: int) -> list[tuple[str, int, int]]:
    """What compute action ``a`` needs first (as ``completes`` keys), here or received:
    F the previous stage's F; B or BW its own F and the next stage's B; W its own B."""
    s, mb = a.stage, a.microbatch
    if a.kind is ActionKind.FORWARD:
        return [("F", mb, s - 1)] if s > 0 else []
    if a.kind is ActionKind.BACKWARD_WEIGHT:
        return [("B", mb, s)]
    return [("F", mb, s)] + ([("B", mb, s + 1)] if s < n - 1 else [])


def carries(a: Action) -> tuple[str, int, int]:
    """The ``completes`` key a send or receive moves between ranks."""
    direction, mb, src, _ = message_key(a)
    return ("F" if direction == "activation" else "B"), mb, src


def _validate(name: str, p: int, m: int, v: int, rank: int, interleaved: bool = False) -> None:
    """Refuse sizes a schedule cannot run, naming the fix."""
    for label, value in (("pp", p), ("microbatches", m), ("vpp", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be an integer >= 1, got {value!r}")
    if not 0 <= rank < p:
        raise ValueError(f"{name}: rank must be in [0, {p}), got {rank}")
    if v != 1 and not interleaved:
        raise ValueError(f"{name} runs one model chunk per rank: set vpp=1, or use "
                         f"interleaved-1f1b for vpp={v}")
    if interleaved and m % p != 0:
        lo, hi = (m // p) * p, (m // p + 1) * p
        fix = f"{lo} or {hi}" if lo else f"{hi}"
        raise ValueError(f"{name} needs microbatches to be a multiple of pp (got microbatches="
                         f"{m}, pp={p}): use microbatches={fix}, or schedule 1f1b")


# --------------------------------------------------------------------------------------------
# Communication layout: where each schedule's sends and receives go.
# --------------------------------------------------------------------------------------------

Steps = list[list[Action]]  # one rank's compute actions, grouped into steps (see _place_by_step)
_BACKWARD_INPUTS = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)  # make the input grad


def _recv_for(a: Action, rank: int, p: int, n: int) -> Action | None:
    """The receive compute action ``a`` needs first, if its input is made on another rank."""
    s, mb = a.stage, a.microbatch
    if a.kind is ActionKind.FORWARD and s > 0 and stage_rank(s - 1, p) != rank:
        return Action(ActionKind.RECV_FORWARD, mb, a.chunk, s, stage_rank(s - 1, p))
    if a.kind in _BACKWARD_INPUTS and s < n - 1 and stage_rank(s + 1, p) != rank:
        return Action(ActionKind.RECV_BACKWARD, mb, a.chunk, s, stage_rank(s + 1, p))
    return None


def _send_for(a: Action, rank: int, p: int, n: int) -> Action | None:
    """The send that carries ``a``'s output on, if the stage that needs it is on another rank."""
    s, mb = a.stage, a.microbatch
    if a.kind is ActionKind.FORWARD and s < n - 1 and stage_rank(s + 1, p) != rank:
        return Action(ActionKind.SEND_FORWARD, mb, a.chunk, s, stage_rank(s + 1, p))
    if a.kind in _BACKWARD_INPUTS and s > 0 and stage_rank(s - 1, p) != rank:
        return Action(ActionKind.SEND_BACKWARD, mb, a.chunk, s, stage_rank(s - 1, p))
    return None


def _place_by_step(steps_all: list[Steps], p: int, n: int) -> list[list[Action]]:
    """Megatron-LM's layout: after each step one batch holding the sends of what the step
    made and the receives the next step needs (send_forward_recv_backward and kin). With
    steps of one compute this is plain 1F1B; interleaved 1F1B's steady steps are an (F, B)
    pair, and its 2·(p-r-1) warm-up offset is what keeps neighbours' batches in lockstep."""
    lists = []
    for r, steps in enumerate(steps_all):
        acts = [x for a in steps[0] if (x := _recv_for(a, r, p, n))]
        for j, step in enumerate(steps):
            nxt = steps[j + 1] if j + 1 < len(steps) else []
            acts += step
            acts += [x for a in step if (x := _send_for(a, r, p, n))]
            acts += [x for a in nxt if (x := _recv_for(a, r, p, n))]
        lists.append(acts)
    return lists


def _unit_times(orders: list[list[Action]], n: int) -> list[list[tuple[int, int]]]:
    """(start, end) of every compute when each takes one time unit and messages arrive at
    once: the reference timeline _place_by_gap lays messages out against."""
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


def _place_by_gap(steps_all: list[Steps], p: int, n: int) -> list[list[Action]]:
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
            recv = _recv_for(a, r, p, n)
            if recv is None:
                continue
            src, i = where[needs(a, n)[-1]]  # the remote input is always the last one
            lo, hi = gaps[r][q]
            g = bisect.bisect_left(gap_ends[src], lo, i + 1)
            if gaps[src][g][0] > hi:  # impossible with unit costs; guards a future edit
                raise RuntimeError("internal error: no overlapping gap for a message")
            send = _send_for(orders[src][i], src, p, n)
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
def _all_ranks(steps_fn: Callable, place: Callable, p: int, m: int, v: int, n: int):
    """Every rank's full list for one schedule and size, cached: each rank's list depends on
    the others' through the communication layout."""
    return tuple(tuple(x) for x in place([steps_fn(p, m, v, r) for r in range(p)], p, n))


# --------------------------------------------------------------------------------------------
# The schedules: the compute order of each rank, in steps.
# --------------------------------------------------------------------------------------------


def _f(mb: int, rank: int, p: int, chunk: int = 0) -> Action:
    return Action(ActionKind.FORWARD, mb, chunk, chunk * p + rank)


def _b(kind: ActionKind, mb: int, rank: int, p: int, chunk: int = 0) -> Action:
    return Action(kind, mb, chunk, chunk * p + rank)


def _gpipe_steps(p: int, m: int, v: int, rank: int) -> Steps:
    return [[_f(i, rank, p)] for i in range(m)] + \
           [[_b(ActionKind.BACKWARD, i, rank, p)] for i in range(m)]


def _one_f_one_b_steps(p: int, m: int, v: int, rank: int) -> Steps:
    warmup = min(p - rank - 1, m)
    steps = [[_f(i, rank, p)] for i in range(warmup)]
    for i in range(m - warmup):
        steps += [[_f(warmup + i, rank, p)], [_b(ActionKind.BACKWARD, i, rank, p)]]
    return steps + [[_b(ActionKind.BACKWARD, i, rank, p)] for i in range(m - warmup, m)]


def _interleaved_steps(p: int, m: int, v: int, rank: int) -> Steps:
    def pick(k: int, backward: bool) -> tuple[int, int]:
        # The k-th (microbatch, chunk) this rank runs: groups of p microbatches per chunk,
        # chunks in order going forward and in reverse going backward.
        group = (k // p) % v
        return (k // (p * v)) * p + k % p, (v - 1 - group if backward else group)

    def fwd(k: int) -> Action:
        mb, c = pick(k, backward=False)
        return _f(mb, rank, p, c)

    def bwd(k: int) -> Action:
        mb, c = pick(k, backward=True)
        return _b(ActionKind.BACKWARD, mb, rank, p, c)

    total = m * v
    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    steps = [[fwd(k)] for k in range(warmup)]
    steps += [[fwd(warmup + k), bwd(k)] for k in range(total - warmup)]
    return steps + [[bwd(k)] for k in range(total - warmup, total)]


def _zb_h1_steps(p: int, m: int, v: int, rank: int) -> Steps:
    warmup = min(p - rank - 1, m)
    pending: list[int] = []  # microbatches whose W has not run yet, oldest first
    order = [_f(i, rank, p) for i in range(warmup)]

    def backward_input(i: int, lag: int) -> None:
        order.append(_b(ActionKind.BACKWARD_INPUT, i, rank, p))
        pending.append(i)
        if len(pending) > lag:
            order.append(_b(ActionKind.BACKWARD_WEIGHT, pending.pop(0), rank, p))

    for i in range(m - warmup):  # steady state: F, B and (once r are waiting) the oldest W
        order.append(_f(warmup + i, rank, p))
        backward_input(i, lag=rank)
    for i in range(m - warmup, m):  # cool-down: each B followed by a W while grads trickle in
        backward_input(i, lag=0)
    order += [_b(ActionKind.BACKWARD_WEIGHT, i, rank, p) for i in pending]
    return [[a] for a in order]


def gpipe(p: int, m: int, v: int, rank: int) -> list[Action]:
    """GPipe (Huang et al., arXiv 1811.06965): all m forwards, then all m backwards.
    Holds all m microbatches' activations at once."""
    _validate("gpipe", p, m, v, rank)
    return list(_all_ranks(_gpipe_steps, _place_by_step, p, m, v, p)[rank])


def one_f_one_b(p: int, m: int, v: int, rank: int) -> list[Action]:
    """1F1B (PipeDream-Flush; Narayanan et al., arXiv 2104.04473 §2.2.1): rank r runs
    p - r - 1 warm-up forwards, then alternates one forward and one backward, then drains
    the remaining backwards. At most p microbatches in flight (on rank 0). Any m >= 1 works:
    with m < p the warm-up is cut to m (torchtitan #775's hang when microbatches < stages
    cannot happen here: check.py replays every rank's list together before launch)."""
    _validate("1f1b", p, m, v, rank)
    return list(_all_ranks(_one_f_one_b_steps, _place_by_step, p, m, v, p)[rank])


def interleaved_1f1b(p: int, m: int, v: int, rank: int) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al., arXiv 2104.04473 §2.2.2): each rank holds v model
    chunks; microbatches go through the chunks in groups of p, which shrinks the bubble to
    (p-1)/(v·m) of the ideal time at v times the point-to-point traffic. Needs m % p == 0.
    Warm-up length, (chunk, microbatch) order and message batches follow Megatron-LM's
    published schedule: 2·(p - r - 1) + (v - 1)·p warm-up forwards on rank r."""
    _validate("interleaved-1f1b", p, m, v, rank, interleaved=True)
    return list(_all_ranks(_interleaved_steps, _place_by_step, p, m, v, p * v)[rank])


def zb_h1(p: int, m: int, v: int, rank: int) -> list[Action]:
    """ZB-H1 (Qi et al., arXiv 2401.10241, §3): backward split into B (input grad, on the
    critical path between stages) and W (weight grad, free to move). Rank r keeps 1F1B's
    warm-up and F, B order but runs each W up to r steps late, so later ranks send gradients
    upstream sooner and their deferred Ws fill the tail. A microbatch's activations are held
    from F until its W: at most p on every rank, 1F1B's peak. With T_F = T_B = T_W the
    bubble is (p-1)/(3m) of the ideal time, a third of 1F1B's."""
    _validate("zb-h1", p, m, v, rank)
    return list(_all_ranks(_zb_h1_steps, _place_by_gap, p, m, v, p)[rank])


Schedule = Callable[[int, int, int, int], list[Action]]

SCHEDULES: dict[str, Schedule] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
}


def get_schedule(name: str) -> Schedule:
    """The schedule function registered as ``name``; ValueError listing the known names."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; "
                         f"choose one of {', '.join(SCHEDULES)}") from None


def num_stages(name: str, p: int, v: int = 1) -> int:
    """Virtual stages the model is cut into: v·p for interleaved-1f1b, else p."""
    return p * v if name == "interleaved-1f1b" else p


def validate(name: str, p: int, m: int, v: int = 1) -> None:
    """Refuse a schedule name or sizes that cannot run, with a ValueError naming the fix."""
    get_schedule(name)
    _validate(name, p, m, v, 0, interleaved=name == "interleaved-1f1b")


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Every rank's action list, indexed by rank."""
    validate(name, p, m, v)
    return [get_schedule(name)(p, m, v, r) for r in range(p)]


def in_flight_chunks(actions: list[Action], weights: list | None = None):
    """Peak number of (microbatch, chunk) activations a rank holds at once: taken at F,
    released when the weight gradient is done (BW or W; after B the weight grad still needs
    the layer inputs). With ``weights`` (one per chunk, e.g. its bytes per microbatch) the
    peak of their sum instead."""
    held = peak = 0
    for a in actions:
        w = 1 if weights is None else weights[a.chunk]
        if a.kind is ActionKind.FORWARD:
            held += w
            peak = max(peak, held)
        elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            held -= w
    return peak


def peak_in_flight(name: str, p: int, m: int, v: int = 1, rank: int = 0) -> float:
    """Peak microbatches of activations held at once on ``rank``, in units of one
    microbatch through all of this rank's layers (a chunk holds 1/v of them): GPipe m,
    1F1B p - rank (capped at m), interleaved p + (p-1)/v on rank 0 (Korthikanti et al.,
    arXiv 2205.05198 §4.2.3: a factor 1 + (p-1)/(p·v) over 1F1B), ZB-H1 min(p, m)."""
    return in_flight_chunks(get_schedule(name)(p, m, v, rank)) / v
