"""Validation of each field's own values, which needs no world size: one function per
section, in the order ``validate`` runs them, each raising ``ConfigError`` with the field, the
value and what would be valid. The rules that refuse a layout (parallel degrees against the
world, the model, the batch, recompute, LoRA) are the rule book's,
``threefold.layout.rules``, which every command calls before launch.
"""

from __future__ import annotations

import importlib.util

from threefold.config.fields import ConfigError, unknown_value
from threefold.config.model_shape import ModelConfig
from threefold.config.presets import MODEL_PRESETS
from threefold.config.schema import (CP_ALGORITHMS, CP_BALANCES, EP_DISPATCHES, FP8_RECIPES,
                                     MODEL_FAMILIES, PIPELINE_SCHEDULES, RECOMPUTE_MODES,
                                     RECOMPUTE_MODULES, CheckpointConfig,
                                     Config, DataConfig, LoRAConfig, MetricsConfig,
                                     OptimConfig, ParallelConfig, TrainConfig)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _one_of(path: str, value: str, choices: list[str]) -> None:
    if value not in choices:
        raise ConfigError(unknown_value(path, value, choices))


def validate(cfg: Config) -> None:
    """Check every field that can be checked without knowing the world size (and write
    ``parallel.pipeline_split`` without spaces, the one form the rest reads)."""
    _check_model_settings(cfg.model)
    _check_data(cfg.data)
    _check_optim(cfg.optim)
    _check_parallel(cfg.parallel, cfg.train)
    _check_train(cfg.train)
    _check_recompute(cfg.train)
    _check_checkpoint(cfg.checkpoint)
    _check_metrics(cfg.metrics)
    _check_lora(cfg.lora)
    _check_fp8(cfg.train, cfg.lora, cfg.parallel)
    _check_ft(cfg)
    if not cfg.checkpoint.init_from:  # else the checkpoint's shape, once read (model_source)
        check_against_model(cfg, _check_model(cfg.model, cfg.data.vocab_size))


def check_against_model(cfg: Config, r: ModelConfig) -> None:
    """The rules that need the model's shape ``r`` (resolved): the sequence fits its
    context, the experts' activation and the 8-bit gather."""
    _need(cfg.data.seq_len <= r.max_position_embeddings,
          f"data.seq_len: {cfg.data.seq_len} exceeds model.max_position_embeddings="
          f"{r.max_position_embeddings}; lower it or raise the model's limit")
    _need(r.hidden_act == "silu" or not r.num_local_experts,
          f"model.hidden_act: {r.hidden_act}, but the experts of a mixture are SwiGLU; use "
          "silu")
    _need(not (cfg.parallel.fp8_all_gather and r.num_local_experts),
          "parallel.fp8_all_gather: true is not available for a mixture of experts "
          "(model.num_local_experts; its dense blocks' 8-bit units are not modelled); unset it "
          "or set it false")


def _check_model_settings(m: ModelConfig) -> None:
    """What the model fields say besides its shape: the preset's name, the initialisation
    and the router's loss weights."""
    _one_of("model.preset", m.preset, list(MODEL_PRESETS))
    _need(m.init_std > 0, f"model.init_std: must be positive, got {m.init_std}")
    _need(m.shared_expert_intermediate_size >= 0,
          "model.shared_expert_intermediate_size: must be >= 0 (0 = no shared expert)")
    _need(m.router_aux_loss_coef >= 0 and m.router_z_loss_coef >= 0,
          "model.router_aux_loss_coef/router_z_loss_coef: must be >= 0")
    _need(m.num_nextn_predict_layers >= 0 and m.mtp_loss_weight >= 0,
          "model.num_nextn_predict_layers/mtp_loss_weight: must be >= 0 (0 = no multi-token "
          "prediction)")
    _one_of("model.norm_layout", m.norm_layout, ["pre", "post", "sandwich"])
    _one_of("model.hidden_act", m.hidden_act, ["silu", "gelu_tanh"])
    _need(0 < m.partial_rotary_factor <= 1, f"model.partial_rotary_factor: must be in (0, 1], "
          f"got {m.partial_rotary_factor}")
    for name in ("query_pre_attn_scalar", "sliding_window_pattern", "rope_local_theta"):
        _need(getattr(m, name) >= 0, f"model.{name}: must be >= 0 (0 = off), got "
              f"{getattr(m, name)}")
    _one_of("model.qk_norm_over", m.qk_norm_over, ["head", "projection"])
    _one_of("model.moe_impl", m.moe_impl, ["grouped", "loop"])
    _one_of("model.moe_activation", m.moe_activation, ["swiglu", "clamped_swiglu"])
    _need(m.sliding_window >= 0, f"model.sliding_window: must be >= 0 (0 = none), got "
          f"{m.sliding_window}")
    if m.family is not None:
        _one_of("model.family", m.family, list(MODEL_FAMILIES))


