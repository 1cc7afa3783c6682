"""``checkpoint.interval auto``: Daly's optimum against hand-computed figures, Llama 3's failure
rate, the dry run's line with its goodput, the field's validation, and a run that saves at the
interval it chose."""

from __future__ import annotations

import math
import re

import pytest

from tests.conftest import tiny_overrides
from threefold.commands.main import main as cli_main
from threefold.accounting import num_parameters
from threefold.commands.planning import load_model
from threefold.config import ConfigError, load_config
from threefold.launch.dryrun import dry_run, predict
from threefold.plan.checkpoint_interval import (GPU_HOURS_PER_FAILURE, HOST_COPY_GBPS,
    choose_interval, daly_interval, job_mtbf_hours, planned_intervals, rank_write_bytes,
    young_interval)
from threefold.training.train import train
from threefold.weights.checkpoint_verify import list_checkpoints


def test_llama3_rate_gives_the_jobs_mtbf():
    # 54 days · 24 h · 16,384 GPUs / 419 unexpected interruptions = 50,677.0 GPU-hours
    assert GPU_HOURS_PER_FAILURE == pytest.approx(50_677.0, abs=0.01)
    # the whole Llama 3 job: one failure every 1296 / 419 = 3.093 h
    assert job_mtbf_hours(16384) == pytest.approx(3.0931, abs=1e-4)
    assert job_mtbf_hours(8) == pytest.approx(6334.6, abs=0.1)
    assert job_mtbf_hours(16384, mtbf_hours=2.5) == 2.5  # given: for the whole job


def test_daly_optimum_against_hand_computed_figures():
    # C = 60 s, M = 3 h = 10,800 s: sqrt(2CM) = sqrt(1,296,000) = 1138.42; C/2M = 1/360;
    # [1 + sqrt(1/360)/3 + 1/3240] = 1.017877; 1138.42 · 1.017877 − 60 = 1098.77 s
    assert young_interval(60, 10_800) == pytest.approx(1138.42, abs=0.01)
    assert daly_interval(60, 10_800) == pytest.approx(1098.77, abs=0.01)
    # a cheap save: Daly's correction vanishes, Young's leading term remains
    assert daly_interval(1e-3, 1e6) == pytest.approx(young_interval(1e-3, 1e6), rel=1e-4)
    # a save as long as twice the MTBF or longer: save every M
    assert daly_interval(7200, 3600) == 3600


def test_chosen_steps_lost_work_overhead_and_goodput():
    # C = 60 s, step 10 s, M = 3 h: tau 1098.77 s -> round(109.877) = 110 steps = 1100 s;
    # R = C = 60 s (not given): lost per failure 1100/2 + 60 = 610 s; overhead 60/1100 =
    # 5.4545%; goodput 1 − 0.054545 − 610/10,800 = 0.888973
    c = choose_interval(60, 10, 3.0)
    assert (c.steps, c.interval_s, c.restart_s) == (110, 1100, 60)
    assert c.lost_s == pytest.approx(610)
    assert c.overhead == pytest.approx(0.054545, abs=1e-6)
    assert c.goodput == pytest.approx(0.888973, abs=1e-6)
    # a given restart replaces C there; a set count is costed, auto's count named beside it
    set_ = choose_interval(60, 10, 3.0, restart_s=300, steps=50)
    assert set_.goodput == pytest.approx(1 - 60 / 500 - (250 + 300) / 10_800, abs=1e-9)
    assert "50 steps" in set_.line() and "auto would choose 110" in set_.line()
    assert choose_interval(1e-6, 10, 3.0).steps == 1  # never below one step
    assert choose_interval(5e4, 10, 3.0).goodput == 0.0  # saves cost more than failures


def _tiny(*extra):
    return load_config(None, [("model.preset", "tiny"), ("data.seq_len", "64"),
                              ("train.global_batch_size", "4"), ("train.micro_batch_size", "2"),
                              *extra])


def test_dry_run_prints_the_chosen_interval_and_its_goodput(monkeypatch):
    """The dry run costs a save as rank 0's checkpoint bytes over checkpoint.write_gbps and
    divides Daly's optimum by its predicted step."""
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    cfg = _tiny(("checkpoint.interval", "auto"), ("checkpoint.mtbf_hours", "1"),
                ("checkpoint.write_gbps", "0.01"), ("parallel.zero_stage", "1"))
    r = predict(cfg, 4)
    save_s = (r.owned_per_rank * 12 + 5056) / 1e7  # fp32 weight + two moments; RNG state
    assert rank_write_bytes(r.owned_per_rank) / 1e7 == pytest.approx(save_s)
    tau = daly_interval(save_s, 3600.0)
    steps = round(tau / r.step.step_time_s)
    (chosen,) = r.intervals
    assert chosen.steps == steps > 1 and chosen.save_s == pytest.approx(save_s)
    lines: list[str] = []
    dry_run(cfg, 4, out=lines.append)
    line = next(x for x in lines[0].splitlines() if x.startswith("checkpoint interval:"))
    goodput = 1 - save_s / (steps * r.step.step_time_s) \
        - (steps * r.step.step_time_s / 2 + save_s) / 3600.0
    assert f"{steps} steps" in line and "Daly" in line and f"goodput {goodput:.2%}" in line
    # the default MTBF: Llama 3's per-GPU rate over the 4 ranks
    (default,) = planned_intervals(_tiny(("checkpoint.interval", "auto")), 4, 1000, 0.1)
    assert default.mtbf_s == pytest.approx(GPU_HOURS_PER_FAILURE / 4 * 3600)
    assert planned_intervals(_tiny(), 4, 1000, 0.1) == ()  # no interval saves: no line


