"""ZeRO (Rajbhandari et al., arXiv 1910.02054) over the "dp_shard" axis, on flat shards.

Parameters are grouped into *units* — the embedding, each transformer block, the final norm and
the LM head (a root unit takes tied weights) — and each unit's parameters are flattened into one
buffer, padded to a multiple of N = |dp_shard| and cut into N equal shards. Rank r owns shard r
of every unit, and AdamW updates only that shard (elementwise the same arithmetic as on whole
tensors, so the result equals single-process training).

- Stage 1 (P_os): optimiser state sharded. Full gradients stay allocated; after backward each
  unit's gradient is reduce-scattered, the owner updates its shard, the new shards are
  all-gathered back into the full parameters.
- Stage 2 (P_os+g): as stage 1, but each unit's reduce-scatter starts from a backward hook as
  soon as the unit's gradients are complete (overlapping the rest of backward) and the full
  gradient is released right after: only shard gradients stay.
- Stage 3 (P_os+g+p): parameters sharded too. A block's full parameters exist only around its
  forward and its backward: all-gathered just before (the next block prefetched
  asynchronously), released after. Gradients are reduce-scattered per micro-batch into the
  shard's gradient, so no full gradient outlives its block's backward.

With dp_replicate > 1 (hybrid sharding, HSDP), shard gradients are then all-reduced over
"dp_replicate": every replica group holds the same shards.

Communication per step, elements per rank (ZeRO §7): stages 1-2 reduce-scatter Ψ(N-1)/N +
all-gather Ψ(N-1)/N = 2Ψ(N-1)/N; stage 3 adds the backward re-gather: 3Ψ(N-1)/N.
"""

from __future__ import annotations

import collections
import contextlib
import math
import warnings
import weakref
from typing import Iterator

import torch
from torch import nn

from threefold.config import OptimConfig
from threefold.model.head_loss import LMHead
from threefold.model.mtp import mtp_depth
from threefold.parallel.engines.engine import (EngineBase, OptimizerSlot, global_sq_norm,
                                       trained_named_parameters)
from threefold.parallel.engines.flat import FlatUnit, fill_frozen, frozen_named
from threefold.parallel.transforms.fp8_linear import Float8Linear
from threefold.parallel.engines.fp8_gather import Fp8FlatUnit, GatheredWeight
from threefold.parallel.materialize import fill_flat, hollow_parameters
from threefold.weights.checkpoint_verify import Piece


