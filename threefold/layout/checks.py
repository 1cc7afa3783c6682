"""The rule book's callers' one order: ``check_layout`` (a ``Layout`` against the model and
the batch: what the planner asks of every layout it searches) and ``validate_layout`` (a
training config on a world size: what the launcher asks before any process starts, the dry
run and the trainer; ``check_layout`` and the rules only a run's config can break). The rules
themselves, and their messages, are ``threefold.layout.rules``'s.
"""

from __future__ import annotations

from threefold.config import Config, ModelConfig, param_dtype
from threefold.layout import rules
from threefold.layout.description import Layout, Workload
from threefold.schedules.balance import split_counts
from threefold.schedules import check_schedule


def check_layout(cfg: ModelConfig, layout: Layout, work: Workload) -> None:
    """Raise LayoutError naming the first rule ``layout`` breaks for this model and batch.
    Selective recompute is threefold's: a Megatron block (``work.block``) keeps its own. The
    planner calls this for every layout it searches, so each group of rules is called only
    where one of them could refuse (tp, cp, ep, experts, a pipeline above 1)."""
    lay, e = layout, cfg.num_local_experts or 0
    if lay.recompute_modules:
        rules.recompute_modules_need_selective(lay.recompute, lay.recompute_modules)
        rules.recompute_modules_in_model(cfg, lay.recompute_modules)
    if lay.recompute == "selective" and work.block != "megatron":
        rules.selective_without_cp(lay.recompute, lay.cp)
    if lay.cp > 1:
        rules.ulysses_degree(lay.cp, lay.cp_algorithm, lay.cp_ulysses)
        rules.seq_len_over_cp(work.seq_len, lay.cp, lay.cp_algorithm)
        rules.heads_over_ulysses(cfg, lay.tp, lay.ulysses)
        rules.kv_heads_over_ulysses(cfg, lay.tp, lay.ulysses)
    if lay.tp > 1:
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        rules.heads_over_tp(heads, kv, cfg.intermediate_size, lay.tp)
        rules.kv_heads_over_tp(heads, kv, cfg.intermediate_size, lay.tp)
    if e or lay.ep != 1:
        rules.ep_needs_experts(lay.ep, e)
        rules.ep_divides_experts(lay.ep, e, lay.dp_shard)
        rules.ep_nodes_tile(lay.ep, lay.ep_dispatch, lay.gpus_per_node, lay.cp * lay.tp)
        rules.ep_groups_map_to_nodes(cfg, lay.ep_inter)
        rules.ep_divides_dp_shard(lay.ep, lay.dp_shard)
        rules.experts_without_sequence_parallel(e, lay.tp, lay.sequence_parallel)
    if lay.tp > 1:
        rules.k_norm_needs_split_kv(cfg, lay.tp)
        rules.blockwise_tiles_over_tp(cfg, lay.tp, work.fp8)
    if lay.cp > 1:
        rules.cp_attention(cfg, lay.cp, lay.cp_ring)
        rules.mtp_without_cp(cfg.num_nextn_predict_layers, lay.cp)
        rules.cp_attention_sinks(cfg, lay.cp)
    if work.lora_r:
        rules.lora_without_experts(work.lora_r, e)
        rules.lora_kv_needs_split_kv(work.lora_targets, cfg.num_key_value_heads, lay.tp)
    if work.mlp_tiles > 1:
        rules.mlp_tiles_plain(work.mlp_tiles, lay.recompute, lay.tp_overlap, e)
    rules.vpp_needs_pp(lay.pp, lay.vpp)
    if lay.pp > 1:
        rules.mtp_tied_pipeline(cfg.num_nextn_predict_layers, bool(cfg.tie_word_embeddings),
                                lay.pp)
    rules.layers_fill_chunks(cfg.num_hidden_layers, lay.pp, lay.vpp)
    m, rem = divmod(work.global_batch, lay.dp * lay.microbatch_size)
    if rem or not m:
        rules.batch_over_dp(work.global_batch, lay.dp)
        rules.micro_batch_divides(work.global_batch, lay.dp, lay.microbatch_size)
    if lay.pp > 1:  # no pipeline: the schedule is not used (as the runtime ignores it)
        schedule = lay.pipeline_schedule
        rules.schedule_chunks(schedule, lay.pp, lay.vpp)
        rules.interleaved_microbatches(schedule, lay.pp, m)
        rules.pipeline_inflight(schedule, lay.pp, lay.vpp, lay.pipeline_inflight)


