"""A Layout on a world: resolution, every refusal of its degrees and shapes (the rule book's),
rank arithmetic, and agreement with DeviceMesh."""

from __future__ import annotations

import warnings

import pytest
from tests.dist import run_distributed
from threefold.config import ConfigError, ModelConfig, ParallelConfig
from threefold.layout.axes import AXES
from threefold.layout import Layout, rules
from threefold.comm.mesh import build_mesh, submesh


def dims(world: int, **kw) -> Layout:
    """The Layout of ParallelConfig(**kw) over ``world`` ranks."""
    return Layout.from_parallel(ParallelConfig(**kw), world)


# ------------------------------------------------------------------ resolution and refusals
@pytest.mark.parametrize("kw, expect", [
    ({}, (1, 8, 1, 1)),
    ({"tp": 2}, (1, 4, 2, 1)),
    ({"tp": 2, "dp_replicate": 2}, (2, 2, 2, 1)),
    ({"tp": 2, "pp": 2, "dp_shard": 2}, (1, 2, 2, 2)),
    ({"pp": 8}, (1, 1, 1, 8)),
    ({"cp": 2, "tp": 2}, (1, 2, 2, 1, 2)),
    ({"cp": 4, "pp": 2}, (1, 1, 1, 2, 4)),
])
def test_from_config_resolves_the_rest(kw, expect):
    d = dims(8, **kw)
    cp = expect[4] if len(expect) > 4 else 1
    assert (d.dp_replicate, d.dp_shard, d.tp, d.pp, d.cp) == (*expect[:4], cp)
    assert d.world_size == 8 and d.dp == expect[0] * expect[1]
    assert d.shape == (expect[3], expect[0], expect[1], cp, expect[2])  # AXES order
    assert d.axis_size("dp_cp") == d.dp * cp and d.axis_size("dp_shard_cp") == d.dp_shard * cp


@pytest.mark.parametrize("world, kw, message", [
    (8, {"tp": 3}, "parallel.tp: 3 does not divide world size 8; valid tp values: 1, 2, 4, 8"),
    (8, {"pp": 3}, "parallel.pp: 3 does not divide world size 8; valid pp values: 1, 2, 4, 8"),
    (6, {"dp_replicate": 4},
     "parallel.dp_replicate: 4 does not divide world size 6; valid dp_replicate values: 1, 2, "
     "3, 6"),
    (8, {"tp": 4, "pp": 4}, "parallel: pp·dp_replicate·cp·tp = 4·1·1·4 = 16 does not divide "
                            "world size 8; lower one of them or launch a multiple of 16 ranks"),
    (8, {"tp": 2, "dp_shard": 2}, "parallel.dp_shard: pp·dp_replicate·cp·tp = 1·1·1·2 = 2, "
                                  "times dp_shard=2 is 4, not world size 8; set "
                                  "parallel.dp_shard to 4 or -1 (the rest)"),
    (8, {"cp": 3}, "parallel.cp: 3 does not divide world size 8; valid cp values: 1, 2, 4, 8"),
    (8, {"tp": 0}, "parallel.tp: 0 does not divide world size 8; valid tp values: 1, 2, 4, 8"),
    (8, {"dp_shard": 0}, "parallel.dp_shard: pp·dp_replicate·cp·tp = 1·1·1·1 = 1, times "
                         "dp_shard=0 is 0, not world size 8; set parallel.dp_shard to 8 or -1 "
                         "(the rest)"),
    (0, {}, "world size must be >= 1, got 0"),
])
def test_from_config_refuses_with_field_and_fix(world, kw, message):
    with pytest.raises(ConfigError) as e:
        dims(world, **kw)
    assert str(e.value) == message


def test_zero_over_one_rank_is_allowed_with_a_note():
    assert dims(4, tp=4, zero_stage=2).notes() == [
        "parallel.zero_stage=2 with dp_shard=1 shards over one rank: no memory saving (raise "
        "parallel.dp_shard to shard)"]
    assert dims(4, tp=2, zero_stage=2).notes() == []
    assert dims(4, tp=4).notes() == []


