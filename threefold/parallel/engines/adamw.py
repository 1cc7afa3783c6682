"""AdamW as every engine (and the host optimiser of ``offload``) runs it. Its own module so
that ``engine`` and ``offload`` both import it and neither imports the other at load time.
"""

from __future__ import annotations

import torch

from threefold.config import OptimConfig

# torch's three AdamW kernels, by the flags that choose them
KERNELS = {"single": dict(foreach=False, fused=False), "foreach": dict(foreach=True),
           "fused": dict(fused=True)}


def adamw_step(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate, step, release the gradients."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def make_adamw(params, cfg: OptimConfig, kernel: str = "single") -> torch.optim.AdamW:
    """AdamW as every engine uses it: same hyper-parameters, single-tensor kernel by default
    (the same elementwise arithmetic whether a tensor is a whole parameter or a flat shard,
    so every layout equals one process bit for bit). ``kernel`` "foreach" or "fused" picks
    torch's other kernels (``KERNELS``)."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, **KERNELS[kernel])


# The host optimiser's kernel (``threefold.parallel.engines.offload``). torch's fused CPU AdamW is
# one vectorised, multi-threaded pass over each tensor: on this project's 2-core CPU it runs at
# the memory's copy bandwidth, about 4× the single-tensor kernel and level with DeepSpeed's
# CPU Adam (bench/bench_offload.py). Its rounding differs from the single-tensor kernel's in
# the last bits, so an offloaded run equals an on-device one to fp32 tolerance, not exactly.
HOST_KERNEL = "fused"


def make_host_adamw(params, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over host (CPU) masters with ``HOST_KERNEL``."""
    return make_adamw(params, cfg, HOST_KERNEL)
