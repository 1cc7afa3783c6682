"""`threefold plan`: the search, its ranking and explanations, and the command line."""

from __future__ import annotations

import json
import re
import time

import pytest

from threefold.layout import Layout, Workload
from threefold.accounting import comm_bytes_per_step, num_parameters
from threefold.accounting import flops_per_token, matmul_parameters
from threefold.accounting.counts import moe_key
from threefold.accounting.stages import attn_key, shape_key
from threefold.config import ModelConfig
from threefold.plan.candidates import SearchSpace
from threefold.commands.planning import load_model, main
from threefold.plan.cluster import Cluster
from threefold.hardware.catalogue import get_hardware
from threefold.plan.report import explain
from threefold.plan.search import JSON_KEYS, search


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def llama70b_on_64():
    cfg = load_model("llama3-70b")
    cluster = Cluster(get_hardware("h100"), 64, 8)
    work = Workload(seq_len=4096, global_batch=1024)
    return cfg, cluster, work, search(cfg, cluster, work, keep=20)


def test_best_layout_keeps_tp_inside_a_node(llama70b_on_64):
    cfg, cluster, work, result = llama70b_on_64
    best = result.ranked[0]
    assert best.layout.tp <= cluster.gpus_per_node
    assert "tp" not in best.step.inter_node_axes
    assert not any("tp crosses nodes" in w for w in best.warnings)
    # layouts whose tp group spans nodes exist in the search and are flagged
    wide = search(cfg, cluster, work, SearchSpace(tp=(16,), zero_stage=(1, 2, 3)), keep=1)
    assert wide.ranked and "tp crosses nodes" in " ".join(wide.ranked[0].warnings)
    assert wide.ranked[0].step.step_time_s > best.step.step_time_s


def test_layouts_that_do_not_fit_are_excluded_with_a_reason(llama70b_on_64):
    cfg, cluster, work, result = llama70b_on_64
    assert result.too_big, "a 70B model must not fit every layout on 80 GB"
    limit = cluster.hardware.memory_bytes
    for lay, total, why in result.too_big:
        assert total > limit and "GB >" in why and "states" in why
    assert all(c.memory.total <= limit for c in result.ranked)
    # no sharding and no model parallelism: 70B x 16 bytes is excluded, with its reason
    assert any(lay.tp == lay.pp == 1 and lay.zero_stage == 0 and "states 1128" in why
               for lay, _, why in result.too_big)


def test_ranking_is_best_first_and_pruning_keeps_the_top(llama70b_on_64):
    cfg, cluster, work, result = llama70b_on_64
    times = [c.step.step_time_s for c in result.ranked]
    assert times == sorted(times) and len(times) == 20
    small = load_model("llama3-8b")
    cl, wk = Cluster(get_hardware("a100"), 16, 8), Workload(2048, 256)
    full = search(small, cl, wk)
    pruned = search(small, cl, wk, keep=5)
    assert full.fits == pruned.fits == len(full.ranked)
    assert [c.layout for c in pruned.ranked] == [c.layout for c in full.ranked[:5]]
    # split-backward schedules, whose bubble is replayed only for the layouts pruning reaches
    space = SearchSpace(pp=(2, 4, 8), schedules=("zb-h1", "zb-v", "1f1b"))
    full, pruned = search(small, cl, wk, space), search(small, cl, wk, space, keep=5)
    assert [c.layout for c in pruned.ranked] == [c.layout for c in full.ranked[:5]]
    assert [c.step for c in pruned.ranked] == [c.step for c in full.ranked[:5]]


def test_shape_key_is_the_model_and_attention_keys():
    """The search's written-out key agrees with moe_key and attn_key, the
    multi-token-prediction modules last."""
    for cfg in (load_model("llama3-8b"), load_model("mixtral-8x7b"),
                ModelConfig(preset="tiny", vocab_size=512, qkv_bias=True, qk_norm=True,
                            attention_head_dim=24, num_local_experts=4, num_experts_per_tok=2,
                            shared_expert_intermediate_size=64).resolved()):
        key = shape_key(cfg)
        assert key[-3:] == (moe_key(cfg), attn_key(cfg), cfg.num_nextn_predict_layers)


def test_explain_names_the_bigger_term(llama70b_on_64):
    _, _, _, result = llama70b_on_64
    best = result.ranked[0]
    assert explain(best, best).startswith("best")
    worst = result.ranked[-1]
    text = explain(best, worst)
    assert "slower" in text
    assert any(term in text for term in ("compute", "bubble", "tp comm", "pp comm", "dp comm"))


