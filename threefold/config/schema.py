"""The configuration's shape: typed, nested dataclasses, every field with a one-line doc in its
``metadata["doc"]`` (``describe`` lists them); the model's shape is ``model_shape``'s.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from threefold.config.fields import doc_field as _f
from threefold.config.model_shape import ModelConfig

# The pipeline schedules' names: all config needs of them, as it imports nothing of threefold.
# The registry, threefold.schedules.registry.SCHEDULE_SPECS, holds each schedule
# (builder, bubble, activations in flight) and refuses to load unless it lists these names.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v")
# Context-parallel attention algorithms (threefold.parallel.transforms.context) and recompute modes
# (threefold.parallel.transforms.recompute): named once here, at the bottom, for validation, the
# rule book, the planner's options and the runtime.
CP_ALGORITHMS = ("ring", "allgather", "ulysses")
# How packed rows are split over cp ranks (threefold.accounting.cp_balance).
CP_BALANCES = ("documents", "causal")
RECOMPUTE_MODES = ("none", "selective", "full")
# How expert parallelism's all-to-alls travel (threefold.parallel.transforms.expert_dispatch).
EP_DISPATCHES = ("flat", "hierarchical")
# What selective recompute may name as recomputed (``train.recompute_modules``), in Megatron's
# names; layernorm and moe_act are recomputed under any selective policy (the default: empty).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "moe_act", "mlp", "moe",
                     "shared_experts")
# DeepSeek-V3's policy (arXiv 2412.19437 §3.2.3, §3.3.2): the norms, latent attention's
# up-projections and SwiGLU's output recomputed, everything else kept.
DEEPSEEK_RECOMPUTE = ("layernorm", "mla_up_proj", "moe_act")
FP8_RECIPES = ("none", "tensorwise", "rowwise", "blockwise")
# The model families' names (Hugging Face model_type), for the same reason: the registry,
# threefold.families.FAMILIES, holds each family's spec and refuses to load unless it lists these.
MODEL_FAMILIES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "mistral",
                  "olmo2", "gemma3_text", "phi3", "deepseek_v3", "gpt_oss")


@dataclass
class DataConfig:
    """Where text comes from and how it is tokenized and sampled."""

    corpus: str = _f("stdlib", "'stdlib' (this Python's standard-library sources), a text "
                     "file, JSONL file or directory, or a directory `threefold data prepare` "
                     "wrote (recognised by its index.json)")
    mix: str = _f("", "prepared sources and their proportions, NAME=DIR:WEIGHT,... (e.g. "
                  "web=/data/web:0.7,code=/data/code:0.3); replaces data.corpus")
    document_mask: bool = _f(False, "attention stays inside each document of a packed sequence "
                             "(positions restart per document; no target across a document's "
                             "end)")
    text_key: str = _f("text", "field holding the text in JSONL records")
    tokenizer: str = _f("bpe", "'bpe' (train a byte-level BPE, cached) or a tokenizer.json path")
    vocab_size: int = _f(4096, "vocabulary size of the trained BPE")
    seq_len: int = _f(256, "tokens per training sequence")
    val_fraction: float = _f(0.02, "share of the token stream held out for validation")
    max_corpus_mb: float = _f(16.0, "read at most this many MB of corpus text")
    cache_dir: str = _f("~/.cache/threefold", "where tokenizers and token files are cached")


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay."""

    lr: float = _f(2e-3, "peak learning rate")
    min_lr_ratio: float = _f(0.1, "final lr as a fraction of the peak")
    warmup_steps: int = _f(30, "linear warmup steps")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (all parameters, as torchtitan)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 = off")


