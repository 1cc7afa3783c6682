"""FP8 training of the blocks' linear layers (``train.fp8``): dynamic scaling as torchao's
float8 training recipes define it (``Float8LinearConfig.from_recipe_name``), built on
``torch._scaled_mm`` directly.

Why not torchao itself: its 0.18 wheel runs on torch 2.13's CPU build, but its layers replace
``nn.Linear`` by its own class (which would drop LoRA's and tensor parallelism's wrappers),
its tensor-parallel amax agreement goes through DTensor and its FP8 all-gather through FSDP2,
neither of which threefold uses (threefold's TP and ZeRO are its own, counted by
``threefold.comm.counted``); and the GPU machine has no pip. The arithmetic here is torchao's:

- ``tensorwise``: one amax per tensor, scale = 448 / amax (e4m3's largest value); input and
  weight in e4m3, the output's gradient in e5m2 (range over precision, as torchao's default
  ``cast_config_grad_output``); scales as computed (no rounding);
- ``rowwise``: every operand in e4m3, one scale per row of the matmul's left operand and per
  column of its right one, each along the matmul's inner dimension (forward: x per token,
  W per output row; grad input: dy per token, W per input column; grad weight: dy and x per
  feature along the tokens), scales rounded down to a power of 2 (torchao's
  ``round_scales_to_power_of_2``);
- ``blockwise``: DeepSeek-V3's 1×128 activation tiles and 128×128 weight blocks, all e4m3
  (``threefold.parallel.transforms.fp8_blockwise``, which says what runs where).

As torchao does, the forward saves the high-precision input and weight (which autograd holds
anyway for the plain layer) and casts again in backward, so FP8 adds no saved activation
bytes: a block saves what it saves without FP8.

Tensor parallelism: a shard's amax is not the whole tensor's, so where a scale's amax runs
along a dimension tp splits, the amaxes are all-reduced (max) over tp through the counted
communication layer (Megatron/Transformer Engine do the same for tensorwise), and every
tp layout computes with the scales one process would. Which amaxes: tensorwise, all of them
(x and W in forward, dy in backward, scalars); rowwise, a row-parallel layer's x and W
amaxes (its inner dimension, the input features, is split) and a column-parallel layer's dy
and W-per-column amaxes in backward (their inner dimension, the output features, is split).

``torch._scaled_mm`` on CUDA needs the inner dimension and the output's columns to be
multiples of 16: a layer whose local in or out features are not stays high precision (it is
not wrapped), and a matmul whose token count is not (the weight gradient's inner dimension)
multiplies the same fp8 values dequantised to fp32 (``_mm8``).
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.model.kernels import matmul_dtype
from threefold.model.lora import LoRALinear
from threefold.parallel.placement import tp_shard_dim
from threefold.parallel.transforms.fp8_blockwise import blockwise_linear
from threefold.parallel.transforms.fp8_cast import ALIGN, E4M3, E5M2, _cast, _mm8, _scale
from threefold.parallel.transforms.tensor import TensorParallelLoRALinear
from threefold.parallel.transforms.wrap import wrap

AXIS = "tp"
# the blocks' projections FP8 runs (never the embedding, the head or a router)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _max_over_tp(comm, *amaxes: torch.Tensor) -> list[torch.Tensor]:
    """The amaxes' elementwise max over tp, in one all-reduce."""
    flat = torch.cat([a.reshape(-1).float() for a in amaxes])
    comm.all_reduce(flat, AXIS, op="max")
    return [t.reshape(a.shape) for t, a in zip(flat.split([a.numel() for a in amaxes]), amaxes)]


