"""Closed-form costs of a model under a layout: parameters, FLOPs, communication bytes per mesh
axis and the predicted step time. Pure functions of the configuration; imports no torch, so the
planner can evaluate a 1T-parameter layout in microseconds. The runtime's measured figures are
compared against these same functions (``comm_bytes_per_step``, ``predict_step``); memory is in
``threefold.memory``, the hardware catalogue in ``threefold.hardware``.

Sections, in order: parameters of the model; ``Layout`` and ``Workload``; parameters per rank
(and the ZeRO units and gradient buckets the runtime builds from them); FLOPs and memory-bound
traffic per stage; ``collectives`` (the one list from which both the bytes per mesh axis and
the communication times are derived); which link each mesh axis crosses; the pipeline bubble;
``predict_step`` (α-β times, overlap rules, MFU/HFU).

Conventions (every function below follows them):
- A *layout* splits the world into pp × dp_replicate × dp_shard × cp × tp. Mesh axes are
  ordered outermost first as ``MESH_ORDER``: tp innermost (NVLink), then cp, then dp_shard, then
  dp_replicate and pp outermost (DESIGN.md, topology rule). A group that does not fit inside
  one aligned node crosses the network.
- Context parallelism is threefold's (``threefold.parallel.context``): each cp rank holds
  seq_len/cp tokens of every sequence, so every per-token figure (FLOPs, memory traffic,
  activations, tp and pp messages) is that of seq_len/cp tokens, while attention still looks
  at all seq_len keys. Weights are replicated over cp: plain data parallelism all-reduces over
  dp·cp ranks ("dp_cp"), ZeRO shards over dp_shard·cp ("dp_shard_cp"). Each attention moves
  K/V on "cp" (``cp_bytes_per_attention``).
- Tensor parallelism is threefold's (``threefold.parallel.tensor``, after Megatron, Shoeybi et
  al. 2019): q/k/v/gate/up column-parallel, o/down row-parallel, vocab-parallel embedding and
  head. RMSNorm weights are *replicated* over tp (under sequence parallelism their gradients
  are all-reduced over tp in every backward). When kv heads < tp, k/v projections stay whole
  on every tp rank, each rank computing the one kv head its query heads use, and their weight
  gradients are all-reduced over tp in every backward. The vocabulary is padded to a multiple
  of tp, as the runtime pads it (Megatron pads further, to 128·t); an intermediate size that
  tp does not divide is padded to ceil(f/tp) per rank (the runtime refuses it; the planner
  allows it, with a warning).
- Pipeline (planned, not yet run by the runtime): virtual stage s of v·p lives on rank s % p
  (Megatron's interleaved layout); rank 0 also holds the embedding, rank p-1 the final norm
  and LM head; with tied embeddings and pp > 1 both ends hold a copy, whose gradients are
  all-reduced between them once per step.
- Bytes are those one rank *sends*, counted exactly as ``threefold.comm.Comm`` counts them (ring
  algorithms): all-reduce 2·(numel − own chunk), reduce-scatter and all-gather (n−1)·numel/n
  elements, point-to-point all of it. For the rank with coordinate 0 on every axis (global
  rank 0, the one that writes summary.json); other ranks differ by at most 2 elements per
  all-reduce whose size the group does not divide. With n dividing every size these are the
  published 2(n−1)/n·S and (n−1)/n·S.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from threefold.config import Config, ModelConfig
from threefold.moe import inactive_parameters, moe_layer_parameters
from threefold.parallel.pipeline.balance import split_counts

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first (= mesh.AXES)
# Axes communication is counted on: the mesh axes plus the flattened ones the runtime reports
# (threefold.mesh.FLATTENED): "dp" (dp_replicate × dp_shard), where plain data parallelism
# all-reduces with cp = 1; with cp > 1 it all-reduces over "dp_cp" (dp × cp) and ZeRO shards
# over "dp_shard_cp" (dp_shard × cp) instead of "dp_shard".
FLATTENED_AXES = {"dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
                  "dp_shard_cp": ("dp_shard", "cp")}
# Expert parallelism (threefold.parallel.expert, threefold.mesh.EXPERT_AXES): "ep" (the ranks
# that split one layer's experts: the innermost ep of dp_shard), "edp_shard" (dp_shard/ep: the
# ranks holding the same experts within dp_shard, over which ZeRO shards the expert units) and
# "edp" (dp/ep: every rank holding the same experts, over which plain data parallelism
# all-reduces their gradients).
EXPERT_AXES = ("ep", "edp_shard", "edp")
COMM_AXES = MESH_ORDER + tuple(FLATTENED_AXES) + EXPERT_AXES
CP_ALGORITHMS = ("ring", "allgather")
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
DTYPE_BYTES = {"bf16": 2, "fp32": 4}

# The one calibration constant: achieved matmul FLOP/s as a fraction of the datasheet peak.
# Fitted once to Narayanan et al. 2021 Table 1 (ten GPT runs, 1.7B-1T on up to 3072 A100s;
# tests/test_cost.py): predicted/published TF/s per GPU then spans 0.93-1.06 over all rows.
# Everything else in the time model is a datasheet figure or a count (FLOPs, bytes).
# A measured Hardware (``Hardware.measured``) carries achieved FLOP/s and uses 1.0 instead.
MATMUL_EFFICIENCY = 0.58
DEFAULT_BUCKET_MB = 25.0  # = ParallelConfig.bucket_mb: data-parallel gradient buckets, MiB
# The optimiser step as threefold's engines run it — torch's single-tensor AdamW (foreach=False)
# and the gradient-norm clip — is memory-bound: fp32 elements read or written per parameter
# it updates: weight decay 2, first moment 3, second moment 5, the denominator 6, the update 4,
# the squared norm 3, the clipping scale 2.
ADAMW_ACCESSES_PER_PARAM = 25


class LayoutError(ValueError):
    """A layout that does not divide the world, the model or the batch."""


# --------------------------------------------------------------------------------------------
# Parameters of the model (exact; unchanged API)
# --------------------------------------------------------------------------------------------
def layer_parameters(cfg: ModelConfig) -> int:
    """Weights of one transformer block: attention, SwiGLU MLP (or, with
    ``num_local_experts``, the router and every expert) and its two RMSNorms."""
    h, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q = h * cfg.num_attention_heads * hd
    kv = 2 * h * cfg.num_key_value_heads * hd
    o = cfg.num_attention_heads * hd * h
    mlp = moe_layer_parameters(cfg) if cfg.num_local_experts else 3 * h * f
    return q + kv + o + mlp + 2 * h


def num_parameters(cfg: ModelConfig) -> int:
    """Exact parameter count of the model built from ``cfg`` (a resolved config)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    head = 0 if cfg.tie_word_embeddings else v * h
    return v * h + cfg.num_hidden_layers * layer_parameters(cfg) + h + head


def active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token uses: all of them but, in a mixture of experts, the E − k experts
    per layer it is not routed to (the router counts: every token uses all of it). Equal to
    ``num_parameters`` for a dense model."""
    return num_parameters(cfg) - inactive_parameters(cfg)


def matmul_parameters(cfg: ModelConfig) -> int:
    """Parameters that take part in a matrix multiply per token: every Linear weight (of a
    mixture of experts, the router and the token's k experts), the LM head included (tied or
    not); the embedding lookup and the norms excluded."""
    h, v = cfg.hidden_size, cfg.vocab_size
    return cfg.num_hidden_layers * (layer_parameters(cfg) - 2 * h) + v * h \
        - inactive_parameters(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM (arXiv 2204.02311, App. B): 6N + 12·L·H·Q·T, with N the
    matmul parameters, H heads, Q head dim, T the sequence length. Recomputation excluded, so
    this is the model-FLOPs (MFU) numerator, not the hardware-FLOPs one."""
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len
    return 6.0 * matmul_parameters(cfg) + attn