@dataclass
class ParallelConfig:
    """How the world is split. Product of pp·dp_replicate·dp_shard·cp·tp = world size."""

    dp_replicate: int = _f(1, "data-parallel replicas (full copies, gradients all-reduced)")
    dp_shard: int = _f(-1, "data-parallel ranks that shard state (ZeRO); -1 = the rest")
    tp: int = _f(1, "tensor-parallel degree (innermost mesh axis)")
    cp: int = _f(1, "context-parallel degree: each sequence split over this many ranks "
                 "(between tp and dp_shard in the mesh)")
    cp_algorithm: str = _f("ring", "context-parallel attention: ring (K/V blocks passed "
                           "around the cp ranks), allgather (K/V all-gathered; suits GQA) or "
                           "ulysses (all-to-all from sequence to head shards); "
                           "one of " + ", ".join(CP_ALGORITHMS))
    cp_ulysses: int = _f(1, "hybrid context parallelism: the innermost cp_ulysses of the cp "
                         "ranks trade sequence shards for head shards by all-to-all (inside a "
                         "node), the other cp/cp_ulysses run cp_algorithm (ring or allgather) "
                         "across them; 1 = none")
    pp: int = _f(1, "pipeline stages")
    ep: int = _f(1, "expert-parallel degree (mixture of experts): each expert lives on one of "
                 "this many data-parallel ranks (the innermost part of dp_shard), tokens reach "
                 "it by all-to-all")
    ep_dispatch: str = _f("flat", "how tokens reach their experts: flat (one all-to-all over "
                          "the ep ranks) or hierarchical (each token crosses the network once "
                          "per destination node, to its peer there, then fans out inside the "
                          "node, as DeepSeek-V3 and DeepEP do)")
    gpus_per_node: int = _f(0, "ranks per node for the hierarchical ep dispatch; 0 = the "
                            "launcher's --nproc-per-node (torchrun's LOCAL_WORLD_SIZE)")
    zero_stage: int = _f(0, "ZeRO stage over dp_shard: 0 none, 1 optimiser, 2 +grads, 3 +params")
    sequence_parallel: bool = _f(False, "shard norms/residuals on the sequence within tp")
    cp_balance: str = _f("documents", "how packed rows split over the cp ranks: documents "
                         "(each document head-tail split, equal attention work under "
                         "data.document_mask) or causal (the whole row head-tail split); one "
                         "of " + ", ".join(CP_BALANCES))
    schedule: str = _f("1f1b", "pipeline schedule: " + ", ".join(PIPELINE_SCHEDULES))
    microbatches: int = _f(0, "pipeline microbatches per step; 0 = from the batch")
    vpp: int = _f(1, "model chunks per pipeline stage (interleaved 1F1B; 2 for zb-v and "
                     "dualpipe-v)")
    pipeline_inflight: int = _f(0, "interleaved-1f1b: most chunk activations a rank holds at "
                                   "once (memory against bubble; >= (vpp-1)·pp + 1); 0 = "
                                   "Megatron's warm-up")
    pipeline_split: str = _f("params", "blocks per pipeline stage: params (balance parameters, "
                             "embedding and head included), flops (balance training FLOPs at "
                             "data.seq_len), uniform (L/(pp·vpp) each), or counts per virtual "
                             "stage, e.g. 7,9,9,7")
    bucket_mb: float = _f(25.0, "gradient bucket size for data-parallel all-reduce, MB")
    offload_optimizer: bool = _f(False, "keep AdamW's state and the fp32 master weights in host "
                                 "memory and run the step there (ZeRO-Offload); only "
                                 "gradients go down and parameters come back each step")
    param_dtype: str = _f("auto", "dtype parameters are held and ZeRO-gathered in for compute "
                          "(FSDP2-style mixed precision; the float32 master shards stay with "
                          "their owners): auto (bfloat16 under ZeRO-3 with train.dtype "
                          "bfloat16, else float32), float32 or bfloat16")
    fp8_all_gather: bool | None = _f(None, "ZeRO-3 gathers the FP8 projections' weights in 8 "
                                     "bits (e4m3, scales from one amax all-reduce) under "
                                     "train.fp8 tensorwise; unset = on where it applies "
                                     "(zero_stage 3, tp 1, no LoRA)")
    reduce_dtype: str = _f("float32", "dtype ZeRO reduce-scatters gradients in: float32 or "
                           "bfloat16 (half the bytes, a looser sum)")
    timeout_s: float = _f(600.0, "collective timeout during start-up and the first step, s")
    step_timeout_s: float = _f(120.0, "collective timeout after the first step, s")
    check_collectives: bool = _f(False, "compare every rank's collectives (op, axis, dtype, "
                                 "size, phase) across each group at start-up's end and each "
                                 "step's end, through the rendezvous store; a mismatch stops the "
                                 "run naming the group, the ranks and the first differing call "
                                 "(also on with THREEFOLD_CHECK_COLLECTIVES=1)")
    tp_overlap: int = _f(0, "under sequence parallelism, split each all-gather before the "
                         "column-parallel matmuls and each reduce-scatter after the row-parallel "
                         "ones into this many chunks, each overlapping the neighbouring chunk's "
                         "matmul (async TP); 0 or 1 = off")
    elastic_world: int = _f(0, "the world size this section describes under an elastic launch "
                            "(--nnodes MIN:MAX sets MAX × --nproc-per-node): a run that starts on "
                            "another number of ranks re-plans its layout with the planner, "
                            "keeping the global batch; 0 = no re-plan")
    trace_buf_size: int = _f(20000, "CUDA: entries of NCCL's flight recorder per rank (dumped "
                             "to OUTPUT_DIR/comm_traces/ when a collective times out); 0 = off")


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = _f(300, "optimiser steps")
    global_batch_size: int = _f(8, "sequences per optimiser step, over all ranks")
    micro_batch_size: int = _f(8, "sequences per forward/backward on one rank")
    seed: int = _f(0, "seed for init and data order")
    dtype: str = _f("float32", "compute dtype: float32 or bfloat16 (autocast; fp32 master)")
    activation_checkpointing: bool = _f(False, "recompute each block's activations in backward "
                                        "(the same as train.recompute full)")
    recompute: str = _f("none", "activations recomputed in backward: none; selective (matmul "
                        "and attention outputs kept, norms, RoPE, SwiGLU and casts recomputed); "
                        "full (each block from its input)")
    recompute_modules: str = _f("", "with train.recompute selective, what is recomputed, as "
                                "Megatron's --recompute-modules: a comma list of core_attn, "
                                "layernorm, mla_up_proj, moe_act, mlp, moe, shared_experts "
                                "(a named module keeps no matmul output); empty = "
                                "layernorm,moe_act (always recomputed under selective)")
    compile: bool = _f(False, "torch.compile each block")
    mlp_tiles: int = _f(1, "run each dense MLP over the sequence in this many tiles, each "
                        "recomputed in backward (ALST's tiled MLP): its activations stop "
                        "growing with the length; 1 = off")
    host_mmap_threshold_mb: float = _f(256.0, "CPU runs: glibc keeps freed blocks below this "
                                       "many MiB for reuse instead of mapping fresh pages "
                                       "each step (threefold/training/hostmem.py; 1 MiB at most with "
                                       "several ranks, whose heaps would fragment); 0 = "
                                       "glibc's default")
    device: str = _f("auto", "auto, cpu or cuda")
    output_dir: str = _f("runs/default", "where metrics, summary and checkpoints go")
    log_interval: int = _f(10, "print a line every this many steps")
    eval_interval: int = _f(100, "validate every this many steps; 0 = only at the end")
    eval_batches: int = _f(8, "validation batches (of global_batch_size) per evaluation")
    dry_run: bool = _f(False, "check the configuration on the meta device and print a prediction")
    progress: str = _f("auto", "progress bar: auto (on a TTY), on or off")
    trace_step: int = _f(0, "write OUTPUT_DIR/trace.json, a Chrome/Perfetto trace of what every "
                         "rank did in this step (1-based; 0 = no trace)")
    fp8: str = _f("none", "FP8 matmuls in the blocks' linear layers and routed experts, scaled "
                  "dynamically: none, tensorwise (one scale per tensor), rowwise (per row of the "
                  "input, per column of the weight) or blockwise (DeepSeek-V3: 1x128 input "
                  "tiles, 128x128 weight blocks); master weights, optimiser and head stay as "
                  "they are")
    preemption_grace_s: float = _f(60.0, "on SIGTERM (a preemption notice) every rank finishes "
                                   "the step, saves a checkpoint and exits 0 within this many "
                                   "seconds; 0 = SIGTERM ends the run at once")

    @property
    def recompute_mode(self) -> str:
        """none, selective or full: ``recompute``, or full under ``activation_checkpointing``."""
        return "full" if self.activation_checkpointing else self.recompute

    @property
    def recompute_module_names(self) -> tuple[str, ...]:
        """``recompute_modules`` as a sorted tuple without repeats (the layout's form)."""
        return module_names(self.recompute_modules)


