"""Pipeline schedules as data: pure functions ``(p, m, v, rank) -> list[Action]``, and the
registry ``SCHEDULE_SPECS`` that holds, for each, its builder and the closed forms the planner
uses (bubble, activations in flight). Adding a schedule is one ``ScheduleSpec`` entry here (and
its name in ``threefold.config.PIPELINE_SCHEDULES``, which config validates against without
importing this module); validation, the planner, the dry run and the accounting read the rest.

A schedule says, for one rank, in which order it runs forward (F), backward (B: input grad,
W: weight grad, or BW: both fused) and the point-to-point sends and receives that move
activations down the pipeline and gradients back up (``actions.py``; where the messages go:
``messages.py``). The same lists drive the executor, the checker (check.py), the simulator and
the timeline picture (simulate.py, timeline.py).

Layout (Megatron's, Narayanan et al. 2021 §2.2.2): there are ``S = v·p`` virtual stages;
stage ``s`` lives on rank ``s % p`` as its model chunk ``s // p``. Without interleaving
(v = 1) stage and rank coincide.

This module imports no torch: the planner uses it to predict bubbles cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from threefold.config import PIPELINE_SCHEDULES
from threefold.schedules.actions import Action, ActionKind
from threefold.schedules.messages import Steps, all_ranks, place_by_gap, place_by_step
from threefold.schedules.bounded import bounded_steps, bubble_estimate, validate_inflight
from threefold.schedules.vshape import dualpipe_v_steps, zb_v_steps

__all__ = ["SCHEDULES", "SCHEDULE_SPECS", "Schedule", "ScheduleSpec", "build_schedule",
           "get_schedule", "bubble_of", "gpipe", "in_flight_chunks", "inflight_of",
           "interleaved_1f1b", "num_stages", "one_f_one_b", "peak_in_flight", "schedule_spec",
           "validate", "zb_h1", "zb_v"]


def _validate(name: str, p: int, m: int, v: int, rank: int, interleaved: bool = False,
              vshape: bool = False, inflight: int = 0) -> None:
    """Refuse sizes a schedule cannot run, naming the fix."""
    if inflight and not interleaved:
        raise ValueError(f"{name} has no bound on the activations in flight: pipeline_inflight "
                         f"applies to interleaved-1f1b; set it to 0")
    for label, value in (("pp", p), ("microbatches", m), ("vpp", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be an integer >= 1, got {value!r}")
    if not 0 <= rank < p:
        raise ValueError(f"{name}: rank must be in [0, {p}), got {rank}")
    if vshape:
        if v != 2:
            raise ValueError(f"{name} runs two model chunks per rank in a V: set vpp=2 "
                             f"(got vpp={v})")
        return
    if v != 1 and not interleaved:
        raise ValueError(f"{name} runs one model chunk per rank: set vpp=1, or use "
                         f"interleaved-1f1b for vpp={v}")
    if interleaved and m % p != 0:
        lo, hi = (m // p) * p, (m // p + 1) * p
        fix = f"{lo} or {hi}" if lo else f"{hi}"
        raise ValueError(f"{name} needs microbatches to be a multiple of pp (got microbatches="
                         f"{m}, pp={p}): use microbatches={fix}, or schedule 1f1b")
    if interleaved:
        validate_inflight(name, p, v, inflight)


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


def gpipe(p: int, m: int, v: int, rank: int, inflight: int = 0) -> list[Action]:
    """GPipe (Huang et al., arXiv 1811.06965): all m forwards, then all m backwards.
    Holds all m microbatches' activations at once."""
    _validate("gpipe", p, m, v, rank, inflight=inflight)
    return list(all_ranks(_gpipe_steps, place_by_step, p, m, v, p)[rank])


def one_f_one_b(p: int, m: int, v: int, rank: int, inflight: int = 0) -> list[Action]:
    """1F1B (PipeDream-Flush; Narayanan et al., arXiv 2104.04473 §2.2.1): rank r runs
    p - r - 1 warm-up forwards, then alternates one forward and one backward, then drains
    the remaining backwards. At most p microbatches in flight (on rank 0). Any m >= 1 works:
    with m < p the warm-up is cut to m (torchtitan #775's hang when microbatches < stages
    cannot happen here: check.py replays every rank's list together before launch)."""
    _validate("1f1b", p, m, v, rank, inflight=inflight)
    return list(all_ranks(_one_f_one_b_steps, place_by_step, p, m, v, p)[rank])


