"""MXFP4 (the OCP Microscaling format's FP4 kind), as GPT-OSS's published experts store
their weights: each block of 32 consecutive values along a row holds 32 e2m1 numbers (1 sign,
2 exponent, 1 mantissa bit: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}) packed two per byte, the lower
nibble the earlier value, and one e8m0 scale byte s, the power 2^(s − 127) that multiplies
them. A weight (·, rows, cols) is two tensors: ``*_blocks`` (·, rows, cols / 32, 16) bytes and
``*_scales`` (·, rows, cols / 32) bytes. Dequantising is exact in fp32 (and bf16: a value
has at most two significant bits), so an import equals the weights that were quantised.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantise(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(·, G, 16) packed bytes and (·, G) scale bytes -> (·, G · 32) values of ``dtype``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not match (·, G, 16) and (·, G)")
    table = torch.tensor(E2M1, dtype=torch.float32)
    b = blocks.to(torch.uint8).long()
    values = torch.stack((table[b & 0x0F], table[b >> 4]), dim=-1)  # low nibble first
    power = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values.reshape(*blocks.shape[:-1], BLOCK), power[..., None].float())
    return out.reshape(*blocks.shape[:-2], -1).to(dtype)
