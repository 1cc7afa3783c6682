"""One optimiser step and one evaluation, the same for one process and for many: the
engine (``threefold.parallel``) hides the layout, the task (``threefold.task``) the loss."""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING

import torch

from threefold.config import Config
from threefold.moe import RouterLog, balance_routers
from threefold.parallel.expert import take_rows_sent
from threefold.parallel.tp_overlap import set_trace
from threefold.schedules.timeline import TraceRecord

if TYPE_CHECKING:  # annotations only
    from threefold.run import Run


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
        yield run.layout.split_sequence({k: v[i:i + mb].to(run.device)
                                         for k, v in batch.items()})


class StepTracer:
    """Times the phases of one step as trace records of this rank (``trace`` a list), or does
    nothing (``trace`` None). On a GPU it waits for the device at each phase's end, so the
    trace shows execution, not queueing."""

    def __init__(self, run: Run, trace: list | None):
        self.trace, self.rank = trace, run.layout.rank
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


def pipeline_micro_batches(run: Run, micro: list[dict]) -> list[dict]:
    """Micro-batches as the pipeline executor takes them: the task's ``pipeline_micro``
    (e.g. DPO's chosen and rejected rows as one "input_ids"/"labels" batch, its own fields
    kept for its loss on the last stage) or as they are."""
    return [run.task.pipeline_micro(mb) for mb in micro]


def train_step(run: Run, step: int, trace: list | None = None
               ) -> tuple[float, float, dict[str, float]]:
    """One optimiser step over the global batch of ``step``; returns (mean loss, grad norm,
    extra metrics). The loss is the sum over the global batch divided by the true number of
    units (target tokens, pairs) in it, so accumulation and data parallelism give the
    single-process gradient. A mixture of experts also optimises its router losses (added
    per micro-batch, see ``threefold.moe.RouterLog``); they are reported among the extra
    metrics, not in the loss. With a ``trace`` list, this rank's timed phases are appended to
    it (the pipeline's every action, or each micro-batch's forward and backward; gradient
    synchronisation, clipping, the optimiser)."""
    lay, eng = run.layout, run.engine
    timed = StepTracer(run, trace)
    if hasattr(eng, "comm_trace"):  # data parallel: each bucket's all-reduce, launch to wait
        eng.comm_trace = trace
    overlap_traced = trace is not None and run.cfg.parallel.tp_overlap >= 2
    if overlap_traced:  # overlapped tp: each chunk's collective and matmul, this step only
        set_trace(eng.model, trace)
    batch = run.sampler.local_batch(step, lay.dp_rank, lay.dp_size)
    n = lay.global_token_count(run.task.count(batch))
    micro = list(micro_batches(run, batch))
    loss_sum = torch.zeros((), dtype=torch.float32, device=run.device)
    extras: dict[str, torch.Tensor] = {}
    pipe = lay.pipeline
    # a mixture of experts adds its router losses (threefold.moe.RouterLog: per micro-batch,
    # weighted by its loss units; in a pipeline per chunk, _pipeline_router_term); the
    # logged loss stays the task's own
    router = RouterLog(run.model_cfg) if run.model_cfg.num_local_experts else None
    run.router_log = router
    ep = lay.ep_size > 1
    if ep:  # count this step's rows only (not evaluation's)
        take_rows_sent(eng.model)
    if pipe is not None:  # the schedule runs every micro-batch's forward and backward
        # a traced step waits for the device after each action (execution, not queueing)
        pipe.sync_timing = trace is not None and run.device.type == "cuda"
        loss_sum += pipe.run(pipeline_micro_batches(run, micro), n)
        extras = {k: torch.tensor(v, dtype=torch.float64) for k, v in pipe.metrics.items()}
        if trace is not None:
            trace.extend(pipe.records)
        micro = []
    loss_sum += _micro_steps(run, micro, n, router, timed, extras)
    with timed("finish gradients", "comm"):
        eng.finish_gradients()
        lay.reduce_tied_gradients(eng)
    with timed("clip gradients", "comm"):
        norm = eng.clip_grad_norm(run.cfg.optim.grad_clip)
    with timed("optimizer step"):
        eng.step(lr_at(step, run.cfg))
        if run.model_cfg.moe_router == "sigmoid_grouped":  # DeepSeek-V3's routing bias
            balance_routers(eng.model, lay.sum_logged, run.model_cfg.router_bias_update_rate)
    if overlap_traced:
        set_trace(eng.model, None)
    loss, norm, metrics = _read_logged(run, loss_sum, norm, extras, n)
    if router is not None:  # sums over the data-parallel ranks (and pipeline stages)
        metrics.update(router.metrics(n, lambda v: sum_router(lay, v, scalar=True),
                                      lambda v: sum_router(lay, v)))
        if ep:  # this rank's (the log's: rank 0's)
            metrics["ep_rows_sent"] = take_rows_sent(eng.model)
    metrics.update(run.task.step_metrics())  # figures of the step as a whole (GRPO's rewards)
    metrics.update(run.task.data_metrics(run, step))  # tokens and epoch of each source
    return loss, norm, metrics


