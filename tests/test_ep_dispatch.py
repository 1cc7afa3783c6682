"""The hierarchical expert dispatch (threefold.parallel.transforms.expert_dispatch): ep split into
nodes ("ep_inter") and the ranks of a node ("ep_intra"), the closed form of the bytes per level
(threefold.accounting.ep_levels) against enumeration and against the runtime's measured routing,
training equal to the flat dispatch and one process, and recompute sending nothing twice
(selective) or everything twice (full, counted)."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_checks
from threefold.accounting import axis_crosses_nodes, nodes_per_token
from threefold.config import ModelConfig, load_config
from threefold.layout import Layout

GROUPED = dict(model__num_local_experts=8, model__num_experts_per_tok=3,
               model__moe_router="sigmoid_grouped", model__n_group=4, model__topk_group=2,
               model__intermediate_size=64, model__router_z_loss_coef=0.001)
HIER = {"parallel__ep": 4, "parallel__ep_dispatch": "hierarchical",
        "parallel__gpus_per_node": 2}


@pytest.mark.parametrize("kw,gpn", [(dict(dp_shard=8, ep=8), 4), (dict(dp_shard=4, tp=2, ep=4), 4),
                                    (dict(dp_replicate=2, dp_shard=4, ep=4), 2),
                                    (dict(dp_shard=8, ep=4), 2)])
def test_ep_levels_split_ep_into_nodes(kw, gpn):
    """ep = ep_inter × ep_intra: every ep_intra group is the ep ranks of one node, every
    ep_inter group one rank of each node the ep group spans, with the same local index;
    the planner places ep_intra inside a node and ep_inter across nodes."""
    d = Layout(**kw, ep_dispatch="hierarchical", gpus_per_node=gpn)
    assert d.ep_intra * d.ep_inter == d.ep and d.ep_inter > 1
    for r in range(d.world_size):
        c, ep = d.coords(r), d.axis_ranks(r, "ep")
        assert c["ep"] == c["ep_inter"] * d.ep_intra + c["ep_intra"]
        intra, inter = d.axis_ranks(r, "ep_intra"), d.axis_ranks(r, "ep_inter")
        assert intra[c["ep_intra"]] == r and inter[c["ep_inter"]] == r
        assert set(intra) | set(inter) <= set(ep) and set(intra) & set(inter) == {r}
        assert {q // gpn for q in intra} == {r // gpn}
        assert len({q // gpn for q in inter}) == d.ep_inter
        assert len({q % gpn for q in inter}) == 1
    assert not axis_crosses_nodes(d, "ep_intra", gpn) and axis_crosses_nodes(d, "ep_inter", gpn)
    flat = Layout(**kw)  # one level: ep_intra is ep
    assert (flat.ep_intra, flat.ep_inter) == (flat.ep, 1)


def _enumerated_nodes(e, k, groups, chosen, nodes):
    """The mean distinct nodes over every uniform choice of ``chosen`` groups and then of k
    experts among theirs (experts contiguous: expert x on node x // (e / nodes))."""
    per_group, per_node, total, count = e // groups, e // nodes, Fraction(0), 0
    for gs in itertools.combinations(range(groups), chosen):
        pool = [g * per_group + i for g in gs for i in range(per_group)]
        for ex in itertools.combinations(pool, k):
            total += len({x // per_node for x in ex})
            count += 1
    return total / count


@pytest.mark.parametrize("e,k,groups,chosen,nodes", [(8, 3, 4, 2, 2), (16, 4, 8, 3, 4),
                                                     (8, 2, 1, 1, 4), (12, 3, 6, 2, 3)])
def test_nodes_per_token_is_the_enumerated_expectation(e, k, groups, chosen, nodes):
    """D, the expected distinct destination nodes per token, equals enumeration, at most
    topk_group (grouped) or k; DeepSeek-V3's 8 groups on 8 nodes, 4 kept, 8 of 128 experts:
    3.62 nodes of at most 4."""
    grouped = groups > 1
    cfg = ModelConfig(num_local_experts=e, num_experts_per_tok=k, n_group=groups,
                      topk_group=chosen, moe_router="sigmoid_grouped" if grouped else "softmax")
    d = nodes_per_token(cfg, nodes)
    assert d == (_enumerated_nodes(e, k, groups, chosen, nodes) if grouped
                 else _enumerated_nodes(e, k, e, k, nodes))
    assert 1 <= d <= min(nodes, chosen if grouped else k)
    ds = nodes_per_token(ModelConfig(preset="deepseek-v3").resolved(), 8)
    assert 3.6 < ds < 3.65


def _runs(rank, world, corpus, cache, root, runs):
    """Training runs on these ranks (``world`` 4: ep 4, flat and as 2 nodes × 2), ranks 0-1
    and 2-3 on two faked hosts (``THREEFOLD_TEST_HOSTNAME``), as the dispatch's nodes."""
    import os

    from threefold.comm.topology import TEST_HOSTNAME_ENV
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    os.environ[TEST_HOSTNAME_ENV] = f"node{rank // 2}"
    for name, extra in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name, **{
            **GROUPED, "train__steps": 2, "train__micro_batch_size": 2, **extra}))
        train(cfg, Distributed(cfg))


def _recomputed(rank, world):
    """A 2-block MoE model (grouped routing) under ep 4 as 2 nodes × 2: loss, gradients and
    rows sent per level under recompute none, selective and full."""
    from threefold.comm.counted import Comm
    from threefold.comm.mesh import build_mesh
    from threefold.layout.axes import EP_LEVELS, EXPERT_AXES
    from threefold.model.decoder import CausalLM
    from threefold.parallel.transforms.expert import apply_expert_parallel
    from threefold.parallel.transforms.expert_dispatch import (HierarchicalExperts,
                                                               apply_hierarchical_dispatch)
    from threefold.parallel.transforms.recompute import apply_recompute

    cfg = ModelConfig(preset="tiny", vocab_size=256, hidden_size=64, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      num_local_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                      moe_router="sigmoid_grouped").resolved()
    dims = Layout(dp_shard=world, ep=world, ep_dispatch="hierarchical", gpus_per_node=2)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    for axis in EXPERT_AXES + EP_LEVELS:
        comm.add_axis(axis, dims.axis_groups(axis))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(rank))
    out = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = CausalLM(cfg)
        apply_hierarchical_dispatch(apply_expert_parallel(model, comm), comm)
        apply_recompute(model, mode)
        loss = model.model(ids).pow(2).mean()
        loss.backward()
        counts = [m.dispatcher.take_counts() for m in model.modules()
                  if isinstance(m, HierarchicalExperts)]
        sent = {k: sum(c[k] for c in counts) for k in counts[0]}
        out[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sent)
    return out


