"""One ZeRO unit: a group of parameters flattened into one padded buffer, sharded over a
mesh axis (``threefold.parallel.engines.zero`` groups the model into units and drives them)."""

from __future__ import annotations

import math

import torch
from torch import nn

from threefold.parallel.engines.engine import sq_norm, unique_named_parameters
from threefold.parallel.materialize import fill_flat, fill_local
from threefold.parallel.placement import tied_replica, tp_shard_dim


class FlatUnit:
    """One unit's parameters as a padded flat buffer, sharded over the shard axis.

    ``shard`` (this rank's slice of the flat buffer, a float32 master) is filled first, from
    ``source`` (``threefold.parallel.materialize``: the initial values or a checkpoint's
    region, never the whole unit) or from the parameters' own values; ``full`` (the gathered
    buffer, in ``param_dtype``) exists only while gathered: for good under stages 1-2 (after
    one all-gather at start-up), around use under stage 3. The parameters become views of
    ``full``. Gradients are views of one flat buffer too (``attach_grads``), which the
    reduce-scatter reads directly."""

    def __init__(self, name: str, named: list[tuple[str, nn.Parameter]], comm, axis: str,
                 stage: int, source=None, device: torch.device | None = None,
                 param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, frozen: bool = False):
        self.name, self.comm, self.axis, self.stage = name, comm, axis, stage
        self.frozen = frozen  # weights that never train (LoRA's base): gathered, not reduced
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.offsets, n = [], 0
        for p in self.params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        world, rank = comm.size(axis), comm.rank(axis)
        self.shard_numel = math.ceil(n / world)
        self.padded = self.shard_numel * world
        first = self.params[0]
        dev = device or (first.device if not first.is_meta else torch.device("cpu"))
        master = first.dtype  # the logical dtype (float32): the optimiser's shard
        self.param_dtype = param_dtype or master
        self.reduce_dtype = reduce_dtype
        lo = rank * self.shard_numel
        shard = torch.zeros(self.shard_numel, dtype=master, device=dev)
        if source is not None:
            fill_flat(source, named, self.offsets, shard, lo)
        else:  # the parameters' own values (a model materialised by its caller)
            with torch.no_grad():
                for p, off in zip(self.params, self.offsets):
                    a, b = max(off, lo), min(off + p.numel(), lo + self.shard_numel)
                    if b > a:
                        shard[a - lo:b - lo].copy_(p.detach().reshape(-1)[a - off:b - off])
        self.shard = nn.Parameter(shard)
        # (views need storage when made; untouched pages of an empty buffer cost nothing)
        self.full = torch.empty(self.padded, dtype=self.param_dtype, device=dev)
        self._point_params_at_full()
        self.full.untyped_storage().resize_(0)  # nothing gathered yet
        self.gathered = False
        self.pending = len(self.params)
        self.gather_handle = None
        self.grad_flat: torch.Tensor | None = None
        self.reduce_jobs: list[tuple] = []
        self.in_backward = False
        self.reads_weights_in_backward = True  # False for the embedding (see ZeroEngine)
        self.reads_weights_in_w = False  # True for the head (see ZeroEngine)
        self.open_backwards = 0  # backwards of its module's calls begun and not ended
        self.calls = 1  # its module's calls per micro-batch (see ZeroEngine)

    # -- parameters as views of the flat buffer -------------------------------------------
    def _point_params_at_full(self) -> None:
        # `.data` assignment keeps each Parameter's identity (optimiser hooks, autograd leaf,
        # placement) while its storage becomes a view of the unit's flat buffer.
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            p.data = self.full.data[off:off + math.prod(shape)].view(shape)

    def release(self) -> None:
        """Free the full parameters' memory (stage 3); views stay, pointing at no bytes."""
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def start_gather(self) -> None:
        """Begin re-materialising the full parameters from all shards (asynchronous), in
        ``param_dtype`` (a 16-bit copy of the float32 shard travels: half the bytes)."""
        if self.gathered or self.gather_handle is not None:
            return
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        src = self.shard.data
        if src.dtype != self.full.dtype:
            src = src.to(self.full.dtype)
        self.gather_handle = self.comm.all_gather(self.full.data, src, self.axis, async_op=True)

    def wait_gather(self) -> None:
        """Make sure the full parameters are present."""
        if self.gathered:
            return
        self.start_gather()
        self.gather_handle.wait()
        self.gather_handle = None
        self.gathered = True

    # -- gradients --------------------------------------------------------------------------
    def attach_grads(self) -> None:
        """Give the parameters' gradients a home before autograd writes them: views of one
        zeroed flat buffer (autograd then adds into them in place), so the unit's gradient
        exists once and the reduce-scatter reads it as it is. Called from each parameter's
        gradient hook; the first call of a backward allocates."""
        if self.grad_flat is not None:
            return
        self.grad_flat = torch.zeros(self.padded, dtype=self.param_dtype,
                                     device=self.shard.device)
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            p.grad = self.grad_flat[off:off + math.prod(shape)].view(shape)

    def start_reduce_scatter(self) -> None:
        """Sum the unit's gradient over the shard axis, keeping only this rank's shard (in
        ``reduce_dtype``); the parameters' gradient views are released."""
        g = self.grad_flat
        if g is None:  # no gradient reached this unit
            g = torch.zeros(self.padded, dtype=self.param_dtype, device=self.shard.device)
        for p in self.params:
            p.grad = None
        self.grad_flat = None
        if self.reduce_dtype is not None and g.dtype != self.reduce_dtype:
            g = g.to(self.reduce_dtype)
        out = torch.empty(self.shard_numel, dtype=g.dtype, device=g.device)
        handle = self.comm.reduce_scatter(out, g, self.axis, async_op=True)
        self.reduce_jobs.append((handle, out, g))

    def shard_sq_norm_parts(self) -> torch.Tensor:
        """[tp-sharded, tp-replicated] sums of squares of this rank's gradient shard."""
        parts = torch.zeros(2, dtype=torch.float32, device=self.full.device)
        g = self.shard.grad
        lo = self.comm.rank(self.axis) * self.shard_numel
        for p, off in zip(self.params, self.offsets):
            a, b = max(off, lo), min(off + p.numel(), lo + self.shard_numel)
            if b > a and not tied_replica(p):  # counted on its owner
                parts[0 if tp_shard_dim(p) is not None else 1] += sq_norm(g[a - lo:b - lo])
        return parts

    def finish_reduce_scatter(self) -> None:
        """Wait for this unit's reductions and accumulate them into the shard's gradient."""
        for handle, out, _ in self.reduce_jobs:
            handle.wait()
            if self.shard.grad is None:
                self.shard.grad = out if out.dtype == self.shard.dtype else \
                    out.to(self.shard.dtype)
            else:
                self.shard.grad.add_(out)
        self.reduce_jobs = []


def frozen_named(model: nn.Module, trained: list) -> list:
    """(name, parameter) of the weights that do not train while ``trained`` do (LoRA's base)."""
    ids = {id(p) for _, p in trained}
    return [(n, p) for n, p in unique_named_parameters(model) if id(p) not in ids]


@torch.no_grad()
def fill_frozen(model: nn.Module, trained: list, source, device, param_dtype) -> None:
    """Weights that do not train (a LoRA run's base, under stages 1-2) stay whole on every
    rank, as those stages keep parameters: filled from ``source`` in the compute dtype."""
    for name, p in frozen_named(model, trained):
        if source is not None:
            p.data = torch.empty(p.shape, dtype=p.dtype, device=device or p.device)
            fill_local(source, name, p, p.data)
        if param_dtype is not None:
            p.data = p.data.to(param_dtype)
