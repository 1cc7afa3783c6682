"""FP8 for a mixture of experts' routed experts (``train.fp8``): each ``Experts`` becomes a
``Float8Experts`` (``apply_fp8_experts``, after expert parallelism, whose wrapper it
composes with), whose two grouped products (gate/up, then down) run in FP8 by the same
recipe as the blocks' projections (``threefold.parallel.transforms.fp8_linear``), forward and
backward, each expert as if it were one FP8 linear layer of its own:

- ``tensorwise``: one scale per expert for its rows, its weight and its rows' output
  gradient (e4m3, e4m3, e5m2), scales as computed;
- ``rowwise``: per row along each matmul's inner dimension, powers of 2, all e4m3;
- ``blockwise``: DeepSeek-V3's tiles and blocks (``threefold.parallel.transforms.fp8_blockwise``).

How the products run:

- ``torch._scaled_grouped_mm`` (one kernel over every expert) where ``grouped_fp8_unfit``
  finds no reason against it: rowwise, bf16, CUDA compute capability 9.x or 10.x, widths
  multiples of 16 (torch's grouped FP8 kernel takes e4m3 operands with rowwise scales; the
  CPU build raises NotImplementedError, and the decision is made from the device, not by
  catching it). It runs the forward and the input gradient, whose rowwise scales are the
  per-expert ones (a row's scale does not depend on its group); the weight gradient, whose
  inner dimension is each expert's ragged token count, runs per expert;
- elsewhere, the CPU included, one ``torch._scaled_mm`` per expert that got rows: exactly
  the FP8 linear layer's arithmetic on that expert's rows (tests/test_fp8_experts.py checks
  it bit for bit).

Saved for backward: what the high-precision experts keep (the rows in the compute dtype, the
first product, the SwiGLU output, the group offsets where the grouped matmul runs), not the
autocast copies of the expert weights (FP8 casts the fp32 weights itself), plus tensorwise's
two fp32 scales per expert and projection, or blockwise's weight-block scales
(``threefold.plan.activations.fp8_scale_bytes`` counts them).
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.model.experts import Experts, grouped_mm_unfit
from threefold.model.kernels import matmul_dtype, swiglu
from threefold.parallel.transforms.fp8_blockwise import (block_scales, blockwise_forward,
                                                          blockwise_grads)
from threefold.parallel.transforms.fp8_cast import ALIGN, E4M3, E5M2, _cast, _mm8, _scale
from threefold.parallel.transforms.wrap import wrap


def grouped_fp8_unfit(device: torch.device, recipe: str, dtype: torch.dtype, hidden: int,
                      ffn: int, capability: tuple[int, int] | None = None) -> str | None:
    """Why ``torch._scaled_grouped_mm`` should not run these experts (None: it should)."""
    if recipe != "rowwise":
        return f"recipe {recipe} (torch's grouped FP8 kernel takes rowwise e4m3 scaling)"
    if device.type != "cuda":
        return f"device {device.type} (torch's grouped FP8 kernel is CUDA only)"
    if dtype != torch.bfloat16:
        return f"dtype {dtype} (the grouped FP8 kernel writes bf16)"
    if hidden % ALIGN or ffn % ALIGN:
        return f"widths {hidden}, {ffn} (the grouped FP8 kernel needs multiples of {ALIGN})"
    major = (capability or torch.cuda.get_device_capability(device))[0]
    if major not in (9, 10):
        return f"compute capability {major}.x (the grouped FP8 kernel needs 9.x or 10.x)"
    return None


def _rowwise_scales(t: torch.Tensor, dim: int) -> torch.Tensor:
    return _scale(t.abs().amax(dim, keepdim=True), E4M3, True)


def grouped_rowwise(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """Rows x (T, K) grouped by ``offs`` through their experts' w (E, N, K): x·w[e]ᵀ per group
    in one ``torch._scaled_grouped_mm``, x per row and w per output row (along K)."""
    sx, sw = _rowwise_scales(x, 1), _rowwise_scales(w, 2)  # (T, 1), (E, N, 1)
    y = torch._scaled_grouped_mm(_cast(x, sx, E4M3), _cast(w, sw, E4M3).transpose(-2, -1),
                                 (1 / sx).reshape(-1), (1 / sw).reshape(w.shape[0], -1),
                                 offs=offs, out_dtype=torch.bfloat16)
    return y.to(out_dtype)


def _grouped_rowwise_dx(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """dy (T, N) · w[e] per group: dy per row, w per input column (along N)."""
    sg, swc = _rowwise_scales(dy, 1), _rowwise_scales(w, 1)  # (T, 1), (E, 1, K)
    b = _cast(w, swc, E4M3).transpose(-2, -1).contiguous().transpose(-2, -1)  # column-major
    dx = torch._scaled_grouped_mm(_cast(dy, sg, E4M3), b, (1 / sg).reshape(-1),
                                  (1 / swc).reshape(w.shape[0], -1), offs=offs,
                                  out_dtype=torch.bfloat16)
    return dx.to(out_dtype)


def _forward_one(recipe: str, x, w, out_dtype, sx=None, sw=None):
    """One expert's x·wᵀ (x its rows) as the FP8 linear layer computes it."""
    if recipe == "tensorwise":
        return _mm8(_cast(x, sx, E4M3), _cast(w, sw, E4M3).t(), sx, sw, out_dtype)
    if recipe == "blockwise":
        return blockwise_forward(x, w, out_dtype, sw)[0]
    sx, sw = _rowwise_scales(x, 1), _rowwise_scales(w, 1)
    return _mm8(_cast(x, sx, E4M3), _cast(w, sw, E4M3).t(), sx, sw.t(), out_dtype)


