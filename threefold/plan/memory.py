"""Memory per rank: model states, activations and the engines' buffers, when each exists
(``MemoryBreakdown.total``), per pipeline stage and the per-GPU peak the planner checks
against the device; for a mixture of experts, the experts each rank holds
(``memory_per_rank``). Pure formulas, no torch.

Model states as threefold's engines hold them (``_model_states``; Ψ = this rank's parameters,
N = dp_shard·cp, the ZeRO group, m = microbatches, bytes per element from ``StateBytes``):

- plain / data parallel: Ψ weights, Ψ gradients (freed after every step), the optimiser
  state; data parallel adds its flat gradient buckets, Ψ, for good;
- ZeRO 1/2 (``threefold.parallel.engines.zero``): the full weights live in per-unit flat buffers
  and the owned shard is a separate parameter (a copy of Ψ/N unless it is the fp32 master
  the optimiser state already counts); the optimiser state is Ψ/N; at the end of backward
  stage 1 holds the full .grad (Ψ) and, in ``finish_gradients``, one unit's flat copy
  while the .grad of the units not yet reduced give way to the Ψ/N shard;
  stage 2 frees each unit's .grad once copied for its reduce-scatter, holding the shard
  and ``ZERO_REDUCES_IN_FLIGHT`` + 1 units' full copies at the end of backward, and the
  shard alone at the optimiser step (the copies are reduced and freed before it);
- ZeRO 3: Ψ/N weights, Ψ/N optimiser state, gradients as stage 2; two gathered units
  (the one in use and the one prefetched) while computing; under ``parallel.fp8_all_gather``
  a block's FP8 weights are gathered at one byte each (``gathered_unit_bytes``).
While accumulating (m > 1), the gradients of earlier microbatches are held when the last
backward starts: Ψ, or the Ψ/N shard under stage 3. ZeRO over one rank (N = 1) is the same
engine with nothing to shard.

With ``layout.offload_optimizer`` (threefold.parallel.engines.offload) the optimiser state and the
step's temporaries leave the device: ``optimizer`` and ``optimizer_working`` are 0 and
``host`` holds, per owned parameter (Ψ, or Ψ/N under ZeRO), the optimiser state plus an
fp32 master when the state did not include it, plus the fp32 gradient buffer: 16 bytes
either way. Under ZeRO 1/2 the device keeps the owned shard as a tensor of its own (it
receives the host's update and is all-gathered), ``state.param`` bytes per owned element.
Gradients stay on the device until the step copies them down.

``work.backend_copies``: the collective backend copies an all-gather or reduce-scatter through
a temporary as large as the whole unit (gloo on a CPU; NCCL does not): one more unit at
ZeRO's gathers and reductions. With bf16 parameters (``work.weight_bytes`` 2) gradients
are reduced in ``work.grad_reduce_bytes``: ZeRO-3 casts the unit's gradient first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from threefold.accounting import (layer_parameters_per_rank, microbatches,
                                  rank_layers, stage_expert_units, stage_units)
from threefold.accounting.fp8 import fp8_gathered_numels
from threefold.accounting.lora_counts import lora_units
from threefold.accounting.stages import distinct_stages, rank_dense_layers
from threefold.config import ModelConfig
from threefold.layout import Layout, Workload, check_layout
from threefold.plan.mlp_tiling import tiled_mlp_weights
from threefold.plan.moe_memory import moe_block_extra_bytes, moe_cast_weight_bytes
from threefold.plan.mtp_bytes import mtp_activation_bytes
from threefold.plan.activations import (adapter_activation_bytes, head_inflight_microbatches,
                                        head_saved_bytes, inflight_microbatches, logits_bytes,
                                        microbatch_extra_bytes, model_layer_activation_bytes,
                                        recompute_working_bytes)
from threefold.plan.states import (HOST_GRAD_BYTES, HOST_MASTER_BYTES, RUNTIME_OVERHEAD_BYTES,
                                   ZERO_REDUCES_IN_FLIGHT, StateBytes, state_bytes_for)

def cast_weight_bytes(cfg: ModelConfig, layout: Layout, work: Workload, stage: int) -> float:
    """Under autocast with weights wider than the matmul dtype (threefold's fp32 weights under
    bf16), every linear's weight is cast once per forward and the cast is kept for backward:
    d bytes per matmul weight of the stage's blocks, for one microbatch (``cast_copies_held``:
    how many such sets a rank holds). 0 otherwise.
    (The head's cast is not kept: the chunked loss casts it again in backward, and
    ``activations.logits_bytes`` counts it while the loss runs.)"""
    d = work.act_bytes
    if work.weight_bytes <= d:
        return 0.0
    sharded, _ = layer_parameters_per_rank(cfg, layout.tp)
    return d * (sharded - tiled_mlp_weights(cfg, layout, work)) * rank_layers(cfg, layout, stage)


def cast_copies_held(recompute: str, inflight: int, layers: int) -> float:
    """How many times a stage's cast weights (``cast_weight_bytes``, ``moe_cast_weight_bytes``:
    all ``layers`` of its blocks) are held at the start of the last backward. Each microbatch's
    forward runs in an autocast context of its own, so without recompute every microbatch in
    flight keeps its own casts. Under full or selective recompute the checkpointed forward
    keeps none (autocast's cache is dropped when its context exits); only the block being
    recomputed casts its weights again and keeps them until its backward ends: one block's."""
    return inflight if recompute == "none" else 1 / max(1, layers)


# --------------------------------------------------------------------------------------------
# Per GPU
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on one rank of the worst pipeline stage, by what holds them.

    Not everything is alive at once: gradients are made while activations are freed. The
    peak is the larger of two moments (``total``): the start of the last microbatch's
    backward (activations, logits, gradients kept from earlier microbatches, ZeRO-3's gathered
    units, autocast weight copies) and the end of the backward / the optimiser step (all
    gradients and the optimiser's temporaries), over what always exists (weights, optimiser
    state, the engine's buffers, the flat runtime overhead)."""

    stage: int
    params: float
    grads: float  # gradient bytes at the end of backward
    optimizer: float
    activations: float
    recompute_working: float  # one block's activations while it is recomputed
    logits: float
    zero3_working: float
    overhead: float
    buffers: float = 0.0  # persistent engine buffers (data parallel's gradient buckets)
    grads_in_backward: float = 0.0  # gradient bytes already held when the last backward starts
    cast_weights: float = 0.0
    optimizer_working: float = 0.0  # AdamW's per-tensor temporaries during the step
    # host memory of this rank under optimiser offload (``Layout.offload_optimizer``): fp32
    # master, AdamW state and the gradient buffer; not part of ``total`` (the device's peak)
    host: float = 0.0
    host_working: float = 0.0  # AdamW's temporaries, on the host
    # ZeRO-3: the gradient of the unit whose backward runs (its flat buffer, the cast to
    # parallel.reduce_dtype, the reduce-scatter's output and a CPU backend's copy)
    zero3_grad_working: float = 0.0
    # ZeRO-2/3: the gradient bytes the optimiser step sees, the shards alone (the full unit
    # gradients in flight at the end of backward are reduced and freed before the step); None:
    # ``grads`` (no ZeRO, ZeRO-1: the gradients the step reads are those backward left)
    grads_at_step: float | None = None

    @property
    def host_total(self) -> float:
        """Host bytes this rank needs at the optimiser step (0 without offload)."""
        return self.host + self.host_working

    @property
    def model_states(self) -> float:
        """Weights, gradients and optimiser state."""
        return self.params + self.grads + self.optimizer

    @property
    def activation_peak(self) -> float:
        """What is transient at the start of the last backward."""
        return (self.grads_in_backward + self.activations + self.recompute_working
                + self.logits + self.zero3_working + self.cast_weights
                + self.zero3_grad_working)

    @property
    def step_peak(self) -> float:
        """What is transient at the end of backward or during the optimiser step, whichever
        is larger: every gradient backward left (ZeRO-2/3's in-flight reductions too), or the
        gradients the step reads and its temporaries."""
        at_step = self.grads if self.grads_at_step is None else self.grads_at_step
        return max(self.grads, at_step + self.optimizer_working)

    @property
    def total(self) -> float:
        """The peak: what always exists plus the larger of the transient moments."""
        return (self.params + self.optimizer + self.buffers + self.overhead
                + max(self.activation_peak, self.step_peak))


def stage_memory(cfg: ModelConfig, layout: Layout, work: Workload, stage: int,
                 state: StateBytes | None = None,
                 overhead_bytes: float = RUNTIME_OVERHEAD_BYTES) -> MemoryBreakdown:
    """Peak memory of one rank of pipeline ``stage`` under threefold's engines (see
    ``_stage_memories``). A layout the rule book refuses raises its LayoutError, as in
    ``memory_per_gpu`` and ``memory_per_rank``."""
    check_layout(cfg, layout, work)
    return _stage_memories(cfg, layout, work, [stage], state, overhead_bytes)[0]


def memory_per_gpu(cfg: ModelConfig, layout: Layout, work: Workload,
                   state: StateBytes | None = None,
                   overhead_bytes: float = RUNTIME_OVERHEAD_BYTES) -> MemoryBreakdown:
    """The breakdown of the pipeline stage with the largest peak (stage 0 holds the most
    activations, the last stage the logits and head). A layout the rule book refuses raises
    its LayoutError (``check_layout``) rather than a division by zero deep inside."""
    check_layout(cfg, layout, work)
    return _largest_stage(cfg, layout, work, state, overhead_bytes)


def _largest_stage(cfg: ModelConfig, layout: Layout, work: Workload, state: StateBytes | None,
                   overhead_bytes: float) -> MemoryBreakdown:
    stages = distinct_stages(cfg, layout)
    return max(_stage_memories(cfg, layout, work, stages, state, overhead_bytes), key=lambda mb: mb.total)


@lru_cache(maxsize=65536)
def _unit_totals(units: tuple, n: int) -> tuple[int, int, int]:
    """(parameters, parameters with each unit padded to a multiple of ``n``, largest unit)
    of a stage's units (cached: the planner asks for the same stages thousands of times)."""
    sizes = [sum(u) for u in units]
    return sum(sizes), sum(-(-x // n) * n for x in sizes), max(sizes)


def _stage_memories(cfg: ModelConfig, layout: Layout, work: Workload, stages: list[int],
                    state: StateBytes | None, overhead_bytes: float) -> list[MemoryBreakdown]:
    """The breakdown of each of ``stages``: model states as threefold's engines hold them
    (``_model_states``; the module docstring has the rules), the activations of the
    microbatches the schedule keeps in flight, the last stage's head and loss."""
    state = state or state_bytes_for(work)
    m = microbatches(layout, work)
    per_layer = model_layer_activation_bytes(cfg, layout, work)
    dense = model_layer_activation_bytes(cfg, layout, work, dense=True) - per_layer
    working = recompute_working_bytes(cfg, layout, work)  # the block being recomputed
    extra = microbatch_extra_bytes(cfg, layout, work)
    out = []
    for stage in stages:
        states = _model_states(layout, work, state, stage_units(cfg, layout, stage), m,
                               fp8_gathered_numels(cfg) if work.fp8_gathers(layout) else ())
        inflight = inflight_microbatches(layout.pipeline_schedule, layout.pp, m, layout.vpp,
                                         stage, layout.pipeline_inflight)
        layers = rank_layers(cfg, layout, stage)
        mtp = mtp_activation_bytes(cfg, layout, work) if stage == layout.last_stage else 0.0
        out.append(MemoryBreakdown(
            stage=stage, activations=(per_layer * layers + mtp + extra
                                      + dense * rank_dense_layers(cfg, layout, stage)) * inflight,
            recompute_working=working,
            logits=(logits_bytes(cfg, layout, work)
                    + (head_inflight_microbatches(layout.pipeline_schedule, layout.pp, m) - 1)
                    * head_saved_bytes(cfg, layout, work)
                    if stage == layout.last_stage else 0.0),
            overhead=overhead_bytes,
            cast_weights=cast_weight_bytes(cfg, layout, work, stage)
            * cast_copies_held(layout.recompute, inflight, layers),
            **states))
    return out


def gathered_unit_bytes(unit: tuple[int, ...], n: int, param: float,
                        fp8: tuple[int, ...] = ()) -> float:
    """Bytes of one ZeRO-3 unit while gathered: its parameters in ``param`` bytes, or under
    ``parallel.fp8_all_gather`` (``fp8``: a block's FP8 weights, ``fp8_gathered_numels``) a
    block's whole padded unit as bytes (e4m3 for those weights) plus its other elements in
    ``param`` bytes (``threefold.parallel.engines.fp8_gather``). A block is a unit of several
    tensors (the embedding, final norm and head are units of one)."""
    if not fp8 or len(unit) == 1:
        return sum(unit) * param
    return -(-sum(unit) // n) * n + (sum(unit) - sum(fp8)) * param


def _model_states(layout: Layout, work: Workload, state: StateBytes, units: tuple,
                  m: int, fp8: tuple[int, ...] = ()) -> dict[str, float]:
    """The ``MemoryBreakdown`` fields of one stage's model states (its ZeRO ``units``, ``m``
    microbatches; ``fp8`` a block's weights gathered in 8 bits): weights, gradients,
    optimiser state, the engine's buffers and working copies, and the host's share under
    offload (``_offload``)."""
    z, n = layout.zero_stage, layout.shard_size
    psi, padded, largest = _unit_totals(units, n if z else 1)
    buffers, zero3, in_bwd, unit_grad, at_step = 0.0, 0.0, 0.0, 0.0, None
    if z == 0:
        params, opt, grads = psi * state.param, psi * state.optimizer, psi * state.grad
        buffers = psi * state.grad if layout.dp * layout.cp > 1 else 0.0
        in_bwd = grads if m > 1 else 0.0
        temp = 2 * largest * state.param
    elif z in (1, 2):
        shard_copy = 0 if state.master_in_optimizer else padded / n * state.param
        params, opt = padded * state.param + shard_copy, padded / n * state.optimizer
        grads = (padded + largest) * state.grad
        if z == 2:
            grads = (padded / n + (ZERO_REDUCES_IN_FLIGHT + 1) * largest) * state.grad
            at_step = padded / n * state.grad
        if work.backend_copies:  # the reduce-scatter's whole-unit copy
            grads += largest * state.grad
        in_bwd = psi * state.grad if m > 1 else 0.0
        temp = 2 * -(-largest // n) * state.param
    else:
        params, opt = padded / n * state.param, padded / n * state.optimizer
        grads = (padded / n + (ZERO_REDUCES_IN_FLIGHT + 1) * largest) * state.grad
        at_step = padded / n * state.grad
        in_bwd = padded / n * state.grad if m > 1 else 0.0
        gathered = max(gathered_unit_bytes(u, n, state.param, fp8) for u in units)
        zero3 = 2 * gathered  # the unit in use and the one prefetched
        temp = 2 * -(-largest // n) * state.param
        rb = work.grad_reduce_bytes
        unit_grad = largest * state.grad + (largest * rb if rb != state.grad else 0) \
            + -(-largest // n) * rb
        if work.backend_copies:  # the reduce-scatter's copy, the prefetch's gather copy
            unit_grad += largest * rb + gathered
    out = dict(params=params, optimizer=opt, grads=grads, buffers=buffers,
               grads_in_backward=in_bwd, zero3_working=zero3, optimizer_working=temp,
               zero3_grad_working=unit_grad, grads_at_step=at_step, host=0.0,
               host_working=0.0)
    if layout.offload_optimizer:
        _offload(out, z, psi if z == 0 else padded / n, state)
    return out


def _offload(states: dict[str, float], z: int, owned: float, state: StateBytes) -> None:
    """Move the optimiser state and the step's temporaries of ``owned`` parameters from the
    device's ``states`` to the host's (ZeRO 1/2 keeping the owned shard on the device)."""
    if z in (1, 2) and state.master_in_optimizer:
        states["params"] += owned * state.param  # the device shard, no longer the master
    states["host"] = owned * (state.optimizer + HOST_GRAD_BYTES
                              + (0 if state.master_in_optimizer else HOST_MASTER_BYTES))
    states["host_working"] = states["optimizer_working"] / state.param * HOST_MASTER_BYTES
    states["optimizer"] = states["optimizer_working"] = 0.0


# --------------------------------------------------------------------------------------------
# Memory of a mixture of experts (what the dense accounting above does not count)
# --------------------------------------------------------------------------------------------
def memory_per_rank(cfg: ModelConfig, layout: Layout, work: Workload,
                    state: StateBytes | None = None,
                    overhead_bytes: float = RUNTIME_OVERHEAD_BYTES, *,
                    checked: bool = False) -> MemoryBreakdown:
    """``threefold.plan.memory.memory_per_gpu``, and for a mixture of experts what it does not
    count: the MoE blocks' activations and cast weights (``moe_block_extra_bytes``,
    ``moe_cast_weight_bytes``) and, under expert parallelism, the expert tensors, which
    ``cost.stage_units`` leaves out of the dense units: each rank holds E/ep experts per
    block, plain data parallelism keeps them whole (weights, gradients, their own gradient
    buckets, optimiser state), ZeRO shards each block's experts as one unit over
    dp_shard/ep ranks (padded to a multiple of it), with the dense units' rules per stage
    (see the module docstring). A dense model's figure is unchanged. Under LoRA
    (``work.lora_r``) the model states are the adapters' and the frozen base's
    (``_lora_memory``). A layout the rule book refuses raises its LayoutError; ``checked``:
    the caller has run ``check_layout`` on it already (the search, on every layout it
    enumerates, thousands of times a second)."""
    if not checked:
        check_layout(cfg, layout, work)
    if work.lora_r:  # LoRA runs no mixture of experts (refused before launch)
        state = state or state_bytes_for(work)
        stages = distinct_stages(cfg, layout)
        return max((_lora_memory(cfg, layout, work, mb, state) for mb in
                    _stage_memories(cfg, layout, work, stages, state, overhead_bytes)),
                   key=lambda mb: mb.total)
    if not cfg.num_local_experts:
        return _largest_stage(cfg, layout, work, state, overhead_bytes)
    state = state or state_bytes_for(work)
    return max((_moe_stage_memory(cfg, layout, work, st, state, overhead_bytes)
                for st in distinct_stages(cfg, layout)), key=lambda mb: mb.total)


def _moe_stage_memory(cfg: ModelConfig, layout: Layout, work: Workload, stage: int,
                      state: StateBytes, overhead_bytes: float) -> MemoryBreakdown:
    mem = _stage_memories(cfg, layout, work, [stage], state, overhead_bytes)[0]
    m = microbatches(layout, work)
    inflight = inflight_microbatches(layout.pipeline_schedule, layout.pp, m, layout.vpp, stage,
                                     layout.pipeline_inflight)
    extra, ch = moe_block_extra_bytes(cfg, layout, work), {}
    if layout.recompute != "none":  # the recomputed block holds its MoE's tensors again
        ch["recompute_working"] = mem.recompute_working + extra
    if layout.recompute == "none":  # (selective's kept MoE tensors: in mem.activations)
        ch["activations"] = mem.activations + extra * rank_layers(cfg, layout, stage) * inflight
    ch["cast_weights"] = mem.cast_weights + moe_cast_weight_bytes(cfg, layout, work, stage) \
        * cast_copies_held(layout.recompute, inflight, rank_layers(cfg, layout, stage))
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
        params, opt, buffers, temp = mem.params, mem.optimizer, mem.buffers, mem.optimizer_working
        grads, in_bwd, zero3 = mem.grads, mem.grads_in_backward, mem.zero3_working
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
        at_step = None if mem.grads_at_step is None else mem.grads_at_step + owned * g
        host, host_temp = mem.host, mem.host_working
        if layout.offload_optimizer:
            if z in (1, 2) and state.master_in_optimizer:
                params += owned * p  # the device shard, no longer the master
            host += owned * (o + HOST_GRAD_BYTES
                             + (0 if state.master_in_optimizer else HOST_MASTER_BYTES))
            host_temp += temp_e / p * HOST_MASTER_BYTES
            opt_e = temp_e = 0.0
        ch.update(params=params, optimizer=opt + opt_e, grads=grads, grads_at_step=at_step,
                  grads_in_backward=in_bwd, zero3_working=zero3, buffers=buffers,
                  optimizer_working=temp + temp_e, host=host, host_working=host_temp)
    return dataclasses.replace(mem, **ch)


def _lora_memory(cfg: ModelConfig, layout: Layout, work: Workload, base: MemoryBreakdown,
                 state: StateBytes) -> MemoryBreakdown:
    """``base`` (the breakdown of the same stage without LoRA) with LoRA's model states and
    activations, on ``accounting.lora.lora_units`` (checked against the meta model):

    - the adapters hold weights, gradients and AdamW state as any run's parameters do
      (``_model_states`` on the adapter units: sharded by ZeRO as usual);
    - the frozen base holds weights only: whole in the weights' dtype under ZeRO 0-2; under
      ZeRO-3 a float32 shard of each unit plus, while in use, the gathered unit and the one
      prefetched; no gradient, no optimiser state, no gradient bucket;
    - each block adds ``activations.adapter_activation_bytes``; autocast's copies of the
      adapters are counted with the weights' casts.

    tests/test_lora.py measures a run's weights and AdamW state against this count."""
    trained, frozen = lora_units(cfg, layout, work, base.stage)
    m = microbatches(layout, work)
    states = _model_states(layout, work, state, trained, m)
    z, n = layout.zero_stage, layout.shard_size
    psi, padded, largest = _unit_totals(frozen, n if z else 1)
    if z == 3:  # float32 shards; gathered: the unit in use and the next, prefetched (two
        # units, not twice the largest: a tied embedding of a large vocabulary is one unit)
        states["params"] += padded / n * 4
        sizes = sorted((sum(u) for u in frozen), reverse=True)
        states["zero3_working"] += sum(sizes[:2]) * work.weight_bytes
    else:
        states["params"] += psi * work.weight_bytes
    inflight = inflight_microbatches(layout.pipeline_schedule, layout.pp, m, layout.vpp,
                                     base.stage, layout.pipeline_inflight)
    extra = adapter_activation_bytes(layout, work) * len(trained)  # one unit per block
    return dataclasses.replace(base, activations=base.activations + extra * inflight,
                               **states)
