"""What LoRA (``threefold.lora``) changes in a rank's memory, for the planner and the dry run
(``plan.memory.memory_per_rank`` applies it when ``Workload.lora_r`` > 0).

The units are ``threefold.accounting.lora.lora_units``: per block, the adapters that train,
and the frozen base's units (tests/test_lora.py checks them against the meta model as the
runtime builds it). Then:

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

from threefold.accounting.layout import Layout, Workload, microbatches
from threefold.accounting.lora import lora_units
from threefold.config import ModelConfig
from threefold.plan.activations import inflight_microbatches
from threefold.plan.memory import MemoryBreakdown, _model_states, _unit_totals
from threefold.plan.states import StateBytes


def adapter_activation_bytes(layout: Layout, work: Workload) -> float:
    """Bytes one block's adapters keep per microbatch: r activations per token per adapted
    layer, in the matmul dtype (per rank: a row-parallel layer's x·Aᵀ is of its columns,
    still r wide)."""
    per_layer = len(work.lora_targets) * work.lora_r
    return layout.microbatch_size * work.seq_len * per_layer * work.act_bytes


def lora_memory(cfg: ModelConfig, layout: Layout, work: Workload, base: MemoryBreakdown,
                state: StateBytes) -> MemoryBreakdown:
    """``base`` (the breakdown of the same run without LoRA) with LoRA's model states and
    activations (module doc)."""
    trained, frozen = lora_units(cfg, layout, work, base.stage)
    m = microbatches(layout, work)
    states = _model_states(layout, work, state, trained, m)
    z, n = layout.zero_stage, layout.shard_size
    psi, padded, largest = _unit_totals(frozen, n if z else 1)
    if z == 3:
        states["params"] += padded / n * 4  # float32 shards
        states["zero3_working"] += 2 * largest * work.weight_bytes
    else:
        states["params"] += psi * work.weight_bytes
    inflight = inflight_microbatches(layout.pipeline_schedule, layout.pp, m, layout.vpp,
                                     base.stage, layout.pipeline_inflight)
    extra = adapter_activation_bytes(layout, work) * len(trained)  # one unit per block
    return dataclasses.replace(base, activations=base.activations + extra * inflight,
                               **states)
