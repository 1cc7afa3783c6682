"""Run one rank's pipeline schedule: any schedule's action list (schedules.py), one executor.

Per optimiser step the executor walks this rank's actions in order:

- ``F``: forward of one microbatch through one chunk. The first stage reads token ids; the
  others read the activation received from (or, on the same rank, handed over by) the
  previous stage, as a leaf that requires grad. The last stage computes the loss with the
  given loss function, divided by the step's target-token count, so the summed gradient over
  microbatches (and data-parallel ranks) is the single-process gradient of the global batch.
- ``BW``: the whole backward of that chunk: weight gradients accumulate in ``.grad``, the input
  gradient goes to the previous stage.
- ``B`` / ``W`` (zero bubble, Qi et al., arXiv 2401.10241 §2): B computes only the input
  gradient, which the previous stage is waiting for; W computes the weight gradients later.
  See ``split_backward.SplitBackward`` for how the graph is cut.
- sends and receives: each maximal run of them is posted with ``comm.batch_isend_irecv`` over
  "pp"; its receives are waited on before the next compute action (the contract check.py
  proves deadlock-free), its sends only when the next run is posted or the step ends, so a
  send overlaps the compute after it (the trace shows each send in flight on its own track).
  Messages are matched by posting order between each pair of ranks.

Gradient synchronisation of data parallelism/ZeRO (``grad_sync``, e.g. ``engine.micro_step``)
is switched on only around the last backward action that produces weight gradients for each
chunk (its last BW or W), so bucketed reductions fire once per step, after the last
microbatch has contributed.

Every action is timed (``TraceRecord``: compute actions, and communication batches including
any wait for the peer), for a Chrome trace of the run and the measured idle fraction.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, ContextManager, Sequence

import torch
from torch import nn

from threefold.schedules import check_schedule
from threefold.schedules.actions import RECEIVES, rank_stage, stage_rank
from threefold.schedules import Action, ActionKind, build_schedule, num_stages
from threefold.schedules.registry import schedule_spec
from threefold.schedules import replay
from threefold.parallel.pipeline.split_backward import SplitBackward
from threefold.schedules.timeline import TraceRecord

F, B, W, BW = (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT,
               ActionKind.BACKWARD)


@functools.lru_cache(maxsize=32)
def checked_schedule(name: str, p: int, m: int, v: int, inflight: int = 0
                     ) -> tuple[tuple[Action, ...], ...]:
    """Every rank's action list, proven complete and deadlock-free first (check.py)."""
    check_schedule(name, p, m, v, inflight)
    return tuple(tuple(acts) for acts in build_schedule(name, p, m, v, inflight))


@functools.lru_cache(maxsize=32)
def forward_only_schedule(name: str, p: int, m: int, v: int, inflight: int = 0
                          ) -> tuple[tuple[Action, ...], ...]:
    """The schedule's lists without backward computes and gradient messages (evaluation):
    forwards keep their order and partners. Removing work can merge two message batches into
    one, so the result is replayed once more to prove it free of deadlock."""
    keep = (F, ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD)
    lists = [[a for a in acts if a.kind in keep]
             for acts in checked_schedule(name, p, m, v, inflight)]
    replay(lists, num_stages(name, p, v))  # DeadlockError if it could hang
    return tuple(tuple(acts) for acts in lists)


# --------------------------------------------------------------------------------------------
# Split backward: B (input gradient now) and W (weight gradients later)
# --------------------------------------------------------------------------------------------
def _null_context(*_args) -> ContextManager:
    return contextlib.nullcontext()


