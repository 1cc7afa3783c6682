"""Context parallelism: every sequence split over the ranks of the "cp" axis.

Each of the N cp ranks holds 2 of the 2N equal chunks of every sequence, chunk i and chunk
2N−1−i (the load balance of Megatron's context parallelism and of the "zig-zag" ring): under
a causal mask the early chunks attend to little and the late ones to much, so pairing them
gives every rank the same attention work. Everything but attention is per token and runs
unchanged on the rank's tokens; the positions (RoPE), labels and packed documents' ids of the
whole sequence say what each local token is.

Attention needs every earlier key. Three algorithms (``parallel.cp_algorithm``); the first
two here (their blocks in ``threefold.parallel.transforms.ring_blocks``), the third in
``threefold.parallel.transforms.ulysses``:

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

- ``ulysses``: an all-to-all trades sequence shards for head shards, and each rank runs the
  model's own attention over whole sequences (``ulysses_attention``); its ranks hold
  contiguous slices. With ``parallel.cp_ulysses`` u (1 < u < cp) the two combine (a hybrid):
  Ulysses over the innermost u cp ranks (axis "cp_inner"), then the ring or the all-gather
  over the cp/u ring ranks (axis "cp_outer") on the gathered share (``token_index``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from threefold.model.attention import Attention, document_mask, sdpa_attention, window_mask
from threefold.model.decoder import DecoderModel
from threefold.model.mla import LatentAttention
from threefold.parallel.transforms.ring_blocks import (_merge, _piece_backward, _piece_forward,
                                                        chunk_index, ring_pieces, visibility)
from threefold.parallel.transforms.cp_order import (rank_positions, row_visibility, split_balance,
                                                   take_positions)
from threefold.parallel.transforms.ulysses import ulysses_attention
from threefold.parallel.transforms.wrap import wrap


AXIS = "cp"
ALGORITHMS = ("ring", "allgather", "ulysses")
TOKEN_KEYS = ("input_ids", "labels", "position_ids")
"""Per-token fields of a micro-batch that each cp rank keeps its share of. ``document_ids``
stays whole: attention masks need every token's document."""


# --------------------------------------------------------------------------------------------
# Which tokens a rank holds
# --------------------------------------------------------------------------------------------
def token_index(seq_len: int, cp: int, rank: int, ulysses: int = 1, device=None
                ) -> torch.Tensor:
    """Global positions of the tokens cp rank ``rank`` holds when ``ulysses`` of the cp ranks
    run Ulysses (the innermost: rank = ring rank · ulysses + Ulysses rank): its ring rank's
    balanced share (``chunk_index`` over cp/ulysses ring ranks; the whole sequence under pure
    Ulysses), cut in ``ulysses`` contiguous slices, this rank's the one of its Ulysses index.
    Ulysses' all-to-all gathers the slices in order, so each rank then sees its ring rank's
    share (pure Ulysses: the sequence) in position order and needs no reordering."""
    ring, (outer, inner) = cp // ulysses, divmod(rank, ulysses)
    share = chunk_index(seq_len, ring, outer, device) if ring > 1 else \
        torch.arange(seq_len, device=device)
    n = share.numel() // ulysses
    return share[inner * n:(inner + 1) * n]


def shard_batch(micro: dict[str, torch.Tensor], cp: int, rank: int, ulysses: int = 1,
                balance: str = "causal") -> dict[str, torch.Tensor]:
    """This cp rank's share of a micro-batch of whole sequences (``token_index``): its tokens
    of every field in ``TOKEN_KEYS`` it has (positions 0..T−1 made explicit first: a shard
    cannot tell them), the rest (``document_ids``, a task's own per-sequence fields) as they
    are. A micro-batch without ``input_ids`` (preference pairs) stays whole: its task cuts
    the rows it forms (``World.split_sequence``). ``balance`` documents splits rows with
    ``document_ids`` by their documents (``cp_order``; ``split_balance`` says where)."""
    if cp == 1 or "input_ids" not in micro:
        return micro
    ids = micro["input_ids"]
    b, t = ids.shape[:2]
    out = dict(micro)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(t, device=ids.device).expand(b, t)
    if balance == "documents" and out.get("document_ids") is not None:
        idx = rank_positions(out["document_ids"], cp, balance)[rank]
        return out | {key: take_positions(out[key], idx) for key in TOKEN_KEYS if key in out}
    idx = token_index(t, cp, rank, ulysses, ids.device)
    for key in TOKEN_KEYS:
        if key in out:
            out[key] = out[key][:, idx]
    return out


