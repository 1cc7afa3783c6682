"""threefold.model.kernels: RMSNorm and SwiGLU keep fewer tensors for backward than the plain ops,
with the same forward and bit-identical gradients, and a zero-bubble W still gets the norm
weight's gradient after ZeRO-3 released the weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_tp_layer import SavedBytes
from threefold.model.kernels import rms_norm, swiglu


def _plain_rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_same_numbers_as_the_plain_ops(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    w = (torch.rand(64) + 0.5).requires_grad_()
    g = torch.randn(3, 5, 64)
    ours = rms_norm(x, w, 1e-5)
    plain = _plain_rms_norm(x, w, 1e-5)
    assert torch.equal(ours, plain)
    for a, b in zip(torch.autograd.grad(ours, (x, w), g), torch.autograd.grad(plain, (x, w), g)):
        assert torch.equal(a, b)
    gate = torch.randn(3, 5, 96, dtype=dtype, requires_grad=True)
    up = torch.randn(3, 5, 96, dtype=dtype, requires_grad=True)
    g2 = torch.randn(3, 5, 96, dtype=dtype)
    ours, plain = swiglu(gate, up), F.silu(gate) * up
    assert torch.equal(ours, plain)
    for a, b in zip(torch.autograd.grad(ours, (gate, up), g2),
                    torch.autograd.grad(plain, (gate, up), g2)):
        assert torch.equal(a, b)


def test_saved_bytes():
    """rms_norm keeps its input and 1/rms (the plain ops: the input, the normalised input and
    1/rms); swiglu keeps gate and up (the plain ops: gate, up and silu(gate))."""
    n, h, f = 40, 64, 96
    x = torch.randn(n, h, requires_grad=True)
    w = torch.ones(h, requires_grad=True)
    with SavedBytes([w]) as ours:
        rms_norm(x, w, 1e-5)
    with SavedBytes([w]) as plain:
        _plain_rms_norm(x, w, 1e-5)
    assert ours.total == 4 * n * h + 4 * n
    assert plain.total == 2 * 4 * n * h + 4 * n
    gate = torch.randn(n, f, requires_grad=True)
    up = torch.randn(n, f, requires_grad=True)
    with SavedBytes([]) as ours:
        swiglu(gate, up)
    with SavedBytes([]) as plain:
        F.silu(gate) * up
    assert ours.total == 2 * 4 * n * f
    assert plain.total == 3 * 4 * n * f


def test_zero_bubble_weight_gradient_after_the_weight_is_released():
    """The executor's split backward: B takes the input gradient, then (as ZeRO-3 does once
    the unit's backward is over) the weights' storage is released, then W accumulates the
    weights' gradients; they equal one ordinary backward's."""
    from threefold.parallel.pipeline.split_backward import SplitBackward

    torch.manual_seed(1)
    lin = torch.nn.Linear(16, 16)
    norm_w = torch.nn.Parameter(torch.rand(16) + 0.5)
    x = torch.randn(2, 3, 16, requires_grad=True)
    g = torch.randn(2, 3, 16)
    lin(rms_norm(x, norm_w, 1e-5)).backward(g)
    want = {"norm": norm_w.grad.clone(), "lin": lin.weight.grad.clone(), "x": x.grad.clone()}
    norm_w.grad = lin.weight.grad = lin.bias.grad = x.grad = None

    full = torch.empty(16)  # the weight's storage, released after B as ZeRO-3 releases it
    full.copy_(norm_w.detach())
    norm_w.data = full
    split = SplitBackward(lin(rms_norm(x, norm_w, 1e-5)), g, x, {norm_w, lin.weight, lin.bias})
    assert torch.equal(split.input_grad, want["x"])
    kept = full.clone()
    full.untyped_storage().resize_(0)
    split.weight_backward()
    assert torch.equal(norm_w.grad, want["norm"])
    assert torch.equal(lin.weight.grad, want["lin"])
    full.untyped_storage().resize_(16 * 4)
    full.copy_(kept)