def _unpack(mb) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(token ids, labels, forward keyword arguments) of a microbatch given as a pair or as a
    dict with "input_ids", "labels" and optionally "position_ids", "document_ids". Positions
    of the whole sequence are always given explicitly: a later stage sees only hidden states
    (split on the sequence under sequence parallelism), from which it cannot tell them."""
    if isinstance(mb, dict):
        inputs, labels = mb["input_ids"], mb["labels"]
        extra = {k: mb[k] for k in ("position_ids", "document_ids") if mb.get(k) is not None}
    else:
        (inputs, labels), extra = mb, {}
    if "position_ids" not in extra:
        b, t = inputs.shape[:2]
        extra["position_ids"] = torch.arange(t, device=inputs.device).expand(b, t)
    return inputs, labels, extra


class _AddInBackward(torch.autograd.Function):
    """Identity on ``x``; in backward, also the gradient 1 for the scalar ``term``: the term
    joins the objective at this stage although the loss is computed on another."""

    @staticmethod
    def forward(ctx, x, term):
        ctx.term_shape, ctx.term_dtype = term.shape, term.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g, torch.ones(ctx.term_shape, dtype=ctx.term_dtype, device=g.device)


class PipelineExecutor:
    """Runs one rank's share of a pipeline schedule, step after step.

    ``chunks[c]`` is this rank's model chunk ``c`` (virtual stage ``c·p + pp_rank``, see
    stage.split_model). The last stage is called with the microbatch's ``labels`` and returns
    each token's loss (``threefold.model.head_loss``: the logits are never whole), which it sums.
    ``micro_context()`` is entered around
    every forward (e.g. autocast); ``grad_sync(last)`` around every backward that makes weight
    gradients (e.g. ``engine.micro_step``), with ``last`` True for each chunk's final one.
    ``loss_comm`` carries the loss all-reduce over "pp" (default ``comm``; pass a separate
    Comm to keep logging traffic out of the training counters). ``task_loss(outputs,
    microbatch)``, when given, replaces the sum on the last stage: it gets the token losses
    and the microbatch as passed to ``run`` (a dict: a task such as DPO puts its own fields
    there) and returns (summed loss, {name: value}); the values named in ``metric_names`` are summed
    over microbatches and left in ``self.metrics`` after each step, on every rank, and every
    microbatch's dict stays in ``self.task_outputs[microbatch]`` on the last stage.
    ``activation_shape(inputs)`` is the shape of a stage-boundary activation for a
    microbatch of token ids ``inputs`` (default (batch, seq, hidden); pass (batch, seq/tp,
    hidden) under sequence parallelism) and ``activation_dtype`` its dtype (default: the
    chunks' parameter dtype). On a GPU the trace shows when work was queued unless the
    attribute ``sync_timing`` is set: then it waits for the device after each action (exact
    durations, at the cost of any overlap).
    ``extra_loss(chunk, microbatch)``, when given, is called after every training forward of
    a chunk and returns None or a scalar to add to the objective there (a mixture of
    experts' router losses of that chunk's layers, ``threefold.model.moe.RouterLog``), divided by
    the step's count like the loss: on the last stage it joins the loss, elsewhere it
    enters the backward through the chunk's output (``_AddInBackward``); the logged loss
    leaves it out.
    """

    def __init__(self, chunks: Sequence[nn.Module], schedule: str, p: int, m: int, v: int,
                 pp_rank: int, comm, *,
                 micro_context: Callable[[], ContextManager] | None = None,
                 grad_sync: Callable[[bool], ContextManager] | None = None,
                 loss_comm=None, activation_shape: Callable | None = None,
                 activation_dtype: torch.dtype | None = None, trace_rank: int | None = None,
                 task_loss: Callable | None = None, metric_names: Sequence[str] = (),
                 extra_loss: Callable | None = None, inflight: int = 0):
        self.extra_loss = extra_loss
        self.inflight = inflight
        self.actions = checked_schedule(schedule, p, m, v, inflight)[pp_rank]
        self.n = num_stages(schedule, p, v)
        if len(chunks) != self.n // p:
            raise ValueError(f"pipeline: schedule {schedule} with pp={p}, vpp={v} runs "
                             f"{self.n // p} chunk(s) per rank, got {len(chunks)}")
        self.vshape = schedule_spec(schedule).vshape
        for c, chunk in enumerate(chunks):
            want = rank_stage(pp_rank, c, p, self.vshape)
            got = getattr(chunk, "pipeline_stage", None)
            if got is not None and got != want:
                raise ValueError(f"pipeline: chunk {c} of rank {pp_rank} must be virtual stage "
                                 f"{want}, got a chunk of stage {got}")
        self.chunks, self.schedule, self.p, self.m, self.v = list(chunks), schedule, p, m, v
        self.pp_rank, self.comm = pp_rank, comm
        self.loss_comm = loss_comm if loss_comm is not None else comm
        self.micro_context = micro_context or _null_context
        self.grad_sync = grad_sync or _null_context
        self.activation_shape = activation_shape
        self.activation_dtype = activation_dtype or next(
            (q.dtype for c in chunks for q in c.parameters() if q.is_floating_point()),
            torch.float32)
        self.trace_rank = trace_rank if trace_rank is not None else \
            (comm.global_rank if comm is not None else 0)
        self.pp_ranks = (comm.dims.axis_ranks(comm.global_rank, "pp")
                         if comm is not None else [0])
        # The last action of each chunk that accumulates weight gradients: gradient sync on.
        self.last_weight_action = {}
        for i, a in enumerate(self.actions):
            if a.kind in (BW, W):
                self.last_weight_action[a.chunk] = i
        # the weights of each chunk, for split backward (B/W) to tell them from activations
        self.params = [[q for q in c.parameters() if q.requires_grad] for c in self.chunks]
        self.sync_timing = False
        self.task_loss, self.metric_names = task_loss, tuple(metric_names)
        self.metrics: dict[str, float] = {}
        self.task_outputs: dict[int, dict] = {}
        self.records: list[TraceRecord] = []

    # ---------------------------------------------------------------- one step
    def run(self, microbatches: Sequence, n_tokens: int | float) -> float:
        """Forward and backward of all m microbatches of one step; gradients are left
        accumulated in the chunks' parameters. A microbatch is (token ids, labels) or a dict
        as train.py's micro-batches ("input_ids", "labels", optional "position_ids" and
        "document_ids"), the same on every rank of the pipeline. Returns the step's summed loss
        (sum over microbatches of loss / n_tokens), the same on every rank of the pipeline."""
        return self._run(self.actions, microbatches, n_tokens, forward_only=False,
                         task_loss=self.task_loss)

    @torch.no_grad()
    def evaluate(self, microbatches: Sequence, n_tokens: int | float = 1,
                 task_loss: Callable | None = None) -> float:
        """Forward only (no graph kept): the summed loss over microbatches of
        loss / n_tokens, the same on every rank of the pipeline (n_tokens 1: the token sum).
        ``task_loss`` replaces the executor's for this call (e.g. to score sequences)."""
        actions = forward_only_schedule(self.schedule, self.p, self.m, self.v,
                                        self.inflight)[self.pp_rank]
        return self._run(actions, microbatches, n_tokens, forward_only=True,
                         task_loss=task_loss or self.task_loss)

    def _run(self, actions, microbatches, n_tokens, forward_only: bool,
             task_loss: Callable | None = None) -> float:
        if len(microbatches) != self.m:
            raise ValueError(f"pipeline: schedule is for {self.m} microbatches, got "
                             f"{len(microbatches)}")
        self._raw, self._task_loss, self.task_outputs = list(microbatches), task_loss, {}
        self._mbs = [_unpack(mb) for mb in microbatches]
        self._n_tokens, self._forward_only = n_tokens, forward_only
        self._x, self._out, self._grad_in, self._split = {}, {}, {}, {}
        self._handoff_f, self._handoff_b = {}, {}  # stage to stage on this rank
        self._recv_f, self._recv_b = {}, {}  # received activations / output gradients
        self._sends = []  # (handle, tensors, posted at, names): sends in flight
        self._loss = torch.zeros((), dtype=torch.float64, device=self._mbs[0][0].device)
        self._metrics = torch.zeros(len(self.metric_names), dtype=torch.float64,
                                    device=self._loss.device)
        self.records = []
        i = 0
        while i < len(actions):
            j = i + 1
            if actions[i].kind.is_compute:
                self._compute(i, actions[i])
            else:
                while j < len(actions) and not actions[j].kind.is_compute:
                    j += 1
                self._communicate(actions[i:j])
            i = j
        self._wait_sends()
        if self._out or self._split:
            raise RuntimeError("pipeline: the schedule left microbatches without a backward")
        loss = torch.cat([self._loss.reshape(1), self._metrics])
        if self.p > 1:  # only the last stage has them; the others add zero
            self.loss_comm.all_reduce(loss, "pp")
        self.metrics = dict(zip(self.metric_names, loss[1:].tolist()))
        return float(loss[0])

    # ---------------------------------------------------------------- compute actions
    def _compute(self, index: int, a: Action) -> None:
        t0 = time.perf_counter()
        key = (a.microbatch, a.stage)
        if a.kind is F:
            self._forward(a, key)
        else:
            makes_weights = a.kind in (BW, W)
            last = self.last_weight_action.get(a.chunk) == index
            ctx = self.grad_sync(last) if makes_weights else contextlib.nullcontext()
            with ctx:
                if a.kind is BW:
                    self._full_backward(a, key)
                elif a.kind is B:
                    self._input_backward(a, key)
                else:
                    self._split.pop(key).weight_backward()
        self.records.append(TraceRecord(self.trace_rank, str(a), t0, self._now(), "compute"))

    def _forward(self, a: Action, key: tuple[int, int]) -> None:
        inputs, labels, extra = self._mbs[a.microbatch]
        if a.stage == 0:
            x = inputs
        else:
            x = self._handoff_f.pop(key) if key in self._handoff_f else self._recv_f.pop(key)
            x = x.detach().requires_grad_(not self._forward_only)
        last = a.stage == self.n - 1
        if last:  # the last stage returns each token's loss (threefold.model.head_loss)
            extra = {**extra, "labels": labels}
            if a.stage and self.chunks[a.chunk].model.mtp_embed is not None:
                extra["token_ids"] = inputs  # the multi-token-prediction modules embed them
        with self.micro_context():
            out = self.chunks[a.chunk](x, **extra)
        term = None
        if self.extra_loss is not None and not self._forward_only:
            term = self.extra_loss(self.chunks[a.chunk], self._raw[a.microbatch])
            if term is not None:
                term = term / self._n_tokens
                if a.stage < self.n - 1:
                    out = _AddInBackward.apply(out, term)
        if last:
            if self._task_loss is not None:  # the task's own loss over the whole microbatch
                total, more = self._task_loss(out, self._raw[a.microbatch])
                self.task_outputs[a.microbatch] = more
                for i, k in enumerate(self.metric_names):
                    if k in more:
                        self._metrics[i] += more[k].detach().double()
                out = total / self._n_tokens
            else:
                out = out.sum() / self._n_tokens
            self._loss += out.detach().double()
            if term is not None:
                out = out + term
        elif stage_rank(a.stage + 1, self.p, self.vshape) == self.pp_rank:  # next stage here: hand over
            self._handoff_f[(a.microbatch, a.stage + 1)] = out.detach()
        if not self._forward_only:
            self._x[key], self._out[key] = x, out
        elif a.stage < self.n - 1 and stage_rank(a.stage + 1, self.p, self.vshape) != self.pp_rank:
            self._out[key] = out  # until it is sent

    def _output_grad(self, a: Action, key: tuple[int, int]) -> torch.Tensor | None:
        if a.stage == self.n - 1:
            return None  # the loss: d loss / d loss = 1
        g = self._handoff_b.pop(key) if key in self._handoff_b else self._recv_b.pop(key)
        return g.to(self._out[key].dtype)

    def _pass_input_grad(self, a: Action, key: tuple[int, int], g: torch.Tensor | None) -> None:
        if a.stage == 0:
            return
        if stage_rank(a.stage - 1, self.p, self.vshape) == self.pp_rank:
            self._handoff_b[(a.microbatch, a.stage - 1)] = g
        else:
            self._grad_in[key] = g

    def _full_backward(self, a: Action, key: tuple[int, int]) -> None:
        g = self._output_grad(a, key)
        x, out = self._x.pop(key), self._out.pop(key)
        torch.autograd.backward(out, g)
        self._pass_input_grad(a, key, x.grad if a.stage > 0 else None)

    def _input_backward(self, a: Action, key: tuple[int, int]) -> None:
        g = self._output_grad(a, key)
        x, out = self._x.pop(key), self._out.pop(key)
        split = SplitBackward(out, g, x, self.params[a.chunk])
        self._pass_input_grad(a, key, split.input_grad)
        split.input_grad = None
        self._split[key] = split

    # ---------------------------------------------------------------- communication
    def _buffer(self, a: Action) -> torch.Tensor:
        inputs = self._mbs[a.microbatch][0]
        shape = (self.activation_shape(inputs) if self.activation_shape
                 else (*inputs.shape[:2], self.chunks[0].cfg.hidden_size))
        return torch.empty(shape, dtype=self.activation_dtype, device=inputs.device)

    def _communicate(self, batch: Sequence[Action]) -> None:
        """Post a run of sends and receives. The receives are waited on here (the next
        compute action may need them); the sends are not: they stay in flight during the
        compute that follows and are waited on when the next run is posted (``_wait_sends``)
        or at the end of the step. Deferring a send's wait cannot deadlock a schedule that
        check.py proved free of deadlock with every wait immediate: a peer's progress
        towards that send's receive depends only on messages posted before it."""
        self._wait_sends()
        t0 = time.perf_counter()
        sends, recvs = [], []
        for a in batch:
            key, peer = (a.microbatch, a.stage), self.pp_ranks[a.peer]
            if a.kind is ActionKind.SEND_FORWARD:
                out = self._out.pop(key) if self._forward_only else self._out[key]
                sends.append(("send", out.detach().to(self.activation_dtype).contiguous(), peer))
            elif a.kind is ActionKind.SEND_BACKWARD:
                sends.append(("send", self._grad_in.pop(key).to(self.activation_dtype)
                              .contiguous(), peer))
            else:
                t = self._buffer(a)
                (self._recv_f if a.kind is ActionKind.RECV_FORWARD else self._recv_b)[key] = t
                recvs.append(("recv", t, peer))
        names = " + ".join(map(str, batch))
        if sends:  # each direction keeps its posting order, so messages still match
            handle = self.comm.batch_isend_irecv(sends, async_op=True)
            self._sends.append((handle, [t for _, t, _ in sends], t0,
                                " + ".join(str(a) for a in batch if a.kind not in RECEIVES)))
        if recvs:
            self.comm.batch_isend_irecv(recvs)
        self.records.append(TraceRecord(self.trace_rank, names, t0, self._now(), "comm"))

    def _wait_sends(self) -> None:
        """Wait for the sends in flight; each appears in the trace (category "send", a
        track of its own) from its posting to the moment its completion was seen, so the
        compute it overlapped shows beside it."""
        for handle, _tensors, t0, names in self._sends:
            handle.wait()
            self.records.append(TraceRecord(self.trace_rank, f"in flight: {names}", t0,
                                            self._now(), "send"))
        self._sends = []

    def _now(self) -> float:
        if self.sync_timing and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()


