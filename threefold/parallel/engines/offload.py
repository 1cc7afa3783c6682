"""Optimiser state offload to host memory, after ZeRO-Offload (Ren et al., arXiv 2101.06840):
``parallel.offload_optimizer true``.

Forward and backward stay on the device. What the optimiser owns moves to the host
(``torch.device("cpu")``): the fp32 master copy of every tensor it updates — whole parameters
for the plain and data-parallel engines, this rank's flat shard of every unit for ZeRO 1/2/3 —
and AdamW's two moments. Each step:

1. the gradient is reduced and clipped on the device as without offload (the global norm is
   computed there, before anything moves);
2. each gradient is copied device → host into a persistent fp32 buffer (page-locked on a GPU,
   ``non_blocking``), and the device gradient is released. The ZeRO engine issues a unit's
   copy as soon as its last reduce-scatter of the step has finished, while the backward of
   the units before it still runs (``send``); clipping then scales that host copy. The other
   engines copy at the step;
3. AdamW steps the host masters with torch's fused CPU kernel (``adamw.HOST_KERNEL``: at the
   host memory's bandwidth); it waits for the global norm, so it does not overlap backward;
4. the updated masters are copied host → device into the parameters (ZeRO: into the shard,
   which the engine then all-gathers as it always does).

Numerics: threefold keeps fp32 weights and autocasts the matmuls under ``train.dtype
bfloat16``, so the device parameters are already fp32 master weights; the host master is a
copy of the same fp32 values. The fused kernel rounds differently from the on-device
engines' single-tensor kernel in the last bits, so the offloaded run equals the on-device one
to fp32 tolerance (the tests: 1e-5 relative on the losses). A 16-bit device parameter would
receive the master rounded to its dtype.

What it saves on a GPU, per parameter the rank's optimiser updates (Ψ, or Ψ/N under ZeRO):
AdamW's momentum and variance, 8 bytes, leave the device; with 16-bit device weights the fp32
master copy too, 12 bytes in all (ZeRO's K = 12, arXiv 1910.02054 §3.1). The price: the host
holds master + moments + the gradient buffer (16 bytes per owned parameter), every step moves
the gradients down and the parameters up over PCIe (8 bytes per owned parameter in fp32; 4 in
16-bit, ZeRO-Offload's 2Ψ + 2Ψ), and AdamW runs at host-memory speed, after the backward
(this engine does not overlap the step with the next forward: ZeRO-Offload's one-step
delayed update is not implemented). ``threefold.plan.memory`` counts the host bytes separately
(``MemoryBreakdown.host``) and ``threefold.accounting.offload_bytes_per_step`` the PCIe traffic.
ZeRO-Offload's own figures (abstract): models of over 13B parameters on one V100, 10× what
PyTorch alone trains there, at 40 TFLOPS for a 10B model.

On a CPU-only machine host and device are the same memory: the copies are real copies, and
the tests use it to prove the offloaded code path trains exactly as the on-device one.
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.config import OptimConfig
from threefold.parallel.engines.adamw import adamw_step, make_host_adamw

HOST = torch.device("cpu")


def _host_buffer(like: torch.Tensor, pin: bool) -> torch.Tensor:
    """An fp32 host tensor of ``like``'s shape (page-locked when ``pin``)."""
    return torch.empty(like.shape, dtype=torch.float32, device=HOST, pin_memory=pin)


class HostOptimizer:
    """AdamW for device tensors ``params`` (parameters or ZeRO shards, each carrying its
    gradient in ``.grad`` at step time) whose masters, moments and step live on the host.

    ``optimizer`` is the torch AdamW over the host masters: its ``state`` is keyed by the
    master (``master_of``), so an engine reads and writes the same logical tensors as without
    offload."""

    def __init__(self, params: list[torch.Tensor], cfg: OptimConfig):
        self.params = list(params)
        self.pin = torch.cuda.is_available() and any(p.device.type == "cuda"
                                                     for p in self.params)
        self.masters: list[nn.Parameter] = []
        self.host_grads: list[torch.Tensor] = []
        for p in self.params:
            m = _host_buffer(p, self.pin)
            m.copy_(p.detach())
            self.masters.append(nn.Parameter(m))
            self.host_grads.append(_host_buffer(p, self.pin))
        self._index = {p: i for i, p in enumerate(self.params)}
        self._sent = [False] * len(self.params)  # host_grads[i] holds params[i]'s final grad
        self.events: list | None = None  # ("d2h", i) per early copy, when a list (tests)
        self.optimizer = make_host_adamw(self.masters, cfg)

    def master_of(self, p: torch.Tensor) -> nn.Parameter:
        """The host master of device tensor ``p`` (the optimiser's state key)."""
        return self.masters[self._index[p]]

    def pull(self) -> None:
        """Masters ← device values (after the engine loaded weights into the device
        tensors)."""
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                m.copy_(p.detach())

    def send(self, p: torch.Tensor) -> None:
        """Start copying ``p``'s gradient, final for this step, to the host now (during the
        backward of what is left); the step then uses that copy. A later change to the
        device gradient must be followed by ``forget(p)``."""
        i = self._index[p]
        with torch.no_grad():
            self.host_grads[i].copy_(p.grad, non_blocking=self.pin)
        self._sent[i] = True
        if self.events is not None:
            self.events.append(("d2h", i))

    def forget(self, p: torch.Tensor) -> None:
        """``p``'s device gradient changed after ``send``: the step copies it again."""
        self._sent[self._index[p]] = False

    def gradients(self, params: list[torch.Tensor]) -> tuple[list, list]:
        """(device gradients, host copies): where each gradient of ``params`` is to be
        scaled by clipping (its host copy once sent, which is then complete)."""
        on_device, on_host = [], []
        for p in params:
            i = self._index[p]
            if self._sent[i]:
                on_host.append(self.host_grads[i])
            elif p.grad is not None:
                on_device.append(p.grad)
        if on_host and self.pin:
            torch.cuda.synchronize()
        return on_device, on_host

    def step(self, lr: float) -> None:
        """Gradients down (those not sent yet), AdamW on the host at learning rate ``lr``,
        parameters up; device gradients are released. A tensor without a gradient is left
        alone, as AdamW does."""
        with torch.no_grad():
            for i, (p, m, g) in enumerate(zip(self.params, self.masters, self.host_grads)):
                if p.grad is None:
                    m.grad = None
                    continue
                if not self._sent[i]:
                    g.copy_(p.grad, non_blocking=self.pin)
                m.grad = g
                p.grad = None
            self._sent = [False] * len(self.params)
            if self.pin:  # the host reads the gradients: wait for the device-to-host copies
                torch.cuda.synchronize()
            adamw_step(self.optimizer, lr)
            for p, m in zip(self.params, self.masters):
                p.copy_(m, non_blocking=self.pin)

    def host_bytes(self) -> int:
        """Host bytes held: masters, gradient buffers and the optimiser's state tensors."""
        n = sum(m.numel() * m.element_size() * 2 for m in self.masters)
        return n + sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                       for k, t in st.items() if k != "step")
