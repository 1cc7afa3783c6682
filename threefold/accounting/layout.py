"""``Layout`` (the degrees of every parallel axis, the ZeRO stage, the schedule) and ``Workload``
(the batch, the sequence, the numerics), and the checks that a layout divides the world, the
model and the batch (``check_layout``), as the runtime requires.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from threefold.accounting.shapes import (
    CP_ALGORITHMS,
    DEFAULT_BUCKET_MB,
    DTYPE_BYTES,
    RECOMPUTE,
    SCHEDULES,
    LayoutError,
    tp_shard,
)
from threefold.axes import FLATTENED, resolve_dp_shard
from threefold.config import Config, ModelConfig, fp8_all_gather, param_dtype
from threefold.config.validation import lora_targets
from threefold.schedules.schedules import SCHEDULE_SPECS

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
    pipeline_inflight: int = 0  # interleaved 1F1B's bound on chunk activations; 0 = Megatron's
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
    # chunks wanted per sequence-parallel collective (``parallel.tp_overlap``; < 2 = off)
    tp_overlap: int = 0

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

    @cached_property  # read a million times in a search (a frozen dataclass: computed once)
    def pipeline_schedule(self) -> str:
        """The schedule name, with the default filled in."""
        return self.schedule or ("interleaved-1f1b" if self.vpp > 1 else "1f1b")

    @cached_property
    def vshape(self) -> bool:
        """A V-shaped pipeline (ZB-V, DualPipeV): rank r holds stages r and 2p-1-r, so rank 0
        holds the embedding and the head (a tied head as a copy, summed in place)."""
        spec = SCHEDULE_SPECS.get(self.pipeline_schedule)
        return self.pp > 1 and spec is not None and spec.vshape

    @property
    def last_stage(self) -> int:
        """The pipeline rank that holds the final norm, the head and the loss."""
        return 0 if self.vshape else self.pp - 1

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
        if axis in FLATTENED:
            return math.prod(getattr(self, a) for a in FLATTENED[axis])
        return getattr(self, axis)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "Layout":
        """The layout a training config describes on ``world_size`` ranks (dp_shard -1 = the
        rest, resolved as the runtime resolves it: ``threefold.axes.resolve_dp_shard``).
        A micro-batch larger than a rank's share of the batch is that share, as in the loop."""
        p = cfg.parallel
        dp_shard = resolve_dp_shard(p, world_size) if p.dp_shard == -1 else p.dp_shard
        local = max(1, cfg.train.global_batch_size // (p.dp_replicate * dp_shard))
        return cls(tp=p.tp, pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard,
                   zero_stage=p.zero_stage, vpp=p.vpp, pipeline_inflight=p.pipeline_inflight,
                   microbatch_size=min(cfg.train.micro_batch_size, local),
                   recompute=cfg.train.recompute_mode,
                   schedule=p.schedule, sequence_parallel=p.sequence_parallel,
                   bucket_mb=p.bucket_mb, cp=p.cp, cp_algorithm=p.cp_algorithm,
                   offload_optimizer=p.offload_optimizer, ep=p.ep, tp_overlap=p.tp_overlap,
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
    changes the memory traffic ``stage_memory_traffic_per_microbatch`` counts. ``block`` says
    whose transformer block keeps the activations: "threefold" (threefold's own block, as
    autograd saves its tensors: ``plan.activations.block_activation_bytes``) or "megatron" (a
    fused block as Megatron-Core runs it, Korthikanti et al.'s count adapted to a Llama block:
    ``plan.activations.layer_activation_bytes``), for planning or checking published runs."""

    seq_len: int
    global_batch: int
    precision: str = "bf16"
    flash_attention: bool = True
    residual_bytes: int = 0
    master_bytes: int = 0
    eager: bool = False  # one kernel per elementwise op (threefold without compile), not fused
    block: str = "threefold"  # whose block keeps the activations: "threefold" or "megatron"
    reduce_bytes: int = 0  # element size ZeRO reduce-scatters gradients in (0 = weight_bytes)
    # gloo on a CPU: all-gathers and reduce-scatters copy through a temporary as large as the
    # whole unit, and the host's memory is the device's (offload's buffers count there)
    backend_copies: bool = False
    # packed documents (data.document_mask): attention under a mask, which keeps more
    document_mask: bool = False
    # LoRA (``lora.r``, threefold.accounting.lora): only adapters of rank lora_r on the named
    # linear layers train; the base is frozen
    lora_r: int = 0
    lora_targets: tuple[str, ...] = ()
    # the weights start from files (checkpoint.init_from): start-up reads each rank's regions
    # instead of drawing whole tensors (plan.startup)
    init_from: bool = False
    # train.fp8: the blocks' linear layers multiply in FP8 (none, tensorwise, rowwise); the
    # planner times their FLOPs at the FP8 peak (plan.compute.matmul_peak)
    fp8: str = "none"
    # parallel.fp8_all_gather resolved: ZeRO-3 gathers the FP8 weights in e4m3 (1 byte each)
    fp8_gather: bool = False

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

    @property
    def grad_reduce_bytes(self) -> int:
        """Bytes of one gradient element as ZeRO reduce-scatters it."""
        return self.reduce_bytes or self.weight_bytes

    @classmethod
    def from_config(cls, cfg: Config) -> "Workload":
        """The workload of a threefold training config, with the runtime's numerics: fp32
        weights, gradients and residual stream (bf16 ones with ``parallel.param_dtype``
        bfloat16, the default under ZeRO-3 with bf16 compute: the embedding then outputs
        bf16); matmuls in ``train.dtype`` (autocast); ZeRO's gradients reduced in
        ``parallel.reduce_dtype``; attention through ``scaled_dot_product_attention`` (a
        flash kernel: probabilities not stored); elementwise work eager unless
        ``train.compile``."""
        precision = "bf16" if cfg.train.dtype == "bfloat16" else "fp32"
        weights = 2 if param_dtype(cfg) == "bfloat16" else 4
        reduce = 2 if cfg.parallel.reduce_dtype == "bfloat16" else 4
        return cls(seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch_size,
                   precision=precision, flash_attention=True, residual_bytes=weights,
                   master_bytes=weights, eager=not cfg.train.compile,
                   reduce_bytes=reduce if cfg.parallel.zero_stage else 0,
                   document_mask=cfg.data.document_mask, lora_r=cfg.lora.r,
                   lora_targets=lora_targets(cfg.lora) if cfg.lora.r else (),
                   init_from=bool(cfg.checkpoint.init_from), fp8=cfg.train.fp8,
                   fp8_gather=fp8_all_gather(cfg))


def _check_lora(cfg: ModelConfig, layout: Layout, work: Workload) -> None:
    """What LoRA runs with (as ``config.validation`` refuses before launch; expert
    parallelism needs a mixture of experts, so it is refused with it)."""
    if cfg.num_local_experts:
        raise LayoutError("LoRA does not adapt a mixture of experts")
    if {"k_proj", "v_proj"} & set(work.lora_targets) \
            and tp_shard(cfg, layout.tp).kv_replicas > 1:
        raise LayoutError(f"LoRA on k_proj/v_proj needs tp ({layout.tp}) to divide the "
                          f"{cfg.num_key_value_heads} KV heads")


def check_layout(cfg: ModelConfig, layout: Layout, work: Workload) -> None:
    """Raise LayoutError naming the first rule ``layout`` breaks for this model and batch."""
    if layout.recompute not in RECOMPUTE:
        raise LayoutError(f"recompute '{layout.recompute}' is not one of {RECOMPUTE}")
    if layout.recompute == "selective" and work.block != "megatron" \
            and (layout.cp > 1 or cfg.num_local_experts):
        raise LayoutError("selective recompute is not available with cp > 1 or a mixture of "
                          "experts (threefold.parallel.recompute); use full or none")
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
    check_attention(cfg, layout)
    if work.lora_r:
        _check_lora(cfg, layout, work)
    chunks = layout.pp * layout.vpp
    if cfg.num_hidden_layers < chunks:  # uneven splits are fine: see pipeline_layers
        raise LayoutError(f"pp·vpp={chunks} is more than the {cfg.num_hidden_layers} layers "
                          "(each pipeline chunk needs one)")
    spec = SCHEDULE_SPECS[layout.pipeline_schedule]
    if layout.vpp > 1 and not (spec.chunked or spec.vshape):
        chunked = " or ".join(name for name, sp in SCHEDULE_SPECS.items()
                              if sp.chunked or sp.vshape)
        raise LayoutError(f"vpp > 1 needs the {chunked} schedule")
    m = microbatches(layout, work)
    if layout.pp == 1:
        return  # no pipeline: the schedule is not used (as the runtime ignores it)
    if spec.vshape and layout.vpp != 2:
        raise LayoutError(f"{spec.name} runs two model chunks per rank in a V: vpp must be 2")
    if spec.chunked and m % layout.pp:
        raise LayoutError(f"interleaved 1F1B needs microbatches ({m}) a multiple of pp "
                          f"({layout.pp})")
    if layout.pipeline_inflight and not spec.chunked:
        raise LayoutError(f"pipeline_inflight bounds interleaved-1f1b only, not {spec.name}")
    if spec.chunked and 0 < layout.pipeline_inflight < (layout.vpp - 1) * layout.pp + 1:
        raise LayoutError(f"pipeline_inflight={layout.pipeline_inflight} is below (vpp-1)·pp + "
                          f"1 = {(layout.vpp - 1) * layout.pp + 1}: the first backward could "
                          "never start")


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


def check_attention(cfg: ModelConfig, layout: Layout) -> None:
    """LayoutError for context parallelism with attention its ring does not compute: a
    sliding window (``model.sliding_window``) or another score scale
    (``model.query_pre_attn_scalar``); and for OLMo 2's projection-wide k norm over KV
    heads tp replicates (the runtime refuses it: ``threefold.mesh``)."""
    if cfg.qk_norm and cfg.qk_norm_over == "projection" \
            and tp_shard(cfg, layout.tp).kv_replicas > 1:
        raise LayoutError(f"model.qk_norm_over: a k norm over the whole projection needs the "
                          f"{cfg.num_key_value_heads} KV heads split over tp={layout.tp}, not "
                          "replicated")
    for field in ("sliding_window", "query_pre_attn_scalar", "kv_lora_rank"):
        if layout.cp > 1 and getattr(cfg, field):
            raise LayoutError(f"model.{field}: {getattr(cfg, field)}: context parallelism "
                              f"(parallel.cp={layout.cp}) does not compute this attention "
                              "yet; set parallel.cp 1")


def overlap_chunks(local_tokens: int, wanted: int) -> int:
    """The chunks overlapped tensor parallelism (``parallel.tp_overlap``) cuts each collective
    into: the largest divisor of ``local_tokens`` (a rank's tokens of one sequence under
    sequence parallelism) not above ``wanted``; 1 = no overlap. Shapes decide it, the same on
    every rank."""
    top = max(1, min(wanted, local_tokens))
    return max(d for d in range(1, top + 1) if local_tokens % d == 0)


def tp_chunks(layout: Layout, work: Workload) -> int:
    """The chunks per sequence-parallel collective the runtime uses for ``layout`` and
    ``work`` (``overlap_chunks`` of a rank's seq_len / cp / tp tokens); 1 = not overlapped."""
    if not layout.sp or layout.tp_overlap < 2:
        return 1
    return overlap_chunks(local_seq_len(layout, work) // layout.tp, layout.tp_overlap)


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
