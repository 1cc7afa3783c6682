"""Ulysses and hybrid context parallelism: which tokens a rank holds, the attention of whole
models (sliding windows, latent attention, packed documents) equal to one process with the
closed form's bytes on each cp axis, and training under every new layout equal to the single
process's losses and weights."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_checks, run_distributed
from tests.test_context_parallel import STEPS, _runs  # the same runs, under Ulysses
from tests.test_dp_zero import _check_equal
from threefold.accounting import cp_attention_widths, cp_bytes_per_attention
from threefold.config import ModelConfig, load_config
from threefold.parallel.transforms.context import token_index
from threefold.training.train import train



def test_ulysses_ranks_hold_slices_in_order_and_a_hybrid_the_ring_share():
    # pure Ulysses: contiguous slices, so the all-to-all gathers the sequence in order
    assert [token_index(16, 4, r, 4).tolist() for r in (0, 3)] == [[0, 1, 2, 3],
                                                                  [12, 13, 14, 15]]
    # hybrid 2 ring × 2 Ulysses: ring rank 0 holds chunks 0 and 3 of 4 (balanced), cut in two
    assert [token_index(16, 4, r, 2).tolist() for r in range(4)] == [
        [0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
    for cp, u in ((4, 1), (4, 2), (4, 4), (2, 2)):
        got = torch.cat([token_index(32, cp, r, u) for r in range(cp)])
        assert sorted(got.tolist()) == list(range(32))


SHAPE = dict(preset="tiny", vocab_size=64, hidden_size=64, intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
             rope_scaling="none")
MODELS = {
    "gqa": {},
    "window": dict(sliding_window=6),  # Mistral's: every block within 6 tokens
    "gemma": dict(sliding_window=6, sliding_window_pattern=2, query_pre_attn_scalar=32,
                  rope_local_theta=1000.0),
    "latent": dict(kv_lora_rank=16, q_lora_rank=0, qk_nope_head_dim=8, qk_rope_head_dim=8,
                   v_head_dim=8),
}
# (model, algorithm, cp_ulysses, packed) on 4 ranks: pure Ulysses (K/V heads repeated from
# 2 up to 4), the hybrids (2 Ulysses × 2 ring or all-gather ranks)
CASES = [("gqa", "ulysses", 1, False), ("gqa", "ulysses", 1, True),
         ("window", "ulysses", 1, True), ("gemma", "ulysses", 1, False),
         ("latent", "ulysses", 1, False), ("gqa", "ring", 2, True),
         ("gqa", "allgather", 2, False)]


def _model_check(rank, world, model, algorithm, cp_ulysses, packed):
    """This cp rank's logits and the cp-summed gradients of a 2-block model against the
    whole model in one process; the bytes each cp axis moved."""
    from threefold.comm.counted import Comm
    from threefold.comm.mesh import build_mesh
    from threefold.layout import Layout
    from threefold.layout.axes import CP_AXES
    from threefold.model.attention import document_position_ids
    from threefold.model.decoder import CausalLM
    from threefold.parallel.transforms.context import apply_context_parallel, shard_batch

    dims = Layout(cp=world, cp_algorithm=algorithm, cp_ulysses=cp_ulysses)
    mesh = build_mesh(dims, "cpu")
    comm, control = Comm(dims, mesh), Comm(dims, mesh)
    if dims.cp_axes == CP_AXES:
        for axis in CP_AXES:
            comm.add_axis(axis, dims.axis_groups(axis))
    cfg = ModelConfig(**SHAPE, **MODELS[model]).resolved()
    whole = CausalLM(cfg)
    whole.init_weights(0)
    part = apply_context_parallel(copy.deepcopy(whole), comm, algorithm, dims.ulysses)
    gen = torch.Generator().manual_seed(1)
    b, t = 2, 32
    batch = {"input_ids": torch.randint(0, 64, (b, t), generator=gen),
             "labels": torch.randint(0, 64, (b, t), generator=gen)}
    if packed:
        batch["document_ids"] = torch.tensor([[0] * 5 + [1] * 19 + [2] * 8, [0] * 32])
        batch["position_ids"] = document_position_ids(batch["document_ids"])
    weight = torch.randn(b, t, 64, generator=gen)
    ref = whole(batch["input_ids"], batch.get("position_ids"), batch.get("document_ids"))
    (ref * weight).sum().backward()
    idx = token_index(t, world, comm.rank("cp"), dims.ulysses)
    mine = shard_batch(batch, world, comm.rank("cp"), dims.ulysses)
    out = part(mine["input_ids"], mine["position_ids"], mine.get("document_ids"))
    (out * weight[:, idx]).sum().backward()
    sent = {a: sum(ops.values()) for a, ops in comm.totals().items()}
    err = float((out - ref[:, idx]).abs().max() / ref.abs().max())
    for (name, p), q in zip(part.named_parameters(), whole.parameters()):
        control.all_reduce(p.grad, "cp")
        err = max(err, float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-6)))
    return err, sent


def _want_bytes(model, algorithm, cp_ulysses, world):
    """Closed-form bytes per cp axis of one forward and backward of the 2 blocks."""
    cfg = ModelConfig(**SHAPE, **MODELS[model]).resolved()
    u = world if algorithm == "ulysses" else cp_ulysses
    tokens = 2 * 32 // world
    q, kv, out = (tokens * w * 4 for w in cp_attention_widths(cfg, 1, u))
    fwd, bwd = cp_bytes_per_attention(kv, world, algorithm, 1, u, q, out)
    if u in (1, world):
        return {"cp": 2 * (fwd + bwd)}
    a2a = (u - 1) * (q + kv) // u + (u - 1) * out // u
    ring = cp_bytes_per_attention(kv, world // u, algorithm)
    assert fwd + bwd == 2 * a2a + sum(ring)
    return {"cp_inner": 2 * 2 * a2a, "cp_outer": 2 * sum(ring)}


@pytest.mark.slow
def test_ulysses_and_hybrid_models_equal_one_process_with_the_closed_form_bytes():
    results = run_checks(4, [(_model_check, c) for c in CASES], timeout=300)
    for case, per_rank in zip(CASES, results):
        want = _want_bytes(case[0], case[1], case[2], 4)
        for err, sent in per_rank:
            assert err < 1e-5, (case, err)
            assert {a: b for a, b in sent.items() if b} == want, case


# --------------------------------------------------------------------------------------------
# Training equals one process
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(corpus, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ulyref") / "single"
    train(load_config(None, tiny_overrides(corpus, cache_dir, out, train__steps=STEPS)))
    return {"losses": [r["loss"] for r in metrics(out)], "weights": final_weights(out)}


def _step_bytes(cfg, world: int) -> dict[str, int]:
    """Bytes per step on each cp axis: the accounting's, checked against the closed form
    per attention (rank 0's blocks, per microbatch; the forward twice under recompute)."""
    from threefold.accounting import comm_bytes_per_step
    from threefold.layout import Layout, Workload

    m, lay = cfg.model.resolved(320), Layout.from_config(cfg, world)
    got = comm_bytes_per_step(m, lay, Workload.from_config(cfg))
    tokens = lay.microbatch_size * 32 // lay.cp
    q, kv, out = (tokens * w * 4 for w in cp_attention_widths(m, lay.tp, lay.ulysses))
    forwards = 2 if lay.recompute == "full" else 1
    fwd, bwd = cp_bytes_per_attention(kv, lay.cp, lay.cp_algorithm, forwards, lay.ulysses, q,
                                      out)
    micro = 8 // lay.dp // lay.microbatch_size
    cp_axes = {a: got[a] for a in ("cp", "cp_inner", "cp_outer") if got[a]}
    assert sum(cp_axes.values()) == micro * (2 // lay.pp) * (fwd + bwd) > 0  # blocks of rank 0
    return cp_axes


RUNS_4 = [
    ("ulysses_cp2_tp2_sp", {"parallel__cp": 2, "parallel__cp_algorithm": "ulysses",
                            "parallel__tp": 2, "parallel__sequence_parallel": "true"}),
    ("ulysses_cp2_pp2", {"parallel__cp": 2, "parallel__cp_algorithm": "ulysses",
                         "parallel__pp": 2, "train__micro_batch_size": 2}),
    ("ring2_x_ulysses2_ac_zero1", {"parallel__cp": 4, "parallel__cp_ulysses": 2,
                                   "train__activation_checkpointing": "true",
                                   "train__micro_batch_size": 4, "parallel__zero_stage": 1}),
]


@pytest.mark.slow
def test_ulysses_layouts_train_as_one_process(reference, corpus, cache_dir, tmp_path):
    results = run_distributed(_runs, 4, corpus, cache_dir, tmp_path, RUNS_4, timeout=600)
    for name, extra in RUNS_4:
        _check_equal(reference, tmp_path / name)
        cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path, **extra))
        want = _step_bytes(cfg, 4)
        for per_rank in results:
            for axis, b in want.items():
                assert [s[axis] for s in per_rank[name]] == [b] * STEPS, (name, axis)


