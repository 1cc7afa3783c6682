"""The LM head and its cross-entropy as one autograd function over chunks of tokens, so the
fp32 logits of a whole micro-batch never exist (at the 1.11B shape, seq 2048 × micro-batch 8 ×
vocab 32,768, they are 2 GiB; 8 GiB at vocab 128k).

``linear_cross_entropy(h, weight, labels)`` returns each token's loss, −log softmax(h·Wᵀ/τ)
at its label (0 where the label is ``ignore_index``), and is the one implementation behind the
pre-training and SFT loss, DPO's and GRPO's log-probabilities and validation. Per chunk of
``chunk`` tokens the forward computes the logits in the matmul dtype, widens them to fp32 and
keeps only the log-sum-exp; the backward recomputes them and turns softmax − one-hot into the
gradients of h and of the weight at once. Kept for backward per token: h (in the matmul dtype),
the label and the fp32 log-sum-exp — ``threefold.plan.activations.head_saved_bytes``.

Under tensor parallelism the weight holds this rank's rows of the vocabulary
(``VocabShard``): the log-sum-exp and the target logit are completed over "tp" with the same
three all-reduces of one float per token as Megatron's vocab-parallel cross-entropy (max,
sum of exponentials, target logit), and padded rows of the last shard are never a class.

Under a zero-bubble pipeline schedule (``threefold.parallel.pipeline.split_backward``) the
backward is asked for h's gradient alone (B) and later for the weight's alone (W):
``threefold.model.kernels.backward_half`` says which, and each half computes only its own matmul.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from threefold.model.kernels import backward_half, matmul_input
from threefold.families.shapes import chunk_tokens



@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's rows [offset, offset + rows) of a vocabulary of ``vocab`` classes split
    over ``axis`` of ``comm`` (rows past ``vocab`` pad the last shard)."""
    comm: object
    axis: str
    offset: int
    vocab: int


def _logits(h: torch.Tensor, w: torch.Tensor, temperature: float, shard) -> torch.Tensor:
    """fp32 logits of a chunk, divided by the temperature; -inf on padded vocabulary rows."""
    z = (h @ w.t()).float()
    if temperature != 1.0:
        z = z / temperature
    if shard is not None and shard.offset + z.shape[1] > shard.vocab:
        z[:, max(0, shard.vocab - shard.offset):] = float("-inf")
    return z


def _targets(labels: torch.Tensor, ignore_index: int, rows: int, shard):
    """(valid, mine, local index): labels that are targets, those among this rank's rows,
    and their row (0 where not mine)."""
    valid = labels != ignore_index
    local = labels - (shard.offset if shard is not None else 0)
    mine = valid & (local >= 0) & (local < rows)
    return valid, mine, torch.where(mine, local, torch.zeros_like(local))


class _LinearCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, h, weight, labels, temperature, ignore_index, chunk, shard):
        w = weight.to(h.dtype)
        n = h.shape[0]
        valid, mine, idx = _targets(labels, ignore_index, w.shape[0], shard)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        target = torch.empty_like(lse)
        for lo in range(0, n, chunk):
            z = _logits(h[lo:lo + chunk], w, temperature, shard)
            target[lo:lo + chunk] = z.gather(1, idx[lo:lo + chunk, None]).squeeze(1)
            top = z.max(-1).values  # log-sum-exp in place (torch.logsumexp makes a copy)
            lse[lo:lo + chunk] = z.sub_(top[:, None]).exp_().sum(-1).log_().add_(top)
            del z
        target = torch.where(mine, target, torch.zeros_like(target))
        if shard is not None:  # log Σ_ranks exp(lse_rank), from the largest, then the target
            top = lse.clone()
            shard.comm.all_reduce(top, shard.axis, op="max")
            total = lse.sub_(top).exp_()
            shard.comm.all_reduce(total, shard.axis)
            lse = total.log_().add_(top)
            shard.comm.all_reduce(target, shard.axis)
        ctx.save_for_backward(h, weight, labels, lse)
        ctx.temperature, ctx.ignore_index, ctx.chunk, ctx.shard = \
            temperature, ignore_index, chunk, shard
        return torch.where(valid, lse - target, torch.zeros_like(lse))

    @staticmethod
    def backward(ctx, grad):
        h, weight, labels, lse = ctx.saved_tensors
        half = backward_half()
        want_h = ctx.needs_input_grad[0] and half != "weight"
        want_w = ctx.needs_input_grad[1] and half != "input"
        w = weight.to(h.dtype)
        valid, mine, idx = _targets(labels, ctx.ignore_index, w.shape[0], ctx.shard)
        # d loss / d logit = (softmax − one-hot) · grad / temperature, on target tokens
        scale = torch.where(valid, grad, torch.zeros_like(grad)) / ctx.temperature
        hit = (-mine.to(torch.float32))[:, None]
        gh = torch.empty_like(h) if want_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if want_w else None
        for lo in range(0, h.shape[0], ctx.chunk):
            hi = min(lo + ctx.chunk, h.shape[0])
            z = _logits(h[lo:hi], w, ctx.temperature, ctx.shard)
            z.sub_(lse[lo:hi, None]).exp_().scatter_add_(1, idx[lo:hi, None], hit[lo:hi])
            g = z.mul_(scale[lo:hi, None]).to(h.dtype)  # in place, then one cast
            del z
            if want_h:
                gh[lo:hi] = g @ w
            if want_w:  # fp32: in place; else through the chunk's gradient in h's dtype
                gw.addmm_(g.t(), h[lo:hi]) if g.dtype == gw.dtype else gw.add_(g.t() @ h[lo:hi])
            del g
        return gh, gw.to(weight.dtype) if want_w else None, None, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         temperature: float = 1.0, ignore_index: int = -100, chunk: int = 0,
                         shard: VocabShard | None = None) -> torch.Tensor:
    """Per-token fp32 loss −log softmax(h·Wᵀ / temperature)[label] of ``h`` (N, hidden) and
    ``labels`` (N,), 0 where the label is ``ignore_index``. The matmuls run in h's dtype;
    ``chunk`` tokens at a time (0: ``chunk_tokens``'s budget)."""
    chunk = chunk or chunk_tokens(h.shape[0], weight.shape[0])
    device = h.device.type
    with torch.autocast(device, enabled=False):
        return _LinearCrossEntropy.apply(h, weight, labels, float(temperature), ignore_index,
                                         chunk, shard)


class LMHead(nn.Linear):
    """The LM head: ``head(h)`` gives logits in h's dtype (generation); ``head(h,
    labels=...)`` gives each token's fp32 loss (shaped as the labels) through
    ``linear_cross_entropy``, h cast once to the autocast dtype. Tensor parallelism sets
    ``shard`` to this rank's vocabulary rows; ``chunk`` tokens per chunk (0: automatic)."""

    shard: VocabShard | None = None
    chunk: int = 0

    def __init__(self, in_features: int, out_features: int, **kwargs):
        kwargs.setdefault("bias", False)
        super().__init__(in_features, out_features, **kwargs)

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None,
                temperature: float = 1.0) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        x = matmul_input(h)
        return linear_cross_entropy(x.flatten(0, -2), self.weight, labels.flatten(),
                                    temperature=temperature, chunk=self.chunk,
                                    shard=self.shard).view(labels.shape)
