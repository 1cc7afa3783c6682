"""`threefold plan`: rank every parallel layout of a model on a cluster by predicted step time.

The search enumerates (dp_replicate, dp_shard, cp, cp_algorithm, tp, pp, vpp, zero_stage,
microbatch_size, recompute) whose product is the world and which divide the model and the
batch, drops those
that do not fit in memory (keeping the reason), scores the rest with ``threefold.cost`` and
``threefold.memory``, and explains the ranking. Imports no torch: the 1024-GPU search for a
70B model takes a second or two.

Conventions: tensor parallelism runs with sequence parallelism; zero_stage 0 means plain data
parallelism over dp_shard (dp_replicate = 1); vpp > 1 means interleaved 1F1B; mesh axes are
ordered pp, dp_replicate, dp_shard, cp, tp (outermost first), so tp stays inside a node when it
can, and a layout whose tp group crosses nodes is flagged.

Context parallelism (cp > 1, each sequence split over cp ranks) multiplies the search by the
cp degrees times the two algorithms, and only pays at long sequences, so it is searched only
when ``seq_len >= CP_MIN_SEQ_LEN``, or when no layout without it fits in memory (the search
then runs again with it), or when asked for (``SearchSpace.cp``, ``--cp``). cp takes the
divisors of world/tp for which seq_len divides by 2·cp and each cp rank's tokens by tp. When
the best layout uses cp, ``PlanResult.notes`` says why: no cp = 1 layout fits (and what the
smallest needs), or how much slower the best one without cp is. Memory is threefold's runtime's
(``threefold.memory``), numerics the published mixed-precision ones (``Workload``).

The hardware is a catalogue GPU (``--gpu``, overridable) or this machine as measured by
``--calibrate`` (``threefold.calibrate``), read back with ``--hardware-file``.

A mixture of experts (``model.num_local_experts``, threefold.moe) is planned as the runtime
runs it (threefold.parallel.expert): the search adds the expert-parallel degree ep (every
divisor of the experts that divides dp_shard, ``SearchSpace.ep``, ``--ep``); tp runs without
sequence parallelism (the MoE is whole on every tp rank) and cp is not searched (the runtime
refuses MoE with cp). Memory counts every expert a rank holds (E/ep per block, sharded by
ZeRO over dp_shard/ep: ``memory_per_rank``); FLOPs and MFU the active parameters (the router
and k experts per token); the ep all-to-alls are the uniform-routing expectation, exposed on
the link the ep axis crosses (an ep group that leaves the node is flagged).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from threefold.config import MODEL_PRESETS, ConfigError, ModelConfig, load_config
from threefold.cost import (
    RECOMPUTE,
    Layout,
    LayoutError,
    StepPrediction,
    Workload,
    _distinct_stages,
    active_parameters,
    check_layout,
    compute_bound_step_time,
    local_seq_len,
    microbatches,
    num_parameters,
    predict_step,
    rank_layers,
    stage_expert_units,
    stage_units,
    tp_shard,
)
from threefold.hardware import GPUS, Cluster, Hardware, get_hardware
from threefold.memory import (
    HOST_GRAD_BYTES,
    HOST_MASTER_BYTES,
    RUNTIME_OVERHEAD_BYTES,
    MemoryBreakdown,
    StateBytes,
    inflight_microbatches,
    memory_per_gpu,
    stage_memory,
    state_bytes_for,
)

JSON_KEYS = ("tp", "pp", "dp_replicate", "dp_shard", "ep", "cp", "cp_algorithm", "zero_stage", "vpp",
             "microbatch_size",
             "recompute", "offload_optimizer", "memory_bytes_per_gpu",
             "host_memory_bytes_per_gpu", "step_time_s", "tokens_per_second_per_gpu",
             "tflops_per_gpu", "mfu", "bubble_fraction", "warnings")
BUBBLE_WARN = 0.20
MEMORY_WARN = 0.95
MAX_MICROBATCH = 16
CP_MIN_SEQ_LEN = 32768  # shorter sequences: cp only when nothing fits without it
CP_ALGORITHMS = ("ring", "allgather")


@dataclass(frozen=True)
class SearchSpace:
    """Values each knob may take; None = every value that divides the world and the model
    (microbatch sizes: the divisors of each replica's batch up to ``MAX_MICROBATCH``)."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    vpp: tuple[int, ...] | None = None
    dp_replicate: tuple[int, ...] | None = None
    zero_stage: tuple[int, ...] = (0, 1, 2, 3)
    microbatch_size: tuple[int, ...] | None = None
    recompute: tuple[str, ...] | None = None  # None: all, less selective under flash
    # None: cp = 1, and every fitting cp degree when seq_len >= CP_MIN_SEQ_LEN (or when
    # nothing fits without cp; see ``search``)
    cp: tuple[int, ...] | None = None
    cp_algorithm: tuple[str, ...] = CP_ALGORITHMS
    # optimiser state in host memory (threefold.parallel.offload): (False,) = never, (True,)
    # = every layout offloads, (False, True) = search both
    offload_optimizer: tuple[bool, ...] = (False,)
    # expert-parallel degrees (a mixture of experts only); None: every divisor of the experts
    # that divides dp_shard
    ep: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Candidate:
    """A layout that fits, with its prediction and warnings."""

    layout: Layout
    memory: MemoryBreakdown
    step: StepPrediction
    warnings: tuple[str, ...]


@dataclass
class PlanResult:
    """Ranked candidates (best first), the layouts that do not fit (with why), and counts of
    layouts the model or batch does not divide, by reason. ``fits`` counts every layout that
    fits; with ``search(keep=k)`` only the best k are scored in full (``ranked``), the others
    being provably slower (their communication-free time already exceeds the k-th best)."""

    ranked: list[Candidate]
    too_big: list[tuple[Layout, float, str]] = field(default_factory=list)
    invalid: dict[str, int] = field(default_factory=dict)
    fits: int = 0
    notes: list[str] = field(default_factory=list)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(cfg: ModelConfig, world: int, work: Workload,
                      space: SearchSpace = SearchSpace(),
                      invalid: dict[str, int] | None = None) -> Iterator[Layout]:
    """Every layout in ``space`` that uses exactly ``world`` ranks and passes
    ``check_layout``; the reasons others fail are counted into ``invalid``."""
    invalid = {} if invalid is None else invalid

    def reject(reason: str, n: int = 1) -> None:
        """Count ``n`` layouts skipped for ``reason``."""
        invalid[reason] = invalid.get(reason, 0) + n

    recompute, dropped = _recompute_options(space, work)
    experts = cfg.num_local_experts or 0
    for tp in space.tp or _divisors(world):
        if world % tp:
            reject(f"tp={tp} does not divide {world} GPUs")
            continue
        try:
            tp_shard(cfg, tp)
        except LayoutError as e:
            reject(str(e))
            continue
        for cp in _cp_degrees(world // tp, tp, work, space, reject, bool(experts)):
            algorithms = ("ring",) if cp == 1 else space.cp_algorithm
            for pp in space.pp or _divisors(world // (tp * cp)):
                if (world // (tp * cp)) % pp:
                    reject(f"tp·cp·pp={tp * cp * pp} does not divide {world} GPUs")
                    continue
                if cfg.num_hidden_layers % pp:
                    reject(f"pp={pp} does not divide the {cfg.num_hidden_layers} layers")
                    continue
                dp = world // (tp * cp * pp)
                per_replica, rem = divmod(work.global_batch, dp)
                if rem or not per_replica:
                    reject(f"dp={dp} does not divide the global batch of {work.global_batch}")
                    continue
                vpps = space.vpp or ([1] if pp == 1 else
                                     _divisors(cfg.num_hidden_layers // pp))
                splits = list(_dp_splits(dp, space, cp))
                sizes = space.microbatch_size or [b for b in _divisors(per_replica)
                                                  if b <= MAX_MICROBATCH]
                if dropped:
                    reject(dropped, len(vpps) * len(splits) * len(sizes) * len(algorithms))
                for alg, vpp, (zero, dp_r), mbs, rc, off in itertools.product(
                        algorithms, vpps, splits, sizes, recompute, space.offload_optimizer):
                    for ep in _ep_degrees(experts, dp // dp_r, space, reject):
                        lay = Layout(tp=tp, pp=pp, dp_replicate=dp_r, dp_shard=dp // dp_r,
                                     zero_stage=zero, vpp=vpp, microbatch_size=mbs,
                                     recompute=rc, cp=cp, cp_algorithm=alg,
                                     offload_optimizer=off, ep=ep,
                                     sequence_parallel=not experts)
                        try:
                            check_layout(cfg, lay, work)
                        except LayoutError as e:
                            reject(_generic(str(e)))
                            continue
                        yield lay


def _ep_degrees(experts: int, dp_shard: int, space: SearchSpace, reject) -> list[int]:
    """Expert-parallel degrees to try: 1 for a dense model; else ``space.ep`` (None: every
    divisor of the experts) less those that do not divide dp_shard (ep ranks are part of
    it; counted as skipped only when asked for)."""
    if not experts:
        return [1]
    out = []
    for ep in space.ep or _divisors(experts):
        if experts % ep == 0 and dp_shard % ep == 0:
            out.append(ep)
        elif space.ep:
            reject(f"ep={ep} does not divide both the {experts} experts and dp_shard")
    return out


def _cp_degrees(rest: int, tp: int, work: Workload, space: SearchSpace, reject,
                moe: bool = False) -> list[int]:
    """cp degrees to try with ``tp``: ``space.cp`` (None: 1, and with ``seq_len >=
    CP_MIN_SEQ_LEN`` every divisor of ``rest`` = world/tp) less those the sequence does not
    split into (seq_len a multiple of 2·cp, each cp rank's seq_len/cp of tp for sequence
    parallelism). A mixture of experts takes no cp (the runtime refuses it)."""
    wanted = space.cp or ([1] if work.seq_len < CP_MIN_SEQ_LEN or moe else _divisors(rest))
    out = []
    for cp in wanted:
        if moe and cp > 1:
            reject(f"parallel.cp: cp > 1 with a mixture of experts (not supported yet)")
        elif rest % cp:
            reject(f"tp·cp={tp * cp} does not divide the GPUs")
        elif cp > 1 and work.seq_len % (2 * cp):
            reject(f"cp={cp}: seq_len {work.seq_len} is not a multiple of 2·cp")
        elif tp > 1 and not moe and (work.seq_len // cp) % tp:
            reject(f"cp={cp}: seq_len/cp is not a multiple of tp={tp} (sequence parallel)")
        else:
            out.append(cp)
    return out


def _recompute_options(space: SearchSpace, work: Workload) -> tuple[tuple[str, ...], str]:
    """(recompute modes to try, why one was dropped or ''). Under flash attention selective
    recompute keeps exactly what no recompute keeps (the attention core is already
    recomputed) at more FLOPs, so it can never win; it is skipped unless asked for."""
    if space.recompute:
        return space.recompute, ""
    if work.flash_attention:
        return tuple(r for r in RECOMPUTE if r != "selective"), \
            "selective recompute: no memory saved under flash attention (never better than none)"
    return RECOMPUTE, ""


def _generic(reason: str) -> str:
    """Group reasons that differ only in their numbers (for the summary)."""
    if reason.startswith("interleaved"):
        return "interleaved 1F1B needs microbatches a multiple of pp"
    return reason


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


# --------------------------------------------------------------------------------------------
# Memory of a mixture of experts (what threefold.memory does not count yet)
# --------------------------------------------------------------------------------------------
def moe_block_extra_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """Bytes one MoE block keeps for backward per microbatch on one rank beyond what
    ``threefold.memory.block_activation_bytes`` counts for a dense block (whose SwiGLU term
    4·d·f and MLP-input casts it replaces). Measured on ``threefold.moe.SparseMoeBlock``
    (autograd's saved tensors, fp32 and bf16 autocast; tests/test_plan_moe.py), per token:
    k rows of 4·d·f (its experts' SwiGLU) + (4 + 2d)·h (the rows as the experts' matmul
    keeps them, their output, the fp32 product with the router weight) + 32 (indices and
    weights); the router's fp32 probabilities and logits 8·E + 8; under autocast the
    router's cast input d·h. A shared expert adds a dense SwiGLU's 4·d·f_s + 3·d·h (not
    measured). Under ep a rank computes the rows routed to its experts: N·k in expectation
    (uniform routing). 0 for a dense model. The MoE is whole on every tp rank."""
    e, k = cfg.num_local_experts or 0, cfg.num_experts_per_tok or 0
    if not e:
        return 0.0
    h, f, d, r = cfg.hidden_size, cfg.intermediate_size, work.act_bytes, work.resid_bytes
    fs = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    tokens = layout.microbatch_size * local_seq_len(layout, work)
    moe = k * (4 * d * f + (4 + 2 * d) * h + 32) + 8 * e + 8 + (0 if r == d else d * h)
    if fs:
        moe += 4 * d * fs + 3 * d * h
    dense = 4 * d * tp_shard(cfg, layout.tp).ffn + (0 if r == d else 2 * d * h)
    return float(tokens * (moe - dense))


def moe_cast_weight_bytes(cfg: ModelConfig, layout: Layout, work: Workload, stage: int) -> float:
    """Under autocast with weights wider than the matmul dtype, the MoE weights cast for one
    microbatch and kept for backward (``threefold.memory.cast_weight_bytes`` counts the dense
    ones): every local expert that gets a row (all E/ep of them, in expectation), the router,
    a shared expert; d bytes each."""
    e = cfg.num_local_experts or 0
    d = work.act_bytes
    if not e or work.weight_bytes <= d:
        return 0.0
    h, f = cfg.hidden_size, cfg.intermediate_size
    fs = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    per_layer = e // layout.ep * 3 * h * f + e * h + (3 * h * fs + h if fs else 0)
    return float(d * per_layer * rank_layers(cfg, layout, stage))


def memory_per_rank(cfg: ModelConfig, layout: Layout, work: Workload,
                    state: StateBytes | None = None,
                    overhead_bytes: float = RUNTIME_OVERHEAD_BYTES) -> MemoryBreakdown:
    """``threefold.memory.memory_per_gpu``, and for a mixture of experts what it does not
    count: the MoE blocks' activations and cast weights (``moe_block_extra_bytes``,
    ``moe_cast_weight_bytes``) and, under expert parallelism, the expert tensors, which
    ``cost.stage_units`` leaves out of the dense units: each rank holds E/ep experts per
    block, plain data parallelism keeps them whole (weights, gradients, their own gradient
    buckets, optimiser state), ZeRO shards each block's experts as one unit over
    dp_shard/ep ranks (padded to a multiple of it), with the dense units' rules per stage
    (see ``threefold.memory._stage_memories``). A dense model's figure is unchanged."""
    if not cfg.num_local_experts:
        return memory_per_gpu(cfg, layout, work, state, overhead_bytes)
    state = state or state_bytes_for(work)
    return max((_moe_stage_memory(cfg, layout, work, st, state, overhead_bytes)
                for st in _distinct_stages(cfg, layout)), key=lambda mb: mb.total)


def _moe_stage_memory(cfg: ModelConfig, layout: Layout, work: Workload, stage: int,
                      state: StateBytes, overhead_bytes: float) -> MemoryBreakdown:
    mem = stage_memory(cfg, layout, work, stage, state, overhead_bytes)
    m = microbatches(layout, work)
    inflight = inflight_microbatches(layout.pipeline_schedule, layout.pp, m, layout.vpp, stage)
    extra = moe_block_extra_bytes(cfg, layout, work)
    ch: dict[str, float] = {}
    if layout.recompute == "full":  # blocks keep their input; the recomputed one all of it
        ch["recompute_working"] = mem.recompute_working + extra
    else:
        ch["activations"] = mem.activations + extra * rank_layers(cfg, layout, stage) * inflight
    ch["cast_weights"] = mem.cast_weights + moe_cast_weight_bytes(cfg, layout, work,
                                                                  stage) * inflight
    units = stage_expert_units(cfg, layout, stage)
    if units:  # ep > 1: the expert units, sharded over edp_shard = dp_shard/ep under ZeRO
        p, g, o = state.param, state.grad, state.optimizer
        z, n, ne = layout.zero_stage, layout.shard_size, layout.edp_shard
        psi = sum(sum(u) for u in units)
        unit = sum(units[0])
        padded = -(-unit // ne) * ne * len(units)
        largest = max(sum(u) for u in stage_units(cfg, layout, stage))
        bigger = max(0, unit - largest)  # the largest unit, if an expert unit is larger
        bigger_shard = max(0, -(-unit // ne) - -(-largest // n))
        owned = psi if z == 0 else padded / ne
        params, opt = mem.params, mem.optimizer
        grads, in_bwd, zero3 = mem.grads, mem.grads_in_backward, mem.zero3_working
        buffers, temp = mem.buffers, mem.optimizer_working
        opt_e = owned * o
        if z == 0:
            params += psi * p
            grads += psi * g
            buffers += psi * g  # the experts' gradient buckets (over edp)
            in_bwd += psi * g if m > 1 else 0.0
            temp_e = 2 * bigger * p
        elif z in (1, 2):
            params += padded * p + (0 if state.master_in_optimizer else owned * p)
            grads += (padded + bigger) * g if z == 1 else \
                (owned + (3 * bigger if z == 2 else 0)) * g
            in_bwd += psi * g if m > 1 else 0.0
            temp_e = 2 * bigger_shard * p
        else:
            params += owned * p
            grads += (owned + 3 * bigger) * g
            in_bwd += owned * g if m > 1 else 0.0
            zero3 += unit * p  # the block's experts, gathered beside its dense unit
            temp_e = 2 * bigger_shard * p
        host, host_temp = mem.host, mem.host_working
        if layout.offload_optimizer:
            if z in (1, 2) and state.master_in_optimizer:
                params += owned * p  # the device shard, no longer the master
            host += owned * (o + HOST_GRAD_BYTES
                             + (0 if state.master_in_optimizer else HOST_MASTER_BYTES))
            host_temp += temp_e / p * HOST_MASTER_BYTES
            opt_e = temp_e = 0.0
        ch.update(params=params, optimizer=opt + opt_e, grads=grads, grads_in_backward=in_bwd,
                  zero3_working=zero3, buffers=buffers, optimizer_working=temp + temp_e,
                  host=host, host_working=host_temp)
    return dataclasses.replace(mem, **ch)


def moe_notes(cfg: ModelConfig, top: list[Candidate]) -> list[str]:
    """What a user of a mixture of experts should know about the planned figures."""
    if not cfg.num_local_experts:
        return []
    notes = ["mixture of experts: ep all-to-all bytes and time are the uniform-routing "
             "expectation (each rank sends (ep-1)/ep of its N·k token-expert rows each way); "
             "real routing is uneven; tp runs without sequence parallelism (the MoE is whole "
             "on every tp rank)"]
    if any(c.layout.pp > 1 for c in top) and cfg.router_aux_loss_coef > 0 \
            and not cfg.router_aux_loss_per_layer:
        notes.append("pp > 1 with a mixture of experts: set model.router_aux_loss_per_layer "
                     "true (the runtime needs the load-balancing loss per layer)")
    return notes


def layout_warnings(cfg: ModelConfig, lay: Layout, mem: MemoryBreakdown, step: StepPrediction,
                    cluster: Cluster) -> tuple[str, ...]:
    """What a user should know before launching ``lay``."""
    out = []
    if "tp" in step.inter_node_axes:
        out.append(f"tp crosses nodes (tp={lay.tp} > {cluster.gpus_per_node} GPUs per node)")
    if "cp" in step.inter_node_axes:
        out.append(f"cp crosses nodes (cp·tp={lay.cp * lay.tp} > {cluster.gpus_per_node} GPUs "
                   "per node): K/V move over the network")
    if "ep" in step.inter_node_axes:
        out.append(f"ep crosses nodes (ep·tp={lay.ep * lay.tp} > {cluster.gpus_per_node} GPUs "
                   "per node): the all-to-alls of every MoE layer go over the network")
    if step.bubble_fraction > BUBBLE_WARN:
        out.append(f"pipeline bubble {step.bubble_fraction:.0%} > {BUBBLE_WARN:.0%}")
    if mem.total > MEMORY_WARN * cluster.hardware.memory_bytes:
        out.append(f"within {1 - MEMORY_WARN:.0%} of the memory limit")
    if lay.offload_optimizer:
        out.append(f"optimizer offload: {mem.host_total * cluster.gpus_per_node / 1e9:.0f} GB "
                   f"of host memory per node ({mem.host_total / 1e9:.1f} per GPU), "
                   f"{step.offload_s:.2f} s of PCIe copies per step")
    sh = tp_shard(cfg, lay.tp)
    if sh.kv_replicas > 1:
        out.append(f"{cfg.num_key_value_heads} kv heads replicated {sh.kv_replicas}x over tp")
    if cfg.intermediate_size % lay.tp:
        out.append(f"intermediate size {cfg.intermediate_size} padded to {sh.ffn}·tp")
    return tuple(out)


def search(cfg: ModelConfig, cluster: Cluster, work: Workload,
           space: SearchSpace = SearchSpace(), memory_limit: float | None = None,
           keep: int | None = None, **predict_kw) -> PlanResult:
    """Score every layout in ``space`` that fits in memory; best (shortest step) first. With
    ``keep``, layouts are scored in order of their communication-free step time and the search
    stops once that bound exceeds the ``keep``-th best full prediction (same top ``keep``).
    ``predict_kw`` go to ``predict_step`` (e.g. ``overlap_grad_reduce=False``). With
    ``space.cp`` None and a sequence shorter than ``CP_MIN_SEQ_LEN``, cp > 1 is searched only
    if nothing fits without it. When the best layout has cp > 1, ``notes`` says why."""
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
        mem = memory_per_rank(cfg, lay, work)
        if mem.total > limit:
            why = (f"needs {mem.total / 1e9:.1f} GB > {limit / 1e9:.0f} GB on stage {mem.stage}"
                   f" (states {mem.model_states / 1e9:.1f}, activations "
                   f"{(mem.activations + mem.recompute_working) / 1e9:.1f}, logits "
                   f"{mem.logits / 1e9:.1f})")
            result.too_big.append((lay, mem.total, why))
            continue
        bound = compute_bound_step_time(cfg, lay, work, cluster) if keep else 0.0
        fitting.append((bound, lay, mem))
    result.fits = len(fitting)
    fitting.sort(key=lambda x: x[0])
    best: list[float] = []  # the keep smallest step times so far, as a max-heap
    for bound, lay, mem in fitting:
        if keep and len(best) >= keep and bound >= -best[0]:
            break
        step = predict_step(cfg, lay, work, cluster, **predict_kw)
        result.ranked.append(Candidate(lay, mem, step, layout_warnings(cfg, lay, mem, step,
                                                                       cluster)))
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
                       f"mbs={lay.microbatch_size} recompute={lay.recompute}) {why}")
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


# --------------------------------------------------------------------------------------------
# Explaining and printing
# --------------------------------------------------------------------------------------------
def _terms(c: Candidate) -> dict[str, float]:
    s = c.step
    return {"compute": s.compute_s, "bubble": s.bubble_s, "tp comm": s.tp_exposed_s,
            "pp comm": s.pp_exposed_s, "cp comm": s.cp_exposed_s, "ep comm": s.ep_exposed_s,
            "dp comm": s.dp_exposed_s}


def explain(best: Candidate, other: Candidate) -> str:
    """Why ``other`` is slower than ``best``: the terms of its step time that are larger,
    biggest first, with what in the layout makes them so."""
    if other is best:
        return "best: shortest predicted step"
    tb, to = _terms(best), _terms(other)
    deltas = sorted(((to[k] - tb[k], k) for k in tb), reverse=True)
    lost = other.step.step_time_s - best.step.step_time_s
    if lost <= 1e-4 * best.step.step_time_s:
        return "ties with the best (predicted step within 0.01%)"
    parts = [f"{k} +{d * 1e3:.1f} ms" for d, k in deltas if d > 0.1 * max(lost, 1e-9)]
    gains = [f"{k} -{-d * 1e3:.1f} ms" for d, k in sorted(deltas) if d < -0.1 * max(lost, 1e-9)]
    head = f"{lost * 1e3:.1f} ms slower: " + ", ".join(parts[:3])
    if gains:
        head += " (saves " + ", ".join(gains[:2]) + ")"
    why = _cause(best, other, deltas[0][1])
    saved = best.memory.total - other.memory.total
    tail = f"; uses {saved / 1e9:.1f} GB less per GPU" if saved > 1e9 else ""
    return head + (f" ({why})" if why else "") + tail


def _cause(best: Candidate, other: Candidate, term: str) -> str:
    """A short reason for the largest term difference."""
    b, o = best.layout, other.layout
    if term == "compute":
        if o.recompute != b.recompute:
            return f"recompute {o.recompute} vs {b.recompute}"
        return "more FLOPs on the slowest stage (padding, replicated kv, head imbalance)"
    if term == "bubble":
        return f"pp={o.pp}, vpp={o.vpp}, {other.step.bubble_fraction:.0%} bubble"
    if term == "tp comm":
        crosses = "tp" in other.step.inter_node_axes
        return f"tp={o.tp}" + (" across nodes" if crosses else "")
    if term == "pp comm":
        return f"pp={o.pp}, vpp={o.vpp}"
    if term == "cp comm":
        return f"cp={o.cp} {o.cp_algorithm}" + \
            (" across nodes" if "cp" in other.step.inter_node_axes else "")
    if term == "ep comm":
        return f"ep={o.ep} all-to-alls" + \
            (" across nodes" if "ep" in other.step.inter_node_axes else "")
    if term == "dp comm":
        axis = o.data_axis if o.zero_stage == 0 else o.shard_axis
        return f"zero_stage {o.zero_stage} over {axis}={o.size(axis)}" + \
               (" across nodes" if axis in other.step.inter_node_axes else "")
    return ""


def to_json_rows(cands: list[Candidate]) -> list[dict]:
    """The ``--json`` records, keys exactly ``JSON_KEYS``."""
    rows = []
    for c in cands:
        lay, s = c.layout, c.step
        rows.append({"tp": lay.tp, "pp": lay.pp, "dp_replicate": lay.dp_replicate,
                     "dp_shard": lay.dp_shard, "ep": lay.ep, "cp": lay.cp, "cp_algorithm": lay.cp_algorithm,
                     "zero_stage": lay.zero_stage, "vpp": lay.vpp,
                     "microbatch_size": lay.microbatch_size, "recompute": lay.recompute,
                     "offload_optimizer": lay.offload_optimizer,
                     "memory_bytes_per_gpu": c.memory.total,
                     "host_memory_bytes_per_gpu": c.memory.host_total,
                     "step_time_s": s.step_time_s,
                     "tokens_per_second_per_gpu": s.tokens_per_second_per_gpu,
                     "tflops_per_gpu": s.tflops_per_gpu, "mfu": s.mfu,
                     "bubble_fraction": s.bubble_fraction, "warnings": list(c.warnings)})
    return rows


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def format_table(cands: list[Candidate], explain_all: bool = False,
                 moe: bool | None = None) -> str:
    """The text table of ``cands`` (best first), with warnings and explanations under rows;
    ``moe`` adds the ep column and bytes (None: when some layout has ep > 1)."""
    if moe is None:
        moe = any(c.layout.ep > 1 for c in cands)
    head = (f"{'#':>2} {'tp':>3} {'cp':>6} {'pp':>3} {'vpp':>3} {'dp_r':>4} {'dp_s':>4} "
            + (f"{'ep':>3} " if moe else "")
            + f"{'zero':>4} {'mbs':>3} {'recomp':<9} {'mem GB (states+act+other)':<26} "
            f"{'step s':>8} {'tok/s/GPU':>9} {'TF/s':>6} {'MFU':>5} {'bubble':>6}  "
            + ("GB sent per step: tp/cp/pp/ep/dp|dp_s/dp_r (ep: uniform routing)" if moe else
               "GB sent per step: tp/cp/pp/dp|dp_s/dp_r"))
    lines = [head]
    for i, c in enumerate(cands, 1):
        lay, s, m = c.layout, c.step, c.memory
        other = m.total - m.model_states - m.activations
        mem = f"{_gb(m.total)} ({_gb(m.model_states)}+{_gb(m.activations)}+{_gb(other)})"
        b = s.comm_bytes
        data = b["dp"] + b["dp_shard"] + b["dp_cp"] + b["dp_shard_cp"] + b["edp"] \
            + b["edp_shard"]
        sent = (b["tp"], b["cp"], b["pp"]) + ((b["ep"],) if moe else ()) + \
            (data, b["dp_replicate"])
        comm = "/".join(_gb(x) for x in sent)
        cp = f"{lay.cp}{'r' if lay.cp_algorithm == 'ring' else 'ag'}" if lay.cp > 1 else "1"
        lines.append(
            f"{i:>2} {lay.tp:>3} {cp:>6} {lay.pp:>3} {lay.vpp:>3} {lay.dp_replicate:>4} "
            f"{lay.dp_shard:>4} " + (f"{lay.ep:>3} " if moe else "") + f"{str(lay.zero_stage) + ('o' if lay.offload_optimizer else ''):>4} "
            f"{lay.microbatch_size:>3} "
            f"{lay.recompute:<9} {mem:<26} {s.step_time_s:>8.3f} "
            f"{s.tokens_per_second_per_gpu:>9.0f} {s.tflops_per_gpu:>6.0f} {s.mfu:>5.1%} "
            f"{s.bubble_fraction:>6.1%}  {comm}")
        for w in c.warnings:
            lines.append(f"{'':>6}! {w}")
        if explain_all and i > 1:
            lines.append(f"{'':>6}why not best: {explain(cands[0], c)}")
    return "\n".join(lines)


def _summary(result: PlanResult) -> str:
    lines = []
    if result.too_big:
        lay, total, why = min(result.too_big, key=lambda r: r[1])
        lines.append(f"{len(result.too_big)} layouts do not fit in memory; the smallest "
                     f"(tp={lay.tp} cp={lay.cp} pp={lay.pp} ep={lay.ep} zero={lay.zero_stage} "
                     f"mbs={lay.microbatch_size} recompute={lay.recompute}) {why}")
    for reason, n in sorted(result.invalid.items(), key=lambda kv: -kv[1])[:6]:
        lines.append(f"{n} skipped: {reason}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line and exit 2 (through main) instead of argparse's usage + message."""
        raise _UsageError(message)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers")


def _choices(flag: str, text: str | None, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated subset of ``allowed`` (all of them when ``text`` is empty);
    ConfigError naming ``flag`` for anything else."""
    if not text:
        return allowed
    chosen = tuple(text.split(","))
    bad = [c for c in chosen if c not in allowed]
    if bad:
        raise ConfigError(f"{flag}: '{bad[0]}' is not one of {', '.join(allowed)}")
    return chosen


def build_parser() -> argparse.ArgumentParser:
    """The ``threefold plan`` options."""
    p = _Parser(prog="threefold plan", description="Rank parallel layouts by predicted step "
                "time. Throughput counts recomputation (hardware TF/s, as Narayanan et al. "
                "report); MFU does not (PaLM's definition).")
    p.add_argument("--model", default="llama3-8b",
                   help=f"preset ({', '.join(MODEL_PRESETS)}) or a TOML file with [model]")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in total")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink")
    p.add_argument("--gpu", default="h100", help=f"catalogue entry: {', '.join(GPUS)}")
    p.add_argument("--peak-tflops", type=float, help="override: dense peak TF/s at --precision")
    p.add_argument("--memory-gb", type=float, help="override: GPU memory, GB (1e9 bytes)")
    p.add_argument("--intra-bw-gbps", type=float,
                   help="override: NVLink GB/s per GPU as datasheets state it (both directions"
                   " summed, e.g. 900 for H100)")
    p.add_argument("--inter-bw-gbps", type=float,
                   help="override: network Gb/s (bits) per GPU per direction, e.g. 400")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default min(4096, model))")
    p.add_argument("--global-batch-tokens", type=int, default=4 * 1024 * 1024,
                   help="tokens per optimiser step (a multiple of --seq-len)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16 mixed precision with fp32 Adam (16 bytes/param), or fp32")
    p.add_argument("--attention", choices=("flash", "eager"), default="flash",
                   help="flash: attention probabilities not stored; eager: stored")
    p.add_argument("--top", type=int, default=5, help="layouts to show")
    p.add_argument("--tp", type=_int_list, help="only these tp degrees (comma list)")
    p.add_argument("--pp", type=_int_list, help="only these pp degrees")
    p.add_argument("--zero-stage", type=_int_list, help="only these ZeRO stages")
    p.add_argument("--cp", type=_int_list,
                   help="only these context-parallel degrees (default: 1, and every one that "
                   f"splits the sequence when --seq-len >= {CP_MIN_SEQ_LEN} or nothing fits "
                   "without)")
    p.add_argument("--cp-algorithm", help="only these cp algorithms: ring,allgather")
    p.add_argument("--ep", type=_int_list,
                   help="only these expert-parallel degrees (a mixture of experts; default: "
                   "every divisor of the experts that divides dp_shard)")
    p.add_argument("--recompute", help="only these: none,selective,full")
    p.add_argument("--offload-optimizer", choices=("off", "on", "search"), default="off",
                   help="optimizer state and fp32 master in host memory (ZeRO-Offload): off, "
                        "on for every layout, or search both (zero column marked 'o')")
    p.add_argument("--json", action="store_true", help="print the top layouts as JSON")
    p.add_argument("--explain", action="store_true", help="say why each loses to the best")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (matmul FLOP/s, memory and gloo all-reduce "
                   "bandwidth between local processes), print and save it, and exit")
    p.add_argument("--calibrate-out", default=None,
                   help="where --calibrate saves its JSON (default ~/.cache/threefold/"
                   "calibration.json)")
    p.add_argument("--calibrate-ranks", type=int, default=2,
                   help="local processes the all-reduce is measured between")
    p.add_argument("--hardware-file", default=None,
                   help="plan for the machine measured by --calibrate (that JSON) instead of "
                   "--gpu; every rank of a node shares its cores, memory and bandwidth")
    return p


def load_model(spec: str) -> ModelConfig:
    """A resolved ModelConfig from a preset name or a TOML file's [model] (and [data]) tables."""
    if spec in MODEL_PRESETS:
        cfg = ModelConfig(preset=spec).resolved()
        vocab = 0
    elif Path(spec).suffix == ".toml" or Path(spec).is_file():
        full = load_config(spec, validate_now=False)
        cfg, vocab = full.model.resolved(full.data.vocab_size), full.data.vocab_size
    else:
        raise ConfigError(f"--model: '{spec}' is neither a preset ({', '.join(MODEL_PRESETS)})"
                          " nor a TOML file")
    if not cfg.vocab_size:
        # presets without a vocabulary use the tokenizer's; plan with the default BPE size
        cfg.vocab_size = vocab or 4096
    return cfg


def _hardware(args) -> Hardware:
    if args.hardware_file:
        from threefold.calibrate import hardware_from_calibration, load

        hw = hardware_from_calibration(load(args.hardware_file),
                                       min(args.gpus, args.gpus_per_node))
    else:
        hw = get_hardware(args.gpu)
    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
    return hw.with_overrides(
        peak_flops_16bit=peak if args.precision == "bf16" else None,
        peak_flops_fp32=peak if args.precision == "fp32" else None,
        memory_bytes=None if args.memory_gb is None else args.memory_gb * 1e9,
        intra_node_bw=None if args.intra_bw_gbps is None else args.intra_bw_gbps / 2 * 1e9,
        inter_node_bw=None if args.inter_bw_gbps is None else args.inter_bw_gbps / 8 * 1e9)


def _setup(args):
    cfg = load_model(args.model)
    for name in ("gpus", "gpus_per_node", "top", "global_batch_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1")
    for name in ("peak_tflops", "memory_gb", "intra_bw_gbps", "inter_bw_gbps"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be positive")
    seq = args.seq_len or min(4096, cfg.max_position_embeddings)
    if seq < 1 or seq > cfg.max_position_embeddings:
        raise ConfigError(f"--seq-len: {seq} is outside 1..{cfg.max_position_embeddings} "
                          f"(the model's max_position_embeddings)")
    if args.global_batch_tokens % seq:
        raise ConfigError(f"--global-batch-tokens: {args.global_batch_tokens} is not a multiple "
                          f"of --seq-len {seq}")
    recompute = _choices("--recompute", args.recompute, RECOMPUTE)
    if args.zero_stage and any(z not in (0, 1, 2, 3) for z in args.zero_stage):
        raise ConfigError("--zero-stage: stages are 0, 1, 2, 3")
    for cp in args.cp or ():
        if cp < 1 or args.gpus % cp or (cp > 1 and seq % (2 * cp)):
            raise ConfigError(f"--cp: {cp} must be >= 1, divide --gpus {args.gpus} and (above 1)"
                              f" split --seq-len {seq} into 2·cp equal chunks")
    algorithms = _choices("--cp-algorithm", args.cp_algorithm, CP_ALGORITHMS)
    experts = cfg.num_local_experts or 0
    for ep in args.ep or ():
        if ep < 1 or (ep > 1 and (not experts or experts % ep)):
            raise ConfigError(f"--ep: {ep} must be >= 1 and divide model.num_local_experts="
                              f"{experts}" + ("" if experts else " (a dense model: ep 1 only)"))
    if experts and any(cp > 1 for cp in args.cp or ()):
        raise ConfigError(f"--cp: a mixture of experts (model.num_local_experts={experts}) "
                          "does not train with context parallelism yet; use --cp 1")
    work = Workload(seq_len=seq, global_batch=args.global_batch_tokens // seq,
                    precision=args.precision, flash_attention=args.attention == "flash")
    cluster = Cluster(_hardware(args), args.gpus, min(args.gpus_per_node, args.gpus))
    space = SearchSpace(tp=args.tp, pp=args.pp, zero_stage=args.zero_stage or (0, 1, 2, 3),
                        recompute=recompute if args.recompute else None, cp=args.cp,
                        cp_algorithm=algorithms, ep=args.ep,
                        offload_optimizer={"off": (False,), "on": (True,),
                                           "search": (False, True)}[args.offload_optimizer])
    return cfg, cluster, work, space


def _calibrate(args) -> int:
    """``--calibrate``: measure, print, save."""
    from threefold.calibrate import DEFAULT_PATH, calibrate, save

    if args.calibrate_ranks < 2:
        print("threefold plan: error: --calibrate-ranks: must be >= 2", file=sys.stderr)
        return 2
    record = calibrate(args.calibrate_ranks)
    path = save(record, args.calibrate_out or DEFAULT_PATH)
    print(f"saved {path}; use it with: threefold plan --hardware-file {path} --gpus N "
          f"--gpus-per-node N (N processes on this machine)")
    return 0


def main(argv: list[str]) -> int:
    """``threefold plan ...``: print the top layouts (table or --json). Exit 0 on success,
    1 when no layout fits, 2 on bad input (one line on stderr). ``--calibrate`` measures this
    machine instead (see ``threefold.calibrate``)."""
    try:
        args = build_parser().parse_args(argv)
        if args.calibrate:
            return _calibrate(args)
        cfg, cluster, work, space = _setup(args)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (_UsageError, ConfigError, ValueError) as e:
        print(f"threefold plan: error: {e}", file=sys.stderr)
        return 2
    result = search(cfg, cluster, work, space, keep=args.top)
    top = result.ranked[:args.top]
    if args.json:
        print(json.dumps(to_json_rows(top), indent=1))
    else:
        hw = cluster.hardware
        moe = (f" ({active_parameters(cfg) / 1e9:.2f}B active: {cfg.num_local_experts} experts,"
               f" top-{cfg.num_experts_per_tok})" if cfg.num_local_experts else "")
        print(f"{args.model}: {num_parameters(cfg) / 1e9:.2f}B parameters{moe}, vocab "
              f"{cfg.vocab_size} (padded to a multiple of tp), "
              f"seq {work.seq_len}, {work.global_batch} sequences per step, {work.precision}")
        print(f"{cluster.num_gpus} x {hw.name} ({cluster.gpus_per_node} per node): peak "
              f"{(hw.peak_flops(work.precision) or 0) / 1e12:.0f} TF/s, "
              f"{hw.memory_bytes / 1e9:.0f} GB, NVLink {hw.intra_node_bw * 2 / 1e9:.0f} GB/s, "
              f"network {hw.inter_node_bw * 8 / 1e9:.0f} Gb/s per GPU")
        print(f"{result.fits} layouts fit; top {len(top)} by predicted step time:")
        if top:
            print(format_table(top, explain_all=args.explain, moe=bool(cfg.num_local_experts)))
        summary = _summary(result)
        if summary:
            print(summary)
        for note in result.notes + moe_notes(cfg, top):
            print(f"note: {note}")
    if not result.fits:
        print("threefold plan: no layout fits; " + (_summary(result).splitlines() or [""])[0],
              file=sys.stderr)
        return 1
    return 0
