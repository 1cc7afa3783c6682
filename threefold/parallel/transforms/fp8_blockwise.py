"""DeepSeek-V3's blockwise FP8 recipe (``train.fp8 blockwise``; DeepSeek-AI, arXiv 2412.19437,
§3.3): a reference implementation for a projection y = x·Wᵀ (x (tokens, in), W (out, in)).

- Forward: x in 1×128 tiles (one scale per token per 128 input features), W in 128×128
  blocks (one scale per block); both e4m3.
- Input gradient dx = dy·W: dy in 1×128 tiles (per token, per 128 output features), W the
  forward's blocks: a 128×128 block of W is one of Wᵀ too, so the same e4m3 values and scales
  (W's block scales are saved for it: ``ceil(out/128)·ceil(in/128)`` fp32).
- Weight gradient dW = dyᵀ·x: the inner dimension is the tokens, so dy and x are cast again
  in 128×1 tiles (per feature, per 128 tokens), as DeepSeek describe.
- e4m3 everywhere (no e5m2 for gradients, as DeepSeek); fp32 scales, **rounded down to a
  power of 2** (our choice: the cast then only moves exponents, and dequantising is exact,
  which makes the CPU reference exact; DeepSeek's report describes fp32 scaling factors).
- A width that is not a multiple of 128 ends in a narrower tile or block, which scales its
  own elements: no padding, no refusal. (Under tensor parallelism a shard's tiles are one
  process's only when each local width is a multiple of 128: the rule book's
  ``blockwise_tiles_over_tp``.) No amax crosses ranks: every tile lies inside one shard.

How the matmul runs, on CPU and CUDA alike: an e4m3 value (4 significant bits) times a power
of 2 is exact in fp32 and in bf16, so each operand is dequantised exactly and multiplied once
in the compute dtype (fp32, or bf16 with fp32 accumulation). That is the recipe's arithmetic
with fp32 accumulation throughout (DeepSeek promote Hopper's FP8 accumulator to fp32 every
128 products; this accumulates in fp32 from the start); in fp32 it is what CPU's
``torch._scaled_mm`` itself computes for rowwise scales (dequantise, then one fp32 matmul).
It is a numerics reference, not a fast kernel: torch 2.13 also exposes a blockwise FP8 kernel
(``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128`` and
``BlockWise128x128``; the CPU build refuses it), which is not called here because it was not
run on a GPU in this repository; the planner times the recipe's FP8 share at the FP8 peak,
i.e. as such a kernel would run it.

Like the other recipes the forward keeps the high-precision input and weight (what a plain
linear keeps) and casts again in backward, so the only bytes blockwise adds to a block's
saved tensors are W's block scales.

Why not torchao's layers: its float8 training API's recipes (``Float8LinearConfig``) are
tensorwise and rowwise, with blockwise FP8 training only in its prototype namespace, as far
as we know on GPU kernels; its layers replace ``nn.Linear`` by its own class (dropping
threefold's LoRA and tensor-parallel wrappers, which an FP8 layer here composes with) and
agree amaxes through DTensor, which threefold's counted TP and ZeRO do not use; and this
module has to run, exactly, on the CPU that the tests use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from threefold.parallel.transforms.fp8_cast import E4M3, _cast, _scale

TILE = 128  # DeepSeek-V3's tile and block edge


def _blocks(n: int) -> int:
    return -(-n // TILE)


def quantise_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (e4m3 values (M, K), scales (M, ceil(K/128))): 1×128 tiles along each row
    (x8 = x·scale of its tile, scales powers of 2)."""
    m, k = x.shape
    nb = _blocks(k)
    xp = F.pad(x.float(), (0, nb * TILE - k)).view(m, nb, TILE)  # zeros change no amax
    s = _scale(xp.abs().amax(-1), E4M3, True)
    return _cast(xp, s[..., None], E4M3).view(m, nb * TILE)[:, :k].contiguous(), s


def _padded_blocks(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    nb, kb = _blocks(n), _blocks(k)
    return F.pad(w.float(), (0, kb * TILE - k, 0, nb * TILE - n)).view(nb, TILE, kb, TILE)


def block_scales(w: torch.Tensor) -> torch.Tensor:
    """W (N, K) -> its 128×128 blocks' scales (ceil(N/128), ceil(K/128)), powers of 2."""
    return _scale(_padded_blocks(w).abs().amax((1, 3)), E4M3, True)


def cast_blocks(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W (N, K) in e4m3 with its blocks' scales ``s``."""
    n, k = w.shape
    w8 = _cast(_padded_blocks(w), s[:, None, :, None], E4M3)
    return w8.view(s.shape[0] * TILE, s.shape[1] * TILE)[:n, :k].contiguous()


def dequantise(x8: torch.Tensor, s: torch.Tensor, rows: int) -> torch.Tensor:
    """e4m3 values with scales per ``rows``×128 tile (1: tiles, 128: blocks) -> fp32, exact
    (a power-of-2 scale)."""
    m, k = x8.shape
    per = s.repeat_interleave(rows, 0)[:m].repeat_interleave(TILE, 1)[:, :k]
    return x8.float() / per


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b of exactly dequantised operands, in ``out_dtype`` (the values are exact in fp32
    and bf16; CPU's and CUDA's bf16 matmuls accumulate in fp32); fp16, whose range would not
    hold them, multiplies in fp32. The one matmul's output is what selective recompute
    keeps, in the compute dtype as for the other recipes."""
    dt = torch.float32 if out_dtype == torch.float16 else out_dtype
    return (a.to(dt) @ b.to(dt)).to(out_dtype)


def blockwise_forward(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
                      sw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x·Wᵀ by the recipe, W's block scales ``sw``, computed when not given)."""
    sw = block_scales(w) if sw is None else sw
    x8, sx = quantise_tiles(x)
    wd = dequantise(cast_blocks(w, sw), sw, TILE)
    return _mm(dequantise(x8, sx, 1), wd.t(), out_dtype), sw


def blockwise_grads(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, dy: torch.Tensor,
                    need_dx: bool, need_dw: bool):
    """(dx, dW) of y = x·Wᵀ by the recipe (None where not needed); ``sw``: the forward's
    block scales."""
    dx = dw = None
    if need_dx:
        g8, sg = quantise_tiles(dy)
        wd = dequantise(cast_blocks(w, sw), sw, TILE)
        dx = _mm(dequantise(g8, sg, 1), wd, x.dtype)
    if need_dw:  # 128×1 tiles: along the tokens, per feature
        gt8, sgt = quantise_tiles(dy.t())
        xt8, sxt = quantise_tiles(x.t())
        dw = _mm(dequantise(gt8, sgt, 1), dequantise(xt8, sxt, 1).t(), w.dtype)
    return dx, dw


class _BlockwiseMatmul(torch.autograd.Function):
    """y = x·Wᵀ by the blockwise recipe (module doc); x is (tokens, in)."""

    @staticmethod
    def forward(ctx, x, w, out_dtype):
        y, sw = blockwise_forward(x.detach(), w.detach(), out_dtype)
        ctx.save_for_backward(x, w, sw)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, sw = ctx.saved_tensors
        dx, dw = blockwise_grads(x, w, sw, dy, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None


def blockwise_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x (tokens, in) · Wᵀ by DeepSeek-V3's blockwise recipe, as ``out_dtype``."""
    return _BlockwiseMatmul.apply(x, w, out_dtype)
