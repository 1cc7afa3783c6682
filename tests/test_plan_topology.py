"""α–β collectives per algorithm, and topology levels: each mesh axis on the level its
ranks span (mesh order), oversubscription, and the command-line ways to give levels."""

from __future__ import annotations

import json

import pytest

from threefold.layout import Layout, Workload
from threefold.commands.planning import load_model, main
from threefold.plan.collectives import (
    Link,
    all_reduce_time,
    collective_time,
    hierarchical_time,
    ring_time,
    tree_all_reduce_time,
)
from threefold.plan.cluster import Cluster, Level
from threefold.hardware.catalogue import get_hardware
from threefold.plan.step import predict_step
from threefold.plan.network import CLUSTERS, levels_from_record, place

NET = Link(latency_s=6e-6, bandwidth=50e9)
NVL = Link(latency_s=2e-6, bandwidth=450e9)


def test_ring_latency_grows_linearly_and_tree_logarithmically():
    small = 0  # bytes: latency only
    r = [ring_time("all_reduce", n, small, NET) for n in (2, 64, 2048)]
    t = [tree_all_reduce_time(n, small, NET) for n in (2, 64, 2048)]
    assert r[2] == pytest.approx(2 * 2047 * 6e-6, rel=1e-6)
    assert t[2] == pytest.approx(2 * 11 * 6e-6, rel=1e-6)
    assert r[1] / r[0] == pytest.approx(63, rel=1e-3) and t[1] / t[0] == pytest.approx(6)
    # large buffers: both pay 2(n-1)/n·S/β, so the choice is the ring's or the tree's latency
    big = 1e9
    assert all_reduce_time(2048, big, NET) == pytest.approx(
        2 * 11 * 6e-6 + 2 * 2047 / 2048 * big / 50e9)
    assert all_reduce_time(2048, small, NET) == tree_all_reduce_time(2048, small, NET)


def test_hierarchical_pays_the_network_only_for_one_rank_per_node():
    n, g, size = 64, 8, 256e6
    flat = ring_time("all_gather", n, size, NET)
    two = hierarchical_time("all_gather", n, size, g, NVL, NET)
    # inside the node: 7 hops of the whole buffer's 7/8 on NVLink; across: 7 hops of S/8
    want = 7 * 2e-6 + 7 / 8 * size / 450e9 + 7 * 6e-6 + 7 / 8 * size / 8 / 50e9
    assert two == pytest.approx(want) and two < flat
    # all-reduce may take the two-level form; all-gather runs NCCL's ring through every rank:
    # 7 of its 63 steps cross the network, 56 stay on NVLink, the node crossings on 8 cards
    assert collective_time("all_reduce", n, size, NET, per_node=g, intra=NVL) == min(
        all_reduce_time(n, size, NET), hierarchical_time("all_reduce", n, size, g, NVL, NET))
    ring = 7 * 6e-6 + 56 * 2e-6 + 63 / 64 * size / min(450e9, 8 * 50e9)
    assert collective_time("all_gather", n, size, NET, per_node=g, intra=NVL) == \
        pytest.approx(ring)
    assert collective_time("all_gather", n, size, NET) == flat  # one rank per node: flat
    assert collective_time("p2p", 2, size, NET) == pytest.approx(6e-6 + size / 50e9)


def test_axes_are_placed_on_the_level_their_ranks_span():
    levels = levels_from_record(CLUSTERS["llama3-24k"], 8)
    cl = Cluster(get_hardware("h100"), 16384, 8, levels)
    lay = Layout(tp=8, pp=16, dp_shard=128, zero_stage=1)
    where = {a: place(lay, a, cl) for a in ("tp", "dp_shard", "pp")}
    assert where["tp"].level == "nvlink" and where["tp"].index == 0
    assert where["dp_shard"].level == "pod"  # 128·8 = 1024 consecutive ranks, inside 3072
    assert where["pp"].level == "cluster"  # stride 1024 · 16 = every rank
    # 1:7 above the pods, but only 1024 of a pod's 3072 GPUs send across at a stage boundary:
    # the uplinks (3072/7 GPUs' line rate) are 7·1024/3072 = 7/3 times oversubscribed
    assert where["pp"].link.bandwidth == pytest.approx(50e9 * 3 / 7)
    assert where["pp"].contention == pytest.approx(7 / 3)
    full = Layout(tp=8, pp=2, dp_shard=1024, zero_stage=1)  # stride 8192 > a pod: all 1:7
    assert place(full, "pp", cl).link.bandwidth == pytest.approx(50e9 / 7)
    # Llama 3's order ([TP, CP, PP, DP] innermost first): pipelines of 128 ranks inside a pod,
    # dp over the cluster with 128 flows out of each pod: under the uplinks' capacity
    meta = Cluster(get_hardware("h100"), 16384, 8, levels, mesh_order="dp-outer")
    here = {a: place(lay, a, meta) for a in ("tp", "dp_shard", "pp")}
    assert (here["tp"].level, here["pp"].level, here["dp_shard"].level) == \
        ("nvlink", "pod", "cluster")
    assert here["dp_shard"].contention == 1.0
    assert where["dp_shard"].per_node == 1 and place(Layout(tp=2, dp_shard=8), "dp_shard",
                                                     Cluster(get_hardware("h100"), 16, 8)
                                                     ).per_node == 4