def module_names(text: str) -> tuple[str, ...]:
    """A comma list of recompute modules as a sorted tuple without repeats or blanks."""
    return tuple(sorted({n.strip() for n in text.split(",") if n.strip()}))


@dataclass
class CheckpointConfig:
    """Checkpoints in OUTPUT_DIR/checkpoints/<step>/."""

    interval: int | str = _f(0, "save every this many steps; 0 = only at the end; auto = the "
                             "step count that loses the least time to saves and failures "
                             "(Daly's optimum from a save's cost and checkpoint.mtbf_hours)")
    mtbf_hours: float = _f(0.0, "the job's mean time between failures for checkpoint.interval "
                           "auto, hours; 0 = Llama 3's rate per GPU (419 unexpected "
                           "interruptions in 54 days on 16,384 GPUs) over this run's ranks")
    write_gbps: float = _f(0.122, "storage write bandwidth each rank gets, GB/s: a save's cost "
                           "for checkpoint.interval auto until one is timed (default: Llama 3's "
                           "2 TB/s sustained over 16,384 GPUs)")
    restart_s: float = _f(0.0, "seconds from a failure to the next step, in checkpoint.interval "
                          "auto's goodput (not its optimum); 0 = one save's cost")
    keep_last: int = _f(3, "keep this many most recent checkpoints")
    resume: bool = _f(False, "resume from the newest checkpoint in the output directory")
    save_final: bool = _f(True, "save a checkpoint after the last step")
    init_from: str = _f("", "start from these weights (a Hugging Face folder or hub id "
                        "org/name[@revision], or a threefold run or checkpoint directory); the "
                        "model's shape and tokenizer come with them")
    init_from_commit: str = _f("", "the hub snapshot init_from resolved to (set by the "
                               "launcher; every rank then reads that commit from the cache)")
    async_save: bool = _f(False, "copy each rank's shard to host memory and write it from a "
                          "background thread while training goes on; the commit (manifest, "
                          "index) stays on the main thread at the next step")
    dir: str = _f("", "checkpoint root of each node; empty = OUTPUT_DIR/checkpoints. '{node}' "
                  "is replaced by the node rank (torchrun's GROUP_RANK). Nodes need not share "
                  "it: each writes its own ranks' files and manifest part, rank 0's root gets "
                  "the index (the commit); a resume sends nodes the parts they lack")
    memory_interval: int | str = _f(0, "also keep a checkpoint in host memory (memory_dir) "
                                    "every this many steps, each node's part replicated to "
                                    "the next node; a restart resumes from it before storage; "
                                    "0 = off; auto = the failure rate's optimum for a copy "
                                    "into host memory (as checkpoint.interval auto)")
    memory_dir: str = _f("", "where the in-memory checkpoints live (a tmpfs); empty = "
                         "/dev/shm/threefold-<hash of the output dir>/node{node}; '{node}' is "
                         "replaced by the node rank")