@pytest.mark.parametrize("field,value,match", [
    ("checkpoint.interval", "often", r"checkpoint\.interval: must be a step count >= 0 or auto"),
    ("checkpoint.interval", "-5", r"checkpoint\.interval: .*got -5"),
    ("checkpoint.mtbf_hours", "-1", r"checkpoint\.mtbf_hours: must be >= 0"),
    ("checkpoint.write_gbps", "0", r"checkpoint\.write_gbps: must be > 0"),
])
def test_bad_values_are_refused_naming_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, [(field, value)])
    assert "\n" not in str(e.value)


def test_interval_takes_a_count_or_auto():
    assert load_config(None, [("checkpoint.interval", "25")]).checkpoint.interval == 25
    assert load_config(None, [("checkpoint.interval", "auto")]).checkpoint.interval == "auto"
    assert math.isclose(load_config(None, []).checkpoint.write_gbps, 0.122)


def test_a_run_saves_at_the_interval_it_chose(corpus, cache_dir, tmp_path, capsys):
    """One process: the count is decided after step 2 (a save predicted at an ample bandwidth:
    every step), re-decided from the first save's measured cost, and the checkpoints on disk
    are exactly the multiples of the count in force, plus the final one."""
    out, steps = tmp_path / "run", 6
    cfg = load_config(None, tiny_overrides(
        corpus, cache_dir, out, train__steps=steps, checkpoint__interval="auto",
        checkpoint__mtbf_hours="2e-5", checkpoint__write_gbps="1000", checkpoint__keep_last=99))
    train(cfg)
    said = re.findall(r"step +(\d+) checkpoint interval: (\d+) steps .*(measured|predicted)",
                      capsys.readouterr().out)
    decisions = [(int(s), int(n)) for s, n, _ in said]
    assert decisions[0] == (2, 1) and "predicted" in said[0][2]
    assert len(decisions) == 2 and decisions[1][0] == 3  # the first save, at step 3, measured
    expected = {steps}
    for s in range(1, steps + 1):
        n = [n for d, n in decisions if d < s]
        if n and s % n[-1] == 0:
            expected.add(s)
    assert list_checkpoints(out / "checkpoints") == sorted(expected)
    assert cfg.checkpoint.interval == decisions[-1][1]


def test_plan_explain_gives_each_layout_its_interval(capsys):
    """``threefold plan --explain``: one interval line per layout, from its own save (rank 0's
    owned elements at --write-gbps: under ZeRO-3 1/dp_shard of the model) and the job MTBF
    given."""
    argv = ["plan", "--model", "tiny", "--gpus", "8", "--top", "2", "--zero-stage", "3",
            "--tp", "1", "--pp", "1", "--explain", "--mtbf-hours", "0.5", "--write-gbps", "0.1"]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    # each row (tp 1, cp 1, pp 1, vpp 1, dp_r, dp_s, zero 3) and the interval line under it
    rows = re.findall(r"\n\s*\d+\s+1\s+1\s+1\s+1\s+\d+\s+(\d+)\s+3 .*?checkpoint interval: "
                      r"(\d+) steps .*? a save of ([\d.]+) ms and a job MTBF of 30 min", text,
                      re.S)
    assert len(rows) == 2
    params = num_parameters(load_model("tiny"))  # the planner's tiny (vocab 4096)
    for dp_shard, _, save_ms in rows:
        assert float(save_ms) == pytest.approx((params / int(dp_shard) * 12 + 5056) / 1e8 * 1e3,
                                               rel=0.01)


def test_memory_interval_auto_is_costed_at_a_host_copys_rate(monkeypatch):
    """``checkpoint.memory_interval auto`` gets its own optimum: the same bytes at
    HOST_COPY_GBPS instead of the storage's bandwidth, so a shorter interval."""
    cfg = _tiny(("checkpoint.interval", "auto"), ("checkpoint.write_gbps", "0.1"),
                ("checkpoint.memory_interval", "auto"))
    storage, memory = planned_intervals(cfg, 8, 10**6, 0.01)
    assert memory.field == "checkpoint.memory_interval" and "memory checkpoint" in memory.line()
    assert memory.save_s == pytest.approx(storage.save_s * 0.1 / HOST_COPY_GBPS)
    assert memory.steps == round(daly_interval(memory.save_s, storage.mtbf_s) / 0.01)
    assert memory.steps < storage.steps
    # the dry run's host-memory line is for the count auto chose
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    r = predict(cfg, 4)
    chosen = next(i for i in r.intervals if i.field == "checkpoint.memory_interval")
    assert r.memory_copy is not None and r.memory_copy.interval == chosen.steps > 0


def test_a_run_keeps_memory_checkpoints_at_the_interval_auto_chose(corpus, cache_dir, tmp_path,
                                                                  capsys):
    """``checkpoint.memory_interval auto`` with storage saves off: the count is decided after
    step 2 from a copy's predicted cost (a failure every 0.07 s: every step), and the memory
    checkpoints kept are the newest multiples of it."""
    out, mem, steps = tmp_path / "run", tmp_path / "mem", 5
    cfg = load_config(None, tiny_overrides(
        corpus, cache_dir, out, train__steps=steps, checkpoint__memory_interval="auto",
        checkpoint__memory_dir=str(mem), checkpoint__mtbf_hours="2e-5",
        checkpoint__save_final="false"))
    train(cfg)
    said = re.findall(r"step +(\d+) memory checkpoint interval: (\d+) steps",
                      capsys.readouterr().out)
    assert said == [("2", "1")] and cfg.checkpoint.memory_interval == 1
    assert cfg.checkpoint.interval == 0  # storage's count untouched
    assert list_checkpoints(mem)[-1] == steps  # steps 3.. kept in memory, the newest last
    assert not (out / "checkpoints").exists() or not list_checkpoints(out / "checkpoints")