def _grads_one(recipe: str, x, w, dy, sx=None, sw=None, need_dx=True):
    """One expert's (dx, dw) as the FP8 linear layer computes them."""
    if recipe == "blockwise":
        return blockwise_grads(x, w, sw, dy, need_dx, True)
    dx = None
    if recipe == "tensorwise":
        sg = _scale(dy.abs().amax(), E5M2, False)
        g8 = _cast(dy, sg, E5M2)
        if need_dx:
            dx = _mm8(g8, _cast(w, sw, E4M3), sg, sw, x.dtype)
        return dx, _mm8(g8.t(), _cast(x, sx, E4M3), sg, sx, w.dtype)
    if need_dx:
        sg, swc = _rowwise_scales(dy, 1), _rowwise_scales(w, 0)
        dx = _mm8(_cast(dy, sg, E4M3), _cast(w, swc, E4M3), sg, swc, x.dtype)
    sgt, sxt = _rowwise_scales(dy, 0), _rowwise_scales(x, 0)
    return dx, _mm8(_cast(dy, sgt, E4M3).t(), _cast(x, sxt, E4M3), sgt.t(), sxt, w.dtype)


def _weight_scales(recipe: str, w: torch.Tensor) -> torch.Tensor | None:
    """The per-expert weight scales a recipe keeps: tensorwise (E,), blockwise (E, ·, ·)."""
    if recipe == "tensorwise":
        return _scale(w.detach().abs().amax((1, 2)), E4M3, False)
    if recipe == "blockwise":
        return torch.stack([block_scales(we) for we in w.detach()])
    return None


