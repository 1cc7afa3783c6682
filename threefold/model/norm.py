"""RMSNorm, the one norm every family uses (Zhang & Sennrich, arXiv 1910.07467)."""

from __future__ import annotations

import torch
from torch import nn

from threefold.model.kernels import rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, arXiv 1910.07467): x / rms(x) · weight, or
    with ``plus_one`` (Gemma) x / rms(x) · (1 + weight), the weight then starting at 0.

    Computed in fp32. Llama's casts the normalised input back before the weight multiplies
    it, as Hugging Face does; with ``fp32_weight`` (Gemma, OLMo 2) the weight multiplies in
    fp32 and the product is rounded once, as their Hugging Face norms do (the same numbers in
    fp32). Backward keeps the input and 1/rms only (``threefold.model.kernels.rms_norm``), not
    autograd's fp32 copy and normalised input."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False, fp32_weight: bool = False):
        super().__init__()
        self.eps, self.plus_one, self.fp32_weight = eps, plus_one, fp32_weight
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def gain(self, weight: torch.Tensor) -> torch.Tensor:
        """What multiplies the normalised input: ``weight``, or 1 + ``weight`` (in fp32 when
        the weight multiplies in fp32)."""
        if self.fp32_weight:
            weight = weight.float()
        return weight + 1.0 if self.plus_one else weight

    def normalise(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x / rms(x) · gain(weight), rounded as this norm's family rounds it."""
        return rms_norm(x, self.gain(weight), self.eps, self.fp32_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        return self.normalise(x, self.weight)

    def reset_parameters(self) -> None:
        """Weight to its start: ones (zeros with ``plus_one``)."""
        (nn.init.zeros_ if self.plus_one else nn.init.ones_)(self.weight)
