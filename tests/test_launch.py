"""Launching: `threefold train --nproc-per-node N` starts torchrun; impossible layouts are
refused before any process starts. Two agents as two nodes: tests/test_slurm.py (and
tests/test_checkpoint_nodes.py), with these helpers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import tiny_overrides
from threefold.config import load_config
from threefold.training.train import train


def _args(corpus, cache, out, **extra) -> list[str]:
    return [a for k, v in tiny_overrides(corpus, cache, out, **extra) for a in (f"--{k}", v)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    return env


def _losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_nproc_per_node_starts_torchrun(corpus, cache_dir, tmp_path):
    ref = tmp_path / "ref"
    train(load_config(None, tiny_overrides(corpus, cache_dir, ref, train__steps=3)))
    out = tmp_path / "zero2"
    cmd = [sys.executable, "-m", "threefold", "train", "--nproc-per-node", "2",
           *_args(corpus, cache_dir, out, train__steps=3, parallel__zero_stage=2)]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2
    assert s["comm_bytes_per_step"]["dp_shard"] > 0
    assert _losses(out) == pytest.approx(_losses(ref), rel=1e-5)


# A rank of a finished run, then the threads it still has (as /proc names them).
_THREADS_AFTER_A_RUN = """
import os, sys
from threefold.config import load_config, parse_overrides
from threefold.parallel.distributed_world import Distributed
from threefold.training.train import train

cfg = load_config(None, parse_overrides(sys.argv[1:]))
train(cfg, Distributed(cfg))
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
# one write (shorter than a pipe's atomic size): the two ranks' lines never interleave
sys.stdout.write(f"threads after the run: {sorted(names)}\\n")
sys.stdout.flush()
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc/self/task")
def test_no_process_group_thread_outlives_a_finished_run(corpus, cache_dir, tmp_path):
    """After a run ends, every gloo group is destroyed and its threads ("pt_gloo_runloop",
    "gloo_tcp_loop") joined, before interpreter exit, where such a thread aborted finished
    runs now and then ("terminate called without an active exception";
    threefold.comm.distributed.shutdown). Deterministic, where the abort is a race."""
    script = tmp_path / "threads_after_a_run.py"
    script.write_text(_THREADS_AFTER_A_RUN)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(script), *_args(corpus, cache_dir, tmp_path / "out", train__steps=2,
                                    parallel__zero_stage=2)]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    reports = p.stdout.split("threads after the run:")[1:]
    assert len(reports) == 2 and not any("gloo" in x for x in reports), p.stdout


def wait_agents(procs, timeout: float = 240.0) -> list[str]:
    """The outputs of agents started in sessions of their own; a hang is a failure with both
    agents' output (their sessions killed: the agent and its worker)."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        tails = [(p.communicate()[0] or "")[-3000:] for p in procs]
        raise AssertionError("two agents hung:\n" + "\n----\n".join(tails)) from None


@pytest.mark.parametrize("extra,needle", [
    (["--nproc-per-node", "3", "--parallel.dp_replicate", "2"], "parallel."),
    (["--nproc-per-node", "4", "--train.global_batch_size", "6",
      "--train.micro_batch_size", "2"], "train.global_batch_size"),
    (["--nproc-per-node", "2", "--train.micro_batch_size", "4", "--train.global_batch_size",
      "12"], "train.micro_batch_size"),
    (["--nproc-per-node", "2", "--parallel.pp", "2", "--train.micro_batch_size", "2",
      "--parallel.pipeline_split", "1,2"], "parallel.pipeline_split"),  # 2 layers, not 3
])
def test_impossible_layout_refused_before_launch(corpus, cache_dir, tmp_path, extra, needle):
    out = tmp_path / "never"
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "threefold", "train",
                        *_args(corpus, cache_dir, out), *extra],
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert not out.exists()
    assert "torch.distributed.run" not in p.stderr and time.perf_counter() - t0 < 60