def test_default_topology_keeps_the_two_level_predictions():
    """Without levels a cluster is (node, network): an axis is off level 0 exactly when the
    accounting's axis_crosses_nodes says so."""
    from threefold.accounting import axis_crosses_nodes

    cl = Cluster(get_hardware("h100"), 64, 8)
    for lay in (Layout(tp=8, dp_shard=8), Layout(tp=2, pp=4, dp_shard=8),
                Layout(tp=16, dp_shard=4)):
        for a in ("tp", "pp", "dp_shard"):
            assert (place(lay, a, cl).index > 0) == axis_crosses_nodes(lay, a, 8)


def test_oversubscription_slows_the_axis_that_crosses_it_and_is_flagged(capsys):
    cfg = load_model("llama3-8b")
    work = Workload(seq_len=4096, global_batch=512)
    lay = Layout(tp=8, dp_shard=64, zero_stage=3, microbatch_size=1)
    flat = Cluster(get_hardware("h100"), 512, 8, (
        Level("nvlink", 8, 450e9, 2e-6), Level("spine", 0, 50e9, 8e-6)))
    over = Cluster(get_hardware("h100"), 512, 8, (
        Level("nvlink", 8, 450e9, 2e-6), Level("spine", 0, 50e9, 8e-6, oversubscription=8)))
    a, b = predict_step(cfg, lay, work, flat), predict_step(cfg, lay, work, over)
    assert b.dp_exposed_s > a.dp_exposed_s and b.step_time_s > a.step_time_s
    assert dict(b.axis_levels) == {"dp_shard": "spine", "tp": "nvlink"}
    rc = main(["--model", "llama3-8b", "--gpus", "512", "--gpu", "h100", "--cluster",
               "llama3-24k", "--tp", "8", "--pp", "1", "--zero-stage", "3", "--top", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "on: " in out and "network levels: nvlink 8 GPUs" in out


def test_hardware_file_with_levels(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"gpu": "h100", "levels": [
        {"name": "nvlink", "gpus": 8, "gb_s_per_gpu": 450, "latency_us": 2},
        {"name": "leaf", "gpus": 32, "gbits_per_gpu": 400, "latency_us": 5},
        {"name": "spine", "gpus": 0, "gbits_per_gpu": 400, "latency_us": 8,
         "oversubscription": 4}]}))
    rc = main(["--model", "llama3-8b", "--gpus", "128", "--hardware-file", str(path),
               "--tp", "8", "--pp", "1", "--zero-stage", "3", "--top", "1"])
    out = capsys.readouterr().out
    on = next(line for line in out.splitlines() if line.strip().startswith("on: "))
    # the 1:4 spine: ZeRO-3's dp_shard (16 ranks, stride 8) crosses it, but each 32-GPU leaf
    # sends one ring flow per group (8) against uplinks of 32/4 = 8 GPUs' line rate, so it
    # costs nothing; the layout is still told which collectives cross the spine
    assert rc == 0 and "dp_shard spine" in on and "tp nvlink" in on
    assert "collectives cross the spine level, oversubscribed 1:4" in out
    path.write_text(json.dumps({"levels": [{"name": "nvlink", "gpus": 4, "gb_s_per_gpu": 450,
                                            "latency_us": 2}]}))
    assert main(["--model", "llama3-8b", "--gpus", "16", "--hardware-file", str(path)]) == 2
    assert "levels[0] must be the node" in capsys.readouterr().err


def test_explain_states_what_each_collective_hides_behind(capsys):
    """--explain lists, per axis and collective, what hides it and what is exposed: ZeRO-3's
    gathers behind the forward but for the first bucket, tp's collectives on the critical
    path, pipeline sends exposed at the stage boundaries."""
    rc = main(["--model", "llama3-8b", "--gpus", "64", "--gpu", "h100", "--tp", "8",
               "--pp", "2", "--zero-stage", "3", "--recompute", "none", "--top", "1",
               "--explain"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "dp_shard all_gather:" in out and "forward, but for the first bucket" in out
    assert "tp all_gather:" in out and "on the critical path" in out
    assert "pp p2p:" in out and "exposed" in out
