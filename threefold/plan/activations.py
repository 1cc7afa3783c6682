"""Activation memory: Korthikanti et al.'s per-layer count (arXiv 2205.05198) adapted to a Llama
block (``layer_activation_bytes``), and the tensors threefold's own block keeps for backward
(``block_activation_bytes``, checked against autograd's saved tensors in tests/test_dryrun.py),
context parallelism's K/V, the head's logits, and the microbatches a schedule keeps in flight.
"""

from __future__ import annotations

from threefold.layout import Layout, Workload
from threefold.accounting import local_seq_len
from threefold.accounting.counts import norms_per_block
from threefold.accounting import tp_shard
from threefold.config import ModelConfig
from threefold.families.shapes import chunk_tokens
from threefold.plan.mlp_tiling import kept_lora_targets, tile_working_bytes, tiled_mlp_bytes
from threefold.plan.selective import selective_layer_bytes
from threefold.plan.sink_bytes import selective_sink_bytes, sink_attention_bytes
from threefold.schedules.registry import inflight_of, schedule_spec

# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------
def layer_activation_bytes(s: int, b: int, h: int, heads: int, kv_heads: int, ffn: int,
                           tp: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", dtype_bytes: int = 2,
                           mlp_tensors: int = 4, dropout: bool = False,
                           flash_attention: bool = True, kv_replicas: int = 1) -> float:
    """Activation bytes one transformer block keeps for backward, per rank, one microbatch, in
    Korthikanti et al.'s accounting (for the published comparisons; threefold's own block,
    which keeps more, is ``block_activation_bytes``).

    Korthikanti et al. (arXiv 2205.05198 §4) count, for a GPT block in 16-bit with 1-byte
    dropout masks, s·b·h·(34 + 5·a·s/h): attention 11·sbh + 5·a·s²·b, MLP 19·sbh, layer norms
    4·sbh. The same count, term by term, for this project's block (d = bytes per element,
    k = kv heads, f = SwiGLU width, no dropout, RMSNorm):

        replicated over tp unless sequence parallel, per s·b·h:
            2 norm inputs 2d  +  attention input d  +  MLP input d         (GPT: 4+2+2, +2 masks)
        split over tp:
            Q d·sbh  +  K and V 2d·sbh·k/a  +  attention output d·sbh      (GPT: 2+4+2)
            MLP: 4 tensors d·sbf (gate, silu(gate), up, their product)    (GPT: 2 tensors of 4h)
            attention core: flash attention keeps only the log-sum-exp, 4 bytes·a·s·b;
            materialised attention keeps the probabilities, d·a·s²·b     (GPT: 5·a·s²·b)

    i.e.  sbh·(4d)/(t if SP) + [sbh·(3d + 2d·k/a) + 4d·sbf + core]/t  bytes.
    With ``mlp_tensors=2, ffn=4h, kv_heads=heads, dropout=True, flash_attention=False`` this
    is Korthikanti's formula exactly: 34 + 5as/h; tp: 10 + 24/t + 5as/(ht); +SP: 34/t + ...
    Selective recompute drops the materialised attention core (no change under flash
    attention, which already recomputes it); full recompute keeps only the block input,
    d·sbh (/t with SP). When kv heads are replicated (k < t), K and V are not split.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute '{recompute}' is not none, selective or full")
    sbh = s * b * h
    rep_div = tp if sequence_parallel else 1
    if recompute == "full":
        return dtype_bytes * sbh / rep_div
    mask = 1 if dropout else 0
    replicated = sbh * (4 * dtype_bytes + 2 * mask)
    kv_share = kv_heads / heads * kv_replicas  # a replicated kv head is not split by tp
    split = sbh * (2 * dtype_bytes + 2 * dtype_bytes * kv_share)
    split += mlp_tensors * dtype_bytes * s * b * ffn
    if flash_attention:
        core = 4 * heads * s * b
    else:
        core = (2 * dtype_bytes + mask) * heads * s * s * b if dropout else \
            dtype_bytes * heads * s * s * b
        if recompute == "selective":
            core = 0
    return replicated / rep_div + (split + core) / tp


def block_activation_bytes(tokens: int, h: int, heads: int, kv_heads: int, head_dim: int,
                           ffn: int, tp: int = 1, sequence_parallel: bool = False,
                           act_bytes: int = 2, residual_bytes: int = 0,
                           flash_attention: bool = True, seq_len: int = 0, cp: int = 1,
                           cp_algorithm: str = "ring", ulysses: int = 1) -> float:
    """Bytes threefold's block (``threefold.model.decoder.DecoderLayer`` under
    ``threefold.parallel.transforms.tensor`` and ``threefold.parallel.transforms.context``) keeps
    for backward on one rank for ``tokens`` = b·s/cp tokens (this cp rank's share of b sequences of
    ``seq_len``).
    ``heads``, ``kv_heads`` and ``ffn`` are per rank; d = ``act_bytes`` (matmul dtype), r =
    ``residual_bytes`` (0 = d). Per token, what autograd saves:

    - each RMSNorm (``threefold.model.kernels.rms_norm``): its input and 1/rms (4 bytes): r·h + 4,
      split over tp under sequence parallelism (norms then see 1/t of the tokens);
    - each sub-layer input as its linears keep it, at full size (all-gathered under SP, not
      re-gathered in backward): d·h, the input itself when r = d, else the one autocast copy
      ``threefold.model.decoder.matmul_input`` makes for the sub-layer's linears (the wider input
      itself is then not kept);
    - attention: q and k after RoPE, v, the output (which o_proj reuses), the log-sum-exp of
      the flash kernel (4 bytes per head); materialised attention adds d·s per head;
    - RoPE's cos/sin cast to d when d ≠ 4 (4 tables of head_dim, for q and for k);
    - SwiGLU (``threefold.model.kernels.swiglu``): gate, up and their product (the down
      projection's input), 3·d·ffn; silu(gate) is recomputed in backward.

    This is more than Korthikanti's count (``layer_activation_bytes``: norms keep 2 bytes/h,
    RoPE and flash attention did not exist there), and under SP the attention and MLP inputs
    stay whole, which their 34/t does not assume. (Before ``threefold.model.kernels``, autograd
    also kept each norm's fp32 input copy and normalised input, 4·h more per norm, and
    silu(gate), d·ffn more; autocast's own casts, one per linear, kept 3·d·h for q/k/v and
    2·d·h for gate/up where ``matmul_input``'s single copies keep 2·d·h in all.)

    Under context parallelism (cp > 1) everything above is per local token except the
    attention core, which is ``cp_attention_bytes``'s."""
    d, r = act_bytes, residual_bytes or act_bytes
    norm_div = tp if sequence_parallel and tp > 1 else 1
    norms = 2 * (r * h + 4) / norm_div
    inputs = 2 * d * h
    rope = 0 if d == 4 else 4 * d * head_dim
    mlp = 3 * d * ffn
    if cp > 1:
        return tokens * (norms + inputs + rope + mlp) + cp_attention_bytes(
            tokens, heads, kv_heads, head_dim, seq_len, cp, cp_algorithm, d, ulysses)
    attn = d * (2 * heads * head_dim + 2 * kv_heads * head_dim) + 4 * heads
    if not flash_attention:
        attn += d * heads * seq_len
    return tokens * (norms + inputs + attn + rope + mlp)


def cp_attention_bytes(tokens: int, heads: int, kv_heads: int, head_dim: int, seq_len: int,
                       cp: int, algorithm: str, act_bytes: int, ulysses: int = 1) -> float:
    """Bytes one block's attention keeps for backward under context parallelism, on one rank
    for its ``tokens`` = b·seq_len/cp tokens (heads and kv heads per tp rank, d =
    ``act_bytes``), as ``threefold.parallel.transforms.context`` runs it (measured to the byte in
    tests/test_dryrun.py):

    - ring (``RingAttention``): the local q (after RoPE), k and v, its output (cast to q's
      dtype) and fp32 log-sum-exp (4·heads), plus o_proj's input, the output laid out as
      (b, s/cp, heads·head_dim) — a separate copy: d·(3·heads + 2·kv_heads)·head_dim + 4·heads
      per token;
    - allgather: SDPA's saved tensors over the gathered sequence — the local q, K and V of the
      whole sequence repeated to the query heads (2·d·heads·head_dim·b·seq_len; without
      grouping, the gathered K/V themselves), the output (shared with o_proj's input) and the
      fp32 log-sum-exp per local token — plus the visibility mask of (seq_len/cp × seq_len)
      that SDPA keeps converted to d bytes. Without packed documents the mask is one per
      layer; with them it is (b, 1, seq_len/cp, seq_len), b times more, which this count
      (the planner's, for unpacked pre-training) leaves out;
    - ulysses (``threefold.parallel.transforms.ulysses``): the model's own attention over the
      whole sequence for heads/cp of the heads keeps as much per local token as the ring does
      (q, K/V repeated up to ``ulysses`` heads when fewer, the output and its log-sum-exp,
      and o_proj's input, the output back from the all-to-all);
    - a hybrid (1 < ``ulysses`` < cp) keeps the ring's or the all-gather's over cp/ulysses
      ranks with heads/ulysses heads on ulysses·tokens tokens (the all-to-all's output),
      plus o_proj's input."""
    d = act_bytes
    u = cp if algorithm == "ulysses" else ulysses
    kv = max(kv_heads, u) if u > 1 else kv_heads
    if algorithm in ("ring", "ulysses") or u == cp:
        return tokens * (d * (3 * heads + 2 * kv) * head_dim + 4 * heads)
    if algorithm == "allgather":
        n, b_seq = cp // u, tokens * cp  # ring ranks, b · seq_len
        own = d * heads * head_dim if u > 1 else 0  # o_proj's input, after the all-to-all
        return tokens * (2 * d * heads * head_dim + 4 * heads + own) \
            + 2 * d * (heads // u) * head_dim * b_seq + d * (seq_len // n) * seq_len
    raise ValueError(f"unknown cp algorithm {algorithm!r}; use ring, allgather or ulysses")


def fp8_scale_bytes(cfg: ModelConfig, work: Workload, tp: int = 1, ep: int = 1) -> int:
    """What ``train.fp8`` adds to a block's saved tensors (``threefold.parallel.transforms``'
    ``fp8_linear`` and ``fp8_experts``): each FP8 layer keeps the input and weight a plain one
    keeps and casts again in backward, so only the weights' scales: tensorwise two fp32
    scalars per projection (q, k, v, o and a dense MLP's or a shared expert's gate, up,
    down) and two per local routed expert (ep splits them) and grouped product; blockwise
    one fp32 per 128×128 block of each (local, under tp) weight. Rowwise recomputes its
    per-row scales."""
    if work.fp8 not in ("tensorwise", "blockwise"):
        return 0
    h, sh, e = cfg.hidden_size, tp_shard(cfg, tp), cfg.num_local_experts or 0
    f = (cfg.shared_expert_intermediate_size or 0) if e else sh.ffn  # the FP8 MLP, if any
    q, kv = sh.heads * cfg.head_dim, sh.kv_heads * cfg.head_dim
    shapes = [(q, h), (kv, h), (kv, h), (h, q)] + ([(f, h), (f, h), (h, f)] if f else [])
    fe = cfg.intermediate_size
    experts = [(2 * fe, h), (h, fe)] if e and not (h % 16 or fe % 16) else []
    if work.fp8 == "tensorwise":
        return 8 * len(shapes) + 8 * (e // ep) * len(experts)
    blocks = sum(-(-n // 128) * -(-k // 128) for n, k in shapes)
    return 4 * blocks + 4 * (e // ep) * sum(-(-n // 128) * -(-k // 128) for n, k in experts)


def model_layer_activation_bytes(cfg: ModelConfig, layout: Layout, work: Workload,
                                 recompute: str | None = None, dense: bool = False) -> float:
    """Bytes one block keeps per rank per microbatch under ``layout``: ``block_activation_bytes``
    without recompute; with full recompute only the checkpoint's input, r·b·s·h (/t under SP);
    with selective recompute ``selective_block_bytes`` (the matmuls' and the fused attention's
    outputs, less what ``layout.recompute_modules`` recomputes: ``plan.selective``; ``dense``
    a mixture of experts' dense first block there, elsewhere counted as its MoE blocks).
    Under cp, of this rank's seq_len/cp tokens."""
    sh, b, s = tp_shard(cfg, layout.tp), layout.microbatch_size, work.seq_len
    local = local_seq_len(layout, work)
    mode = recompute or layout.recompute
    if work.block == "megatron":
        return megatron_layer_activation_bytes(cfg, layout, work, mode)
    if mode == "full":
        return work.resid_bytes * b * local * cfg.hidden_size / (layout.tp if layout.sp else 1)
    if mode == "selective":  # (with the layout's recompute_modules)
        return selective_layer_bytes(cfg, layout, work, b * local, dense) \
            + (selective_sink_bytes(cfg, layout, work) if cfg.attention_sinks else 0.0)
    kept = block_activation_bytes(b * local, cfg.hidden_size, sh.heads, sh.kv_heads,
                                  cfg.head_dim, sh.ffn, layout.tp, layout.sp, work.act_bytes,
                                  work.resid_bytes, work.flash_attention, s, layout.cp,
                                  layout.cp_algorithm, layout.ulysses)
    kept += sink_attention_bytes(cfg, layout, work) if cfg.attention_sinks else \
        block_document_mask_bytes(cfg, layout, work)
    kept += tiled_mlp_bytes(cfg, layout, work)
    kept += fp8_scale_bytes(cfg, work, layout.tp, layout.ep)
    kept += gemma_extra_bytes(cfg, layout, work, b * local, sh.ffn)
    if cfg.qk_norm:
        kept += qk_norm_bytes(b * local, sh.heads, sh.kv_heads, cfg.head_dim, work.act_bytes,
                              cfg.qk_norm_over == "head")
        if cfg.qk_norm_over == "projection" and layout.tp > 1:
            # tensor parallelism's projection norm (plain ops around its all-reduce) also
            # keeps the normalised q and k (parallel.tensor.ProjectionParallelRMSNorm)
            # (and, below fp32, the fp32 copy of its input that squares it)
            kept += b * local * (sh.heads + sh.kv_heads) * cfg.head_dim * (
                work.act_bytes + (4 if work.act_bytes < 4 else 0))
    return kept


def gemma_extra_bytes(cfg: ModelConfig, layout: Layout, work: Workload, tokens: int,
                      ffn: int) -> float:
    """What Gemma's block keeps beyond ``block_activation_bytes``'s count for ``tokens``:
    two more norms (the sandwich layout's post-sub-layer ones: input and 1/rms each, split
    over tp under sequence parallelism), GeGLU's tanh-GeLU output (the SwiGLU kernel
    recomputes its activation; the plain GeLU keeps it), d·ffn per token, and each (1 + w)
    norm's gain, once per block (measured: tests/test_families.py)."""
    out = 0.0
    if cfg.norm_layout == "sandwich":
        r = work.resid_bytes or work.act_bytes
        out += tokens * 2 * (r * cfg.hidden_size + 4) / (layout.tp if layout.sp else 1)
    if cfg.hidden_act == "gelu_tanh" and not cfg.num_local_experts:
        out += tokens * work.act_bytes * ffn
    if cfg.norm_plus_one:  # each norm keeps its 1 + w, a new tensor (not the parameter)
        widths = norms_per_block(cfg) * cfg.hidden_size
        widths += 2 * cfg.head_dim if cfg.qk_norm and cfg.qk_norm_over == "head" else 0
        out += widths * (4 if cfg.norm_fp32_weight else work.weight_bytes)
    return out


def block_document_mask_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """What masked attention (packed documents, ``data.document_mask``, or a sliding window
    shorter than the sequence, ``model.sliding_window``) adds to one block's kept bytes
    without recompute (``document_mask_bytes``; none under ring or all-gather context
    parallelism, whose attention takes no mask). Under Ulysses a rank runs the masked
    attention over whole sequences for heads/u of the heads (K/V heads repeated up to u):
    the same count for those heads, b·s tokens."""
    window = 0 < cfg.sliding_window < work.seq_len  # a sliding window masks attention too
    if not (work.document_mask or window) or layout.cp_ring > 1:
        return 0.0
    sh, b, s, u = tp_shard(cfg, layout.tp), layout.microbatch_size, work.seq_len, layout.ulysses
    out = document_mask_bytes(b * s, sh.heads // u, max(sh.kv_heads, u) // u, cfg.head_dim, s,
                              work.act_bytes)
    if not work.document_mask:  # a window alone: one (1, 1, T, T) mask for the whole batch,
        out -= (b - 1) * s * s * work.act_bytes
        n, every = cfg.num_hidden_layers, cfg.sliding_window_pattern
        if every:  # in the sliding blocks only (Gemma 3: the global ones run unmasked), as
            out *= (n - n // every) / n  # an average over the model's blocks
    return out


def qk_norm_bytes(tokens: int, heads: int, kv_heads: int, head_dim: int,
                  act_bytes: int, per_head: bool = True) -> float:
    """What q/k RMSNorms (``model.qk_norm``) keep beyond the block's count, per rank: each
    norm's input, the q or k projection's output in the matmul dtype, and its fp32 1/rms
    (the normalised q and k are RoPE's inputs, already counted after RoPE). Per head
    (Qwen3): (heads + kv heads)·(d·head_dim + 4) per token, measured with autograd's saved
    tensors (tests/test_dryrun.py); over the projection (OLMo 2): one 1/rms per norm."""
    rstd = 4 * (heads + kv_heads) if per_head else 8
    return float(tokens * ((heads + kv_heads) * act_bytes * head_dim + rstd))


def adapter_activation_bytes(layout: Layout, work: Workload) -> float:
    """Bytes one block's LoRA adapters (``work.lora_r``) keep per microbatch beyond the base
    block's count: r activations (x·Aᵀ) per token per adapted layer, in the matmul dtype, of
    this rank's tokens (a row-parallel layer's x·Aᵀ is of its columns, still r wide). The
    adapted layer's input is the one the base layer keeps; with fewer targets than all, the
    frozen layers that are not adapted keep less than counted (their inputs are not needed),
    so the count is then an upper bound."""
    per_layer = kept_lora_targets(work) * work.lora_r  # a tiled MLP's are recomputed
    return layout.microbatch_size * local_seq_len(layout, work) * per_layer * work.act_bytes


def document_mask_bytes(tokens: int, heads: int, kv_heads: int, head_dim: int, seq_len: int,
                        act_bytes: int) -> float:
    """What threefold's block keeps in addition, without recompute, when attention stays
    inside packed documents (``data.document_mask``: ``threefold.model.decoder.sdpa_attention``
    under a mask), for ``tokens`` tokens of sequences of ``seq_len`` (heads per rank): K and V
    repeated to the query heads, since the masked kernels take no grouped K/V,
    2·d·(heads − kv_heads)·head_dim per token; and the boolean mask, which the kernel keeps
    converted to d bytes, d·seq_len per token (d·b·s² in all, on every tp rank). Selective
    recompute keeps neither (both are recomputed). Measured to the byte in
    tests/test_dryrun.py. Under cp this is not counted."""
    return tokens * act_bytes * (2 * (heads - kv_heads) * head_dim + seq_len)


def recompute_working_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """What the block whose activations are being recomputed holds beyond what it keeps:
    under full recompute everything it keeps without recompute; under selective, that less
    the kept tensors its recomputed forward saves again (v, the attention's output and
    log-sum-exp, gate and up where no named module recomputes them: the same storage,
    counted in the activations); 0 without."""
    mode = layout.recompute
    if mode == "none" or work.block == "megatron" and mode == "selective":
        return tile_working_bytes(cfg, layout, work)
    whole = model_layer_activation_bytes(cfg, layout, work, recompute="none")
    if mode == "full":
        return whole + tile_working_bytes(cfg, layout, work)
    sh, d, mods = tp_shard(cfg, layout.tp), work.act_bytes, layout.recompute_modules
    shared = d * sh.kv_heads * cfg.head_dim + (0 if "mlp" in mods else 2 * d * sh.ffn)
    if work.flash_attention and "core_attn" not in mods:
        shared += d * sh.heads * cfg.head_dim + 4 * sh.heads
    return whole - layout.microbatch_size * local_seq_len(layout, work) * shared


def megatron_layer_activation_bytes(cfg: ModelConfig, layout: Layout, work: Workload,
                                    recompute: str) -> float:
    """Bytes one block keeps per rank per microbatch when it runs as Megatron-Core's fused
    Llama block (``Workload.block == "megatron"``): ``layer_activation_bytes`` — Korthikanti
    et al.'s count, term by term for RMSNorm, GQA and SwiGLU — with the fused SwiGLU's three
    f-wide tensors (its saved input, gate and up, and the down projection's input, their
    product; silu(gate) is recomputed inside the kernel), 16-bit norm inputs (the fused
    RMSNorm keeps its input and 1/rms), no dropout, and under sequence parallelism the
    sub-layers' sharded inputs, all-gathered again in backward. Under cp, of this rank's
    seq_len/cp tokens (the flash kernel's log-sum-exp per local query)."""
    sh = tp_shard(cfg, layout.tp)
    return layer_activation_bytes(
        local_seq_len(layout, work), layout.microbatch_size, cfg.hidden_size,
        sh.heads * layout.tp, cfg.num_key_value_heads, sh.ffn * layout.tp, layout.tp,
        layout.sp, recompute, work.act_bytes, mlp_tensors=3, dropout=False,
        flash_attention=work.flash_attention, kv_replicas=sh.kv_replicas)


def microbatch_extra_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """What one microbatch keeps besides its blocks: RoPE's fp32 cos/sin tables for the whole
    sequence (shared by every block; this cp rank's tokens under cp)."""
    return 2 * 4 * layout.microbatch_size * local_seq_len(layout, work) * cfg.head_dim


def inflight_microbatches(schedule: str, p: int, m: int, v: int = 1, rank: int = 0,
                          inflight: int = 0) -> float:
    """Microbatches whose activations ``rank`` holds at its peak, in units of the rank's whole
    share of layers (v chunks): the schedule's ``ScheduleSpec.inflight``. GPipe m; 1F1B
    min(p - rank, m) (Narayanan et al. §2.2.1); ZB-H1 min(p, m) on every rank (its weight
    gradients, which free the activations, run up to `rank` steps late; Qi et al. §3).
    Interleaved 1F1B: rank r runs 2(p-r-1) + (v-1)·p warm-up chunk-forwards (as Megatron
    schedules them) plus one, each 1/v of its layers (at most m·v in all); for rank 0 with
    m >= p that is p·(1 + (p-1)/(p·v)) — Korthikanti's interleaving factor, whose 'm' is the
    number of interleaved stages (our v). tests/test_cost.py checks all of these against the
    schedules' action lists."""
    return float(inflight_of(schedule, p, m, v, rank, inflight))


def head_inflight_microbatches(schedule: str, p: int, m: int) -> int:
    """Microbatches whose head and loss tensors the last virtual stage holds at its peak (the
    schedule's ``ScheduleSpec.head_inflight``): GPipe all m; ZB-H1 min(p, m) (each one's
    weight gradient, which frees them, waits); 1F1B and interleaved 1F1B one (the last stage
    runs each backward right after its forward). tests/test_cost.py checks these against the
    schedules' action lists."""
    return schedule_spec(schedule).head_inflight(p, m)


def logits_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """The last stage's peak for one microbatch beyond its blocks, while the loss runs: what
    the head and loss keep for backward (``head_saved_bytes``) plus the chunked head loss's
    working set (``threefold.model.head_loss``): one chunk's fp32 logits over the vocabulary shard
    (4·V/t per token of the chunk) and, where the matmul dtype d is narrower than fp32, the
    same logits as the matmul gives them or the gradient cast back for the matmuls (d·V/t
    more); and where the weights are wider than d, the head weight's cast (d·V/t·h; a
    chunk's weight gradient in d, as large, comes after the chunk's logits are freed; the
    fp32 gradient it adds into is the weight's gradient, counted with the gradients). The
    fp32 logits of the whole microbatch never exist."""
    tokens, _, vocab = _head_terms(cfg, layout, work)
    d, h = work.act_bytes, cfg.hidden_size
    narrow = d if d != 4 else 0
    cast = d if work.weight_bytes > d else 0
    chunk = chunk_tokens(tokens, vocab)
    return head_saved_bytes(cfg, layout, work) + chunk * vocab * (4 + narrow) \
        + vocab * h * cast


def _head_terms(cfg: ModelConfig, layout: Layout, work: Workload) -> tuple[int, float, int]:
    """(tokens per microbatch, the final norm's saved bytes per token (r·h + 4, /t under
    SP: its input and 1/rms) plus the head's input as its matmul keeps it (d·h: an autocast
    copy when r != d), vocabulary rows per tp rank)."""
    h, d, r = cfg.hidden_size, work.act_bytes, work.resid_bytes
    norm = (r * h + 4) / (layout.tp if layout.sp else 1)
    return (layout.microbatch_size * local_seq_len(layout, work), norm + d * h,
            tp_shard(cfg, layout.tp).vocab)


def head_saved_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """What the last stage keeps for backward per microbatch beyond its blocks, from its
    forward until its backward: the final norm's saved tensors (r·h + 4, /t under SP), the
    LM head's input (d·h), and the chunked loss's labels (int64) and fp32 log-sum-exp,
    12 bytes a token, with or without tp (``threefold.model.head_loss``; the weight is a
    parameter). A pipeline's last stage holds this for every microbatch in flight
    (``head_inflight_microbatches``); ``logits_bytes`` adds the working set of the one whose
    loss is running. tests/test_dryrun.py measures it to the byte (fp32, with tp and SP);
    bench/bench_pipeline_memory.py the whole schedule."""
    tokens, norm_and_head, _ = _head_terms(cfg, layout, work)
    return tokens * (norm_and_head + 8 + 4)