@dataclass
class MetricsConfig:
    """Where the per-step record goes besides OUTPUT_DIR/metrics.jsonl (the writer rank's)."""

    tensorboard: bool = _f(False, "also write TensorBoard event files to OUTPUT_DIR/tensorboard "
                           "(the tensorboard extra)")
    wandb: bool = _f(False, "also log to Weights & Biases (the wandb extra; WANDB_MODE=offline "
                     "keeps the run local)")
    wandb_project: str = _f("threefold", "the W&B project runs are logged to")


@dataclass
class LoRAConfig:
    """Low-rank adapters (Hu et al., arXiv 2106.09685): with r > 0 only they train, on the
    named linear layers; the rest of the model is frozen."""

    r: int = _f(0, "adapter rank; 0 = no LoRA (every weight trains)")
    alpha: float = _f(16.0, "scaling: the adapter's output is multiplied by alpha / r")
    dropout: float = _f(0.0, "dropout on the adapter's input")
    target_modules: str = _f("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                             "comma-separated linear layers to adapt, as PEFT names them "
                             "('all-linear': every one of these)")


@dataclass
class FaultToleranceConfig:
    """Replica groups that fail and heal on their own (torchft, the ft extra): each group is
    one launcher with threefold's normal layout inside; gradients are summed across groups
    through torchft's Manager, and a restarted group heals from a live group's memory."""

    lighthouse: str = _f("", "the torchft Lighthouse's address (http://host:port; "
                         "`python3 -m threefold.parallel.ft_replicas` starts one); empty = off")
    replica_group: int = _f(0, "this launcher's replica group, 0 .. replica_groups - 1 (its "
                            "share of the global batch)")
    replica_groups: int = _f(1, "replica groups in the job; the global batch is split over "
                             "them times each group's data-parallel ranks")
    min_replicas: int = _f(1, "fewest replica groups a step may commit with")
    timeout_s: float = _f(10.0, "torchft's timeout for a cross-group collective, a quorum and a "
                          "heal")


@dataclass
class Config:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (JSON/TOML-serialisable)."""
        return dataclasses.asdict(self)


def param_dtype(cfg: Config) -> str:
    """The dtype parameters are held and gathered in for compute (``parallel.param_dtype``
    resolved): "bfloat16" or "float32"."""
    p = cfg.parallel
    if p.param_dtype == "auto":
        return "bfloat16" if cfg.train.dtype == "bfloat16" and p.zero_stage == 3 else "float32"
    return p.param_dtype


def fp8_all_gather(cfg: Config) -> bool:
    """``parallel.fp8_all_gather`` resolved: whether ZeRO-3 gathers the FP8 weights in 8 bits
    (unset: wherever it applies; validation refuses it set where it does not)."""
    p = cfg.parallel
    applies = cfg.train.fp8 == "tensorwise" and p.zero_stage == 3 and p.tp == 1 \
        and not cfg.lora.r
    if not applies or p.fp8_all_gather is False:
        return False
    # a mixture of experts gathers in param_dtype: its dense-first blocks' 8-bit units and its
    # expert units are not modelled (validation refuses the field set true there)
    experts = cfg.model.num_local_experts
    if experts is None:
        experts = cfg.model.resolved().num_local_experts
    return not experts


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, doc) for every field: the reference the CLI prints."""
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.name in
                                                 {x.name for x in dataclasses.fields(Config)}
                                                 and cls is Config):
            sub = typing.get_type_hints(cls)[f.name]
            rows += describe(sub, f"{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((prefix + f.name, repr(default), f.metadata.get("doc", "")))
    return rows
