"""Megatron's conjugate operators for tensor parallelism (Shoeybi et al., arXiv 1909.08053
§3; under sequence parallelism Korthikanti et al., arXiv 2205.05198 §4), as autograd functions
through the counted communication layer: ``f`` (identity forward, gradient all-reduced), ``g``
(all-reduce forward, identity backward) and their sequence-parallel forms (all-gather /
reduce-scatter). ``threefold.parallel.transforms.tensor`` places them.
"""

from __future__ import annotations

import torch

AXIS = "tp"


# --------------------------------------------------------------------------------------------
# Conjugate operators (autograd functions through the communication layer)
# --------------------------------------------------------------------------------------------
def copy_to_tp(x: torch.Tensor, comm) -> torch.Tensor:
    """Megatron's f: ``x`` as it is forward, its gradient all-reduced over tp backward (a
    replicated weight whose gradient each tp rank sees only part of)."""
    return _CopyToTP.apply(x, comm)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward. Also wraps a replicated weight whose
    gradient each tp rank sees only part of (SP norms, replicated k/v)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, AXIS)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        out = x.contiguous().clone()
        comm.all_reduce(out, AXIS)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_seq(x: torch.Tensor, comm) -> torch.Tensor:
    t = comm.size(AXIS)
    xs = x.transpose(0, 1).contiguous()  # (s/t, b, h): the sequence leads, chunks concatenate
    out = torch.empty((xs.shape[0] * t, *xs.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, xs, AXIS)
    # contiguous: q/k/v (gate/up) then share one saved copy of the gathered input instead of
    # each saving its own
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, comm) -> torch.Tensor:
    t = comm.size(AXIS)
    xs = x.transpose(0, 1).contiguous()
    out = torch.empty((xs.shape[0] // t, *xs.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, xs, AXIS)
    return out.transpose(0, 1).contiguous()


class _GatherSeq(torch.autograd.Function):
    """f under sequence parallelism: all-gather on the sequence, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.comm), None


class _ReduceScatterSeq(torch.autograd.Function):
    """g under sequence parallelism: reduce-scatter on the sequence, all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.comm), None
