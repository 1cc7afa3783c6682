"""The predicted step time: compute per stage, the pipeline bubble (closed forms, or the runtime's
schedule replayed by threefold.schedules.simulate), and each axis's communication with
what of it hides behind compute (``predict_step``, ``StepPrediction``).

Time model, per pipeline stage and microbatch: compute = FLOPs / (peak · efficiency) +
memory-bound bytes / HBM bandwidth (``stage_memory_traffic_per_microbatch``); tp collectives
and pipeline sends are *not* overlapped (they sit between dependent matmuls); ZeRO-3 gathers
and reduce-scatters overlap the forward/backward of their microbatch, except one bucket each;
the data-parallel all-reduce and the ZeRO-2 reduce-scatter overlap the last microbatch's
backward except one bucket; the ZeRO-1 reduce-scatter, the HSDP all-reduce over dp_replicate
and the ZeRO-1/2 parameter all-gathers after the step are exposed. With ``parallel.tp_overlap``
(C chunks, sequence parallelism) a sub-layer's all-gather or reduce-scatter is C calls of
1/C of the size, each but one behind a neighbouring chunk's matmul: exposed per collective is
one chunk's time plus (C−1)·max(0, one chunk's time − one chunk's matmul), so about 1/C of
the unoverlapped time while the matmuls are the longer. Context parallelism's cp
traffic runs on the link the cp axis crosses: each ring hop of K/V hides behind the attention
of one block (the rank's queries against one rank's keys: 1/cp of the layer's attention
FLOPs), the dK/dV hops and the allgather algorithm's all-gather and reduce-scatter are
exposed. Expert parallelism's all-to-alls (their uniform-routing expectation) run on the link
the ep axis crosses and are exposed: each MoE layer waits for its tokens. The pipeline then
takes m·T_slowest plus the bubble, (bubble/ideal ratio of the schedule)·m·T_mean. The
optimiser step adds its memory traffic (``ADAMW_ACCESSES_PER_PARAM`` fp32 accesses per
parameter the rank updates: Ψ, or Ψ/N under ZeRO) over the HBM bandwidth, when that is known.
With ``layout.offload_optimizer`` that traffic is over the host's memory bandwidth instead
(``offload_step_seconds``), and the gradients going down and the parameters coming up over
PCIe add ``offload_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from threefold.layout import Layout, Workload, check_layout
from threefold.accounting import microbatches
from threefold.accounting.stages import (
    distinct_stages,
    shape_key,
    stage_multiplicity,
    stage_representatives,
)
from threefold.accounting import Collective, collectives
from threefold.accounting.traffic import bytes_per_axis
from threefold.layout.axes import AXES, COMM_AXES, CP_AXES, EP_LEVELS
from threefold.config import ModelConfig
from threefold.schedules.registry import bubble_of, schedule_spec
from threefold.schedules import Costs
from threefold.schedules import simulate as replay_schedule
from threefold.plan.collectives import collective_time
from threefold.plan.compute import (
    MATMUL_EFFICIENCY,
    attention_block_seconds,
    matmul_peak,
    model_flops_per_step,
    tp_chunk_seconds,
    offload_step_seconds,
    optimizer_seconds,
    stage_flops_per_microbatch,
    stage_memory_traffic_per_microbatch,
)
from threefold.plan.network import Placement, place

# --------------------------------------------------------------------------------------------
# Pipeline bubble
# --------------------------------------------------------------------------------------------
SIMULATE_MAX_ACTIONS = 4096  # p·m·v above this uses the closed form (the replay is Python)


def bubble_over_ideal(schedule: str, p: int, m: int, v: int = 1,
                      backward_over_forward: float = 2.0,
                      simulate: bool = False, inflight: int = 0) -> tuple[float, str]:
    """(bubble time / ideal time, source) with equal stages.

    Closed forms from the schedule registry (``ScheduleSpec.bubble``: GPipe and 1F1B
    (p-1)/m, interleaved 1F1B (p-1)/(v·m), Narayanan et al. 2021 §2.2); the schedule
    simulator (threefold.schedules.simulate) replays the same action lists the
    executor runs and gives exactly these values (tests/test_cost.py checks it), so they are
    used directly — the replay is far too slow for a search of thousands. A split-backward
    schedule's bubble (ZB-H1) depends on how backward splits into B and W, so it is simulated
    (B = W = half of backward) when the run is small, else its closed form ((p-1)/(3m), Qi et
    al., arXiv 2401.10241, T_F = T_B = T_W). ``simulate`` forces the replay for any schedule
    (a single layout, e.g. a dry run). Interleaved 1F1B with a bound on the activations in
    flight (``inflight``) has no published formula: replayed for one layout (``simulate``),
    ``bounded.bubble_estimate`` in a search (which meets a new bound in nearly every layout;
    exact at a bound of v·p and above, within a third of the replay below)."""
    if p == 1:
        return 0.0, "none"
    spec = schedule_spec(schedule)
    exact_from = 2 * p if spec.vshape else p  # split schedules' closed forms hold from here
    if spec.split_backward and m >= exact_from and round(backward_over_forward, 2) == 2.0 \
            and not simulate:  # at T_B = T_W = T_F (tests/test_schedules.py checks the grid)
        return spec.bubble(p, m, v), "closed-form"
    if inflight and not simulate:  # a search meets a new bound in nearly every layout
        return bubble_of(schedule, p, m, v, inflight), "estimate"
    if (simulate or spec.split_backward or inflight) and p * m * v <= SIMULATE_MAX_ACTIONS:
        sim = _simulated(schedule, p, m, v, round(backward_over_forward, 2), inflight)
        if sim is not None:
            return sim, "simulated"
    return bubble_of(schedule, p, m, v, inflight), "closed-form"


@lru_cache(maxsize=4096)
def _simulated(schedule: str, p: int, m: int, v: int, ratio: float,
               inflight: int = 0) -> float | None:
    # a split-backward schedule splits backward into B and W; the fused ones run B+W as one
    costs = Costs(1.0, ratio / 2, ratio / 2, 0.0)
    try:
        return replay_schedule(schedule, p, m, v, costs, inflight).bubble_over_ideal
    except Exception:  # a schedule the simulator refuses (or a bug there): fall back
        return None


# --------------------------------------------------------------------------------------------
# Step time
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepPrediction:
    """Predicted time and throughput of one optimiser step; times in seconds, per rank."""

    step_time_s: float
    compute_s: float  # m microbatches on the slowest stage, compute only
    tp_exposed_s: float
    pp_exposed_s: float
    dp_exposed_s: float  # data-parallel/ZeRO communication not hidden behind compute
    bubble_s: float
    bubble_fraction: float  # idle share of the pipeline's time (GPipe's form)
    bubble_source: str
    model_flops: float
    hardware_flops: float
    tokens_per_second_per_gpu: float
    tflops_per_gpu: float  # hardware (achieved) TF/s per GPU, recompute included
    mfu: float | None  # None when the peak is unknown
    hfu: float | None
    comm_bytes: dict[str, float] = field(default_factory=dict)
    inter_node_axes: tuple[str, ...] = ()
    optimizer_s: float = 0.0  # the optimiser step's memory traffic, after the last backward
    offload_s: float = 0.0  # optimiser offload: gradients down and parameters up over PCIe
    cp_exposed_s: float = 0.0  # context-parallel K/V traffic not hidden behind attention
    # expert-parallel all-to-alls (uniform-routing expectation), on the critical path
    ep_exposed_s: float = 0.0
    # (axis, topology level its groups stay inside) for each axis of size > 1
    axis_levels: tuple[tuple[str, str], ...] = ()
    # the overlap model, stated: (axis, op, what hides it, seconds per step in all, seconds
    # of it exposed) for each kind of collective of the slowest stage (``OVERLAP_RULES``)
    overlap: tuple[tuple[str, str, str, float, float], ...] = ()
    # the slowest stage's compute over the mean rank's (1 without a pipeline): what an uneven
    # split, the head, the embedding or dense first blocks cost
    stage_imbalance: float = 1.0


# What each collective's ``overlap`` tag (threefold.accounting.traffic) hides behind.
OVERLAP_RULES = {
    "none": "nothing: on the critical path",
    "forward": "its microbatch's forward, but for the first bucket",
    "backward": "its microbatch's backward, but for the last bucket",
    "last": "the last microbatch's backward, but for the last bucket",
    "step": "nothing: after the last backward",
    "attention-forward": "one block's attention per hop",
    "attention-backward": "one block's attention per hop (dK/dV hops wait)",
    "paired": "the paired microbatch's forward and backward (DualPipeV), but for one message",
    "tp-chunks": "the neighbouring chunk's matmul (parallel.tp_overlap), but for one chunk",
}


def predict_step(cfg: ModelConfig, layout: Layout, work: Workload, cluster,
                 efficiency: float | None = None, bucket_bytes: float | None = None,
                 simulate: bool = False, overlap_grad_reduce: bool = True, *,
                 checked: bool = False) -> StepPrediction:
    """Predicted step of ``layout`` on ``cluster`` (a ``threefold.plan.cluster.Cluster``), by
    the time model of the module docstring: each stage's microbatch (``_stage_times``), the
    pipeline's m·T_slowest plus its bubble (``_pipeline_span``), then the step's exposed
    data-parallel traffic, the optimiser step and the offload traffic. With
    ``overlap_grad_reduce=False`` no data-parallel communication overlaps anything, as in
    Megatron-LM of 2021; ``simulate`` replays the schedule (a single layout, e.g. a dry
    run). A layout the rule book refuses raises its LayoutError; ``checked``: the caller has
    run ``check_layout`` on it already (the search, on every layout it enumerates)."""
    if not checked:
        check_layout(cfg, layout, work)
    hw = cluster.hardware
    peak = matmul_peak(cfg, work, hw)
    if not peak:
        raise ValueError(f"{hw.name}: peak {work.precision} FLOP/s unknown; give --peak-tflops")
    eff = efficiency if efficiency is not None else (hw.matmul_efficiency or MATMUL_EFFICIENCY)
    m = microbatches(layout, work)
    links = {a: place(layout, a, cluster) for a in COMM_AXES}
    hbm = hw.memory_bw or math.inf
    per_mb, per_step, parts, lists, hw_flops = _stage_times(
        cfg, layout, work, peak * eff, hbm, links,
        layout.bucket_bytes if bucket_bytes is None else bucket_bytes, overlap_grad_reduce)
    slow = max(per_mb, key=per_mb.get)
    ideal, bubble, source = _pipeline_span(cfg, layout, m, per_mb, parts, simulate)
    dp_step = max(per_step.values())
    opt_s, off_s = optimizer_seconds(cfg, layout, hbm, work), 0.0
    if layout.offload_optimizer:
        opt_s, off_s = offload_step_seconds(cfg, layout, work, cluster)
    step = ideal + bubble + dp_step + opt_s + off_s
    comp, exp, _, ledger = parts[slow]
    mean = sum(parts[st][0] * stage_multiplicity(cfg, layout, st) for st in parts) / layout.pp
    stated = tuple((axis, op, rule, tot * (1 if rule in ("last", "step") else m),
                    left * (1 if rule in ("last", "step") else m))
                   for (axis, op, rule), (tot, left) in ledger.items())
    n = layout.world_size
    mf = model_flops_per_step(cfg, work)
    hf = hw_flops * m * layout.tp * layout.dp * layout.cp
    return StepPrediction(
        step_time_s=step, compute_s=m * comp, tp_exposed_s=m * exp["tp"],
        pp_exposed_s=m * exp["pp"], dp_exposed_s=m * exp["dp"] + dp_step, bubble_s=bubble,
        bubble_fraction=bubble / (ideal + bubble), bubble_source=source, model_flops=mf,
        hardware_flops=hf, tokens_per_second_per_gpu=work.tokens / step / n,
        tflops_per_gpu=hf / step / n / 1e12, mfu=mf / (step * n * peak),
        hfu=hf / (step * n * peak), comm_bytes=bytes_per_axis(lists, m), optimizer_s=opt_s,
        offload_s=off_s,
        inter_node_axes=tuple(a for a in COMM_AXES if links[a].index > 0),
        cp_exposed_s=m * exp["cp"], ep_exposed_s=m * exp["ep"],
        axis_levels=tuple((a, links[a].level) for a in AXES + ("ep",) + (
            EP_LEVELS if layout.ep_dispatch == "hierarchical" else ())
            if layout.axis_size(a) > 1), overlap=stated,
        stage_imbalance=comp / mean if mean else 1.0)


def _stage_times(cfg: ModelConfig, layout: Layout, work: Workload, rate: float, hbm: float,
                 links: dict, bucket_bytes: float, overlap_grad_reduce: bool):
    """Per distinct stage: (seconds per microbatch, compute and exposed communication;
    exposed data-parallel seconds per step; (compute seconds, exposed seconds per axis,
    backward/forward ratio, overlap ledger)); the stages' collective lists; hardware FLOPs
    per microbatch over the pipeline."""
    per_mb, per_step, parts, lists, hw_flops = {}, {}, {}, [], 0.0
    for st in distinct_stages(cfg, layout):
        f, bwd = stage_flops_per_microbatch(cfg, layout, work, st)
        mem_f, mem_b = stage_memory_traffic_per_microbatch(cfg, layout, work, st)
        hw_flops += (f + bwd) * stage_multiplicity(cfg, layout, st)
        t_f, t_b = f / rate + mem_f / hbm, bwd / rate + mem_b / hbm
        colls = collectives(cfg, layout, work, st)
        lists.append(colls)
        windows = (t_f, t_b) if overlap_grad_reduce else (0.0, 0.0)
        ledger: dict = {}
        exposed, step_dp = _exposed_comm(colls, links, *windows, bucket_bytes,
                                         attention_block_seconds(cfg, layout, work, rate),
                                         ledger, tp_chunk_seconds(cfg, layout, work, rate))
        per_mb[st] = t_f + t_b + sum(exposed.values())
        per_step[st] = step_dp
        parts[st] = (t_f + t_b, exposed, t_b / t_f, ledger)
    return per_mb, per_step, parts, lists, hw_flops


def _pipeline_span(cfg: ModelConfig, layout: Layout, m: int, per_mb: dict, parts: dict,
                   simulate: bool) -> tuple[float, float, str]:
    """(m·T_slowest, the bubble, where the bubble comes from): the schedule's bubble ratio
    times m·T_mean, or with ``simulate`` (one layout) the schedule replayed with each stage's
    own times."""
    stages = list(per_mb)
    slow = max(per_mb, key=per_mb.get)
    mean = sum(per_mb[s] * stage_multiplicity(cfg, layout, s) for s in stages) / layout.pp
    ratio, source = bubble_over_ideal(layout.pipeline_schedule, layout.pp, m, layout.vpp,
                                      parts[stages[len(stages) // 2]][2], simulate,
                                      layout.pipeline_inflight)
    ideal = m * per_mb[slow]
    bubble = ratio * m * mean
    if simulate and layout.pp > 1 and layout.vpp == 1:  # one layout: replay its own stages
        span = _replayed_makespan(cfg, layout, m, per_mb,
                                  {st: 1 / (1 + parts[st][2]) for st in stages})
        if span is not None:
            bubble, source = max(0.0, span - ideal), "simulated (per-stage times)"
    return ideal, bubble, source


def _replayed_makespan(cfg: ModelConfig, layout: Layout, m: int, per_mb: dict,
                       forward_share: dict) -> float | None:
    """The pipeline's compute span for ``m`` microbatches replayed by the schedule simulator
    with every stage's own time per microbatch (``per_mb``, split into forward and backward
    by ``forward_share``; ZB-H1's B and W halves of the backward): with uneven stages (the
    head on the last, an uneven split) the bubble is not the equal-stage formula's. None when
    the replay is too large or the simulator refuses the schedule."""
    p = layout.pp
    if p * m > SIMULATE_MAX_ACTIONS:
        return None
    per: dict = {}
    reps = stage_representatives(shape_key(cfg), p, 1, layout.pipeline_split)
    for st, rep in enumerate(reps):  # a stage has its representative's times
        f = per_mb[rep] * forward_share[rep]
        b = per_mb[rep] - f
        per.update({("F", st): f, ("BW", st): b, ("B", st): b / 2, ("W", st): b / 2})
    try:
        return replay_schedule(layout.pipeline_schedule, p, m, 1, Costs(per_stage=per)).makespan
    except Exception:  # a schedule the simulator refuses (or a bug there): the closed form
        return None


def call_time(c: Collective, where: Placement, size: float | None = None) -> float:
    """α–β time of one call of ``c`` (on ``size`` bytes if given) where its axis runs: the
    fastest algorithm of ``plan.collectives`` on the level the group spans."""
    return collective_time(c.op, c.group, c.size if size is None else size, where.link,
                           where.per_node, where.intra)


def _chunked(c: Collective, where: Placement, chunks: int, matmul: float
             ) -> tuple[float, float]:
    """(seconds, exposed seconds) of the ``count`` calls of an overlapped sequence-parallel
    collective (``parallel.tp_overlap``): each is ``chunks`` calls of 1/chunks of the size;
    the first chunk of an all-gather (the last of a reduce-scatter) waits for no matmul, each
    other hides behind a neighbouring chunk's ``matmul`` seconds and shows what exceeds it."""
    piece = call_time(c, where, c.size / chunks)
    return (c.count * chunks * piece,
            c.count * (piece + (chunks - 1) * max(0.0, piece - matmul)))


