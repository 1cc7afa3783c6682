"""Memory per rank: model states (ZeRO), activations, pipeline in-flight microbatches, and the
per-GPU peak the planner checks against the device.

Two kinds of function live here. The published accountings, kept for the comparisons with
the papers: ``model_state_bytes`` (ZeRO Table 1), ``layer_activation_bytes`` (Korthikanti et
al.'s per-layer count, adapted term by term to a Llama block). And the model of threefold's
own runtime, which the planner, the dry run and the benchmark use: ``block_activation_bytes``
counts exactly the tensors threefold's block keeps for backward (checked against autograd's
saved tensors in tests/test_dryrun.py), ``memory_per_gpu`` adds the engines' buffers and when
each exists (see ``MemoryBreakdown.total``).

Pure formulas, no torch. Bytes throughout; 1 GB = 1e9 bytes as in the papers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from threefold.config import ModelConfig
from threefold.cost import (
    Layout,
    Workload,
    _distinct_stages,
    layer_parameters_per_rank,
    local_seq_len,
    microbatches,
    rank_layers,
    stage_units,
    tp_shard,
)

# threefold.parallel.zero (stages 2 and 3) starts each unit's reduce-scatter from a backward
# hook; its input, a full flat copy of the unit's gradient, lives until the reduce-scatter is
# finished, and the engine lets at most this many wait (ZeroEngine.MAX_INFLIGHT), so
# MAX_INFLIGHT + 1 full unit gradients exist at once at most.
ZERO_REDUCES_IN_FLIGHT = 2

# Optimiser offload (threefold.parallel.offload) keeps, per parameter the rank updates, an fp32
# master copy and an fp32 gradient buffer in host memory beside AdamW's state.
HOST_MASTER_BYTES = 4
HOST_GRAD_BYTES = 4

# CUDA context, NCCL buffers, allocator fragmentation and kernels' workspaces: a flat allowance
# per GPU on top of what the formulas count (the planner's fit test includes it).
RUNTIME_OVERHEAD_BYTES = 2e9


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state: the working weights, their gradients and the
    optimiser state (which ZeRO stage 1 already shards)."""

    param: float
    grad: float
    optimizer: float
    # True when the optimiser state holds the fp32 master weights (mixed precision); False when
    # the optimiser updates the working weights themselves (fp32), so that a ZeRO shard the
    # optimiser owns is a copy beside the full weights (threefold's stages 1 and 2).
    master_in_optimizer: bool = True

    @property
    def total(self) -> float:
        """Bytes per parameter when nothing is sharded."""
        return self.param + self.grad + self.optimizer


# ZeRO (arXiv 1910.02054 §3.1): bf16/fp16 weights 2 + gradients 2 + K = 12 for Adam's fp32
# master weights, momentum and variance.
MIXED_ADAM = StateBytes(param=2, grad=2, optimizer=12)
# fp32 training: weights 4 + gradients 4 + Adam's momentum and variance 8 (no master copy).
FP32_ADAM = StateBytes(param=4, grad=4, optimizer=8, master_in_optimizer=False)
# DeepSpeed's estimators additionally keep an fp32 gradient partition (4 bytes) with the
# optimiser state: 2P + 18P/N for stage 2 (deepspeed/runtime/zero/stage_1_and_2.py).
DEEPSPEED_MIXED_ADAM = StateBytes(param=2, grad=2, optimizer=16)

STATE_BYTES = {"bf16": MIXED_ADAM, "fp32": FP32_ADAM}


def state_bytes_for(work: Workload) -> StateBytes:
    """The model-state bytes of ``work``: fp32 weights and gradients (threefold's runtime,
    ``work.master_bytes == 4``, or fp32 training) hold 16 bytes/param as FP32_ADAM; 16-bit
    weights hold MIXED_ADAM's."""
    return FP32_ADAM if work.weight_bytes == 4 else STATE_BYTES[work.precision]


