"""Context parallelism: every sequence split over the ranks of the "cp" axis.

Each of the N cp ranks holds 2 of the 2N equal chunks of every sequence, chunk i and chunk
2N−1−i (the load balance of Megatron's context parallelism and of the "zig-zag" ring): under
a causal mask the early chunks attend to little and the late ones to much, so pairing them
gives every rank the same attention work. Everything but attention is per token and runs
unchanged on the rank's tokens; the positions (RoPE), labels and packed documents' ids of the
whole sequence say what each local token is.

Attention needs every earlier key. Two algorithms (``parallel.cp_algorithm``):

- ``ring`` (Liu et al., "Ring Attention", arXiv 2310.01889): the K/V of each rank travel
  around the ring of cp ranks, one hop per step, N−1 hops; each rank attends its queries to the
  block it holds and merges the partial results by their log-sum-exp (the online softmax of
  FlashAttention, Dao et al. arXiv 2205.14135). The next block's transfer is posted before the
  current block is computed, so it overlaps. Backward runs the ring again: K/V travel as in
  forward and each block's dK/dV accumulator travels with it, picking up every rank's
  contribution, and one last hop brings it home. No rank ever holds more than two K/V blocks.
- ``allgather`` (Llama 3's choice for long context, arXiv 2407.21783 §3.3.2): K and V are
  all-gathered over cp, each rank attends its queries to the whole sequence; backward
  reduce-scatters dK/dV. With grouped-query attention K/V are small (8 heads of 128 against 64
  query heads in Llama 3 70B), and one collective beats N−1 dependent hops.

Bytes a rank sends per attention call, with kv = the bytes of its local K and V together
(2 · B · kv_heads · T/N · head_dim · element size): ring forward (N−1)·kv, backward
(N−1)·kv + N·kv (the dK/dV hops); allgather forward (N−1)·kv (all-gather), backward (N−1)·kv
(reduce-scatter). Activation checkpointing runs the forward twice.
``threefold.cost.cp_bytes_per_attention`` is that closed form; the planner and the tests use
it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from threefold.cost import cp_bytes_per_attention  # noqa: F401 - the closed form lives there

AXIS = "cp"
ALGORITHMS = ("ring", "allgather")
TOKEN_KEYS = ("input_ids", "labels", "position_ids")
"""Per-token fields of a micro-batch that each cp rank keeps its share of. ``document_ids``
stays whole: attention masks need every token's document."""