# --------------------------------------------------------------------------------------------
# Layout and workload
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How one step is split over the world. ``schedule`` '' means 1f1b, or interleaved-1f1b
    when vpp > 1; sequence parallelism only matters when tp > 1. ``bucket_mb`` is the
    data-parallel gradient bucket (``parallel.bucket_mb``), which sets how the all-reduce is cut."""

    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    zero_stage: int = 0
    vpp: int = 1
    microbatch_size: int = 1
    recompute: str = "none"
    schedule: str = ""
    sequence_parallel: bool = True
    bucket_mb: float = DEFAULT_BUCKET_MB
    pipeline_split: str = "params"
    cp: int = 1
    cp_algorithm: str = "ring"
    # AdamW's state and the fp32 master in host memory, the step run there
    # (``parallel.offload_optimizer``, threefold.parallel.offload)
    offload_optimizer: bool = False
    # expert parallelism (``parallel.ep``, a mixture of experts only): each MoE layer's experts
    # split over ep ranks, the innermost ep of dp_shard
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas times shards (the ranks that see different data;
        context-parallel ranks see the same sequences)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        """Ranks this layout uses."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def data_axis(self) -> str:
        """The axis plain data parallelism all-reduces gradients over: "dp", or "dp_cp" with
        cp > 1 (context-parallel ranks hold the same weights)."""
        return "dp" if self.cp == 1 else "dp_cp"

    @property
    def shard_axis(self) -> str:
        """The axis ZeRO shards over: "dp_shard", or "dp_shard_cp" with cp > 1."""
        return "dp_shard" if self.cp == 1 else "dp_shard_cp"

    @property
    def shard_size(self) -> int:
        """Ranks a ZeRO shard group holds: dp_shard · cp."""
        return self.dp_shard * self.cp

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (needs tp > 1)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def pipeline_schedule(self) -> str:
        """The schedule name, with the default filled in."""
        return self.schedule or ("interleaved-1f1b" if self.vpp > 1 else "1f1b")

    @property
    def bucket_bytes(self) -> int:
        """Gradient bucket size in bytes, as ``threefold.parallel.data`` computes it."""
        return int(self.bucket_mb * 2**20)

    @property
    def edp_shard(self) -> int:
        """Ranks of dp_shard holding the same experts: dp_shard / ep (ZeRO shards the expert
        units over them)."""
        return self.dp_shard // self.ep

    @property
    def edp(self) -> int:
        """Data-parallel ranks holding the same experts: dp / ep (plain data parallelism
        all-reduces the expert gradients over them)."""
        return self.dp // self.ep

    def size(self, axis: str) -> int:
        """Degree of the named mesh axis (or of a flattened one, e.g. "dp" = dp_replicate ·
        dp_shard, "dp_cp", "dp_shard_cp"; or of an expert axis, "ep", "edp_shard", "edp")."""
        if axis in FLATTENED_AXES:
            return math.prod(getattr(self, a) for a in FLATTENED_AXES[axis])
        return getattr(self, axis)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "Layout":
        """The layout a training config describes on ``world_size`` ranks (dp_shard -1 = rest).
        A micro-batch larger than a rank's share of the batch is that share, as in the loop."""
        p = cfg.parallel
        dp_shard = p.dp_shard
        if dp_shard == -1:
            rest = p.pp * p.dp_replicate * p.cp * p.tp
            if world_size % rest:
                raise LayoutError(f"world size {world_size} is not a multiple of "
                                  f"pp·dp_replicate·cp·tp = {rest}")
            dp_shard = world_size // rest
        local = max(1, cfg.train.global_batch_size // (p.dp_replicate * dp_shard))
        return cls(tp=p.tp, pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard,
                   zero_stage=p.zero_stage, vpp=p.vpp,
                   microbatch_size=min(cfg.train.micro_batch_size, local),
                   recompute="full" if cfg.train.activation_checkpointing else "none",
                   schedule=p.schedule, sequence_parallel=p.sequence_parallel,
                   bucket_mb=p.bucket_mb, cp=p.cp, cp_algorithm=p.cp_algorithm,
                   offload_optimizer=p.offload_optimizer, ep=p.ep,
                   pipeline_split=(f"flops:{cfg.data.seq_len}" if p.pipeline_split == "flops"
                                   else p.pipeline_split))


@dataclass(frozen=True)
class Workload:
    """What one optimiser step trains: ``global_batch`` sequences of ``seq_len`` tokens.
    ``flash_attention`` False means the attention probabilities are materialised.

    ``precision`` is the matmul (activation) dtype. ``residual_bytes`` and ``master_bytes``
    (0 = the same as the activations) are the element sizes of the residual stream and of the
    stored weights and gradients. The published figures (Megatron, ZeRO) keep all three in
    16 bits under bf16/fp16 and the fp32 master copy in the optimiser state, which is this
    class's default. threefold's runtime keeps fp32 weights, gradients and residual stream and
    autocasts only the matmuls: ``Workload.from_config`` describes that. ``eager`` says the
    elementwise work runs one kernel per operation, as PyTorch's eager mode does (threefold
    without ``train.compile``), rather than fused (Megatron's kernels, torch.compile); it
    changes the memory traffic ``stage_memory_traffic_per_microbatch`` counts."""

    seq_len: int
    global_batch: int
    precision: str = "bf16"
    flash_attention: bool = True
    residual_bytes: int = 0
    master_bytes: int = 0
    eager: bool = False  # one kernel per elementwise op (threefold without compile), not fused

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return self.seq_len * self.global_batch

    @property
    def act_bytes(self) -> int:
        """Bytes of one matmul activation element."""
        return DTYPE_BYTES[self.precision]

    @property
    def resid_bytes(self) -> int:
        """Bytes of one element of the residual stream (what norms read, what the tp
        "enter" collectives and pipeline sends move)."""
        return self.residual_bytes or self.act_bytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of one stored weight or gradient element (what ZeRO gathers and data
        parallelism reduces)."""
        return self.master_bytes or self.act_bytes

    @classmethod
    def from_config(cls, cfg: Config) -> "Workload":
        """The workload of a threefold training config, with the runtime's numerics: fp32
        weights, gradients and residual stream; matmuls in ``train.dtype`` (autocast);
        attention through ``scaled_dot_product_attention`` (a flash kernel: probabilities
        not stored); elementwise work eager unless ``train.compile``."""
        precision = "bf16" if cfg.train.dtype == "bfloat16" else "fp32"
        return cls(seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch_size,
                   precision=precision, flash_attention=True, residual_bytes=4, master_bytes=4,
                   eager=not cfg.train.compile)


@dataclass(frozen=True)
class TPShard:
    """Per-rank widths of one block under tensor parallelism."""

    heads: int  # query heads per rank
    kv_heads: int  # kv heads per rank (1 when replicated)
    kv_replicas: int  # ranks that hold a copy of each kv head (1 = sharded)
    ffn: int  # intermediate width per rank (ceil(f/tp))
    vocab: int  # padded vocabulary rows per rank


def padded_vocab(cfg: ModelConfig, tp: int) -> int:
    """Vocabulary padded to a multiple of tp, as ``threefold.parallel.tensor`` pads it."""
    return -(-cfg.vocab_size // tp) * tp


@lru_cache(maxsize=4096)
def _tp_shard(h: int, a: int, kv: int, f: int, vocab: int, tp: int) -> TPShard:
    if a % tp:
        raise LayoutError(f"tp={tp} does not divide the {a} attention heads")
    if kv % tp == 0:
        kv_r, reps = kv // tp, 1
    elif tp % kv == 0:
        kv_r, reps = 1, tp // kv  # each kv head replicated on tp/kv ranks
    else:
        raise LayoutError(f"tp={tp} neither divides nor is a multiple of the {kv} kv heads")
    return TPShard(a // tp, kv_r, reps, -(-f // tp), -(-vocab // tp))


def tp_shard(cfg: ModelConfig, tp: int) -> TPShard:
    """Per-rank head counts and widths under ``tp``; LayoutError if tp does not fit."""
    return _tp_shard(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                     cfg.intermediate_size, cfg.vocab_size, tp)


def check_layout(cfg: ModelConfig, layout: Layout, work: Workload) -> None:
    """Raise LayoutError naming the first rule ``layout`` breaks for this model and batch."""
    if layout.recompute not in RECOMPUTE:
        raise LayoutError(f"recompute '{layout.recompute}' is not one of {RECOMPUTE}")
    if layout.pipeline_schedule not in SCHEDULES:
        raise LayoutError(f"schedule '{layout.pipeline_schedule}' is not one of {SCHEDULES}")
    if layout.zero_stage not in (0, 1, 2, 3):
        raise LayoutError(f"zero_stage {layout.zero_stage} is not 0-3")
    if layout.cp < 1 or layout.cp_algorithm not in CP_ALGORITHMS:
        raise LayoutError(f"cp={layout.cp} with cp_algorithm '{layout.cp_algorithm}': cp must "
                          f"be >= 1 and the algorithm one of {CP_ALGORITHMS}")
    if layout.cp > 1 and work.seq_len % (2 * layout.cp):
        raise LayoutError(f"cp={layout.cp}: seq_len {work.seq_len} is not divisible by 2·cp "
                          "(each cp rank holds two balanced chunks)")
    tp_shard(cfg, layout.tp)
    check_experts(cfg, layout)
    chunks = layout.pp * layout.vpp
    if cfg.num_hidden_layers < chunks:  # uneven splits are fine: see pipeline_layers
        raise LayoutError(f"pp·vpp={chunks} is more than the {cfg.num_hidden_layers} layers "
                          "(each pipeline chunk needs one)")
    if layout.vpp > 1 and layout.pipeline_schedule != "interleaved-1f1b":
        raise LayoutError("vpp > 1 needs the interleaved-1f1b schedule")
    m = microbatches(layout, work)
    if layout.pp == 1:
        return  # no pipeline: the schedule is not used (as the runtime ignores it)
    if layout.pipeline_schedule == "interleaved-1f1b" and (layout.pp < 2 or m % layout.pp):
        raise LayoutError(f"interleaved 1F1B needs pp >= 2 and microbatches ({m}) a multiple "
                          f"of pp ({layout.pp})")


def check_experts(cfg: ModelConfig, layout: Layout) -> None:
    """LayoutError naming the field for a layout the runtime's mixture of experts does not
    take (``threefold.parallel.layout.validate_layout``): ep must divide the experts and
    dp_shard, ep needs experts; experts train under data, expert, tensor (without sequence
    parallelism) and pipeline parallelism and ZeRO, not under context parallelism."""
    e, ep = cfg.num_local_experts or 0, layout.ep
    if ep < 1:
        raise LayoutError(f"parallel.ep: must be >= 1, got {ep}")
    if not e:
        if ep > 1:
            raise LayoutError(f"parallel.ep: {ep} needs a mixture of experts "
                              "(model.num_local_experts > 0); set parallel.ep 1")
        return
    if e % ep:
        raise LayoutError(f"parallel.ep: {ep} does not divide model.num_local_experts={e}")
    if layout.dp_shard % ep:
        raise LayoutError(f"parallel.ep: {ep} does not divide parallel.dp_shard="
                          f"{layout.dp_shard} (expert-parallel ranks are part of dp_shard)")
    if layout.cp > 1:
        raise LayoutError(f"parallel.cp: {layout.cp} with a mixture of experts "
                          f"(model.num_local_experts={e}): not supported yet; set parallel.cp 1")
    if layout.sp:
        raise LayoutError(f"parallel.sequence_parallel: tp={layout.tp} with a mixture of "
                          f"experts (model.num_local_experts={e}) runs without sequence "
                          "parallelism; set parallel.sequence_parallel false")


def local_seq_len(layout: Layout, work: Workload) -> int:
    """Tokens of each sequence one rank holds: seq_len / cp."""
    return work.seq_len // layout.cp


def microbatches(layout: Layout, work: Workload) -> int:
    """Microbatches per step on each pipeline (gradient-accumulation steps without pp)."""
    per_replica, rem = divmod(work.global_batch, layout.dp * layout.microbatch_size)
    if rem or not per_replica:
        raise LayoutError(f"global batch {work.global_batch} is not a multiple of "
                          f"dp·microbatch = {layout.dp}·{layout.microbatch_size}")
    return per_replica


# --------------------------------------------------------------------------------------------
# Parameters per rank, as the runtime groups them
# --------------------------------------------------------------------------------------------
def layer_parameters_per_rank(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(tp-sharded, tp-replicated) weights of one block on one rank, as the FLOPs see them: the
    replicated ones are the two RMSNorm weights; a replicated kv projection counts as the one
    kv head the rank computes with. A mixture of experts' feed-forward is in neither (it is
    whole on every tp rank and a token uses k of its experts: ``moe_matmul_parameters``)."""
    sh, h, hd = tp_shard(cfg, tp), cfg.hidden_size, cfg.head_dim
    mlp = 0 if cfg.num_local_experts else 3 * h * sh.ffn
    sharded = 2 * h * sh.heads * hd + 2 * h * sh.kv_heads * hd + mlp
    return sharded, 2 * h


def _moe_key(cfg: ModelConfig) -> tuple[int, int, int]:
    """(experts E, experts per token k, shared expert width), (0, 0, 0) for a dense model."""
    if not cfg.num_local_experts:
        return (0, 0, 0)
    return (cfg.num_local_experts, cfg.num_experts_per_tok,
            getattr(cfg, "shared_expert_intermediate_size", 0) or 0)


def moe_matmul_parameters(cfg: ModelConfig) -> int:
    """Weights of one MoE feed-forward that take part in a matmul per token: the router
    (E·h), the token's k experts (3·h·f each) and a shared expert with its gate. 0 for a
    dense model. Not split by tp (the runtime keeps the MoE whole on every tp rank)."""
    e, k, fs = _moe_key(cfg)
    if not e:
        return 0
    h = cfg.hidden_size
    return e * h + k * 3 * h * cfg.intermediate_size + (3 * h * fs + h if fs else 0)


def _shape_key(cfg: ModelConfig) -> tuple:
    return (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers,
            bool(cfg.tie_word_embeddings), _moe_key(cfg))


@lru_cache(maxsize=4096)
def _block_numels(h: int, a: int, kv: int, f: int, vocab: int, tp: int) -> tuple[int, ...]:
    sh, hd = _tp_shard(h, a, kv, f, vocab, tp), h // a
    kv_rows = (kv * hd) if sh.kv_replicas > 1 else sh.kv_heads * hd  # replicated: whole
    # registration order of threefold.model.LlamaDecoderLayer: input_layernorm,
    # q/k/v/o_proj, post_attention_layernorm, gate/up/down_proj
    return (h, sh.heads * hd * h, kv_rows * h, kv_rows * h, h * sh.heads * hd, h,
            sh.ffn * h, sh.ffn * h, h * sh.ffn)


@lru_cache(maxsize=4096)
def _layer_numels(h: int, a: int, kv: int, f: int, vocab: int, tp: int, moe: tuple, ep: int
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the block's parameters, its expert tensors held apart) on one tp and ep rank, in
    registration order. Dense: (``_block_numels``, ()). A mixture of experts (HF Mixtral
    names, threefold.moe): the norms and attention, then ``mlp.gate`` (E·h),
    ``mlp.experts.gate_up_proj`` (E/ep·2f·h), ``mlp.experts.down_proj`` (E/ep·h·f), a shared
    expert (gate/up/down, then its 1×h gate); the MoE is whole on every tp rank. With ep > 1
    the two expert tensors are held apart (the runtime's engines treat them apart: their own
    ZeRO unit, their own gradient buckets), else they are in the block."""
    dense = _block_numels(h, a, kv, f, vocab, tp)
    e, _, fs = moe
    if not e:
        return dense, ()
    router = (e * h,)
    experts = ((e // ep) * 2 * f * h, (e // ep) * h * f)
    shared = (fs * h, fs * h, h * fs, h) if fs else ()
    if ep == 1:
        return dense[:6] + router + experts + shared, ()
    return dense[:6] + router + shared, experts


def block_parameter_numels(cfg: ModelConfig, tp: int) -> tuple[int, ...]:
    """Elements of each parameter of one block held by one tp rank, in the order the model
    registers them (a replicated k/v projection is held whole; a mixture of experts' every
    expert, as without expert parallelism)."""
    h, a, kv, f, vocab, _, _, moe = _shape_key(cfg)
    return _layer_numels(h, a, kv, f, vocab, tp, moe, 1)[0]


@lru_cache(maxsize=4096)
def _virtual_stage_layers(key: tuple, n_stages: int, split: str = "params") -> tuple[int, ...]:
    h, a, kv, f, vocab, n_layers, tied, moe = key
    layer = sum(_layer_numels(h, a, kv, f, vocab, 1, moe, 1)[0])  # every expert
    emb = vocab * h
    if split.startswith("flops"):  # "flops:T", as stage.stage_costs counts them at length T
        try:
            t = int(split.split(":")[1])
        except (IndexError, ValueError):
            raise LayoutError(f"pipeline_split '{split}': the planner needs 'flops:SEQ_LEN'") \
                from None
        # stage_costs counts the nn.Linear weights: of a mixture of experts, the attention's
        # and a shared expert's (the router and the 3-D expert tensors are not Linears)
        linear = layer - 2 * h if not moe[0] else \
            sum(_block_numels(h, a, kv, f, vocab, 1)[1:5]) + (3 * h * moe[2] + h if moe[2] else 0)
        per_block = 6.0 * linear + 12.0 * a * (h // a) * t
        return split_counts("flops", [per_block] * n_layers, n_stages, 0.0, 6.0 * emb)
    return split_counts(split, [float(layer)] * n_layers, n_stages, float(emb),
                        float(h + (0 if tied else emb)))


def pipeline_layers(cfg: ModelConfig, layout: Layout) -> tuple[int, ...]:
    """Blocks of each of the ``pp·vpp`` virtual stages, split as the runtime splits the model
    (``threefold.parallel.pipeline.stage.split_model`` with ``parallel.pipeline_split``: by
    default balanced by parameters, the embedding counted on the first stage, the final norm
    and an untied head on the last; "flops:T" balanced by training FLOPs at sequence length
    T; uniform; or given counts), so that every per-stage figure here is that of the stage a
    run builds."""
    return _virtual_stage_layers(_shape_key(cfg), layout.pp * layout.vpp, layout.pipeline_split)


def rank_layers(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    """Blocks one rank of pipeline ``stage`` holds: its ``vpp`` chunks (virtual stages
    ``c·pp + stage``) together."""
    return _rank_layers(_shape_key(cfg), layout.pp, layout.vpp, layout.pipeline_split, stage)


@lru_cache(maxsize=65536)
def _rank_layers(key: tuple, p: int, v: int, split: str, stage: int) -> int:
    counts = _virtual_stage_layers(key, p * v, split)
    return sum(counts[c * p + stage] for c in range(v))


@lru_cache(maxsize=65536)
def _stage_units(key: tuple, tp: int, p: int, v: int, split: str, stage: int, ep: int = 1
                 ) -> tuple[tuple[int, ...], ...]:
    h, a, kv, f, vocab, n_layers, tied, moe = key
    emb = _tp_shard(h, a, kv, f, vocab, tp).vocab * h
    block = _layer_numels(h, a, kv, f, vocab, tp, moe, ep)[0]
    units: list[tuple[int, ...]] = []
    if stage == 0 and not (tied and p == 1):
        units.append((emb,))
    units += [block] * _rank_layers(key, p, v, split, stage)
    if stage == p - 1:
        units.append((h,))
        if not (tied and p == 1):
            units.append((emb,))
    if tied and p == 1:
        units.append((emb,))  # the shared weight: ZeRO's root unit, registered first
    return tuple(units)


def stage_units(cfg: ModelConfig, layout: Layout, stage: int) -> tuple[tuple[int, ...], ...]:
    """The parameters one rank of pipeline ``stage`` holds, grouped as threefold's ZeRO engine
    groups them into units, in forward order: the embedding, each block, the final norm, the
    LM head (each a tuple of parameter sizes in registration order). With tied embeddings on
    one stage the shared weight is one *root* unit, listed last (``ZeroEngine`` does so); in
    registration order it comes first (``parameter_numels``). Under expert parallelism
    (ep > 1) a block's expert tensors are not in its unit: ``stage_expert_units``."""
    return _stage_units(_shape_key(cfg), layout.tp, layout.pp, layout.vpp,
                        layout.pipeline_split, stage, layout.ep)


def stage_expert_units(cfg: ModelConfig, layout: Layout, stage: int
                       ) -> tuple[tuple[int, ...], ...]:
    """Under expert parallelism (ep > 1), the expert tensors one rank of ``stage`` holds,
    one unit per block (gate_up_proj, down_proj of its E/ep experts): the runtime's ZeRO
    shards each over "edp_shard" (padded to a multiple of dp_shard/ep), its data parallelism
    all-reduces them over "edp" in buckets of their own. () without ep (the experts are then
    in their blocks' units) or for a dense model."""
    h, a, kv, f, vocab, _, _, moe = _shape_key(cfg)
    experts = _layer_numels(h, a, kv, f, vocab, layout.tp, moe, layout.ep)[1]
    if not experts:
        return ()
    return (experts,) * rank_layers(cfg, layout, stage)


def parameter_numels(cfg: ModelConfig, layout: Layout, stage: int = 0) -> list[int]:
    """Sizes of the parameters one rank of ``stage`` holds, in the model's registration order
    (embedding, blocks, final norm, LM head; a tied weight once, first): the order
    ``threefold.parallel.data`` cuts gradient buckets in."""
    units = list(stage_units(cfg, layout, stage))
    if cfg.tie_word_embeddings and layout.pp == 1:
        units = [units[-1]] + units[:-1]
    return [n for unit in units for n in unit]


def owned_parameters(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    """Parameters one rank of ``stage`` updates: all it holds, or under ZeRO its shard of
    each unit (padded to a multiple of dp_shard·cp, as ``threefold.parallel.zero`` pads; an
    expert unit to a multiple of dp_shard/ep, its shard group)."""
    n = layout.shard_size if layout.zero_stage else 1
    ne = layout.edp_shard if layout.zero_stage else 1
    return sum(-(-sum(u) // n) for u in stage_units(cfg, layout, stage)) \
        + sum(-(-sum(u) // ne) for u in stage_expert_units(cfg, layout, stage))


def stage_parameters(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    """Parameters held by one rank of pipeline stage ``stage`` (tp-sharded, vocabulary padded;
    of a mixture of experts, the rank's E/ep experts per block)."""
    return sum(sum(u) for u in stage_units(cfg, layout, stage)) \
        + sum(sum(u) for u in stage_expert_units(cfg, layout, stage))


def largest_unit_parameters(cfg: ModelConfig, tp: int) -> int:
    """Largest unit of weights ZeRO-3 gathers at once on one rank: a transformer block or the
    embedding/head shard (DeepSpeed's 'largest layer'); without expert parallelism."""
    return max(sum(block_parameter_numels(cfg, tp)), tp_shard(cfg, tp).vocab * cfg.hidden_size)


@lru_cache(maxsize=4096)
def _buckets(numels: tuple[int, ...], elem: int, bucket_bytes: int) -> tuple[int, ...]:
    out, cur = [], 0
    for n in reversed(numels):
        cur += n
        if cur * elem >= bucket_bytes:
            out.append(cur)
            cur = 0
    if cur:
        out.append(cur)
    return tuple(out)


def gradient_buckets(cfg: ModelConfig, layout: Layout, elem_bytes: int, stage: int = 0
                     ) -> tuple[int, ...]:
    """Elements of each data-parallel gradient bucket, cut as ``threefold.parallel.data``
    cuts them: parameters in reverse registration order, a bucket closed once it reaches
    ``layout.bucket_bytes``."""
    return _buckets(tuple(parameter_numels(cfg, layout, stage)), elem_bytes, layout.bucket_bytes)


# --------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------
def model_flops_per_step(cfg: ModelConfig, work: Workload) -> float:
    """Model FLOPs of one step (the MFU numerator, PaLM's definition: no recompute)."""
    return flops_per_token(cfg, work.seq_len) * work.tokens


def stage_flops_per_microbatch(cfg: ModelConfig, layout: Layout, work: Workload,
                               stage: int) -> tuple[float, float]:
    """(forward, backward + recompute) FLOPs one rank of ``stage`` executes per microbatch,
    over all its chunks: what the hardware does, including redundant replicated-kv work, the
    padded vocabulary and recomputation. Backward is twice forward (input and weight grads);
    full recompute re-runs each block's forward, selective only the attention core
    (Korthikanti et al., arXiv 2205.05198 §5). Under cp a rank computes its seq_len/cp tokens,
    each attending over all seq_len keys. A mixture of experts' feed-forward costs its
    router and k experts per token (``moe_matmul_parameters``) on every tp rank (it is not
    split by tp); under expert parallelism a rank computes the rows routed to its experts,
    N·k in expectation under uniform routing, the same FLOPs."""
    sh, h, hd, s = tp_shard(cfg, layout.tp), cfg.hidden_size, cfg.head_dim, work.seq_len
    tokens = layout.microbatch_size * local_seq_len(layout, work)
    layers = rank_layers(cfg, layout, stage)
    sharded, _ = layer_parameters_per_rank(cfg, layout.tp)
    core = 4 * s * sh.heads * hd  # QK^T and AV per token, no causal halving (as PaLM)
    layer_fwd = tokens * (2 * sharded + 2 * moe_matmul_parameters(cfg) + core)
    fwd = layers * layer_fwd
    bwd = 2 * fwd
    if layout.recompute == "full":
        bwd += fwd
    elif layout.recompute == "selective":
        bwd += layers * tokens * core
    if stage == layout.pp - 1:  # LM head: never recomputed
        head = 2 * tokens * sh.vocab * h
        fwd, bwd = fwd + head, bwd + 2 * head
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

    Materialised attention adds a softmax that reads and writes a·s scores. Recompute repeats
    the forward (or only the softmax, when selective). The last stage (``stage`` None: the
    last) adds the loss over its vocabulary shard, in fp32: forward reads the logits twice
    (max, sum of exponentials) and writes the (log-)softmax, backward fills and reads the
    gradients and writes the logits' gradient, 8 passes of 4·V/t bytes.

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
    layers = rank_layers(cfg, layout, layout.pp - 1 if stage is None else stage)
    split = layout.tp if layout.sp else 1
    qk = (sh.heads + sh.kv_heads) * hd
    softmax = 0 if work.flash_attention else 2 * d * sh.heads * s
    e, k, fs = _moe_key(cfg)
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
    if layout.recompute == "full":
        bwd += fwd
    elif layout.recompute == "selective":
        bwd += layers * tokens * softmax
    if stage is None or stage == layout.pp - 1:
        fwd += 3 * 4 * tokens * sh.vocab
        bwd += 5 * 4 * tokens * sh.vocab
    return fwd, bwd


def hardware_flops_per_step(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """FLOPs all ranks execute in one step (the HFU numerator: recompute included)."""
    per_pipeline = 0.0
    for st in _distinct_stages(cfg, layout):
        flops = sum(stage_flops_per_microbatch(cfg, layout, work, st))
        per_pipeline += flops * _stage_multiplicity(cfg, layout, st)
    return per_pipeline * microbatches(layout, work) * layout.tp * layout.dp * layout.cp


@lru_cache(maxsize=4096)
def _stage_representatives(key: tuple, p: int, v: int, split: str) -> tuple[int, ...]:
    """For each pipeline stage, the first stage of its kind (first, last, or a middle one with
    the same block count): stages of one kind have the same costs."""
    first: dict[tuple, int] = {}
    return tuple(first.setdefault((st == 0, st == p - 1, _rank_layers(key, p, v, split, st)), st)
                 for st in range(p))


def _distinct_stages(cfg: ModelConfig, layout: Layout) -> list[int]:
    """One stage for each kind of pipeline rank: the first, the last, and one per distinct
    block count in between (all alike when the split is even)."""
    return sorted(set(_stage_representatives(_shape_key(cfg), layout.pp, layout.vpp,
                                             layout.pipeline_split)))


def _stage_multiplicity(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    """How many stages the representative ``stage`` stands for."""
    return _stage_representatives(_shape_key(cfg), layout.pp, layout.vpp,
                                  layout.pipeline_split).count(stage)


# --------------------------------------------------------------------------------------------
# Collectives per step
# --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Collective:
    """One kind of collective a rank issues: ``count`` calls of ``op`` on a buffer of ``numel``
    elements of ``elem`` bytes over ``group`` ranks of mesh axis ``axis``; per microbatch when
    ``per_microbatch``. ``overlap`` says what may hide it: 'none' (on the critical path),
    'hidden' (overlapped entirely), 'forward'/'backward' (that microbatch's compute, except one
    bucket), 'last' (the last microbatch's backward, except one bucket), 'step' (after the
    step, exposed), 'attention-forward'/'attention-backward' (each call behind the compute of
    one ring-attention block, forward or backward)."""

    axis: str
    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | p2p
    numel: int
    elem: int
    count: int
    group: int
    per_microbatch: bool
    overlap: str

    @property
    def size(self) -> int:
        """Bytes of the buffer (all_gather: the gathered output, reduce_scatter: the input)."""
        return self.numel * self.elem

    def bytes_sent(self, index: int = 0) -> int:
        """Bytes the rank with coordinate ``index`` on the axis sends per call, exactly as
        ``threefold.comm.Comm`` counts them."""
        n, numel = self.group, self.numel
        if self.op == "all_reduce":  # every chunk but its own, twice (tensor_split chunks)
            q, r = divmod(numel, n)
            return 2 * (numel - q - (1 if index < r else 0)) * self.elem
        if self.op in ("all_gather", "reduce_scatter", "all_to_all"):  # all_to_all: even split
            return (n - 1) * numel // n * self.elem
        return numel * self.elem  # p2p

    def time(self, latency_s: float, bw: float, size: float | None = None) -> float:
        """α-β time of one call (on a buffer of ``size`` bytes if given)."""
        n, size = self.group, self.size if size is None else size
        if self.op == "p2p":
            return latency_s + size / bw
        steps = 2 * (n - 1) if self.op == "all_reduce" else n - 1
        frac = (2 if self.op == "all_reduce" else 1) * (n - 1) / n
        return steps * latency_s + frac * size / bw


def collectives(cfg: ModelConfig, layout: Layout, work: Workload, stage: int,
                grad_bytes: int | None = None, param_bytes: int | None = None
                ) -> list[Collective]:
    """Every collective one rank of ``stage`` issues in a step, as threefold's runtime issues
    them (x = b·s·h elements of one microbatch's activation, L = layers on the stage).

    tp (``threefold.parallel.tensor``; Megatron §3, Korthikanti et al. §4.2.2), per microbatch:
    without SP each layer all-reduces its two sub-layer outputs forward (matmul dtype) and its
    two sub-layer input gradients backward (residual dtype): 8·x·(t-1)/t elements per layer.
    With SP each "all-reduce" becomes an all-gather plus a reduce-scatter — the same bytes;
    the q/k/v and gate/up linears keep the gathered input for backward, so there is no
    re-gather — plus an all-reduce of each RMSNorm weight gradient (h elements, 2 per layer
    and the final norm) in every backward. The vocab-parallel embedding all-reduces (SP:
    reduce-scatters, all-gathers back) x forward; the LM head input's gather costs x backward
    (SP: forward and backward); the vocab-parallel loss all-reduces 3 vectors of b·s fp32.
    Replicated k/v projections (kv heads < tp) all-reduce their whole weight gradient over tp
    in every backward. Full recompute (torch's non-reentrant checkpoint) re-runs each block's
    forward but stops as soon as the last tensor saved for backward is rebuilt
    (``torch.utils.checkpoint.set_checkpoint_early_stop``, on by default), so the attention's
    closing collective is repeated and the MLP's is not: +1 all-reduce per layer, or under SP
    +2 all-gathers and +1 reduce-scatter. The gradient-norm all-reduces one fp32 scalar over tp.
    pp: b·s·h (/t under SP) to the next stage and back per microbatch per chunk boundary, in
    the residual dtype; the gradient norm all-reduces 2 fp32 scalars over the stages (these
    pipeline figures are the planner's: not yet checked against the pipeline executor).
    dp (``threefold.parallel.data`` / ``zero``; ZeRO arXiv 1910.02054 §7): stage 0 all-reduces
    the gradient buckets over the flattened "dp" group once per step (no sync while
    accumulating), overlapped with the last backward; ZeRO works per unit (embedding, each
    block, final norm, head; each padded to a multiple of dp_shard): stages 1 and 2
    reduce-scatter every unit once per step (stage 2 from backward hooks) and all-gather it
    after the optimiser step; stage 3 all-gathers each unit before its forward and again before
    its backward and reduce-scatters it, every microbatch (a tied root unit stays gathered
    from the first forward to the end of the step: one gather per step). Then, with
    dp_replicate > 1, every unit's gradient shard is all-reduced over dp_replicate, and the
    gradient norm all-reduces 2 fp32 scalars over dp_shard. Weights and gradients move in
    ``work.weight_bytes`` unless ``grad_bytes``/``param_bytes`` say otherwise.
    Mixture of experts (``threefold.moe``, ``threefold.parallel.expert``): the MoE is whole on
    every tp rank, so only the attention has tp collectives (one all-reduce per layer each
    way, and the recomputed attention's). With ep > 1, per MoE layer and microbatch, on "ep"
    (all-to-alls, on the critical path): the count exchange, E int64 split evenly over the ep
    ranks; dispatch, the rank's N·k (token, expert) rows (N = b·s tokens) of h elements in the
    residual dtype (the MLP's input) to the experts' ranks, and combine, the rows back in the
    matmul dtype (the experts' output); backward, their gradients, the same sizes. Bytes sent
    are the uniform-routing expectation, (ep−1)/ep of the rows leaving the rank each way:
    4·N·k·(ep−1)/ep·h elements + E·8·(ep−1)/ep bytes per layer, or under full recompute (the
    forward's three all-to-alls again) 6·N·k·(ep−1)/ep·h + 2·E·8·(ep−1)/ep; real routing
    varies around it. The expert tensors' gradients: ZeRO-0 all-reduces them over "edp"
    (dp/ep) in buckets of their own (the dense ones over "dp" as always) and the gradient
    norm all-reduces one fp32 over "ep"; ZeRO 1-3 makes each block's experts a unit of its
    own over "edp_shard" (dp_shard/ep), padded to a multiple of it, with the dense units'
    collectives (stage 3 under full recompute gathers it a third time: the recomputed forward
    runs before the unit's backward hook) and, with dp_replicate > 1, its shard gradient
    all-reduced over dp_replicate.
    cp (``threefold.parallel.context``), per microbatch and layer: the attention's K/V moves,
    ``cp_bytes_per_attention`` of this rank's K and V (2·b·kv heads per tp rank·s/cp·head_dim
    in the matmul dtype), its forward twice under recompute. Ring: point-to-point hops of the
    K/V block, posted before the block in hand is computed (each hides behind one block's
    attention), and in backward the dK/dV accumulator's hops, which wait right after their
    block (exposed). Allgather: an all-gather forward and a reduce-scatter backward, exposed.
    With cp > 1, s above is seq_len/cp, the data-parallel all-reduce runs over "dp_cp" (dp·cp
    ranks) and ZeRO over "dp_shard_cp" (dp_shard·cp ranks, units padded to a multiple of it).
    """
    t, p, v, b = layout.tp, layout.pp, layout.vpp, layout.microbatch_size
    s = local_seq_len(layout, work)
    d, r = work.act_bytes, work.resid_bytes
    g = work.weight_bytes if grad_bytes is None else grad_bytes
    pb = work.weight_bytes if param_bytes is None else param_bytes
    h, layers = cfg.hidden_size, rank_layers(cfg, layout, stage)
    x = b * s * h
    first, last = int(stage == 0), int(stage == p - 1)
    rec = layers if layout.recompute == "full" else 0
    e, k, _ = _moe_key(cfg)
    subs = 1 if e else 2  # sub-layers with tp collectives: attention (and a dense MLP)
    out: list[Collective] = []

    def add(axis, op, numel, elem, count, group, per_mb, overlap):
        """Record a collective unless it is a no-op (group of one or no calls)."""
        if group > 1 and count > 0:
            out.append(Collective(axis, op, int(numel), int(elem), int(count), group, per_mb,
                                  overlap))

    if layout.sp:
        add("tp", "all_gather", x, r, 2 * layers + 2 * rec + first + last, t, True, "none")
        add("tp", "reduce_scatter", x, r, 2 * layers + first + last, t, True, "none")
        add("tp", "reduce_scatter", x, d, 2 * layers + rec, t, True, "none")
        add("tp", "all_gather", x, d, 2 * layers, t, True, "none")
        add("tp", "all_reduce", h, g, 2 * layers + last, t, True, "none")
    else:
        add("tp", "all_reduce", x, r, subs * layers + first + last, t, True, "none")
        add("tp", "all_reduce", x, d, subs * layers + rec, t, True, "none")
    add("tp", "all_reduce", b * s, 4, 3 * last, t, True, "none")
    sh = tp_shard(cfg, t)
    if sh.kv_replicas > 1:
        add("tp", "all_reduce", cfg.num_key_value_heads * cfg.head_dim * h, g, 2 * layers, t,
            True, "none")
    add("tp", "all_reduce", 1, 4, 1, t, False, "step")  # gradient norm

    if p > 1:
        sends = _p2p_sends_per_microbatch(p, v, stage)
        add("pp", "p2p", x // t if layout.sp else x, r, sends, p, True, "none")
        if cfg.tie_word_embeddings and stage in (0, p - 1):
            # the embedding and the last stage's copy of it: their gradients (this rank's
            # ZeRO shard of them) summed between the two ends (runtime axis "pp_ends")
            tied = sh.vocab * h
            if layout.zero_stage:
                tied = -(-tied // layout.shard_size)
            add("pp", "all_reduce", tied, g, 1, 2, False, "step")
        add("pp", "all_reduce", 2, 4, 1, p, False, "step")  # gradient norm over stages

    if layout.cp > 1:
        _cp_attention(add, layout, sh.kv_heads * cfg.head_dim, b * s, d, layers)

    ep = layout.ep if e else 1
    if ep > 1:
        forwards = 2 if layout.recompute == "full" else 1
        rows = b * s * k  # (token, expert) assignments of this rank's tokens
        add("ep", "all_to_all", e, 8, layers * forwards, ep, True, "none")  # counts
        add("ep", "all_to_all", rows * h, r, layers * (forwards + 1), ep, True, "none")
        add("ep", "all_to_all", rows * h, d, layers * (forwards + 1), ep, True, "none")
    experts = stage_expert_units(cfg, layout, stage)

    ns, nr, z = layout.shard_size, layout.dp_replicate, layout.zero_stage
    if z == 0:
        for numel, count in Counter(gradient_buckets(cfg, layout, g, stage)).items():
            add(layout.data_axis, "all_reduce", numel, g, count, ns * nr, False, "last")
        flat = tuple(n for unit in experts for n in unit)
        for numel, count in Counter(_buckets(flat, g, layout.bucket_bytes)).items():
            add("edp", "all_reduce", numel, g, count, layout.edp, False, "last")
        if experts:
            add("ep", "all_reduce", 1, 4, 1, ep, False, "step")  # experts' share of the norm
        return out
    units = list(stage_units(cfg, layout, stage))
    # a tied root unit (``ZeroEngine``'s last) stays gathered from the step's first forward
    # to its end under stage 3: one gather per step instead of two per microbatch
    root = units.pop() if cfg.tie_word_embeddings and p == 1 else None
    ax = layout.shard_axis
    for unit, count in Counter(-(-sum(u) // ns) * ns for u in units).items():
        _zero_unit(add, ax, z, unit, count, ns, nr, g, pb, per_step_gathers=False)
    if root is not None:
        _zero_unit(add, ax, z, -(-sum(root) // ns) * ns, 1, ns, nr, g, pb,
                   per_step_gathers=True)
    ne = layout.edp_shard
    for unit, count in Counter(-(-sum(u) // ne) * ne for u in experts).items():
        _zero_unit(add, "edp_shard", z, unit, count, ne, nr, g, pb, per_step_gathers=False,
                   extra_gathers=int(layout.recompute == "full"))
    add(ax, "all_reduce", 2, 4, 1, ns, False, "step")  # gradient norm
    return out


def _cp_attention(add, layout: Layout, kv_width: int, tokens: int, d: int, layers: int) -> None:
    """The cp collectives of ``layers`` attentions per microbatch (see ``collectives``):
    ``kv_width`` = kv heads per tp rank · head_dim, ``tokens`` = b·s/cp, ``d`` the K/V
    element size. Bytes per call from ``cp_bytes_per_attention``."""
    cp, numel = layout.cp, 2 * tokens * kv_width  # this rank's K and V
    forwards = 1 if layout.recompute == "none" else 2  # recompute repeats the attention
    fwd, bwd = cp_bytes_per_attention(numel * d, cp, layout.cp_algorithm, forwards)
    if layout.cp_algorithm == "ring":  # hops of one K/V block (or its dK/dV) each
        hops_f = fwd // (numel * d)
        kv_b = hops_f // forwards  # backward's K/V hops: as one forward's
        add("cp", "p2p", numel, d, layers * hops_f, cp, True, "attention-forward")
        add("cp", "p2p", numel, d, layers * kv_b, cp, True, "attention-backward")
        add("cp", "p2p", numel, d, layers * (bwd // (numel * d) - kv_b), cp, True, "none")
    else:  # one all-gather of every rank's K/V forward, one reduce-scatter backward
        add("cp", "all_gather", cp * numel, d, layers * forwards, cp, True, "none")
        add("cp", "reduce_scatter", cp * numel, d, layers, cp, True, "none")


def _zero_unit(add, axis: str, z: int, padded: int, count: int, ns: int, nr: int, g: int,
               pb: int, per_step_gathers: bool, extra_gathers: int = 0) -> None:
    """The collectives of ``count`` ZeRO units of ``padded`` elements over ``axis`` (see
    ``collectives``); ``extra_gathers`` more stage-3 gathers per microbatch (an expert unit's
    in a recomputed forward)."""
    if z in (1, 2):
        add(axis, "reduce_scatter", padded, g, count, ns, False,
            "step" if z == 1 else "last")
        add(axis, "all_gather", padded, pb, count, ns, False, "step")
    elif per_step_gathers:
        add(axis, "reduce_scatter", padded, g, count, ns, True, "backward")
        add(axis, "all_gather", padded, pb, count, ns, False, "step")
    else:
        add(axis, "reduce_scatter", padded, g, count, ns, True, "backward")
        add(axis, "all_gather", padded, pb, count, ns, True, "forward")
        add(axis, "all_gather", padded, pb, count * (1 + extra_gathers), ns, True, "backward")
    add("dp_replicate", "all_reduce", padded // ns, g, count, nr, False, "step")


def _p2p_sends_per_microbatch(p: int, v: int, rank: int) -> int:
    """Point-to-point sends per microbatch on ``rank``: forward out of every chunk but the
    model's last, backward out of every chunk but the model's first."""
    chunks = [c * p + rank for c in range(v)]
    return sum(s < p * v - 1 for s in chunks) + sum(s > 0 for s in chunks)


def cp_bytes_per_attention(kv_bytes: int, cp: int, algorithm: str,
                           forwards: int = 1) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends on "cp" for one attention call, ``kv_bytes``
    being its local K and V together; ``forwards`` 2 under activation checkpointing (the
    forward runs again in backward, with its communication)."""
    if cp == 1:
        return 0, 0
    if algorithm == "ring":
        return forwards * (cp - 1) * kv_bytes, (cp - 1) * kv_bytes + cp * kv_bytes
    if algorithm == "allgather":
        return forwards * (cp - 1) * kv_bytes, (cp - 1) * kv_bytes
    raise ValueError(f"unknown cp algorithm {algorithm!r}; use ring or allgather")


def comm_bytes_per_step(cfg: ModelConfig, layout: Layout, work: Workload,
                        stage: int | None = None, grad_bytes: int | None = None,
                        param_bytes: int | None = None) -> dict[str, int]:
    """Bytes global rank 0 (of pipeline stage ``stage``; when None, the largest over stages
    per axis) sends per step on each axis (keys ``COMM_AXES``): with ``Workload.from_config``
    exactly what threefold's runtime reports as ``comm_bytes_per_step`` in summary.json
    (tests/test_dryrun.py checks it for DP, ZeRO 1/2/3 and TP). Gradients and gathered
    parameters move in ``work.weight_bytes`` unless ``grad_bytes``/``param_bytes`` say
    otherwise. See ``collectives`` for what each axis carries."""
    stages = _distinct_stages(cfg, layout) if stage is None else [stage]
    lists = [collectives(cfg, layout, work, st, grad_bytes, param_bytes) for st in stages]
    return _bytes_per_axis(lists, microbatches(layout, work))


def _bytes_per_axis(lists: list[list[Collective]], m: int) -> dict[str, int]:
    """Per axis, the largest over the given stages' collective lists of bytes sent per step."""
    out = {axis: 0 for axis in COMM_AXES}
    for colls in lists:
        per = {axis: 0 for axis in COMM_AXES}
        for c in colls:
            per[c.axis] += c.bytes_sent() * c.count * (m if c.per_microbatch else 1)
        for axis in COMM_AXES:
            out[axis] = max(out[axis], per[axis])
    return out


# --------------------------------------------------------------------------------------------
# Topology: which link each mesh axis crosses
# --------------------------------------------------------------------------------------------
def axis_stride(layout: Layout, axis: str) -> int:
    """Rank distance between neighbours of ``axis``: product of the inner axes' degrees (for a
    flattened axis, whose parts are adjacent in the mesh, that of its innermost part). The
    expert axes (threefold.mesh): "ep" is the innermost ep of dp_shard (dp_shard's stride),
    "edp_shard" the rest of dp_shard (ep times that), "edp" edp_shard then dp_replicate."""
    if axis in EXPERT_AXES:
        inner = axis_stride(layout, "dp_shard")
        return inner if axis == "ep" else inner * layout.ep
    if axis in FLATTENED_AXES:
        axis = FLATTENED_AXES[axis][-1]
    i = MESH_ORDER.index(axis)
    return math.prod(layout.size(a) for a in MESH_ORDER[i + 1:])


def axis_crosses_nodes(layout: Layout, axis: str, gpus_per_node: int) -> bool:
    """True when a group of ``axis`` is not contained in one node (it then runs at the
    network's bandwidth): its ranks span stride·size consecutive ranks, which must fit in and
    tile a node."""
    span = axis_stride(layout, axis) * layout.size(axis)
    return layout.size(axis) > 1 and (span > gpus_per_node or gpus_per_node % span != 0)


# --------------------------------------------------------------------------------------------
# Pipeline bubble
# --------------------------------------------------------------------------------------------
SIMULATE_MAX_ACTIONS = 4096  # p·m·v above this uses the closed form (the replay is Python)


def bubble_over_ideal(schedule: str, p: int, m: int, v: int = 1,
                      backward_over_forward: float = 2.0,
                      simulate: bool = False) -> tuple[float, str]:
    """(bubble time / ideal time, source) with equal stages.

    Closed forms: GPipe and 1F1B (p-1)/m, interleaved 1F1B (p-1)/(v·m) (Narayanan et al. 2021
    §2.2); the schedule simulator (threefold.parallel.pipeline.simulate) replays the same
    action lists the executor runs and gives exactly these values (tests/test_cost.py checks
    it), so they are used directly — the replay is far too slow for a search of thousands.
    ZB-H1's bubble depends on how backward splits into B and W, so it is simulated (B = W =
    half of backward) when the simulator is importable and the run small, else (p-1)/(3m)
    (Qi et al., arXiv 2401.10241, T_F = T_B = T_W). ``simulate`` forces the replay for any
    schedule (a single layout, e.g. a dry run)."""
    if p == 1:
        return 0.0, "none"
    if (simulate or schedule == "zb-h1") and p * m * v <= SIMULATE_MAX_ACTIONS:
        sim = _simulated(schedule, p, m, v, round(backward_over_forward, 2))
        if sim is not None:
            return sim, "simulated"
    div = {"interleaved-1f1b": v, "zb-h1": 3}.get(schedule, 1)
    return (p - 1) / (div * m), "closed-form"


@lru_cache(maxsize=4096)
def _simulated(schedule: str, p: int, m: int, v: int, ratio: float) -> float | None:
    try:
        from threefold.parallel.pipeline.simulate import Costs, simulate
    except ImportError:
        return None
    # zb-h1 splits backward into B and W; the fused schedules run B+W as one action.
    costs = Costs(1.0, ratio / 2, ratio / 2, 0.0)
    try:
        return simulate(schedule, p, m, v, costs).bubble_over_ideal
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


def predict_step(cfg: ModelConfig, layout: Layout, work: Workload, cluster,
                 efficiency: float | None = None, bucket_bytes: float | None = None,
                 simulate: bool = False, overlap_grad_reduce: bool = True) -> StepPrediction:
    """Predicted step of ``layout`` on ``cluster`` (a ``threefold.hardware.Cluster``).

    Time model, per pipeline stage and microbatch: compute = FLOPs / (peak · efficiency) +
    memory-bound bytes / HBM bandwidth (``stage_memory_traffic_per_microbatch``); tp
    collectives and pipeline sends are *not* overlapped (they sit between dependent matmuls);
    ZeRO-3 gathers and reduce-scatters overlap the forward/backward of their microbatch, except
    one bucket each; the data-parallel all-reduce and the ZeRO-2 reduce-scatter overlap the
    last microbatch's backward except one bucket; the ZeRO-1 reduce-scatter, the HSDP
    all-reduce over dp_replicate and the ZeRO-1/2 parameter all-gathers after the step are
    exposed (with ``overlap_grad_reduce=False`` no data-parallel communication overlaps
    anything, as in Megatron-LM of 2021). Context parallelism's cp traffic runs on the link
    the cp axis crosses: each ring hop of K/V hides behind the attention of one block (the
    rank's queries against one rank's keys: 1/cp of the layer's attention FLOPs), the dK/dV
    hops and the allgather algorithm's all-gather and reduce-scatter are exposed. Expert
    parallelism's all-to-alls (their uniform-routing expectation) run on the link the ep axis
    crosses and are exposed: each MoE layer waits for its tokens. The pipeline then takes m·T_slowest plus the bubble,
    (bubble/ideal ratio of the schedule)·m·T_mean. The optimiser step adds its memory traffic
    (``ADAMW_ACCESSES_PER_PARAM`` fp32 accesses per parameter the rank updates: Ψ, or Ψ/N
    under ZeRO) over the HBM bandwidth, when that is known. With ``layout.offload_optimizer``
    that traffic is over the host's memory bandwidth instead (``offload_step_seconds``), and
    the gradients going down and the parameters coming up over PCIe add ``offload_s``."""
    hw = cluster.hardware
    bucket_bytes = layout.bucket_bytes if bucket_bytes is None else bucket_bytes
    peak = hw.peak_flops(work.precision)
    if not peak:
        raise ValueError(f"{hw.name}: peak {work.precision} FLOP/s unknown; give --peak-tflops")
    eff = efficiency if efficiency is not None else (hw.matmul_efficiency or MATMUL_EFFICIENCY)
    rate = peak * eff
    m = microbatches(layout, work)
    inter = {a: axis_crosses_nodes(layout, a, cluster.gpus_per_node) for a in COMM_AXES}
    links = {a: hw.link(inter[a]) for a in COMM_AXES}
    stages = _distinct_stages(cfg, layout)
    hbm = hw.memory_bw or math.inf
    per_mb, per_step, parts, lists, hw_flops = {}, {}, {}, [], 0.0
    for st in stages:
        f, bwd = stage_flops_per_microbatch(cfg, layout, work, st)
        mem_f, mem_b = stage_memory_traffic_per_microbatch(cfg, layout, work, st)
        hw_flops += (f + bwd) * _stage_multiplicity(cfg, layout, st)
        t_f, t_b = f / rate + mem_f / hbm, bwd / rate + mem_b / hbm
        colls = collectives(cfg, layout, work, st)
        lists.append(colls)
        windows = (t_f, t_b) if overlap_grad_reduce else (0.0, 0.0)
        exposed, step_dp = _exposed_comm(colls, links, *windows, bucket_bytes,
                                         _attention_block_seconds(cfg, layout, work, rate))
        per_mb[st] = t_f + t_b + sum(exposed.values())
        per_step[st] = step_dp
        parts[st] = (t_f + t_b, exposed, t_b / t_f)
    slow = max(per_mb, key=per_mb.get)
    mean = sum(per_mb[s] * _stage_multiplicity(cfg, layout, s) for s in stages) / layout.pp
    ratio, source = bubble_over_ideal(layout.pipeline_schedule, layout.pp, m, layout.vpp,
                                      parts[stages[len(stages) // 2]][2], simulate)
    ideal = m * per_mb[slow]
    bubble = ratio * m * mean
    if simulate and layout.pp > 1 and layout.vpp == 1:  # one layout: replay its own stages
        span = _replayed_makespan(cfg, layout, m, per_mb,
                                  {st: 1 / (1 + parts[st][2]) for st in stages})
        if span is not None:
            bubble, source = max(0.0, span - ideal), "simulated (per-stage times)"
    dp_step = max(per_step.values())
    opt_s, off_s = optimizer_seconds(cfg, layout, hbm), 0.0
    if layout.offload_optimizer:
        opt_s, off_s = offload_step_seconds(cfg, layout, work, cluster)
    step = ideal + bubble + dp_step + opt_s + off_s
    comp, exp, _ = parts[slow]
    n = layout.world
    mf = model_flops_per_step(cfg, work)
    hf = hw_flops * m * layout.tp * layout.dp * layout.cp
    return StepPrediction(
        step_time_s=step, compute_s=m * comp, tp_exposed_s=m * exp["tp"],
        pp_exposed_s=m * exp["pp"], dp_exposed_s=m * exp["dp"] + dp_step, bubble_s=bubble,
        bubble_fraction=bubble / (ideal + bubble), bubble_source=source, model_flops=mf,
        hardware_flops=hf, tokens_per_second_per_gpu=work.tokens / step / n,
        tflops_per_gpu=hf / step / n / 1e12, mfu=mf / (step * n * peak),
        hfu=hf / (step * n * peak), comm_bytes=_bytes_per_axis(lists, m), optimizer_s=opt_s,
        offload_s=off_s,
        inter_node_axes=tuple(a for a in COMM_AXES if inter[a]), cp_exposed_s=m * exp["cp"],
        ep_exposed_s=m * exp["ep"])


def _replayed_makespan(cfg: ModelConfig, layout: Layout, m: int, per_mb: dict,
                       forward_share: dict) -> float | None:
    """The pipeline's compute span for ``m`` microbatches replayed by the schedule simulator
    with every stage's own time per microbatch (``per_mb``, split into forward and backward
    by ``forward_share``; ZB-H1's B and W halves of the backward): with uneven stages (the
    head on the last, an uneven split) the bubble is not the equal-stage formula's. None when
    the replay is too large or the simulator is unavailable."""
    p = layout.pp
    if p * m > SIMULATE_MAX_ACTIONS:
        return None
    try:
        from threefold.parallel.pipeline.simulate import Costs
        from threefold.parallel.pipeline.simulate import simulate as replay_schedule
    except ImportError:
        return None
    per: dict = {}
    reps = _stage_representatives(_shape_key(cfg), p, 1, layout.pipeline_split)
    for st, rep in enumerate(reps):  # a stage has its representative's times
        f = per_mb[rep] * forward_share[rep]
        b = per_mb[rep] - f
        per.update({("F", st): f, ("BW", st): b, ("B", st): b / 2, ("W", st): b / 2})
    try:
        return replay_schedule(layout.pipeline_schedule, p, m, 1, Costs(per_stage=per)).makespan
    except Exception:  # a schedule the simulator refuses (or a bug there): the closed form
        return None


def optimizer_seconds(cfg: ModelConfig, layout: Layout, memory_bw: float) -> float:
    """Time of the optimiser step on the busiest stage: its memory traffic over ``memory_bw``
    (0 when the bandwidth is unknown, i.e. infinite)."""
    owned = max(owned_parameters(cfg, layout, st) for st in _distinct_stages(cfg, layout))
    return ADAMW_ACCESSES_PER_PARAM * 4 * owned / memory_bw


def offload_bytes_per_step(cfg: ModelConfig, layout: Layout, work: Workload) -> dict[str, int]:
    """Bytes one rank of the busiest stage moves between device and host per step under
    optimiser offload (threefold.parallel.offload): its owned parameters' gradients down and
    their updated values up, each ``work.weight_bytes`` per element (fp32 in threefold's
    runtime: 4 + 4 bytes per owned parameter; 2 + 2 with 16-bit weights, ZeRO-Offload's
    2Ψ + 2Ψ, Ren et al. arXiv 2101.06840). Owned = Ψ of the stage, Ψ/N under ZeRO (padded
    shards). {"down": 0, "up": 0} without offload."""
    if not layout.offload_optimizer:
        return {"down": 0, "up": 0}
    owned = max(owned_parameters(cfg, layout, st) for st in _distinct_stages(cfg, layout))
    return {"down": owned * work.weight_bytes, "up": owned * work.weight_bytes}


def offload_step_seconds(cfg: ModelConfig, layout: Layout, work: Workload,
                         cluster) -> tuple[float, float]:
    """(host AdamW seconds, PCIe seconds) of one step under optimiser offload: the step's
    ``ADAMW_ACCESSES_PER_PARAM`` fp32 accesses per owned parameter over this rank's share of
    the host memory bandwidth (``Hardware.host_memory_bw`` / GPUs per node; a measured machine,
    whose host is its device, uses ``memory_bw``), and ``offload_bytes_per_step`` over the
    device-host link per direction (``Hardware.host_link_bw``; gradients down, then after the
    step parameters up: the runtime does not overlap them). Unknown bandwidths count 0."""
    hw = cluster.hardware
    owned = max(owned_parameters(cfg, layout, st) for st in _distinct_stages(cfg, layout))
    host_bw = (hw.host_memory_bw / cluster.gpus_per_node if hw.host_memory_bw
               else hw.memory_bw) or math.inf
    link = hw.host_link_bw or hw.memory_bw or math.inf
    moved = sum(offload_bytes_per_step(cfg, layout, work).values())
    return ADAMW_ACCESSES_PER_PARAM * 4 * owned / host_bw, moved / link


def compute_bound_step_time(cfg: ModelConfig, layout: Layout, work: Workload, cluster,
                            efficiency: float | None = None) -> float:
    """``predict_step``'s step time with every collective free: a lower bound on it, cheap
    enough to order and prune a search."""
    hw = cluster.hardware
    rate = hw.peak_flops(work.precision) * (efficiency if efficiency is not None else
                                            (hw.matmul_efficiency or MATMUL_EFFICIENCY))
    m = microbatches(layout, work)
    stages = _distinct_stages(cfg, layout)
    bw = hw.memory_bw or math.inf
    times = {st: sum(stage_flops_per_microbatch(cfg, layout, work, st)) / rate
             + sum(stage_memory_traffic_per_microbatch(cfg, layout, work, st)) / bw
             for st in stages}
    mean = sum(times[s] * _stage_multiplicity(cfg, layout, s) for s in stages) / layout.pp
    ratio, _ = bubble_over_ideal(layout.pipeline_schedule, layout.pp, m, layout.vpp)
    return m * max(times.values()) + ratio * m * mean


def _attention_block_seconds(cfg: ModelConfig, layout: Layout, work: Workload,
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


def _exposed_comm(colls: list[Collective], links: dict, t_f: float, t_b: float,
                  bucket_bytes: float, attention_block: tuple[float, float] = (0.0, 0.0)
                  ) -> tuple[dict[str, float], float]:
    """({tp, pp, cp, ep, dp}: exposed seconds per microbatch, exposed dp seconds once per step)
    for one stage, applying the overlap rules of ``predict_step``; ``attention_block`` is
    the (forward, backward) time a ring hop may hide behind."""
    exposed = {"tp": 0.0, "pp": 0.0, "cp": 0.0, "ep": 0.0, "dp": 0.0}
    step_dp = 0.0
    groups: dict[tuple[str, str], float] = {}
    tails: dict[tuple[str, str], float] = {}
    for c in colls:
        if c.overlap == "hidden":
            continue
        lat, bw = links[c.axis]
        one = c.time(lat, bw)
        kind = c.axis if c.axis in ("tp", "pp", "cp", "ep") else "dp"
        if c.overlap.startswith("attention-"):  # each hop behind one block's attention
            window = attention_block[0 if c.overlap == "attention-forward" else 1]
            exposed[kind] += c.count * max(0.0, one - window)
        elif c.overlap == "none":
            exposed[kind] += one * c.count
        elif c.overlap == "step":
            step_dp += one * c.count
        else:
            key = (kind, c.overlap)
            groups[key] = groups.get(key, 0.0) + one * c.count
            tails[key] = max(tails.get(key, 0.0), c.time(lat, bw, min(c.size, bucket_bytes)))
    for (kind, overlap), total in groups.items():
        window = t_f if overlap == "forward" else t_b
        left = max(tails[(kind, overlap)], total - window)
        if overlap == "last":
            step_dp += left
        else:
            exposed[kind] += left
    return exposed, step_dp