class _ExpertsMatmul(torch.autograd.Function):
    """Rows x (T, K) grouped by expert (``counts``) -> x·w[e]ᵀ per group (w (E, N, K)), in
    FP8 by ``recipe``; ``grouped``: through ``torch._scaled_grouped_mm`` (module doc)."""

    @staticmethod
    def forward(ctx, x, w, offs, counts, recipe, out_dtype, grouped):
        ctx.counts, ctx.recipe, ctx.grouped = counts, recipe, grouped
        ctx.has_offs = offs is not None
        sw = _weight_scales(recipe, w)
        sx = torch.ones(len(counts), device=x.device) if recipe == "tensorwise" else None
        if grouped:
            y = grouped_rowwise(x, w, offs, out_dtype)
        else:
            ys, start = [], 0
            for e, n in enumerate(counts):
                if n:
                    xe = x[start:start + n].detach()
                    if sx is not None:
                        sx[e] = _scale(xe.abs().amax(), E4M3, False)
                    ys.append(_forward_one(recipe, xe, w[e].detach(), out_dtype,
                                           None if sx is None else sx[e],
                                           None if sw is None else sw[e]))
                    start += n
            y = torch.cat(ys)
        kept = [t for t in (offs, sx, sw) if t is not None]
        ctx.save_for_backward(x, w, *kept)
        ctx.sx, ctx.sw = sx is not None, sw is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, *kept = ctx.saved_tensors
        offs = kept.pop(0) if ctx.has_offs else None
        sx = kept.pop(0) if ctx.sx else None
        sw = kept.pop(0) if ctx.sw else None
        loop_dx = ctx.needs_input_grad[0] and not ctx.grouped
        dxs, dws, start = [], [], 0
        for e, n in enumerate(ctx.counts):
            if not n:
                dws.append(torch.zeros_like(w[e]))
                continue
            dxe, dwe = _grads_one(ctx.recipe, x[start:start + n], w[e], dy[start:start + n],
                                  None if sx is None else sx[e], None if sw is None else sw[e],
                                  need_dx=loop_dx)
            dxs.append(dxe)
            dws.append(dwe)
            start += n
        dx = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_rowwise_dx(dy, w, offs, x.dtype) if ctx.grouped else torch.cat(dxs)
        return dx, torch.stack(dws), None, None, None, None, None


@torch.compiler.disable
def experts_fp8(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None, counts: list[int],
                recipe: str, out_dtype: torch.dtype, grouped: bool = False) -> torch.Tensor:
    """x (T, K) grouped by expert, ``counts[e]`` rows each (at least one row in all) ->
    x·w[e]ᵀ per group in FP8 by ``recipe``, as ``out_dtype``; ``offs``: the int32 group
    ends, needed where ``grouped`` (and kept for backward, as the grouped matmul keeps them).
    Eager inside a compiled block (``train.compile``): the per-expert loop branches on the
    host counts, which would recompile the block for every new pattern of empty experts."""
    with torch.autocast(x.device.type, enabled=False):
        return _ExpertsMatmul.apply(x, w, offs, counts, recipe, out_dtype, grouped)


class Float8Experts(Experts):
    """``Experts`` whose grouped products run in FP8 (module doc); ``apply_fp8_experts``
    makes them."""

    recipe = "tensorwise"

    def compute(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``Experts.compute`` in FP8 (no rows at all: the high-precision loop's zero)."""
        if not rows.shape[0]:
            return self.compute_loop(rows, counts)
        dtype = matmul_dtype(rows)
        h, f = self.down_proj.shape[1], self.down_proj.shape[2]
        grouped = grouped_fp8_unfit(rows.device, self.recipe, dtype, h, f) is None
        offs = None  # kept where the high-precision experts would run grouped, as they do
        if grouped or (self.impl == "grouped" and grouped_mm_unfit(
                rows.device, dtype, h, f, compiling=torch.compiler.is_compiling()) is None):
            offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            offs = offs.to(rows.device, non_blocking=True)
        r = rows.to(dtype)
        gate, up = experts_fp8(r, self.gate_up_proj, offs, counts, self.recipe, dtype,
                               grouped).chunk(2, dim=-1)
        return experts_fp8(swiglu(gate, up), self.down_proj, offs, counts, self.recipe, dtype,
                           grouped)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 {self.recipe}".lstrip(", ")


def fp8_experts_eligible(module: Experts) -> bool:
    """Experts whose widths meet ``torch._scaled_mm``'s rule (multiples of 16); others stay
    high precision, as a projection does."""
    h, f = module.down_proj.shape[1], module.down_proj.shape[2]
    return h % ALIGN == 0 and f % ALIGN == 0


def apply_fp8_experts(model: nn.Module, recipe: str) -> list[str]:
    """Turn every routed ``Experts`` of the blocks into a ``Float8Experts`` in place (after
    expert parallelism); returns the names of those left in high precision."""
    kept = []
    if recipe == "none":
        return kept
    for name, module in list(model.model.layers.named_modules()):
        if isinstance(module, Experts):
            if fp8_experts_eligible(module):
                wrap(module, Float8Experts, recipe=recipe)
            else:
                kept.append(name)
    return kept