# --------------------------------------------------------------------------------------------
# Which tokens a rank holds
# --------------------------------------------------------------------------------------------
def chunk_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens cp rank ``rank`` holds: chunks ``rank`` and
    ``2·cp − 1 − rank`` of ``2·cp`` (seq_len must divide by 2·cp)."""
    c = seq_len // (2 * cp)
    if c * 2 * cp != seq_len:
        raise ValueError(f"context parallel: sequence length {seq_len} is not divisible by "
                         f"2·cp = {2 * cp}")
    lo, hi = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(lo, lo + c, device=device),
                      torch.arange(hi, hi + c, device=device)])


def shard_batch(micro: dict[str, torch.Tensor], cp: int, rank: int) -> dict[str, torch.Tensor]:
    """This cp rank's share of a micro-batch of whole sequences: its tokens of every field in
    ``TOKEN_KEYS`` (positions 0..T−1 made explicit first: a shard cannot tell them), the
    rest (``document_ids``, a task's own per-sequence fields) as they are."""
    if cp == 1:
        return micro
    ids = micro["input_ids"]
    b, t = ids.shape[:2]
    out = dict(micro)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(t, device=ids.device).expand(b, t)
    idx = chunk_index(t, cp, rank, ids.device)
    for key in TOKEN_KEYS:
        out[key] = out[key][:, idx]
    return out


class CPMask(NamedTuple):
    """What a context-parallel attention gets as its mask: the whole sequence's document
    ids (B, T), or None for plain causal attention."""

    document_ids: torch.Tensor | None


def visibility(q_idx: torch.Tensor, k_idx: torch.Tensor, docs: torch.Tensor | None):
    """Which keys each query may attend: True where the key is not later than the query and,
    with packed documents, in the same one. Returns a (Tq, Tk) or (B, 1, Tq, Tk) boolean
    mask, None when every pair is visible, or False when none is (the block is skipped)."""
    m = k_idx[None, :] <= q_idx[:, None]
    if docs is not None:
        same = docs[:, q_idx][:, :, None] == docs[:, k_idx][:, None, :]
        m = (m[None] & same)[:, None]
    if bool(m.all()):
        return None
    if not bool(m.any()):
        return False
    return m


# --------------------------------------------------------------------------------------------
# Attention of a query block against one key block, with its log-sum-exp
# --------------------------------------------------------------------------------------------
def _scores(q5: torch.Tensor, k: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """q5 (B, kvh, g, Tq, d) against k (B, kvh, Tk, d) -> (B, kvh, g, Tq, Tk), masked to
    −inf."""
    s = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        m = mask if mask.dim() == 2 else mask.unsqueeze(2)  # (B, 1, 1, Tq, Tk)
        s = s.masked_fill(~m, float("-inf"))
    return s


class _OnlineSoftmax:
    """Running max, denominator and weighted sum of values over key blocks (fp32)."""

    def __init__(self, q5: torch.Tensor):
        shape = q5.shape[:-1]
        self.m = torch.full(shape, float("-inf"), dtype=torch.float32, device=q5.device)
        self.l = torch.zeros(shape, dtype=torch.float32, device=q5.device)
        self.acc = torch.zeros(q5.shape, dtype=torch.float32, device=q5.device)

    def add(self, s: torch.Tensor, v: torch.Tensor) -> None:
        """Fold in one block's scores ``s`` and values ``v`` (B, kvh, Tk, d)."""
        m_new = torch.maximum(self.m, s.amax(-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(self.m - safe)
        p = torch.exp(s - safe.unsqueeze(-1))
        self.l = self.l * alpha + p.sum(-1)
        self.acc = self.acc * alpha.unsqueeze(-1) + torch.matmul(p, v.unsqueeze(2).float())
        self.m = m_new

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output (B, kvh, g, Tq, d), log-sum-exp (B, kvh, g, Tq)); every query row has seen
        at least itself, so the denominator is positive."""
        return self.acc / self.l.unsqueeze(-1), self.m + torch.log(self.l)


def _block_backward(q5, k, v, do5, lse, delta, mask, scale):
    """Gradients of one (query block, key block) pair: (dq5, dk, dv) from the saved
    log-sum-exp (FlashAttention-2's backward, arXiv 2307.08691, Alg. 2)."""
    s = _scores(q5, k, mask, scale)
    p = torch.exp(s - lse.unsqueeze(-1))  # masked entries: exp(−inf) = 0
    dv = torch.matmul(p.transpose(-1, -2), do5).sum(2)
    dp = torch.matmul(do5, v.unsqueeze(2).transpose(-1, -2).float())
    ds = p * (dp - delta.unsqueeze(-1))
    dq5 = torch.matmul(ds, k.unsqueeze(2).float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2) * scale
    return dq5, dk, dv


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, T, d) -> (B, kv_heads, H/kv_heads, T, d) in fp32 (query heads grouped by the key
    head they share, as repeat_interleave lays them out)."""
    b, h, t, d = q.shape
    return q.float().reshape(b, kv_heads, h // kv_heads, t, d)


# --------------------------------------------------------------------------------------------
# Ring attention
# --------------------------------------------------------------------------------------------
class _Ring:
    """The cp ring as seen from one rank: neighbours and a counted K/V hop."""

    def __init__(self, comm):
        self.comm = comm
        self.n, self.r = comm.size(AXIS), comm.rank(AXIS)
        ranks = comm.dims.axis_ranks(comm.global_rank, AXIS)
        self.next, self.prev = ranks[(self.r + 1) % self.n], ranks[(self.r - 1) % self.n]

    def shift(self, t: torch.Tensor):
        """Send ``t`` to the next rank and receive the previous rank's into a new buffer;
        returns (handle, buffer)."""
        buf = torch.empty_like(t)
        h = self.comm.batch_isend_irecv([("send", t, self.next), ("recv", buf, self.prev)],
                                        async_op=True, axis=AXIS)
        return h, buf


class RingAttention(torch.autograd.Function):
    """Causal (optionally per-document) attention of this rank's queries over the whole
    sequence, K/V passed around the cp ring. Inputs as ``LlamaAttention.attend`` gets them."""

    @staticmethod
    def forward(ctx, q, k, v, docs, comm, seq_len):
        with torch.autocast(q.device.type, enabled=False):  # the softmax merge stays fp32
            return RingAttention._forward(ctx, q, k, v, docs, comm, seq_len)

    @staticmethod
    def _forward(ctx, q, k, v, docs, comm, seq_len):
        ring, kvh = _Ring(comm), k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        q5 = _grouped(q, kvh)
        q_idx = chunk_index(seq_len, ring.n, ring.r, q.device)
        kv = torch.stack([k, v]).contiguous()
        acc = _OnlineSoftmax(q5)
        for step in range(ring.n):
            src = (ring.r - step) % ring.n
            pending = ring.shift(kv) if step < ring.n - 1 else None  # overlap the next hop
            mask = visibility(q_idx, chunk_index(seq_len, ring.n, src, q.device), docs)
            if mask is not False:
                acc.add(_scores(q5, kv[0].float(), mask, scale), kv[1])
            if pending is not None:
                pending[0].wait()
                kv = pending[1]
        out5, lse = acc.result()
        ctx.save_for_backward(q, k, v, out5, lse)
        ctx.docs, ctx.comm, ctx.seq_len, ctx.scale = docs, comm, seq_len, scale
        b, h, t, d = q.shape
        return out5.reshape(b, h, t, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out5, lse = ctx.saved_tensors
        ring, kvh, scale = _Ring(ctx.comm), k.shape[1], ctx.scale
        q5 = _grouped(q, kvh)
        do5 = _grouped(grad_out, kvh)
        delta = (do5 * out5).sum(-1)
        q_idx = chunk_index(ctx.seq_len, ring.n, ring.r, q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        dq5 = torch.zeros_like(q5)
        for step in range(ring.n):
            src = (ring.r - step) % ring.n
            pending = ring.shift(kv) if step < ring.n - 1 else None
            mask = visibility(q_idx, chunk_index(ctx.seq_len, ring.n, src, q.device), ctx.docs)
            if mask is not False:
                dq_b, dk_b, dv_b = _block_backward(q5, kv[0].float(), kv[1], do5, lse, delta,
                                                   mask, scale)
                dq5 += dq_b
                dkv[0] += dk_b
                dkv[1] += dv_b
            # this block's dK/dV go on with it; after the last step, home to their owner
            h, dkv = ring.shift(dkv.to(kv.dtype) if kv.dtype != torch.float32 else dkv)
            if pending is not None:
                pending[0].wait()
                kv = pending[1]
            h.wait()
            dkv = dkv.float()
        b, hq, t, d = q.shape
        return (dq5.reshape(b, hq, t, d).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None)


# --------------------------------------------------------------------------------------------
# All-gather attention
# --------------------------------------------------------------------------------------------
class GatherKV(torch.autograd.Function):
    """(2, B, kvh, T/N, d) local K/V -> (N, 2, B, kvh, T/N, d) of every cp rank (all-gather);
    backward reduce-scatters the gradient back to each rank's share."""

    @staticmethod
    def forward(ctx, kv, comm):
        ctx.comm = comm
        n = comm.size(AXIS)
        out = kv.new_empty((n * kv.shape[0], *kv.shape[1:]))  # c10d's layout: ranks on dim 0
        comm.all_gather(out, kv.contiguous(), AXIS)
        return out.view(n, *kv.shape)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[1:])
        ctx.comm.reduce_scatter(out, grad.contiguous().flatten(0, 1), AXIS)
        return out, None


def allgather_attention(q, k, v, docs, comm, seq_len):
    """This rank's queries against the all-gathered K/V of the whole sequence, through SDPA
    with the visibility mask of the keys' global positions."""
    from threefold.model import sdpa_attention

    n = comm.size(AXIS)
    full = GatherKV.apply(torch.stack([k, v]), comm)  # (N, 2, B, kvh, T/N, d)
    b, kvh, tl, d = k.shape
    full = full.permute(1, 2, 3, 0, 4, 5).reshape(2, b, kvh, n * tl, d)
    q_idx = chunk_index(seq_len, n, comm.rank(AXIS), q.device)
    k_idx = torch.cat([chunk_index(seq_len, n, j, q.device) for j in range(n)])
    mask = visibility(q_idx, k_idx, docs)  # never all False: a query sees itself
    if mask is None:
        mask = torch.ones(tl, n * tl, dtype=torch.bool, device=q.device)
    return sdpa_attention(q, full[0], full[1], mask)


# --------------------------------------------------------------------------------------------
# Applying it
# --------------------------------------------------------------------------------------------
def apply_context_parallel(model: torch.nn.Module, comm, algorithm: str = "ring"
                           ) -> torch.nn.Module:
    """Make every attention of ``model`` (a whole model or a pipeline rank's chunks) attend
    over the whole sequence from this cp rank's share of it, with ``algorithm`` (ring or
    allgather). In place; parameter names do not change. Micro-batches must be cut with
    ``shard_batch`` (positions explicit, ``document_ids`` whole)."""
    from threefold.model import LlamaAttention, LlamaModel

    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown cp algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    n = comm.size(AXIS)
    if n == 1:
        return model

    def attend(q, k, v, mask):
        docs = mask.document_ids if isinstance(mask, CPMask) else None
        seq_len = q.shape[2] * n
        if algorithm == "ring":
            return RingAttention.apply(q, k, v, docs, comm, seq_len)
        return allgather_attention(q, k, v, docs, comm, seq_len)

    for mod in model.modules():
        if isinstance(mod, LlamaAttention):
            mod.attend = attend
        elif isinstance(mod, LlamaModel):
            mod.attention_mask = lambda document_ids: CPMask(document_ids)
    model.cp_size = n
    return model