class _TensorwiseMatmul(torch.autograd.Function):
    """y = x·Wᵀ with one scale per tensor (module doc); x is (tokens, in)."""

    @staticmethod
    def forward(ctx, x, w, out_dtype, comm, weight8):
        if weight8 is not None:  # ZeRO-3 gathered W in e4m3 with its scale: used as it is
            ax = x.detach().abs().amax()
            w8, sw = weight8.get()
            sx = _scale(ax, E4M3, False)
        else:
            ax, aw = x.detach().abs().amax(), w.detach().abs().amax()
            if comm is not None:
                ax, aw = _max_over_tp(comm, ax, aw)
            sx, sw = _scale(ax, E4M3, False), _scale(aw, E4M3, False)
            w8 = _cast(w, sw, E4M3)
        ctx.save_for_backward(x, w, sx, sw)
        ctx.comm, ctx.weight8 = comm, weight8
        return _mm8(_cast(x, sx, E4M3), w8.t(), sx, sw, out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, sx, sw = ctx.saved_tensors
        ag = dy.abs().amax()
        if ctx.comm is not None:
            (ag,) = _max_over_tp(ctx.comm, ag)
        sg = _scale(ag, E5M2, False)
        g8 = _cast(dy, sg, E5M2)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # (re-gathered for backward: the same bytes and scale)
            w8 = ctx.weight8.get()[0] if ctx.weight8 is not None else _cast(w, sw, E4M3)
            dx = _mm8(g8, w8, sg, sw, x.dtype)
        if ctx.needs_input_grad[1]:  # not for a frozen base (LoRA): x is cast only here
            dw = _mm8(g8.t(), _cast(x, sx, E4M3), sg, sx, w.dtype)
        return dx, dw, None, None, None


class _RowwiseMatmul(torch.autograd.Function):
    """y = x·Wᵀ with one scale per row/column along each matmul's inner dimension (module
    doc); ``sync_in``/``sync_out``: the in (out) features are split over tp."""

    @staticmethod
    def forward(ctx, x, w, out_dtype, comm, sync_in, sync_out):
        ax, aw = x.detach().abs().amax(1, keepdim=True), w.detach().abs().amax(1, keepdim=True)
        if sync_in:  # the inner dimension (in features) is split over tp
            ax, aw = _max_over_tp(comm, ax, aw)
        sx, sw = _scale(ax, E4M3, True), _scale(aw, E4M3, True)  # (M,1), (N,1)
        ctx.save_for_backward(x, w)
        ctx.comm, ctx.sync_out = comm, sync_out
        return _mm8(_cast(x, sx, E4M3), _cast(w, sw, E4M3).t(), sx, sw.t(), out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx = dy·W, inner dimension the out features
            ag, awc = dy.abs().amax(1, keepdim=True), w.abs().amax(0, keepdim=True)
            if ctx.sync_out:
                ag, awc = _max_over_tp(ctx.comm, ag, awc)
            sg, swc = _scale(ag, E4M3, True), _scale(awc, E4M3, True)  # (M,1), (1,K)
            dx = _mm8(_cast(dy, sg, E4M3), _cast(w, swc, E4M3), sg, swc, x.dtype)
        if ctx.needs_input_grad[1]:  # dW = dyᵀ·x, inner dimension the tokens (never split)
            sgt = _scale(dy.abs().amax(0, keepdim=True), E4M3, True)   # (1,N)
            sxt = _scale(x.abs().amax(0, keepdim=True), E4M3, True)    # (1,K)
            dw = _mm8(_cast(dy, sgt, E4M3).t(), _cast(x, sxt, E4M3), sgt.t(), sxt, w.dtype)
        return dx, dw, None, None, None, None


def fp8_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: str,
               comm=None, split: str = "", weight8=None) -> torch.Tensor:
    """F.linear(x, w, bias) with its matmul in FP8 by ``recipe``; ``split``: "column" or
    "row" when tp splits the layer (its amaxes then agree over tp through ``comm``);
    ``weight8`` (tensorwise under ZeRO-3's 8-bit gather, ``fp8_gather.GatheredWeight``):
    W's gathered e4m3 values and scale, which replace casting ``w``. The output's dtype is
    autocast's when it is on, else x's."""
    dev = x.device.type
    out_dtype = matmul_dtype(x)
    with torch.autocast(dev, enabled=False):
        x2 = x.reshape(-1, x.shape[-1])
        if recipe == "tensorwise":
            y = _TensorwiseMatmul.apply(x2, w, out_dtype, comm if split else None, weight8)
        elif recipe == "blockwise":  # every tile inside one tp shard: no amax to agree
            y = blockwise_linear(x2, w, out_dtype)
        else:
            y = _RowwiseMatmul.apply(x2, w, out_dtype, comm, split == "row", split == "column")
        y = y.reshape(*x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias.to(out_dtype)


class Float8Linear(nn.Linear):
    """A block's projection whose matmul runs in FP8 (module doc); ``apply_fp8`` makes them."""

    recipe = "tensorwise"
    comm = None
    split = ""  # "column" / "row": tensor parallelism's split of this layer
    weight8 = None  # ZeRO-3's 8-bit gather of W (threefold.parallel.engines.fp8_gather), when on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x·Wᵀ + b in FP8."""
        return fp8_linear(x, self.weight, self.bias, self.recipe, self.comm, self.split,
                          self.weight8)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 {self.recipe}" + \
            (f", amax over tp ({self.split})" if self.split else "") + \
            (", gathered in 8 bits" if self.weight8 is not None else "")


class Float8LoRALinear(LoRALinear):
    """A LoRA-adapted projection whose frozen base matmul runs in FP8 (the adapter's two
    thin matmuls stay in the compute dtype, as torchao leaves small layers)."""

    recipe = "tensorwise"
    comm = None
    split = ""

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """x·Wᵀ + b in FP8."""
        return fp8_linear(x, self.weight, self.bias, self.recipe, self.comm, self.split)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 {self.recipe}"


def fp8_eligible(module: nn.Module) -> bool:
    """A plain, LoRA-adapted or tensor-parallel LoRA layer whose local in and out features
    meet ``torch._scaled_mm``'s rule (multiples of 16); any other (a k/v projection
    replicated over tp, which uses only some of its rows) stays high precision."""
    w = module.weight
    return type(module) in (nn.Linear, LoRALinear, TensorParallelLoRALinear) \
        and w.shape[0] % ALIGN == 0 and w.shape[1] % ALIGN == 0


def apply_fp8(model: nn.Module, recipe: str, comm=None) -> list[str]:
    """Turn the blocks' projections (``TARGETS``) into FP8 layers in place (after tensor
    parallelism, whose split each keeps; ``comm`` only when tp > 1); returns the names of
    those left in high precision (``fp8_eligible``)."""
    kept = []
    if recipe == "none":
        return kept
    tp = comm is not None
    for name, module in list(model.model.layers.named_modules()):
        if name.rsplit(".", 1)[-1] not in TARGETS or not isinstance(module, nn.Linear):
            continue
        if not fp8_eligible(module):
            kept.append(name)
            continue
        dim = tp_shard_dim(module.weight) if tp else None
        split = {0: "column", 1: "row"}.get(dim, "")
        cls = Float8LoRALinear if isinstance(module, LoRALinear) else Float8Linear
        wrap(module, cls, recipe=recipe, comm=comm if split else None, split=split)
    return kept