def test_json_keys_exactly_and_best_first(capsys):
    rc, out, err = run(capsys, "--model", "llama3-70b", "--gpus", "64", "--json", "--top", "4")
    assert rc == 0, err
    rows = json.loads(out)
    assert len(rows) == 4
    for row in rows:
        assert tuple(row) == JSON_KEYS
        assert row["tp"] * row["pp"] * row["dp_replicate"] * row["dp_shard"] == 64
        assert 0 < row["mfu"] < 1 and row["memory_bytes_per_gpu"] <= 80e9
        assert isinstance(row["warnings"], list)
    steps = [r["step_time_s"] for r in rows]
    assert steps == sorted(steps)


def test_table_and_explain_text(capsys):
    rc, out, _ = run(capsys, "--model", "llama3-8b", "--gpus", "16", "--top", "3", "--explain")
    assert rc == 0
    assert "tok/s/GPU" in out and "MFU" in out and "why not best" in out
    assert "do not fit" in out or "skipped" in out


def test_precision_and_overrides_change_the_prediction(capsys):
    base = json.loads(run(capsys, "--model", "llama3-8b", "--gpus", "8", "--json")[1])[0]
    fast = json.loads(run(capsys, "--model", "llama3-8b", "--gpus", "8", "--json",
                          "--peak-tflops", "1978")[1])[0]
    assert fast["step_time_s"] < base["step_time_s"]
    fp32 = json.loads(run(capsys, "--model", "llama3-8b", "--gpus", "8", "--json",
                          "--precision", "fp32", "--memory-gb", "141")[1])
    assert fp32 and fp32[0]["step_time_s"] > 5 * base["step_time_s"]  # 67 vs 989 TF/s


def test_model_from_toml_file(tmp_path, capsys):
    path = tmp_path / "m.toml"
    path.write_text('[model]\npreset = "llama3-8b"\nnum_hidden_layers = 16\n')
    cfg = load_model(str(path))
    assert isinstance(cfg, ModelConfig) and cfg.num_hidden_layers == 16
    rc, out, _ = run(capsys, "--model", str(path), "--gpus", "8", "--json", "--top", "1")
    assert rc == 0 and json.loads(out)


