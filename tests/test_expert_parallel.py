"""Expert parallelism (threefold.parallel.transforms.expert): the mesh's expert axes, the all-to-all MoE
layer equal to the single-process layer (forward, backward, bytes to the closed form for the
measured routing), training runs on ep layouts equal to one process, checkpoints that move
between ep layouts, and the layout refusals."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed
from threefold.config import ConfigError, ModelConfig, load_config
from threefold.layout import Layout
from threefold.comm.mesh import build_mesh

MOE = dict(model__num_local_experts=4, model__num_experts_per_tok=2,
           model__intermediate_size=64, model__router_z_loss_coef=0.001)


# --------------------------------------------------------------------------------------------
# The mesh
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [(1, 4, 1, 1, 2), (2, 4, 2, 1, 2), (1, 8, 1, 2, 4),
                                    (2, 2, 2, 1, 2)])
def test_expert_axes_partition_dp_shard(layout):
    """ep × edp_shard is dp_shard; every rank's groups on ep, edp_shard and edp are the
    ranks that share all other coordinates; edp holds the ranks with the same experts."""
    rep, shard, tp, pp, ep = layout
    world = rep * shard * tp * pp
    d = Layout(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, ep=ep)
    for r in range(world):
        c = d.coords(r)
        assert c["dp_shard"] == c["edp_shard"] * ep + c["ep"]
        for axis, varies in (("ep", {"ep"}), ("edp_shard", {"edp_shard"}),
                             ("edp", {"edp_shard", "dp_replicate"})):
            g = d.axis_ranks(r, axis)
            assert len(g) == d.axis_size(axis) and g[c[axis]] == r
            fixed = {"pp", "tp", "cp", "dp_replicate", "edp_shard", "ep"} - varies
            for q in g:
                cq = d.coords(q)
                assert all(cq[a] == c[a] for a in fixed), (axis, r, q)
        # the ep group and the edp group meet in this rank only
        assert set(d.axis_ranks(r, "ep")) & set(d.axis_ranks(r, "edp")) == {r}
    assert sorted(sum(d.axis_groups("ep"), [])) == list(range(world))


def test_ep_layouts_are_checked_before_launch():
    base = [("model.preset", "tiny-moe")]
    from threefold.layout import validate_layout

    def check(*kv, world=4, mcfg=None):
        validate_layout(load_config(None, base + list(kv)), world, mcfg)

    with pytest.raises(ConfigError, match="parallel.ep: 4 does not divide parallel.dp_shard=2"):
        check(("parallel.ep", "4"), ("parallel.dp_replicate", "2"))
    check(("parallel.ep", "2"), ("parallel.cp", "2"))  # experts route a cp share of tokens

    check(("parallel.ep", "4"))  # 4 experts over 4 ranks
    with pytest.raises(ConfigError, match="parallel.ep: 2 needs a mixture of experts"):
        check(("model.preset", "tiny"), ("parallel.ep", "2"))
    mcfg = ModelConfig(preset="tiny-moe", num_local_experts=6).resolved(320)
    with pytest.raises(ConfigError, match="parallel.ep: 4 does not divide "
                                          "model.num_local_experts=6; use an ep in 1, 2"):
        check(("parallel.ep", "4"), ("model.num_local_experts", "6"), mcfg=mcfg)
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        check(("parallel.tp", "2"), ("parallel.sequence_parallel", "true"))
    with pytest.raises(ConfigError, match="model.router_aux_loss_per_layer: parallel.pp=2"):
        check(("parallel.pp", "2"))
    check(("parallel.pp", "2"), ("model.router_aux_loss_per_layer", "true"))
    check(("parallel.pp", "2"), ("model.router_aux_loss_coef", "0"))


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------
def _layer(rank, world, tokens):
    """Each rank: its tokens through the ep layer and through the whole single-process
    layer; outputs, input gradients and expert gradients, and the bytes counted on ep."""
    from threefold.comm.counted import Comm
    from threefold.layout.axes import EXPERT_AXES
    from threefold.model.moe import SparseMoeBlock
    from threefold.parallel.transforms.expert import apply_expert_parallel

    cfg = ModelConfig(preset="tiny", hidden_size=16, intermediate_size=24,
                      num_local_experts=8, num_experts_per_tok=2).resolved(64)
    dims = Layout(dp_shard=world, ep=world)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    for axis in EXPERT_AXES:
        comm.add_axis(axis, dims.axis_groups(axis))
    torch.manual_seed(0)
    whole = SparseMoeBlock(cfg)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.3)
    local = SparseMoeBlock(cfg)
    local.load_state_dict(whole.state_dict())
    apply_expert_parallel(local, comm)
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(1, tokens[rank], 16, generator=g)
    dy = torch.randn(1, tokens[rank], 16, generator=g)
    out = []
    for block in (whole, local):
        xi = x.clone().requires_grad_()
        y = block(xi)
        (y * dy).sum().backward()
        out.append((y.detach(), xi.grad, block.experts.gate_up_proj.grad.clone(),
                    block.experts.down_proj.grad.clone(), block.router_stats.counts))
    sent = comm.totals().get("ep", {})
    return out, sent


@pytest.mark.parametrize("world,tokens", [(2, (40, 17)), (4, (9, 30, 1, 22))])
def test_dispatch_equals_the_single_process_layer_and_counts_its_bytes(world, tokens):
    """Uneven token counts per rank: outputs and input gradients equal the whole layer's on
    the same tokens; each rank's expert gradients, summed over ranks, equal the whole
    layer's summed over ranks (every rank's tokens), for its slice of the experts; bytes on
    ep equal the count exchange plus the rows the routing sends, both ways, twice."""
    res = run_distributed(_layer, world, tokens)
    h, e, k, ep = 16, 8, 2, world
    n = e // ep
    whole_gu = sum(r[0][0][2] for r in res)
    whole_dn = sum(r[0][0][3] for r in res)
    ep_gu = torch.cat([r[0][1][2] for r in res])
    ep_dn = torch.cat([r[0][1][3] for r in res])
    torch.testing.assert_close(ep_gu, whole_gu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ep_dn, whole_dn, rtol=1e-5, atol=1e-6)
    counts = [r[0][0][4] for r in res]  # (E,) per rank, of its own tokens
    for rank, ((want, got), sent) in enumerate(res):
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        assert torch.equal(got[4], want[4])
        out_rows = int(counts[rank].sum() - counts[rank][rank * n:(rank + 1) * n].sum())
        in_rows = int(sum(c[rank * n:(rank + 1) * n].sum() for i, c in enumerate(counts)
                          if i != rank))
        want_bytes = e * 8 * (ep - 1) // ep + 2 * (out_rows + in_rows) * h * 4
        assert sent == {"all_to_all": want_bytes}, (rank, sent)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
def _runs(rank, world, corpus, cache, root, runs):
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    for name, extra in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name,
                                               **{**MOE, "train__steps": 3, **extra}))
        train(cfg, Distributed(cfg))


def _single(corpus, cache, out, micro):
    from threefold.training.train import train

    train(load_config(None, tiny_overrides(corpus, cache, out, **{
        **MOE, "train__steps": 3, "train__micro_batch_size": micro})))
    return metrics(out), final_weights(out)


def _assert_equal(got_dir, want, weights, name):
    got = metrics(got_dir)
    for key in ("loss", "router_aux_loss", "router_z_loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), \
            (name, key)
    assert [r["expert_counts"] for r in got] == [r["expert_counts"] for r in want], name
    summary = json.loads((got_dir / "summary.json").read_text())
    assert summary["comm_bytes_per_step"]["ep"] > 0, name  # the experts did move tokens
    final = final_weights(got_dir)
    assert final.keys() == weights.keys()
    for k, w in final.items():
        torch.testing.assert_close(w, weights[k], rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")


def _assert_exact_bytes(run_dir, world, ep, micro_steps, recompute):
    """Rank 0's bytes of every step (zero stage 0) equal the closed form with its measured
    routing (``ep_rows_sent``): on ep, per layer and forward the count exchange
    E·8·(ep−1)/ep, the rows sent forward (recomputed forwards included) and again in
    backward, × h × 4, and the norm's scalar all-reduce; on edp the all-reduce of its
    experts' gradients, on dp of the dense ones (one bucket each)."""
    from threefold.accounting import num_parameters

    layers, e, h, f = 2, 4, 64, 64
    mcfg = ModelConfig(preset="tiny", hidden_size=h, intermediate_size=f, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=e,
                       num_experts_per_tok=2).resolved(320)
    experts = layers * e * 3 * h * f
    dense, local = num_parameters(mcfg) - experts, experts // ep

    def all_reduce(numel, n):  # rank 0's share of a ring all-reduce, fp32 (comm.Comm)
        return 0 if n == 1 else 2 * (numel - -(-numel // n)) * 4

    forwards = 2 if recompute else 1
    for rec in metrics(run_dir):
        rows = rec["ep_rows_sent"]
        assert rows % forwards == 0 and rows > 0
        want_ep = (layers * micro_steps * forwards * e * 8 * (ep - 1) // ep
                   + (rows + rows // forwards) * h * 4 + all_reduce(1, ep))
        assert rec["comm_bytes"]["ep"] == want_ep, rec
        assert rec["comm_bytes"].get("edp", 0) == all_reduce(local, world // ep)
        assert rec["comm_bytes"]["dp"] == all_reduce(dense, world)


def test_ep2_trains_as_one_process(corpus, cache_dir, tmp_path):
    """2 ranks, 2 experts each (ZeRO 0 and 1): each rank's 4 sequences are one micro-batch
    of the single-process run; with gradient accumulation and activation checkpointing (the
    recomputed forward repeats the all-to-alls; ZeRO-3 re-gathers the experts' unit), two
    micro-batches of 2."""
    want, weights = _single(corpus, cache_dir, tmp_path / "single", 4)
    want2, weights2 = _single(corpus, cache_dir, tmp_path / "single2", 2)
    accum = {"parallel__ep": 2, "train__micro_batch_size": 2,
             "train__activation_checkpointing": "true"}
    runs = [("ep2", {"parallel__ep": 2}),
            ("ep2_zero1", {"parallel__ep": 2, "parallel__zero_stage": 1}),
            ("ep2_accum_ac", accum),
            ("ep2_accum_ac_zero3", {**accum, "parallel__zero_stage": 3})]
    run_distributed(_runs, 2, corpus, cache_dir, tmp_path, runs)
    for name, _ in runs:
        ref = (want2, weights2) if "accum" in name else (want, weights)
        _assert_equal(tmp_path / name, *ref, name)
    _assert_exact_bytes(tmp_path / "ep2", 2, 2, 1, False)
    _assert_exact_bytes(tmp_path / "ep2_accum_ac", 2, 2, 2, True)


def test_ep_layouts_on_four_ranks_train_as_one_process(corpus, cache_dir, tmp_path):
    """ep4 (one expert per rank), ep2 × dp2 (expert gradients summed over the two ranks that
    hold them), ep2 × ZeRO-3 (experts sharded over those two), hybrid ZeRO-2 over
    dp_replicate 2 × ep 2: each rank's 2 sequences are one micro-batch of the reference."""
    want, weights = _single(corpus, cache_dir, tmp_path / "single", 2)
    runs = [("ep4", {"parallel__ep": 4}),
            ("ep2_dp2", {"parallel__ep": 2}),
            ("ep2_zero3", {"parallel__ep": 2, "parallel__zero_stage": 3}),
            ("ep2_hsdp_zero2", {"parallel__ep": 2, "parallel__dp_replicate": 2,
                                "parallel__zero_stage": 2})]
    run_distributed(_runs, 4, corpus, cache_dir, tmp_path, runs)
    for name, _ in runs:
        _assert_equal(tmp_path / name, want, weights, name)
    _assert_exact_bytes(tmp_path / "ep4", 4, 4, 1, False)
    _assert_exact_bytes(tmp_path / "ep2_dp2", 4, 2, 1, False)


def test_ep2_with_pp2_trains_as_one_process(corpus, cache_dir, tmp_path):
    """ep2 × pp2 (1F1B; and zero-bubble with ZeRO-1), the load-balancing loss per layer:
    each stage adds its layers' router terms in its own backward; the logged router losses
    and counts are summed over the stages. dp 2, two micro-batches of 2 per rank."""
    from threefold.training.train import train

    per_layer = {"model__router_aux_loss_per_layer": "true", "train__micro_batch_size": 2}
    ref = tmp_path / "single"
    train(load_config(None, tiny_overrides(corpus, cache_dir, ref, **{
        **MOE, "train__steps": 3, **per_layer})))
    want, weights = metrics(ref), final_weights(ref)
    runs = [("ep2_pp2", {"parallel__ep": 2, "parallel__pp": 2, **per_layer}),
            ("ep2_pp2_zb_zero1", {"parallel__ep": 2, "parallel__pp": 2, **per_layer,
                                  "parallel__schedule": "zb-h1", "parallel__zero_stage": 1})]
    run_distributed(_runs, 4, corpus, cache_dir, tmp_path, runs)
    for name, _ in runs:
        _assert_equal(tmp_path / name, want, weights, name)


def test_ep2_with_a_v_schedule_trains_as_one_process(corpus, cache_dir, tmp_path):
    """ep2 × pp2 under ZB-V (4 blocks, two chunks per rank in a V, rank 0 holding the first
    and the last): every chunk adds its layers' router terms in its own backward."""
    from threefold.training.train import train

    deep = {"model__router_aux_loss_per_layer": "true", "train__micro_batch_size": 2,
            "model__num_hidden_layers": 4}
    ref = tmp_path / "single"
    train(load_config(None, tiny_overrides(corpus, cache_dir, ref, **{
        **MOE, "train__steps": 3, **deep})))
    runs = [("ep2_pp2_zbv", {"parallel__ep": 2, "parallel__pp": 2, "parallel__vpp": 2,
                             "parallel__schedule": "zb-v", **deep})]
    run_distributed(_runs, 4, corpus, cache_dir, tmp_path, runs)
    _assert_equal(tmp_path / "ep2_pp2_zbv", metrics(ref), final_weights(ref), "ep2_pp2_zbv")


def test_ep2_with_tp2_trains_as_one_process(corpus, cache_dir, tmp_path):
    """ep2 × tp2 (and with ZeRO-1): experts whole on both tp ranks, all-to-all between ranks
    of the same tp index; dp 2 of 4 sequences each."""
    want, weights = _single(corpus, cache_dir, tmp_path / "single", 4)
    runs = [("ep2_tp2", {"parallel__ep": 2, "parallel__tp": 2}),
            ("ep2_tp2_zero1", {"parallel__ep": 2, "parallel__tp": 2,
                               "parallel__zero_stage": 1})]
    run_distributed(_runs, 4, corpus, cache_dir, tmp_path, runs)
    for name, _ in runs:
        _assert_equal(tmp_path / name, want, weights, name)


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------
def _segment(rank, world, corpus, cache, out, extra, steps):
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    cfg = load_config(None, _ck_overrides(corpus, cache, out, steps, extra))
    train(cfg, Distributed(cfg))


def _ck_overrides(corpus, cache, out, steps, extra):
    return tiny_overrides(corpus, cache, out, **{
        **MOE, "train__steps": steps, "train__micro_batch_size": 2, "checkpoint__interval": 3,
        "checkpoint__resume": "true", **extra})


@pytest.mark.parametrize("first,second", [
    ((4, {"parallel__ep": 2, "parallel__zero_stage": 3}), (4, {"parallel__ep": 4})),
    ((4, {"parallel__ep": 4, "parallel__zero_stage": 1}), (1, {})),
    ((1, {}), (4, {"parallel__ep": 2, "parallel__dp_replicate": 2,
                   "parallel__zero_stage": 2})),
], ids=["ep2zero3-to-ep4", "ep4zero1-to-single", "single-to-ep2hsdp"])
def test_checkpoints_reshard_across_ep_layouts(first, second, corpus, cache_dir, tmp_path):
    """Three steps on one layout, three more on another from its checkpoint: the losses and
    the final weights and optimiser state equal six single-process steps (experts saved by
    their ep ranks into whole tensors, read back as any other layout's slices)."""
    from threefold.weights.checkpoint_verify import list_checkpoints
    from threefold.weights.checkpoint import load_checkpoint
    from threefold.training.train import train

    ref = tmp_path / "single"
    train(load_config(None, _ck_overrides(corpus, cache_dir, ref, 6, {})))
    out = tmp_path / "run"
    for (world, extra), steps in ((first, 3), (second, 6)):
        if world == 1:
            train(load_config(None, _ck_overrides(corpus, cache_dir, out, steps, extra)))
        else:
            run_distributed(_segment, world, corpus, cache_dir, out, extra, steps, timeout=300)
        if steps == 3:
            assert list_checkpoints(out / "checkpoints") == [3]
    got, want = metrics(out), metrics(ref)
    for key in ("loss", "router_aux_loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), key
    assert [r["expert_counts"] for r in got] == [r["expert_counts"] for r in want]
    a, _ = load_checkpoint(out / "checkpoints" / "6")
    b, _ = load_checkpoint(ref / "checkpoints" / "6")
    for kind in ("model", "optim"):
        assert set(a[kind]) == set(b[kind])
        for k in a[kind]:
            torch.testing.assert_close(a[kind][k], b[kind][k], rtol=1e-4, atol=2e-5, msg=k)


def test_per_layer_load_balancing_splits_over_stages():
    """The per-layer loss is the mean of each layer's E·Σ f·P (each layer alone pooled);
    computed on two halves of the layers with the model's layer count, the halves add up
    to it (what each pipeline stage contributes); the z-loss likewise."""
    from threefold.model.moe import RouterStats, load_balancing_loss, router_z_loss

    g = torch.Generator().manual_seed(0)
    stats = []
    for _ in range(4):
        probs = torch.softmax(torch.randn(10, 6, generator=g), -1)
        counts = torch.bincount(torch.topk(probs, 2).indices.reshape(-1), minlength=6)
        stats.append(RouterStats(probs.sum(0), counts, torch.rand((), generator=g), 10))
    whole = load_balancing_loss(stats, 6, per_layer=True)
    each = torch.stack([load_balancing_loss([s], 6) for s in stats])
    torch.testing.assert_close(whole, each.mean())
    assert not torch.allclose(whole, load_balancing_loss(stats, 6))  # not the pooled one
    halves = [load_balancing_loss(part, 6, per_layer=True, layers=4)
              for part in (stats[:1], stats[1:])]
    torch.testing.assert_close(sum(halves), whole)
    z = [router_z_loss(part, layers=4) for part in (stats[:1], stats[1:])]
    torch.testing.assert_close(sum(z), router_z_loss(stats))


def test_shared_expert_under_ep_trains_as_one_process(corpus, cache_dir, tmp_path):
    """A Qwen2-MoE-style block (shared expert, top-k weights not renormalised) under ep2,
    with ZeRO 0 and 3: the shared expert is a dense weight (reduced over dp, in the
    layer's ZeRO unit), the routed experts are split."""
    qwen = {"model__shared_expert_intermediate_size": 48, "model__norm_topk_prob": "false"}
    ref = tmp_path / "single"
    from threefold.training.train import train

    train(load_config(None, tiny_overrides(corpus, cache_dir, ref, **{
        **MOE, **qwen, "train__steps": 3, "train__micro_batch_size": 4})))
    want, weights = metrics(ref), final_weights(ref)
    assert any("shared_expert_gate" in k for k in weights)
    runs = [(f"ep2_shared_zero{z}", {**qwen, "parallel__ep": 2, "parallel__zero_stage": z})
            for z in (0, 3)]
    run_distributed(_runs, 2, corpus, cache_dir, tmp_path, runs)
    for name, _ in runs:
        _assert_equal(tmp_path / name, want, weights, name)


def _recomputed_blocks(rank, world):
    """On each rank (ep = world, or one process when world is 1): a 2-block MoE model's
    loss and gradients under recompute none, selective and full, and the rows sent on ep."""
    from threefold.comm.counted import Comm
    from threefold.layout.axes import EXPERT_AXES
    from threefold.model.decoder import CausalLM
    from threefold.parallel.transforms.expert import apply_expert_parallel, take_rows_sent
    from threefold.parallel.transforms.recompute import apply_recompute

    cfg = ModelConfig(preset="tiny", vocab_size=256, hidden_size=64, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      num_local_experts=4, num_experts_per_tok=2).resolved()
    comm = None
    if world > 1:
        dims = Layout(dp_shard=world, ep=world)
        comm = Comm(dims, build_mesh(dims, "cpu"))
        for axis in EXPERT_AXES:
            comm.add_axis(axis, dims.axis_groups(axis))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(rank))
    out = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = CausalLM(cfg)
        if comm is not None:
            apply_expert_parallel(model, comm)
        apply_recompute(model, mode)
        loss = model.model(ids).pow(2).mean()
        loss.backward()
        rows = take_rows_sent(model)
        out[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()}, rows)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_selective_recompute_equals_no_recompute(world):
    """Selective recompute of MoE blocks (grouped experts) gives the loss and every gradient
    of no recompute, in one process and under ep 2; its recompute sends no row (the forward's
    all-to-all results are kept), where full recompute sends every forward row again."""
    res = [_recomputed_blocks(0, 1)] if world == 1 else run_distributed(_recomputed_blocks,
                                                                         world)
    for out in res:
        loss, grads, rows = out["none"]
        for mode in ("selective", "full"):
            torch.testing.assert_close(out[mode][0], loss, rtol=1e-5, atol=0)
            for name, g in grads.items():
                torch.testing.assert_close(out[mode][1][name], g, rtol=1e-5, atol=1e-7,
                                           msg=f"{mode}: {name}")
        assert out["selective"][2] == rows
        assert out["full"][2] == 2 * rows
        assert (rows > 0) == (world > 1)


def test_ep2_with_selective_recompute_trains_as_one_process(corpus, cache_dir, tmp_path):
    """2 ranks, ep 2, selective recompute with the whole mixture of experts and the attention
    core recomputed too (``train.recompute_modules``): losses, router losses, expert counts
    and weights equal the single-process run without recompute, and every step's bytes on
    ep are those of no recompute (the recompute repeats no all-to-all)."""
    want, weights = _single(corpus, cache_dir, tmp_path / "single", 4)
    runs = [("ep2_selective", {"parallel__ep": 2, "train__recompute": "selective",
                               "train__recompute_modules": "core_attn,moe"})]
    run_distributed(_runs, 2, corpus, cache_dir, tmp_path, runs)
    _assert_equal(tmp_path / "ep2_selective", want, weights, "ep2_selective")
    _assert_exact_bytes(tmp_path / "ep2_selective", 2, 2, 1, False)