def _micro_steps(run, micro: list[dict], n: int, router, timed, extras: dict) -> torch.Tensor:
    """Forward and backward of every micro-batch (without a pipeline), each loss divided by
    the step's ``n`` units; the engine synchronises gradients on the last. Sums the task's
    extra metrics into ``extras``; returns the summed loss (a device tensor)."""
    eng = run.engine
    loss_sum = torch.zeros((), dtype=torch.float32, device=run.device)
    for i, mb in enumerate(micro):
        with eng.micro_step(last=i == len(micro) - 1):
            with timed(f"F mb{i}"):
                total, more = run.task.loss(run, mb)
                loss = total / n
                if router is not None:
                    objective = (total + router.add(eng.model, run.task.count(mb))) / n
            with timed(f"BW mb{i}"):  # with the gradient reductions it starts
                (loss if router is None else objective).backward()
        loss_sum += loss.detach()
        for k, v in more.items():
            extras[k] = extras.get(k, 0) + v.detach().double()
    return loss_sum


def _read_logged(run, loss_sum: torch.Tensor, norm: torch.Tensor, extras: dict, n: int
                 ) -> tuple[float, float, dict[str, float]]:
    """One read from the device for what the step logs: the loss, the norm and the task's
    metrics come back together (a single host sync per step; clipping kept the norm on the
    device), then the sums over data-parallel ranks are one all-reduce on the host."""
    names = [k for k in run.task.metric_names if k in extras]
    logged = torch.stack([loss_sum.double(), norm.detach().double().to(loss_sum.device)]
                         + [extras[k].reshape(()).to(loss_sum.device) for k in names])
    logged = logged.cpu()
    summed = run.layout.sum_logged(torch.cat([logged[:1], logged[2:]]))
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
    with run.layout.phase("evaluation"):
        losses = {name: _evaluate_set(run, sampler) for name, _, sampler in sets}
        run.engine.release_roots()  # nothing gathered for evaluation outlives it
    total = sum(weight * losses[name] for name, weight, _ in sets)
    return total, (losses if len(sets) > 1 else {})


def _evaluate_set(run: Run, sampler) -> float:
    """Mean loss per unit over ``train.eval_batches`` batches of one validation sampler."""
    lay = run.layout
    total = torch.zeros((), dtype=torch.float64, device=run.device)
    count = 0
    for k in range(run.cfg.train.eval_batches):
        batch = sampler.local_batch(k, lay.dp_rank, lay.dp_size)
        if lay.pipeline is not None:
            mbs = pipeline_micro_batches(run, list(micro_batches(run, batch)))
            total += lay.pipeline.evaluate(mbs)
        else:
            for mb in micro_batches(run, batch):
                total += run.task.loss(run, mb)[0].double()
        count += lay.global_token_count(run.task.count(batch))
    return lay.sum_over_dp(total) / count
