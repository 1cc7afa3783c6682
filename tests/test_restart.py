"""Failures: a SIGKILLed rank under `--max-restarts` is restarted and the run resumes from the
last checkpoint to the same weights as an uninterrupted run; a stalled rank is named by the
others' report within the collective timeout; a dead rank without restarts ends the run with
an error naming it, not a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import tiny_overrides
from threefold.weights.checkpoint import load_checkpoint


def _cmd(corpus, cache, out, *extra, steps=6):
    args = [a for k, v in tiny_overrides(corpus, cache, out, train__steps=steps,
                                         checkpoint__interval=2) for a in (f"--{k}", v)]
    return [sys.executable, "-m", "threefold", "train", "--nproc-per-node", "2", *args, *extra]


def _run(cmd, fault=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("THREEFOLD_FAULT", None)
    if fault:
        env["THREEFOLD_FAULT"] = fault
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return p, time.perf_counter() - t0


def _assert_same_run(out, uninterrupted) -> None:
    """``out`` logged steps 1..6 with the uninterrupted run's losses and ended with its
    weights."""
    a = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in a] == list(range(1, 7))
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6)
    wa, _ = load_checkpoint(out / "checkpoints" / "6")
    wb, _ = load_checkpoint(uninterrupted / "checkpoints" / "6")
    for k, v in wb["model"].items():
        torch.testing.assert_close(wa["model"][k], v, rtol=1e-6, atol=1e-7, msg=k)


@pytest.fixture(scope="module")
def uninterrupted(corpus, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("restart") / "clean"
    p, _ = _run(_cmd(corpus, cache_dir, out, "--parallel.zero_stage", "2"))
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kill_step", [3, 6])  # mid-interval, and the last step
def test_killed_rank_is_restarted_and_resumes(kill_step, uninterrupted, corpus, cache_dir,
                                               tmp_path):
    out = tmp_path / "killed"
    p, _ = _run(_cmd(corpus, cache_dir, out, "--parallel.zero_stage", "2", "--max-restarts",
                     "1"), fault=f"kill:1:{kill_step}")
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["restarts"] == 1
    last_ckpt = ((kill_step - 1) // 2) * 2
    assert 0 <= s["lost_steps"] <= kill_step - 1 - last_ckpt
    _assert_same_run(out, uninterrupted)


@pytest.mark.slow
def test_stalled_rank_is_named_within_timeout(corpus, cache_dir, tmp_path):
    p, wall = _run(_cmd(corpus, cache_dir, tmp_path / "stall", "--parallel.step_timeout_s", "4"),
                   fault="stall:1:3:120", timeout=200)
    assert p.returncode != 0
    assert wall < 100  # the 4 s timeout fired, not the 120 s stall
    text = p.stdout + p.stderr
    assert "did not report (dead or stuck): rank 1 (last reached step 3)" in text, text[-3000:]
    assert "last collectives on rank 0" in text


@pytest.mark.slow
def test_dead_rank_without_restarts_fails_naming_it(corpus, cache_dir, tmp_path):
    p, wall = _run(_cmd(corpus, cache_dir, tmp_path / "dead"), fault="kill:1:3", timeout=200)
    assert p.returncode != 0 and wall < 100
    text = p.stdout + p.stderr
    assert "rank 1" in text or "rank: 1" in text, text[-3000:]


def _verified_steps(out):
    from threefold.weights.checkpoint_verify import list_checkpoints, verify_checkpoint

    steps = list_checkpoints(out / "checkpoints")
    for s in steps:
        verify_checkpoint(out / "checkpoints" / str(s))
    assert not list((out / "checkpoints").glob(".tmp-*"))  # nothing half-written left
    return steps


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_every_rank_with_a_checkpoint(uninterrupted, corpus,
                                                                 cache_dir, tmp_path):
    """A preemption notice to rank 1 before step 3: both ranks finish step 3, save checkpoint 3
    (off the interval of 2) and exit 0; resuming continues to the uninterrupted run's losses
    and weights."""
    out = tmp_path / "term"
    p, _ = _run(_cmd(corpus, cache_dir, out, "--parallel.zero_stage", "2"), fault="term:1:3")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SIGTERM received" in p.stderr and "preempted (SIGTERM)" in p.stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["preempted"] == {"step": 3}
    assert _verified_steps(out) == [2, 3]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3]
    p, _ = _run(_cmd(corpus, cache_dir, out, "--parallel.zero_stage", "2",
                     "--checkpoint.resume", "true"))
    assert p.returncode == 0, p.stderr[-3000:]
    _assert_same_run(out, uninterrupted)


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_exits_0_within_the_grace(corpus, cache_dir,
                                                                    tmp_path):
    """SIGTERM to `threefold train --nproc-per-node 2` (as a scheduler sends it): torchrun
    forwards it, every rank saves after the same step, the command exits 0 within the grace
    period; a grace too short for the save ends the ranks with 143 and leaves only complete
    checkpoints."""
    import signal

    out = tmp_path / "launcher"
    cmd = _cmd(corpus, cache_dir, out, "--train.preemption_grace_s", "30", steps=500)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("THREEFOLD_FAULT", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics_file = out / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be signalled"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert time.monotonic() - t0 < 30
    s = json.loads((out / "summary.json").read_text())
    stopped = s["preempted"]["step"]
    assert 3 <= stopped < 500
    assert stopped in _verified_steps(out)
    assert "preempted (SIGTERM)" in stdout


_PREEMPT_SCRIPT = """
import os, signal, sys, time
from threefold.training.preempt import Preemption
p = Preemption(30.0)
for _ in range(3):  # three healthy steps of ~0.05 s: the stuck limit is ~5.15 s
    p.step_started(); time.sleep(0.05); p.step_finished()
p.step_started()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(float(sys.argv[1]))  # the step in progress: stuck (60 s) or ordinary (0.1 s)
p.step_finished()
p.close()
print("closed", flush=True)
"""


@pytest.mark.parametrize("step_s,rc", [(60.0, 143), (0.1, 0)], ids=["stuck", "healthy"])
def test_sigterm_in_a_stuck_step_exits_before_the_grace(step_s, rc):
    """A rank whose step is still running 3 × its slowest step + 5 s after SIGTERM (waiting on
    a dead or hung peer while torchrun tears the group down) exits 143 then, not after the
    whole grace period (30 s here); a step that finishes in time goes on to the checkpoint."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _PREEMPT_SCRIPT, str(step_s)],
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == rc, p.stderr
    if rc:
        assert "a peer is dead or stuck" in p.stderr and "closed" not in p.stdout
        assert 5.0 < took < 20.0
    else:
        assert "closed" in p.stdout and "stuck" not in p.stderr
