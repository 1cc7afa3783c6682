"""What LoRA (``threefold.lora``) changes in a rank's memory, for the dry run.

The units are read off the meta model as the runtime builds it (the adapters applied, tensor
parallelism slicing both the base and the adapters, ``threefold.parallel.parallelize.
zero_units`` grouping): per unit, the parameters that train (the adapters) and those that are
frozen (the base). Then:

- what trains holds weights, gradients and AdamW state as any run's parameters do
  (``plan.memory._model_states`` on the adapter units: sharded by ZeRO as usual);
- the frozen base holds weights only: whole in the compute dtype under ZeRO 0-2; under ZeRO-3
  a float32 shard of each unit plus, while in use, the gathered unit and the one prefetched;
  no gradient, no optimiser state, no gradient bucket;
- activations: an adapted layer also keeps its adapter's low-rank activation x·Aᵀ, r values
  per token in the matmul dtype (its input is the one the base layer keeps). That is the
  whole difference when every linear layer is adapted (the default); with fewer targets the
  frozen layers that are not adapted keep less than counted (their inputs are not needed),
  so the count is an upper bound. Autocast's copies of the adapters are counted with the
  weights' casts.

tests/test_lora.py measures the model states of a run against this count.
"""

from __future__ import annotations

import dataclasses

import torch

from threefold.accounting.layout import Layout, Workload, microbatches
from threefold.config import Config, ModelConfig
from threefold.config.validation import lora_targets
from threefold.lora import apply_lora
from threefold.model import LlamaForCausalLM
from threefold.parallel.parallelize import zero_units
from threefold.parallel.tensor import apply_tensor_parallel
from threefold.plan.activations import inflight_microbatches
from threefold.plan.memory import MemoryBreakdown, _model_states, _unit_totals
from threefold.plan.states import state_bytes_for


def lora_units(mcfg: ModelConfig, cfg: Config, layout: Layout, comm) -> tuple[tuple, tuple]:
    """(the adapter units, the frozen base's units) of one rank, each a tuple of per-unit
    parameter sizes in forward order, read off the meta model (``comm``: a meta
    communication layer giving the tp degree)."""
    with torch.device("meta"):
        model = apply_lora(LlamaForCausalLM(mcfg), cfg.lora)
    if layout.tp > 1:
        apply_tensor_parallel(model, comm, cfg.parallel.sequence_parallel)
    modules, _ = zero_units(model, 1)
    seen: set[int] = set()
    trained, frozen = [], []
    for module in modules:
        t, f = [], []
        for p in module.parameters():
            if id(p) in seen:  # a tied weight: once, where first used
                continue
            seen.add(id(p))
            (t if p.requires_grad else f).append(p.numel())
        if t:
            trained.append(tuple(t))
        if f:
            frozen.append(tuple(f))
    return tuple(trained), tuple(frozen)


def adapter_activation_bytes(mcfg: ModelConfig, cfg: Config, layout: Layout,
                             work: Workload) -> float:
    """Bytes one block's adapters keep per microbatch: r activations per token per adapted
    layer, in the matmul dtype (per rank: a row-parallel layer's x·Aᵀ is of its columns,
    still r wide)."""
    per_layer = len(lora_targets(cfg.lora)) * cfg.lora.r
    return layout.microbatch_size * work.seq_len * per_layer * work.act_bytes


def lora_memory(mcfg: ModelConfig, cfg: Config, layout: Layout, work: Workload,
                base: MemoryBreakdown, units: tuple[tuple, tuple]) -> MemoryBreakdown:
    """``base`` (the breakdown of the same run without LoRA) with LoRA's model states and
    activations (module doc); ``units``: ``lora_units``'s (adapter, frozen) units."""
    trained, frozen = units
    state = state_bytes_for(work)
    m = microbatches(layout, work)
    states = _model_states(layout, work, state, trained, m)
    z, n = layout.zero_stage, layout.shard_size
    psi, padded, largest = _unit_totals(frozen, n if z else 1)
    if z == 3:
        states["params"] += padded / n * 4  # float32 shards
        states["zero3_working"] += 2 * largest * work.weight_bytes
    else:
        states["params"] += psi * work.weight_bytes
    inflight = inflight_microbatches(layout.pipeline_schedule, layout.pp, m, layout.vpp, 0,
                                     layout.pipeline_inflight)
    extra = adapter_activation_bytes(mcfg, cfg, layout, work) * mcfg.num_hidden_layers
    return dataclasses.replace(base, activations=base.activations + extra * inflight,
                               **states)
