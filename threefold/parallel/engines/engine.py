"""The optimiser side of a run, one object per layout.

An engine owns the parameters' storage, their gradients' synchronisation and the optimiser. The
training loop drives every layout with the same five calls:

    with engine.micro_step(last=...):   # no gradient sync on accumulation micro-steps
        loss.backward()
    engine.finish_gradients()          # wait for in-flight reductions
    norm = engine.clip_grad_norm(c)    # global norm, whatever is sharded where
    engine.step(lr)                    # AdamW, then re-materialise what the layout needs
    engine.state_dict()                # logical (unsharded, HF-named) tensors for checkpoints

and around each step ``engine.begin_step()`` / ``engine.step_metrics()`` (what the engine
counts of the step's own traffic: expert parallelism's rows), with ``optim_step`` once for
every engine (``EngineBase``).

``LocalEngine`` is the single-process reference every parallel engine is proven equal to.
What the loop, the layouts and the checkpoints use of an engine is declared once, as a
protocol, above this package: ``threefold.training.run.Engine`` (tests/test_code_shape.py checks
that every engine has its methods).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Iterator

import torch
from torch import nn

from threefold.config import OptimConfig
from threefold.parallel.engines.adamw import adamw_step, make_adamw
from threefold.parallel.transforms.expert import ExpertParallelExperts, take_counts
from threefold.parallel.materialize import fill_local
from threefold.parallel.engines.offload import HostOptimizer
from threefold.weights.checkpoint_verify import Piece
from threefold.parallel.placement import ep_sharded, tied_replica, tp_shard_dim


def unique_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named parameters with tied weights listed once (under their first name)."""
    return list(model.named_parameters(remove_duplicate=True))


