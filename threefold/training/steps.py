"""One optimiser step and one evaluation, the same for one process and for many: the
engine (``threefold.parallel``) hides the layout, the task (``threefold.training.task``) the loss."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import TYPE_CHECKING

import torch

from threefold.config import Config
from threefold.schedules.timeline import TraceRecord

if TYPE_CHECKING:  # annotations only
    from threefold.training.run import Run


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate for optimiser step ``step`` (0-based): linear warmup, then cosine decay to
    ``min_lr_ratio`` of the peak at the last step."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, total - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def micro_batches(run: Run, batch: dict[str, torch.Tensor]):
    """Micro-batches of this rank's sequences, each cut to this rank's tokens (context
    parallelism)."""
    n = next(iter(batch.values())).shape[0]
    mb = min(run.cfg.train.micro_batch_size, n)
    for i in range(0, n, mb):
        yield run.world.split_sequence({k: v[i:i + mb].to(run.device)
                                         for k, v in batch.items()})


class StepTracer:
    """Times the phases of one step as trace records of this rank (``trace`` a list), or does
    nothing (``trace`` None). On a GPU it waits for the device at each phase's end, so the
    trace shows execution, not queueing."""

    def __init__(self, run: Run, trace: list | None):
        self.trace, self.rank = trace, run.world.rank
        self.cuda = run.device.type == "cuda"

    @contextlib.contextmanager
    def __call__(self, name: str, category: str = "compute"):
        if self.trace is None:
            yield
            return
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.trace.append(TraceRecord(self.rank, name, t0, time.perf_counter(), category))


def train_step(run: Run, step: int, trace: list | None = None
               ) -> tuple[float, float, dict[str, float]]:
    """One optimiser step over the global batch of ``step``; returns (mean loss, grad norm,
    extra metrics). The loss is the sum over the global batch divided by the true number of
    units (target tokens, pairs) in it, so accumulation and data parallelism give the
    single-process gradient. What the model adds (a mixture of experts' router losses, per
    micro-batch, and its routing-bias update: ``run.router_log``) is reported among the
    extra metrics, not in the loss. With a ``trace`` list, this rank's timed phases are
    appended to it (each micro-batch's forward and backward, or the pipeline's every
    action; the collectives that time themselves; gradient synchronisation, clipping, the
    optimiser). Everything layout-specific is a hook of the world or the engine, everything
    model-specific one of ``run.router_log``: the step names neither."""
    lay, eng, router = run.world, run.engine, run.router_log
    timed = StepTracer(run, trace)
    with lay.traced(trace):
        batch = run.sampler.local_batch(step, lay.dp_rank, lay.dp_size)
        n = lay.global_token_count(run.task.count(batch))
        micro = list(micro_batches(run, batch))
        router.restart()
        eng.begin_step()  # counts this step's traffic only (not evaluation's or sampling's)
        loss_sum = torch.zeros((), dtype=torch.float32, device=run.device)
        done, extras = lay.forward_backward(
            micro, n, lambda mbs: _micro_steps(run, mbs, n, router, timed), trace)
        loss_sum += done
        with timed("finish gradients", "comm"):
            eng.finish_gradients()
            lay.reduce_tied_gradients(eng)
        with timed("clip gradients", "comm"):
            norm = eng.clip_grad_norm(run.cfg.optim.grad_clip)
        with timed("optimizer step"):
            eng.step(lr_at(step, run.cfg))
            router.balance(lay.sum_logged)
    loss, norm, metrics = _read_logged(run, loss_sum, norm, extras, n)
    # sums over the data-parallel ranks (and pipeline stages); nothing for a dense model
    metrics.update(router.metrics(n, lambda v: sum_router(lay, v, scalar=True),
                                  lambda v: sum_router(lay, v)))
    metrics.update(eng.step_metrics())  # this rank's (the log's: rank 0's)
    metrics.update(run.task.step_metrics())  # figures of the step as a whole (GRPO's rewards)
    metrics.update(run.task.data_metrics(run, step))  # tokens and epoch of each source
    return loss, norm, metrics


def _micro_steps(run, micro: list[dict], n: int, router, timed
                 ) -> tuple[torch.Tensor, dict]:
    """Forward and backward of every micro-batch (without a pipeline), each loss divided by
    the step's ``n`` units, the router term of the model's (``RouterLog.add``) in the
    objective; the engine synchronises gradients on the last. Returns the summed loss (a
    device tensor) and the task's extra metrics, summed."""
    eng = run.engine
    loss_sum = torch.zeros((), dtype=torch.float32, device=run.device)
    extras: dict[str, torch.Tensor] = {}
    for i, mb in enumerate(micro):
        with eng.micro_step(last=i == len(micro) - 1):
            with timed(f"F mb{i}"):
                total, more = run.task.loss(run, mb)
                loss = total / n
                term = router.add(eng.model, functools.partial(run.task.count, mb))
                objective = loss if term is None else (total + term) / n
            with timed(f"BW mb{i}"):  # with the gradient reductions it starts
                objective.backward()
        loss_sum += loss.detach()
        for k, v in more.items():
            extras[k] = extras.get(k, 0) + v.detach().double()
    return loss_sum, extras