def _attach(unit_ref, grad: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient hook: its unit's flat gradient buffer exists before autograd
    accumulates into the parameter's view of it."""
    unit = unit_ref()
    if unit is not None:
        unit.attach_grads()
    return grad


def group_parameters(modules: list[nn.Module], named: list) -> tuple[list[list], list]:
    """(each module's (name, parameter) pairs, the root's: parameters used by several)."""
    users: dict[nn.Parameter, list[int]] = {}
    for i, module in enumerate(modules):
        for p in module.parameters():
            users.setdefault(p, []).append(i)
    inside = {i: {id(m) for m in module.modules()} for i, module in enumerate(modules)}
    groups: list[list] = [[] for _ in modules]
    root: list = []
    for n, p in named:
        u = users.get(p, [])
        # a unit inside another (a layer's experts in the layer) takes its own weights
        inner = [i for i in u if all(id(modules[i]) in inside[j] for j in u)]
        (groups[inner[0]] if len(inner) == 1 else root).append((n, p))
    return groups, root


class ZeroEngine(EngineBase):
    """ZeRO stage 1, 2 or 3 over ``shard_axis``, optionally replicated over ``replicate_axis``.

    ``modules`` lists, in forward order, the modules that become units (for the Llama model:
    the embedding, each block, the final norm, the LM head). A parameter used by two of them
    (tied embeddings) and any parameter in none of them go to the *root* unit, which stays
    gathered from the model's forward until the gradients are reduced.

    With ``offload`` (ZeRO-Offload, ``threefold.parallel.engines.offload``) the fp32 master of each
    owned shard and its AdamW state live in host memory: the shard gradient goes down, the
    host steps, the new shard comes back up and is all-gathered as without offload.
    """

    def __init__(self, model: nn.Module, modules: list[nn.Module], cfg: OptimConfig, comm,
                 stage: int, shard_axis: str = "dp_shard", replicate_axis: str = "dp_replicate",
                 offload: bool = False, unit_axes: dict[int, str] | None = None,
                 source=None, device: torch.device | None = None,
                 param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, fp8_gather: bool = False):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        self.model, self.cfg, self.comm, self.stage = model, cfg, comm, stage
        self.fp8_gather = fp8_gather and stage == 3
        self.shard_axis, self.replicate_axis = shard_axis, replicate_axis
        if source is not None:  # meta parameters: shapes only, until the shards are filled
            hollow_parameters(model, device or torch.device("cpu"))
        named = trained_named_parameters(model)  # (a LoRA run: the adapters)
        kw = dict(source=source, device=device, param_dtype=param_dtype,
                  reduce_dtype=reduce_dtype)
        root = self._build_units(model, modules, named, unit_axes or {}, kw)
        if source is not None:
            source.release()  # the last tensor drawn, or the files read
        self.units = [u for _, u in self.unit_modules]
        self._open_frozen: list[FlatUnit] = []  # gathered for a backward that may be over
        for module, unit in self.unit_modules:
            # an embedding's backward reads its indices, not its weight: no gather for it
            unit.reads_weights_in_backward = not isinstance(module, nn.Embedding)
            # the chunked head loss recomputes its logits in a zero-bubble W as well: its
            # unit stays gathered until every micro-batch whose backward began has its W
            unit.reads_weights_in_w = isinstance(module, LMHead)
            # the head's backwards per micro-batch: 1 + one per multi-token-prediction module
            unit.calls = 1 + (mtp_depth(model) if isinstance(module, LMHead) else 0)
        self.root = FlatUnit("root", root, comm, shard_axis, stage, **kw) if root else None
        # the units that train: reduced, clipped, stepped, checkpointed
        self.all_units = [u for u in self.units if not u.frozen] + ([self.root] if self.root
                                                                    else [])
        self._unit_of = {q: unit for unit in self.all_units for q in unit.params}
        self.named_params = named
        self.slot = OptimizerSlot([u.shard for u in self.all_units], cfg, offload)
        self.optimizer = self.slot.optimizer
        self._sync = True
        self._final = False  # inside the last micro-step: a finished reduction is final
        # reduce-scatters in flight: bounded, so that no more than a couple of units' full
        # gradients exist at once during backward (the point of stages 2 and 3)
        self._inflight: collections.deque = collections.deque()
        for unit in self.all_units:
            for p in unit.params:
                # weak references: a hook holding the engine (or a unit) would keep it, and
                # every buffer, alive forever through the parameter's C++ hook table
                p.register_hook(lambda g, u=weakref.ref(unit): _attach(u, g))
                p.register_post_accumulate_grad_hook(
                    lambda _p, u=unit, me=weakref.ref(self): me() and me()._on_grad(u))
        if stage == 3:
            self._install_stage3_hooks()
        else:  # stages 1-2 keep whole parameters: one all-gather of the shards at start-up
            for unit in self.all_units:
                unit.wait_gather()

    def _build_units(self, model: nn.Module, modules: list[nn.Module], named: list,
                     axes: dict[int, str], kw: dict) -> list:
        """``unit_modules``: per module, in forward order, its frozen weights' unit (stage 3
        under LoRA: gathered around use like any unit, never reduced or stepped), then its
        trained one; ``frozen_root``; returns the trained root's (name, parameter) pairs.
        Under stages 1-2 frozen weights stay whole instead, as those stages keep
        parameters."""
        frozen = frozen_named(model, named)
        if self.stage < 3:
            fill_frozen(model, named, kw["source"], kw["device"], kw["param_dtype"])
            frozen = []
        groups, root = group_parameters(modules, named)
        fgroups, froot = group_parameters(modules, frozen)
        comm, stage, axis = self.comm, self.stage, self.shard_axis
        # parallel.fp8_all_gather: the tensorwise FP8 layers' weights, gathered in 8 bits
        fp8 = {id(q.weight): q for q in model.modules()
               if isinstance(q, Float8Linear) and q.recipe == "tensorwise"} \
            if self.fp8_gather else {}

        def unit(name: str, g: list, i: int, frozen: bool) -> FlatUnit:
            ids = {id(p) for _, p in g} & fp8.keys()
            if not ids or frozen:
                return FlatUnit(name, g, comm, axes.get(i, axis), stage, frozen=frozen, **kw)
            made = Fp8FlatUnit(name, g, comm, axes.get(i, axis), stage, ids, **kw)
            for j in made.fp8_index:
                fp8[id(made.params[j])].weight8 = GatheredWeight(made, j)
            return made

        self.unit_modules = [
            (m, unit(f"unit{i}{tag}", g, i, bool(tag)))
            for i, (m, fg, g) in enumerate(zip(modules, fgroups, groups))
            for tag, g in ((".frozen", fg), ("", g)) if g]
        self.frozen_root = FlatUnit("root.frozen", froot, comm, axis, stage, frozen=True,
                                    **kw) if froot else None
        return root

    # -- stage 3: gather around use -------------------------------------------------------
    def _install_stage3_hooks(self) -> None:
        units = self.units

        def pre_forward(i):
            def hook(_m, _args):
                if not units[i].in_backward:
                    units[i].wait_gather()
                    if i + 1 < len(units):
                        units[i + 1].start_gather()  # prefetch the next unit
            return hook

        def post_forward(i):
            def hook(_m, _args, _out):
                # under activation checkpointing a block's forward is re-run inside backward,
                # after its backward pre-hook: then its parameters must stay for backward
                if not units[i].in_backward:
                    units[i].release()
            return hook

        def pre_backward(i):
            def hook(m, _grad_out):
                if units[i].frozen:  # a frozen unit has no gradient to say its backward is
                    self._close_frozen(keep=m)  # over: it ends when another module's begins
                    self._open_frozen.append(units[i])
                units[i].in_backward = True
                units[i].open_backwards += 1
                if units[i].reads_weights_in_backward:
                    units[i].wait_gather()
                if i > 0 and units[i - 1].reads_weights_in_backward:
                    units[i - 1].start_gather()  # prefetch the unit whose backward is next
            return hook

        def on_demand(i):
            # A zero-bubble W (the weight half of a split backward, run after the unit has
            # been released) recomputes a checkpointed block's forward without its hooks:
            # the block's inner modules re-gather the unit there. Anywhere else they find
            # it gathered already, and this costs a flag test.
            def hook(_m, _args):
                if not units[i].gathered:
                    units[i].in_backward = True
                    units[i].wait_gather()
            return hook

        # The embedding's input (token ids) needs no gradient; its backward pre-hook still
        # fires on the output gradient, which is what we want. Silence torch's note about it.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")
        for i, (module, _) in enumerate(self.unit_modules):
            module.register_forward_pre_hook(pre_forward(i))
            module.register_forward_hook(post_forward(i))
            module.register_full_backward_pre_hook(pre_backward(i))
            for inner in module.modules():
                if inner is not module:
                    inner.register_forward_pre_hook(on_demand(i))
        for root in (self.root, self.frozen_root):
            if root:
                self.model.register_forward_pre_hook(lambda _m, _a, r=root: r.wait_gather())

    def weight_groups(self) -> Iterator[dict[str, torch.Tensor]]:
        """Stage 3: the whole weights a unit at a time (each gathered only while its group is
        in use, then released as after a forward); stages 1-2 hold them whole."""
        if self.stage < 3:
            yield from super().weight_groups()
            return
        for unit in [u for u in (*self.units, self.root, self.frozen_root) if u is not None]:
            held = unit.gathered
            unit.wait_gather()
            yield dict(zip(unit.names, (p.detach() for p in unit.params)))
            if not held:
                unit.release()

    def _close_frozen(self, keep: nn.Module | None = None) -> None:
        """Release the frozen units gathered for backwards that are over (all but those of
        module ``keep``, whose backward is beginning)."""
        module_of = {id(u): m for m, u in self.unit_modules}
        still = []
        for unit in self._open_frozen:
            if keep is not None and module_of[id(unit)] is keep:
                still.append(unit)
                continue
            unit.in_backward, unit.open_backwards = False, 0
            unit.release()
        self._open_frozen = still

    # -- the step -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_step(self, last: bool) -> Iterator[None]:
        """Stages 1-2 keep accumulating full gradients locally until the last micro-step;
        stage 3 reduces every micro-step (its full gradients are not kept)."""
        self._sync = last or self.stage == 3
        self._final = last
        try:
            yield
        finally:
            self._sync = True
            if self.stage == 3:  # a micro-batch's reductions end with its backward: their
                self._drain()    # buffers do not wait through the next micro-batch's forward
                self._close_frozen()
            self._final = False

    def _on_grad(self, unit: FlatUnit) -> None:
        unit.pending -= 1
        if unit.pending:
            return
        unit.pending = len(unit.params)
        unit.open_backwards = max(0, unit.open_backwards - unit.calls)
        if self.stage == 3:
            self._reduce(unit)
            if unit.reads_weights_in_w and unit.open_backwards:
                return  # another micro-batch's W still reads the weights
            unit.in_backward = False
            if unit is not self.root:
                unit.release()
        elif self.stage == 2 and self._sync:
            self._reduce(unit)

    MAX_INFLIGHT = 2

    def _reduce(self, unit: FlatUnit) -> None:
        unit.start_reduce_scatter()
        self._inflight.append(unit)
        while len(self._inflight) > self.MAX_INFLIGHT:
            self._finish(self._inflight.popleft())

    def _drain(self) -> None:
        while self._inflight:
            self._finish(self._inflight.popleft())

    def _finish(self, unit: FlatUnit) -> None:
        """Complete ``unit``'s reduce-scatters. Under offload a shard gradient that is final
        for the step (the last micro-step's, no replica all-reduce to follow) starts down to
        the host now, overlapping the backward of the units before it; one that changes
        afterwards is copied again at the step."""
        changed = bool(unit.reduce_jobs)
        unit.finish_reduce_scatter()
        off = self.slot.offload
        if off is not None and changed:
            if self._final and self.comm.size(self.replicate_axis) == 1:
                off.send(unit.shard)
            else:
                off.forget(unit.shard)

    def release_roots(self) -> None:
        """After a forward-only pass (evaluation): under stage 3 free the root units it
        gathered, and any unit it prefetched without running (the multi-token-prediction
        modules, which only a training forward runs), so that the next step gathers them
        as every step does."""
        if self.stage == 3:
            for root in (self.root, self.frozen_root):
                if root:
                    root.release()
            for unit in self.units:
                if unit.gather_handle is not None:  # prefetched: complete, then free
                    unit.wait_gather()
                if not unit.in_backward:
                    unit.release()

    def finish_gradients(self) -> None:
        """Complete every unit's reduce-scatter (stage 1 starts them here), then all-reduce
        shard gradients across replicas for hybrid sharding."""
        self._inflight.clear()
        for unit in self.all_units:
            if self.stage == 1:
                unit.start_reduce_scatter()
            self._finish(unit)
            if self.comm.size(self.replicate_axis) > 1:
                self.comm.all_reduce(unit.shard.grad, self.replicate_axis)
        self.release_roots()

    def gradient_of(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's shard of ``p``'s reduced gradient, for an in-place sum with the same
        weight's gradient on another pipeline stage (tied embeddings). ``p`` must fill a unit
        alone (the embedding and the LM head do), so that both stages shard it alike."""
        unit = self._unit_of.get(p)
        if unit is None:
            raise KeyError("ZeroEngine.gradient_of: not a parameter of this engine")
        if len(unit.params) != 1:
            raise ValueError("ZeroEngine.gradient_of: the parameter shares its unit "
                             f"with {len(unit.params) - 1} other(s)")
        if unit.shard.grad is None:
            unit.shard.grad = torch.zeros_like(unit.shard)
        if self.slot.offload is not None:  # the caller changes it in place
            self.slot.offload.forget(unit.shard)
        return unit.shard.grad

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm from the shards (padding is zero), summed over the shard axis; tp
        slices summed over tp, tp-replicated parameters counted once."""
        parts = sum(unit.shard_sq_norm_parts() for unit in self.all_units)
        total = global_sq_norm(parts, self.comm, self.shard_axis).sqrt()
        self.slot.clip([u.shard for u in self.all_units], total, max_norm)
        return total

    def step(self, lr: float) -> None:
        """AdamW on the owned shards (on the host under offload, the new shards copied back
        up); stages 1-2 then all-gather the new parameters."""
        self.slot.step(lr)
        if self.stage in (1, 2):
            for unit in self.all_units:
                unit.gathered = False
                unit.wait_gather()

    # -- checkpoints: whole, HF-named tensors whatever the sharding -------------------------
    def _gather_flat(self, unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(unit.padded, dtype=shard.dtype, device=shard.device)
        self.comm.all_gather(full, shard.contiguous(), unit.axis)
        return full

    def _split(self, unit: FlatUnit, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: flat[o:o + math.prod(s)].view(s).clone()
                for n, o, s in zip(unit.names, unit.offsets, unit.shapes)}

    def state_dict(self) -> dict:
        """Collective: every rank must call it. Returns logical tensors on every rank."""
        model, optim, step = {}, {}, 0
        for unit in self.all_units:
            model.update(self._split(unit, self._gather_flat(unit, unit.shard.data)))
            st = self.slot.state_of(unit.shard)
            if st:
                step = int(st["step"])
                for key in ("exp_avg", "exp_avg_sq"):
                    # (under offload the state is on the host: collectives run on the device)
                    parts = self._split(unit, self._gather_flat(unit,
                                                                st[key].to(unit.shard.device)))
                    optim.update({f"{n}.{key}": t for n, t in parts.items()})
        return {"model": model, "optim": optim, "optim_step": step}

    def local_pieces(self) -> list:
        """This rank's shard of every unit, cut at parameter boundaries into pieces."""
        out = []
        for unit in self.all_units:
            lo = self.comm.rank(unit.axis) * unit.shard_numel
            st = self.slot.state_of(unit.shard)
            sources = [("model", unit.shard.detach())] + [(k, st[k]) for k in ("exp_avg",
                                                                               "exp_avg_sq")
                                                          if k in st]
            for n, off, shape in zip(unit.names, unit.offsets, unit.shapes):
                a, b = max(off, lo), min(off + math.prod(shape), lo + unit.shard_numel)
                if b <= a:
                    continue
                for kind, flat in sources:
                    out.append(Piece(n, kind, flat[a - lo:b - lo], a - off, b - off,
                                     tuple(shape)))
        return out

    @torch.no_grad()
    def load_from(self, source, optim_step: int = 0) -> None:
        """Take this rank's shards of the logical tensors in ``source`` (a checkpoint of any
        layout, ``threefold.weights``), reading only the rows each shard covers; AdamW's
        moments too when the source has them (``optim_step`` steps taken)."""
        for unit in self.all_units:
            named = list(zip(unit.names, unit.params))
            lo = self.comm.rank(unit.axis) * unit.shard_numel
            fill_flat(source, named, unit.offsets, unit.shard.data, lo)
            moments = [torch.zeros_like(unit.shard.data) for _ in range(2)]
            if all(fill_flat(source, named, unit.offsets, buf, lo, kind)
                   for buf, kind in zip(moments, ("exp_avg", "exp_avg_sq"))):
                self.slot.set_state(unit.shard, optim_step, *moments)
            del moments
            if self.stage in (1, 2) or unit.gathered:
                unit.gathered = False
                unit.wait_gather()
            if self.stage == 3:
                unit.release()
        self.slot.loaded_params()