# ------------------------------------------------------------------ model divisibility
def tiny(**kw) -> ModelConfig:
    """The tiny preset (8 heads, 4 KV heads, SwiGLU 688, 4 layers) with changes."""
    return ModelConfig(**kw).resolved(vocab_size=321)


def check_model(d: Layout, m: ModelConfig, vpp: int = 1) -> None:
    """The rule book's rules on the model's shape over ``d``'s tp and pp·vpp."""
    heads, kv, ffn = m.num_attention_heads, m.num_key_value_heads, m.intermediate_size
    rules.heads_over_tp(heads, kv, ffn, d.tp)
    rules.kv_heads_over_tp(heads, kv, ffn, d.tp)
    rules.ffn_over_tp(m, d.tp)
    rules.layers_fill_chunks(m.num_hidden_layers, d.pp, vpp)


def test_model_shapes_that_split_pass():
    check_model(dims(2, tp=2), tiny())
    check_model(dims(8, tp=8), tiny())  # 4 KV heads over 8 ranks: each held twice
    check_model(dims(4, pp=2), tiny(num_hidden_layers=5))  # uneven splits are the runtime's
    check_model(dims(2, pp=2), tiny(), vpp=2)


@pytest.mark.parametrize("world, kw, model, vpp, message", [
    (16, {"tp": 16}, {}, 1, "model.num_attention_heads: 8 is not divisible by parallel.tp=16; "
                            "this model splits over a tp in 1, 2, 4, 8 (with a world size that "
                            "tp divides)"),
    (2, {"tp": 2}, {"num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 384},
     1, "model.num_key_value_heads: 3 neither divides nor is divisible by parallel.tp=2; this "
        "model splits over a tp in 1"),
    (4, {"tp": 4}, {"intermediate_size": 690}, 1,
     "model.intermediate_size: 690 is not divisible by parallel.tp=4; this model splits over a "
     "tp in 1, 2"),
    (8, {"pp": 4}, {}, 2, "model.num_hidden_layers: 4 layers cannot fill pp·vpp = 4·2 = 8 "
                          "pipeline chunks; lower parallel.pp or parallel.vpp"),
    (8, {"pp": 8}, {}, 1, "model.num_hidden_layers: 4 layers cannot fill pp·vpp = 8·1 = 8 "
                          "pipeline chunks; lower parallel.pp or parallel.vpp"),
])
def test_validate_model_refuses_with_field_and_fix(world, kw, model, vpp, message):
    with pytest.raises(ConfigError) as e:
        check_model(dims(world, **kw), tiny(**model), vpp=vpp)
    assert str(e.value) == message


# ------------------------------------------------------------------ rank arithmetic
def test_hybrid_cp_axes_keep_the_all_to_all_inside_a_node():
    """cp 4 = 2 ring ranks × 2 Ulysses ranks over tp 2 on nodes of 4: the all-to-all's group
    (cp_inner) is 2 neighbouring cp ranks, inside a node; the ring's (cp_outer) crosses."""
    from threefold.accounting import axis_crosses_nodes, axis_stride_and_span
    from threefold.layout import Layout

    d = Layout(cp=4, cp_ulysses=2, tp=2)
    assert (d.ulysses, d.cp_ring, d.cp_axes) == (2, 2, ("cp_inner", "cp_outer"))
    assert d.axis_groups("cp_inner") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.axis_groups("cp_outer") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert {k: d.coords(6)[k] for k in ("cp", "cp_outer", "cp_inner")} == {
        "cp": 3, "cp_outer": 1, "cp_inner": 1}
    assert axis_stride_and_span(d, "cp_inner") == (2, 4)
    assert axis_stride_and_span(d, "cp_outer") == (4, 8)
    assert not axis_crosses_nodes(d, "cp_inner", 4) and axis_crosses_nodes(d, "cp_outer", 4)
    assert Layout(cp=4, cp_algorithm="ulysses").cp_axes == ("cp", None)
    assert Layout(cp=4).cp_axes == (None, "cp")


def test_coords_and_groups_of_a_2x2x2_layout():
    d = dims(8, dp_replicate=2, dp_shard=2, tp=2)
    # rank = dp_replicate·4 + dp_shard·2 + tp (tp innermost): rank 5 = (1, 0, 1)
    assert d.coords(5) == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1, "dp": 2,
                           "dp_cp": 2, "dp_shard_cp": 0, "world": 5,
                           "ep": 0, "edp_shard": 0, "edp": 2,  # ep 1: edp is dp
                           "ep_inter": 0, "ep_intra": 0, "cp_inner": 0, "cp_outer": 0}
    assert d.axis_ranks(5, "tp") == [4, 5]
    assert d.axis_ranks(5, "dp_shard") == [5, 7]
    assert d.axis_ranks(5, "dp_replicate") == [1, 5]
    assert d.axis_ranks(5, "dp") == [1, 3, 5, 7]
    assert d.axis_ranks(5, "pp") == [5]
    assert d.axis_ranks(5, "world") == list(range(8))
    d = dims(8, pp=2, dp_shard=2, tp=2)
    assert d.coords(6) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0, "dp": 1,
                           "dp_cp": 1, "dp_shard_cp": 1, "world": 6,
                           "ep": 0, "edp_shard": 1, "edp": 1, "ep_inter": 0, "ep_intra": 0,
                           "cp_inner": 0, "cp_outer": 0}
    assert d.axis_ranks(6, "pp") == [2, 6] and d.axis_ranks(6, "dp") == [4, 6]
    # cp between dp_shard and tp: rank = dp_shard·4 + cp·2 + tp
    d = dims(8, dp_shard=2, cp=2, tp=2)
    assert d.coords(7) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 1, "tp": 1, "dp": 1,
                           "dp_cp": 3, "dp_shard_cp": 3, "world": 7,
                           "ep": 0, "edp_shard": 3, "edp": 3, "ep_inter": 0, "ep_intra": 0,
                           "cp_inner": 0, "cp_outer": 1}
    assert d.axis_ranks(7, "cp") == [5, 7] and d.axis_ranks(7, "dp") == [3, 7]
    # the experts' data ranks span cp (ep 1: edp is dp_cp)
    assert d.axis_ranks(7, "edp") == [1, 3, 5, 7] == d.axis_ranks(7, "edp_shard")
    assert d.axis_ranks(7, "dp_cp") == [1, 3, 5, 7] == d.axis_ranks(7, "dp_shard_cp")
    assert d.describe() == "pp 1 × dp_replicate 1 × dp_shard 2 × cp 2 × tp 2 = 8 ranks"


