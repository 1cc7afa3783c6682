"""GRPO's loss: group-relative advantages, the clipped-ratio token loss with its KL, and how
the token losses of a micro-batch are reduced for each of TRL's loss types.

The training loop sums a task's loss over micro-batches and divides by the step's units summed
over data-parallel ranks (``Task.count``). Each loss type is written in those terms, so that it
equals TRL's GRPOTrainer for the same micro-batches (TRL's per_device_train_batch_size) and
data-parallel ranks:

- ``dapo``: Σ token losses / completion tokens of the global batch (units: tokens);
- ``grpo``: each completion's mean token loss, averaged over completions (units: completions);
- ``dr_grpo``: Σ token losses / (completions × max_completion_length) (units: completions,
  each micro-batch's sum divided by max_completion_length);
- ``bnpo``: each micro-batch's mean token loss, averaged over micro-batches (units:
  micro-batches).

Logged figures (KL, clip ratios) are each micro-batch's token mean weighted by its units, so
that the logged value is TRL's mean of per-micro-batch means where TRL averages those.
"""

from __future__ import annotations

import numpy as np
import torch

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")


def advantages(rewards: np.ndarray, group: int, scale: str) -> np.ndarray:
    """Group-relative advantages (TRL's): reward minus its group's mean, divided by the
    group's (``scale`` "group") or the batch's ("batch") standard deviation (Bessel-
    corrected) + 1e-4, or not divided ("none"). ``rewards`` holds whole groups in order."""
    r = rewards.reshape(-1, group)
    out = r - r.mean(1, keepdims=True)
    if scale == "group":
        out = out / (r.std(1, ddof=1, keepdims=True) + 1e-4)
    elif scale == "batch":
        out = out / (rewards.std(ddof=1) + 1e-4)
    return out.reshape(-1)


def grpo_token_loss(logps: torch.Tensor, advantages: torch.Tensor, ref_logps, beta: float,
                    epsilon: float, old_logps: torch.Tensor | None = None,
                    kl_bias_correction: bool = False):
    """Per-token GRPO loss ℓ = −min(r·A, clip(r, 1−ε, 1+ε)·A) + β·KL, r = π / π_old,
    KL = exp(log π_ref − log π) − (log π_ref − log π) − 1 (Schulman's k3), and, per token,
    the KL and whether the ratio was clipped below (low) or above (high); ``advantages``
    broadcast over the tokens of each row. ``old_logps`` defaults to ``logps`` detached (one update
    per generation). ``kl_bias_correction`` weighs the KL term by the ratio (TRL's
    ``use_bias_correction_kl``: the same value at one update per generation, a gradient with KL·∇log
    π added; the KL returned is then the weighted one, as TRL logs it)."""
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    a = advantages[:, None]
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    loss = -torch.min(ratio * a, clipped * a)
    kl = torch.zeros_like(logps)
    if beta:
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        if kl_bias_correction:  # (the KL reported is this weighted one, as TRL's)
            kl = kl * ratio
        loss = loss + beta * kl
    low, high = (ratio < 1 - epsilon) & (a < 0), (ratio > 1 + epsilon) & (a > 0)
    return loss, kl.detach(), low, high


def loss_units(loss_type: str, mask: torch.Tensor, micro_batch_size: int) -> int:
    """The units a batch of rows with target ``mask`` (rows, T) counts for ``loss_type``
    (``micro_batch_size``: the rows of one micro-batch, for bnpo)."""
    rows = mask.shape[0]
    if loss_type == "dapo":
        return int(mask.sum())
    if loss_type == "bnpo":
        mb = max(1, min(micro_batch_size, rows))
        return -(-rows // mb)
    return rows


def reduce_token_loss(loss_type: str, token_loss: torch.Tensor, mask: torch.Tensor,
                      max_completion_length: int,
                      figures: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """(the micro-batch's loss summed in ``loss_type``'s units, its per-token ``figures``
    (rows, T) as sums in the same units)."""
    mask = mask.to(token_loss.dtype)
    summed = (token_loss * mask).sum()
    tokens = mask.sum()
    if loss_type == "dapo":
        return summed, {k: (v.double() * mask).sum() for k, v in figures.items()}
    if loss_type == "grpo":
        total = ((token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum()
    elif loss_type == "dr_grpo":
        total = summed / max_completion_length
    else:  # bnpo
        total = summed / tokens.clamp(min=1)
    units = loss_units(loss_type, mask, mask.shape[0])
    scale = units / tokens.double().clamp(min=1)
    return total, {k: (v.double() * mask).sum() * scale for k, v in figures.items()}