@pytest.mark.parametrize("argv", [
    ["--model", "llama9"], ["--gpu", "tpu-v9"], ["--gpus", "0"], ["--seq-len", "1000000"],
    ["--global-batch-tokens", "1000"], ["--precision", "fp8"], ["--recompute", "some"],
    ["--tp", "two"], ["--peak-tflops", "-1"],
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv):
    rc, out, err = run(capsys, "--model", "llama3-8b", *argv) if argv[0] != "--model" else \
        run(capsys, *argv)
    assert rc == 2
    assert err.strip().count("\n") == 0 and err.startswith("threefold plan: error:")


def test_nothing_fits_exits_1_and_says_why(capsys):
    rc, out, err = run(capsys, "--model", "llama3-70b", "--gpus", "8", "--memory-gb", "8")
    assert rc == 1
    assert "no layout fits" in err and "GB" in err


def test_thousand_gpu_search_is_fast(capsys):
    start = time.process_time()
    rc, out, _ = run(capsys, "--model", "llama3-70b", "--gpus", "1024", "--json", "--top", "3")
    elapsed = time.process_time() - start
    assert rc == 0 and len(json.loads(out)) == 3
    assert elapsed < 8, f"search took {elapsed:.1f} s of CPU"


# --------------------------------------------------------------------------------------------
# Calibration: a measured machine in place of a catalogue GPU
# --------------------------------------------------------------------------------------------
def _calibration(fp32_1=20e9, fp32_2=36e9, bw=1e9, lat=3e-4):
    return {"name": "cpu-test", "cores": 2, "threads": 2,
            "matmul_flops": {"fp32": {"1": fp32_1, "2": fp32_2}, "bf16": {"1": 1e9, "2": 2e9}},
            "memory_bandwidth": 8e9, "memory_bytes": 16e9,
            "allreduce": {"ranks": 2, "latency_s": lat, "bandwidth": bw, "times": {}}}


def test_alpha_beta_fit_recovers_a_link():
    from threefold.plan.calibrate import fit_alpha_beta

    for world, lat, bw in ((2, 3e-4, 1e9), (4, 8e-4, 4e8)):
        steps, frac = 2 * (world - 1), 2 * (world - 1) / world
        times = {s: steps * lat + frac * s / bw for s in (4, 65536, 1 << 20, 16 << 20)}
        got_lat, got_bw = fit_alpha_beta(times, world)
        assert got_lat == pytest.approx(lat, rel=1e-4) and got_bw == pytest.approx(bw, rel=1e-4)


def test_hardware_from_calibration_shares_the_machine():
    from threefold.plan.calibrate import hardware_from_calibration

    one = hardware_from_calibration(_calibration(), 1)
    two = hardware_from_calibration(_calibration(), 2)
    assert one.peak_flops("fp32") == 36e9 and two.peak_flops("fp32") == 20e9  # threads/rank
    assert two.peak_flops("bf16") == 1e9 and two.matmul_efficiency == 1.0
    assert two.memory_bytes == 8e9 and two.memory_bw == 4e9
    assert two.link(False) == two.link(True) == (3e-4, 1e9)
    # a rate measured with 2 processes multiplying at once is what each of 2 ranks gets
    busy = dict(_calibration(), matmul_flops_concurrent={"fp32": {"2": 12e9}})
    assert hardware_from_calibration(busy, 2).peak_flops("fp32") == 12e9
    assert hardware_from_calibration(busy, 1).peak_flops("fp32") == 36e9


def test_plan_uses_a_hardware_file(tmp_path, capsys):
    path = tmp_path / "cal.json"
    argv = ["--model", "tiny", "--gpus", "2", "--gpus-per-node", "2", "--precision", "fp32",
            "--seq-len", "256", "--global-batch-tokens", "4096", "--json", "--top", "1"]
    path.write_text(json.dumps(_calibration()))
    rc, out, err = run(capsys, *argv, "--hardware-file", str(path))
    assert rc == 0, err
    slow = json.loads(out)[0]
    path.write_text(json.dumps(_calibration(fp32_1=80e9, fp32_2=144e9)))
    fast = json.loads(run(capsys, *argv, "--hardware-file", str(path))[1])[0]
    assert fast["step_time_s"] < 0.5 * slow["step_time_s"]
    assert 0 < slow["mfu"] <= 1  # a measured peak is an achieved rate
    path.write_text("{}")
    rc, _, err = run(capsys, *argv, "--hardware-file", str(path))
    assert rc == 2 and "calibration" in err
    rc, _, err = run(capsys, "--calibrate", "--calibrate-ranks", "1")
    assert rc == 2 and "calibrate-ranks" in err


def test_calibration_measures_this_machine():
    """The measurements themselves, small: matmul rate, copy bandwidth, and all-reduces
    between two local processes (spawned, joined through this process's store)."""
    from threefold.plan.calibrate import allreduce_times, matmul_flops, memory_bandwidth

    assert matmul_flops("fp32", 1, seconds=0.05) > 1e8
    assert memory_bandwidth(8 << 20, repeats=2) > 1e8
    times = allreduce_times(2, sizes=(4, 1 << 20), repeats=2, timeout_s=120)
    assert set(times) == {4, 1 << 20} and all(t > 0 for t in times.values())


# --------------------------------------------------------------------------------------------
# Context parallelism
# --------------------------------------------------------------------------------------------
def test_long_context_plan_picks_cp_and_says_why(capsys):
    """llama3-70b at 131072 tokens on 64 H100s: the best layout splits each sequence over cp
    ranks, the table shows it, and a note says why (the best layout without cp, and how much
    slower it is, or that none fits)."""
    rc, out, err = run(capsys, "--model", "llama3-70b", "--seq-len", "131072", "--gpus", "64",
                       "--top", "3")
    assert rc == 0, err
    best = out.splitlines()[4]  # the first row under the header
    assert best.split()[0] == "1" and best.split()[2] not in ("1",), best
    assert "tp/cp/pp" in out
    note = [line for line in out.splitlines() if line.startswith("note: cp=")]
    assert note and "at seq_len 131072" in note[0]
    assert "with cp = 1" in note[0] and ("slower" in note[0] or "fits" in note[0])
    rows = json.loads(run(capsys, "--model", "llama3-70b", "--seq-len", "131072", "--gpus",
                          "64", "--json", "--top", "2")[1])
    for row in rows:
        assert tuple(row) == JSON_KEYS and row["cp"] > 1
        assert row["tp"] * row["pp"] * row["dp_replicate"] * row["dp_shard"] * row["cp"] == 64
        assert 131072 % (2 * row["cp"]) == 0 and row["memory_bytes_per_gpu"] <= 80e9


def test_cp_is_searched_only_for_long_sequences_or_when_nothing_fits():
    """Below CP_MIN_SEQ_LEN the search keeps cp = 1 (the 1024-GPU search stays fast) unless
    nothing fits without cp; an explicit SearchSpace.cp is always searched."""
    from threefold.plan.search import CP_MIN_SEQ_LEN

    cfg = load_model("llama3-8b")
    cluster = Cluster(get_hardware("h100"), 16, 8)
    short = search(cfg, cluster, Workload(seq_len=4096, global_batch=64), keep=5)
    assert short.ranked and all(c.layout.cp == 1 for c in short.ranked) and not short.notes
    asked = search(cfg, cluster, Workload(seq_len=4096, global_batch=64),
                   SearchSpace(cp=(2,), cp_algorithm=("allgather",)), keep=3)
    assert asked.ranked and all(c.layout.cp == 2 and c.layout.cp_algorithm == "allgather"
                                for c in asked.ranked)
    assert 16384 < CP_MIN_SEQ_LEN
    # 16K tokens of an 8B model on 8 GPUs of 25 GB, no tp or pp: nothing fits without cp
    # (40 GB did before the chunked head loss, when the fp32 logits of 16K tokens over a
    # 128K vocabulary, 8 GiB, and the loss's copies of them were whole)
    tight = Cluster(get_hardware("h100").with_overrides(memory_bytes=25e9), 8, 8)
    work = Workload(seq_len=16384, global_batch=8)
    none = search(cfg, tight, work, SearchSpace(cp=(1,), tp=(1,), pp=(1,)), keep=3)
    assert not none.fits
    fallback = search(cfg, tight, work, SearchSpace(tp=(1,), pp=(1,)), keep=3)
    assert fallback.fits and fallback.ranked[0].layout.cp > 1
    assert "no layout without context parallelism fits" in fallback.notes[0]
    assert any("no layout with cp = 1 fits" in n for n in fallback.notes)


@pytest.mark.parametrize("argv,field", [  # degrees by the rule book: the field they set
    (["--cp", "3"], "parallel.cp"), (["--cp", "0"], "parallel.cp"),
    (["--cp-algorithm", "tree"], "--cp-algorithm")])
def test_bad_cp_input_names_the_option(capsys, argv, field):
    rc, _, err = run(capsys, "--model", "llama3-8b", "--gpus", "8", *argv)
    assert rc == 2 and err.startswith(f"threefold plan: error: {field}:")


def test_table_memory_parts_add_up_to_the_peak_and_are_never_negative():
    """The table's 'mem GB (states+act+other)' splits the peak at the moment it happens, so
    its three parts are non-negative and sum to it, whichever moment (the last backward's
    start, or the optimiser step) is the peak."""
    from threefold.layout import Workload
    from threefold.commands.planning import load_model
    from threefold.plan.cluster import Cluster
    from threefold.hardware.catalogue import get_hardware
    from threefold.plan.report import peak_parts
    from threefold.plan.search import search
    from threefold.plan.candidates import SearchSpace

    cluster = Cluster(get_hardware("h100"), 8, 8)
    ranked = search(load_model("llama3-8b"), cluster, Workload(seq_len=1024, global_batch=8),
                    SearchSpace(), keep=1000).ranked
    moments = set()
    for c in ranked:
        m = c.memory
        parts = peak_parts(m)
        assert min(parts) >= 0, (c.layout, parts)
        assert sum(parts) == pytest.approx(m.total)
        moments.add(m.activation_peak >= m.grads + m.optimizer_working)
    assert moments == {True, False}  # both moments occur among these layouts


# --------------------------------------------------------------------------------------------
# LoRA: only the adapters train
# --------------------------------------------------------------------------------------------
def test_lora_plan_counts_adapters_and_a_frozen_base(capsys):
    """--lora-r: the model states are the frozen base's weights and the adapters' training
    state, the FLOPs 4N + 6·adapters per token (no weight gradients for the base), plain data
    parallelism all-reduces the adapters' gradients only; pp and cp stay 1."""
    from threefold.accounting.lora_counts import adapter_parameters, lora_flops_per_token
    from threefold.plan.compute import model_flops_per_step
    from threefold.plan.memory import memory_per_rank

    args = ["--model", "llama3-8b", "--gpus", "8", "--json", "--top", "200"]
    rc, out, _ = run(capsys, *args, "--lora-r", "16")
    rows = json.loads(out)
    assert rc == 0 and rows
    full = json.loads(run(capsys, *args)[1])
    assert rows[0]["step_time_s"] < 0.8 * full[0]["step_time_s"]  # no weight gradients
    cfg = load_model("llama3-8b")
    work = Workload(4096, 256, lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                                       "gate_proj", "up_proj", "down_proj"))
    n_adapters = adapter_parameters(cfg, work)
    assert n_adapters == 16 * 32 * (2 * 4096 + 2 * (4096 + 1024) + 2 * 4096
                                    + 3 * (4096 + 14336))  # r·(in + out) per layer
    assert model_flops_per_step(cfg, work) == pytest.approx(
        (flops_per_token(cfg, 4096) - 2 * matmul_parameters(cfg) + 6 * n_adapters) * work.tokens)
    lay = Layout(dp_shard=8, microbatch_size=1)
    mem, plain = memory_per_rank(cfg, lay, work), memory_per_rank(cfg, lay, Workload(4096, 256))
    assert mem.params == num_parameters(cfg) * 2 + n_adapters * 2  # bf16 base and adapters
    assert mem.optimizer == n_adapters * 12 and plain.optimizer == num_parameters(cfg) * 12
    sent = comm_bytes_per_step(cfg, lay, work)
    assert {a for a, v in sent.items() if v} == {"dp"} and sent["dp"] == pytest.approx(2 * 7 / 8 * 2 * n_adapters)
    assert lora_flops_per_token(cfg, work) < flops_per_token(cfg, 4096)


