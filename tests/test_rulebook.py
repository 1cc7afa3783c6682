"""The rule book (``threefold.layout.rules``) as one table: for every rule, a layout that breaks
it, and the one message it is refused with, by ``threefold train`` before launch (exit 2, one
line, no process started), by the dry run (``--dry-run`` and ``threefold.launch.dryrun.predict``)
and, where ``threefold plan`` can express the layout (``--tp/--cp/--pp/--ep/--recompute/--lora-r``,
``--seq-len``, ``--global-batch-tokens``, the model as a TOML file), by the planner: exit 2 with
that line, or exit 1 with its search skipping every layout under that rule. A row plan cannot
express says why. Every rule has a row (``test_every_rule_has_a_row``). In-process calls only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from threefold.commands import main as cli
from threefold.launch import launcher as launch
from threefold.layout.rules import RULES, LayoutError, rule_of


@dataclass(frozen=True)
class Row:
    rule: str
    settings: dict  # dotted config fields -> values (the model's go to plan's TOML too)
    world: int
    message: str
    plan: tuple[str, ...] | str  # plan's flags for the layout, or why plan cannot express it
    command: str = "train"


MOE = {"model.preset": "tiny-moe"}
NO_PLAN_SP = "plan runs a mixture of experts without sequence parallelism (no flag sets it)"
NO_PLAN_PIPE = "plan has no --vpp, --schedule or block counts: the search chooses them"
NO_PLAN_BATCH = "plan chooses micro-batches that divide a rank's share"
ROWS = [
    Row("divides_world", {"parallel.tp": 3}, 4,
        "parallel.tp: 3 does not divide world size 4; valid tp values: 1, 2, 4", ("--tp", "3")),
    Row("fills_world", {"parallel.tp": 2, "parallel.cp": 2, "parallel.pp": 2}, 4,
        "parallel: pp·dp_replicate·cp·tp = 2·1·2·2 = 8 does not divide world size 4; lower one "
        "of them or launch a multiple of 8 ranks", ("--tp", "2", "--cp", "2", "--pp", "2")),
    Row("ep_needs_experts", {"parallel.ep": 2}, 2,
        "parallel.ep: 2 needs a mixture of experts (model.num_local_experts > 0, e.g. "
        "--model.preset tiny-moe); set parallel.ep 1 for a dense model", ("--ep", "2")),
    Row("ep_divides_experts", {**MOE, "parallel.ep": 3}, 3,
        "parallel.ep: 3 does not divide model.num_local_experts=8; use an ep in 1",
        ("--ep", "3")),
    Row("ep_divides_dp_shard", {**MOE, "parallel.ep": 4}, 2,
        "parallel.ep: 4 does not divide parallel.dp_shard=2 (expert-parallel ranks are "
        "data-parallel ranks of one shard group); valid ep values: 1, 2",
        ("--ep", "4", "--zero-stage", "0")),
    Row("ep_nodes_tile", {**MOE, "parallel.ep": 2, "parallel.ep_dispatch": "hierarchical",
                          "parallel.gpus_per_node": 3}, 4,
        "parallel.gpus_per_node: nodes of 3 ranks do not tile the ep=2 ranks (cp·tp=1 apart) "
        "for parallel.ep_dispatch hierarchical; use ranks per node a multiple of 1 whose "
        "quotient divides 2 or is a multiple of it, or parallel.ep_dispatch flat",
        ("--ep", "2", "--ep-dispatch", "hierarchical", "--gpus-per-node", "3")),
    Row("ep_groups_map_to_nodes",
        {**MOE, "model.num_local_experts": 6, "model.moe_router": "sigmoid_grouped",
         "model.n_group": 3, "model.topk_group": 1, "parallel.ep": 2,
         "parallel.ep_dispatch": "hierarchical", "parallel.gpus_per_node": 1}, 4,
        "model.n_group: 3 routing groups do not map to the 2 nodes an ep group spans under "
        "parallel.ep_dispatch hierarchical (a node must hold whole groups, so that a token "
        "reaches at most topk_group=1 nodes); choose parallel.ep or the ranks per node so that "
        "the nodes divide 3, or parallel.ep_dispatch flat",
        ("--ep", "2", "--ep-dispatch", "hierarchical", "--gpus-per-node", "1")),
    Row("experts_without_sequence_parallel",
        {**MOE, "parallel.tp": 2, "parallel.sequence_parallel": True}, 2,
        "parallel.sequence_parallel: tp=2 with a mixture of experts (model.num_local_experts=8) "
        "runs without sequence parallelism; set parallel.sequence_parallel false", NO_PLAN_SP),
    Row("experts_balance_per_layer", {**MOE, "parallel.pp": 2}, 2,
        "model.router_aux_loss_per_layer: parallel.pp=2 with a mixture of experts needs the "
        "load-balancing loss per layer (a stage cannot pool f and P over the other stages' "
        "layers): set model.router_aux_loss_per_layer true, or model.router_aux_loss_coef 0",
        "a training-config field of the model: plan notes it under pp > 1 instead"),
    Row("seq_len_over_cp", {"parallel.cp": 2, "data.seq_len": 250}, 2,
        "data.seq_len: 250 is not divisible by 2·parallel.cp = 4 (each cp rank holds two "
        "balanced chunks of every sequence); use a multiple of 4, e.g. 252", ("--cp", "2")),
    Row("sequence_parallel_tokens",
        {"parallel.tp": 2, "parallel.sequence_parallel": True, "data.seq_len": 255}, 2,
        "data.seq_len: 255 is not divisible by parallel.tp=2, which sequence parallelism needs; "
        "use a data.seq_len that is a multiple of 2", ("--tp", "2")),
    Row("selective_without_cp", {"parallel.cp": 2, "train.recompute": "selective"}, 2,
        "train.recompute: selective is not available with parallel.cp > 1 (ring attention's "
        "per-hop results would all be kept); use full or none",
        ("--cp", "2", "--recompute", "selective")),
    Row("mlp_tiles_plain", {"train.mlp_tiles": 4, "train.recompute": "selective"}, 2,
        "train.mlp_tiles: 4 tiles a dense MLP with plain projections, not with train.recompute "
        "selective; set train.mlp_tiles 1", ("--mlp-tiles", "4", "--recompute", "selective")),
    Row("mtp_without_cp", {"model.num_nextn_predict_layers": 1, "parallel.cp": 2}, 2,
        "parallel.cp: 2 with multi-token prediction (model.num_nextn_predict_layers=1) is not "
        "built yet (a rank's slice lacks the tokens ahead); set parallel.cp 1", ("--cp", "2")),
    Row("mtp_tied_pipeline", {"model.num_nextn_predict_layers": 1,
                              "model.tie_word_embeddings": True, "parallel.pp": 2}, 2,
        "model.tie_word_embeddings: a tied head with multi-token prediction "
        "(model.num_nextn_predict_layers=1) is not built under pipeline parallelism (pp=2); "
        "untie it or set parallel.pp 1", ("--pp", "2")),
    Row("cp_attention", {"model.sliding_window": 64, "parallel.cp": 2}, 2,
        "model.sliding_window: 64: ring and all-gather context parallelism (parallel.cp=2) do "
        "not compute this attention; set parallel.cp_algorithm ulysses, or parallel.cp 1",
        ("--cp", "2", "--cp-algorithm", "ring,allgather")),
    Row("ulysses_degree", {"parallel.cp": 4, "parallel.cp_ulysses": 3}, 4,
        "parallel.cp_ulysses: 3 does not divide parallel.cp=4 (cp = ring ranks × Ulysses "
        "ranks); use one of 1, 2, 4", "plan searches the Ulysses degree itself (no flag sets "
        "it)"),
    Row("heads_over_ulysses", {"model.num_attention_heads": 12, "model.num_key_value_heads": 4,
                               "model.hidden_size": 384, "parallel.cp": 8,
                               "parallel.cp_algorithm": "ulysses"}, 8,
        "parallel.cp_ulysses: the 12 query heads do not split over tp·ulysses = 1·8 ranks "
        "(Ulysses gives each rank whole heads); choose tp·ulysses dividing them, or "
        "cp_algorithm ring", ("--tp", "1", "--cp", "8", "--cp-algorithm", "ulysses")),
    Row("kv_heads_over_ulysses", {"model.num_attention_heads": 12,
                                  "model.num_key_value_heads": 3, "model.hidden_size": 384,
                                  "parallel.cp": 4, "parallel.cp_algorithm": "ulysses"}, 4,
        "parallel.cp_ulysses: the 3 KV heads neither split over nor repeat up to tp·ulysses = "
        "4 ranks; choose tp·ulysses a divisor or a multiple of 3, or cp_algorithm ring",
        ("--tp", "1", "--cp", "4", "--cp-algorithm", "ulysses")),
    Row("cp_attention_sinks", {"model.attention_sinks": True, "parallel.cp": 2}, 2,
        "model.attention_sinks: true: context parallelism (parallel.cp=2) does not add the "
        "sinks to its softmax yet; set parallel.cp 1",
        "a model field: plan skips every cp layout of a model with sinks under this rule, "
        "among the other rules a tiny model's cp layouts meet"),
    Row("heads_over_tp", {"parallel.tp": 16}, 16,
        "model.num_attention_heads: 8 is not divisible by parallel.tp=16; this model splits "
        "over a tp in 1, 2, 4, 8 (with a world size that tp divides)", ("--tp", "16")),
    Row("kv_heads_over_tp", {"model.num_attention_heads": 12, "model.num_key_value_heads": 3,
                             "model.hidden_size": 384, "parallel.tp": 2}, 2,
        "model.num_key_value_heads: 3 neither divides nor is divisible by parallel.tp=2; this "
        "model splits over a tp in 1", ("--tp", "2")),
    Row("k_norm_needs_split_kv", {"model.qk_norm": True, "model.qk_norm_over": "projection",
                                  "model.num_key_value_heads": 2, "parallel.tp": 4}, 4,
        "model.qk_norm_over: a k norm over the whole projection needs the 2 KV heads split over "
        "parallel.tp=4, not replicated; use a tp that divides 2", ("--tp", "4")),
    Row("ffn_over_tp", {"model.intermediate_size": 690, "parallel.tp": 4}, 4,
        "model.intermediate_size: 690 is not divisible by parallel.tp=4; this model splits over "
        "a tp in 1, 2", "plan pads the SwiGLU width (as published Megatron runs do) and warns"),
    Row("blockwise_tiles_over_tp", {"train.fp8": "blockwise", "parallel.tp": 2}, 2,
        "train.fp8: blockwise with parallel.tp=2 splits model.num_key_value_heads·head_dim into "
        "64-wide shards, not multiples of 128 (a shard's 1x128 tiles would not be one "
        "process's); use parallel.tp in 1 or train.fp8 rowwise",
        ("--tp", "2", "--fp8", "blockwise")),
    Row("layers_fill_chunks", {"parallel.pp": 8}, 8,
        "model.num_hidden_layers: 4 layers cannot fill pp·vpp = 8·1 = 8 pipeline chunks; lower "
        "parallel.pp or parallel.vpp", ("--pp", "8")),
    Row("vpp_needs_pp", {"parallel.vpp": 2}, 1,
        "parallel.vpp: 2 model chunks per stage need pipeline stages; set parallel.pp > 1 or "
        "parallel.vpp 1", NO_PLAN_PIPE),
    Row("block_counts_need_pp", {"parallel.pipeline_split": "2,2"}, 1,
        "parallel.pipeline_split: block counts '2,2' need pipeline stages; set parallel.pp > 1 "
        "or leave pipeline_split params", NO_PLAN_PIPE),
    Row("schedule_chunks", {"parallel.pp": 2, "parallel.vpp": 2}, 2,
        "parallel.schedule: 1f1b runs one model chunk per rank: set parallel.vpp 1, or "
        "parallel.schedule interleaved-1f1b for vpp=2", NO_PLAN_PIPE),
    Row("interleaved_microbatches",
        {"parallel.pp": 2, "parallel.vpp": 2, "parallel.schedule": "interleaved-1f1b",
         "train.global_batch_size": 3, "train.micro_batch_size": 1}, 2,
        "parallel.schedule: interleaved-1f1b needs microbatches a multiple of parallel.pp=2 (got "
        "3: global batch / (dp · micro batch)); change train.global_batch_size or "
        "train.micro_batch_size, or use schedule 1f1b", NO_PLAN_PIPE),
    Row("pipeline_inflight", {"parallel.pp": 2, "parallel.pipeline_inflight": 3}, 2,
        "parallel.pipeline_inflight: 3 bounds interleaved-1f1b only, not 1f1b; set it to 0",
        NO_PLAN_PIPE),
    Row("batch_over_dp", {"train.global_batch_size": 3, "train.micro_batch_size": 1}, 2,
        "train.global_batch_size: 3 does not split over 2 data-parallel ranks; use a multiple "
        "of 2", ("--tp", "1", "--pp", "1", "--cp", "1")),
    Row("micro_batch_divides", {"train.global_batch_size": 12, "train.micro_batch_size": 4}, 2,
        "train.micro_batch_size: 4 does not divide the 6 sequences each rank gets; use a "
        "divisor of 6", NO_PLAN_BATCH),
    Row("microbatches_agree", {"parallel.pp": 2, "parallel.microbatches": 3,
                               "train.micro_batch_size": 1}, 2,
        "parallel.microbatches: 3, but train.micro_batch_size=1 makes 8 per step; set "
        "train.micro_batch_size to 2 or parallel.microbatches 0", NO_PLAN_BATCH),
    Row("selective_experts_eager", {**MOE, "train.recompute": "selective",
                                    "train.compile": True, "parallel.ep": 2}, 2,
        "train.compile: selective recompute of a mixture of experts under expert parallelism "
        "(parallel.ep=2) runs eagerly only (a compiled block could send its all-to-alls "
        "again); set train.compile false or train.recompute full",
        "plan has no compile flag: it plans eager and compiled runs alike"),
    Row("recompute_modules_need_selective", {"train.recompute": "full",
                                             "train.recompute_modules": "core_attn"}, 1,
        "train.recompute_modules: core_attn applies to selective recompute, not "
        "train.recompute full; set train.recompute selective or clear "
        "train.recompute_modules", ("--recompute", "full", "--recompute-modules", "core_attn")),
    Row("recompute_modules_in_model", {"train.recompute": "selective",
                                       "train.recompute_modules": "mla_up_proj,moe"}, 1,
        "train.recompute_modules: mla_up_proj,moe names no module of this model; use only "
        "core_attn,layernorm,mlp", ("--recompute-modules", "mla_up_proj,moe")),
    Row("recompute_modules_eager", {**MOE, "train.recompute": "selective",
                                    "train.recompute_modules": "moe,core_attn",
                                    "train.compile": True}, 1,
        "train.compile: train.recompute_modules moe runs eagerly only; set train.compile "
        "false or name only core_attn, layernorm, moe_act",
        "plan has no compile flag: it plans eager and compiled runs alike"),
    Row("bf16_params_need_zero", {"parallel.param_dtype": "bfloat16",
                                  "train.dtype": "bfloat16"}, 2,
        "parallel.param_dtype: bfloat16 parameters under data parallelism need ZeRO (the 16-bit "
        "copies are what ZeRO gathers); set parallel.zero_stage 1, 2 or 3, or "
        "parallel.param_dtype float32", "plan has no parameter dtype: it plans the published "
        "numerics"),
    Row("lora_without_experts", {**MOE, "lora.r": 4}, 1,
        "lora.r: LoRA does not adapt a mixture of experts (model.num_local_experts=8); use "
        "lora.r 0", ("--lora-r", "4")),
    Row("lora_kv_needs_split_kv", {"lora.r": 4, "parallel.tp": 8}, 8,
        "lora.target_modules: k_proj/v_proj stay whole when parallel.tp=8 exceeds the 4 KV "
        "heads; leave them out or lower parallel.tp", ("--tp", "8", "--lora-r", "4")),
    Row("task_layout", {"parallel.cp": 2, "parallel.pp": 2}, 4,
        "parallel.pp: DPO under context parallelism (cp=2) runs without a pipeline (got pp=2); "
        "use parallel.pp 1, or parallel.cp 1", "plan plans pre-training layouts, not DPO's",
        command="dpo"),
    Row("task_layout", {"parallel.pp": 2}, 2,
        "parallel.pp: reward training does not run under pipeline parallelism yet (got pp=2); "
        "use parallel.pp 1 and shard over dp_shard (ZeRO) or tp instead",
        "plan plans pre-training layouts, not a reward model's", command="reward"),
    Row("tp_overlap_needs_sequence_parallel", {"parallel.tp_overlap": 4}, 1,
        "parallel.tp_overlap: 4 chunks overlap sequence parallelism's all-gathers and "
        "reduce-scatters, which parallel.tp=1 with sequence_parallel=false does not have; set "
        "parallel.tp > 1 and parallel.sequence_parallel true, or parallel.tp_overlap 0",
        "plan overlaps only what sequence parallelism has: a layout without it is not "
        "overlapped, never refused"),
    Row("tp_overlap_plain_projections", {"parallel.tp": 2, "parallel.sequence_parallel": True,
                                         "parallel.tp_overlap": 4, "lora.r": 4}, 2,
        "parallel.tp_overlap: 4 cannot overlap the projections of LoRA adapters (lora.r > 0); "
        "set parallel.tp_overlap 0", "plan has no overlapped LoRA: it plans the adapters "
        "unoverlapped"),
    Row("replica_groups_data_parallel", {"ft.replica_groups": 2, "parallel.tp": 2}, 2,
        "parallel.tp: 2 with ft.replica_groups 2; a replica group trains by data parallelism "
        "or ZeRO (stages 1-3) alone, the cross-group sum and heal are not checked with tp: "
        "set parallel.tp 1", "plan plans one job, not replica groups that heal (ft.*)"),
    Row("generation_layout", {"parallel.pp": 2}, 2,
        "parallel.pp: GRPO does not run with pp=2 (generation runs the whole model on each "
        "rank); use parallel.pp 1", "plan plans pre-training layouts, not GRPO's generation",
        command="grpo"),
    Row("generation_layout", {"parallel.tp": 2, "parallel.sequence_parallel": True}, 2,
        "parallel.sequence_parallel: GRPO's generation decodes one token a step, which cannot "
        "be split over tp ranks; set it false",
        "plan plans pre-training layouts, not GRPO's generation", command="grpo"),
    Row("rollout_engine_layout", {"parallel.zero_stage": 3, "lora.r": 4,
                                  "grpo.rollout_engine": "vllm"}, 2,
        "parallel.zero_stage: grpo.rollout_engine vllm with LoRA merges each layer's adapters "
        "into its weight, which ZeRO-3 keeps in other units; use parallel.zero_stage 2 or "
        "grpo.rollout_engine builtin",
        "plan plans pre-training layouts, not GRPO's rollout engine", command="grpo"),
    Row("rollout_overlap_tp", {"parallel.tp": 2, "grpo.rollout_engine": "vllm",
                               "grpo.max_staleness": 1}, 2,
        "grpo.max_staleness: 1 with a colocated vLLM engine at parallel.tp=2 would overlap the "
        "engine's tp collectives with training's; use grpo.max_staleness 0, grpo.vllm_mode "
        "server, or parallel.tp 1",
        "plan plans pre-training layouts, not GRPO's rollout engine", command="grpo"),
    Row("rollout_server_tp", {"model.hidden_size": 96, "model.num_attention_heads": 3,
                              "model.num_key_value_heads": 3, "grpo.rollout_engine": "vllm",
                              "grpo.vllm_mode": "server", "grpo.vllm_server_tp": 2}, 1,
        "grpo.vllm_server_tp: 2 must divide model.num_attention_heads=3 and divide or be a "
        "multiple of model.num_key_value_heads=3 (the server's vLLM shards the heads); valid "
        "values: 1, 3",
        "plan plans pre-training layouts, not GRPO's rollout server", command="grpo"),
]
IDS = [f"{r.rule}-{r.command}" for r in ROWS]


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _argv(row: Row, out) -> list[str]:
    argv = ["--nproc-per-node", str(row.world), "--train.output_dir", str(out)]
    if row.command != "train":
        argv += ["--checkpoint.init_from", ""]
    for key, value in row.settings.items():
        argv += [f"--{key}", _text(value)]
    return argv


def _run(row: Row, argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """The command in this process; a refusal must come before dispatch (no launch)."""
    from threefold.commands import posttrain as post_cli

    def no_launch(*_a, **_k):
        raise AssertionError(f"{row.rule}: the layout reached dispatch")

    monkeypatch.setattr(cli, "dispatch", no_launch)
    monkeypatch.setattr(post_cli, "dispatch", no_launch)
    monkeypatch.setattr(launch, "launch", no_launch)
    main = {"train": cli.cmd_train, "dpo": post_cli.dpo_main,
            "reward": post_cli.reward_main, "grpo": post_cli.grpo_main}[row.command]
    rc = main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_train_and_the_dry_run_refuse_with_the_rule_message(row, capsys, monkeypatch, tmp_path):
    for extra in ([], ["--dry-run"]):
        rc, err = _run(row, _argv(row, tmp_path) + extra, capsys, monkeypatch)
        assert (rc, err) == (2, f"threefold: error: {row.message}\n"), extra
    if row.command != "train":
        return  # the task's own refusal: the dry run of the task refused it above
    from threefold.config import load_config
    from threefold.launch.dryrun import predict

    cfg = load_config(None, [(k, _text(v)) for k, v in row.settings.items()]
                      + [("train.output_dir", str(tmp_path))])
    with pytest.raises(LayoutError) as e:
        predict(cfg, row.world)
    assert str(e.value) == row.message and rule_of(e.value) == row.rule


def _plan_model(row: Row, tmp_path) -> str:
    """The row's model as a TOML file ``threefold plan --model`` reads (its [model] table)."""
    lines = ["[model]"] + [
        f"{k.split('.', 1)[1]} = " + (_text(v) if isinstance(v, (bool, int)) else f'"{v}"')
        for k, v in row.settings.items() if k.startswith("model.")]
    path = tmp_path / "model.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("row", [r for r in ROWS if not isinstance(r.plan, str)],
                         ids=[i for i, r in zip(IDS, ROWS) if not isinstance(r.plan, str)])
def test_plan_refuses_what_it_can_express_with_the_rule_message(row, capsys, tmp_path):
    from threefold.commands.planning import main

    seq = row.settings.get("data.seq_len", 256)
    batch = row.settings.get("train.global_batch_size", 8)
    rc = main(["--model", _plan_model(row, tmp_path), "--gpus", str(row.world),
               "--gpus-per-node", str(row.world), "--seq-len", str(seq),
               "--global-batch-tokens", str(seq * batch), "--top", "1", *row.plan])
    out = capsys.readouterr()
    if rc == 2:  # a degree refused as given
        assert out.err == f"threefold plan: error: {row.message}\n"
    else:  # searched: no layout fits, most of them skipped under the rule (its first line)
        assert rc == 1 and re.fullmatch(r"threefold plan: no layout fits; \d+ skipped: "
                                        + re.escape(row.message) + "\n", out.err), out.err


def test_every_rule_has_a_row_and_every_row_a_rule():
    assert {r.rule for r in ROWS} == set(RULES)
    for r in ROWS:
        assert isinstance(r.plan, tuple) or len(r.plan) > 20, f"{r.rule}: say why plan cannot"