def _exposure_kind(axis: str) -> str:
    """Which exposed term an axis's time goes to: tp, pp, cp (a hybrid's two cp axes too),
    ep (the hierarchical dispatch's levels too) or dp (the data axes)."""
    if axis in EP_LEVELS:
        return "ep"
    if axis in CP_AXES:
        return "cp"
    return axis if axis in ("tp", "pp", "cp", "ep") else "dp"


def _exposed_comm(colls: list[Collective], links: dict, t_f: float, t_b: float,
                  bucket_bytes: float, attention_block: tuple[float, float] = (0.0, 0.0),
                  ledger: dict | None = None, tp_chunk: tuple[int, float] = (1, 0.0)
                  ) -> tuple[dict[str, float], float]:
    """({tp, pp, cp, ep, dp}: exposed seconds per microbatch, exposed dp seconds once per step)
    for one stage, applying the overlap rules of ``predict_step``; ``attention_block`` is
    the (forward, backward) time a ring hop may hide behind. ``ledger`` (if given) receives
    {(axis, op, overlap tag): [seconds, exposed seconds]}, per microbatch for the tags that
    repeat each microbatch, per step for "last" and "step"; a window's exposure is shared
    among the collectives behind it in proportion to their time. ``tp_chunk``: (chunks, one
    chunk's matmul seconds) for the "tp-chunks" collectives (``tp_chunk_seconds``)."""
    ledger = {} if ledger is None else ledger

    def note(c: Collective, total: float, left: float) -> None:
        """Add to ``ledger``."""
        rec = ledger.setdefault((c.axis, c.op, c.overlap), [0.0, 0.0])
        rec[0] += total
        rec[1] += left

    exposed = {"tp": 0.0, "pp": 0.0, "cp": 0.0, "ep": 0.0, "dp": 0.0}
    step_dp = 0.0
    groups: dict[tuple[str, str], float] = {}
    tails: dict[tuple[str, str], float] = {}
    members: dict[tuple[str, str], list[tuple[Collective, float]]] = {}
    for c in colls:
        if c.overlap == "hidden":
            continue
        where = links[c.axis]
        one = call_time(c, where)
        kind = _exposure_kind(c.axis)
        if c.overlap.startswith("attention-"):  # each hop behind one block's attention
            window = attention_block[0 if c.overlap == "attention-forward" else 1]
            exposed[kind] += c.count * max(0.0, one - window)
            note(c, one * c.count, c.count * max(0.0, one - window))
        elif c.overlap == "tp-chunks":
            total, left = _chunked(c, where, *tp_chunk)
            exposed[kind] += left
            note(c, total, left)
        elif c.overlap == "none":
            exposed[kind] += one * c.count
            note(c, one * c.count, one * c.count)
        elif c.overlap == "step":
            step_dp += one * c.count
            note(c, one * c.count, one * c.count)
        else:
            key = (kind, c.overlap)
            groups[key] = groups.get(key, 0.0) + one * c.count
            members.setdefault(key, []).append((c, one * c.count))
            tails[key] = max(tails.get(key, 0.0),
                             call_time(c, where, min(c.size, bucket_bytes)))
    for (kind, overlap), total in groups.items():
        window = {"forward": t_f, "paired": t_f + t_b}.get(overlap, t_b)
        left = max(tails[(kind, overlap)], total - window)
        if overlap == "last":
            step_dp += left
        else:
            exposed[kind] += left
        for c, t in members[(kind, overlap)]:
            note(c, t, left * t / total if total else 0.0)
    return exposed, step_dp


