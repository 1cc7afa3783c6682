"""Typed, nested configuration: dataclasses <- TOML file <- dotted CLI overrides.

Every field carries a one-line doc in its ``metadata["doc"]``. ``load_config`` builds a
``Config`` from an optional TOML file and ``--section.key value`` overrides (overrides win),
then ``validate`` checks it before anything is allocated or any process starts. Errors are
``ConfigError`` with the field, the value and what would be valid; the CLI turns them into a
one-line message and exit code 2.

This module imports nothing of threefold (it is the bottom layer).
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


# The pipeline schedules' names: all config needs of them, as it imports nothing of threefold.
# The registry, threefold.parallel.pipeline.schedules.SCHEDULE_SPECS, holds each schedule
# (builder, bubble, activations in flight) and refuses to load unless it lists these names.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


class ConfigError(ValueError):
    """An invalid configuration value, named by its dotted field path."""


def _f(default: Any, doc: str, **kw: Any) -> Any:
    """A dataclass field with a one-line doc."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc, **kw})
    return field(default=default, metadata={"doc": doc, **kw})


# --------------------------------------------------------------------------------------------
# Model presets. Shapes are the published ones (Llama 3 model cards / HF config.json files;
# GPT sizes from Narayanan et al. 2021, Table 1). `tiny` is the CPU default.
# GPT presets are written as this project's Llama-style block with multi-head attention, tied
# embeddings and a SwiGLU width of 8h/3, which gives the same 12·h² weights per layer as a GPT
# block (4h² attention + 8h² MLP); they are for planning on the meta device.
# --------------------------------------------------------------------------------------------
_LLAMA3_ROPE = dict(rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=8.0,
                    low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192, max_position_embeddings=131072,
                    vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=False)

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=0, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
                 rope_theta=10000.0, rope_scaling="none", max_position_embeddings=1024,
                 tie_word_embeddings=False),
    "small": dict(vocab_size=0, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
                  rope_theta=10000.0, rope_scaling="none", max_position_embeddings=2048,
                  tie_word_embeddings=False),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, **_LLAMA3_ROPE),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, **_LLAMA3_ROPE),
    "llama3-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                        num_attention_heads=128, num_key_value_heads=8, **_LLAMA3_ROPE),
    # Mixture of experts (threefold.moe). tiny-moe: the CPU MoE (8 experts of half tiny's MLP
    # width, top-2, so a token's MLP work is tiny's). mixtral-8x7b: mistralai/Mixtral-8x7B-v0.1
    # config.json (46,702,792,704 parameters, 12,879,925,248 active per token).
    # olmoe-shape-1b-7b: OLMoE-1B-7B's shape (Muennighoff et al., arXiv 2409.02060: 64 experts,
    # top-8) as a Mixtral block: OLMoE's q/k RMSNorms (2·2048 weights per layer) are not
    # modelled, so it has 6,919,096,320 parameters (OLMoE: 6,919,161,856) and
    # 1,281,951,744 active; it cannot load OLMoE's weights.
    "tiny-moe": dict(vocab_size=0, hidden_size=256, intermediate_size=344, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
                     rope_theta=10000.0, rope_scaling="none", max_position_embeddings=1024,
                     tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2),
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         rms_norm_eps=1e-5, rope_theta=1e6, rope_scaling="none",
                         max_position_embeddings=32768, tie_word_embeddings=False,
                         num_local_experts=8, num_experts_per_tok=2),
    "olmoe-shape-1b-7b": dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                              num_hidden_layers=16, num_attention_heads=16,
                              num_key_value_heads=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                              rope_scaling="none", max_position_embeddings=4096,
                              tie_word_embeddings=False, num_local_experts=64,
                              num_experts_per_tok=8),
}

# (params in billions as published, heads, hidden, layers) — Narayanan et al. 2021, Table 1.
GPT_SHAPES = {
    "gpt-1.7b": (24, 2304, 24), "gpt-3.6b": (32, 3072, 30), "gpt-7.5b": (32, 4096, 36),
    "gpt-18b": (48, 6144, 40), "gpt-39b": (64, 8192, 48), "gpt-76b": (80, 10240, 60),
    "gpt-145b": (96, 12288, 80), "gpt-310b": (128, 16384, 96), "gpt-530b": (128, 20480, 105),
    "gpt-1t": (160, 25600, 128),
}
for _name, (_a, _h, _l) in GPT_SHAPES.items():
    MODEL_PRESETS[_name] = dict(vocab_size=51200, hidden_size=_h, intermediate_size=8 * _h // 3,
                                num_hidden_layers=_l, num_attention_heads=_a,
                                num_key_value_heads=_a, rms_norm_eps=1e-5, rope_theta=10000.0,
                                rope_scaling="none", max_position_embeddings=2048,
                                tie_word_embeddings=True)


