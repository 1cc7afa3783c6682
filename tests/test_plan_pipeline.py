"""The planner's pipelines: every pp the runtime accepts is searched (layer counts that pp·vpp
does not divide included, split as the runtime splits them), and explicit --tp/--pp are
honoured or refused with the reason."""

from __future__ import annotations

import json

import pytest

from threefold.layout import Layout, Workload
from threefold.accounting import pipeline_layers
from threefold.config import ModelConfig
from threefold.schedules.balance import uniform_counts
from threefold.plan.candidates import SearchSpace
from threefold.commands.planning import load_model, main
from threefold.plan.cluster import Cluster
from threefold.hardware.catalogue import get_hardware
from threefold.plan.search import enumerate_layouts, search


def small(layers: int) -> ModelConfig:
    return ModelConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=8,
                       vocab_size=32000).resolved()


def test_pp_that_does_not_divide_the_layers_is_searched_with_the_runtime_split():
    cfg, work = small(10), Workload(seq_len=1024, global_batch=64)
    pps = {lay.pp for lay in enumerate_layouts(cfg, 8, work, SearchSpace(tp=(1,)))}
    assert {4, 8} <= pps  # neither divides 10 layers; both are what the runtime accepts
    lay = Layout(pp=4, dp_shard=2, microbatch_size=1)
    counts = pipeline_layers(cfg, lay)
    assert sum(counts) == 10 and len(counts) == 4 and len(set(counts)) > 1
    # "params": the embedding and head weigh on the end stages, which take fewer blocks
    assert counts[0] <= counts[1] and counts[-1] <= counts[-2]
    # uniform is searchable as well and is the runtime's uniform split
    uni = Layout(pp=4, dp_shard=2, microbatch_size=1, pipeline_split="uniform")
    assert pipeline_layers(cfg, uni) == uniform_counts(10, 4)


def test_llama3_405b_pp16_on_126_layers_is_evaluated():
    cfg = load_model("llama3-405b")
    cluster = Cluster(get_hardware("h100"), 1024, 8)
    work = Workload(seq_len=8192, global_batch=1024)
    r = search(cfg, cluster, work, SearchSpace(tp=(8,), pp=(16,), vpp=(1,),
                                                zero_stage=(1,), recompute=("full",)), keep=3)
    assert r.ranked, r.invalid
    best = r.ranked[0]
    assert best.layout.pp == 16 and sum(best.stage_layers) == 126
    assert best.stage_layers == pipeline_layers(cfg, best.layout)
    assert not any("does not divide the 126" in k for k in r.invalid)


def test_more_stages_than_layers_is_refused_by_name():
    cfg, work = small(6), Workload(seq_len=1024, global_batch=64)
    invalid: dict[str, int] = {}
    lays = list(enumerate_layouts(cfg, 8, work, SearchSpace(tp=(1,), pp=(8,)), invalid))
    assert not lays and any("6 layers cannot fill pp·vpp = 8·1" in k for k in invalid)
    invalid = {}
    list(enumerate_layouts(cfg, 8, work, SearchSpace(tp=(1,), pp=(4,), vpp=(2,)), invalid))
    assert any("6 layers cannot fill pp·vpp = 4·2" in k for k in invalid)


@pytest.mark.parametrize("argv, says", [
    (["--tp", "3"], "parallel.tp: 3 does not divide world size 64"),
    (["--tp", "64", "--model", "llama3-8b"],
     "model.num_attention_heads: 32 is not divisible by parallel.tp=64"),
    (["--pp", "5"], "parallel.pp: 5 does not divide world size 64"),
    (["--pp", "64", "--tp", "1", "--model", "llama3-8b"],
     "model.num_hidden_layers: 32 layers cannot fill pp·vpp = 64·1"),
])
def test_explicit_degrees_are_refused_with_the_reason(capsys, argv, says):
    args = ["--model", "llama3-70b", "--gpus", "64", "--gpu", "h100"] + argv
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1


def test_explicit_pp_is_honoured(capsys):
    rc = main(["--model", "llama3-8b", "--gpus", "48", "--gpu", "h100", "--pp", "3,6",
               "--tp", "1,2", "--json", "--top", "3"])
    out = capsys.readouterr().out
    rows = json.loads(out)
    assert rc == 0 and rows and all(r["pp"] in (3, 6) and r["tp"] in (1, 2) for r in rows)
    # 32 layers over 3 or 6 stages: uneven, and the split is reported
    assert all(sum(r["stage_layers"]) == 32 and len(r["stage_layers"]) == r["pp"] * r["vpp"]
               for r in rows)


def test_explain_breaks_each_step_into_exposed_terms_that_add_up(capsys):
    rc = main(["--model", "llama3-8b", "--gpus", "64", "--gpu", "h100", "--top", "4",
               "--explain", "--pp", "1,2,4"])
    out = capsys.readouterr().out
    rows = [line.strip() for line in out.splitlines() if line.strip().startswith("step ")]
    assert rc == 0 and len(rows) == 4
    for row in rows:
        total = float(row.split()[1])
        terms = row.split("=", 1)[1].split(" (exposed")[0].split(" + ")
        parts = [float(t.split()[-1]) if "(" not in t else float(t.split("(")[0].split()[-1])
                 for t in terms]
        assert sum(parts) == pytest.approx(total, abs=2e-3 * len(parts)), row
    assert "why not best" in out


def test_batch_size_effects_are_warned():
    cfg = load_model("llama3-8b")
    cluster = Cluster(get_hardware("h100"), 64, 8)
    work = Workload(seq_len=4096, global_batch=32)  # dp 16 at pp 4: 2 sequences per replica
    r = search(cfg, cluster, work, SearchSpace(tp=(1,), pp=(4,), zero_stage=(1,),
                                                microbatch_size=(1,), vpp=(1,)), keep=1)
    assert r.ranked
    assert any("2 microbatches for pp=4 stages" in w for w in r.ranked[0].warnings)
    one = search(cfg, cluster, Workload(seq_len=4096, global_batch=16),
                 SearchSpace(tp=(4,), pp=(1,), zero_stage=(3,)), keep=1)
    assert any("one sequence per replica" in w for w in one.ranked[0].warnings)