@pytest.mark.parametrize("argv,needle", [
    (["--ep", "2"], "parallel.ep"), (["--lora-targets", "lm_head"],
                                                        "--lora-targets"),
    (["--offload-optimizer", "on"], "--offload-optimizer"), (["--lora-r", "-1"], "--lora-r")])
def test_lora_plan_refuses_what_lora_does_not_run_with(capsys, argv, needle):
    rc, _, err = run(capsys, "--model", "llama3-8b", "--gpus", "8", "--lora-r", "8", *argv)
    assert rc == 2 and needle in err
    rc, _, err = run(capsys, "--model", "mixtral-8x7b", "--gpus", "8", "--lora-r", "8")
    assert rc == 2 and "mixture of experts" in err


# --------------------------------------------------------------------------------------------
# The table: each header stands over its own column
# --------------------------------------------------------------------------------------------
_SPACED = {"mem GB (states+act+other)": "mem_GB_(states+act+other)", "step s": "step_s",
           "GB sent per step: ": "GB_sent_per_step:_", " (ep: uniform routing)": ""}


def _fields(line: str) -> list[tuple[int, int, str]]:
    """(start, end, text) of each whitespace-separated field; a field with spaces inside (a
    header's name, a memory figure's parts) is kept whole."""
    for spaced, joined in _SPACED.items():
        line = line.replace(spaced, joined)
    line = re.sub(r" \(([\d.+]+)\)", r"_(\1)", line)  # "74.0 (17.6+50.7+5.7)"
    return [(m.start(), m.end(), m.group()) for m in re.finditer(r"\S+", line)]