@pytest.mark.parametrize("kw", [{"dp_replicate": 2, "dp_shard": 2, "tp": 2},
                                {"pp": 2, "dp_shard": 2, "tp": 2},
                                {"pp": 2, "dp_replicate": 2, "tp": 2},
                                {"pp": 2, "dp_replicate": 2, "dp_shard": 2},
                                {"dp_replicate": 2, "cp": 2, "tp": 2},
                                {"pp": 2, "dp_shard": 2, "cp": 2},
                                {"cp": 4, "cp_ulysses": 2, "tp": 2}])
def test_groups_partition_the_world_and_agree_with_coords(kw):
    from threefold.layout.axes import DERIVED_AXES, FLATTENED

    d = dims(8, **kw)
    for axis in AXES + tuple(FLATTENED) + ("cp_inner", "cp_outer"):
        groups = d.axis_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(8))
        assert all(len(g) == d.axis_size(axis) for g in groups)
        for g in groups:
            for i, r in enumerate(g):
                assert d.coords(r)[axis] == i and d.axis_ranks(r, axis) == g
                # ranks in one group differ only in this axis's coordinates
                others = {a: v for a, v in d.coords(r).items()
                          if a in AXES and a not in FLATTENED.get(axis, (axis,))
                          and a != axis[:2]}  # (cp_inner, cp_outer: parts of cp)
                assert others == {a: v for a, v in d.coords(g[0]).items() if a in others}
    assert set(DERIVED_AXES) == {*FLATTENED, "ep", "edp", "edp_shard", "ep_inter", "ep_intra",
                                 "cp_inner", "cp_outer",
                                 "world"}
    with pytest.raises(ValueError, match="outside world size 8"):
        d.coords(8)
    with pytest.raises(KeyError, match="unknown mesh axis 'xp'"):
        d.axis_ranks(0, "xp")