def _read_logged(run, loss_sum: torch.Tensor, norm: torch.Tensor, extras: dict, n: int
                 ) -> tuple[float, float, dict[str, float]]:
    """One read from the device for what the step logs: the loss, the norm and the task's
    metrics come back together (a single host sync per step; clipping kept the norm on the
    device), then the sums over data-parallel ranks are one all-reduce on the host."""
    names = [k for k in run.task.metric_names if k in extras]
    logged = torch.stack([loss_sum.double(), norm.detach().double().to(loss_sum.device)]
                         + [extras[k].reshape(()).to(loss_sum.device) for k in names])
    logged = logged.cpu()
    summed = run.world.sum_logged(torch.cat([logged[:1], logged[2:]]))
    metrics = {k: float(v) / n for k, v in zip(names, summed[1:].tolist())}
    return float(summed[0]), float(logged[1]), metrics


def sum_router(lay, v: torch.Tensor, scalar: bool = False):
    """A router figure summed over data-parallel ranks and, in a pipeline, over the stages
    (each holds the terms of its layers); a float for ``scalar``."""
    v = lay.sum_logged(v.detach().double().reshape(-1) if scalar else v, over_stages=True)
    return float(v) if scalar else v


@torch.no_grad()
def evaluate(run: Run) -> tuple[float, dict[str, float]]:
    """The validation loss, per unit, on the fixed validation batches: the task's sets'
    (``Task.val_sets``: each pre-training source's held-out tokens) weighted sum, and each
    set's own loss by name when there are several."""
    sets = run.task.val_sets(run)
    with run.world.phase("evaluation"):
        losses = {name: _evaluate_set(run, sampler) for name, _, sampler in sets}
        run.engine.release_roots()  # nothing gathered for evaluation outlives it
    total = sum(weight * losses[name] for name, weight, _ in sets)
    return total, (losses if len(sets) > 1 else {})


def _evaluate_set(run: Run, sampler) -> float:
    """Mean loss per unit over ``train.eval_batches`` batches of one validation sampler."""
    lay = run.world
    total = torch.zeros((), dtype=torch.float64, device=run.device)
    count = 0
    for k in range(run.cfg.train.eval_batches):
        batch = sampler.local_batch(k, lay.dp_rank, lay.dp_size)
        total += lay.forward_only(list(micro_batches(run, batch)),
                                  lambda mbs: sum(run.task.loss(run, mb)[0].double()
                                                  for mb in mbs))
        count += lay.global_token_count(run.task.count(batch))
    return lay.sum_over_dp(total) / count