@pytest.mark.parametrize("model,gpus", [("llama3-8b", 16), ("mixtral-8x7b", 16)])
def test_table_headers_stand_over_their_columns(model, gpus):
    """Every row of `threefold plan`'s table has one value under each header name, overlapping
    it, and the headers that name several values (memory parts, bytes sent per axis) name as
    many as the row gives, in the row's order."""
    from threefold.plan.report import SENT_AXES, format_table, sent_per_axis

    cluster = Cluster(get_hardware("h100"), gpus, 8)
    ranked = search(load_model(model), cluster, Workload(seq_len=4096, global_batch=64),
                    keep=4).ranked[:4]
    lines = format_table(ranked).splitlines()
    head = _fields(lines[0])
    rows = [line for line in lines[1:] if re.match(r"\s*\d+ ", line)]
    assert len(rows) == len(ranked)
    for c, row in zip(ranked, rows):
        values = _fields(row)
        assert len(values) == len(head), (lines[0], row)
        for (hs, he, name), (vs, ve, value) in zip(head, values):
            assert hs < ve and vs < he, f"'{value}' is not under '{name}'"
        names = head[-1][2].split(":_")[1]
        sent = values[-1][2].split("/")
        assert len(re.split(r"[/|]", names)) == len(sent)
        expected = sent_per_axis(c.step.comm_bytes)
        assert sent == [f"{expected[a] / 1e9:.1f}" for a in names.split("/")]
        assert set(names.split("/")) <= set(SENT_AXES)
        mem = re.findall(r"[\d.]+", values[head.index(next(h for h in head
                                                             if h[2].startswith("mem")))][2])
        total, *parts = map(float, mem)  # the peak, then states + act + other
        assert len(parts) == 3 and sum(parts) == pytest.approx(total, abs=0.16)
    assert ("ep" in head[-1][2].split(":_")[1].split("/")) == any(c.layout.ep > 1 for c in ranked)
