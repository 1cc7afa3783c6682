"""Elastic continuation (``threefold train --nnodes MIN:MAX``, threefold.launch.elastic): the
re-plan for a smaller world, in-process, and one job of two torchrun agents on 127.0.0.1 as two
nodes that loses node 1 for good (it continues alone on a re-planned layout), then gets a node
back (it grows through the preemption save) and trains to an uninterrupted run's losses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import tiny_overrides
from tests.test_launch import _args, _env, _free_port, _losses, wait_agents
from threefold.config import ConfigError, load_config
from threefold.hardware.catalogue import Hardware
from threefold.launch.elastic import (elastic_argv, elastic_env, grad_accum, replan,
                                      replan_for_world)
from threefold.layout import Layout
from threefold.plan.cluster import Cluster
from threefold.training.train import train
from threefold.weights.checkpoint_verify import list_checkpoints

# The losses after a shrink equal the uninterrupted run's to fp32 reduction order: the same
# global batch summed over other micro-batches and ranks (the equivalence tests' tolerance)
REL = 1e-5


def _cfg(corpus, cache, out, **extra):
    return load_config(None, tiny_overrides(corpus, cache, out, **extra))


def test_replan_keeps_the_global_batch(corpus, cache_dir, tmp_path):
    """4 configured ranks on 2: dp_shard follows the world, the global batch is kept with
    twice the accumulation, the line says so; the same inputs give the same layout; the full
    world keeps the configured one."""
    over = dict(parallel__dp_shard=4, parallel__zero_stage=2, train__micro_batch_size=1,
                parallel__elastic_world=4)
    cfg = _cfg(corpus, cache_dir, tmp_path, **over)
    line = replan_for_world(cfg, 2)
    lay = Layout.from_config(cfg, 2)
    assert lay.dp_shard == 2 and lay.world_size == 2
    assert lay.dp * lay.microbatch_size * grad_accum(lay, 8) == 8
    assert line.startswith("elastic: 4 -> 2 ranks: layout ")
    assert "(was dp_shard 4, zero 2, mbs 1), grad_accum 2 -> 4, predicted " in line
    again = _cfg(corpus, cache_dir, tmp_path, **over)
    assert replan_for_world(again, 2) == line and again.to_dict() == cfg.to_dict()
    full = _cfg(corpus, cache_dir, tmp_path, **over)
    assert replan_for_world(full, 4) is None
    assert full.to_dict() == _cfg(corpus, cache_dir, tmp_path, **over).to_dict()


def test_replan_on_named_hardware(corpus, cache_dir, tmp_path, monkeypatch):
    """``THREEFOLD_HARDWARE`` (as the dry run reads it) sets the figures the re-plan ranks by;
    every rank reading the same variable picks the same layout."""
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    monkeypatch.setenv("THREEFOLD_GPUS_PER_NODE", "8")
    over = dict(parallel__dp_shard=8, parallel__elastic_world=8, train__micro_batch_size=1)
    lines = []
    for _ in range(2):
        cfg = _cfg(corpus, cache_dir, tmp_path, **over)
        lines.append(replan_for_world(cfg, 4))
        assert Layout.from_config(cfg, 4).world_size == 4
    assert lines[0] == lines[1] and lines[0].startswith("elastic: 8 -> 4 ranks: layout ")
    assert lines[0].endswith("s/step (catalogue (THREEFOLD_HARDWARE))")


def test_replan_refuses_in_one_line(corpus, cache_dir, tmp_path):
    """No layout fits the per-rank memory, or none divides the batch and the model: one line
    naming the field and what to do."""
    cfg = _cfg(corpus, cache_dir, tmp_path, parallel__elastic_world=2)
    mcfg = cfg.model.resolved(vocab_size=320)
    small = Hardware.measured("tiny", peak_flops=1e10, bandwidth=1e9, latency_s=1e-4,
                              memory_bytes=1e5, precision="fp32")
    with pytest.raises(ConfigError, match=r"^parallel\.elastic_world: no layout on 1 of the 2 "
                       r"ranks .* fits in 0\.0001 GB per rank \(the smallest needs [0-9.]+ GB\);"
                       r" bring the nodes back") as e:
        replan(cfg, mcfg, 1, Cluster(small, 1, 1))
    assert "\n" not in str(e.value)
    cfg = _cfg(corpus, cache_dir, tmp_path, parallel__elastic_world=4)
    big = Hardware.measured("big", peak_flops=1e10, bandwidth=1e9, latency_s=1e-4,
                            memory_bytes=1e12, precision="fp32")
    with pytest.raises(ConfigError, match=r"divides the model and the global batch: .*"
                       r"train\.global_batch_size: 8 does not split over 3"):
        replan(cfg, mcfg, 3, Cluster(big, 3, 3))


def test_elastic_launch_arguments(corpus, cache_dir, tmp_path, monkeypatch):
    """--nnodes MIN:MAX hands the workers the full world and resume, and runs torchrun without
    the shared rendezvous store; a fixed --nnodes changes nothing."""
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    cfg = _cfg(corpus, cache_dir, tmp_path)
    elastic = ["--nnodes", "1:3", "--rdzv-endpoint", "h:1"]
    assert elastic_argv(cfg, 2, elastic, ["a"]) == [
        "a", "--parallel.elastic_world", "6", "--checkpoint.resume", "true"]
    assert elastic_env(elastic)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    for fixed in (["--nnodes", "2"], ["--nnodes", "2:2"], []):
        assert elastic_argv(cfg, 2, fixed, ["a"]) == ["a"] and elastic_env(fixed) is None


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts its workers in sessions of their own: a
    node's death is its launcher, its agent and its workers)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _kill_node(proc) -> None:
    for pid in _tree(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _wait_for(what, timeout: float, why: str, logs=()) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            tails = "\n----\n".join(p.read_text()[-3000:] for p in logs if p.exists())
            raise AssertionError(f"not within {timeout:g} s: {why}\n{tails}")
        time.sleep(0.1)


@pytest.mark.slow
def test_node_lost_then_back(corpus, cache_dir, tmp_path):
    """Node 1 dies for good after checkpoint 2: node 0's agent re-forms the group alone, the
    worker re-plans the layout for one rank (grad_accum 1 -> 2) and continues from checkpoint
    2. Node 1 then returns: node 0's agent stops its worker with SIGTERM, which finishes the
    step and saves it (the preemption save), and both nodes resume it with the configured
    layout. Every step's loss equals the uninterrupted single process's (``REL``)."""
    over = dict(train__steps=6, checkpoint__interval=2, parallel__dp_shard=2,
                parallel__zero_stage=2, train__micro_batch_size=4)
    ref = tmp_path / "ref"  # one process, the same global batch: run while the agents start
    out, port = tmp_path / "run", _free_port()
    killed, go = tmp_path / "killed", tmp_path / "go"
    env = dict(_env(), LOGLEVEL="INFO",  # torchrun's agent says when it sees a node waiting
               # both ranks wait before step 3 until node 1 is dead (whichever rank it is:
               # the rendezvous numbers the nodes); the shrunk run waits before step 4 until
               # node 0's agent has seen node 1 come back
               THREEFOLD_FAULT=f"hold:0:3:{killed},hold:1:3:{killed},hold:0:4:{go}")
    # fast membership on loopback: a dead node expires after 4 missed 1 s keep-alives, a round
    # waits 2 s for more nodes; node 1 never hosts the store (on one machine both would)
    conf = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=4"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "node1b.log"]

    def node(rank: int, log) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "threefold", "train", "--nnodes", "1:2",
               "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"elastic{port}", "--max-restarts", "3",
               "--rdzv-conf", conf + (",is_host=false" if rank else ""),
               *_args(corpus, cache_dir, out, **over)]
        return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    procs = []
    try:
        procs.append(node(1, logs[1]))  # node 1 first, so that the first round has both
        time.sleep(0.3)
        procs.insert(0, node(0, logs[0]))
        train(_cfg(corpus, cache_dir, ref, **{**over, "parallel__dp_shard": -1}))
        _wait_for(lambda: 2 in list_checkpoints(out / "checkpoints"), 120,
                  "checkpoint 2 of the two-node run", logs)
        _kill_node(procs[1])
        killed.write_text("")
        text = lambda: logs[0].read_text()  # noqa: E731
        _wait_for(lambda: "elastic: 2 -> 1 ranks" in text(), 120, "the shrunk restart", logs)
        procs.append(node(1, logs[2]))
        _wait_for(lambda: "Detected 1 new nodes" in text(), 120, "node 1's return", logs)
        go.write_text("")
        wait_agents([procs[0], procs[2]], timeout=180)
        assert [procs[0].returncode, procs[2].returncode] == [0, 0], text()[-3000:]
    finally:
        for p in procs:
            _kill_node(p)
    log = "\n".join(p.read_text() for p in logs)  # rank 0 is on either node
    assert "threefold: 0.12M parameters, 2 ranks" in log  # the first session: two nodes
    line = next(x for x in log.splitlines() if "elastic: 2 -> 1 ranks" in x)
    assert "layout dp_shard 1, zero 0, mbs 4 (was dp_shard 2, zero 2, mbs 4), grad_accum " \
           "1 -> 2, predicted " in line
    assert "single process, device cpu, dtype float32, steps 2->6" in log
    assert "step      4 preempted (SIGTERM): checkpoint 4 saved" in log
    assert "2 ranks (pp 1 × dp_replicate 1 × dp_shard 2 × tp 1 = 2 ranks, zero 2)" \
           ", device cpu, dtype float32, steps 4->6" in log
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    assert list_checkpoints(out / "checkpoints")[-3:] == [2, 4, 6]
    assert _losses(out) == pytest.approx(_losses(ref), rel=REL)
