"""The chunked head loss (``threefold.model.head_loss``) against cross-entropy on whole logits: the
same per-token losses and gradients in fp32 for any chunking, temperature and ignored labels;
its two backward halves (a zero-bubble B and W) add up to the whole; under tensor
parallelism, vocabulary shards (padded when tp does not divide the vocabulary) give what the
whole head gives; under bf16 autocast it stays within bf16 rounding of the logits path; and
the memory it keeps is the planner's count (tests/test_dryrun.py, tests/test_cost.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist import run_distributed
from threefold.model.head_loss import LMHead, linear_cross_entropy
from threefold.families.shapes import chunk_tokens
from threefold.model.kernels import computing_half

N, H, V = 37, 16, 50


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=gen, dtype=torch.float64).float()
    w = (torch.randn(V, H, generator=gen) * 0.5)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[::5] = -100
    weights = torch.rand(N, generator=gen)  # a per-token weighting of the losses
    return h, w, labels, weights


def _reference(h, w, labels, weights, temperature):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = F.cross_entropy((h @ w.t()) / temperature, labels, reduction="none")
    gh, gw = torch.autograd.grad((loss * weights).sum(), [h, w])
    return loss.detach(), gh, gw


@pytest.mark.parametrize("chunk", [1, 6, 0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_cross_entropy_on_whole_logits(chunk, temperature):
    h, w, labels, weights = _inputs()
    want, want_gh, want_gw = _reference(h, w, labels, weights, temperature)
    h, w = h.requires_grad_(), w.requires_grad_()
    got = linear_cross_entropy(h, w, labels, temperature=temperature, chunk=chunk)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert (got[labels == -100] == 0).all()
    gh, gw = torch.autograd.grad((got * weights).sum(), [h, w])
    assert torch.allclose(gh, want_gh, rtol=1e-5, atol=1e-6)
    assert torch.allclose(gw, want_gw, rtol=1e-5, atol=1e-6)


def test_backward_halves_add_up_to_the_whole():
    """Asked for the input's gradient alone (B) the weight's is not computed, and the other
    way round (W); together they are the whole backward."""
    h, w, labels, weights = _inputs(1)
    h, w = h.requires_grad_(), w.requires_grad_()
    loss = (linear_cross_entropy(h, w, labels, chunk=8) * weights).sum()
    want_gh, want_gw = torch.autograd.grad(loss, [h, w], retain_graph=True)
    with computing_half("input"):
        (gh,) = torch.autograd.grad(loss, [h], retain_graph=True)
        w_in_b = torch.autograd.grad(loss, [w], retain_graph=True, allow_unused=True)[0]
    with computing_half("weight"):
        (gw,) = torch.autograd.grad(loss, [w], retain_graph=True)
        h_in_w = torch.autograd.grad(loss, [h], allow_unused=True)[0]
    assert torch.equal(gh, want_gh) and torch.equal(gw, want_gw)
    assert w_in_b is None and h_in_w is None  # each half computes only its own matmul


def test_lm_head_module_under_bf16_autocast():
    """``LMHead(h, labels=...)`` under bf16 autocast: the matmuls in bf16, the loss in fp32,
    equal to the logits path (bf16 logits widened, then cross-entropy) to bf16 rounding;
    without labels it is the plain Linear."""
    head = LMHead(H, V)
    h, _, labels, _ = _inputs(2)
    h = h.view(1, N, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(h).float()
        got = head(h, labels=labels.view(1, N))
    want = F.cross_entropy(logits[0], labels, reduction="none")
    assert got.dtype == torch.float32 and got.shape == (1, N)
    assert torch.allclose(got[0], want, rtol=1e-3, atol=1e-3)
    assert torch.equal(head(h), F.linear(h, head.weight))


def test_chunk_budget():
    assert chunk_tokens(16384, 32768) == 2048  # 256 MiB of fp32 logits
    assert chunk_tokens(100, 32768) == 100 and chunk_tokens(10, 2**40) == 1


def _vocab_parallel(rank: int, world: int, vocab: int) -> dict:
    """On each tp rank: its shard of the head and the loss, against the whole head."""
    from threefold.comm.counted import Comm
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh
    from threefold.model.head_loss import VocabShard

    dims = Layout(tp=world)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    h, _, labels, weights = _inputs(3)
    w = torch.randn(vocab, H, generator=torch.Generator().manual_seed(4))
    labels = labels.clamp(max=vocab - 1)
    labels[::5] = -100
    want, want_gh, want_gw = _reference(h, w, labels, weights, 0.9)
    rows = -(-vocab // world)
    local = torch.zeros(rows, H)
    lo, hi = rank * rows, min((rank + 1) * rows, vocab)
    local[:hi - lo] = w[lo:hi]
    h, local = h.requires_grad_(), local.requires_grad_()
    got = linear_cross_entropy(h, local, labels, temperature=0.9, chunk=5,
                               shard=VocabShard(comm, "tp", lo, vocab))
    gh, gw = torch.autograd.grad((got * weights).sum(), [h, local])
    return {"loss": float((got.detach() - want).abs().max()), "gh": gh, "want_gh": want_gh,
            "gw": float((gw[:hi - lo] - want_gw[lo:hi]).abs().max()),
            "pad": float(gw[hi - lo:].abs().max()) if hi - lo < rows else 0.0}


@pytest.mark.parametrize("vocab", [V, V - 1])  # 49 rows over 2 ranks: one padded row
def test_vocab_parallel_equals_the_whole_head(vocab):
    """Every rank's losses are the whole head's; its weight rows get their whole gradient
    (padded rows none); the input gradients through each rank's rows sum to the whole one
    (the sum over tp that the head's input operator makes in backward)."""
    results = run_distributed(_vocab_parallel, 2, vocab, timeout=120)
    for r in results:
        assert r["loss"] < 1e-5 and r["gw"] < 1e-5 and r["pad"] == 0.0, r
    gh = sum(r["gh"] for r in results)
    assert torch.allclose(gh, results[0]["want_gh"], rtol=1e-5, atol=1e-6)
