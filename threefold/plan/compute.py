"""Compute time of a layout: FLOPs per step and per pipeline stage (model and hardware FLOPs,
recomputation included), the memory-bound traffic of the elementwise work, the optimiser step,
offload's PCIe time, and the compute-bound step time. ``MATMUL_EFFICIENCY`` is the one fitted
constant (Narayanan et al. 2021 Table 1).
"""

from __future__ import annotations

import math

from threefold.layout import Layout, Workload
from threefold.accounting import local_seq_len, microbatches
from threefold.accounting.batches import tp_chunks
from threefold.accounting.lora_counts import adapter_numels, lora_flops_per_token, lora_units
from threefold.accounting import (flops_per_token, layer_parameters_per_rank, moe_matmul_parameters,
    tp_shard)
from threefold.accounting.counts import moe_key
from threefold.accounting.stages import distinct_stages, stage_multiplicity
from threefold.accounting import owned_parameters, rank_layers
from threefold.accounting.stages import rank_dense_layers
from threefold.accounting import offload_bytes_per_step
from threefold.config import ModelConfig
from threefold.families.shapes import moe_layers
from threefold.plan.mlp_tiling import tile_recompute_flops
from threefold.plan.selective import recomputed_core, recomputed_matmul_parameters

# The one calibration constant: achieved matmul FLOP/s as a fraction of the datasheet peak.
# Fitted once to Narayanan et al. 2021 Table 1 (ten GPT runs, 1.7B-1T on up to 3072 A100s;
# tests/test_cost.py): predicted/published TF/s per GPU then spans 0.93-1.06 over all rows.
# Everything else in the time model is a datasheet figure or a count (FLOPs, bytes).
# A measured Hardware (``Hardware.measured``) carries achieved FLOP/s and uses 1.0 instead.
MATMUL_EFFICIENCY = 0.58
# The optimiser step as threefold's engines run it — torch's single-tensor AdamW (foreach=False)
# and the gradient-norm clip — is memory-bound: fp32 elements read or written per parameter
# it updates: weight decay 2, first moment 3, second moment 5, the denominator 6, the update 4,
# the squared norm 3, the clipping scale 2.
ADAMW_ACCESSES_PER_PARAM = 25


# --------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------
def model_flops_per_step(cfg: ModelConfig, work: Workload) -> float:
    """Model FLOPs of one step (the MFU numerator, PaLM's definition: no recompute; under
    LoRA the base's weight gradients are not computed: ``lora_flops_per_token``)."""
    return lora_flops_per_token(cfg, work) * work.tokens


def fp8_flops_fraction(cfg: ModelConfig, work: Workload) -> float:
    """The share of a token's forward FLOPs (``flops_per_token`` / 3) that ``train.fp8`` runs
    in FP8: the blocks' q/k/v/o, dense gate/up/down and shared-expert gate/up/down projections
    (``parallel.fp8.TARGETS``, plain linear layers; under latent attention only o, and q
    without a query latent) and the routed experts' two grouped products (``Float8Experts``),
    each where its widths are multiples of 16 (the runtime's rule, ``fp8_eligible``), against
    attention's core, the routers, the latents and the head, which stay in the compute
    dtype. Every recipe runs the same layers."""
    h, hd, heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    ok = lambda *dims: all(x % 16 == 0 for x in dims)  # noqa: E731
    if cfg.kv_lora_rank:
        attn = h * heads * cfg.v_head_dim + (0 if cfg.q_lora_rank else h * heads * hd)
    else:
        q, kv = heads * hd, cfg.num_key_value_heads * hd
        attn = 2 * q * h * ok(q, h) + 2 * kv * h * ok(kv, h)
    moe = moe_layers(cfg)
    dense = cfg.num_hidden_layers - moe
    ffn = (cfg.dense_intermediate_size or cfg.intermediate_size) if cfg.num_local_experts \
        else cfg.intermediate_size
    e, k, fs, *_ = moe_key(cfg)  # every MoE block's shared expert, if any, and k experts
    f = cfg.intermediate_size
    linear = 2 * (attn * cfg.num_hidden_layers + 3 * h * (ffn * dense * ok(ffn, h)
                                                         + fs * moe * ok(fs, h)
                                                         + k * f * moe * ok(f, h) * bool(e)))
    return linear / (flops_per_token(cfg, work.seq_len) / 3)


