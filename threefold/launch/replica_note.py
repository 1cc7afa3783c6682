"""The dry run's note on replica groups (``ft.*``, torchft; ``threefold.parallel.ft_replicas``):
the bytes a step's gradients send across the groups, and the state a heal serves, for the
model the run builds (counted on the meta device)."""

from __future__ import annotations

import torch

from threefold.accounting import replica_gradient_bytes
from threefold.config import Config, ModelConfig
from threefold.model.decoder import CausalLM
from threefold.model.lora import apply_lora
from threefold.parallel.engines.engine import trained_named_parameters


def replica_note(cfg: Config, mcfg: ModelConfig) -> str | None:
    """One line for a job of several replica groups; None otherwise. The gradients are
    reduced in float32 (the optimiser's tensors), one all-reduce per trained tensor; the
    heal's state is the weights and AdamW's two moments, float32 too."""
    f = cfg.ft
    if f.replica_groups <= 1:
        return None
    with torch.device("meta"):
        model = CausalLM(mcfg)
        if cfg.lora.r:
            model = apply_lora(model, cfg.lora)
    numels = [p.numel() for _, p in trained_named_parameters(model)]
    grads = replica_gradient_bytes(numels, 4, f.replica_groups, 0)
    return (f"replica groups: {f.replica_groups} (ft.*, torchft), this launcher's "
            f"{f.replica_group}; each step's gradients are all-reduced across the groups in "
            f"the quorum: {grads:,} bytes sent by a rank first in a full quorum (axis "
            "replica), none by a group training alone; a heal serves "
            f"{3 * sum(numels) * 4:,} bytes per rank (weights and AdamW's moments, fp32)")
