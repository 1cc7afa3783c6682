"""Data parallel: every rank holds the whole model; gradients are summed over the "dp" axis
with bucketed all-reduces launched from backward hooks, so communication of late layers
overlaps the backward of early ones (the DDP idea, Li et al., VLDB 2020).

The loss is already divided by the global token count, so the all-reduce is a SUM, not a mean:
the result is exactly the single-process gradient of the same global batch.

Gradients live in the buckets (DDP's ``gradient_as_bucket_view``): each parameter's ``.grad``
is a view into its bucket's flat buffer, so autograd accumulates straight into the message
that is all-reduced, and there is no second copy of the gradients (nor a copy in before the
all-reduce and back after it). The buffers are kept for the whole run and zeroed after each
optimiser step; whoever releases or replaces a ``.grad`` meanwhile (the optimiser's
``zero_grad``, the host-offload step) is undone by ``_attach``, and a gradient that arrives in
a tensor of its own is copied into the bucket by the hook.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Iterator

import torch
from torch import nn

from threefold.config import OptimConfig
from threefold.parallel.engines.engine import LocalEngine
from threefold.schedules.timeline import TraceRecord
from threefold.parallel.placement import ep_sharded


class _Bucket:
    """A flat gradient buffer for a few parameters, all-reduced over ``axis`` as one
    message; ``views[i]`` is parameter i's gradient inside it."""

    def __init__(self, params: list[nn.Parameter], axis: str):
        self.params, self.axis = params, axis
        n = sum(p.numel() for p in params)
        self.flat = torch.zeros(n, dtype=params[0].dtype, device=params[0].device)
        self.views, off = [], 0
        for p in params:
            self.views.append(self.flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        self.pending = len(params)
        self.handle = None
        self.launched = 0.0  # perf_counter at the all-reduce's launch (traced steps)


def make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters in reverse registration order (roughly the order backward produces
    their gradients) into buckets of about ``bucket_bytes``."""
    buckets, cur, size = [], [], 0
    for p in reversed(params):
        cur.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return buckets


class DataParallelEngine(LocalEngine):
    """Full replicas on every rank of ``axis``; gradient all-reduce overlapped with backward.
    With ``offload`` the optimiser runs on the host (``LocalEngine``). Under expert
    parallelism (``expert_axis``, "edp") a rank's experts are replicated over that axis only:
    their gradients go in buckets of their own, all-reduced there.

    On a traced step (``comm.trace`` a list, ``World.traced``) each bucket's all-reduce is
    a ``TraceRecord`` there, from its launch to the return of its wait in
    ``finish_gradients``."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, comm, bucket_mb: float,
                 axis: str = "dp", offload: bool = False, expert_axis: str | None = None):
        super().__init__(model, cfg, comm, offload)
        self.axis, self.expert_axis = axis, expert_axis
        params = [p for _, p in self.named_params]
        is_expert = [bool(expert_axis) and ep_sharded(p) for p in params]
        experts = [p for p, e in zip(params, is_expert) if e]
        dense = [p for p, e in zip(params, is_expert) if not e]
        size = int(bucket_mb * 2**20)
        self.buckets = [_Bucket(b, axis) for b in make_buckets(dense, size)] + \
            [_Bucket(b, expert_axis) for b in make_buckets(experts, size)]
        self._where = {}
        # weakly: a hook holding the engine would keep it alive forever through the
        # parameter's C++ hook table
        me = weakref.WeakMethod(self._on_grad)
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self._where[p] = (bucket, i)
                p.register_post_accumulate_grad_hook(
                    lambda q, me=me: (on_grad := me()) is not None and on_grad(q))
        self._sync = True
        self._attach()
        self._broadcast_parameters()

    def _attach(self) -> None:
        """Point every ``.grad`` at its (zeroed) bucket view: backward then accumulates in
        place into the buckets, allocating nothing."""
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.flat.zero_()
                for p, view in zip(bucket.params, bucket.views):
                    p.grad = view

    def _broadcast_parameters(self) -> None:
        """Replicas start equal because every rank initialises from the same seed; check it
        cheaply rather than trust it (a sum per parameter, all-reduced as max - min)."""
        # Axes in bucket order (the configuration's), never a set's: a set of strings iterates
        # in an order that depends on each process's hash seed, and ranks that reduce over
        # "dp" and "edp" in different orders deadlock.
        for axis in dict.fromkeys(b.axis for b in self.buckets):
            sums = torch.stack([p.detach().double().sum() for b in self.buckets
                                if b.axis == axis for p in b.params])
            hi, lo = sums.clone(), -sums.clone()
            self.comm.all_reduce(hi, axis, op="max")
            self.comm.all_reduce(lo, axis, op="max")
            if not torch.equal(hi, -lo):
                raise RuntimeError(f"data-parallel replicas differ at start-up over '{axis}' "
                                   "(non-deterministic initialisation?)")

    @contextlib.contextmanager
    def micro_step(self, last: bool) -> Iterator[None]:
        """Gradients are communicated only on the last micro-step of an accumulation (the
        others accumulate into the buckets)."""
        self._sync = last
        try:
            yield
        finally:
            self._sync = True

    def _on_grad(self, p: nn.Parameter) -> None:
        bucket, i = self._where[p]
        view = bucket.views[i]
        if p.grad is not view:  # a gradient in a tensor of its own (.grad was released)
            # the bucket's stale contents may be there: this gradient is the whole of it
            with torch.no_grad():
                view.copy_(p.grad)
            p.grad = view
        if not self._sync:
            return
        bucket.pending -= 1
        if bucket.pending == 0:  # the whole bucket is ready: send it while backward goes on
            bucket.launched = time.perf_counter()
            bucket.handle = self.comm.all_reduce(bucket.flat, bucket.axis, async_op=True)

    def finish_gradients(self) -> None:
        """Wait for every bucket's all-reduce; the summed gradients are then in ``.grad``
        (views of the buckets)."""
        for k, bucket in enumerate(self.buckets):
            if bucket.handle is None:
                raise RuntimeError("a gradient bucket was never reduced: some parameter got no "
                                   "gradient this step (unused parameter?)")
            bucket.handle.wait()
            if self.comm.trace is not None:
                mib = bucket.flat.numel() * bucket.flat.element_size() / 2**20
                self.comm.trace.append(TraceRecord(
                    self.comm.rank("world"),
                    f"all-reduce bucket {k} ({bucket.axis}, {mib:.1f} MiB)",
                    bucket.launched, time.perf_counter(), "comm"))
            bucket.handle, bucket.pending = None, len(bucket.params)

    def step(self, lr: float) -> None:
        """AdamW at ``lr`` (it releases the ``.grad`` tensors), then the zeroed buckets become
        the next step's gradients."""
        super().step(lr)
        self._attach()
