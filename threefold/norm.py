"""RMSNorm, the one norm every family uses (Zhang & Sennrich, arXiv 1910.07467)."""

from __future__ import annotations

import torch
from torch import nn

from threefold.kernels import rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, arXiv 1910.07467): x / rms(x) · weight, or
    with ``plus_one`` (Gemma) x / rms(x) · (1 + weight), the weight then starting at 0.

    Computed in fp32 and cast back before the weight is applied, as Hugging Face does, so bf16
    activations lose no precision in the reduction. Backward keeps the input and 1/rms only
    (``threefold.kernels.rms_norm``), not autograd's fp32 copy and normalised input."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def gain(self, weight: torch.Tensor) -> torch.Tensor:
        """What multiplies the normalised input: ``weight``, or 1 + ``weight``."""
        return weight + 1.0 if self.plus_one else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        return rms_norm(x, self.gain(self.weight), self.eps)

    def reset_parameters(self) -> None:
        """Weight to its start: ones (zeros with ``plus_one``)."""
        (nn.init.zeros_ if self.plus_one else nn.init.ones_)(self.weight)
