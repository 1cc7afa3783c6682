"""The search: every layout (dp_replicate, dp_shard, ep, cp, cp_algorithm, tp, pp, vpp,
zero_stage, microbatch size, recompute) whose product is the world and which the runtime
accepts, dropped when it does not fit in memory (with the reason), scored by ``predict_step``.
A layout the runtime refuses is skipped by the rule book's rule (``threefold.layout.rules``),
counted under that rule: one summary line per rule, with its message for the first layout it
refused.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Iterator

from threefold.accounting import tp_shard
from threefold.accounting import pipeline_layers
from threefold.config import (CP_ALGORITHMS, DEEPSEEK_RECOMPUTE, RECOMPUTE_MODES, ConfigError,
                              ModelConfig, ParallelConfig)
from threefold.layout import Layout, Workload, check_layout, recompute_of_label, rules
from threefold.plan.candidates import Candidate, PlanResult, SearchSpace
from threefold.plan.traps import layout_warnings
from threefold.plan.cluster import Cluster
from threefold.plan.splits import searched_splits
from threefold.schedules.registry import SCHEDULE_SPECS
from threefold.plan.memory import MemoryBreakdown, memory_per_rank
from threefold.plan.startup import startup_peaks
from threefold.plan.states import RUNTIME_OVERHEAD_BYTES
from threefold.plan.report import explain
from threefold.plan.step import compute_bound_step_time, predict_step

JSON_KEYS = ("tp", "pp", "dp_replicate", "dp_shard", "ep", "cp", "cp_algorithm", "zero_stage",
             "vpp", "schedule", "pipeline_inflight", "pipeline_split", "stage_layers", "microbatch_size", "recompute",
             "offload_optimizer", "memory_bytes_per_gpu",
             "host_memory_bytes_per_gpu", "step_time_s", "tokens_per_second_per_gpu",
             "tflops_per_gpu", "mfu", "bubble_fraction", "warnings")
MAX_MICROBATCH = 16
MAX_VPP = 4  # and every divisor of layers // pp above it
CP_MIN_SEQ_LEN = 32768  # shorter sequences: cp only when nothing fits without it
# the schedules whose rank r holds virtual stages r and 2pp-1-r (the splits differ for them)
VSHAPED = {name for name, spec in SCHEDULE_SPECS.items() if spec.vshape}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(cfg: ModelConfig, world: int, work: Workload,
                      space: SearchSpace = SearchSpace(),
                      invalid: dict[str, int] | None = None) -> Iterator[Layout]:
    """Every layout in ``space`` that uses exactly ``world`` ranks and passes
    ``check_layout``; the others are counted into ``invalid`` by rule (``_rejecter``)."""
    reject = _rejecter({} if invalid is None else invalid)
    recompute, dropped = _recompute_options(space, work)
    recompute = _with_modules(recompute, space, cfg, work)
    experts = cfg.num_local_experts or 0
    for tp in space.tp or _divisors(world):
        try:
            rules.divides_world("tp", tp, world)
            tp_shard(cfg, tp)
        except rules.LayoutError as e:
            reject(e)
            continue
        for cp in _cp_degrees(world // tp, tp, work, space, reject, experts):
            algorithms = cp_splits(cp, space)  # (algorithm, Ulysses degree) pairs
            for pp in space.pp or _divisors(world // (tp * cp)):
                try:
                    _fits_world(tp, cp, pp, world)
                    rules.layers_fill_chunks(cfg.num_hidden_layers, pp, 1)
                    rules.batch_over_dp(work.global_batch, world // (tp * cp * pp))
                except rules.LayoutError as e:
                    reject(e)
                    continue
                dp = world // (tp * cp * pp)
                per_replica = work.global_batch // dp
                vpps = _vpp_degrees(cfg.num_hidden_layers, pp, space, reject)
                splits = list(_dp_splits(dp, space, cp))
                sizes = space.microbatch_size or [b for b in _divisors(per_replica)
                                                  if b <= MAX_MICROBATCH]
                if dropped:
                    reject(dropped, len(vpps) * len(splits) * len(sizes) * len(algorithms))
                for (alg, uly), vpp, (zero, dp_r), mbs, rc, off in itertools.product(
                        algorithms, vpps, splits, sizes, recompute, space.offload_optimizer):
                    for (sched, bound), ep, psplit in _pipe_choices(
                            cfg, work, space, pp, vpp,
                            _ep_degrees(experts, dp // dp_r, space, reject)):
                        lay = Layout(tp=tp, pp=pp, dp_replicate=dp_r, dp_shard=dp // dp_r,
                                     zero_stage=zero, vpp=vpp, microbatch_size=mbs,
                                     recompute=rc[0], recompute_modules=rc[1], cp=cp,
                                     cp_algorithm=alg, **uly,
                                     offload_optimizer=off, ep=ep, pipeline_split=psplit,
                                     sequence_parallel=not experts, schedule=sched,
                                     pipeline_inflight=bound, tp_overlap=space.tp_overlap,
                                     ep_dispatch=space.ep_dispatch,
                                     gpus_per_node=space.gpus_per_node)
                        try:
                            check_layout(cfg, lay, work)
                        except rules.LayoutError as e:
                            reject(e)
                            continue
                        yield lay


def cp_splits(cp: int, space: SearchSpace) -> list[tuple[str, dict]]:
    """The context-parallel splits to try at degree ``cp``: each algorithm of
    ``space.cp_algorithm`` over all cp ranks, and where the runtime has Ulysses each hybrid of a
    ring or all-gather over cp/u ranks with Ulysses' all-to-all over u (``space.cp_ulysses``,
    where 1 is the algorithm alone; None: 1 and every divisor u of cp, 1 < u < cp). Each as
    (algorithm, the Layout's hybrid field: ``{"cp_ulysses": u}``, or ``{}`` for none)."""
    if cp == 1:
        return [("ring", {})]
    hybrids = "ulysses" in CP_ALGORITHMS  # the runtime has the all-to-all
    degrees = space.cp_ulysses or [1] + [u for u in range(2, cp) if cp % u == 0 and hybrids]
    return [(alg, {"cp_ulysses": u} if u > 1 else {}) for alg in space.cp_algorithm
            for u in degrees if u == 1 or (hybrids and alg != "ulysses" and u < cp
                                           and cp % u == 0)]


def _pipe_choices(cfg: ModelConfig, work: Workload, space: SearchSpace, pp: int, vpp: int,
                  eps: list[int]) -> Iterator[tuple[tuple[str, int], int, str]]:
    """((schedule, in-flight bound), ep, pipeline split) to try for one (pp, vpp): the
    splits per schedule shape (``plan.splits.searched_splits``)."""
    for (sched, bound), ep in itertools.product(_schedules(pp, vpp, space), eps):
        vshape = pp > 1 and sched in VSHAPED
        for psplit in searched_splits(cfg, pp, vpp, work.seq_len, vshape,
                                      space.pipeline_split):
            yield (sched, bound), ep, psplit


def _rejecter(invalid: dict[str, int]):
    """``reject(reason, n=1)``: count n skipped layouts in ``invalid`` under the rule that
    refused them (``rules.rule_of``), keyed by its message for the first layout it refused."""
    first: dict[str, str] = {}  # rule -> its line in ``invalid``

    def reject(reason: rules.LayoutError | str, n: int = 1) -> None:
        key = first.setdefault(rules.rule_of(reason) if isinstance(reason, rules.LayoutError) else reason,
                               str(reason))
        invalid[key] = invalid.get(key, 0) + n
    return reject


def _vpp_degrees(layers: int, pp: int, space: SearchSpace, reject) -> list[int]:
    """Model chunks per pipeline rank to try: ``space.vpp`` (None: 1 without a pipeline; with
    one, every v up to ``MAX_VPP`` and every divisor of layers // pp, as long as pp·v chunks
    get a block each). The runtime splits layers that pp·v does not divide
    (threefold.schedules.balance), and so does the accounting, so they are searched."""
    if space.vpp is None:
        if pp == 1:
            return [1]
        fit = layers // pp
        return sorted({v for v in range(1, fit + 1) if v <= MAX_VPP or fit % v == 0})
    out = []
    for v in space.vpp:
        try:
            rules.vpp_needs_pp(pp, v)
            rules.layers_fill_chunks(layers, pp, v)
            out.append(v)
        except rules.LayoutError as e:
            reject(e)
    return out


def _fitting_bound(cfg: ModelConfig, lay: Layout, work: Workload, limit: float,
                   mem: MemoryBreakdown) -> tuple[Layout, MemoryBreakdown]:
    """For interleaved 1F1B that does not fit with Megatron's warm-up, the same layout with
    the largest bound on chunk activations in flight that fits (memory against bubble:
    ``parallel.pipeline_inflight``), if one does; else ``lay`` and ``mem`` unchanged."""
    if lay.pp == 1 or lay.vpp == 1 or lay.pipeline_schedule != "interleaved-1f1b" \
            or lay.pipeline_inflight:
        return lay, mem
    lo, hi = (lay.vpp - 1) * lay.pp + 1, 2 * (lay.pp - 1) + (lay.vpp - 1) * lay.pp
    low = dataclasses.replace(lay, pipeline_inflight=lo)
    m = memory_per_rank(cfg, low, work, checked=True)  # bounds the pipeline_inflight rule allows
    if m.total > limit:  # not even the smallest bound fits (most layouts a search tries)
        return lay, mem
    best, lo = (low, m), lo + 1
    while lo <= hi:  # memory grows with the bound: the largest that fits
        mid = (lo + hi) // 2
        cand = dataclasses.replace(lay, pipeline_inflight=mid)
        m = memory_per_rank(cfg, cand, work, checked=True)
        if m.total <= limit:
            best, lo = (cand, m), mid + 1
        else:
            hi = mid - 1
    return best


def _fits_world(tp: int, cp: int, pp: int, world: int) -> None:
    """The rule book's world rule for the degrees the search fixes (dp takes the rest)."""
    rules.fills_world(ParallelConfig(tp=tp, cp=cp, pp=pp), world)


def _schedules(pp: int, vpp: int, space: SearchSpace) -> list[tuple[str, int]]:
    """(schedule, in-flight bound) pairs to try for a pipeline of ``pp`` ranks with ``vpp``
    chunks each ("" = the default: 1f1b, or interleaved-1f1b with Megatron's warm-up)."""
    if pp == 1:
        return [("", 0)]
    runs = {1: ("1f1b", "zb-h1"), 2: ("interleaved-1f1b", "zb-v", "dualpipe-v")}.get(
        vpp, ("interleaved-1f1b",))
    names = [s for s in runs if space.schedules is None or s in space.schedules]
    out = []
    for name in names:
        default = name in ("1f1b", "interleaved-1f1b")
        if name != "interleaved-1f1b":
            out.append(("" if default else name, 0))
            continue
        low = (vpp - 1) * pp + 1
        out += [("", b) for b in dict.fromkeys(space.pipeline_inflight or (0,))
                if b == 0 or b >= low]
    return out


def _ep_degrees(experts: int, dp_shard: int, space: SearchSpace, reject) -> list[int]:
    """Expert-parallel degrees to try: 1 for a dense model; else ``space.ep`` (None: every
    divisor of the experts) less those that do not divide dp_shard (ep ranks are part of
    it; counted as skipped only when asked for)."""
    if not experts:
        return [1]
    out = []
    for ep in space.ep or _divisors(experts):
        try:
            rules.ep_divides_experts(ep, experts, dp_shard)
            rules.ep_divides_dp_shard(ep, dp_shard)
            out.append(ep)
        except rules.LayoutError as e:
            if space.ep:
                reject(e)
    return out


def _cp_degrees(rest: int, tp: int, work: Workload, space: SearchSpace, reject,
                experts: int = 0) -> list[int]:
    """cp degrees to try with ``tp``: ``space.cp`` (None: 1, and with ``seq_len >=
    CP_MIN_SEQ_LEN`` every divisor of ``rest`` = world/tp) less those the sequence does not
    split into (seq_len a multiple of 2·cp, each cp rank's seq_len/cp of tp for sequence
    parallelism)."""
    wanted = space.cp or ([1] if work.seq_len < CP_MIN_SEQ_LEN else _divisors(rest))
    out = []
    for cp in wanted:
        try:
            rules.fills_world(ParallelConfig(tp=tp, cp=cp), rest * tp)
            rules.seq_len_over_cp(work.seq_len, cp)
            rules.sequence_parallel_tokens(work.seq_len, cp, tp, not experts)
            out.append(cp)
        except rules.LayoutError as e:
            reject(e)
    return out


def _recompute_options(space: SearchSpace, work: Workload) -> tuple[tuple[str, ...], str]:
    """(recompute modes to try, why one was dropped or ''). Megatron's selective recompute
    under flash attention keeps exactly what no recompute keeps (the attention core is
    already recomputed) at more FLOPs, so it can never win there and is skipped unless asked
    for; threefold's (``threefold.parallel.transforms.recompute``) keeps less, and is searched."""
    if space.recompute:
        return space.recompute, ""
    if work.flash_attention and work.block == "megatron":
        return tuple(r for r in RECOMPUTE_MODES if r != "selective"), \
            "selective recompute: no memory saved under flash attention (never better than none)"
    return RECOMPUTE_MODES, ""


def _with_modules(modes: tuple[str, ...], space: SearchSpace, cfg: ModelConfig,
                  work: Workload) -> list[tuple[str, tuple[str, ...]]]:
    """(mode, recompute modules) pairs: the policies asked for with every mode; the modes as
    asked (a label "selective:a+b" names its modules); else the default, and for selective
    with latent attention DeepSeek-V3's too (its up-projections recomputed: less memory for
    a few matmuls)."""
    if space.recompute_modules is not None:
        return [(m, mods) for m in modes for mods in space.recompute_modules]
    if space.recompute:
        return [recompute_of_label(m) for m in modes]
    out = [(m, ()) for m in modes]
    if "selective" in modes and cfg.kv_lora_rank and work.block == "threefold":
        out.append(("selective", DEEPSEEK_RECOMPUTE))
    return out


def _dp_splits(dp: int, space: SearchSpace, cp: int = 1) -> Iterator[tuple[int, int]]:
    """(zero_stage, dp_replicate): stage 0 is plain DP (dp_replicate 1); stages 1-3 shard over
    dp_shard·cp = dp / dp_replicate · cp > 1, with any dp_replicate (hybrid sharding)."""
    for zero in space.zero_stage:
        if zero == 0:
            if not space.dp_replicate or 1 in space.dp_replicate:
                yield 0, 1
            continue
        for dp_r in space.dp_replicate or _divisors(dp):
            if dp % dp_r == 0 and dp // dp_r * cp > 1:
                yield zero, dp_r


def search(cfg: ModelConfig, cluster: Cluster, work: Workload,
           space: SearchSpace = SearchSpace(), memory_limit: float | None = None,
           keep: int | None = None, **predict_kw) -> PlanResult:
    """Score every layout in ``space`` that fits in memory; best (shortest step) first. With
    ``keep``, layouts are scored in order of their communication-free step time and the search
    stops once that bound exceeds the ``keep``-th best full prediction (same top ``keep``).
    ``predict_kw`` go to ``predict_step`` (e.g. ``overlap_grad_reduce=False``). With
    ``space.cp`` None and a sequence shorter than ``CP_MIN_SEQ_LEN``, cp > 1 is searched only
    if nothing fits without it. When the best layout has cp > 1, ``notes`` says why."""
    if space.tp_overlap < 0 or (space.tp_overlap >= 2 and work.lora_r):
        raise ConfigError(f"--tp-overlap: {space.tp_overlap}: use >= 0 (0 = off), and 0 under "
                          "LoRA (its adapted projections are not overlapped)")
    limit = cluster.hardware.memory_bytes if memory_limit is None else memory_limit
    result = _search(cfg, cluster, work, space, limit, keep, predict_kw)
    if not result.fits and space.cp is None and work.seq_len < CP_MIN_SEQ_LEN \
            and not cfg.num_local_experts:
        wide = dataclasses.replace(space, cp=tuple(_divisors(cluster.num_gpus)))
        retry = _search(cfg, cluster, work, wide, limit, keep, predict_kw)
        if retry.fits:
            retry.notes.insert(0, f"no layout without context parallelism fits at seq_len "
                                  f"{work.seq_len}: searched cp > 1 too")
            return retry
    return result


def _search(cfg: ModelConfig, cluster: Cluster, work: Workload, space: SearchSpace,
            limit: float, keep: int | None, predict_kw: dict) -> PlanResult:
    """One pass of ``search`` over ``space``."""
    result = PlanResult(ranked=[])
    fitting = []
    for lay in enumerate_layouts(cfg, cluster.num_gpus, work, space, result.invalid):
        mem = memory_per_rank(cfg, lay, work, checked=True)  # enumerate_layouts checked it
        if mem.total > limit and space.pipeline_inflight is None:
            lay, mem = _fitting_bound(cfg, lay, work, limit, mem)
        if mem.total > limit:
            why = (f"needs {mem.total / 1e9:.1f} GB > {limit / 1e9:.0f} GB on stage {mem.stage}"
                   f" (states {mem.model_states / 1e9:.1f}, activations "
                   f"{(mem.activations + mem.recompute_working) / 1e9:.1f}, logits "
                   f"{mem.logits / 1e9:.1f})")
            result.too_big.append((lay, mem.total, why))
            continue
        start = startup_peaks(cfg, lay, work, checked=True).startup + RUNTIME_OVERHEAD_BYTES
        if start > limit:  # building the model needs more than its step
            result.too_big.append((lay, start, f"start-up needs {start / 1e9:.1f} GB > "
                                   f"{limit / 1e9:.0f} GB (the largest tensor is drawn whole "
                                   "while the rank's shards fill)"))
            continue
        # ordered by the bound without the bubble (no schedule replayed), which the bound
        # with it (replayed only for the layouts reached) tightens before a prediction
        bound = compute_bound_step_time(cfg, lay, work, cluster, bubble=False) if keep else 0.0
        fitting.append((bound, lay, mem))
    result.fits = len(fitting)
    fitting.sort(key=lambda x: x[0])
    best: list[float] = []  # the keep smallest step times so far, as a max-heap
    for bound, lay, mem in fitting:
        if keep and len(best) >= keep and bound >= -best[0]:
            break
        if keep and len(best) >= keep and lay.pp > 1 \
                and compute_bound_step_time(cfg, lay, work, cluster) >= -best[0]:
            continue
        step = predict_step(cfg, lay, work, cluster, **predict_kw, checked=True)
        result.ranked.append(Candidate(lay, mem, step,
                                       layout_warnings(cfg, lay, mem, step, cluster, work),
                                       pipeline_layers(cfg, lay)))
        if keep:
            heapq.heappush(best, -step.step_time_s)
            if len(best) > keep:
                heapq.heappop(best)
    result.ranked.sort(key=lambda c: (c.step.step_time_s, c.memory.total))
    if keep:
        del result.ranked[keep:]
    if result.ranked and result.ranked[0].layout.cp > 1:
        result.notes.append(_why_cp(cfg, cluster, work, result, fitting, limit, predict_kw))
    return result


def _why_cp(cfg: ModelConfig, cluster: Cluster, work: Workload, result: PlanResult,
            fitting: list, limit: float, predict_kw: dict) -> str:
    """Why the best layout splits sequences over cp: no cp = 1 layout fits (what the
    smallest needs), or the best cp = 1 layout (found with the same pruning) and how much
    slower it is."""
    best = result.ranked[0]
    head = f"cp={best.layout.cp} ({best.layout.cp_algorithm}) at seq_len {work.seq_len}: "
    plain = [(bound, lay, mem) for bound, lay, mem in fitting if lay.cp == 1]
    if not plain:
        big = [r for r in result.too_big if r[0].cp == 1]
        if not big:
            return head + "no layout with cp = 1 was searched"
        lay, total, why = min(big, key=lambda r: r[1])
        return head + (f"no layout with cp = 1 fits in {limit / 1e9:.0f} GB; the smallest "
                       f"(tp={lay.tp} pp={lay.pp} zero={lay.zero_stage} "
                       f"mbs={lay.microbatch_size} recompute={lay.recompute_label}) {why}")
    top = None
    for bound, lay, mem in sorted(plain, key=lambda x: x[0]):
        if top is not None and bound >= top.step.step_time_s:
            break
        step = predict_step(cfg, lay, work, cluster, **predict_kw)
        if top is None or step.step_time_s < top.step.step_time_s:
            top = Candidate(lay, mem, step, ())
    lay = top.layout
    slower = top.step.step_time_s / best.step.step_time_s - 1
    return head + (f"the best layout with cp = 1 (tp={lay.tp} pp={lay.pp} vpp={lay.vpp} "
                   f"zero={lay.zero_stage} mbs={lay.microbatch_size} recompute="
                   f"{lay.recompute}) is {slower:.0%} slower ({explain(best, top)})")