# --------------------------------------------------------------------------------------------
# A mixture of experts under cp
# --------------------------------------------------------------------------------------------
MOE_RUNS = [("ep2_cp2_zero1", {"parallel__ep": 2, "parallel__cp": 2,
                               "parallel__zero_stage": 1})]
MOE_STEPS = 2


def _moe_runs(rank, world, corpus, cache, root, runs):
    from tests.test_expert_parallel import MOE
    from threefold.parallel.distributed_world import Distributed

    for name, extra in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name, **{
            **MOE, "train__steps": MOE_STEPS, **extra}))
        train(cfg, Distributed(cfg))


@pytest.mark.slow
def test_experts_under_cp_train_as_one_process(corpus, cache_dir, tmp_path):
    """ep 2 × cp 2 on 4 ranks: each cp rank routes its tokens of the same sequences, the
    router losses pool f, P and z over cp, the experts' gradients are summed over their
    data ranks × cp ("edp"): the single process's losses, router losses, expert counts and
    weights; the bytes on cp, edp and dp_cp are the accounting's."""
    from tests.test_expert_parallel import MOE, _assert_equal
    from threefold.accounting import comm_bytes_per_step
    from threefold.layout import Layout, Workload

    single = tmp_path / "single"
    train(load_config(None, tiny_overrides(corpus, cache_dir, single, **{
        **MOE, "train__steps": MOE_STEPS, "train__micro_batch_size": 4})))
    want, weights = metrics(single), final_weights(single)
    run_distributed(_moe_runs, 4, corpus, cache_dir, tmp_path, MOE_RUNS)
    for name, extra in MOE_RUNS:
        _assert_equal(tmp_path / name, want, weights, name)
        cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path,
                                               **{**MOE, "train__steps": MOE_STEPS, **extra}))
        lay = Layout.from_config(cfg, 4)
        assert (lay.edp, lay.edp_shard) == (2, 2)  # dp_shard / ep × cp
        plan = comm_bytes_per_step(cfg.model.resolved(320), lay, Workload.from_config(cfg))
        assert plan["cp"] > 0 and plan["edp_shard"] > 0 and plan["dp_shard_cp"] > 0
        for rec in metrics(tmp_path / name):
            for axis in ("cp", "edp", "edp_shard", "dp_cp", "dp_shard_cp"):
                assert rec["comm_bytes"].get(axis, 0) == plan[axis], (name, axis)


