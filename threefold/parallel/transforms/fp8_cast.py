"""The casts and the scaled matmul every FP8 recipe shares (``train.fp8``: the blocks'
projections, ``threefold.parallel.transforms.fp8_linear``, the grouped experts,
``fp8_experts``, and the blockwise recipe, ``fp8_blockwise``): a scale from an amax (torchao's
``amax_to_scale``), the saturating cast, and ``torch._scaled_mm`` with its fallback.
"""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ALIGN = 16  # torch._scaled_mm's CUDA rule for the inner and output dimensions


def _scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """torchao's ``amax_to_scale``: the dtype's largest value over amax (in float64, as
    torchao computes it), as float32; optionally rounded down to a power of 2."""
    s = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    return torch.exp2(torch.floor(torch.log2(s))) if pow2 else s


def _cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-m, m).to(dtype)


def _mm8(a8, b8, sa, sb, out_dtype):
    """a8 @ b8 with a8 = a·sa and b8 = b·sb scaled (sa (M,1) or (), sb (1,N) or ()):
    ``torch._scaled_mm`` (its right operand column-major) where the shapes meet its CUDA
    rule, else the same fp8 values dequantised and multiplied in fp32."""
    k, n = a8.shape[1], b8.shape[1]
    if k % ALIGN or n % ALIGN:
        return ((a8.float() @ b8.float()) / (sa * sb)).to(out_dtype)
    # CUDA's rowwise kernel writes bf16 only: under float32 it is widened after
    mm_dtype = torch.bfloat16 if a8.is_cuda and sa.dim() else out_dtype
    return torch._scaled_mm(a8.contiguous(), b8.t().contiguous().t(),
                            scale_a=(1 / sa).reshape(-1, 1) if sa.dim() else 1 / sa,
                            scale_b=(1 / sb).reshape(1, -1) if sb.dim() else 1 / sb,
                            out_dtype=mm_dtype).to(out_dtype)
