"""The rule book: every rule that refuses a layout, each one function with its one message
(the field, the value, and the fix), written once.

One module per part of a layout (the world, experts, the sequence, the model's shape, the
pipeline, the batch, the tasks); ``book`` binds them. The launcher (before any process starts), the dry run and the trainer call them through
``threefold.layout.checks.validate_layout``; the planner through ``checks.check_layout`` (a
million layouts a search: each rule is a few comparisons, its message formatted only when it
refuses) and, for the degrees it takes from the command line, directly
(``threefold.commands.planning``); the post-training commands through ``task_layout``. A refusal is
a ``LayoutError``, a ``ConfigError``: one line, exit code 2. ``rule_of`` names the rule that
refused (the planner groups its skipped layouts by it).

Each rule takes plain numbers or the model's shape (a resolved ``ModelConfig``), never a
process group, and imports no torch.
"""

from threefold.layout.rules.batch_rules import (
    batch_over_dp,
    bf16_params_need_zero,
    micro_batch_divides,
    microbatches_agree,
)
from threefold.layout.rules.book import RULES, LayoutError, rule, rule_of
from threefold.layout.rules.expert_rules import (
    ep_divides_dp_shard,
    ep_divides_experts,
    ep_groups_map_to_nodes,
    ep_needs_experts,
    ep_nodes_tile,
    experts_balance_per_layer,
    experts_without_sequence_parallel,
)
from threefold.layout.rules.pipeline_rules import (
    block_counts_need_pp,
    interleaved_microbatches,
    mtp_tied_pipeline,
    pipeline_inflight,
    schedule_chunks,
    vpp_needs_pp,
)
from threefold.layout.rules.sequence_rules import (
    cp_attention,
    heads_over_ulysses,
    kv_heads_over_ulysses,
    mlp_tiles_plain,
    mtp_without_cp,
    cp_attention_sinks,
    selective_without_cp,
    seq_len_over_cp,
    sequence_parallel_tokens,
    ulysses_degree,
)
from threefold.layout.rules.shape_rules import (
    blockwise_tiles_over_tp,
    ffn_over_tp,
    heads_over_tp,
    recompute_modules_in_model,
    recompute_modules_of,
    k_norm_needs_split_kv,
    kv_heads_over_tp,
    layers_fill_chunks,
)
from threefold.layout.rules.task_rules import (
    generation_layout,
    lora_kv_needs_split_kv,
    lora_without_experts,
    rollout_engine_layout,
    rollout_overlap_tp,
    rollout_server_tp,
    recompute_modules_eager,
    recompute_modules_need_selective,
    selective_experts_eager,
    task_layout,
    tp_overlap_needs_sequence_parallel,
    tp_overlap_plain_projections,
)
from threefold.layout.rules.world_rules import (
    divides_world,
    fills_world,
    replica_groups_data_parallel,
)

__all__ = [
    "LayoutError",
    "RULES",
    "batch_over_dp",
    "bf16_params_need_zero",
    "block_counts_need_pp",
    "blockwise_tiles_over_tp",
    "cp_attention",
    "cp_attention_sinks",
    "divides_world",
    "ep_divides_dp_shard",
    "ep_divides_experts",
    "ep_groups_map_to_nodes",
    "ep_needs_experts",
    "ep_nodes_tile",
    "experts_balance_per_layer",
    "experts_without_sequence_parallel",
    "ffn_over_tp",
    "fills_world",
    "replica_groups_data_parallel",
    "generation_layout",
    "heads_over_tp",
    "heads_over_ulysses",
    "interleaved_microbatches",
    "k_norm_needs_split_kv",
    "kv_heads_over_tp",
    "kv_heads_over_ulysses",
    "layers_fill_chunks",
    "lora_kv_needs_split_kv",
    "lora_without_experts",
    "micro_batch_divides",
    "microbatches_agree",
    "mlp_tiles_plain",
    "mtp_tied_pipeline",
    "mtp_without_cp",
    "pipeline_inflight",
    "rule",
    "rollout_engine_layout",
    "rollout_overlap_tp",
    "rollout_server_tp",
    "recompute_modules_eager",
    "recompute_modules_in_model",
    "recompute_modules_need_selective",
    "recompute_modules_of",
    "rule_of",
    "schedule_chunks",
    "selective_experts_eager",
    "selective_without_cp",
    "seq_len_over_cp",
    "sequence_parallel_tokens",
    "task_layout",
    "tp_overlap_needs_sequence_parallel",
    "tp_overlap_plain_projections",
    "ulysses_degree",
    "vpp_needs_pp",
]