def test_dry_run_of_a_hybrid_names_both_parts_and_counts_each_axis(monkeypatch, tmp_path):
    """The tiny model at 1K tokens on 8 ranks, cp 8 = ring 2 × Ulysses 4: the layout line names
    both parts; the all-to-alls' bytes are on cp_inner, the ring's on cp_outer, each the
    closed form's (4 blocks, 4 micro-batches)."""
    from threefold.launch.dryrun import predict
    from threefold.launch.dryrun_report import format_report

    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    base = [("model.preset", "tiny"), ("data.seq_len", "1024"),
            ("train.dtype", "bfloat16"), ("train.global_batch_size", "4"),
            ("train.micro_batch_size", "1"), ("parallel.cp", "8"), ("parallel.cp_ulysses", "4"),
            ("train.output_dir", str(tmp_path))]
    r = predict(load_config(None, base), 8)
    assert "cp 8 (ring 2 × ulysses 4, 128 tokens of each sequence per rank)" in \
        format_report(r, 8)
    n, e = 128, 2
    q, kv, out = (n * w * e for w in cp_attention_widths(ModelConfig(preset="tiny")
                                                          .resolved(512), 1, 4))
    a2a = 3 * (q + kv) // 4 + 3 * out // 4
    per = 4 * 4  # blocks × micro-batches
    assert r.comm_bytes["cp_inner"] == per * 2 * a2a
    assert r.comm_bytes["cp_outer"] == per * (kv + 3 * kv) and r.comm_bytes["cp"] == 0