@dataclass
class ModelConfig:
    """Llama-style decoder shape. Unset (None) fields come from the preset."""

    preset: str = _f("tiny", "named shape to start from: " + ", ".join(MODEL_PRESETS))
    vocab_size: int | None = _f(None, "vocabulary size; 0 = the tokenizer's")
    hidden_size: int | None = _f(None, "model width h")
    intermediate_size: int | None = _f(None, "SwiGLU inner width")
    num_hidden_layers: int | None = _f(None, "number of transformer blocks")
    num_attention_heads: int | None = _f(None, "query heads")
    num_key_value_heads: int | None = _f(None, "key/value heads (GQA); equal to heads for MHA")
    rms_norm_eps: float | None = _f(None, "RMSNorm epsilon")
    rope_theta: float | None = _f(None, "RoPE base frequency")
    rope_scaling: str | None = _f(None, "RoPE scaling: none or llama3")
    rope_scaling_factor: float | None = _f(None, "llama3 RoPE scaling factor")
    low_freq_factor: float | None = _f(None, "llama3 RoPE low-frequency factor")
    high_freq_factor: float | None = _f(None, "llama3 RoPE high-frequency factor")
    original_max_position_embeddings: int | None = _f(None, "llama3 RoPE original context")
    max_position_embeddings: int | None = _f(None, "longest supported sequence")
    tie_word_embeddings: bool | None = _f(None, "share embedding and LM-head weights")
    init_std: float = _f(0.02, "std of the normal init of weights")
    num_local_experts: int | None = _f(None, "experts per MoE layer (Mixtral-style, every "
                                       "block's MLP routed); 0 = dense MLPs")
    num_experts_per_tok: int | None = _f(None, "experts each token is routed to (top-k)")
    router_aux_loss_coef: float = _f(0.02, "weight of the load-balancing loss E·Σ f_i·P_i "
                                     "(Switch/Mixtral; 0.02 as Mixtral-8x7B's config.json)")
    router_z_loss_coef: float = _f(0.0, "weight of the router z-loss mean(logsumexp(logits)²) "
                                   "(ST-MoE suggests 0.001; 0 = off, as Mixtral)")
    shared_expert_intermediate_size: int = _f(0, "width of a shared expert beside the routed "
                                              "ones, every token through it, its output "
                                              "scaled by sigmoid(x · shared_expert_gate) "
                                              "(Qwen2-MoE); 0 = none (Mixtral)")
    norm_topk_prob: bool = _f(True, "renormalise the k chosen router probabilities to sum to "
                              "one (Mixtral; false: the softmax values as they are, as "
                              "Qwen1.5-MoE's norm_topk_prob false)")
    router_aux_loss_per_layer: bool = _f(False, "load-balancing loss per layer, averaged over "
                                         "layers (Megatron/DeepSeek style; what pipeline "
                                         "parallelism needs), instead of f and P pooled over "
                                         "all layers first (transformers' Mixtral)")

    def resolved(self, vocab_size: int | None = None) -> "ModelConfig":
        """A copy with every None filled from the preset (and vocab from the tokenizer)."""
        if self.preset not in MODEL_PRESETS:
            raise ConfigError(_unknown("model.preset", self.preset, MODEL_PRESETS))
        base = dict(rope_scaling_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192, num_local_experts=0,
                    num_experts_per_tok=2)
        base.update(MODEL_PRESETS[self.preset])
        out = dataclasses.replace(self)
        for f in dataclasses.fields(self):
            if getattr(out, f.name) is None:
                setattr(out, f.name, base.get(f.name))
        if not out.vocab_size:
            out.vocab_size = vocab_size or 0
        return out

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads


