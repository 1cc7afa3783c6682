"""Ulysses context parallelism (Jacobs et al., "DeepSpeed Ulysses", arXiv 2309.14509): an
all-to-all among u ranks that each hold 1/u of a sequence's tokens for all heads gives each
1/u of the heads for all of those tokens; attention runs on whole sequences, and a second
all-to-all sends each token's output back to the rank that holds it.

Every rank then computes every query of its heads, so the causal mask gives every rank the
same work whatever tokens it held: Ulysses needs no head-tail reordering. Its ranks hold
contiguous slices (``threefold.parallel.transforms.context.token_index``), so what the
all-to-all gathers is already in position order. In a hybrid (USP, Fang & Zhao arXiv
2405.07719; Megatron's ``a2a+p2p``) the u slices are those of one ring rank's balanced share
(chunks i and 2N−1−i), which the ring then joins across the ring ranks.

Heads must split: query heads divisible by u (per tp rank); K/V heads per tp rank either
divisible by u or repeated up to u (each destination needs the K/V head its query heads
use), as Megatron does (``rules.heads_over_ulysses``, ``rules.kv_heads_over_ulysses``).

Bytes a rank sends per attention call: (u−1)/u of its q, K/V (as repeated) and output, once
forward (again under recompute) and once backward, in two all-to-alls each way
(``threefold.accounting.cp_bytes_per_attention``).
"""

from __future__ import annotations

import torch


class _AllToAll(torch.autograd.Function):
    """(u, n) rows, row j to rank j of ``axis``; row j of the result came from rank j. Its
    gradient takes the same trip back."""

    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x.contiguous(), axis)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        ctx.comm.all_to_all_single(out, grad.contiguous(), ctx.axis)
        return out, None, None


def repeat_heads(x: torch.Tensor, u: int) -> torch.Tensor:
    """(B, kv heads, T, d) with fewer kv heads than ``u`` -> (B, u, T, d), each head repeated
    for the u/kv ranks whose query heads use it (an expand: autograd keeps nothing)."""
    n = x.shape[1]
    if n >= u:
        return x
    return x[:, :, None].expand(-1, -1, u // n, -1, -1).flatten(1, 2)


def sequence_to_heads(tensors: list[torch.Tensor], comm, axis: str) -> list[torch.Tensor]:
    """Each (B, H, T/u, d) tensor of this rank's tokens -> (B, H/u, T, d): head group j of
    every tensor goes to rank j, in one all-to-all; rank j's tokens come back in rank order."""
    u = comm.size(axis)
    rows = [x.unflatten(1, (u, -1)).movedim(1, 0).reshape(u, -1) for x in tensors]
    got = _AllToAll.apply(torch.cat(rows, 1), comm, axis)
    out, start = [], 0
    for x, r in zip(tensors, rows):
        b, h, t, d = x.shape
        part = got[:, start:start + r.shape[1]].reshape(u, b, h // u, t, d)
        out.append(part.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * t, d))
        start += r.shape[1]
    return out


def heads_to_sequence(x: torch.Tensor, comm, axis: str) -> torch.Tensor:
    """(B, H/u, T, d) of this rank's heads -> (B, H, T/u, d) of its own tokens: token slice
    j goes to rank j; head group j comes back from rank j."""
    u = comm.size(axis)
    b, h, t, d = x.shape
    rows = x.unflatten(2, (u, t // u)).permute(2, 0, 1, 3, 4).reshape(u, -1)
    got = _AllToAll.apply(rows, comm, axis)
    return got.reshape(u, b, h, t // u, d).permute(1, 0, 2, 3, 4).reshape(b, u * h, t // u, d)


def ulysses_attention(q, k, v, comm, axis: str, core) -> torch.Tensor:
    """q (B, heads, T/u, d), k/v (B, kv heads, T/u, d) of this rank's tokens -> the output of
    its tokens (B, heads, T/u, v width), with ``core`` (q, k, v of heads/u heads over all T
    tokens -> their output) run between the two all-to-alls on ``axis``."""
    u = comm.size(axis)
    q, k, v = sequence_to_heads([q, repeat_heads(k, u), repeat_heads(v, u)], comm, axis)
    return heads_to_sequence(core(q, k, v), comm, axis)
