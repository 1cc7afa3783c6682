"""Memory-lean autograd functions for the decoder's elementwise pieces: the same forward
arithmetic as the plain ops, op for op, and autograd's own backward formulas, but fewer
tensors kept between forward and backward (what ``threefold.plan.activations`` counts and
tests/test_dryrun.py measures). Under ``torch.compile`` they are the plain ops, so that a
compiled block is one graph the compiler fuses (tests/test_compile.py checks it has no
graph break).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

_HALF: list = [None]  # a plain global: CUDA backward runs on autograd's device threads


@contextlib.contextmanager
def computing_half(which: str | None) -> Iterator[None]:
    """Within this block a backward is asked for the inputs' gradients alone ("input", a
    zero-bubble B) or the weights' alone ("weight", its W); functions that compute both in
    one pass (``threefold.model.head_loss``) then compute only that half. None: both."""
    before, _HALF[0] = _HALF[0], which
    try:
        yield
    finally:
        _HALF[0] = before


def backward_half() -> str | None:
    """"input", "weight" or None (see ``computing_half``)."""
    return _HALF[0]


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` runs in: autocast's where it is on for x's device, else
    x's (for the matmuls autocast does not see: grouped experts, FP8, the fused overlap)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def matmul_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` cast once to the autocast dtype when autocast is on and ``x`` is wider (the fp32
    residual stream under bf16 autocast), else ``x``: the projections that read it (q, k, v;
    gate, up; the head) then share one saved copy for backward, where autocast would cast,
    and keep, a copy per projection. The same values reach the matmuls either way."""
    dtype = matmul_dtype(x)
    return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm whose backward keeps only the input and 1/rms (4 bytes a row): autograd alone
    would keep an fp32 copy of the input, 1/rms and the normalised input besides. The
    forward is the module's arithmetic, op for op; the backward is autograd's own formulas
    for those ops (mul, rsqrt, mean, pow, the casts), recomputing the normalised input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float,
                fp32_weight: bool = False) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.fp32_weight = fp32_weight
        if fp32_weight:  # (Gemma, OLMo 2: the weight multiplies in fp32, one rounding)
            return (xf * rstd * weight.float()).to(x.dtype)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()
        fp32 = ctx.fp32_weight
        normed = xf * rstd if fp32 else (xf * rstd).to(x.dtype)
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (grad.float() * normed if fp32 else grad * normed).sum_to_size(
                weight.shape).to(weight.dtype)
        if backward_half() == "weight" or weight.untyped_storage().nbytes() == 0:
            # a zero-bubble W asking for the weight's gradient alone (the executor's
            # SplitBackward), where autograd's own nodes skip the input's gradient too; the
            # weight may be released by then (ZeRO-3, after its unit's backward)
            return None, gw, None, None
        # through weight * n (then the cast; in fp32 with ``fp32_weight``)
        gn = grad.float() * weight.float() if fp32 else (grad * weight).to(x.dtype).float()
        # n = xf * rstd; rstd = rsqrt(mean(xf²) + eps): the two paths into xf
        gr = (gn * xf).sum(-1, keepdim=True)
        gsq = ((-0.5 * gr) * rstd.pow(3)).expand_as(xf) / xf.shape[-1]
        gx = gn * rstd + gsq * (2 * xf)
        return gx.to(x.dtype), gw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             fp32_weight: bool = False) -> torch.Tensor:
    """weight · (x / rms(x)) computed in fp32 and cast back to x's dtype before the weight
    (with ``fp32_weight``: after it, the product rounded once), keeping x and 1/rms for
    backward. Under ``torch.compile`` the same arithmetic as plain ops, which the compiler
    fuses (with RoPE, SwiGLU and the residual adds) into one graph per block and whose saved
    tensors its partitioner chooses: a custom backward would break the graph at every norm."""
    if torch.compiler.is_compiling():
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if fp32_weight:
            return (normed * weight.float()).to(x.dtype)
        return weight * normed.to(x.dtype)
    return _RMSNormFunction.apply(x, weight, eps, fp32_weight)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) · up keeping only gate and up for backward (silu(gate) is recomputed
    there, one elementwise op): three ffn-wide tensors per token with the down projection's
    input, where autograd alone keeps four. Same numbers: the backward is autograd's own
    products and ``silu_backward``."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up (Shazeer's SwiGLU without its projections), saving gate and up only;
    plain ops under ``torch.compile`` (see ``rms_norm``)."""
    if torch.compiler.is_compiling():
        return F.silu(gate) * up
    return _SwiGLU.apply(gate, up)


def _clamped_swiglu_ops(gate: torch.Tensor, up: torch.Tensor, alpha: float,
                        limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class _ClampedSwiGLU(torch.autograd.Function):
    """``clamped_swiglu`` keeping only gate and up for backward, as ``_SwiGLU`` does; the
    backward recomputes the forward's elementwise ops under autograd (autograd's numbers)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float):
        ctx.save_for_backward(gate, up)
        ctx.alpha, ctx.limit = alpha, limit
        return _clamped_swiglu_ops(gate, up, alpha, limit)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _clamped_swiglu_ops(gate, up, ctx.alpha, ctx.limit)
        dgate, dup = torch.autograd.grad(out, (gate, up), grad)
        return dgate, dup, None, None


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float,
                   limit: float) -> torch.Tensor:
    """GPT-OSS's experts' activation: gate clamped above at ``limit`` and up to ±``limit``,
    then (up + 1) · gate · sigmoid(``alpha`` · gate); saving gate and up only (plain ops
    under ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return _clamped_swiglu_ops(gate, up, alpha, limit)
    return _ClampedSwiGLU.apply(gate, up, alpha, limit)
