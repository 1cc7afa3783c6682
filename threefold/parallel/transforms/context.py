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
  contribution, and one last hop brings it home; each hop of dK/dV travels while the next
  rank computes its own share for that block. No rank ever holds more than two K/V blocks.
  Thanks to the balanced split, each step is one call of a fused attention kernel that
  returns its log-sum-exp (aten's CPU flash kernel; a math path elsewhere) on a block that is
  plainly causal, wholly visible, or half wholly visible (``ring_pieces``); packed documents
  add a mask. No T × T score matrix is ever formed.
- ``allgather`` (Llama 3's choice for long context, arXiv 2407.21783 §3.3.2): K and V are
  all-gathered over cp, each rank attends its queries to the whole sequence; backward
  reduce-scatters dK/dV. With grouped-query attention K/V are small (8 heads of 128 against 64
  query heads in Llama 3 70B), and one collective beats N−1 dependent hops.

Bytes a rank sends per attention call, with kv = the bytes of its local K and V together
(2 · B · kv_heads · T/N · head_dim · element size): ring forward (N−1)·kv, backward
(N−1)·kv + N·kv (the dK/dV hops); allgather forward (N−1)·kv (all-gather), backward (N−1)·kv
(reduce-scatter). Activation checkpointing runs the forward twice.
``threefold.accounting.cp_bytes_per_attention`` is that closed form; the planner and the tests use
it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from threefold.model.attention import Attention, sdpa_attention
from threefold.model.decoder import DecoderModel
from threefold.parallel.transforms.cp_order import (masked_block, rank_positions, row_visibility,
                                                   split_balance, take_positions)
from threefold.parallel.transforms.wrap import wrap


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


def shard_batch(micro: dict[str, torch.Tensor], cp: int, rank: int, balance: str = "causal"
                ) -> dict[str, torch.Tensor]:
    """This cp rank's share of a micro-batch of whole sequences: its tokens of every field in
    ``TOKEN_KEYS`` (positions 0..T−1 made explicit first: a shard cannot tell them), the
    rest (``document_ids``, a task's own per-sequence fields) as they are. ``balance``
    documents splits rows with ``document_ids`` by their documents (``cp_order``)."""
    if cp == 1:
        return micro
    ids = micro["input_ids"]
    b, t = ids.shape[:2]
    out = dict(micro)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(t, device=ids.device).expand(b, t)
    if balance == "documents" and out.get("document_ids") is not None:
        idx = rank_positions(out["document_ids"], cp, balance)[rank]
        return out | {key: take_positions(out[key], idx) for key in TOKEN_KEYS}
    idx = chunk_index(t, cp, rank, ids.device)
    for key in TOKEN_KEYS:
        out[key] = out[key][:, idx]
    return out


class CPMask(NamedTuple):
    """What a context-parallel attention gets as its mask: the whole sequence's document
    ids (B, T), or None for plain causal attention, and the (cp, B, T/cp) positions each
    rank holds when the rows are split by their documents (None: the head-tail chunks)."""

    document_ids: torch.Tensor | None
    positions: torch.Tensor | None = None


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
class Piece(NamedTuple):
    """One attention call of a ring step: query rows and key columns of the local blocks
    (slices), causal (a square block of increasing positions) or not, and an additive float
    mask (packed documents) or None, with the query rows that see any key under it."""

    rows: slice
    cols: slice
    causal: bool
    mask: torch.Tensor | None = None
    seen: torch.Tensor | None = None


def ring_pieces(n: int, r: int, src: int, tl: int, docs: torch.Tensor | None,
                dtype: torch.dtype, positions: torch.Tensor | None = None) -> list[Piece]:
    """What rank ``r``'s queries compute against the K/V block of rank ``src`` (``tl`` local
    tokens each: chunk c and chunk 2n−1−c of the sequence). The balanced split makes every
    pair simple: its own block is plain causal (its positions increase); an earlier rank's
    first chunk is wholly visible and its second wholly hidden; a later rank's block is
    wholly visible to the second query chunk and hidden from the first. Packed documents
    add a mask to each piece (pieces no query sees are dropped). A split by ``positions``
    (cp, B, T/cp) is one masked piece per block."""
    if positions is not None:
        block = masked_block(positions[r], positions[src], docs, dtype)
        return [] if block is False else [Piece(slice(0, tl), slice(0, tl), False, *block)]
    half = tl // 2
    if src == r:
        pieces = [Piece(slice(0, tl), slice(0, tl), True)]
    elif src < r:
        pieces = [Piece(slice(0, tl), slice(0, half), False)]
    else:
        pieces = [Piece(slice(half, tl), slice(0, tl), False)]
    if docs is None:
        return pieces
    q_idx, k_idx = chunk_index(tl * n, n, r, docs.device), chunk_index(tl * n, n, src, docs.device)
    out = []
    for pc in pieces:
        vis = visibility(q_idx[pc.rows], k_idx[pc.cols], docs)
        if vis is False:
            continue
        if vis is None:
            out.append(pc._replace(causal=False))
            continue
        mask = torch.zeros(vis.shape, dtype=dtype, device=docs.device)
        mask.masked_fill_(~vis, float("-inf"))
        out.append(Piece(pc.rows, pc.cols, False, mask, vis.any(-1)))  # (B, 1, Tq) rows seen
    return out


def _flash_forward():
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _fused(q: torch.Tensor, fused: bool | None) -> bool:
    """Whether to use aten's CPU flash kernel (the one fused kernel whose log-sum-exp output is
    public on every build); elsewhere the math path computes the same quantities."""
    return q.device.type == "cpu" if fused is None else fused


def _piece_forward(q, k, v, pc: Piece, scale: float, fused: bool | None = None):
    """(output, log-sum-exp) of one piece through the fused attention kernel that returns its
    log-sum-exp (on CPU aten's flash kernel; the math path elsewhere or with ``fused``
    False). Rows that see no key get log-sum-exp −inf, so the merge ignores them."""
    groups = q.shape[1] // k.shape[1]
    qs = q[:, :, pc.rows].contiguous()
    if _fused(q, fused):  # the CPU kernel takes grouped K/V as they are
        ks, vs = (x[:, :, pc.cols].contiguous() for x in (k, v))
        out, lse = _flash_forward()(qs, ks, vs, 0.0, pc.causal, attn_mask=pc.mask, scale=scale)
    else:  # the same quantities by the math path (fp32), on any device
        s, _, vs = _math_scores(qs, k, v, pc, groups, scale)
        lse = torch.logsumexp(s, -1)
        out = torch.matmul(torch.softmax(s, -1).nan_to_num(0.0), vs.float()).to(q.dtype)
    if pc.seen is not None:
        lse = lse.masked_fill(~pc.seen, float("-inf"))
    return out, lse


def _math_scores(qs, k, v, pc: Piece, groups: int, scale: float):
    """The math path's fp32 scores of one piece (causal and document masks applied) and its
    K and V blocks with each K/V head repeated for the query heads that share it."""
    ks, vs = (_repeat_kv(x[:, :, pc.cols], groups).contiguous() for x in (k, v))
    s = torch.matmul(qs.float(), ks.float().transpose(-1, -2)) * scale
    if pc.causal:
        s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
    if pc.mask is not None:
        s = s + pc.mask.float()
    return s, ks, vs


def _piece_backward(do, q, k, v, out, lse, pc: Piece, scale: float, fused: bool | None = None):
    """(dq rows, dk cols, dv cols) of one piece, from the whole attention's output and
    log-sum-exp (the block's own softmax is exp(s − lse) over the full row, FlashAttention-2's
    backward, arXiv 2307.08691 Alg. 2); dK/dV summed over the query heads sharing each."""
    groups = q.shape[1] // k.shape[1]
    qs, dos, outs = (x[:, :, pc.rows].contiguous() for x in (q, do, out))
    lses = lse[:, :, pc.rows].contiguous()
    if _fused(q, fused):  # grouped K/V in, their gradients out (summed over each group)
        ks, vs = (x[:, :, pc.cols].contiguous() for x in (k, v))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dos, qs, ks, vs, outs, lses, 0.0, pc.causal, attn_mask=pc.mask, scale=scale)
    s, ks, vs = _math_scores(qs, k, v, pc, groups, scale)
    p = torch.exp(s - lses.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dos.float())
    dp = torch.matmul(dos.float(), vs.float().transpose(-1, -2))
    ds = p * (dp - (dos.float() * outs.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, ks.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qs.float()) * scale
    if groups > 1:
        b, h, t, d = dk.shape
        dk = dk.view(b, h // groups, groups, t, d).sum(2)
        dv = dv.view(b, h // groups, groups, t, d).sum(2)
    return dq, dk, dv


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, o_b: torch.Tensor,
           lse_b: torch.Tensor) -> None:
    """Fold one piece's (output, log-sum-exp) into the running fp32 ones, in place: the
    online softmax's rescaling by exp(lse − new lse)."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, lse_b)
    safe = new.masked_fill(torch.isinf(new), 0.0)  # rows nothing has reached yet
    out[:, :, rows] = (out[:, :, rows] * torch.exp(old - safe).unsqueeze(-1)
                       + o_b.float() * torch.exp(lse_b - safe).unsqueeze(-1))
    lse[:, :, rows] = new


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
    sequence, K/V passed around the cp ring. Inputs as ``Attention.attend`` gets them."""

    @staticmethod
    def forward(ctx, q, k, v, docs, comm, seq_len, positions=None):
        with torch.autocast(q.device.type, enabled=False):  # the softmax merge stays fp32
            return RingAttention._forward(ctx, q, k, v, docs, comm, seq_len, positions)

    @staticmethod
    def _forward(ctx, q, k, v, docs, comm, seq_len, positions):
        ring = _Ring(comm)
        tl, d = q.shape[2:]
        scale = 1.0 / math.sqrt(d)
        out = lse = None
        kv = torch.stack([k, v]).contiguous()
        for step in range(ring.n):
            src = (ring.r - step) % ring.n
            pending = ring.shift(kv) if step < ring.n - 1 else None  # overlap the next hop
            for pc in ring_pieces(ring.n, ring.r, src, tl, docs, q.dtype, positions):
                o_b, lse_b = _piece_forward(q, kv[0], kv[1], pc, scale)
                if step == 0:  # its own block: every row, nothing to merge with yet
                    out, lse = o_b.float(), lse_b
                else:
                    _merge(out, lse, pc.rows, o_b, lse_b)
            if pending is not None:
                pending[0].wait()
                kv = pending[1]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.docs, ctx.comm, ctx.scale, ctx.positions = docs, comm, scale, positions
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = _Ring(ctx.comm), ctx.scale
        tl = q.shape[2]
        grad_out = grad_out.contiguous()
        kv = torch.stack([k, v]).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        incoming = None  # (handle, buffer): the held block's dK/dV summed by earlier ranks
        for step in range(ring.n):
            src = (ring.r - step) % ring.n
            pending = ring.shift(kv) if step < ring.n - 1 else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for pc in ring_pieces(ring.n, ring.r, src, tl, ctx.docs, q.dtype, ctx.positions):
                dq_b, dk_b, dv_b = _piece_backward(grad_out, q, kv[0], kv[1], out, lse, pc,
                                                   scale)
                dq[:, :, pc.rows] += dq_b
                dkv[0][:, :, pc.cols] += dk_b
                dkv[1][:, :, pc.cols] += dv_b
            # the block's dK/dV from the ranks before arrived while this rank computed its
            # own share; the sum goes on with the block (after the last step, home)
            if incoming is not None:
                incoming[0].wait()
                dkv += incoming[1].float()
            incoming = ring.shift(dkv.to(kv.dtype))
            if pending is not None:
                pending[0].wait()
                kv = pending[1]
        incoming[0].wait()  # this rank's own block, summed over every rank
        dkv = incoming[1]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


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


def allgather_attention(q, k, v, docs, comm, seq_len, positions=None):
    """This rank's queries against the all-gathered K/V of the whole sequence, through SDPA
    with the visibility mask of the keys' global positions."""
    n = comm.size(AXIS)
    full = GatherKV.apply(torch.stack([k, v]), comm)  # (N, 2, B, kvh, T/N, d)
    b, kvh, tl, d = k.shape
    full = full.permute(1, 2, 3, 0, 4, 5).reshape(2, b, kvh, n * tl, d)
    if positions is not None:  # split by documents: the positions say who holds what
        mask = row_visibility(positions[comm.rank(AXIS)], positions.permute(1, 0, 2).flatten(1),
                              docs)
    else:
        q_idx = chunk_index(seq_len, n, comm.rank(AXIS), q.device)
        k_idx = torch.cat([chunk_index(seq_len, n, j, q.device) for j in range(n)])
        mask = visibility(q_idx, k_idx, docs)  # never all False: a query sees itself
    if mask is None:
        mask = torch.ones(tl, n * tl, dtype=torch.bool, device=q.device)
    return sdpa_attention(q, full[0], full[1], mask)


# --------------------------------------------------------------------------------------------
# Applying it
# --------------------------------------------------------------------------------------------
class ContextParallelAttention(Attention):
    """An ``Attention`` whose queries, keys and values are this cp rank's share of a
    sequence ``cp`` times longer (``apply_context_parallel`` turns each attention into one,
    in place): its core attends over the whole sequence with ``algorithm`` (ring or
    allgather) on ``comm``'s "cp" axis. Its mask is the ``CPMask`` that
    ``ContextParallelDecoderModel`` makes."""

    comm = None
    cp = 1
    algorithm = "ring"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask=None) -> torch.Tensor:
        """q (B, heads, T/cp, d), k/v (B, kv heads, T/cp, d), this rank's tokens after RoPE
        -> (B, heads, T/cp, d), attended over every token of the sequence."""
        docs, pos = attn_mask if isinstance(attn_mask, CPMask) else (None, None)
        seq_len = q.shape[2] * self.cp
        if self.algorithm == "ring":
            return RingAttention.apply(q, k, v, docs, self.comm, seq_len, pos)
        return allgather_attention(q, k, v, docs, self.comm, seq_len, pos)

    def extra_repr(self) -> str:
        return f"cp={self.cp}, {self.algorithm}"


class ContextParallelDecoderModel(DecoderModel):
    """A ``DecoderModel`` whose blocks run on this cp rank's share of every sequence: the mask
    it gives each attention is the whole sequence's document ids (``CPMask``), from which
    ``ContextParallelAttention`` masks the pairs of tokens it meets; a local square mask
    would not say which documents other ranks' tokens belong to."""

    cp = 1
    balance = "causal"

    def attention_mask(self, document_ids: torch.Tensor | None) -> CPMask:
        """The whole sequence's document ids (B, T) or None (causal), as a ``CPMask``, with
        the positions of the split by documents when the rows are so split."""
        if self.balance != "documents" or document_ids is None:
            return CPMask(document_ids)
        return CPMask(document_ids, rank_positions(document_ids, self.cp, self.balance))

    def extra_repr(self) -> str:
        return f"cp={self.cp}, masks from the whole sequence's document ids"


def apply_context_parallel(model: torch.nn.Module, comm, algorithm: str = "ring",
                           balance: str = "causal") -> torch.nn.Module:
    """Make every attention of ``model`` (a whole model or a pipeline rank's chunks) attend
    over the whole sequence from this cp rank's share of it, with ``algorithm`` (ring or
    allgather): each ``Attention`` becomes a ``ContextParallelAttention`` and each
    ``DecoderModel`` a ``ContextParallelDecoderModel``. In place; parameter names do not change.
    Micro-batches must be cut with ``shard_batch`` (positions explicit, ``document_ids``
    whole) with the same ``balance`` (``split_balance`` of the configured one)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown cp algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    n = comm.size(AXIS)
    if n == 1:
        return model
    for mod in model.modules():
        if isinstance(mod, Attention):
            wrap(mod, ContextParallelAttention, comm=comm, cp=n, algorithm=algorithm)
        elif isinstance(mod, DecoderModel):
            wrap(mod, ContextParallelDecoderModel, cp=n, balance=split_balance(balance, algorithm))
    return model