def fp8_expert_note(cfg: ModelConfig, work: Workload) -> str | None:
    """What a run under ``train.fp8`` should know (None: nothing): routed experts whose widths
    are not multiples of 16 run in the compute dtype, timed at its peak; blockwise is timed
    as a blockwise FP8 kernel would run it, which the runtime's exact reference is not."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    notes = []
    if work.fp8 != "none" and cfg.num_local_experts and (h % 16 or f % 16):
        notes.append(f"train.fp8 {work.fp8}: the routed experts run in {work.precision} "
                     f"(hidden {h} and expert width {f} are not both multiples of 16, FP8's "
                     f"rule), so their FLOPs are timed at the {work.precision} peak")
    if work.fp8 == "blockwise":
        notes.append("train.fp8 blockwise: its FP8 share is timed at the FP8 peak, as a "
                     "blockwise FP8 kernel would run it; threefold's blockwise is an exact "
                     "reference (dequantised operands, one matmul in the compute dtype), no "
                     "faster than bf16 on a GPU")
    return "; ".join(notes) or None


def matmul_peak(cfg: ModelConfig, work: Workload, hw) -> float | None:
    """The matmul peak FLOP/s a step runs at: the ``work.precision`` peak, or under FP8 one
    rate for the mix (time = FP8 share / FP8 peak + the rest / the 16-bit peak); None when a
    needed peak is unknown. A GPU without FP8 units refuses FP8 (ValueError naming
    train.fp8)."""
    peak = hw.peak_flops(work.precision)
    if work.fp8 == "none" or not peak:
        return peak
    fp8 = hw.peak_flops("fp8")
    if not fp8:
        raise ValueError(f"train.fp8 {work.fp8}: {hw.name} has no FP8 peak (V100 and A100 have "
                         "no FP8 tensor cores); set train.fp8 none, or plan for an H100, H200 "
                         "or B200")
    f = fp8_flops_fraction(cfg, work)
    return 1.0 / (f / fp8 + (1 - f) / peak)


def stage_flops_per_microbatch(cfg: ModelConfig, layout: Layout, work: Workload,
                               stage: int) -> tuple[float, float]:
    """(forward, backward + recompute) FLOPs one rank of ``stage`` executes per microbatch,
    over all its chunks: what the hardware does, including redundant replicated-kv work, the
    padded vocabulary and recomputation. Backward is twice forward (input and weight grads);
    full recompute re-runs each block's forward; selective recomputes no matmul but those of
    the modules it names, and the attention core only when it is materialised (Korthikanti
    et al., arXiv 2205.05198 §5) or named (``core_attn``);
    threefold's chunked head loss recomputes the head's logits in backward (Megatron's fused
    block, ``Workload.block``, does not). Under cp a rank computes its seq_len/cp tokens,
    each attending over all seq_len keys. A mixture of experts' feed-forward costs its
    router and k experts per token (``moe_matmul_parameters``) on every tp rank (it is not
    split by tp); under expert parallelism a rank computes the rows routed to its experts,
    N·k in expectation under uniform routing, the same FLOPs. A dense first block
    (DeepSeek-V3's three) costs its own MLP, split by tp, instead."""
    sh, h, hd, s = tp_shard(cfg, layout.tp), cfg.hidden_size, cfg.head_dim, work.seq_len
    tokens = layout.microbatch_size * local_seq_len(layout, work)
    layers = rank_layers(cfg, layout, stage)
    sharded, _ = layer_parameters_per_rank(cfg, layout.tp)
    core = 4 * s * sh.heads * hd  # QK^T and AV per token, no causal halving (as PaLM)
    layer_fwd = tokens * (2 * sharded + 2 * moe_matmul_parameters(cfg) + core)
    fwd = layers * layer_fwd + rank_dense_layers(cfg, layout, stage) * tokens * 2 * (
        3 * cfg.hidden_size * -(-(cfg.dense_intermediate_size or 0) // layout.tp)
        - moe_matmul_parameters(cfg))  # a dense first block: its own MLP, split by tp
    bwd = 2 * fwd
    frozen = 0  # the head's weight gradient not computed under LoRA
    if work.lora_r:  # a frozen base: input gradients only; each adapter's forward, both grads
        adapters = tokens * sum(adapter_numels(cfg, layout.tp, work.lora_r, work.lora_targets))
        bwd = layers * (tokens * (2 * sharded + 2 * core) + 4 * adapters)
        fwd += layers * 2 * adapters
        frozen = 1
    bwd += layers * tile_recompute_flops(cfg, layout, work)  # the tiled MLP's own recompute
    if layout.recompute == "full":
        bwd += fwd
    elif layout.recompute == "selective":  # a materialised attention or core_attn, and the
        # matmuls of the modules the policy names (plan.selective), run again
        again = core if recomputed_core(layout, work) else 0
        bwd += layers * tokens * (again + 2 * recomputed_matmul_parameters(cfg, layout))
    if stage == layout.last_stage:  # LM head: threefold's chunked loss recomputes its logits
        head = 2 * tokens * sh.vocab * h
        fwd, bwd = fwd + head, bwd + ((2 if work.block == "megatron" else 3) - frozen) * head
    return float(fwd), float(bwd)


def stage_memory_traffic_per_microbatch(cfg: ModelConfig, layout: Layout, work: Workload,
                                        stage: int | None = None) -> tuple[float, float]:
    """(forward, backward + recompute) bytes that one rank's memory-bound kernels move per
    microbatch (matmuls and flash attention are counted as FLOPs instead), per token per
    block, d bytes per element (r for the residual stream's):

    - fused kernels (``work.eager`` False, as Megatron's): two RMSNorms read and write h
      (4r·h), two residual adds read two and write one (6r·h) — split over tp only under
      sequence parallelism, every tp rank repeats them otherwise —; RoPE reads and writes q
      and k, SwiGLU's silu(gate)·up reads two and writes one f-wide tensor (3d·f);
      backward about twice the forward;
    - eager (one kernel per op, threefold's block as PyTorch runs it), counting each op's
      reads and writes: an RMSNorm is pow, mean, mul, mul — 7h forward, about 21h backward;
      RoPE's mul, neg, cat, mul, add — 12 per q/k element forward, 13 backward; SwiGLU's silu
      and mul — 5f forward, 9f backward; the residual adds 3h each, and autograd's sums of the
      gradients that reach a tensor along two paths (residual, q/k/v, gate/up) 9h backward.

    Materialised attention adds a softmax that reads and writes a·s scores. Recompute, full
    or selective, repeats the forward's memory-bound work. The last stage (``stage`` None:
    the last) adds the chunked head loss over its vocabulary shard (``threefold.model.head_loss``;
    Megatron's fused block: 3 passes of 4·V/t bytes forward, 5 backward):
    forward widens the matmul's logits to fp32 (d + 4 bytes per logit when d ≠ 4) and takes
    their log-sum-exp in place (max 4, subtract 8, exponentiate 8, sum 4); backward widens
    the recomputed logits again, subtracts the log-sum-exp, exponentiates and scales in
    place (24) and casts the result to the matmul dtype (4 + d when d ≠ 4).

    A mixture of experts (whole on every tp rank): SwiGLU's traffic is that of its k
    experts' rows (and a shared expert), k·f + f_shared wide per token; moving each of the
    k rows per token (gather by expert, the router weight's product, the add back) reads
    and writes about 4r + 3d bytes per element forward, twice that backward; the router's
    softmax and top-k read and write 4·E·4 bytes per token. An approximation: the dense
    terms are counted op by op, these are not."""
    sh, h, hd, d, s = tp_shard(cfg, layout.tp), cfg.hidden_size, cfg.head_dim, work.act_bytes, \
        work.seq_len
    r = work.resid_bytes
    tokens = layout.microbatch_size * local_seq_len(layout, work)  # this cp rank's tokens
    layers = rank_layers(cfg, layout, layout.last_stage if stage is None else stage)
    split = layout.tp if layout.sp else 1
    qk = (sh.heads + sh.kv_heads) * hd
    softmax = 0 if work.flash_attention else 2 * d * sh.heads * s
    e, k, fs, *_ = moe_key(cfg)
    ffn, moe_tok = sh.ffn, 0.0
    if e:
        ffn = k * cfg.intermediate_size + fs
        moe_tok = k * (4 * r + 3 * d) * h + 16 * e
    if work.eager:
        fwd_tok = r * (2 * 7 + 2 * 3) * h / split + 12 * d * qk + 5 * d * ffn + softmax \
            + moe_tok
        bwd_tok = r * (2 * 21 + 2 * 3) * h / split + 9 * r * h + 13 * d * qk + 9 * d * ffn \
            + 2 * softmax + 2 * moe_tok
    else:
        fwd_tok = 10 * r * h / split + 2 * d * qk + 3 * d * ffn + softmax + moe_tok
        bwd_tok = 2 * fwd_tok
    fwd, bwd = layers * tokens * fwd_tok, layers * tokens * bwd_tok
    if layout.recompute != "none":  # selective re-runs every elementwise op, as full does
        bwd += fwd
    if stage is None or stage == layout.last_stage:
        head_fwd, head_bwd = _head_traffic(d, work.block)
        fwd, bwd = fwd + tokens * sh.vocab * head_fwd, bwd + tokens * sh.vocab * head_bwd
    return fwd, bwd


def _head_traffic(d: int, block: str) -> tuple[int, int]:
    """(forward, backward) bytes per logit of the loss's memory-bound kernels (see
    ``stage_memory_traffic_per_microbatch``)."""
    if block == "megatron":
        return 3 * 4, 5 * 4
    cast = d + 4 if d != 4 else 0  # the matmul's logits widened to fp32
    return cast + 24, 2 * cast + 24


def hardware_flops_per_step(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """FLOPs all ranks execute in one step (the HFU numerator: recompute included)."""
    per_pipeline = 0.0
    for st in distinct_stages(cfg, layout):
        flops = sum(stage_flops_per_microbatch(cfg, layout, work, st))
        per_pipeline += flops * stage_multiplicity(cfg, layout, st)
    return per_pipeline * microbatches(layout, work) * layout.tp * layout.dp * layout.cp


def optimizer_seconds(cfg: ModelConfig, layout: Layout, memory_bw: float,
                      work: Workload | None = None) -> float:
    """Time of the optimiser step on the busiest stage: its memory traffic over ``memory_bw``
    (0 when the bandwidth is unknown, i.e. infinite). Under LoRA (``work.lora_r``) it steps
    the adapters alone."""
    n = layout.shard_size if layout.zero_stage else 1
    owned = max(sum(-(-sum(u) // n) for u in lora_units(cfg, layout, work, st)[0])
                if work is not None and work.lora_r else owned_parameters(cfg, layout, st)
                for st in distinct_stages(cfg, layout))
    return ADAMW_ACCESSES_PER_PARAM * 4 * owned / memory_bw


def offload_step_seconds(cfg: ModelConfig, layout: Layout, work: Workload,
                         cluster) -> tuple[float, float]:
    """(host AdamW seconds, PCIe seconds) of one step under optimiser offload: the step's
    ``ADAMW_ACCESSES_PER_PARAM`` fp32 accesses per owned parameter over this rank's share of
    the host memory bandwidth (``Hardware.host_memory_bw`` / GPUs per node; a measured machine,
    whose host is its device, uses ``memory_bw``), and ``offload_bytes_per_step`` over the
    device-host link per direction (``Hardware.host_link_bw``; gradients down, then after the
    step parameters up: the runtime does not overlap them). Unknown bandwidths count 0."""
    hw = cluster.hardware
    owned = max(owned_parameters(cfg, layout, st) for st in distinct_stages(cfg, layout))
    host_bw = (hw.host_memory_bw / cluster.gpus_per_node if hw.host_memory_bw
               else hw.memory_bw) or math.inf
    link = hw.host_link_bw or hw.memory_bw or math.inf
    moved = sum(offload_bytes_per_step(cfg, layout, work).values())
    return ADAMW_ACCESSES_PER_PARAM * 4 * owned / host_bw, moved / link


def tp_chunk_seconds(cfg: ModelConfig, layout: Layout, work: Workload,
                     rate: float) -> tuple[int, float]:
    """(chunks, seconds of one chunk's matmul) of overlapped tensor parallelism
    (``parallel.tp_overlap``): a layer's four overlapped collectives each way hide behind the
    projections next to them (q/k/v, o, gate/up, down forward; their input gradients, the
    same FLOPs, backward), taken as a quarter of the layer's projection FLOPs each, cut in
    ``chunks``. (1, 0) when not overlapped."""
    chunks = tp_chunks(layout, work)
    if chunks < 2:
        return 1, 0.0
    d, tokens = cfg.head_dim, layout.microbatch_size * local_seq_len(layout, work)
    width = 2 * cfg.num_attention_heads * d + 2 * cfg.num_key_value_heads * d \
        + 3 * cfg.intermediate_size  # q and o, k and v, gate, up and down
    flops = 2 * tokens * cfg.hidden_size * width / layout.tp
    return chunks, flops / 4 / chunks / rate


def attention_block_seconds(cfg: ModelConfig, layout: Layout, work: Workload,
                             rate: float) -> tuple[float, float]:
    """(forward, backward) seconds of one ring-attention block: this rank's queries (b·s/cp
    tokens) against one cp rank's keys (s/cp), 4·head_dim FLOPs per query head and key pair
    forward (QK^T and AV, no causal halving, as ``stage_flops_per_microbatch``), twice that
    backward. (0, 0) without cp."""
    if layout.cp == 1:
        return 0.0, 0.0
    s_local = local_seq_len(layout, work)
    f = 4 * layout.microbatch_size * s_local * s_local * tp_shard(cfg, layout.tp).heads \
        * cfg.head_dim
    return f / rate, 2 * f / rate