def model_state_breakdown(num_params: float, dp_shard: int, zero_stage: int,
                          state: StateBytes = MIXED_ADAM) -> dict[str, float]:
    """{'params', 'grads', 'optimizer'} bytes on one rank holding ``num_params`` parameters,
    sharded over ``dp_shard`` ranks by ZeRO ``zero_stage`` (arXiv 1910.02054 §5.1): stage 1
    shards the optimiser state, 2 also the gradients, 3 also the weights."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage {zero_stage} is not 0-3")
    n = dp_shard
    return {"params": num_params * state.param / (n if zero_stage >= 3 else 1),
            "grads": num_params * state.grad / (n if zero_stage >= 2 else 1),
            "optimizer": num_params * state.optimizer / (n if zero_stage >= 1 else 1)}


def model_state_bytes(num_params: float, dp_shard: int, zero_stage: int,
                      state: StateBytes = MIXED_ADAM) -> float:
    """Model-state bytes on one rank: with MIXED_ADAM, 16Ψ (stage 0), 4Ψ + 12Ψ/N (1),
    2Ψ + 14Ψ/N (2), 16Ψ/N (3), ZeRO's Table 1."""
    return sum(model_state_breakdown(num_params, dp_shard, zero_stage, state).values())


def zero3_working_bytes(largest_unit_params: float, state: StateBytes = MIXED_ADAM) -> float:
    """ZeRO-3's transient full-size buffers: the gathered weights and the not yet
    reduce-scattered gradients of the largest unit (DeepSpeed: 4·largest_layer in 16-bit)."""
    return largest_unit_params * (state.param + state.grad)


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
                           cp_algorithm: str = "ring") -> float:
    """Bytes threefold's block (``threefold.model.LlamaDecoderLayer`` under
    ``threefold.parallel.tensor`` and ``threefold.parallel.context``) keeps for backward on
    one rank for ``tokens`` = b·s/cp tokens (this cp rank's share of b sequences of
    ``seq_len``).
    ``heads``, ``kv_heads`` and ``ffn`` are per rank; d = ``act_bytes`` (matmul dtype), r =
    ``residual_bytes`` (0 = d). Per token, what autograd saves:

    - each RMSNorm: its input in fp32 (the input itself when r = 4, else an fp32 copy), the
      normalised input in the residual dtype, 1/rms (4 bytes): (4 + r)·h + 4, split over tp
      under sequence parallelism (norms then see 1/t of the tokens);
    - each sub-layer input as its linears keep it, at full size (all-gathered under SP, not
      re-gathered in backward): r·h when r = d, else one autocast copy per linear, 3·d·h for
      q/k/v and 2·d·h for gate/up (the fp32 input itself is then not kept);
    - attention: q and k after RoPE, v, the output (which o_proj reuses), the log-sum-exp of
      the flash kernel (4 bytes per head); materialised attention adds d·s per head;
    - RoPE's cos/sin cast to d when d ≠ 4 (4 tables of head_dim, for q and for k);
    - SwiGLU: gate, silu(gate), up and their product, 4·d·ffn.

    This is more than Korthikanti's count (``layer_activation_bytes``: norms keep 2 bytes/h,
    RoPE and flash attention did not exist there), and under SP the attention and MLP inputs
    stay whole, which their 34/t does not assume.

    Under context parallelism (cp > 1) everything above is per local token except the
    attention core, which is ``cp_attention_bytes``'s."""
    d, r = act_bytes, residual_bytes or act_bytes
    norm_div = tp if sequence_parallel and tp > 1 else 1
    norms = 2 * ((4 + r) * h + 4) / norm_div
    inputs = (r * h if r == d else 3 * d * h) + (r * h if r == d else 2 * d * h)
    rope = 0 if d == 4 else 4 * d * head_dim
    mlp = 4 * d * ffn
    if cp > 1:
        return tokens * (norms + inputs + rope + mlp) + cp_attention_bytes(
            tokens, heads, kv_heads, head_dim, seq_len, cp, cp_algorithm, d)
    attn = d * (2 * heads * head_dim + 2 * kv_heads * head_dim) + 4 * heads
    if not flash_attention:
        attn += d * heads * seq_len
    return tokens * (norms + inputs + attn + rope + mlp)


