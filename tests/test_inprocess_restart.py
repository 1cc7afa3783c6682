"""Restart without restarting the survivors: two replica groups, each its own torchrun agent
(one process, ``--max-restarts 1``) on 127.0.0.1, and a torchft Lighthouse. Group 1's process
is killed; torchrun restarts it alone, it heals from group 0's memory and rejoins, while group
0's process trains on through the failure on its half of the batch. The survivor's losses are
those of one process replaying exactly the batches the quorum trained on; the healed
weights are the survivor's, bitwise, at the step of the rejoin. Then the same with ZeRO-3
inside each group: shards summed and healed rank to rank."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from tests.conftest import metrics, tiny_overrides
from tests.test_launch import _args, _env
from threefold.accounting import replica_gradient_bytes, ring_all_reduce_bytes
from threefold.config import ConfigError, load_config
from threefold.launch.replica_note import replica_note
from threefold.layout import Layout
from threefold.parallel.ft_replicas import QuorumRows
from threefold.training.steps import train_step
from threefold.training.train import build_run

STEPS, KILL_AT = 36, 4


@pytest.mark.parametrize("fields,message", [
    ({"ft.replica_group": 2, "ft.replica_groups": 2},
     "ft.replica_group: 2 is not in 0 .. 1; give each launcher its own group below "
     "ft.replica_groups"),
    ({"ft.min_replicas": 3, "ft.replica_groups": 2},
     "ft.min_replicas: 3; must be 1 .. ft.replica_groups (2)"),
])
def test_replica_group_fields_are_checked(fields, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [(k, str(v)) for k, v in fields.items()])
    assert str(e.value) == message


@pytest.mark.parametrize("numel,n", [(10, 3), (7, 2), (1, 4), (12, 4)])
def test_replica_ring_bytes_sum_to_the_ring_total(numel, n):
    # every participant sends all chunks but its own twice: 2·(N−1)·nbytes over the ring
    assert sum(ring_all_reduce_bytes(numel, 4, n, i) for i in range(n)) == 2 * (n - 1) * numel * 4
    assert ring_all_reduce_bytes(numel, 4, 1, 0) == 0


def _lighthouse():
    """A Lighthouse on a free port; (process, address)."""
    p = subprocess.Popen([sys.executable, "-m", "threefold.parallel.ft_replicas", "--port", "0"],
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, start_new_session=True)
    line = p.stdout.readline()
    assert "Lighthouse at" in line, line
    return p, line.split()[-1]


def _group(corpus, cache, out, address, group, env_extra):
    cmd = [sys.executable, "-m", "threefold", "train", "--nproc-per-node", "1",
           "--max-restarts", "1",
           *_args(corpus, cache, out, train__steps=STEPS, checkpoint__save_final="false",
                  ft__lighthouse=address, ft__replica_group=group, ft__replica_groups=2)]
    return subprocess.Popen(cmd, env={**_env(), **env_extra}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
def test_survivors_keep_their_processes(corpus, cache_dir, tmp_path):
    pytest.importorskip("torchft")
    # the replay's run, built first: it prepares the data both groups then read
    run = build_run(load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "ref",
                                                     train__steps=STEPS)))
    lighthouse, address = _lighthouse()
    procs = []
    try:
        # the survivor slowed from the kill on, so that it is still training when the
        # restarted group has started again
        stalls = ",".join(f"stall:0:{s}:0.25" for s in range(KILL_AT, STEPS + 1))
        procs = [_group(corpus, cache_dir, tmp_path / "g0", address, 0,
                        {"THREEFOLD_FAULT": stalls}),
                 _group(corpus, cache_dir, tmp_path / "g1", address, 1,
                        {"THREEFOLD_FAULT": f"kill:0:{KILL_AT}"})]
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in [*procs, lighthouse]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(o[-3000:] for o in outs)
    recs = [{r["step"]: r for r in metrics(tmp_path / g)} for g in ("g0", "g1")]
    # which groups trained each step: both from the start, group 0 alone from the kill to
    # the rejoin, both at the end
    groups = {s - 1: {g for g in (0, 1) if s in recs[g]} for s in range(1, STEPS + 1)}
    assert [groups[s] for s in range(KILL_AT)] == [{0, 1}] * (KILL_AT - 1) + [{0}]
    assert groups[STEPS - 1] == {0, 1}
    for s, gs in groups.items():
        assert all(recs[g][s + 1]["ft_participants"] == len(gs) for g in gs)
    assert len({r["pid"] for r in recs[0].values()}) == 1  # the survivor never restarted
    pids = [{r["pid"] for s, r in recs[1].items() if (s < KILL_AT) == early} for early in (1, 0)]
    assert len(pids[0]) == len(pids[1]) == 1 and pids[0] != pids[1]  # group 1 restarted alone
    rejoin = min(s for s in recs[1] if s >= KILL_AT)
    assert "ft_healed_from_step" in recs[1][rejoin]
    assert recs[1][rejoin]["ft_weights_sha256"] == recs[0][rejoin]["ft_weights_sha256"]

    # one process, replaying the batches the quorum trained on
    run.sampler = QuorumRows(run.sampler, groups)
    losses = [train_step(run, s)[0] for s in range(STEPS)]
    # fp32 reduction order (two halves summed across groups vs one process's rows) drifts
    # with the steps trained (1.03e-5 seen by step 24 here); a wrong batch moves it far more
    for g in (0, 1):
        assert [r["loss"] for r in recs[g].values()] == \
            pytest.approx([losses[s - 1] for s in recs[g]], rel=5e-5)
    # the gradients' bytes across groups: the closed form on each step's quorum (group 0
    # first in it); a group that trained alone sent none
    numels = [p.numel() for _, p in run.engine.named_params]
    for g in (0, 1):
        for r in recs[g].values():
            n = r["ft_participants"]
            assert r["comm_bytes"]["replica"] == replica_gradient_bytes(
                numels, 4, n, g if n == 2 else 0)
    # the dry run's note states the same bytes for a full quorum, and the state a heal serves
    note = replica_note(load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "dry",
                                                         ft__replica_groups=2)), run.model_cfg)
    full = recs[0][STEPS]["comm_bytes"]["replica"]
    heals = [r["comm_bytes"]["replica_heal"] for r in recs[0].values()
             if r["comm_bytes"]["replica_heal"]]
    assert f"quorum: {full:,} bytes" in note and heals and f"serves {heals[0]:,} bytes" in note
    summary = json.loads((tmp_path / "g0" / "summary.json").read_text())
    assert summary["comm_bytes_per_step"]["replica"] == pytest.approx(
        sum(r["comm_bytes"]["replica"] for r in recs[0].values()) / len(recs[0]))



HSDP = dict(train__micro_batch_size=2, parallel__zero_stage=3, checkpoint__save_final="false")
LEAVE, HSDP_STEPS = 3, 6  # group 1 leaves after step LEAVE and comes back fresh


def _zero3_group(rank, world, corpus, cache, out, address, group, steps):
    """One rank of a replica group of two ZeRO-3 ranks (a ``run_distributed`` body: the group
    as torchrun would start it). Trains, then returns its log's records (rank 0), the pieces
    of weights and moments it holds and the sizes it sums across groups."""
    from pathlib import Path

    from threefold.config import load_config as load
    from threefold.parallel.distributed_world import Distributed
    from threefold.parallel.engines.rank_state import rank_numels
    from threefold.parallel.ft_replicas import ReplicaWorld
    from threefold.training.train import train

    out = Path(out)
    # validation every LEAVE steps: the leaving group's last step validates with the others
    cfg = load(None, tiny_overrides(corpus, cache, out, **HSDP, train__steps=steps,
                                    train__eval_interval=LEAVE, ft__lighthouse=address,
                                    ft__replica_group=group, ft__replica_groups=2))
    _, run = train(cfg, ReplicaWorld(Distributed(cfg), cfg), return_run=True)
    inner = run.engine._inner
    pieces = [(q.name, q.kind, q.data.clone(), q.start, q.end) for q in inner.local_pieces()]
    return (metrics(out) if rank == 0 else None), pieces, rank_numels(inner)


def _launch_groups(tmp_path, corpus, cache_dir, address) -> dict:
    """Group 0 for HSDP_STEPS steps; group 1 for LEAVE steps, then started again fresh for
    HSDP_STEPS: it heals (group 0 waits for it: the Lighthouse's quorum needs both). Returns
    the ranks' results by output folder (an exception where a launch failed)."""
    from tests.dist import run_distributed

    got: dict = {}

    def launch(name, group, steps):
        try:
            got[name] = run_distributed(_zero3_group, 2, str(corpus), str(cache_dir),
                                        str(tmp_path / name), address, group, steps,
                                        timeout=240)
        except BaseException as e:  # reported in the test's thread
            got[name] = e

    threads = [threading.Thread(target=launch, args=("g0", 0, HSDP_STEPS)),
               threading.Thread(target=lambda: (launch("g1", 1, LEAVE),
                                                launch("g1b", 1, HSDP_STEPS)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


@pytest.mark.slow
def test_zero3_groups_heal_and_train_as_one_process(corpus, cache_dir, tmp_path, monkeypatch):
    """HSDP with an elastic replicate axis: 2 replica groups × 2 ZeRO-3 ranks. Group 1 leaves
    after step LEAVE and comes back as a fresh group, which heals rank by rank from group 0's
    shards. Every step's losses, and the final weights and AdamW moments of both groups, are
    one process's at the same global batch; each rank sums only its own shards across the
    groups, and serves only them to heal."""
    pytest.importorskip("torchft")
    run = build_run(load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "ref",
                                                     **HSDP, train__steps=HSDP_STEPS)))
    from torchft.coordination import LighthouseServer

    monkeypatch.setenv("RUST_LOG", "warn")
    # in this process (no interpreter to start); a quorum of both groups or none: group 0
    # waits for group 1's return, so that the heal is certain whatever the machine's load
    # (training alone is the test above's)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000,
                                  quorum_tick_ms=50, heartbeat_timeout_ms=1000)
    try:
        got = _launch_groups(tmp_path, corpus, cache_dir, lighthouse.address())
    finally:
        lighthouse.shutdown()
    for name, res in got.items():
        assert not isinstance(res, BaseException), f"{name}: {res}"
    numels = got["g0"][0][2]
    assert all(got[n][r][2] == numels for n in got for r in (0, 1))  # the same shard sizes
    total = sum(p.numel() for _, p in run.engine.named_params)
    assert total / 2 <= sum(numels) < total / 2 + len(numels)  # a shard: half, padded
    recs = {n: {r["step"]: r for r in got[n][0][0]} for n in got}
    recs[1] = {**recs.pop("g1"), **recs.pop("g1b")}
    recs[0] = recs.pop("g0")
    assert sorted(recs[0]) == list(range(1, HSDP_STEPS + 1))
    assert sorted(recs[1]) == list(range(1, HSDP_STEPS + 1))  # LEAVE steps, then the rest
    assert [r["ft_participants"] for g in (0, 1) for r in recs[g].values()] == \
        [2] * 2 * HSDP_STEPS
    back = recs[1][LEAVE + 1]
    assert back["ft_healed_from_step"] == 0 and "ft_healed_from_step" not in recs[0][LEAVE + 1]
    assert back["ft_weights_sha256"] == recs[0][LEAVE + 1]["ft_weights_sha256"]
    # the heal served rank 0's shards and their two moments, nothing whole
    heals = [r["comm_bytes"]["replica_heal"] for r in recs[0].values()
             if r["comm_bytes"]["replica_heal"]]
    assert heals == [3 * sum(numels) * 4]
    # the dry run's note: the same bytes, from the closed form on a meta model's units
    cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "dry", **HSDP,
                                           ft__replica_groups=2))
    note = replica_note(cfg, run.model_cfg, Layout.from_config(cfg, 2))
    assert f"quorum: {recs[0][1]['comm_bytes']['replica']:,} bytes" in note
    assert f"serves {heals[0]:,} bytes" in note

    losses = [train_step(run, s)[0] for s in range(HSDP_STEPS)]
    ref = {**run.engine.state_dict()["model"], **run.engine.state_dict()["optim"]}
    for g in (0, 1):
        assert [r["loss"] for r in recs[g].values()] == \
            pytest.approx([losses[s - 1] for s in recs[g]], rel=1e-5)
        # the closed form on the shards (group g is g-th in the quorum)
        assert {r["comm_bytes"]["replica"] for r in recs[g].values()} == {
            replica_gradient_bytes(numels, 4, 2, g)}
        for rank in (0, 1):
            for name, kind, data, a, b in got[("g0", "g1b")[g]][rank][1]:
                key = name if kind == "model" else f"{name}.{kind}"
                torch.testing.assert_close(data, ref[key].reshape(-1)[a:b], rtol=1e-5,
                                           atol=1e-6, msg=key)


def test_dry_run_plans_one_groups_share_of_the_batch(monkeypatch):
    """Under ft.replica_groups the dry run plans one group: its share of the global batch (2
    groups of 16 sequences: each steps as a job of 8 would), not the whole batch per group."""
    pytest.importorskip("torchft")
    from threefold.launch.dryrun import predict

    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    base = [("model.preset", "tiny"), ("data.seq_len", "64"), ("train.micro_batch_size", "2")]
    groups = predict(load_config(None, base + [("train.global_batch_size", "16"),
                                               ("ft.replica_groups", "2"),
                                               ("ft.lighthouse", "http://127.0.0.1:1")]), 2)
    half = predict(load_config(None, base + [("train.global_batch_size", "8")]), 2)
    whole = predict(load_config(None, base + [("train.global_batch_size", "16")]), 2)
    assert groups.work.global_batch == 8
    assert groups.step.step_time_s == half.step.step_time_s < whole.step.step_time_s