def _check_model(m: ModelConfig, vocab_size: int) -> ModelConfig:
    """The model's shape (resolved from its preset, which is returned)."""
    r = m.resolved(vocab_size=vocab_size)
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
    _one_of("model.rope_scaling", r.rope_scaling, ["none", "llama3", "linear", "yarn"])
    _need(r.num_local_experts >= 0,
          f"model.num_local_experts: must be >= 0 (0 = dense), got {r.num_local_experts}")
    if r.num_local_experts:
        _need(1 <= r.num_experts_per_tok <= r.num_local_experts,
              f"model.num_experts_per_tok: {r.num_experts_per_tok} must be between 1 and "
              f"model.num_local_experts={r.num_local_experts}")
    _check_deepseek(r)
    return r


def _check_deepseek(r: ModelConfig) -> None:
    """DeepSeek-V3's fields: grouped routing's groups, latent attention's widths, the dense
    first blocks' width."""
    _one_of("model.moe_router", r.moe_router, ["softmax", "sigmoid_grouped"])
    if r.num_local_experts and r.moe_router == "sigmoid_grouped":
        per = r.num_local_experts // max(r.n_group, 1)
        _need(r.n_group >= 1 and r.num_local_experts % r.n_group == 0 and per >= 2
              and 1 <= r.topk_group <= r.n_group,
              f"model.n_group: {r.n_group} groups of the {r.num_local_experts} experts (two or "
              f"more each), topk_group={r.topk_group} of them kept, is not a valid split")
    if r.kv_lora_rank:
        _need(min(r.qk_nope_head_dim, r.qk_rope_head_dim, r.v_head_dim) > 0
              and r.qk_rope_head_dim % 2 == 0,
              "model.qk_rope_head_dim: latent attention needs qk_nope_head_dim, an even "
              "qk_rope_head_dim and v_head_dim")
    _need(not (r.num_local_experts and r.first_k_dense_replace)
          or r.dense_intermediate_size > 0,
          "model.dense_intermediate_size: the dense first blocks (first_k_dense_replace) "
          "need a width")


def _check_data(d: DataConfig) -> None:
    """The tokenizer's vocabulary, the sequence, the corpus's size."""
    _need(d.vocab_size >= 260, f"data.vocab_size: {d.vocab_size} is too small; use at least 260 "
          "(256 bytes + special tokens)")
    _need(d.seq_len >= 2, f"data.seq_len: must be at least 2, got {d.seq_len}")
    _need(0 < d.val_fraction < 0.5, f"data.val_fraction: {d.val_fraction} must be in (0, 0.5)")
    _need(d.max_corpus_mb > 0, f"data.max_corpus_mb: must be positive, got {d.max_corpus_mb}")
    # Prepared sources (complete, one tokenizer) are the data layer's to check, from their
    # files: ``threefold.launch.launcher.load_run_config``, right after this, before any process
    # starts.


def _check_optim(o: OptimConfig) -> None:
    """AdamW and its schedule."""
    _need(o.lr > 0, f"optim.lr: must be positive, got {o.lr}")
    _need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio: {o.min_lr_ratio} must be in [0, 1]")
    _need(o.warmup_steps >= 0, f"optim.warmup_steps: must be >= 0, got {o.warmup_steps}")
    _need(o.weight_decay >= 0, f"optim.weight_decay: must be >= 0, got {o.weight_decay}")
    _need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1/beta2: must be in [0, 1)")
    _need(o.grad_clip >= 0, f"optim.grad_clip: must be >= 0 (0 = off), got {o.grad_clip}")