def compute_bound_step_time(cfg: ModelConfig, layout: Layout, work: Workload, cluster,
                            efficiency: float | None = None, bubble: bool = True) -> float:
    """``predict_step``'s step time with every collective free: a lower bound on it, cheap
    enough to order and prune a search. Without ``bubble``, the pipeline's bubble is left
    out too: a looser bound that never replays a schedule."""
    hw = cluster.hardware
    rate = matmul_peak(cfg, work, hw) * (efficiency if efficiency is not None else
                                            (hw.matmul_efficiency or MATMUL_EFFICIENCY))
    m = microbatches(layout, work)
    stages = distinct_stages(cfg, layout)
    bw = hw.memory_bw or math.inf
    times = {st: sum(stage_flops_per_microbatch(cfg, layout, work, st)) / rate
             + sum(stage_memory_traffic_per_microbatch(cfg, layout, work, st)) / bw
             for st in stages}
    if not bubble or layout.pp == 1:
        return m * max(times.values())
    mean = sum(times[s] * stage_multiplicity(cfg, layout, s) for s in stages) / layout.pp
    ratio, _ = bubble_over_ideal(layout.pipeline_schedule, layout.pp, m, layout.vpp,
                                 inflight=layout.pipeline_inflight)
    return m * max(times.values()) + ratio * m * mean