@dataclass
class DataConfig:
    """Where text comes from and how it is tokenized and sampled."""

    corpus: str = _f("stdlib", "'stdlib' (this Python's standard-library sources), or a text "
                     "file, JSONL file or directory")
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
                           "around the cp ranks) or allgather (K/V all-gathered; suits GQA)")
    pp: int = _f(1, "pipeline stages")
    ep: int = _f(1, "expert-parallel degree (mixture of experts): each expert lives on one of "
                 "this many data-parallel ranks (the innermost part of dp_shard), tokens reach "
                 "it by all-to-all")
    zero_stage: int = _f(0, "ZeRO stage over dp_shard: 0 none, 1 optimiser, 2 +grads, 3 +params")
    sequence_parallel: bool = _f(False, "shard norms/residuals on the sequence within tp")
    schedule: str = _f("1f1b", "pipeline schedule: " + ", ".join(PIPELINE_SCHEDULES))
    microbatches: int = _f(0, "pipeline microbatches per step; 0 = from the batch")
    vpp: int = _f(1, "model chunks per pipeline stage (interleaved 1F1B)")
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
    reduce_dtype: str = _f("float32", "dtype ZeRO reduce-scatters gradients in: float32 or "
                           "bfloat16 (half the bytes, a looser sum)")
    timeout_s: float = _f(600.0, "collective timeout during start-up and the first step, s")
    step_timeout_s: float = _f(120.0, "collective timeout after the first step, s")


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = _f(300, "optimiser steps")
    global_batch_size: int = _f(8, "sequences per optimiser step, over all ranks")
    micro_batch_size: int = _f(8, "sequences per forward/backward on one rank")
    seed: int = _f(0, "seed for init and data order")
    dtype: str = _f("float32", "compute dtype: float32 or bfloat16 (autocast; fp32 master)")
    activation_checkpointing: bool = _f(False, "recompute each block's activations in backward")
    compile: bool = _f(False, "torch.compile each block")
    host_mmap_threshold_mb: float = _f(256.0, "CPU runs: glibc keeps freed blocks below this "
                                       "many MiB for reuse instead of mapping fresh pages "
                                       "each step (threefold/hostmem.py; 1 MiB at most with "
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
    preemption_grace_s: float = _f(60.0, "on SIGTERM (a preemption notice) every rank finishes "
                                   "the step, saves a checkpoint and exits 0 within this many "
                                   "seconds; 0 = SIGTERM ends the run at once")


@dataclass
class CheckpointConfig:
    """Checkpoints in OUTPUT_DIR/checkpoints/<step>/."""

    interval: int = _f(0, "save every this many steps; 0 = only at the end")
    keep_last: int = _f(3, "keep this many most recent checkpoints")
    resume: bool = _f(False, "resume from the newest checkpoint in the output directory")
    save_final: bool = _f(True, "save a checkpoint after the last step")
    init_from: str = _f("", "start from these weights (a Hugging Face folder, or a threefold run "
                        "or checkpoint directory); model shape and tokenizer come with them")
    dir: str = _f("", "checkpoint root of each node; empty = OUTPUT_DIR/checkpoints. '{node}' "
                  "is replaced by the node rank (torchrun's GROUP_RANK). Nodes need not share "
                  "it: each writes its own ranks' files and manifest part, rank 0's root gets "
                  "the index (the commit); a resume sends nodes the parts they lack")


@dataclass
class Config:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (JSON/TOML-serialisable)."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Loading and overriding
# --------------------------------------------------------------------------------------------
def _unknown(path: str, key: str, choices) -> str:
    near = difflib.get_close_matches(str(key), list(choices), n=1)
    hint = f"; did you mean '{near[0]}'?" if near else f"; valid: {', '.join(map(str, choices))}"
    return f"{path}: unknown value '{key}'{hint}"


def _coerce(path: str, value: Any, typ: Any) -> Any:
    """Convert a TOML or CLI string value to the field's type, or raise ConfigError."""
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if args and typing.get_origin(typ) in (typing.Union, getattr(__import__("types"), "UnionType")):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        typ = args[0]
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise ConfigError(f"{path}: '{value}' is not a valid {getattr(typ, '__name__', typ)}")


def _set(cfg: Config, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(f"{dotted}: options are written section.key, e.g. --train.steps 100")
    section, key = parts
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(_unknown("config", section, sections).replace("value", "section"))
    obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    if key not in names:
        near = difflib.get_close_matches(key, names, n=1)
        hint = f"; did you mean '{section}.{near[0]}'?" if near else ""
        raise ConfigError(f"{section}.{key}: unknown option{hint}")
    setattr(obj, key, _coerce(dotted, value, hints[key]))


def apply_mapping(cfg: Config, data: dict[str, Any]) -> None:
    """Apply a nested mapping (as read from TOML) onto ``cfg``."""
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a [{section}] table, got {values!r}")
        for key, value in values.items():
            _set(cfg, f"{section}.{key}", value)


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """Turn ['--train.steps', '5', '--x.y=z'] into [('train.steps','5'), ('x.y','z')]."""
    out, i = [], 0
    while i < len(argv):
        if not argv[i].startswith("--"):
            raise ConfigError(f"unexpected argument '{argv[i]}': options are --section.key value")
        key, value, i = take_flag(argv, i)
        out.append((key, value))
    return out


def take_flag(argv: list[str], i: int) -> tuple[str, str, int]:
    """``--a.b value`` or ``--a.b=value`` at ``argv[i]`` -> ('a.b', value, next index);
    dashes in the key become underscores."""
    key = argv[i][2:]
    if "=" in key:
        key, value = key.split("=", 1)
        i += 1
    elif i + 1 < len(argv):
        value, i = argv[i + 1], i + 2
    else:
        raise ConfigError(f"--{key}: missing value")
    return key.replace("-", "_"), value, i


def load_config(path: str | None = None, overrides: list[tuple[str, str]] | None = None,
                validate_now: bool = True) -> Config:
    """Defaults <- TOML file <- overrides; validated unless ``validate_now`` is False."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None
        apply_mapping(cfg, data)
    for key, value in overrides or []:
        _set(cfg, key, value)
    if validate_now:
        validate(cfg)
    return cfg


# --------------------------------------------------------------------------------------------
# Validation (world-size independent; the mesh checks the layout against the world size)
# --------------------------------------------------------------------------------------------
def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate(cfg: Config) -> None:
    """Check every field that can be checked without knowing the world size (and write
    ``parallel.pipeline_split`` without spaces, the one form the rest reads)."""
    m, d, o, p, t, c = cfg.model, cfg.data, cfg.optim, cfg.parallel, cfg.train, cfg.checkpoint
    if m.preset not in MODEL_PRESETS:
        raise ConfigError(_unknown("model.preset", m.preset, MODEL_PRESETS))
    r = m.resolved(vocab_size=d.vocab_size)
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        _need(getattr(r, name) > 0, f"model.{name}: must be positive, got {getattr(r, name)}")
    _need(r.hidden_size % r.num_attention_heads == 0,
          f"model.hidden_size: {r.hidden_size} is not divisible by num_attention_heads="
          f"{r.num_attention_heads}; pick a multiple")
    _need(r.num_attention_heads % r.num_key_value_heads == 0,
          f"model.num_key_value_heads: {r.num_key_value_heads} must divide num_attention_heads="
          f"{r.num_attention_heads}")
    _need(r.head_dim % 2 == 0, f"model.hidden_size: head dim {r.head_dim} must be even for RoPE")
    if r.rope_scaling not in ("none", "llama3"):
        raise ConfigError(_unknown("model.rope_scaling", r.rope_scaling, ["none", "llama3"]))
    _need(m.init_std > 0, f"model.init_std: must be positive, got {m.init_std}")
    _need(r.num_local_experts >= 0,
          f"model.num_local_experts: must be >= 0 (0 = dense), got {r.num_local_experts}")
    if r.num_local_experts:
        _need(1 <= r.num_experts_per_tok <= r.num_local_experts,
              f"model.num_experts_per_tok: {r.num_experts_per_tok} must be between 1 and "
              f"model.num_local_experts={r.num_local_experts}")
    _need(m.shared_expert_intermediate_size >= 0,
          "model.shared_expert_intermediate_size: must be >= 0 (0 = no shared expert)")
    _need(m.router_aux_loss_coef >= 0 and m.router_z_loss_coef >= 0,
          "model.router_aux_loss_coef/router_z_loss_coef: must be >= 0")
    _need(d.vocab_size >= 260, f"data.vocab_size: {d.vocab_size} is too small; use at least 260 "
          "(256 bytes + special tokens)")
    _need(d.seq_len >= 2, f"data.seq_len: must be at least 2, got {d.seq_len}")
    _need(d.seq_len <= r.max_position_embeddings,
          f"data.seq_len: {d.seq_len} exceeds model.max_position_embeddings="
          f"{r.max_position_embeddings}; lower it or raise the model's limit")
    _need(0 < d.val_fraction < 0.5, f"data.val_fraction: {d.val_fraction} must be in (0, 0.5)")
    _need(d.max_corpus_mb > 0, f"data.max_corpus_mb: must be positive, got {d.max_corpus_mb}")
    _need(o.lr > 0, f"optim.lr: must be positive, got {o.lr}")
    _need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio: {o.min_lr_ratio} must be in [0, 1]")
    _need(o.warmup_steps >= 0, f"optim.warmup_steps: must be >= 0, got {o.warmup_steps}")
    _need(o.weight_decay >= 0, f"optim.weight_decay: must be >= 0, got {o.weight_decay}")
    _need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1/beta2: must be in [0, 1)")
    _need(o.grad_clip >= 0, f"optim.grad_clip: must be >= 0 (0 = off), got {o.grad_clip}")
    for name in ("dp_replicate", "tp", "pp", "vpp", "cp"):
        _need(getattr(p, name) >= 1, f"parallel.{name}: must be >= 1, got {getattr(p, name)}")
    _need(p.dp_shard == -1 or p.dp_shard >= 1,
          f"parallel.dp_shard: must be >= 1 or -1 (the rest), got {p.dp_shard}")
    _need(p.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage: {p.zero_stage} is not 0, 1, 2 or 3")
    if p.schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(_unknown("parallel.schedule", p.schedule, list(PIPELINE_SCHEDULES)))
    if p.param_dtype not in ("auto", "float32", "bfloat16"):
        raise ConfigError(_unknown("parallel.param_dtype", p.param_dtype,
                                   ["auto", "float32", "bfloat16"]))
    if p.reduce_dtype not in ("float32", "bfloat16"):
        raise ConfigError(_unknown("parallel.reduce_dtype", p.reduce_dtype,
                                   ["float32", "bfloat16"]))
    _need(p.param_dtype != "bfloat16" or t.dtype == "bfloat16",
          "parallel.param_dtype: bfloat16 parameters need bfloat16 compute; set train.dtype "
          "bfloat16 or parallel.param_dtype auto")
    if p.cp_algorithm not in ("ring", "allgather"):
        raise ConfigError(_unknown("parallel.cp_algorithm", p.cp_algorithm, ["ring", "allgather"]))
    p.pipeline_split = p.pipeline_split.replace(" ", "")  # "7, 9, 9, 7" as "7,9,9,7"
    _need(p.pipeline_split in ("params", "flops", "uniform")
          or all(x.isdigit() for x in p.pipeline_split.split(",")),
          f"parallel.pipeline_split: '{p.pipeline_split}' is not params, flops, uniform or block "
          "counts per pipeline stage such as 7,9,9,7")
    _need(p.microbatches >= 0, f"parallel.microbatches: must be >= 0, got {p.microbatches}")
    _need(p.bucket_mb > 0, f"parallel.bucket_mb: must be positive, got {p.bucket_mb}")
    _need(t.steps >= 0, f"train.steps: must be >= 0, got {t.steps}")
    _need(t.host_mmap_threshold_mb >= 0, "train.host_mmap_threshold_mb: must be >= 0 (0 = "
          f"glibc's default), got {t.host_mmap_threshold_mb}")
    _need(t.preemption_grace_s >= 0,
          f"train.preemption_grace_s: must be >= 0 (0 = off), got {t.preemption_grace_s}")
    _need(t.global_batch_size >= 1, f"train.global_batch_size: must be >= 1, got "
          f"{t.global_batch_size}")
    _need(t.micro_batch_size >= 1, f"train.micro_batch_size: must be >= 1, got "
          f"{t.micro_batch_size}")
    _need(t.global_batch_size % t.micro_batch_size == 0,
          f"train.global_batch_size: {t.global_batch_size} is not a multiple of "
          f"train.micro_batch_size={t.micro_batch_size}")
    if t.dtype not in ("float32", "bfloat16"):
        raise ConfigError(_unknown("train.dtype", t.dtype, ["float32", "bfloat16"]))
    if t.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(_unknown("train.device", t.device, ["auto", "cpu", "cuda"]))
    if t.progress not in ("auto", "on", "off"):
        raise ConfigError(_unknown("train.progress", t.progress, ["auto", "on", "off"]))
    _need(t.log_interval >= 1, f"train.log_interval: must be >= 1, got {t.log_interval}")
    _need(t.eval_interval >= 0, f"train.eval_interval: must be >= 0, got {t.eval_interval}")
    _need(0 <= t.trace_step <= max(t.steps, 0),
          f"train.trace_step: must be between 0 (no trace) and train.steps={t.steps}, got "
          f"{t.trace_step}")
    _need(t.eval_batches >= 1, f"train.eval_batches: must be >= 1, got {t.eval_batches}")
    _need(bool(t.output_dir), "train.output_dir: must not be empty")
    _need(c.interval >= 0, f"checkpoint.interval: must be >= 0, got {c.interval}")
    _need(c.keep_last >= 1, f"checkpoint.keep_last: must be >= 1, got {c.keep_last}")
    _need("{" not in c.dir.replace("{node}", "") and "}" not in c.dir.replace("{node}", ""),
          f"checkpoint.dir: '{c.dir}' has a placeholder other than {{node}}")


def param_dtype(cfg: Config) -> str:
    """The dtype parameters are held and gathered in for compute (``parallel.param_dtype``
    resolved): "bfloat16" or "float32"."""
    p = cfg.parallel
    if p.param_dtype == "auto":
        return "bfloat16" if cfg.train.dtype == "bfloat16" and p.zero_stage == 3 else "float32"
    return p.param_dtype


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