def interleaved_1f1b(p: int, m: int, v: int, rank: int, inflight: int = 0) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al., arXiv 2104.04473 §2.2.2): each rank holds v model
    chunks; microbatches go through the chunks in groups of p, which shrinks the bubble to
    (p-1)/(v·m) of the ideal time at v times the point-to-point traffic. Needs m % p == 0.
    Warm-up length, (chunk, microbatch) order and message batches follow Megatron-LM's
    published schedule: 2·(p - r - 1) + (v - 1)·p warm-up forwards on rank r. With
    ``inflight`` > 0 at most that many chunk activations are held on any rank, B and W split
    (``bounded.py``: Llama 3's memory against bubble trade)."""
    _validate("interleaved-1f1b", p, m, v, rank, interleaved=True, inflight=inflight)
    if inflight:
        return list(all_ranks(bounded_steps(inflight), place_by_gap, p, m, v, p * v)[rank])
    return list(all_ranks(_interleaved_steps, place_by_step, p, m, v, p * v)[rank])


def zb_h1(p: int, m: int, v: int, rank: int, inflight: int = 0) -> list[Action]:
    """ZB-H1 (Qi et al., arXiv 2401.10241, §3): backward split into B (input grad, on the
    critical path between stages) and W (weight grad, free to move). Rank r keeps 1F1B's
    warm-up and F, B order but runs each W up to r steps late, so later ranks send gradients
    upstream sooner and their deferred Ws fill the tail. A microbatch's activations are held
    from F until its W: at most p on every rank, 1F1B's peak. With T_F = T_B = T_W the
    bubble is (p-1)/(3m) of the ideal time, a third of 1F1B's."""
    _validate("zb-h1", p, m, v, rank, inflight=inflight)
    return list(all_ranks(_zb_h1_steps, place_by_gap, p, m, v, p)[rank])


def zb_v(p: int, m: int, v: int, rank: int, inflight: int = 0) -> list[Action]:
    """ZB-V (Qi et al., arXiv 2405.15362): two chunks per rank in a V, backward split into B
    and W; 1F1B's activation memory (2p chunk activations, p microbatches of the rank's
    layers) on every rank, and no bubble at T_F = T_B = T_W once m >= 2p - 1
    (``vshape.zb_v_steps``)."""
    _validate("zb-v", p, m, v, rank, vshape=True, inflight=inflight)
    return list(all_ranks(zb_v_steps, place_by_gap, p, m, v, 2 * p, True)[rank])


def dualpipe_v(p: int, m: int, v: int, rank: int, inflight: int = 0) -> list[Action]:
    """DualPipeV (DeepSeek-V3 §3.2.1; the V form of DeepSeek's DualPipe repository): two
    chunks per rank in a V, one microbatch's forward paired with another's backward
    (``vshape.dualpipe_v_steps``). On a CPU the pair runs one after the other: the overlap of
    compute and communication that is its point on a GPU is modelled by the planner from the
    published figure, not measured here."""
    _validate("dualpipe-v", p, m, v, rank, vshape=True, inflight=inflight)
    return list(all_ranks(dualpipe_v_steps, place_by_gap, p, m, v, 2 * p, True)[rank])


Schedule = Callable[..., list[Action]]  # (p, m, v, rank, inflight=0)


# --------------------------------------------------------------------------------------------
# The registry: each schedule's builder and closed forms, one entry each.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule: ``build(p, m, v, rank)`` makes a rank's action list; ``bubble(p,
    m, v)`` is its bubble over the ideal time with equal stages and B+W = 2F (the simulator
    gives the same, tests/test_cost.py checks it); ``inflight(p, m, v, rank)`` the microbatches
    of activations ``rank`` holds at its peak, in units of its whole share of layers;
    ``head_inflight(p, m)`` those whose head and loss tensors the last stage holds.
    ``chunked``: it runs v model chunks per rank (and needs microbatches a multiple of pp);
    ``split_backward``: backward runs as B and W, so its bubble depends on their split (the
    planner simulates it where it can)."""

    name: str
    build: Schedule
    bubble: Callable[[int, int, int], float]
    inflight: Callable[[int, int, int, int], float]
    head_inflight: Callable[[int, int], int]
    chunked: bool = False
    split_backward: bool = False
    vshape: bool = False


# Closed forms: Narayanan et al. 2021 §2.2 (GPipe, 1F1B: bubble (p-1)/m; interleaved:
# (p-1)/(v·m), rank r holding 2(p-r-1) + (v-1)·p + 1 chunk-forwards of 1/v of its layers);
# Qi et al. arXiv 2401.10241 (ZB-H1: (p-1)/(3m) at T_F = T_B = T_W, min(p, m) in flight on
# every rank, its Ws up to r steps late); ZB-V (arXiv 2405.15362: 1F1B's p in flight, i.e.
# 2p chunks, on every rank once m >= 2p - 1, fewer, min(m + r + 1, 2m), before; bubble "≈ 0":
# here the start-up's p - 1 chunk forwards, (p-1)/(6m) for m >= 2p - 2); DualPipeV
# (DeepSeek's DualPipe repository: PP + 1 = 2p + 1 chunks in flight, capped alike; bubble
# (PP/2 - 1)(F&B + B - 3W) = p - 1 chunk times without overlap, so (p-1)/(6m) for m >= 2p).
# tests/test_cost.py checks them against the lists.
SCHEDULE_SPECS: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("gpipe", gpipe, bubble=lambda p, m, v: (p - 1) / m,
                 inflight=lambda p, m, v, r: m, head_inflight=lambda p, m: m),
    ScheduleSpec("1f1b", one_f_one_b, bubble=lambda p, m, v: (p - 1) / m,
                 inflight=lambda p, m, v, r: min(p - r, m), head_inflight=lambda p, m: 1),
    ScheduleSpec("interleaved-1f1b", interleaved_1f1b, chunked=True,
                 bubble=lambda p, m, v: (p - 1) / (v * m),
                 inflight=lambda p, m, v, r: min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) / v,
                 head_inflight=lambda p, m: 1),
    ScheduleSpec("zb-h1", zb_h1, split_backward=True, bubble=lambda p, m, v: (p - 1) / (3 * m),
                 inflight=lambda p, m, v, r: min(p, m), head_inflight=lambda p, m: min(p, m)),
    ScheduleSpec("zb-v", zb_v, split_backward=True, vshape=True,
                 bubble=lambda p, m, v: (p - 1) / (6 * m),
                 inflight=lambda p, m, v, r: min(2 * p, m + r + 1, 2 * m) / 2,
                 head_inflight=lambda p, m: 1),
    ScheduleSpec("dualpipe-v", dualpipe_v, split_backward=True, vshape=True,
                 bubble=lambda p, m, v: (p - 1) / (6 * m),
                 inflight=lambda p, m, v, r: min(2 * p + 1, m + r + 1, 2 * m) / 2,
                 head_inflight=lambda p, m: 1),
)}
if tuple(SCHEDULE_SPECS) != PIPELINE_SCHEDULES:  # config validates names without this module
    raise RuntimeError(f"threefold.config.PIPELINE_SCHEDULES {PIPELINE_SCHEDULES} must list "
                       f"the registered schedules {tuple(SCHEDULE_SPECS)}")

SCHEDULES: dict[str, Schedule] = {name: s.build for name, s in SCHEDULE_SPECS.items()}
"""Each schedule's builder by name (``SCHEDULE_SPECS``' ``build``)."""


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered ``ScheduleSpec`` of ``name``; ValueError listing the known names."""
    try:
        return SCHEDULE_SPECS[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; "
                         f"choose one of {', '.join(SCHEDULE_SPECS)}") from None


