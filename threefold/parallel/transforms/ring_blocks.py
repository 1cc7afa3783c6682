"""The blocks of context-parallel attention: which tokens a ring rank holds (``chunk_index``:
chunks r and 2N−1−r of 2N, the causal load balance), which pairs of them see each other
(``visibility``), the pieces one ring step computes (``ring_pieces``), and one piece's
attention with its log-sum-exp and its backward through the fused kernel or the math path,
merged by the online softmax (``_merge``). ``threefold.parallel.transforms.context`` runs them
around the ring."""

from __future__ import annotations

from typing import NamedTuple

import torch

from threefold.parallel.transforms.cp_order import masked_block


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