def cp_attention_bytes(tokens: int, heads: int, kv_heads: int, head_dim: int, seq_len: int,
                       cp: int, algorithm: str, act_bytes: int) -> float:
    """Bytes one block's attention keeps for backward under context parallelism, on one rank
    for its ``tokens`` = b·seq_len/cp tokens (heads and kv heads per tp rank, d =
    ``act_bytes``), as ``threefold.parallel.context`` runs it (measured to the byte in
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
      (the planner's, for unpacked pre-training) leaves out."""
    d = act_bytes
    if algorithm == "ring":
        return tokens * (d * (3 * heads + 2 * kv_heads) * head_dim + 4 * heads)
    if algorithm == "allgather":
        b_seq = tokens * cp  # b · seq_len
        return tokens * (2 * d * heads * head_dim + 4 * heads) \
            + 2 * d * heads * head_dim * b_seq + d * (seq_len // cp) * seq_len
    raise ValueError(f"unknown cp algorithm {algorithm!r}; use ring or allgather")


def model_layer_activation_bytes(cfg: ModelConfig, layout: Layout, work: Workload,
                                 recompute: str | None = None) -> float:
    """Bytes one block keeps per rank per microbatch under ``layout``: ``block_activation_bytes``
    without recompute; with full recompute only the checkpoint's input, r·b·s·h (/t under SP);
    selective recompute drops the materialised attention probabilities (nothing under flash
    attention, which recomputes them anyway). Under cp, of this rank's seq_len/cp tokens."""
    sh, b, s = tp_shard(cfg, layout.tp), layout.microbatch_size, work.seq_len
    local = local_seq_len(layout, work)
    mode = recompute or layout.recompute
    if mode == "full":
        return work.resid_bytes * b * local * cfg.hidden_size / (layout.tp if layout.sp else 1)
    flash = work.flash_attention or mode == "selective"
    return block_activation_bytes(b * local, cfg.hidden_size, sh.heads, sh.kv_heads,
                                  cfg.head_dim, sh.ffn, layout.tp, layout.sp, work.act_bytes,
                                  work.resid_bytes, flash, s, layout.cp, layout.cp_algorithm)


def microbatch_extra_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """What one microbatch keeps besides its blocks: RoPE's fp32 cos/sin tables for the whole
    sequence (shared by every block; this cp rank's tokens under cp)."""
    return 2 * 4 * layout.microbatch_size * local_seq_len(layout, work) * cfg.head_dim


def inflight_microbatches(schedule: str, p: int, m: int, v: int = 1, rank: int = 0) -> float:
    """Microbatches whose activations ``rank`` holds at its peak, in units of the rank's whole
    share of layers (v chunks). GPipe m; 1F1B min(p - rank, m) (Narayanan et al. §2.2.1);
    ZB-H1 min(p, m) on every rank (its weight gradients, which free the activations, run up to
    `rank` steps late; Qi et al. §3). Interleaved 1F1B: rank r runs 2(p-r-1) + (v-1)·p
    warm-up chunk-forwards (as Megatron schedules them) plus one, each 1/v of its layers
    (at most m·v in all); for rank 0 with m >= p that is
    p·(1 + (p-1)/(p·v)) — Korthikanti's interleaving factor, whose 'm' is the number of
    interleaved stages (our v). tests/test_cost.py checks all of these against the schedules'
    action lists."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "zb-h1":
        return float(min(p, m))
    if schedule == "interleaved-1f1b":
        chunk_mbs = min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
        return chunk_mbs / v
    return float(min(p - rank, m))


def head_inflight_microbatches(schedule: str, p: int, m: int) -> int:
    """Microbatches whose head and loss tensors the last virtual stage holds at its peak:
    GPipe all m; ZB-H1 min(p, m) (each one's weight gradient, which frees them, waits); 1F1B
    and interleaved 1F1B one (the last stage runs each backward right after its forward).
    tests/test_cost.py checks these against the schedules' action lists."""
    if schedule == "gpipe":
        return m
    if schedule == "zb-h1":
        return min(p, m)
    return 1


def logits_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """The last stage's peak for one microbatch beyond its blocks, at the start of the loss's
    backward: the final norm ((4 + r)·h, /t under SP), the LM head's input (d·h: r·h, or its
    autocast copy d·h), the fp32 logits over the vocabulary shard (held by the loop) and the
    loss's working set — without tp, F.cross_entropy's log-softmax output, its gradient and
    the logits' gradient (3 × 4·V); with tp, the vocab-parallel loss's softmax and the
    gradient made from it (2 × 4·V/t)."""
    tokens, norm_and_head, vocab = _head_terms(cfg, layout, work)
    loss = (2 if layout.tp > 1 else 3) * 4 * vocab
    return tokens * (norm_and_head + 4 * vocab + loss)


def _head_terms(cfg: ModelConfig, layout: Layout, work: Workload) -> tuple[int, float, int]:
    """(tokens per microbatch, the final norm's saved bytes per token ((4 + r)·h + 4, /t
    under SP) plus the head's input as its matmul keeps it (d·h: an autocast copy when
    r != d), vocabulary rows per tp rank)."""
    h, d, r = cfg.hidden_size, work.act_bytes, work.resid_bytes
    norm = ((4 + r) * h + 4) / (layout.tp if layout.sp else 1)
    return (layout.microbatch_size * local_seq_len(layout, work), norm + d * h,
            tp_shard(cfg, layout.tp).vocab)


def head_saved_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """What the last stage keeps for backward per microbatch beyond its blocks, from its
    forward until its backward: the final norm's saved tensors ((4 + r)·h + 4, /t under SP),
    the LM head's input, and the loss's saved tensors: without tp F.cross_entropy's
    log-softmax (4·V), the int64 labels and a 4-byte scalar (its total weight); with tp the
    vocab-parallel loss's softmax over the shard (4·V/t), the labels' int64 shard-local ids
    and two bool masks. A pipeline's last stage holds this for every microbatch in flight
    (``head_inflight_microbatches``); ``logits_bytes`` is the larger working set of the one
    whose backward is running. tests/test_cost.py measures a last-stage chunk (fp32, no tp)
    to the byte; bench/bench_pipeline_memory.py the whole schedule."""
    tokens, norm_and_head, vocab = _head_terms(cfg, layout, work)
    if layout.tp > 1:
        return tokens * (norm_and_head + 4 * vocab + 8 + 2)
    return tokens * (norm_and_head + 4 * vocab + 8) + 4


def cast_weight_bytes(cfg: ModelConfig, layout: Layout, work: Workload, stage: int) -> float:
    """Under autocast with weights wider than the matmul dtype (threefold's fp32 weights under
    bf16), every linear's weight is cast once per forward and the cast is kept for backward:
    d bytes per matmul weight of the stage, per microbatch in flight. 0 otherwise."""
    d = work.act_bytes
    if work.weight_bytes <= d:
        return 0.0
    sharded, _ = layer_parameters_per_rank(cfg, layout.tp)
    n = sharded * rank_layers(cfg, layout, stage)
    if stage == layout.pp - 1:
        n += tp_shard(cfg, layout.tp).vocab * cfg.hidden_size
    return d * n


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
                + self.logits + self.zero3_working + self.cast_weights)

    @property
    def total(self) -> float:
        """The peak: what always exists plus the larger of the two transient moments."""
        return (self.params + self.optimizer + self.buffers + self.overhead
                + max(self.activation_peak, self.grads + self.optimizer_working))


def stage_memory(cfg: ModelConfig, layout: Layout, work: Workload, stage: int,
                 state: StateBytes | None = None,
                 overhead_bytes: float = RUNTIME_OVERHEAD_BYTES) -> MemoryBreakdown:
    """Peak memory of one rank of pipeline ``stage`` under threefold's engines (see
    ``_stage_memories``)."""
    return _stage_memories(cfg, layout, work, [stage], state, overhead_bytes)[0]


def memory_per_gpu(cfg: ModelConfig, layout: Layout, work: Workload,
                   state: StateBytes | None = None,
                   overhead_bytes: float = RUNTIME_OVERHEAD_BYTES) -> MemoryBreakdown:
    """The breakdown of the pipeline stage with the largest peak (stage 0 holds the most
    activations, the last stage the logits and head)."""
    stages = _distinct_stages(cfg, layout)
    return max(_stage_memories(cfg, layout, work, stages, state, overhead_bytes),
               key=lambda mb: mb.total)


@lru_cache(maxsize=65536)
def _unit_totals(units: tuple, n: int) -> tuple[int, int, int]:
    """(parameters, parameters with each unit padded to a multiple of ``n``, largest unit)
    of a stage's units (cached: the planner asks for the same stages thousands of times)."""
    sizes = [sum(u) for u in units]
    return sum(sizes), sum(-(-x // n) * n for x in sizes), max(sizes)


def _stage_memories(cfg: ModelConfig, layout: Layout, work: Workload, stages: list[int],
                    state: StateBytes | None, overhead_bytes: float) -> list[MemoryBreakdown]:
    """Model states as threefold's engines hold them (Ψ = this rank's parameters, N =
    dp_shard·cp, the ZeRO group, m = microbatches, bytes per element from ``state``):

    - plain / data parallel: Ψ weights, Ψ gradients (freed after every step), the optimiser
      state; data parallel adds its flat gradient buckets, Ψ, for good;
    - ZeRO 1/2 (``threefold.parallel.zero``): the full weights live in per-unit flat buffers
      and the owned shard is a separate parameter (a copy of Ψ/N unless it is the fp32 master
      the optimiser state already counts); the optimiser state is Ψ/N; at the end of backward
      stage 1 holds the full .grad (Ψ) and, in ``finish_gradients``, one unit's flat copy
      while the .grad of the units not yet reduced give way to the Ψ/N shard;
      stage 2 frees each unit's .grad once copied for its reduce-scatter, holding the shard
      and ``ZERO_REDUCES_IN_FLIGHT`` + 1 units' full copies;
    - ZeRO 3: Ψ/N weights, Ψ/N optimiser state, gradients as stage 2; two gathered units
      (the one in use and the one prefetched) while computing.
    While accumulating (m > 1), the gradients of earlier microbatches are held when the last
    backward starts: Ψ, or the Ψ/N shard under stage 3. ZeRO over one rank (N = 1) is the same
    engine with nothing to shard.

    With ``layout.offload_optimizer`` (threefold.parallel.offload) the optimiser state and the
    step's temporaries leave the device: ``optimizer`` and ``optimizer_working`` are 0 and
    ``host`` holds, per owned parameter (Ψ, or Ψ/N under ZeRO), the optimiser state plus an
    fp32 master when the state did not include it, plus the fp32 gradient buffer: 16 bytes
    either way. Under ZeRO 1/2 the device keeps the owned shard as a tensor of its own (it
    receives the host's update and is all-gathered), ``state.param`` bytes per owned element.
    Gradients stay on the device until the step copies them down."""
    state = state or state_bytes_for(work)
    m = microbatches(layout, work)
    z, n = layout.zero_stage, layout.shard_size
    per_layer = model_layer_activation_bytes(cfg, layout, work)
    working = 0.0
    if layout.recompute == "full":  # the block being recomputed holds everything at once
        working = model_layer_activation_bytes(cfg, layout, work, recompute="none")
    extra = microbatch_extra_bytes(cfg, layout, work)
    out = []
    for stage in stages:
        psi, padded, largest = _unit_totals(stage_units(cfg, layout, stage), n if z else 1)
        buffers, zero3, in_bwd = 0.0, 0.0, 0.0
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
            in_bwd = psi * state.grad if m > 1 else 0.0
            temp = 2 * -(-largest // n) * state.param
        else:
            params, opt = padded / n * state.param, padded / n * state.optimizer
            grads = (padded / n + (ZERO_REDUCES_IN_FLIGHT + 1) * largest) * state.grad
            in_bwd = padded / n * state.grad if m > 1 else 0.0
            zero3 = 2 * largest * state.param  # the unit in use and the one prefetched
            temp = 2 * -(-largest // n) * state.param
        host = host_temp = 0.0
        if layout.offload_optimizer:
            owned = psi if z == 0 else padded / n
            if z in (1, 2) and state.master_in_optimizer:
                params += owned * state.param  # the device shard, no longer the master
            host = owned * (state.optimizer + HOST_GRAD_BYTES
                            + (0 if state.master_in_optimizer else HOST_MASTER_BYTES))
            host_temp = temp / state.param * HOST_MASTER_BYTES
            opt, temp = 0.0, 0.0
        inflight = inflight_microbatches(layout.pipeline_schedule, layout.pp, m, layout.vpp,
                                         stage)
        layers = rank_layers(cfg, layout, stage)
        out.append(MemoryBreakdown(
            stage=stage, params=params, grads=grads, optimizer=opt,
            activations=(per_layer * layers + extra) * inflight, recompute_working=working,
            logits=(logits_bytes(cfg, layout, work)
                    + (head_inflight_microbatches(layout.pipeline_schedule, layout.pp, m) - 1)
                    * head_saved_bytes(cfg, layout, work)
                    if stage == layout.pp - 1 else 0.0),
            zero3_working=zero3, overhead=overhead_bytes, buffers=buffers,
            grads_in_backward=in_bwd,
            cast_weights=cast_weight_bytes(cfg, layout, work, stage) * inflight,
            optimizer_working=temp, host=host, host_working=host_temp))
    return out