def get_schedule(name: str) -> Schedule:
    """The schedule function registered as ``name``; ValueError listing the known names."""
    return schedule_spec(name).build


def num_stages(name: str, p: int, v: int = 1) -> int:
    """Virtual stages the model is cut into: v·p for a chunked schedule (interleaved-1f1b),
    else p."""
    spec = SCHEDULE_SPECS.get(name)
    if spec is not None and spec.vshape:
        return 2 * p
    return p * v if spec is not None and spec.chunked else p


def validate(name: str, p: int, m: int, v: int = 1, inflight: int = 0) -> None:
    """Refuse a schedule name or sizes that cannot run, with a ValueError naming the fix."""
    spec = schedule_spec(name)
    _validate(name, p, m, v, 0, interleaved=spec.chunked, vshape=spec.vshape, inflight=inflight)


def build_schedule(name: str, p: int, m: int, v: int = 1, inflight: int = 0
                   ) -> list[list[Action]]:
    """Every rank's action list, indexed by rank (``inflight``: interleaved 1F1B's bound on
    the chunk activations a rank holds, 0 for Megatron's warm-up)."""
    validate(name, p, m, v, inflight)
    return [get_schedule(name)(p, m, v, r, inflight=inflight) for r in range(p)]


def bubble_of(name: str, p: int, m: int, v: int = 1, inflight: int = 0) -> float:
    """The registered closed form of the bubble over the ideal time; with an in-flight bound,
    ``bounded.bubble_estimate`` (no published formula: the planner replays where it can)."""
    if inflight:
        return bubble_estimate(p, m, v, inflight)
    return schedule_spec(name).bubble(p, m, v)


def inflight_of(name: str, p: int, m: int, v: int = 1, rank: int = 0,
                inflight: int = 0) -> float:
    """Microbatches of activations ``rank`` holds at its peak, in units of its whole share of
    layers (``ScheduleSpec.inflight``); with an in-flight bound, at most that bound."""
    natural = schedule_spec(name).inflight(p, m, v, rank)
    return min(natural, inflight / v) if inflight else natural


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


def peak_in_flight(name: str, p: int, m: int, v: int = 1, rank: int = 0,
                   inflight: int = 0) -> float:
    """Peak microbatches of activations held at once on ``rank``, in units of one
    microbatch through all of this rank's layers (a chunk holds 1/v of them): GPipe m,
    1F1B p - rank (capped at m), interleaved p + (p-1)/v on rank 0 (Korthikanti et al.,
    arXiv 2205.05198 §4.2.3: a factor 1 + (p-1)/(p·v) over 1F1B), ZB-H1 min(p, m)."""
    return in_flight_chunks(get_schedule(name)(p, m, v, rank, inflight=inflight)) / v
