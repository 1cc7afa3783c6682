"""AdamW as every engine (and the host optimiser of ``offload``) runs it. Its own module so
that ``engine`` and ``offload`` both import it and neither imports the other at load time.
"""

from __future__ import annotations

import torch

from threefold.config import OptimConfig


def adamw_step(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate, step, release the gradients."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def make_adamw(params, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW as every engine uses it: same hyper-parameters, single-tensor kernel (the same
    elementwise arithmetic whether a tensor is a whole parameter or a flat shard)."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, foreach=False, fused=False)
