"""RMSNorm, the one norm every family uses (Zhang & Sennrich, arXiv 1910.07467)."""

from __future__ import annotations

import torch
from torch import nn

from threefold.kernels import rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, arXiv 1910.07467): x / rms(x) · weight.

    Computed in fp32 and cast back before the weight is applied, as Hugging Face does, so bf16
    activations lose no precision in the reduction. Backward keeps the input and 1/rms only
    (``threefold.kernels.rms_norm``), not autograd's fp32 copy and normalised input."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        """Weight to ones."""
        nn.init.ones_(self.weight)
