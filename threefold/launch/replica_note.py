"""The dry run's note on replica groups (``ft.*``, torchft; ``threefold.parallel.ft_replicas``):
the bytes a step's gradients send across the groups, and the state a heal serves, for the
model the run builds (counted on the meta device)."""

from __future__ import annotations

import torch

from threefold.accounting import replica_gradient_bytes, replica_rank_numels
from threefold.config import Config, ModelConfig
from threefold.layout import Layout
from threefold.model.decoder import CausalLM
from threefold.model.lora import apply_lora
from threefold.parallel.engines.engine import trained_named_parameters
from threefold.parallel.engines.zero import group_parameters
from threefold.parallel.parallelize import zero_units


def replica_note(cfg: Config, mcfg: ModelConfig, layout: Layout | None = None) -> str | None:
    """One line for a job of several replica groups; None otherwise. The gradients are
    reduced in float32 (the optimiser's tensors), one all-reduce per tensor a rank holds:
    each trained tensor, or under ZeRO in a group of several ranks (``layout``, the group's)
    its shard of each flat unit; the heal's state is the same elements of the weights and
    AdamW's two moments, float32 too."""
    f = cfg.ft
    if f.replica_groups <= 1:
        return None
    with torch.device("meta"):
        model = CausalLM(mcfg)
        if cfg.lora.r:
            model = apply_lora(model, cfg.lora)
    named = trained_named_parameters(model)
    numels = [p.numel() for _, p in named]
    if layout is not None and layout.zero_stage and layout.dp * layout.cp > 1:
        groups, root = group_parameters(zero_units(model, 1)[0], named)
        units = [sum(p.numel() for _, p in g) for g in (*groups, root) if g]
        numels = replica_rank_numels(units, layout.shard_size)
    grads = replica_gradient_bytes(numels, 4, f.replica_groups, 0)
    return (f"replica groups: {f.replica_groups} (ft.*, torchft), this launcher's "
            f"{f.replica_group}; each step's gradients are all-reduced across the groups in "
            f"the quorum: {grads:,} bytes sent by a rank first in a full quorum (axis "
            "replica), none by a group training alone; a heal serves "
            f"{3 * sum(numels) * 4:,} bytes per rank (weights and AdamW's moments, fp32)")
