"""Closed-form costs of a model under a layout: parameters, FLOPs, communication bytes per mesh
axis and the predicted step time. Pure functions of the configuration; imports no torch, so the
planner can evaluate a 1T-parameter layout in microseconds. The runtime's measured figures are
compared against these same functions (``comm_bytes_per_step``, ``predict_step``); memory is in
``threefold.memory``, the hardware catalogue in ``threefold.hardware``.

Sections, in order: parameters of the model; ``Layout`` and ``Workload``; parameters per rank;
FLOPs and memory-bound traffic per stage; ``collectives`` (the one list from which both the
bytes per mesh axis and the communication times are derived); which link each mesh axis
crosses; the pipeline bubble; ``predict_step`` (α-β times, overlap rules, MFU/HFU).

Conventions (every function below follows them):
- A *layout* splits the world into pp × dp_replicate × dp_shard × tp. Mesh axes are ordered
  outermost first as ``MESH_ORDER``: tp innermost (NVLink), then dp_shard, then dp_replicate and
  pp outermost (DESIGN.md, topology rule). A group that does not fit inside one aligned node
  crosses the network.
- Tensor parallelism follows Megatron (Shoeybi et al. 2019): q/k/v/gate/up column-parallel,
  o/down row-parallel, vocab-parallel embedding and head. RMSNorm weights are *replicated* over
  tp (their gradients are all-reduced over tp once per step under sequence parallelism). When
  kv heads < tp, each kv head is *replicated* on tp/kv ranks (its gradient all-reduced among
  them, its projection computed redundantly). The vocabulary is padded to a multiple of
  ``VOCAB_PAD_MULTIPLE``·tp; an intermediate size that tp does not divide is padded to
  ceil(f/tp) per rank.
- Pipeline: virtual stage s of v·p lives on rank s % p (Megatron's interleaved layout); rank 0
  also holds the embedding, rank p-1 the final norm and LM head; with tied embeddings and pp > 1
  both ends hold a copy, whose gradients are all-reduced between them once per step.
- Bytes are those *sent by one rank* under ring algorithms: all-reduce 2(n-1)/n·S, reduce-scatter
  and all-gather (n-1)/n·S for a buffer of S bytes, point-to-point S.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from threefold.config import Config, ModelConfig

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first (= threefold.mesh.AXES)
# Axes communication is counted on: the mesh axes plus "dp", the flattened dp_replicate ×
# dp_shard group plain data parallelism all-reduces over (as threefold.parallel.data does).
COMM_AXES = MESH_ORDER + ("dp",)
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
VOCAB_PAD_MULTIPLE = 128  # Megatron pads the vocabulary to a multiple of 128·tp
DTYPE_BYTES = {"bf16": 2, "fp32": 4}

# The one calibration constant: achieved matmul FLOP/s as a fraction of the datasheet peak.
# Fitted once to Narayanan et al. 2021 Table 1 (ten GPT runs, 1.7B-1T on up to 3072 A100s;
# tests/test_cost.py): predicted/published TF/s per GPU then spans 0.93-1.06 over all rows.
# Everything else in the time model is a datasheet figure or a count (FLOPs, bytes).
# A measured Hardware (``Hardware.measured``) carries achieved FLOP/s and uses 1.0 instead.
MATMUL_EFFICIENCY = 0.58
DEFAULT_BUCKET_BYTES = 25e6  # last gradient bucket, never hidden behind backward


class LayoutError(ValueError):
    """A layout that does not divide the world, the model or the batch."""


# --------------------------------------------------------------------------------------------
# Parameters of the model (exact; unchanged API)
# --------------------------------------------------------------------------------------------
def layer_parameters(cfg: ModelConfig) -> int:
    """Weights of one transformer block: attention, SwiGLU MLP and its two RMSNorms."""
    h, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q = h * cfg.num_attention_heads * hd
    kv = 2 * h * cfg.num_key_value_heads * hd
    o = cfg.num_attention_heads * hd * h
    return q + kv + o + 3 * h * f + 2 * h


def num_parameters(cfg: ModelConfig) -> int:
    """Exact parameter count of the model built from ``cfg`` (a resolved config)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    head = 0 if cfg.tie_word_embeddings else v * h
    return v * h + cfg.num_hidden_layers * layer_parameters(cfg) + h + head


