"""What a mixture of experts adds to a rank's memory beyond a dense block's: the tensors an MoE
block keeps for backward in place of the SwiGLU's (``moe_block_extra_bytes``), whether the
runtime runs the experts grouped (``grouped_experts_run``: the grouped path keeps its offsets),
and autocast's casts of the experts' weights (``moe_cast_weight_bytes``). ``plan.memory``
adds them per stage."""

from __future__ import annotations

from threefold.accounting import local_seq_len, rank_layers, tp_shard
from threefold.config import ModelConfig
from threefold.families.shapes import grouped_widths_unfit
from threefold.layout import Layout, Workload

def moe_block_extra_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """Bytes one MoE block keeps for backward per microbatch on one rank beyond what
    ``activations.block_activation_bytes`` counts for a dense block (whose SwiGLU term
    3·d·f and MLP-input casts it replaces). Measured on ``threefold.model.moe.SparseMoeBlock``
    (autograd's saved tensors, fp32 and bf16 autocast; tests/test_plan_moe.py), per token:
    k rows of 3·d·f (its experts' SwiGLU, ``threefold.model.kernels.swiglu``) + (4 + 2d)·h (the
    rows as the experts' matmul keeps them, their output, the fp32 product with the router
    weight) + 32 (indices and weights); the router's fp32 probabilities and logits 8·E + 8; under
    autocast the router's cast input d·h. A shared expert adds a dense SwiGLU's 3·d·f_s + 3·d·h (not
    measured). Under ep a rank computes the rows routed to its experts: N·k in expectation
    (uniform routing). 0 for a dense model. The MoE is whole on every tp rank. The grouped
    experts (``grouped_experts_run``) also keep their int32 group offsets, 4 bytes per local
    expert."""
    e, k = cfg.num_local_experts or 0, cfg.num_experts_per_tok or 0
    if not e:
        return 0.0
    offsets = 4 * (e // layout.ep) if grouped_experts_run(cfg, work) else 0
    h, f, d, r = cfg.hidden_size, cfg.intermediate_size, work.act_bytes, work.resid_bytes
    fs = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    tokens = layout.microbatch_size * local_seq_len(layout, work)
    moe = k * (3 * d * f + (4 + 2 * d) * h + 32) + 8 * e + 8 + (0 if r == d else d * h)
    if fs:
        moe += 3 * d * fs + 3 * d * h
    dense = 3 * d * tp_shard(cfg, layout.tp).ffn + (0 if r == d else d * h)
    return float(tokens * (moe - dense) + offsets)


def grouped_experts_run(cfg: ModelConfig, work: Workload) -> bool:
    """Whether the runtime runs the experts grouped (``threefold.model.experts.grouped_mm_unfit``):
    ``model.moe_impl`` grouped, widths that meet the 16-byte rule, and on a GPU bf16 (torch's
    grouped kernel; the planner takes the GPU for one that has it, compute capability 9.x or
    10.x: H100, H200; on A100 or V100 the runtime loops and keeps 4 bytes per local expert
    and MoE layer less than predicted). On a CPU (``work.backend_copies``) any of fp32, bf16,
    fp16 runs grouped, except fp32 under compile (``work.eager`` false), which loops."""
    if getattr(cfg, "moe_impl", "grouped") != "grouped":
        return False
    if grouped_widths_unfit(cfg.hidden_size, cfg.intermediate_size, work.act_bytes):
        return False
    if work.precision == "bf16":
        return True
    return work.backend_copies and work.eager


def moe_cast_weight_bytes(cfg: ModelConfig, layout: Layout, work: Workload, stage: int) -> float:
    """Under autocast with weights wider than the matmul dtype, the MoE weights cast for one
    microbatch and kept for backward (``threefold.plan.memory.cast_weight_bytes`` counts the dense
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
