"""LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685):
each adapted linear layer computes y = x·Wᵀ + s·(drop(x)·Aᵀ)·Bᵀ with W frozen, A (r × in) and
B (out × r) trained, s = alpha / r, as PEFT's ``LoraLayer`` does. A starts as PEFT draws it
(Kaiming-uniform with a = √5: U(−1/√in, 1/√in)) and B at zero, so the adapted model starts
equal to the base.

``apply_lora`` turns the named linear layers of the plain (meta) model into ``LoRALinear`` in
place and freezes every other weight; the adapters are parameters of the layer itself
(``model.layers.0.self_attn.q_proj.lora_A.weight``), so the base weights keep their Hugging
Face names and load from any source as before. Engines then optimise, reduce and checkpoint
only what requires a gradient (``threefold.parallel.engines.engine.trained_named_parameters``).

Under tensor parallelism the adapter is split the way its layer is
(``threefold.parallel.transforms.tensor``): a column-parallel layer keeps its rows of B and a whole
A (whose gradient each rank sees part of: summed over tp), a row-parallel layer its columns of A
and a whole B (likewise summed). ``adapters_off`` runs the base alone: the DPO/GRPO reference
without a second copy of the model.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import LoRAConfig
from threefold.config.validation import lora_targets


class LoRALinear(nn.Linear):
    """A linear layer with a low-rank adapter (module doc); ``apply_lora`` makes them."""

    lora_scale = 1.0
    lora_dropout = 0.0
    lora_enabled = True

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapter's A and B as the forward uses them (tensor parallelism's wrapper,
        ``threefold.parallel.transforms.tensor.TensorParallelLoRALinear``, sums a whole factor's
        gradient over tp)."""
        return self.lora_A.weight, self.lora_B.weight

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen layer's output (FP8's wrapper, ``threefold.parallel.transforms.fp8_linear``, runs it in
        FP8)."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base output plus the adapter's."""
        out = self.base(x)
        if not self.lora_enabled:
            return out
        a, b = self.factors()
        if self.lora_dropout and self.training:
            x = F.dropout(x, self.lora_dropout)
        return out + F.linear(F.linear(x, a), b) * self.lora_scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora r={self.lora_A.out_features}, " \
               f"scale={self.lora_scale:g}"


def apply_lora(model: nn.Module, lora: LoRAConfig, trainable: tuple[str, ...] = ()
               ) -> nn.Module:
    """Adapt the layers ``lora.target_modules`` names (in place, on any device) and freeze
    every parameter but the adapters and the ``trainable`` names (a task's new weights, such
    as a reward model's score head). Returns the model; nothing when ``lora.r`` is 0."""
    if not lora.r:
        return model
    targets = set(lora_targets(lora))
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in targets and type(module) is nn.Linear:
            device = module.weight.device
            module.__class__ = LoRALinear
            module.lora_A = nn.Linear(module.in_features, lora.r, bias=False, device=device)
            module.lora_B = nn.Linear(lora.r, module.out_features, bias=False, device=device)
            module.lora_scale = lora.alpha / lora.r
            module.lora_dropout = lora.dropout
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or name in trainable)
    return model


def is_adapter(name: str) -> bool:
    """Whether ``name`` is an adapter's weight."""
    return name.endswith(("lora_A.weight", "lora_B.weight"))


def init_adapter(p: torch.Tensor, name: str, gen: torch.Generator | None) -> None:
    """PEFT's initial values: A ~ U(−1/√in, 1/√in) (Kaiming-uniform, a = √5), B = 0."""
    if name.endswith("lora_B.weight"):
        nn.init.zeros_(p)
    else:
        bound = 1 / math.sqrt(p.shape[1])
        nn.init.uniform_(p, -bound, bound, generator=gen)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base: every adapter skipped inside the block."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.lora_enabled = True


def has_adapters(model: nn.Module) -> bool:
    """Whether any layer of ``model`` carries an adapter."""
    return any(isinstance(m, LoRALinear) for m in model.modules())