class SequenceSum(torch.autograd.Function):
    """Per-sequence partial sums of this cp rank's tokens (a log-prob, a score) summed over
    cp (an all-reduce), for a loss of whole sequences that every cp rank then computes alike.
    Backward sums the gradients over cp too: each rank's loss is counted once overall when
    each returns 1/cp of it (``World.sequence_sum``), and every rank's tokens get the whole
    loss's gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        out = x.detach().clone().contiguous()
        comm.all_reduce(out, AXIS)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone().contiguous()
        ctx.comm.all_reduce(grad, AXIS)
        return grad, None


class CPMask(NamedTuple):
    """What a context-parallel attention gets as its mask: the whole sequence's document
    ids (B, T), or None for plain causal attention, and the (cp, B, T/cp) positions each
    rank holds when the rows are split by their documents (None: ``token_index``'s)."""

    document_ids: torch.Tensor | None
    positions: torch.Tensor | None = None

    def __and__(self, _window) -> "CPMask":
        """The decoder limits a sliding-window layer's mask with ``&``; a window over the
        rank's local tokens would be wrong: each attention applies its own window to the
        whole sequence (Ulysses; the ring and the all-gather refuse windows)."""
        return self


# --------------------------------------------------------------------------------------------
# Ring attention
# --------------------------------------------------------------------------------------------
class _Ring:
    """The ring of ``axis`` ("cp", or a hybrid's "cp_outer") as seen from one rank:
    neighbours and a counted K/V hop."""

    def __init__(self, comm, axis: str = AXIS):
        self.comm, self.axis = comm, axis
        self.n, self.r = comm.size(axis), comm.rank(axis)
        ranks = comm.members(axis)
        self.next, self.prev = ranks[(self.r + 1) % self.n], ranks[(self.r - 1) % self.n]

    def shift(self, t: torch.Tensor):
        """Send ``t`` to the next rank and receive the previous rank's into a new buffer;
        returns (handle, buffer)."""
        buf = torch.empty_like(t)
        h = self.comm.batch_isend_irecv([("send", t, self.next), ("recv", buf, self.prev)],
                                        async_op=True, axis=self.axis)
        return h, buf


class RingAttention(torch.autograd.Function):
    """Causal (optionally per-document) attention of this rank's queries over the whole
    sequence, K/V passed around the ring of ``axis`` (cp; a hybrid's cp_outer, whose queries and
    keys are the ring rank's share after the all-to-all). Inputs as ``Attention.attend`` gets
    them."""

    @staticmethod
    def forward(ctx, q, k, v, docs, comm, seq_len, positions=None, axis=AXIS):
        with torch.autocast(q.device.type, enabled=False):  # the softmax merge stays fp32
            return RingAttention._forward(ctx, q, k, v, docs, comm, axis, positions)

    @staticmethod
    def _forward(ctx, q, k, v, docs, comm, axis, positions):
        ring = _Ring(comm, axis)
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
        ctx.docs, ctx.comm, ctx.scale, ctx.axis = docs, comm, scale, axis
        ctx.positions = positions
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = _Ring(ctx.comm, ctx.axis), ctx.scale
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
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None,
                None)


# --------------------------------------------------------------------------------------------
# All-gather attention
# --------------------------------------------------------------------------------------------
class GatherKV(torch.autograd.Function):
    """(2, B, kvh, T/N, d) local K/V -> (N, 2, B, kvh, T/N, d) of every rank of ``axis``
    (all-gather); backward reduce-scatters the gradient back to each rank's share."""

    @staticmethod
    def forward(ctx, kv, comm, axis=AXIS):
        ctx.comm, ctx.axis = comm, axis
        n = comm.size(axis)
        out = kv.new_empty((n * kv.shape[0], *kv.shape[1:]))  # c10d's layout: ranks on dim 0
        comm.all_gather(out, kv.contiguous(), axis)
        return out.view(n, *kv.shape)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[1:])
        ctx.comm.reduce_scatter(out, grad.contiguous().flatten(0, 1), ctx.axis)
        return out, None, None


def allgather_attention(q, k, v, docs, comm, seq_len, positions=None, axis=AXIS):
    """This rank's queries against the all-gathered K/V of the whole sequence (of ``axis``'s
    ranks: cp, or a hybrid's cp_outer), through SDPA with the visibility mask of the keys'
    global positions."""
    n = comm.size(axis)
    full = GatherKV.apply(torch.stack([k, v]), comm, axis)  # (N, 2, B, kvh, T/N, d)
    b, kvh, tl, d = k.shape
    full = full.permute(1, 2, 3, 0, 4, 5).reshape(2, b, kvh, n * tl, d)
    if positions is not None:  # split by documents: the positions say who holds what
        mask = row_visibility(positions[comm.rank(axis)], positions.permute(1, 0, 2).flatten(1),
                              docs)
    else:
        q_idx = chunk_index(seq_len, n, comm.rank(axis), q.device)
        k_idx = torch.cat([chunk_index(seq_len, n, j, q.device) for j in range(n)])
        mask = visibility(q_idx, k_idx, docs)  # never all False: a query sees itself
    if mask is None:
        mask = torch.ones(tl, n * tl, dtype=torch.bool, device=q.device)
    return sdpa_attention(q, full[0], full[1], mask)