def matmul_parameters(cfg: ModelConfig) -> int:
    """Parameters that take part in a matrix multiply per token: every Linear weight,
    the LM head included (tied or not); the embedding lookup and the norms excluded."""
    h, v = cfg.hidden_size, cfg.vocab_size
    return cfg.num_hidden_layers * (layer_parameters(cfg) - 2 * h) + v * h


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
    when vpp > 1; sequence parallelism only matters when tp > 1."""

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

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas times shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        """Ranks this layout uses."""
        return self.pp * self.dp * self.tp

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (needs tp > 1)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def pipeline_schedule(self) -> str:
        """The schedule name, with the default filled in."""
        return self.schedule or ("interleaved-1f1b" if self.vpp > 1 else "1f1b")

    def size(self, axis: str) -> int:
        """Degree of the named mesh axis (or of "dp", dp_replicate·dp_shard)."""
        return self.dp if axis == "dp" else getattr(self, axis)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "Layout":
        """The layout a training config describes on ``world_size`` ranks (dp_shard -1 = rest)."""
        p = cfg.parallel
        dp_shard = p.dp_shard
        if dp_shard == -1:
            rest = p.pp * p.dp_replicate * p.tp
            if world_size % rest:
                raise LayoutError(f"world size {world_size} is not a multiple of "
                                  f"pp·dp_replicate·tp = {rest}")
            dp_shard = world_size // rest
        return cls(tp=p.tp, pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard,
                   zero_stage=p.zero_stage, vpp=p.vpp,
                   microbatch_size=cfg.train.micro_batch_size,
                   recompute="full" if cfg.train.activation_checkpointing else "none",
                   schedule=p.schedule, sequence_parallel=p.sequence_parallel)


@dataclass(frozen=True)
class Workload:
    """What one optimiser step trains: ``global_batch`` sequences of ``seq_len`` tokens.
    ``flash_attention`` False means the attention probabilities are materialised."""

    seq_len: int
    global_batch: int
    precision: str = "bf16"
    flash_attention: bool = True

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return self.seq_len * self.global_batch

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation / communicated element."""
        return DTYPE_BYTES[self.precision]


@dataclass(frozen=True)
class TPShard:
    """Per-rank widths of one block under tensor parallelism."""

    heads: int  # query heads per rank
    kv_heads: int  # kv heads per rank (1 when replicated)
    kv_replicas: int  # ranks that hold a copy of each kv head (1 = sharded)
    ffn: int  # intermediate width per rank (ceil(f/tp))
    vocab: int  # padded vocabulary rows per rank