def test_axis_spans_nodes_keeps_tp_inside_a_node():
    d = dims(16, tp=8)  # 2 nodes of 8: tp inside, dp_shard across
    assert not d.axis_spans_nodes("tp", 8) and d.axis_spans_nodes("dp_shard", 8)
    assert not d.axis_spans_nodes("pp", 8)
    d = dims(16, tp=4, pp=2, dp_shard=2)
    assert not d.axis_spans_nodes("tp", 8) and not d.axis_spans_nodes("dp_shard", 8)
    assert d.axis_spans_nodes("pp", 8) and d.axis_spans_nodes("tp", 2)
    assert d.describe() == "pp 2 × dp_replicate 1 × dp_shard 2 × tp 4 = 16 ranks"


def test_world_of_one_builds_no_mesh():
    assert build_mesh(dims(1), "cpu") is None
    with pytest.raises(RuntimeError, match="needs a process group"):
        build_mesh(dims(2), "cpu")


# ------------------------------------------------------------------ against the real DeviceMesh
LAYOUTS = [(2, 2, 2, 1), (1, 2, 2, 2), (2, 1, 2, 2), (2, 2, 1, 2), (1, 2, 2, 1, 2),
           (2, 1, 1, 2, 2)]  # dp_rep, dp_shard, tp, pp[, cp]


def mesh_groups(rank: int, world: int, layouts: list) -> list[dict]:
    """Per layout: this rank's group ranks and local rank on each axis, from the DeviceMesh."""
    import torch.distributed as dist

    out = []
    for layout in layouts:
        d = Layout(dp_replicate=layout[0], dp_shard=layout[1], tp=layout[2], pp=layout[3],
                   cp=(layout[4:] or (1,))[0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mesh = build_mesh(d, "cpu")
            got = {}
            for axis in AXES + ("dp", "dp_cp", "dp_shard_cp"):
                sub = submesh(mesh, axis)
                got[axis] = (dist.get_process_group_ranks(sub.get_group()), sub.get_local_rank())
            same = submesh(mesh, "dp").get_group() is submesh(mesh, "dp").get_group()
        out.append({"groups": got, "dp_cached": same, "names": mesh.mesh_dim_names,
                    "warnings": [str(w.message) for w in caught]})
    return out


def test_arithmetic_matches_device_mesh_on_8_ranks():
    results = run_distributed(mesh_groups, 8, LAYOUTS, timeout=120)
    for rank, per_layout in enumerate(results):
        for layout, got in zip(LAYOUTS, per_layout):
            d = Layout(dp_replicate=layout[0], dp_shard=layout[1], tp=layout[2], pp=layout[3],
                       cp=(layout[4:] or (1,))[0])
            assert got["names"] == AXES and got["dp_cached"]
            assert got["warnings"] == []
            for axis, (ranks, local) in got["groups"].items():
                assert ranks == d.axis_ranks(rank, axis), (layout, axis, rank)
                assert local == d.coords(rank)[axis], (layout, axis, rank)