def validate_layout(cfg: Config, world_size: int, mcfg: ModelConfig | None = None) -> Layout:
    """Every rule a run's layout must meet, for the launcher (before any process starts), the
    dry run and the trainer; returns the Layout. ``mcfg`` is the model's shape (the
    checkpoint's, when the weights bring it; else the preset's). Raises LayoutError naming
    the field and a value that works."""
    m = mcfg if mcfg is not None else cfg.model.resolved(vocab_size=1)
    p = cfg.parallel
    layout = Layout.from_config(cfg, world_size)
    rules.experts_balance_per_layer(m, layout.pp)
    rules.sequence_parallel_tokens(cfg.data.seq_len, layout.cp, layout.tp,
                                   p.sequence_parallel)
    rules.bf16_params_need_zero(param_dtype(cfg), p.zero_stage, layout.dp * layout.cp)
    rules.selective_experts_eager(cfg.train.recompute, m.num_local_experts or 0, layout.ep,
                                  cfg.train.compile)
    rules.recompute_modules_eager(layout.recompute_modules, cfg.train.compile)
    rules.block_counts_need_pp(layout.pp, p.pipeline_split)
    rules.tp_overlap_needs_sequence_parallel(p.tp_overlap, layout.tp, p.sequence_parallel)
    rules.tp_overlap_plain_projections(p.tp_overlap, cfg.lora.r, m, layout.tp)
    rules.replica_groups_data_parallel(cfg.ft.replica_groups, layout.tp, layout.pp, layout.cp,
                                       layout.ep)
    check_layout(m, layout, Workload.from_config(cfg))
    rules.ffn_over_tp(m, layout.tp)  # the planner pads these widths instead
    if layout.pp > 1:
        _check_pipeline(cfg, layout, m)
    return layout


def _check_pipeline(cfg: Config, layout: Layout, m: ModelConfig) -> None:
    """The block counts fit the model's layers, ``parallel.microbatches`` agrees with the
    batch, and the schedule is complete and free of deadlock for its microbatches."""
    p = cfg.parallel
    split_counts(p.pipeline_split, [0.0] * m.num_hidden_layers, layout.pp * p.vpp)
    local = cfg.train.global_batch_size // layout.dp
    rules.microbatches_agree(p.microbatches, cfg.train.micro_batch_size, local)
    try:
        check_schedule(p.schedule, layout.pp, pipeline_microbatches(cfg, layout.dp), p.vpp,
                       p.pipeline_inflight)
    except rules.LayoutError:
        raise
    except ValueError as e:
        raise rules.LayoutError(f"parallel.schedule: {e}") from None


def pipeline_microbatches(cfg: Config, dp: int) -> int:
    """Pipeline microbatches per step: a rank's sequences / train.micro_batch_size."""
    local = cfg.train.global_batch_size // dp
    return local // min(cfg.train.micro_batch_size, local)


def task_layout(task: str, cfg: Config, rollout_engine: str = "builtin", server_tp: int = 1,
                mcfg: ModelConfig | None = None, mode: str = "colocate",
                staleness: int = 0) -> None:
    """The layouts a post-training task does not run under (``rules.task_layout``; GRPO's
    generation, and its rollout engine's: ``server_tp``, a rollout server's tensor
    parallelism, for the model ``mcfg``, the checkpoint's where the weights bring it; the
    engine's ``mode`` and ``staleness``, GRPO's options)."""
    p = cfg.parallel
    rules.task_layout(task, p.pp, p.cp)
    if task == "grpo":  # generation with the training model
        rules.generation_layout(p.pp, p.cp, p.ep, p.tp, p.sequence_parallel)
        rules.rollout_engine_layout(rollout_engine, p.zero_stage, cfg.lora.r)
        rules.rollout_overlap_tp(rollout_engine, mode, staleness, p.tp)
        if server_tp > 1:
            m = mcfg if mcfg is not None else cfg.model.resolved(vocab_size=1)
            rules.rollout_server_tp(server_tp, m.num_attention_heads, m.num_key_value_heads)
