"""The one description of a run's layout: ``Layout`` (the degree of every parallel axis, the
ZeRO stage, the pipeline's chunks and schedule, recompute, sequence parallelism, the cp
algorithm) and ``Workload`` (the batch, the sequence, the numerics).

The runtime (``threefold.parallel.distributed_world``: its mesh, ``threefold.comm.mesh.build_mesh``,
and its communication layer read one), the launcher and the dry run (``Layout.from_config``,
checked by ``threefold.layout.checks.validate_layout``) and the planner (which builds millions
of them) all read this class; the rules a layout must meet are ``threefold.layout.rules``'s.
The rank arithmetic on it (coordinates, groups of every axis) is ``threefold.layout.ranks``'s.
Imports no torch.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import cached_property

from threefold.config import Config, ParallelConfig, fp8_all_gather, param_dtype
from threefold.config.validation import lora_targets
from threefold.layout.ranks import Ranks
from threefold.layout.rules import fills_world
from threefold.schedules.registry import SCHEDULE_SPECS

DEFAULT_BUCKET_MB = 25.0  # = ParallelConfig.bucket_mb: data-parallel gradient buckets, MiB
DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def node_ranks(p: ParallelConfig, world_size: int) -> int:
    """Ranks per node for the hierarchical ep dispatch: ``parallel.gpus_per_node``, else
    torchrun's LOCAL_WORLD_SIZE (the launcher's --nproc-per-node, the same on every rank),
    else the world (one node). Read only under that dispatch (else the field as given), so
    a flat layout does not depend on the environment."""
    if p.gpus_per_node or p.ep_dispatch != "hierarchical":
        return p.gpus_per_node
    return min(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), world_size)


@dataclass(frozen=True)
class Layout(Ranks):
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
    # selective recompute's named modules (``train.recompute_modules``, sorted); () = default
    recompute_modules: tuple = ()
    schedule: str = ""
    sequence_parallel: bool = True
    bucket_mb: float = DEFAULT_BUCKET_MB
    pipeline_split: str = "params"
    cp: int = 1
    cp_algorithm: str = "ring"
    # hybrid context parallelism (``parallel.cp_ulysses``): the innermost cp_ulysses of the cp
    # ranks run Ulysses' all-to-all, the rest ``cp_algorithm``
    cp_ulysses: int = 1
    # AdamW's state and the fp32 master in host memory, the step run there
    # (``parallel.offload_optimizer``, threefold.parallel.engines.offload)
    offload_optimizer: bool = False
    # expert parallelism (``parallel.ep``, a mixture of experts only): each MoE layer's experts
    # split over ep ranks, the innermost ep of dp_shard
    ep: int = 1
    # how tokens reach their experts (``parallel.ep_dispatch``): "flat" or "hierarchical"
    # (threefold.parallel.transforms.expert_dispatch), the latter over nodes of
    # ``gpus_per_node`` consecutive ranks
    ep_dispatch: str = "flat"
    gpus_per_node: int = 0
    # chunks wanted per sequence-parallel collective (``parallel.tp_overlap``; < 2 = off)
    tp_overlap: int = 0

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas times shards (the ranks that see different data;
        context-parallel ranks see the same sequences)."""
        return self.dp_replicate * self.dp_shard

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
    def ulysses(self) -> int:
        """The all-to-all (Ulysses) part of cp: all of it under cp_algorithm ulysses, else
        ``cp_ulysses`` (1: none)."""
        return self.cp if self.cp_algorithm == "ulysses" else self.cp_ulysses

    @property
    def cp_ring(self) -> int:
        """The ring (or all-gather) part of cp: cp / ulysses ranks (1: none)."""
        return self.cp // self.ulysses

    @property
    def cp_axes(self) -> tuple[str | None, str | None]:
        """(the axis Ulysses' all-to-alls run on, the axis the ring or all-gather runs on),
        None where that part is absent: "cp" for a pure algorithm, "cp_inner" and "cp_outer"
        for a hybrid."""
        u, r = self.ulysses, self.cp_ring
        if u > 1 and r > 1:
            return "cp_inner", "cp_outer"
        return ("cp" if u > 1 else None), ("cp" if r > 1 else None)

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
        """Gradient bucket size in bytes, as ``threefold.parallel.engines.data_parallel`` computes it."""
        return int(self.bucket_mb * 2**20)

    @property
    def edp_shard(self) -> int:
        """Ranks of dp_shard × cp holding the same experts: dp_shard / ep · cp (ZeRO shards
        the expert units over them; cp ranks route other tokens of the same sequences)."""
        return self.dp_shard // self.ep * self.cp

    @property
    def edp(self) -> int:
        """Data-parallel and context-parallel ranks holding the same experts: dp / ep · cp
        (plain data parallelism all-reduces the expert gradients over them)."""
        return self.dp // self.ep * self.cp

    @property
    def ep_intra(self) -> int:
        """ep ranks of one node under the hierarchical dispatch: ep ranks are cp·tp apart
        (the innermost part of dp_shard), so a node of gpus_per_node ranks holds
        gpus_per_node/(cp·tp) of them, or all ep when that is more; ep (one level) under the
        flat dispatch. ``rules.ep_nodes_tile`` refuses a node size that does not tile ep."""
        if self.ep_dispatch != "hierarchical" or self.gpus_per_node < 1:
            return self.ep
        return max(1, min(self.ep, self.gpus_per_node // (self.cp * self.tp)))

    @property
    def ep_inter(self) -> int:
        """Nodes one ep group spans under the hierarchical dispatch (1 under flat)."""
        return self.ep // self.ep_intra

    @classmethod
    def from_parallel(cls, p: ParallelConfig, world_size: int) -> "Layout":
        """The degrees the ``parallel`` section describes on ``world_size`` ranks, dp_shard = -1
        resolved to the rest of the world (LayoutError when they do not fill it:
        ``rules.fills_world``)."""
        return cls(tp=p.tp, pp=p.pp, dp_replicate=p.dp_replicate,
                   dp_shard=fills_world(p, world_size), cp=p.cp, ep=p.ep,
                   ep_dispatch=p.ep_dispatch, gpus_per_node=node_ranks(p, world_size),
                   zero_stage=p.zero_stage, vpp=p.vpp, pipeline_inflight=p.pipeline_inflight,
                   schedule=p.schedule, sequence_parallel=p.sequence_parallel,
                   bucket_mb=p.bucket_mb, cp_algorithm=p.cp_algorithm,
                   cp_ulysses=p.cp_ulysses,
                   offload_optimizer=p.offload_optimizer, tp_overlap=p.tp_overlap,
                   pipeline_split=p.pipeline_split)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "Layout":
        """The layout a training config describes on ``world_size`` ranks (``from_parallel``),
        with the loop's micro-batch (one larger than a rank's share of the batch is that
        share) and recompute mode."""
        lay = cls.from_parallel(cfg.parallel, world_size)
        local = max(1, cfg.train.global_batch_size // lay.dp)
        split = cfg.parallel.pipeline_split
        return dataclasses.replace(
            lay, microbatch_size=min(cfg.train.micro_batch_size, local),
            recompute=cfg.train.recompute_mode,
            recompute_modules=cfg.train.recompute_module_names,
            pipeline_split=f"flops:{cfg.data.seq_len}" if split == "flops" else split)

    @property
    def recompute_label(self) -> str:
        """The recompute mode as reports print it and ``threefold plan --recompute`` takes it:
        selective with its modules, if named (``recompute_of_label`` reads it back)."""
        if self.recompute_modules:
            return f"{self.recompute}:{'+'.join(self.recompute_modules)}"
        return self.recompute

    def notes(self) -> list[str]:
        """What this layout does that its user may not expect (not refusals)."""
        if self.zero_stage > 0 and self.shard_size == 1:
            # ZeRO over a one-rank shard group is legal and changes nothing: say so
            return [f"parallel.zero_stage={self.zero_stage} with dp_shard=1 shards over one "
                    "rank: no memory saving (raise parallel.dp_shard to shard)"]
        if self.zero_stage > 0 and self.cp > 1:
            return [f"ZeRO-{self.zero_stage} shards over dp_shard·cp = {self.shard_size} ranks "
                    "(axis dp_shard_cp): context-parallel ranks hold the same weights"]
        return []


def recompute_of_label(label: str) -> tuple[str, tuple[str, ...]]:
    """(mode, modules) of a ``Layout.recompute_label``: "selective:layernorm+mla_up_proj" is
    selective with those modules, a plain mode has none."""
    mode, _, modules = label.partition(":")
    return mode, tuple(sorted({m for m in modules.split("+") if m}))


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
    # LoRA (``lora.r``, threefold.accounting.lora_counts): only adapters of rank lora_r on the named
    # linear layers train; the base is frozen
    lora_r: int = 0
    lora_targets: tuple[str, ...] = ()
    # the weights start from files (checkpoint.init_from): start-up reads each rank's regions
    # instead of drawing whole tensors (plan.startup)
    init_from: bool = False
    # train.fp8: the blocks' linear layers and routed experts multiply in FP8 (none,
    # tensorwise, rowwise, blockwise); the planner times their FLOPs at the FP8 peak
    # (plan.compute.matmul_peak)
    fp8: str = "none"
    # parallel.fp8_all_gather resolved: ZeRO-3 gathers the FP8 weights in e4m3 (1 byte each)
    fp8_gather: bool = False
    # train.mlp_tiles: each dense MLP run in this many sequence tiles, recomputed in backward
    mlp_tiles: int = 1

    def fp8_gathers(self, layout: Layout) -> bool:
        """Whether ZeRO-3 gathers ``layout``'s FP8 weights in e4m3: ``fp8_gather`` where the
        runtime's gather applies (stage 3, tp 1). The dry run resolves ``fp8_gather`` for its
        own layout; ``threefold plan`` sets it as ``parallel.fp8_all_gather`` unset does
        (tensorwise, no LoRA, no experts) for every layout it searches."""
        return self.fp8_gather and layout.zero_stage == 3 and layout.tp == 1

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
        # torchft replica groups (ft.replica_groups, with ft.lighthouse) split the global
        # batch between them: the layout is one group's, so is its batch
        groups = max(1, cfg.ft.replica_groups) if cfg.ft.lighthouse else 1
        return cls(seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch_size // groups,
                   precision=precision, flash_attention=True, residual_bytes=weights,
                   master_bytes=weights, eager=not cfg.train.compile,
                   reduce_bytes=reduce if cfg.parallel.zero_stage else 0,
                   document_mask=cfg.data.document_mask, lora_r=cfg.lora.r,
                   lora_targets=lora_targets(cfg.lora) if cfg.lora.r else (),
                   init_from=bool(cfg.checkpoint.init_from), fp8=cfg.train.fp8,
                   fp8_gather=fp8_all_gather(cfg), mlp_tiles=cfg.train.mlp_tiles)