def padded_vocab(cfg: ModelConfig, tp: int) -> int:
    """Vocabulary padded to a multiple of VOCAB_PAD_MULTIPLE·tp (as Megatron does)."""
    mult = VOCAB_PAD_MULTIPLE * tp
    return -(-cfg.vocab_size // mult) * mult


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
    mult = VOCAB_PAD_MULTIPLE * tp
    return TPShard(a // tp, kv_r, reps, -(-f // tp), -(-vocab // mult) * mult // tp)


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
    tp_shard(cfg, layout.tp)
    chunks = layout.pp * layout.vpp
    if cfg.num_hidden_layers % chunks:
        raise LayoutError(f"pp·vpp={chunks} does not divide the {cfg.num_hidden_layers} layers")
    if layout.vpp > 1 and layout.pipeline_schedule != "interleaved-1f1b":
        raise LayoutError("vpp > 1 needs the interleaved-1f1b schedule")
    m = microbatches(layout, work)
    if layout.pipeline_schedule == "interleaved-1f1b" and (layout.pp < 2 or m % layout.pp):
        raise LayoutError(f"interleaved 1F1B needs pp >= 2 and microbatches ({m}) a multiple "
                          f"of pp ({layout.pp})")


def microbatches(layout: Layout, work: Workload) -> int:
    """Microbatches per step on each pipeline (gradient-accumulation steps without pp)."""
    per_replica, rem = divmod(work.global_batch, layout.dp * layout.microbatch_size)
    if rem or not per_replica:
        raise LayoutError(f"global batch {work.global_batch} is not a multiple of "
                          f"dp·microbatch = {layout.dp}·{layout.microbatch_size}")
    return per_replica


# --------------------------------------------------------------------------------------------
# Parameters per rank
# --------------------------------------------------------------------------------------------
def layer_parameters_per_rank(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(tp-sharded, tp-replicated) weights of one block on one rank; the replicated ones are the
    two RMSNorm weights (and kv projections when kv heads are replicated count as sharded)."""
    sh, h, hd = tp_shard(cfg, tp), cfg.hidden_size, cfg.head_dim
    sharded = 2 * h * sh.heads * hd + 2 * h * sh.kv_heads * hd + 3 * h * sh.ffn
    return sharded, 2 * h


def stage_parameters(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    """Parameters held by one rank of pipeline stage ``stage`` (largest over stages at 0/p-1)."""
    return _stage_parameters(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                             cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers,
                             bool(cfg.tie_word_embeddings), layout.tp, layout.pp, stage)


@lru_cache(maxsize=65536)
def _stage_parameters(h: int, a: int, kv: int, f: int, vocab: int, n_layers: int, tied: bool,
                      tp: int, p: int, stage: int) -> int:
    sh = _tp_shard(h, a, kv, f, vocab, tp)
    hd = h // a
    block = 2 * h * sh.heads * hd + 2 * h * sh.kv_heads * hd + 3 * h * sh.ffn + 2 * h
    n = n_layers // p * block
    emb = sh.vocab * h
    if stage == 0:
        n += emb
    if stage == p - 1:
        n += h + (0 if tied and p == 1 else emb)
    return n


def largest_unit_parameters(cfg: ModelConfig, tp: int) -> int:
    """Largest block of weights ZeRO-3 gathers at once on one rank: a transformer block or the
    embedding/head shard (DeepSpeed's 'largest layer')."""
    sharded, replicated = layer_parameters_per_rank(cfg, tp)
    return max(sharded + replicated, tp_shard(cfg, tp).vocab * cfg.hidden_size)


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
    (Korthikanti et al., arXiv 2205.05198 §5)."""
    sh, h, hd, s = tp_shard(cfg, layout.tp), cfg.hidden_size, cfg.head_dim, work.seq_len
    tokens = layout.microbatch_size * s
    layers = cfg.num_hidden_layers // layout.pp
    sharded, _ = layer_parameters_per_rank(cfg, layout.tp)
    core = 4 * s * sh.heads * hd  # QK^T and AV per token, no causal halving (as PaLM)
    layer_fwd = tokens * (2 * sharded + core)
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


def stage_memory_traffic_per_microbatch(cfg: ModelConfig, layout: Layout, work: Workload
                                        ) -> tuple[float, float]:
    """(forward, backward + recompute) HBM bytes that one rank's memory-bound kernels move per
    microbatch (matmuls and flash attention are counted as FLOPs instead). Per token per
    block, forward, d bytes per element: two RMSNorms read and write h (4d·h), two residual
    adds read two and write one (6d·h) — these are split over tp only under sequence
    parallelism, every tp rank repeats them otherwise —; RoPE reads and writes q and k, SwiGLU's
    silu(gate)·up reads two and writes one f-wide tensor (3d·f); materialised attention adds a
    fused softmax that reads and writes a·s scores. Backward moves about twice the forward;
    recompute repeats the forward (or only the softmax, when selective). The loss is not
    counted."""
    sh, h, hd, d, s = tp_shard(cfg, layout.tp), cfg.hidden_size, cfg.head_dim, work.act_bytes, \
        work.seq_len
    tokens = layout.microbatch_size * s
    layers = cfg.num_hidden_layers // layout.pp
    replicated = 10 * d * h / (layout.tp if layout.sp else 1)
    softmax = 0 if work.flash_attention else 2 * d * sh.heads * s
    fwd = layers * tokens * (replicated + 2 * d * (sh.heads + sh.kv_heads) * hd + 3 * d * sh.ffn
                             + softmax)
    bwd = 2 * fwd
    if layout.recompute == "full":
        bwd += fwd
    elif layout.recompute == "selective":
        bwd += layers * tokens * softmax
    return fwd, bwd


def hardware_flops_per_step(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """FLOPs all ranks execute in one step (the HFU numerator: recompute included)."""
    per_pipeline = 0.0
    for st in _distinct_stages(layout.pp):
        flops = sum(stage_flops_per_microbatch(cfg, layout, work, st))
        per_pipeline += flops * _stage_multiplicity(layout.pp, st)
    return per_pipeline * microbatches(layout, work) * layout.tp * layout.dp


def _distinct_stages(p: int) -> list[int]:
    """Stage 0, one middle stage (all middle stages are alike) and stage p-1."""
    return sorted({0, min(1, p - 1), p - 1})


def _stage_multiplicity(p: int, stage: int) -> int:
    """How many stages the representative ``stage`` stands for."""
    if stage in (0, p - 1):
        return 1
    return p - 2


# --------------------------------------------------------------------------------------------
# Collectives per step
# --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Collective:
    """One kind of collective a rank issues: ``count`` calls of ``op`` on a buffer of ``size``
    bytes over ``group`` ranks of mesh axis ``axis``; per microbatch when ``per_microbatch``.
    ``overlap`` says what may hide it: 'none' (on the critical path), 'hidden' (overlapped
    entirely), 'forward'/'backward' (that microbatch's compute, except one bucket), 'last'
    (the last microbatch's backward, except one bucket), 'step' (after the step, exposed)."""

    axis: str
    op: str  # all_reduce | all_gather | reduce_scatter | p2p
    size: float
    count: float
    group: int
    per_microbatch: bool
    overlap: str

    def bytes_sent(self) -> float:
        """Bytes one rank sends per call (ring algorithms)."""
        n = self.group
        return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
                "reduce_scatter": (n - 1) / n, "p2p": 1.0}[self.op] * self.size

    def time(self, latency_s: float, bw: float, size: float | None = None) -> float:
        """α-β time of one call (on a buffer of ``size`` bytes if given)."""
        n, size = self.group, self.size if size is None else size
        if self.op == "p2p":
            return latency_s + size / bw
        steps = 2 * (n - 1) if self.op == "all_reduce" else n - 1
        frac = (2 if self.op == "all_reduce" else 1) * (n - 1) / n
        return steps * latency_s + frac * size / bw


def collectives(cfg: ModelConfig, layout: Layout, work: Workload, stage: int,
                grad_bytes: float | None = None, param_bytes: float | None = None
                ) -> list[Collective]:
    """Every collective one rank of ``stage`` issues in a step.

    tp (Megatron; Korthikanti et al. §4.2.2 for sequence parallelism), per microbatch per layer:
    without SP 2 all-reduces of b·s·h forward, 2 backward (8·b·s·h·(t-1)/t elements); with SP
    2 all-gathers + 2 reduce-scatters forward, the same backward, plus 2 all-gathers that
    re-gather the saved sequence-sharded inputs for the weight gradients (overlapped). Full
    recompute repeats the forward's collectives. Embedding (first stage) and head (last stage)
    add one each way; vocab-parallel cross-entropy 3 all-reduces of b·s fp32.
    pp: b·s·h (/t under SP) to the next stage and back per microbatch per chunk boundary.
    dp, as threefold's engines do it (ZeRO, arXiv 1910.02054 §7; FSDP's no-sync accumulation):
    stage 0 one all-reduce of Ψ over the flattened "dp" group, bucketed and overlapped with the
    last microbatch's backward; stage 1 reduce-scatter Ψ after backward + all-gather Ψ after
    the step; stage 2 the same, the reduce-scatter overlapped with the last backward (full
    gradients are kept while accumulating, as stage 1); stage 3 all-gather Ψ in forward and
    in backward and reduce-scatter Ψ, every microbatch. With dp_replicate > 1 (HSDP) the
    shard gradients are then all-reduced over dp_replicate. Ψ is this rank's parameters.
    """
    t, p, v, b, s = layout.tp, layout.pp, layout.vpp, layout.microbatch_size, work.seq_len
    d = work.act_bytes
    g = d if grad_bytes is None else grad_bytes
    pb = d if param_bytes is None else param_bytes
    layers = cfg.num_hidden_layers // p
    act = b * s * cfg.hidden_size * d
    out: list[Collective] = []

    def add(axis, op, size, count, group, per_mb, overlap):
        """Record a collective unless it is a no-op (group of one or no calls)."""
        if group > 1 and count > 0:
            out.append(Collective(axis, op, size, count, group, per_mb, overlap))

    if layout.sp:
        rec = 2 * layers if layout.recompute == "full" else 0
        add("tp", "all_gather", act, 4 * layers + rec, t, True, "none")
        add("tp", "reduce_scatter", act, 4 * layers + rec, t, True, "none")
        add("tp", "all_gather", act, 2 * layers, t, True, "hidden")
        first = stage == 0
        last = stage == p - 1
        add("tp", "reduce_scatter", act, first + last, t, True, "none")
        add("tp", "all_gather", act, first + last, t, True, "none")
        add("tp", "all_gather", act, int(last), t, True, "hidden")
        norms = layers * 2 * cfg.hidden_size + (cfg.hidden_size if last else 0)
        add("tp", "all_reduce", norms * g, 1, t, False, "last")
    else:
        rec = 2 * layers if layout.recompute == "full" else 0
        ends = (stage == 0) + (stage == p - 1)
        add("tp", "all_reduce", act, 4 * layers + rec + ends, t, True, "none")
    if stage == p - 1:
        add("tp", "all_reduce", b * s * 4, 3, t, True, "none")
    sh = tp_shard(cfg, t)
    kv_params = layers * 2 * cfg.hidden_size * cfg.head_dim * sh.kv_heads
    add("tp", "all_reduce", kv_params * g, 1, sh.kv_replicas, False, "last")

    if p > 1:
        msg = act / t if layout.sp else act
        sends = _p2p_sends_per_microbatch(p, v, stage)
        add("pp", "p2p", msg, sends, p, True, "none")
        if cfg.tie_word_embeddings and stage in (0, p - 1):
            add("pp", "all_reduce", sh.vocab * cfg.hidden_size * g, 1, 2, False, "step")

    psi = stage_parameters(cfg, layout, stage)
    ns, nr, z = layout.dp_shard, layout.dp_replicate, layout.zero_stage
    if z == 0 or ns == 1:
        add("dp", "all_reduce", psi * g, 1, ns * nr, False, "last")
        return out
    if z in (1, 2):
        add("dp_shard", "reduce_scatter", psi * g, 1, ns, False, "step" if z == 1 else "last")
        add("dp_shard", "all_gather", psi * pb, 1, ns, False, "step")
    else:
        add("dp_shard", "all_gather", psi * pb, 1, ns, True, "forward")
        add("dp_shard", "all_gather", psi * pb, 1, ns, True, "backward")
        add("dp_shard", "reduce_scatter", psi * g, 1, ns, True, "backward")
    add("dp_replicate", "all_reduce", psi / ns * g, 1, nr, False, "step")
    return out


def _p2p_sends_per_microbatch(p: int, v: int, rank: int) -> int:
    """Point-to-point sends per microbatch on ``rank``: forward out of every chunk but the
    model's last, backward out of every chunk but the model's first."""
    chunks = [c * p + rank for c in range(v)]
    return sum(s < p * v - 1 for s in chunks) + sum(s > 0 for s in chunks)


def comm_bytes_per_step(cfg: ModelConfig, layout: Layout, work: Workload,
                        stage: int | None = None, grad_bytes: float | None = None,
                        param_bytes: float | None = None) -> dict[str, float]:
    """Bytes one rank sends per step on each axis (keys ``COMM_AXES``), for pipeline
    stage ``stage`` or, when None, the largest over stages per axis. Gradients and gathered
    parameters move in the activation dtype unless ``grad_bytes``/``param_bytes`` say
    otherwise. See ``collectives`` for what each axis carries."""
    stages = _distinct_stages(layout.pp) if stage is None else [stage]
    lists = [collectives(cfg, layout, work, st, grad_bytes, param_bytes) for st in stages]
    return _bytes_per_axis(lists, microbatches(layout, work))


def _bytes_per_axis(lists: list[list[Collective]], m: int) -> dict[str, float]:
    """Per axis, the largest over the given stages' collective lists of bytes sent per step."""
    out = {axis: 0.0 for axis in COMM_AXES}
    for colls in lists:
        per = {axis: 0.0 for axis in COMM_AXES}
        for c in colls:
            per[c.axis] += c.bytes_sent() * c.count * (m if c.per_microbatch else 1)
        for axis in COMM_AXES:
            out[axis] = max(out[axis], per[axis])
    return out


# --------------------------------------------------------------------------------------------
# Topology: which link each mesh axis crosses
# --------------------------------------------------------------------------------------------
def axis_stride(layout: Layout, axis: str) -> int:
    """Rank distance between neighbours of ``axis``: product of the inner axes' degrees."""
    if axis == "dp":  # dp_replicate and dp_shard are adjacent: one contiguous block
        axis = "dp_shard"
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


def predict_step(cfg: ModelConfig, layout: Layout, work: Workload, cluster,
                 efficiency: float | None = None, bucket_bytes: float = DEFAULT_BUCKET_BYTES,
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
    anything, as in Megatron-LM of 2021). The pipeline then takes m·T_slowest plus the bubble,
    (bubble/ideal ratio of the schedule)·m·T_mean. Optimiser arithmetic is not modelled."""
    hw = cluster.hardware
    peak = hw.peak_flops(work.precision)
    if not peak:
        raise ValueError(f"{hw.name}: peak {work.precision} FLOP/s unknown; give --peak-tflops")
    eff = efficiency if efficiency is not None else (hw.matmul_efficiency or MATMUL_EFFICIENCY)
    rate = peak * eff
    m = microbatches(layout, work)
    inter = {a: axis_crosses_nodes(layout, a, cluster.gpus_per_node) for a in COMM_AXES}
    links = {a: hw.link(inter[a]) for a in COMM_AXES}
    stages = _distinct_stages(layout.pp)
    mem_f, mem_b = stage_memory_traffic_per_microbatch(cfg, layout, work)
    hbm = hw.memory_bw or math.inf
    per_mb, per_step, parts, lists, hw_flops = {}, {}, {}, [], 0.0
    for st in stages:
        f, bwd = stage_flops_per_microbatch(cfg, layout, work, st)
        hw_flops += (f + bwd) * _stage_multiplicity(layout.pp, st)
        t_f, t_b = f / rate + mem_f / hbm, bwd / rate + mem_b / hbm
        colls = collectives(cfg, layout, work, st)
        lists.append(colls)
        windows = (t_f, t_b) if overlap_grad_reduce else (0.0, 0.0)
        exposed, step_dp = _exposed_comm(colls, links, *windows, bucket_bytes)
        per_mb[st] = t_f + t_b + sum(exposed.values())
        per_step[st] = step_dp
        parts[st] = (t_f + t_b, exposed, t_b / t_f)
    slow = max(per_mb, key=per_mb.get)
    mean = sum(per_mb[s] * _stage_multiplicity(layout.pp, s) for s in stages) / layout.pp
    ratio, source = bubble_over_ideal(layout.pipeline_schedule, layout.pp, m, layout.vpp,
                                      parts[stages[len(stages) // 2]][2], simulate)
    ideal = m * per_mb[slow]
    bubble = ratio * m * mean
    dp_step = max(per_step.values())
    step = ideal + bubble + dp_step
    comp, exp, _ = parts[slow]
    n = layout.world
    mf = model_flops_per_step(cfg, work)
    hf = hw_flops * m * layout.tp * layout.dp
    return StepPrediction(
        step_time_s=step, compute_s=m * comp, tp_exposed_s=m * exp["tp"],
        pp_exposed_s=m * exp["pp"], dp_exposed_s=m * exp["dp"] + dp_step, bubble_s=bubble,
        bubble_fraction=bubble / (ideal + bubble), bubble_source=source, model_flops=mf,
        hardware_flops=hf, tokens_per_second_per_gpu=work.tokens / step / n,
        tflops_per_gpu=hf / step / n / 1e12, mfu=mf / (step * n * peak),
        hfu=hf / (step * n * peak), comm_bytes=_bytes_per_axis(lists, m),
        inter_node_axes=tuple(a for a in COMM_AXES if inter[a]))


def compute_bound_step_time(cfg: ModelConfig, layout: Layout, work: Workload, cluster,
                            efficiency: float | None = None) -> float:
    """``predict_step``'s step time with every collective free: a lower bound on it, cheap
    enough to order and prune a search."""
    hw = cluster.hardware
    rate = hw.peak_flops(work.precision) * (efficiency if efficiency is not None else
                                            (hw.matmul_efficiency or MATMUL_EFFICIENCY))
    m = microbatches(layout, work)
    stages = _distinct_stages(layout.pp)
    mem = sum(stage_memory_traffic_per_microbatch(cfg, layout, work)) / (hw.memory_bw or math.inf)
    times = {st: sum(stage_flops_per_microbatch(cfg, layout, work, st)) / rate + mem
             for st in stages}
    mean = sum(times[s] * _stage_multiplicity(layout.pp, s) for s in stages) / layout.pp
    ratio, _ = bubble_over_ideal(layout.pipeline_schedule, layout.pp, m, layout.vpp)
    return m * max(times.values()) + ratio * m * mean


def _exposed_comm(colls: list[Collective], links: dict, t_f: float, t_b: float,
                  bucket_bytes: float) -> tuple[dict[str, float], float]:
    """({tp, pp, dp}: exposed seconds per microbatch, exposed dp seconds once per step) for
    one stage, applying the overlap rules of ``predict_step``."""
    exposed = {"tp": 0.0, "pp": 0.0, "dp": 0.0}
    step_dp = 0.0
    groups: dict[tuple[str, str], float] = {}
    tails: dict[tuple[str, str], float] = {}
    for c in colls:
        if c.overlap == "hidden":
            continue
        lat, bw = links[c.axis]
        one = c.time(lat, bw)
        kind = c.axis if c.axis in ("tp", "pp") else "dp"
        if c.overlap == "none":
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