def trained_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The named parameters an optimiser updates: those that require a gradient (a LoRA
    run's adapters), or every one when none does (a frozen model, which never steps)."""
    named = unique_named_parameters(model)
    return [(n, p) for n, p in named if p.requires_grad] or named


def frozen_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that do not train while others do (a LoRA run's base weights)."""
    named = unique_named_parameters(model)
    trained = {id(p) for _, p in trained_named_parameters(model)}
    return [p for _, p in named if id(p) not in trained]


def sq_norm(g: torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``g`` in fp32, a scalar on ``g``'s device (callers add them up there
    and read the total once). A reduction kernel: ``g.pow(2)`` would first allocate a
    temporary as large as the largest gradient (the embedding's) at the moment memory
    peaks."""
    return torch.linalg.vector_norm(g.detach(), dtype=torch.float32).square()


def global_sq_norm(parts: torch.Tensor, comm, shard_axis: str | None = None) -> torch.Tensor:
    """Squared global gradient norm from local [tp-sharded, tp-replicated] sums of squares:
    both summed over ``shard_axis`` (ranks holding disjoint ZeRO shards) and over pipeline
    stages, the sharded part
    also over tp (each tp rank holds a different slice); replicated parts count once. A
    0-dim tensor on the gradients' device: nothing is read back to the host here."""
    if comm is not None and shard_axis and comm.size(shard_axis) > 1:
        comm.all_reduce(parts, shard_axis)
    if comm is not None and comm.size("pp") > 1:  # each stage holds different weights
        comm.all_reduce(parts, "pp")
    sharded = parts[0:1].clone()
    if comm is not None and comm.size("tp") > 1:
        comm.all_reduce(sharded, "tp")
    return sharded[0] + parts[1]


def clip_to(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` so that a global norm of ``total`` (a 0-dim tensor) becomes at most
    ``max_norm`` (0 = no clipping), as torch's clip_grad_norm_ does: by the clamped
    coefficient min(1, max_norm / (total + 1e-6)) kept on the device, so clipping needs no
    host read (multiplying by exactly 1 changes nothing)."""
    if max_norm > 0 and grads:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0).to(grads[0].dtype)
        torch._foreach_mul_(grads, coef)


class OptimizerSlot:
    """Where an engine's AdamW lives: beside the parameters (``offload`` False), or in host
    memory (``threefold.parallel.engines.offload.HostOptimizer``: fp32 masters, moments and the step
    on the host). Engines reach the optimiser state of a tensor they update through
    ``state_of``/``set_state`` so that checkpoints see the same logical tensors either way."""

    def __init__(self, params: list[torch.Tensor], cfg: OptimConfig, offload: bool = False):
        self.offload = None
        if offload:
            self.offload = HostOptimizer(params, cfg)
            self.optimizer = self.offload.optimizer
        else:
            self.optimizer = make_adamw(params, cfg)

    def key(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the optimiser keys ``p``'s state by (its host master under offload)."""
        return self.offload.master_of(p) if self.offload else p

    def state_of(self, p: torch.Tensor) -> dict:
        """AdamW's state of ``p`` ({} before the first step)."""
        return self.optimizer.state.get(self.key(p), {})

    def set_state(self, p: torch.Tensor, step: int, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor) -> None:
        """Install ``p``'s state (a checkpoint's), placed where the optimiser keeps it."""
        k = self.key(p)
        self.optimizer.state[k] = {"step": torch.tensor(float(step)),
                                   "exp_avg": exp_avg.clone().to(k.device),
                                   "exp_avg_sq": exp_avg_sq.clone().to(k.device)}

    def loaded_params(self) -> None:
        """The device tensors were overwritten (a checkpoint): refresh the host masters."""
        if self.offload:
            self.offload.pull()

    def clip(self, params: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
        """``clip_to`` the gradients of ``params`` (tensors this slot updates) where they are:
        on the device, or under offload a gradient already sent to the host
        (``HostOptimizer.send``) there; the same fp32 product either way."""
        if self.offload is None:
            clip_to([p.grad for p in params if p.grad is not None], total, max_norm)
            return
        on_device, on_host = self.offload.gradients(params)
        clip_to(on_device, total, max_norm)
        if on_host:
            clip_to(on_host, total.to(on_host[0].device), max_norm)

    def step(self, lr: float) -> None:
        """One AdamW step at ``lr``; gradients are released afterwards."""
        if self.offload:
            self.offload.step(lr)
        else:
            adamw_step(self.optimizer, lr)


def _fold_grad(p: nn.Parameter, master: nn.Parameter | None) -> None:
    """Add ``p``'s (16-bit) gradient into its float32 master's and release it."""
    if master is None or p.grad is None:
        return
    if master.grad is None:
        master.grad = p.grad.to(master.dtype)
    else:
        master.grad.add_(p.grad)
    p.grad = None


class EngineBase:
    """What every engine does alike, whatever it holds (``model``, ``optimizer``, ``comm``):
    the optimiser's step count, and what it counts per step of its own traffic (expert
    parallelism's all-to-all rows)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    comm = None

    def optim_step(self) -> int:
        """Optimiser steps taken so far."""
        for st in self.optimizer.state.values():
            return int(st["step"])
        return 0

    @functools.cached_property
    def _dispatchers(self) -> list:
        """The all-to-all dispatchers of the model's expert-parallel layers (found once: a
        step does not walk the model)."""
        return [m.dispatcher for m in self.model.modules()
                if isinstance(m, ExpertParallelExperts)]

    def weight_groups(self) -> Iterator[dict[str, torch.Tensor]]:
        """The model's whole weights under their parameter names (tied ones once), a group at
        a time, for a consumer that takes them tensor by tensor (a rollout engine's weight
        sync). Here every rank holds them whole: one group. ZeRO-3 gives a unit at a time."""
        yield {n: p.detach() for n, p in unique_named_parameters(self.model)}

    def begin_step(self) -> None:
        """Before a step's first forward: what the engine counts per step restarts, so that
        evaluation's or generation's traffic is not counted as the step's."""
        take_counts(self._dispatchers)

    def step_metrics(self) -> dict[str, int]:
        """The step's figures of the engine's own traffic: under expert parallelism the rows
        this rank's MoE layers sent to other ep ranks since ``begin_step`` (``ep_rows_sent``:
        dispatch and combine, forwards only;
        ``threefold.parallel.transforms.expert.take_rows_sent``; the hierarchical dispatch's
        per level, ``threefold.parallel.transforms.expert_dispatch``); nothing elsewhere."""
        if self.comm is None or self.comm.size("ep") == 1:
            return {}
        return take_counts(self._dispatchers)


class LocalEngine(EngineBase):
    """One process holds everything: plain AdamW over the model's parameters (its state in
    host memory with ``offload``, ``threefold.parallel.engines.offload``).

    With ``param_dtype`` narrower than the parameters (bfloat16: the single-process form of
    ZeRO's 16-bit gathers, FSDP2's mixed-precision policy) the model computes with 16-bit
    copies and AdamW updates float32 masters: each micro-batch's 16-bit gradient is added
    into the master's float32 gradient as soon as it is complete, as ZeRO-3 reduces each
    micro-batch's gradient in float32, and the new masters are cast back after the step."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, comm=None, offload: bool = False,
                 param_dtype: torch.dtype | None = None):
        self.model = model
        self.cfg = cfg
        self.comm = comm
        self.named_params = trained_named_parameters(model)  # (a LoRA run: the adapters)
        if param_dtype is not None:  # frozen weights compute in it and need no master
            for p in frozen_parameters(model):
                p.data = p.data.to(param_dtype)
        self._master: dict[nn.Parameter, nn.Parameter] = {}
        if param_dtype is not None and any(p.dtype != param_dtype for _, p in self.named_params):
            self._use_compute_copies(param_dtype)
        self.slot = OptimizerSlot([self._trained(p) for _, p in self.named_params], cfg,
                                  offload)
        self.optimizer = self.slot.optimizer

    def _use_compute_copies(self, dtype: torch.dtype) -> None:
        """float32 masters for the optimiser; the model's parameters become ``dtype`` copies."""
        for _, p in self.named_params:
            master = nn.Parameter(p.detach().clone())
            self._master[p] = master
            p.data = p.data.to(dtype)
            p.register_post_accumulate_grad_hook(
                lambda q, m=weakref.ref(master): _fold_grad(q, m()))

    def _trained(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor AdamW updates for parameter ``p`` (its float32 master, or itself)."""
        return self._master.get(p, p)

    def _refresh_compute_copies(self) -> None:
        with torch.no_grad():
            for p, m in self._master.items():
                p.copy_(m)

    # -- the step ------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_step(self, last: bool) -> Iterator[None]:
        """Context for one micro-batch's backward; ``last`` marks the accumulation boundary."""
        yield

    def release_roots(self) -> None:
        """After a forward-only pass (evaluation): nothing is held gathered here."""

    def finish_gradients(self) -> None:
        """Wait for outstanding gradient communication (none here)."""

    def sq_norm_parts(self) -> torch.Tensor:
        """[sum of squares of tp-sharded gradients, of tp-replicated ones] on this rank, on
        the parameters' device (the collectives that sum it run there)."""
        parts = torch.zeros(2, dtype=torch.float32, device=self.named_params[0][1].device)
        experts = torch.zeros(1, dtype=torch.float32, device=parts.device)
        for _, p in self.named_params:
            g = self._trained(p).grad
            if g is not None and not tied_replica(p):
                if ep_sharded(p):  # this rank's experts only
                    experts += sq_norm(g)
                else:
                    parts[0 if tp_shard_dim(p) is not None else 1] += sq_norm(g)
        if self.comm is not None and self.comm.size("ep") > 1:
            self.comm.all_reduce(experts, "ep")  # every rank's experts (whole on each tp rank)
        parts[1] += experts[0]
        return parts

    def gradient_of(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor holding ``p``'s (synchronised) gradient on this rank, to be reduced in
        place with the same parameter's gradient elsewhere (tied weights on two pipeline
        stages); zeros if it got none."""
        t = self._trained(p)
        if t.grad is None:
            t.grad = torch.zeros_like(t)
        return t.grad

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the gradient (a 0-dim tensor on the device: the trainer reads
        it with the loss, one host sync per step); scale gradients so it is at most
        ``max_norm`` (0 = measure only). A parameter placed as a ``tied_replica`` (a copy of a
        weight held by another pipeline stage) is counted there, not here."""
        total = global_sq_norm(self.sq_norm_parts(), self.comm).sqrt()
        grads = [self._trained(p).grad for _, p in self.named_params]
        clip_to([g for g in grads if g is not None], total, max_norm)
        return total

    def step(self, lr: float) -> None:
        """One optimiser step at learning rate ``lr``; gradients are released afterwards."""
        self.slot.step(lr)
        self._refresh_compute_copies()

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """{"model": {name: tensor}, "optim": {name.exp_avg / name.exp_avg_sq: tensor}} plus
        the step count in ``optim_step``; every tensor whole and HF-named."""
        model = {n: self._trained(p).detach().clone() for n, p in self.named_params}
        optim, step = {}, 0
        for n, p in self.named_params:
            st = self.slot.state_of(self._trained(p))
            if st:
                optim[f"{n}.exp_avg"] = st["exp_avg"].detach().clone()
                optim[f"{n}.exp_avg_sq"] = st["exp_avg_sq"].detach().clone()
                step = int(st["step"])
        return {"model": model, "optim": optim, "optim_step": step}

    def local_pieces(self) -> list:
        """What this rank holds, as checkpoint pieces (whole local tensors here)."""
        out = []
        for n, p in self.named_params:
            t = self._trained(p)
            out.append(Piece(n, "model", t.detach().reshape(-1), 0, p.numel(), tuple(p.shape)))
            st = self.slot.state_of(t)
            for kind in ("exp_avg", "exp_avg_sq"):
                if st:
                    out.append(Piece(n, kind, st[kind].reshape(-1), 0, p.numel(),
                                     tuple(p.shape)))
        return out

    @torch.no_grad()
    def load_from(self, source, optim_step: int = 0) -> None:
        """Take this rank's part of every logical tensor in ``source`` (a checkpoint written
        by any layout, ``threefold.weights``: only the slice this rank holds is read), and
        AdamW's moments where the source has them (``optim_step`` steps taken)."""
        for n, p in self.named_params:
            fill_local(source, n, p, self._trained(p).data)
        self._refresh_compute_copies()
        self.slot.loaded_params()
        for n, p in self.named_params:
            t = self._trained(p)
            moments = [torch.zeros_like(t.data) for _ in range(2)]
            if all(fill_local(source, n, p, buf, kind)
                   for buf, kind in zip(moments, ("exp_avg", "exp_avg_sq"))):
                self.slot.set_state(t, optim_step, *moments)