def _assert_level_bytes(run_dir, forwards):
    """Rank 0's bytes of every step on each level equal the closed form with its measured
    routing: on ep_inter, per layer and forward the counts 2·8·(A−1), each pair row sent
    (dispatch and combine, forwards) h·4 bytes and again in backward, each assignment sent
    its id (8) and weight (4), each received its weight's gradient back (4); on ep_intra
    the node's flat dispatch: counts (B−1)·(E/ep)·8 and its rows h·4 each way."""
    layers, h, a, b, local = 2, 64, 2, 2, 2
    for rec in metrics(run_dir):
        pairs, intra = rec["ep_inter_rows_sent"], rec["ep_intra_rows_sent"]
        sent, got = rec["ep_inter_assignments_sent"], rec["ep_inter_assignments_received"]
        assert pairs > 0 and intra > 0 and sent > 0 and got % forwards == 0
        assert rec["comm_bytes"]["ep_inter"] == (
            layers * forwards * 16 * (a - 1) + (pairs + pairs // forwards) * h * 4
            + sent * (8 + 4) + got // forwards * 4)
        assert rec["comm_bytes"]["ep_intra"] == (
            layers * forwards * (b - 1) * local * 8 + (intra + intra // forwards) * h * 4)
        # nothing else on ep: rank 0 sends no byte of the norm's one-element all-reduce
        assert rec["comm_bytes"].get("ep", 0) == 0


def test_hierarchical_dispatch_trains_as_flat_and_one_process(corpus, cache_dir, tmp_path):
    """4 ranks as 2 nodes × 2, ep 4, grouped routing (8 experts in 4 groups, 2 kept, top-3):
    the hierarchical dispatch's losses, router losses, expert counts and weights equal the
    flat dispatch's and one process's, with no recompute and with full recompute (which
    sends every forward exchange again, counted); every step's bytes per level equal the
    closed form with the measured routing; a model's selective recompute gives the loss and
    gradients of no recompute and sends no row twice, full sends every row twice."""
    from threefold.training.train import train

    # the hierarchical run compares every rank's collectives at each step's end
    runs = [("flat", {"parallel__ep": 4}),
            ("hier", {**HIER, "parallel__check_collectives": True}),
            ("hier_full", {**HIER, "train__recompute": "full"})]
    res = run_checks(4, [(_runs, (corpus, cache_dir, tmp_path, runs)), (_recomputed, ())],
                     timeout=300)
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: a shared machine's threads would thrash
    train(load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "single", **{
        **GROUPED, "train__steps": 2, "train__micro_batch_size": 2})))
    torch.set_num_threads(old)
    want, weights = metrics(tmp_path / "single"), final_weights(tmp_path / "single")
    for name, _ in runs:
        got = metrics(tmp_path / name)
        for key in ("loss", "router_z_loss", "grad_norm"):
            assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), \
                (name, key)
        assert [r["expert_counts"] for r in got] == [r["expert_counts"] for r in want], name
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["topology"]["ranks_per_node"] == [2, 2], name
        for k, w in final_weights(tmp_path / name).items():
            torch.testing.assert_close(w, weights[k], rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")
    _assert_level_bytes(tmp_path / "hier", 1)
    _assert_level_bytes(tmp_path / "hier_full", 2)
    for out in res[1]:  # each rank's recompute check
        loss, grads, sent = out["none"]
        for mode in ("selective", "full"):
            torch.testing.assert_close(out[mode][0], loss, rtol=1e-5, atol=0)
            for name, g in grads.items():
                torch.testing.assert_close(out[mode][1][name], g, rtol=1e-5, atol=1e-7,
                                           msg=f"{mode}: {name}")
        assert out["selective"][2] == sent
        assert out["full"][2] == {k: 2 * v for k, v in sent.items()}
        assert sent["ep_inter_rows_sent"] + sent["ep_intra_rows_sent"] > 0


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_level_bytes_are_the_closed_form(recompute):
    """The accounting's bytes per level for N tokens, k experts: on ep_inter the counts, N·D
    pair rows each way (D from ``nodes_per_token``), N·k ids and weights, (A−1)/A of each;
    on ep_intra the node's flat dispatch; nothing on ep itself; full recompute sends the
    forward's exchanges again, selective does not."""
    from threefold.accounting import comm_bytes_per_step
    from threefold.layout import Workload

    cfg = ModelConfig(preset="tiny", vocab_size=256, hidden_size=64, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      num_local_experts=16, num_experts_per_tok=4, n_group=8, topk_group=3,
                      moe_router="sigmoid_grouped").resolved()
    work = Workload(seq_len=64, global_batch=16, precision="bf16", residual_bytes=4,
                    master_bytes=4)
    lay = Layout(dp_shard=8, ep=8, microbatch_size=2, recompute=recompute,
                 ep_dispatch="hierarchical", gpus_per_node=2)
    a, b, e, k, h, layers, n = 4, 2, 16, 4, 64, 2, 2 * 64
    fw = 2 if recompute == "full" else 1
    pairs = int(n * h * nodes_per_token(cfg, a)) * (a - 1) // a  # elements to other nodes
    got = comm_bytes_per_step(cfg, lay, work)
    assert got["ep_inter"] == layers * (fw * 16 * (a - 1) + (fw + 1) * pairs * (4 + 2)
                                        + fw * n * k * (a - 1) // a * 8
                                        + (fw + 1) * n * k * (a - 1) // a * 4)
    assert got["ep_intra"] == layers * (fw * (b - 1) * e // (a * b) * 8
                                        + (fw + 1) * n * k * h * (b - 1) // b * (4 + 2))
    assert got["ep"] == 0


def test_planner_puts_the_levels_on_their_links_for_deepseek_v3():
    """DeepSeek-V3's layout (pp 16, ep 64 over 8 nodes of 8 H100s): the network level runs on
    the network, the node level on NVLink; the network carries fewer bytes than the flat
    dispatch's all-to-alls (each token at most once per node, 3.62 of 4 expected, not k = 8
    rows), and the exposed ep time under 1F1B drops."""
    import dataclasses

    from threefold.accounting import comm_bytes_per_step
    from threefold.hardware.catalogue import GPUS
    from threefold.layout import Workload
    from threefold.plan.cluster import Cluster
    from threefold.plan.step import predict_step

    cfg = ModelConfig(preset="deepseek-v3").resolved()
    work = Workload(seq_len=4096, global_batch=15360)
    cluster = Cluster(dataclasses.replace(GPUS["h100"], intra_node_bw=200e9), 2048, 8)
    steps, sent = {}, {}
    for d in ("flat", "hierarchical"):
        lay = Layout(pp=16, dp_shard=128, ep=64, zero_stage=1, recompute="full",
                     sequence_parallel=False, ep_dispatch=d, gpus_per_node=8)
        steps[d], sent[d] = predict_step(cfg, lay, work, cluster), comm_bytes_per_step(
            cfg, lay, work)
    levels = dict(steps["hierarchical"].axis_levels)
    assert (levels["ep_inter"], levels["ep_intra"]) == ("network", "nvlink")
    assert sent["hierarchical"]["ep_inter"] < 0.5 * sent["flat"]["ep"]
    assert steps["hierarchical"].ep_exposed_s < 0.7 * steps["flat"].ep_exposed_s


def test_a_node_level_across_real_nodes_is_warned_of():
    """The running job's hosts check the node level: parallel.gpus_per_node 4 on two hosts
    of 2 ranks puts each ep_intra group on both (warned, naming the field); 2 matches them."""
    from threefold.comm.topology import Topology

    hosts = Topology(("a", "a", "b", "b"), (0, 1, 0, 1))
    wrong = hosts.warnings(Layout(dp_shard=4, ep=4, ep_dispatch="hierarchical",
                                  gpus_per_node=4))
    assert len(wrong) == 1 and "ep_intra=4 spans nodes" in wrong[0] \
        and "parallel.gpus_per_node" in wrong[0]
    assert hosts.warnings(Layout(dp_shard=4, ep=4, ep_dispatch="hierarchical",
                                 gpus_per_node=2)) == []
    assert hosts.warnings(Layout(dp_shard=4, ep=4)) == []  # flat: one level


def test_the_launcher_gives_the_dispatch_its_nodes(monkeypatch):
    """parallel.gpus_per_node 0 is the launcher's --nproc-per-node: 2 nodes of 1 rank make ep 2
    span 2 nodes, which 3 routing groups cannot map to (refused before launch); 2 ranks per
    node keep ep 2 on one node (accepted)."""
    from threefold.launch.launcher import check_launch
    from threefold.layout.rules import LayoutError

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    over = [("model.preset", "tiny-moe"), ("model.num_local_experts", "6"),
            ("model.moe_router", "sigmoid_grouped"), ("model.n_group", "3"),
            ("model.topk_group", "1"), ("parallel.ep", "2"),
            ("parallel.ep_dispatch", "hierarchical"), ("parallel.dp_shard", "2")]
    cfg = load_config(None, over)
    with pytest.raises(LayoutError, match="model.n_group: 3 routing groups do not map"):
        check_launch(cfg, 1, ["--nnodes", "2"])
    assert cfg.parallel.gpus_per_node == 1
    cfg = load_config(None, over)
    assert check_launch(cfg, 2, []) == 2 and cfg.parallel.gpus_per_node == 2
