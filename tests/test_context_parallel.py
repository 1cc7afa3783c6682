"""Context parallelism: ring and all-gather attention equal attention over the whole sequence
(values and gradients, causal and packed documents), every cp layout trains to the
single-process losses and weights, the cp axis moves exactly the closed form's bytes, and
impossible layouts are refused before launch."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_checks, run_distributed
from tests.test_dp_zero import _check_equal
from threefold.config import ConfigError, load_config
from threefold.accounting import cp_bytes_per_attention
from threefold.parallel.transforms.context import shard_batch
from threefold.parallel.transforms.ring_blocks import chunk_index
from threefold.training.train import train

STEPS = 4
ALGORITHMS = ("ring", "allgather")


# --------------------------------------------------------------------------------------------
# The split and the attention kernels
# --------------------------------------------------------------------------------------------
def test_chunks_are_balanced_and_cover_the_sequence():
    for cp in (1, 2, 4):
        parts = [chunk_index(32, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(32))
        # every rank gets chunk r and chunk 2cp-1-r: the same causal work (sum of positions)
        assert len({int(p.sum()) for p in parts}) == 1
    assert chunk_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="2·cp"):
        chunk_index(30, 4, 0)
    batch = {"input_ids": torch.arange(16).view(1, 16), "labels": torch.arange(1, 17).view(1, 16),
             "document_ids": torch.zeros(1, 16, dtype=torch.long)}
    got = shard_batch(batch, 2, 1)
    assert got["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert got["labels"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert got["position_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert got["document_ids"].shape == (1, 16)  # whole: masks need every token's document


def _attention_check(rank, world, algorithm, packed, balance="causal"):
    """This cp rank's output and gradients against SDPA over the whole sequence, its tokens
    split head-tail or (``balance`` documents) by the packed documents."""
    from threefold.comm.counted import Comm
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh
    from threefold.model.attention import document_mask, sdpa_attention
    from threefold.parallel.transforms.context import RingAttention, allgather_attention
    from threefold.parallel.transforms.cp_order import rank_positions

    dims = Layout(cp=world)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    gen = torch.Generator().manual_seed(0)
    b, h, kvh, t, d = 2, 4, 2, 16, 8  # grouped-query: 2 query heads per key head
    q, k, v = (torch.randn(b, n, t, d, generator=gen).requires_grad_() for n in (h, kvh, kvh))
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16]) if packed else None
    ref = sdpa_attention(q, k, v, document_mask(docs) if packed else None)
    grad = torch.randn(ref.shape, generator=gen)
    ref.backward(grad)
    pos = rank_positions(docs, world, balance) if balance == "documents" else None
    idx = chunk_index(t, world, rank).expand(b, -1) if pos is None else pos[rank]
    assert pos is None or not torch.equal(idx, chunk_index(t, world, rank).expand(b, -1))

    def mine(x):  # (B, heads, T, d) -> this rank's tokens of each row
        return x.gather(2, idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))

    ql, kl, vl = (mine(x.detach()).clone().requires_grad_() for x in (q, k, v))
    fn = RingAttention.apply if algorithm == "ring" else allgather_attention
    out = fn(ql, kl, vl, docs, comm, t, pos)
    out.backward(mine(grad))
    err = {name: float((a - mine(r)).abs().max()) for name, a, r in
           (("out", out, ref), ("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad),
            ("dv", vl.grad, v.grad))}
    return err, sum(comm.totals()["cp"].values())


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_equals_whole_sequence_attention(world):
    cases = [(a, packed) for a in ALGORITHMS for packed in (False, True)]
    cases += [(a, True, "documents") for a in ALGORITHMS]  # rows split by their documents
    results = run_checks(world, [(_attention_check, c) for c in cases], timeout=120)
    kv_bytes = 2 * 2 * 2 * (16 // world) * 8 * 4  # K and V: b·kv_heads·T/N·d fp32
    for (algorithm, packed, *_), per_rank in zip(cases, results):
        fwd, bwd = cp_bytes_per_attention(kv_bytes, world, algorithm)
        for err, sent in per_rank:
            assert max(err.values()) < 5e-6, (algorithm, packed, err)
            assert sent == fwd + bwd, (algorithm, packed)


@pytest.mark.parametrize("causal,packed", [(True, False), (False, False), (False, True)])
def test_ring_piece_math_path_equals_the_fused_kernel(causal, packed):
    """The math path (used off CPU) computes the fused kernel's output, log-sum-exp and
    gradients, fully masked rows included."""
    from threefold.parallel.transforms.ring_blocks import Piece, _piece_backward, _piece_forward

    gen = torch.Generator().manual_seed(1)
    q, do = (torch.randn(2, 4, 8, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, 8, 16, generator=gen) for _ in range(2))
    mask = seen = None
    if packed:
        vis = torch.rand(2, 1, 8, 8, generator=gen) > 0.5
        vis[:, :, 0] = False  # a query row that sees nothing in this block
        mask = torch.zeros(vis.shape).masked_fill(~vis, float("-inf"))
        seen = vis.any(-1)
    pc = Piece(slice(0, 8), slice(0, 8), causal, mask, seen)
    fused = _piece_forward(q, k, v, pc, 0.25, fused=True)
    math_ = _piece_forward(q, k, v, pc, 0.25, fused=False)
    for a, b in zip(fused, math_):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    out, lse = fused
    lse = lse.masked_fill(torch.isinf(lse), 0.0)  # the whole row's lse, finite in real use
    for a, b in zip(_piece_backward(do, q, k, v, out, lse, pc, 0.25, fused=True),
                    _piece_backward(do, q, k, v, out, lse, pc, 0.25, fused=False)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_cp_byte_closed_forms():
    assert cp_bytes_per_attention(100, 1, "ring") == (0, 0)
    assert cp_bytes_per_attention(100, 4, "ring") == (300, 300 + 400)
    assert cp_bytes_per_attention(100, 4, "ring", forwards=2) == (600, 700)
    assert cp_bytes_per_attention(100, 4, "allgather") == (300, 300)
    # Ulysses: (u−1)/u of q, K/V and the output each way, forward and backward alike
    assert cp_bytes_per_attention(100, 4, "ulysses", q_bytes=200, out_bytes=200) == (375, 375)
    assert cp_bytes_per_attention(100, 4, "ulysses", 2, q_bytes=200, out_bytes=200) == (750,
                                                                                        375)
    # hybrid, 2 Ulysses × 2 ring ranks: the all-to-alls, then the ring of the K/V block
    a2a = 100 + 50
    assert cp_bytes_per_attention(100, 4, "ring", ulysses=2, q_bytes=100, out_bytes=100) == (
        a2a + 100, a2a + 100 + 200)
    assert cp_bytes_per_attention(100, 4, "allgather", ulysses=2, q_bytes=100,
                                  out_bytes=100) == (a2a + 100, a2a + 100)
    with pytest.raises(ValueError, match="cp algorithm"):
        cp_bytes_per_attention(100, 2, "tree")


# --------------------------------------------------------------------------------------------
# Training equals one process
# --------------------------------------------------------------------------------------------
def _runs(rank, world, corpus, cache, root, runs):
    from threefold.parallel.distributed_world import Distributed

    out = {}
    for name, extra in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name, train__steps=STEPS,
                                               **extra))
        layout = Distributed(cfg)
        train(cfg, layout)
        out[name] = layout._steps
    return out


@pytest.fixture(scope="module")
def reference(corpus, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cpref") / "single"
    train(load_config(None, tiny_overrides(corpus, cache_dir, out, train__steps=STEPS)))
    return {"losses": [r["loss"] for r in metrics(out)], "weights": final_weights(out)}


def _cp_step_bytes(extra: dict, world: int) -> int:
    """Closed-form bytes a rank sends on "cp" per step for a tiny-model run: per micro-batch,
    per layer, one attention's forward (twice with activation checkpointing) and backward."""
    cp, tp = int(extra["parallel__cp"]), int(extra.get("parallel__tp", 1))
    pp = int(extra.get("parallel__pp", 1))
    dp = world // (cp * tp * pp)
    mb = min(int(extra.get("train__micro_batch_size", 8)), 8 // dp)
    micro = 8 // dp // mb
    kv_heads, head_dim, layers = 2 // tp if tp <= 2 else 1, 64 // 4, 2 // pp
    kv_bytes = 2 * mb * kv_heads * (32 // cp) * head_dim * 4
    forwards = 2 if extra.get("train__activation_checkpointing") == "true" else 1
    fwd, bwd = cp_bytes_per_attention(kv_bytes, cp, extra["parallel__cp_algorithm"], forwards)
    return micro * layers * (fwd + bwd)


def _with(algorithm: str, runs: list) -> list:
    return [(f"{name}_{algorithm}", {**extra, "parallel__cp_algorithm": algorithm})
            for name, extra in runs]


RUNS_2 = [
    ("cp2", {"parallel__cp": 2}),
    ("cp2_ac_accum", {"parallel__cp": 2, "train__activation_checkpointing": "true",
                      "train__micro_batch_size": 4}),
]
RUNS_4 = [
    ("cp4", {"parallel__cp": 4}),
    ("cp2_tp2_sp", {"parallel__cp": 2, "parallel__tp": 2, "parallel__sequence_parallel": "true"}),
    ("cp2_dp2_zero1", {"parallel__cp": 2, "parallel__zero_stage": 1}),
    ("cp2_dp2_zero3", {"parallel__cp": 2, "parallel__zero_stage": 3}),
    ("cp2_pp2", {"parallel__cp": 2, "parallel__pp": 2, "train__micro_batch_size": 2}),
]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world,runs", [(2, RUNS_2), (4, RUNS_4)], ids=["2ranks", "4ranks"])
def test_cp_layouts_equal_single_process(world, runs, algorithm, reference, corpus, cache_dir,
                                         tmp_path):
    runs = _with(algorithm, runs)
    results = run_distributed(_runs, world, corpus, cache_dir, tmp_path, runs, timeout=600)
    for name, extra in runs:
        _check_equal(reference, tmp_path / name)
        want = _cp_step_bytes(extra, world)
        assert want > 0
        for per_rank in results:
            assert [s["cp"] for s in per_rank[name]] == [want] * STEPS, name


@pytest.mark.slow
def test_sft_packed_under_cp_equals_single_process(corpus, cache_dir, tmp_path):
    """Packed conversations (per-document attention, positions restarting per document) split
    over cp ranks by their documents (``parallel.cp_balance documents``, the default): the
    masks see the whole sequence's document ids and the positions each rank holds."""
    from tests.dist import train_runs
    from tests.test_sft import post_overrides
    from threefold.post import SFTTask

    train(load_config(None, post_overrides(corpus, cache_dir, tmp_path / "single")),
          task=SFTTask())
    runs = [(f"cp2_{a}", {"parallel__cp": 2, "parallel__cp_algorithm": a,
                          "train__micro_batch_size": 4}) for a in ALGORITHMS]
    run_distributed(train_runs, 2, functools.partial(post_overrides, corpus, cache_dir),
                    tmp_path, runs, SFTTask, timeout=300)
    ref = [r["loss"] for r in metrics(tmp_path / "single")]
    ref_w = final_weights(tmp_path / "single")
    for name, _ in runs:
        assert [r["loss"] for r in metrics(tmp_path / name)] == pytest.approx(ref, rel=1e-5)
        w = final_weights(tmp_path / name)
        for k, v in ref_w.items():
            torch.testing.assert_close(w[k], v, rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")


# --------------------------------------------------------------------------------------------
# Refused before launch
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world,extra,match", [
    (4, {"parallel__cp": 2, "data__seq_len": 30}, r"data.seq_len: 30 .*2·parallel.cp = 4"),
    (4, {"parallel__cp": 3}, r"parallel.cp: 3 does not divide world size 4"),
    (4, {"parallel__cp": 2, "parallel__tp": 2, "parallel__dp_shard": 2},
     r"parallel.dp_shard: .*cp·tp"),
    (8, {"parallel__cp": 2, "parallel__tp": 4, "parallel__sequence_parallel": "true",
         "data__seq_len": 36}, r"data.seq_len / parallel.cp = 18 is not divisible by parallel.tp"),
    (2, {"parallel__cp_algorithm": "rings"}, r"parallel.cp_algorithm: unknown value 'rings'"),
])
def test_impossible_cp_layouts_are_refused(world, extra, match, corpus, cache_dir, tmp_path):
    from threefold.layout import validate_layout

    with pytest.raises(ConfigError, match=match):
        cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path, **extra))
        validate_layout(cfg, world, cfg.model.resolved(320))