# --------------------------------------------------------------------------------------------
# Applying it
# --------------------------------------------------------------------------------------------
class _ContextParallelCore:
    """The core of a context-parallel attention, whose queries, keys and values are this cp
    rank's share of a sequence ``cp`` times longer: it attends over the whole sequence.
    With ``ulysses`` > 1 an all-to-all first trades the sequence shards of the Ulysses ranks
    for head shards (``ulysses_attention``; on "cp", or a hybrid's "cp_inner"); what is then
    left apart, the ring rank's shares, is joined by ``algorithm`` (ring or allgather, on "cp"
    or a hybrid's "cp_outer"). Under pure Ulysses every rank holds whole sequences for its
    heads and runs the model's own attention, window and score scale included. Its mask is
    the ``CPMask`` that ``ContextParallelDecoderModel`` makes."""

    comm = None
    cp = 1
    algorithm = "ring"
    ulysses = 1  # the Ulysses ranks: cp under cp_algorithm ulysses, a hybrid's cp_ulysses

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask=None) -> torch.Tensor:
        """q (B, heads, T/cp, d), k/v (B, kv heads, T/cp, d), this rank's tokens after RoPE
        -> (B, heads, T/cp, d), attended over every token of the sequence."""
        docs, pos = attn_mask if isinstance(attn_mask, CPMask) else (None, None)
        if self.ulysses == 1:  # (only here can the rows be split by documents: split_balance)
            return self._across(q, k, v, docs, AXIS, pos)
        inner = AXIS if self.ulysses == self.cp else "cp_inner"
        return ulysses_attention(q, k, v, self.comm, inner,
                                 lambda *qkv: self._across(*qkv, docs, "cp_outer"))

    def _across(self, q, k, v, docs, axis: str, pos=None) -> torch.Tensor:
        """These queries (the ring rank's share of the sequence, whole sequences under pure
        Ulysses) attended over every key of the sequence."""
        if self.ulysses == self.cp:
            mask = document_mask(docs) if docs is not None else None
            mask = window_mask(mask, q.shape[2], self.window, q.device)
            return super().attend(q, k, v, mask)
        seq_len = q.shape[2] * (self.cp // self.ulysses)
        if self.algorithm == "ring":
            return RingAttention.apply(q, k, v, docs, self.comm, seq_len, pos, axis)
        return allgather_attention(q, k, v, docs, self.comm, seq_len, pos, axis)

    def extra_repr(self) -> str:
        hybrid = f" × ulysses {self.ulysses}" if 1 < self.ulysses < self.cp else ""
        return f"cp={self.cp}, {self.algorithm}{hybrid}"


class ContextParallelAttention(_ContextParallelCore, Attention):
    """An ``Attention`` over the whole sequence from this cp rank's share of it
    (``_ContextParallelCore``; ``apply_context_parallel`` turns each attention into one, in
    place)."""


class ContextParallelLatentAttention(_ContextParallelCore, LatentAttention):
    """A ``LatentAttention`` (DeepSeek's) over the whole sequence from this cp rank's share of
    it: Ulysses only (the ring and the all-gather refuse it, ``rules.cp_attention``)."""


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
                           ulysses: int = 1, balance: str = "causal") -> torch.nn.Module:
    """Make every attention of ``model`` (a whole model or a pipeline rank's chunks) attend
    over the whole sequence from this cp rank's share of it, with ``algorithm`` (ring,
    allgather or ulysses; ring or allgather with ``ulysses`` > 1 Ulysses ranks inside: the
    hybrid, ``parallel.cp_ulysses``): each ``Attention`` (``LatentAttention``) becomes a
    ``ContextParallelAttention`` (``ContextParallelLatentAttention``) and each ``DecoderModel`` a
    ``ContextParallelDecoderModel``. In place; parameter names do not change. Micro-batches
    must be cut with ``shard_batch`` (positions explicit, ``document_ids`` whole) with the
    same ``balance`` (``split_balance`` of the configured one)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown cp algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    n = comm.size(AXIS)
    if n == 1:
        return model
    u = n if algorithm == "ulysses" else ulysses
    for mod in model.modules():
        if isinstance(mod, (Attention, LatentAttention)):
            cls = ContextParallelAttention if isinstance(mod, Attention) else \
                ContextParallelLatentAttention
            wrap(mod, cls, comm=comm, cp=n, algorithm=algorithm, ulysses=u)
        elif isinstance(mod, DecoderModel):
            wrap(mod, ContextParallelDecoderModel, cp=n,
                 balance=split_balance(balance, algorithm, u))
    return model