def pipeline_step(chunks: Sequence[nn.Module], schedule_name: str, p: int, m: int, v: int,
                  pp_rank: int, comm, microbatches: Sequence,
                  n_tokens: int | float,
                  micro_context: Callable[[], ContextManager] | None = None,
                  grad_sync: Callable[[bool], ContextManager] | None = None,
                  records: list | None = None, loss_comm=None) -> float:
    """Forward and backward of one optimiser step's ``m`` microbatches on this rank under
    the named schedule; gradients are left in the chunks' parameters for the engine to
    finish, clip and apply. Returns the step's summed loss on every rank. Measured trace
    records are appended to ``records`` when given. See ``PipelineExecutor`` for the
    arguments; build one executor and call ``run`` per step to avoid re-checking."""
    ex = PipelineExecutor(chunks, schedule_name, p, m, v, pp_rank, comm,
                          micro_context=micro_context, grad_sync=grad_sync, loss_comm=loss_comm)
    loss = ex.run(microbatches, n_tokens)
    if records is not None:
        records.extend(ex.records)
    return loss


def idle_fraction(records: Sequence[TraceRecord]) -> float:
    """Measured bubble in the simulator's form: 1 − compute time / (ranks × makespan), the
    makespan running from the first compute start to the last compute end over all ranks
    (times from ``time.perf_counter``, one clock for all processes of a machine)."""
    compute = [r for r in records if r.category == "compute"]
    if not compute:
        return 0.0
    ranks = {r.rank for r in compute}
    span = max(r.end_s for r in compute) - min(r.start_s for r in compute)
    busy = sum(r.end_s - r.start_s for r in compute)
    return 1.0 - busy / (len(ranks) * span) if span > 0 else 0.0