def _check_parallel(p: ParallelConfig, t: TrainConfig) -> None:
    """Degrees and choices of ``parallel`` (bfloat16 parameters against ``train.dtype``);
    writes ``pipeline_split`` without spaces."""
    for name in ("dp_replicate", "tp", "pp", "vpp", "cp", "cp_ulysses", "ep"):
        _need(getattr(p, name) >= 1, f"parallel.{name}: must be >= 1, got {getattr(p, name)}")
    _need(p.dp_shard == -1 or p.dp_shard >= 1,
          f"parallel.dp_shard: must be >= 1 or -1 (the rest), got {p.dp_shard}")
    _need(p.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage: {p.zero_stage} is not 0, 1, 2 or 3")
    _one_of("parallel.schedule", p.schedule, list(PIPELINE_SCHEDULES))
    _one_of("parallel.param_dtype", p.param_dtype, ["auto", "float32", "bfloat16"])
    _one_of("parallel.reduce_dtype", p.reduce_dtype, ["float32", "bfloat16"])
    _need(p.param_dtype != "bfloat16" or t.dtype == "bfloat16",
          "parallel.param_dtype: bfloat16 parameters need bfloat16 compute; set train.dtype "
          "bfloat16 or parallel.param_dtype auto")
    _one_of("parallel.cp_algorithm", p.cp_algorithm, list(CP_ALGORITHMS))
    _one_of("parallel.ep_dispatch", p.ep_dispatch, list(EP_DISPATCHES))
    _need(p.gpus_per_node >= 0, f"parallel.gpus_per_node: must be >= 0 (0 = the launcher's "
          f"--nproc-per-node), got {p.gpus_per_node}")
    _one_of("parallel.cp_balance", p.cp_balance, list(CP_BALANCES))
    _need(p.elastic_world >= 0, f"parallel.elastic_world: must be >= 0 (0 = no re-plan), got "
          f"{p.elastic_world}")
    _need(t.mlp_tiles >= 1, f"train.mlp_tiles: must be >= 1 (1 = untiled), got {t.mlp_tiles}")
    p.pipeline_split = p.pipeline_split.replace(" ", "")  # "7, 9, 9, 7" as "7,9,9,7"
    _need(p.pipeline_split in ("params", "flops", "uniform")
          or all(x.isdigit() for x in p.pipeline_split.split(",")),
          f"parallel.pipeline_split: '{p.pipeline_split}' is not params, flops, uniform or block "
          "counts per pipeline stage such as 7,9,9,7")
    _need(p.microbatches >= 0, f"parallel.microbatches: must be >= 0, got {p.microbatches}")
    _need(p.bucket_mb > 0, f"parallel.bucket_mb: must be positive, got {p.bucket_mb}")
    _need(p.tp_overlap >= 0, f"parallel.tp_overlap: must be >= 0 (chunks per collective; 0 = "
          f"off), got {p.tp_overlap}")


def _check_train(t: TrainConfig) -> None:
    """The loop: steps, batch sizes, dtype, device, logging, evaluation, trace."""
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
    _one_of("train.dtype", t.dtype, ["float32", "bfloat16"])
    _one_of("train.device", t.device, ["auto", "cpu", "cuda"])
    _one_of("train.progress", t.progress, ["auto", "on", "off"])
    _need(t.log_interval >= 1, f"train.log_interval: must be >= 1, got {t.log_interval}")
    _need(t.eval_interval >= 0, f"train.eval_interval: must be >= 0, got {t.eval_interval}")
    _need(0 <= t.trace_step <= max(t.steps, 0),
          f"train.trace_step: must be between 0 (no trace) and train.steps={t.steps}, got "
          f"{t.trace_step}")
    _need(t.eval_batches >= 1, f"train.eval_batches: must be >= 1, got {t.eval_batches}")
    _need(bool(t.output_dir), "train.output_dir: must not be empty")


def _check_fp8(t: TrainConfig, lo: LoRAConfig, p: ParallelConfig) -> None:
    """FP8 (threefold.parallel.transforms.fp8_linear) and what it does not run with."""
    _one_of("train.fp8", t.fp8, list(FP8_RECIPES))
    _need(not (t.fp8 != "none" and lo.r and p.tp > 1),
          f"train.fp8: {t.fp8} with lora.r > 0 and parallel.tp > 1 is not available (which "
          "frozen layers run backward, and so agree their amaxes over tp, is not modelled); "
          "set train.fp8 none or parallel.tp 1")
    if p.fp8_all_gather:  # set on: refused by field where the 8-bit gather does not apply
        for bad, why in ((t.fp8 != "tensorwise", f"train.fp8 {t.fp8} (it needs tensorwise: "
                          "one scale per weight)"),
                         (p.zero_stage != 3, f"parallel.zero_stage {p.zero_stage} (only ZeRO-3 "
                          "gathers weights around use)"),
                         (p.tp > 1, f"parallel.tp {p.tp} (a tp shard's amax is not modelled)"),
                         (bool(lo.r), "lora.r > 0 (frozen units gather in param_dtype)")):
            _need(not bad, f"parallel.fp8_all_gather: true does not apply with {why}; "
                  "unset it or set it false")


def _check_recompute(t: TrainConfig) -> None:
    """The recompute mode (the layouts selective recompute does not take are the rule
    book's)."""
    _one_of("train.recompute", t.recompute, list(RECOMPUTE_MODES))
    _need(not (t.activation_checkpointing and t.recompute != "none"),
          "train.activation_checkpointing: true means train.recompute full; set only "
          f"train.recompute ({t.recompute})")
    for name in t.recompute_module_names:
        _one_of("train.recompute_modules", name, list(RECOMPUTE_MODULES))


def _check_checkpoint(c: CheckpointConfig) -> None:
    """Checkpoint interval, retention, directory pattern and background saves."""
    _need(c.interval == "auto" or (isinstance(c.interval, int) and c.interval >= 0),
          f"checkpoint.interval: must be a step count >= 0 or auto, got {c.interval!r}")
    for name in ("mtbf_hours", "restart_s"):
        _need(getattr(c, name) >= 0, f"checkpoint.{name}: must be >= 0 (0 = the default), "
              f"got {getattr(c, name)}")
    _need(c.write_gbps > 0, f"checkpoint.write_gbps: must be > 0, got {c.write_gbps}")
    _need(c.keep_last >= 1, f"checkpoint.keep_last: must be >= 1, got {c.keep_last}")
    _need("{" not in c.dir.replace("{node}", "") and "}" not in c.dir.replace("{node}", ""),
          f"checkpoint.dir: '{c.dir}' has a placeholder other than {{node}}")
    _need(c.memory_interval == "auto"
          or (isinstance(c.memory_interval, int) and c.memory_interval >= 0),
          "checkpoint.memory_interval: must be a step count >= 0 (0 = off) or auto, got "
          f"{c.memory_interval!r}")
    _need("{" not in c.memory_dir.replace("{node}", "")
          and "}" not in c.memory_dir.replace("{node}", ""),
          f"checkpoint.memory_dir: '{c.memory_dir}' has a placeholder other than {{node}}")
    # the final save ends the run, so it is always waited for: only interval saves overlap
    _need(not c.async_save or c.interval == "auto" or c.interval > 0,
          "checkpoint.async_save: true writes the checkpoint.interval saves while training "
          "goes on, but checkpoint.interval is 0 (only the final save, which the run waits "
          "for anyway); set checkpoint.interval > 0 or checkpoint.async_save false")


def _check_ft(cfg: Config) -> None:
    """Replica groups (``ft.*``): torchft installed, the group inside the job, the global
    batch split evenly over the groups."""
    f = cfg.ft
    _need(f.replica_groups >= 1, f"ft.replica_groups: {f.replica_groups}; must be at least 1")
    _need(0 <= f.replica_group < f.replica_groups,
          f"ft.replica_group: {f.replica_group} is not in 0 .. {f.replica_groups - 1}; give each "
          "launcher its own group below ft.replica_groups")
    _need(1 <= f.min_replicas <= f.replica_groups,
          f"ft.min_replicas: {f.min_replicas}; must be 1 .. ft.replica_groups ({f.replica_groups})")
    _need(f.timeout_s > 0, f"ft.timeout_s: {f.timeout_s}; must be positive")
    if not f.lighthouse:
        return
    _need(importlib.util.find_spec("torchft") is not None,
          "ft.lighthouse needs torchft: pip install 'threefold[ft]'")
    _need(cfg.train.global_batch_size % f.replica_groups == 0,
          f"train.global_batch_size: {cfg.train.global_batch_size} does not split over "
          f"ft.replica_groups {f.replica_groups}; make it a multiple of it")


def _check_metrics(m: MetricsConfig) -> None:
    """The trackers asked for are installed (found, not imported: that waits for the writer
    rank)."""
    for name, on in (("tensorboard", m.tensorboard), ("wandb", m.wandb)):
        _need(not on or importlib.util.find_spec(name) is not None,
              f"metrics.{name} needs the {name} extra: pip install 'threefold[{name}]'")
    _need(bool(m.wandb_project), "metrics.wandb_project: must not be empty")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_targets(lora: LoRAConfig) -> tuple[str, ...]:
    """The layers ``lora.target_modules`` names (PEFT's names; 'all-linear' is every one)."""
    names = tuple(t.strip() for t in lora.target_modules.split(",") if t.strip())
    return LORA_TARGETS if names == ("all-linear",) else names


def _check_lora(lo: LoRAConfig) -> None:
    """The adapters' settings (the layouts and models they run with are the rule book's)."""
    if lo.r == 0:
        return
    _need(lo.r > 0, f"lora.r: must be >= 0 (0 = no LoRA), got {lo.r}")
    _need(lo.alpha > 0, f"lora.alpha: must be positive, got {lo.alpha}")
    _need(0 <= lo.dropout < 1, f"lora.dropout: {lo.dropout} must be in [0, 1)")
    names = lora_targets(lo)
    bad = [n for n in names if n not in LORA_TARGETS]
    _need(bool(names) and not bad,
          f"lora.target_modules: {', '.join(bad) or 'nothing'} is not one of "
          f"{', '.join(LORA_TARGETS)} (or 'all-linear')")

