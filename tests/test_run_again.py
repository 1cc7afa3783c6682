"""Running a command again is safe: a finished run stays finished (no step, nothing written,
exit 0), raising train.steps continues it, and summary.json covers the run's whole life and is
never replaced by a worse one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import metrics, tiny_overrides
from threefold.commands.main import main
from threefold.config import load_config
from threefold.training.runlog import write_summary
from threefold.training.steps import lr_at

ROOT = Path(__file__).resolve().parents[1]


def _args(corpus, cache, **extra) -> list[str]:
    """The tiny run's overrides as command-line flags, output left at runs/default."""
    pairs = [(k, v) for k, v in tiny_overrides(corpus, cache, Path("unused"), **extra)
             if k != "train.output_dir"]
    return [a for k, v in pairs for a in (f"--{k}", v)]


def _files(out: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``out``: (size, modification time in ns), to see that nothing moved."""
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(out.rglob("*")) if p.is_file()}


def test_readme_command_twice_then_raised_steps(corpus, cache_dir, tmp_path, monkeypatch,
                                                capsys):
    """The README's `threefold train --checkpoint.resume true` (a few steps) run twice as a
    user would: the second run exits 0, says the run is finished and writes nothing, so
    summary.json is byte-identical. Raising --train.steps then continues the run on the
    longer schedule, and its summary covers steps 1-5 in two sessions."""
    monkeypatch.chdir(tmp_path)
    readme = ["train", "--checkpoint.resume", "true"]
    assert main([*readme, *_args(corpus, cache_dir, train__steps=3)]) == 0
    out = tmp_path / "runs" / "default"
    done = capsys.readouterr().out.strip().splitlines()[-1]
    assert done.startswith("done: loss ") and " tok/s, MFU " in done, done
    summary, before = (out / "summary.json").read_bytes(), _files(out)
    # the second time as the user runs it: its own process, whose exit code we see
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    again = subprocess.run([sys.executable, "-m", "threefold", *readme,
                            *_args(corpus, cache_dir, train__steps=3)],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Traceback" not in again.stderr
    assert again.stdout.strip().splitlines()[-1] == (
        "threefold: run already finished at step 3; raise --train.steps above 3 to continue")
    assert (out / "summary.json").read_bytes() == summary
    assert _files(out) == before  # nothing written, not even config.json or metrics.jsonl

    # a session killed after its last checkpoint but before summary.json: the next run
    # rebuilds the summary from metrics.jsonl, and the one after that writes nothing
    (out / "summary.json").unlink()
    assert main([*readme, *_args(corpus, cache_dir, train__steps=3)]) == 0
    assert "summary.json rebuilt from metrics.jsonl" in capsys.readouterr().out
    rebuilt, recs = json.loads((out / "summary.json").read_text()), metrics(out)
    assert rebuilt["rebuilt_from"] == "metrics.jsonl" and rebuilt["throughput_steps"] == 2
    assert rebuilt["final_loss"] == recs[-1]["loss"]
    assert rebuilt["validation_loss"] == recs[-1]["validation_loss"]
    assert rebuilt["tokens_per_second"] == pytest.approx(
        sum(r["tokens_per_second"] for r in recs[1:]) / 2)
    kept = (out / "summary.json").read_bytes()
    assert main([*readme, *_args(corpus, cache_dir, train__steps=3)]) == 0
    assert (out / "summary.json").read_bytes() == kept
    (out / "summary.json").write_bytes(summary)  # the first session's, for what follows

    # raising the steps continues it: the schedule is the 5-step one from step 4 on
    first_summary = json.loads(summary)
    assert main([*readme, *_args(corpus, cache_dir, train__steps=5)]) == 0
    log = capsys.readouterr().out
    assert "train.steps 3 -> 5: the learning-rate schedule now spans 5 steps" in log
    recs = metrics(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    cfg5 = load_config(None, tiny_overrides(corpus, cache_dir, out, train__steps=5))
    assert [r["lr"] for r in recs[3:]] == [lr_at(3, cfg5), lr_at(4, cfg5)]
    s = json.loads((out / "summary.json").read_text())
    assert [(x["from_step"], x["to_step"]) for x in s["sessions"]] == [(0, 3), (3, 5)]
    assert s["sessions"][0]["wall_time_s"] == first_summary["wall_time_s"]
    assert s["wall_time_s"] == pytest.approx(sum(x["wall_time_s"] for x in s["sessions"]))
    # the whole life's means: every step but each session's first (steps 1 and 4) is timed
    timed = [r["tokens_per_second"] for r in recs if r["step"] not in (1, 4)]
    assert s["throughput_steps"] == 3
    assert s["tokens_per_second"] == pytest.approx(sum(timed) / 3)
    assert 0 < s["mfu"] < 1
    assert s["initial_validation_loss"] == first_summary["initial_validation_loss"]
    assert s["validation_loss"] == recs[-1]["validation_loss"]
    assert log.strip().splitlines()[-1].endswith("(steps 1-5, 2 sessions)")


@pytest.mark.parametrize("cmd", ["sft", "dpo", "reward", "grpo"])
def test_post_training_run_again_is_finished(cmd, corpus, cache_dir, tmp_path, monkeypatch,
                                             capsys):
    """sft, dpo, reward and grpo, run again with --checkpoint.resume true after they have
    finished: exit 0, the same one line, no file touched."""
    monkeypatch.chdir(tmp_path)
    args = [cmd, "--checkpoint.init_from", "", "--checkpoint.resume", "true",
            *_args(corpus, cache_dir, train__steps=1, train__global_batch_size=4,
                   train__micro_batch_size=4, data__seq_len=48)]
    if cmd == "grpo":
        args += ["--grpo.num_generations", "2", "--grpo.max_completion_length", "4"]
    assert main(args) == 0
    out = tmp_path / "runs" / cmd
    before = _files(out)
    assert "summary.json" in before
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "threefold: run already finished at step 1; raise --train.steps above 1 to continue")
    assert _files(out) == before


def test_summary_is_written_atomically_and_never_replaced_by_a_worse_one(tmp_path):
    """summary.json goes through a temporary file and a rename; a session that did no step
    leaves a summary with figures as it is, and writes one where there was none."""
    path = tmp_path / "summary.json"
    good = {"final_loss": 4.8, "tokens_per_second": 4726.0, "mfu": 0.65}
    assert write_summary(path, good, did_steps=True)
    text = path.read_text()
    empty = {"final_loss": float("nan"), "tokens_per_second": None, "mfu": None}
    assert not write_summary(path, empty, did_steps=False)
    assert path.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temp file left
    assert write_summary(tmp_path / "fresh.json", empty, did_steps=False)
    assert write_summary(path, {**good, "final_loss": 4.7}, did_steps=True)
    assert json.loads(path.read_text())["final_loss"] == 4.7


def test_a_resumed_summary_accounts_for_every_earlier_step(tmp_path):
    """The earlier sessions as the resumed summary counts them: a session that ran past the
    checkpoint resumed from (its later steps were lost) keeps its steps up to it with an
    unknown wall time, steps no summary accounts for (a crash) become a session of their own,
    and the throughput sums leave out each session's first step."""
    from threefold.training.runlog import read_prior

    recs = [{"step": k, "tokens_per_second": 100.0 * k, "mfu": 0.01 * k} for k in range(1, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "summary.json").write_text(json.dumps({
        "initial_validation_loss": 8.4, "sessions": [
            {"from_step": 0, "to_step": 4, "wall_time_s": 10.0},
            {"from_step": 4, "to_step": 6, "wall_time_s": 5.0}]}))
    # resumed at 8: steps 7-8 ran in a session that left no summary
    p = read_prior(tmp_path, 8)
    assert p.sessions == [{"from_step": 0, "to_step": 4, "wall_time_s": 10.0},
                          {"from_step": 4, "to_step": 6, "wall_time_s": 5.0},
                          {"from_step": 6, "to_step": 8, "wall_time_s": None}]
    timed = [k for k in range(1, 9) if k not in (1, 5, 7)]
    assert p.steps == len(timed) and p.tps_sum == pytest.approx(100.0 * sum(timed))
    assert p.mfu_sum == pytest.approx(0.01 * sum(timed))
    assert p.initial_validation_loss == 8.4
    # resumed at 5, inside the second session: its time past step 5 is not this life's
    p = read_prior(tmp_path, 5)
    assert p.sessions == [{"from_step": 0, "to_step": 4, "wall_time_s": 10.0},
                          {"from_step": 4, "to_step": 5, "wall_time_s": None}]
    # no summary at all (the first session crashed), one record's MFU unknown
    (tmp_path / "summary.json").unlink()
    recs[2]["mfu"] = None
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:4]))
    p = read_prior(tmp_path, 4)
    assert p.sessions == [{"from_step": 0, "to_step": 4, "wall_time_s": None}]
    assert p.steps == 3 and p.mfu_sum is None and p.initial_validation_loss is None
