"""The layout of a run under torchrun: process group, mesh, communication layer, and which
engine (data parallel or ZeRO) trains the model."""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import torch.distributed as dist

from threefold.comm import faults
from threefold.layout.axes import CP_AXES, EP_LEVELS, EXPERT_AXES
from threefold.weights.checkpoint_verify import CheckpointError
from threefold.comm.collective_check import CHECK_ENV, GroupCheck, Ledger, check_groups
from threefold.comm.counted import Comm
from threefold.comm.distributed import c10d_store, init_distributed, set_timeout, shutdown
from threefold.comm.liveness import Heartbeats
from threefold.layout import Layout, validate_layout
from threefold.layout.checks import pipeline_microbatches
from threefold.comm.mesh import build_mesh
from threefold.parallel.transforms.context import SequenceSum, shard_batch
from threefold.parallel.transforms.cp_order import split_balance
from threefold.parallel.materialize import buffer_pieces
from threefold.parallel.pipeline.executor import PipelineExecutor
from threefold.schedules.registry import schedule_spec
from threefold.comm.topology import gather_topology
from threefold.parallel.pipeline.stage import rank_model, split_model, embedding_replica
from threefold.parallel.placement import placement
from threefold.parallel.engines.zero import ZeroEngine
from threefold.weights.resharding import rank_pieces
from threefold.config import Config, ModelConfig
from threefold.parallel.world import World

_RUNS = itertools.count()  # Distributed layouts made in this process: every rank makes the
# same ones in the same order, so the count tells runs sharing one process group apart


def carved_axes(dims: Layout) -> tuple[str, ...]:
    """The groups the layout carves out of dp_shard (experts, with their levels under the
    hierarchical dispatch) and cp (a hybrid's Ulysses and ring parts), which the mesh lacks."""
    hierarchical = dims.ep_dispatch == "hierarchical"
    experts = EXPERT_AXES + (EP_LEVELS if hierarchical else ()) if dims.ep > 1 else ()
    return experts + (CP_AXES if dims.cp_axes == CP_AXES else ())


class Distributed(World):
    """Several processes on one DeviceMesh: pp × dp_replicate × dp_shard × cp × tp.

    Context-parallel ranks see the same sequences (the same ``dp_rank``) and keep their share
    of each (``split_sequence``); they hold the same weights, so gradients are reduced over
    ``data_axis`` (dp, or dp_cp with cp > 1) and ZeRO shards over ``shard_axis`` (dp_shard,
    or dp_shard_cp)."""

    def __init__(self, cfg: Config):

        # A group made by someone else (a test launcher running several runs in one group)
        # is left for its owner to destroy.
        self._owns_group = not dist.is_initialized()
        self.env = init_distributed(cfg.parallel.timeout_s, cfg.train.device,
                                    cfg.parallel.trace_buf_size,
                                    Path(cfg.train.output_dir) / "comm_traces")
        self.rank, self.world_size = self.env.rank, self.env.world_size
        self.local_rank = self.env.local_rank
        self.dims = Layout.from_config(cfg, self.world_size)  # the one description
        self.mesh = build_mesh(self.dims, self.env.device.type)
        # One ledger for both channels: they reach the same process groups, whose order of
        # calls is what must agree across ranks (threefold.comm.collective_check).
        # On torch's fake process group (one rank of a large layout, alone) there are no
        # peers to compare with: the calls are kept as a stream instead.
        self._fake = dist.is_initialized() and dist.get_backend() == "fake"
        self.ledger = Ledger(self.rank, cfg.parallel.check_collectives
                             or os.environ.get(CHECK_ENV) == "1", keep_stream=self._fake)
        self.comm = Comm(self.dims, self.mesh, ledger=self.ledger)
        # Logging traffic (loss sums, token counts) goes through its own counter so that
        # `comm` holds exactly what training itself moves.
        self.control = Comm(self.dims, self.mesh, ledger=self.ledger)
        for axis in carved_axes(self.dims):
            self.comm.add_axis(axis, self.dims.axis_groups(axis))
        # Groups made after the default one (the mesh's, flattened axes', expert axes') get
        # torch's default timeout (30 min for gloo), not the start-up timeout: make them all
        # now and give them the run's, so that a stuck collective anywhere fails in time.
        if not self._fake:  # whose collectives return at once
            self.comm.set_timeout(cfg.parallel.timeout_s)
        # where every rank runs, learnt once, the same call on every rank: the check that tp
        # and cp stay inside a node, and summary.json's nodes; a rank alone on torch's fake
        # group has no peers to hear from
        self.topology = None if self._fake else gather_topology(self.control, self.local_rank)
        c = self.dims.coords(self.rank)
        self.dp_size = self.dims.dp_replicate * self.dims.dp_shard
        self.dp_rank = c["dp_replicate"] * self.dims.dp_shard + c["dp_shard"]
        self.cp_size, self.cp_rank = self.dims.cp, c["cp"]
        self.data_axis = "dp" if self.cp_size == 1 else "dp_cp"
        self.shard_axis = "dp_shard" if self.cp_size == 1 else "dp_shard_cp"
        self.is_writer = self.rank == 0
        self.pp_rank = c["pp"]
        # ZB-V and DualPipeV place chunk 1 of rank r as stage 2p-1-r: rank 0 holds both ends
        self.vshape = schedule_spec(cfg.parallel.schedule).vshape if self.dims.pp > 1 else False
        self.chunks = self.pipeline = None
        self._tied = None  # this rank's tied weights at pipeline ends (see _tie_pipeline_ends)
        self.cfg = cfg
        self._steps: list[dict[str, int]] = []
        # one key per run so several runs in one process group keep separate heartbeats
        self.heartbeats = Heartbeats(self.rank, self.world_size,
                                     f"{cfg.train.output_dir}|{cfg.train.steps}", self.comm)
        self.restarts = self.env.restart_count
        self._step_timeout_set = False
        self._timeout_s = cfg.parallel.timeout_s  # the collective timeout now in force
        self._run_key = f"{self.heartbeats.run_id}/{next(_RUNS)}"
        self._group_check: GroupCheck | None = None
        self._step = 0

    @contextlib.contextmanager
    def phase(self, name: str, grace_s: Callable[[], float] = lambda: 3.0) -> Iterator[None]:
        """Collectives issued inside are tagged with ``name`` ("start-up", "loading",
        "evaluation", "save 4", ...); a collective that fails or times out there (or a check
        that a peer never reaches) is reported with who and where before it propagates,
        after giving the other ranks ``grace_s()`` seconds to report theirs."""
        before = self.ledger.phase
        self.ledger.phase = name
        try:
            yield
        except Exception as e:
            self.report(e, grace_s())
            raise
        finally:
            self.ledger.phase = before

    def report(self, exc: BaseException, grace_s: float = 3.0) -> None:
        """``report_failure`` once per exception, for failures of the process group (not for
        bad input, which every rank raises alike and reports itself)."""
        if getattr(exc, "_threefold_reported", False) or not isinstance(exc, RuntimeError) \
                or isinstance(exc, CheckpointError):
            return
        report = self.report_failure(exc, self._step, grace_s)
        exc._threefold_reported = True
        exc.add_note(report)

    def check_collectives(self, where: str) -> None:
        """With ``parallel.check_collectives``: compare the collectives every rank issued
        since the last check across each of its groups (``collective_check.GroupCheck``)."""
        if not self.ledger.enabled:
            return
        if self._fake:
            self.ledger._roll()
            return
        if self._group_check is None:
            self._group_check = GroupCheck(self.ledger, c10d_store(), self._run_key,
                                           check_groups(self.comm))
        with self.phase(where):
            self._group_check.check(where, self._timeout_s)

    def first_rank_first(self, fn: Callable[[], Any]) -> Any:
        """Rank 0 fills shared caches (tokenizer, token file) before the others read them."""
        if self.rank == 0:
            out = fn()
            self.control.barrier()
            return out
        self.control.barrier()
        return fn()

    def check(self, cfg: Config, mcfg: ModelConfig) -> None:
        """The rule book against the model (``threefold.layout.validate_layout``)."""
        validate_layout(cfg, self.world_size, mcfg)

    @property
    def ep_size(self) -> int:
        """The expert-parallel degree."""
        return self.dims.ep

    @property
    def tp_size(self) -> int:
        """The tensor-parallel degree."""
        return self.dims.tp

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        return self.env.device

    def gather_object(self, obj):
        """Every rank's ``obj`` on rank 0 (a list), None elsewhere: the logging channel."""
        return self.control.gather_object(obj)

    def sum_logged(self, v: torch.Tensor, over_stages: bool = False) -> torch.Tensor:
        """``v`` summed in place over ``data_axis`` (and "pp") on the logging channel."""
        self.control.all_reduce(v, self.data_axis)
        if over_stages and self.pipeline is not None:
            self.control.all_reduce(v, "pp")
        return v

    def reduce_over_dp(self, v: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``v`` reduced in place over "dp" on the logging channel."""
        self.control.all_reduce(v, "dp", op=op)
        return v

    @property
    def last_stage_rank(self) -> int:
        """The pipeline rank of the last stage (the loss, the head): pp - 1, or 0 in a V."""
        return 0 if self.vshape else self.dims.pp - 1

    def pipeline_groups(self) -> list[list[int]]:
        """The ranks of each pipeline."""
        return self.dims.axis_groups("pp") if self.dims.pp > 1 else []

    def microbatches(self, cfg: Config) -> int:
        """Pipeline microbatches per step on this layout."""
        return pipeline_microbatches(cfg, self.dp_size)

    def split_pipeline(self, model):
        """This rank's pipeline chunks of the (meta) model, kept in ``self.chunks``; returns one
        module over them (what TP, activation checkpointing, the engine and checkpoints see)."""
        if self.dims.pp == 1:
            return model
        self.chunks = split_model(model, self.dims.pp, self.cfg.parallel.vpp, self.pp_rank,
                                  balance=self.cfg.parallel.pipeline_split,
                                  seq_len=self.cfg.data.seq_len, vshape=self.vshape)
        return rank_model(self.chunks)

    def build_pipeline(self, engine, micro_context, hidden: int,
                       task_loss=None, metric_names=(), extra_loss=None,
                       micro_input: Callable[[dict], dict] = lambda mb: mb) -> None:
        """The executor of this rank's schedule (pp > 1), once the engine exists;
        ``task_loss``/``metric_names`` as ``PipelineExecutor`` takes them (a task's own loss
        on the last stage); ``micro_input`` turns a step's micro-batch into the executor's
        (a task's ``pipeline_micro``: e.g. DPO's chosen and rejected rows as one batch)."""
        if self.chunks is None:
            return
        self._micro_input = micro_input
        p = self.cfg.parallel
        split = self.dims.tp if p.sequence_parallel and self.dims.tp > 1 else 1
        mcfg = self.chunks[0].cfg
        if mcfg.tie_word_embeddings or mcfg.num_nextn_predict_layers:  # a copy on the last
            self._tie_pipeline_ends(engine.model)
        self.pipeline = PipelineExecutor(
            self.chunks, p.schedule, self.dims.pp, self.microbatches(self.cfg), p.vpp,
            self.pp_rank, self.comm, micro_context=micro_context,
            grad_sync=engine.micro_step, loss_comm=self.control,
            activation_shape=lambda ids: (ids.shape[0], ids.shape[1] // split, hidden),
            task_loss=task_loss, metric_names=metric_names, extra_loss=extra_loss,
            inflight=p.pipeline_inflight)

    def forward_backward(self, micro: list[dict], n: int, plain: Callable,
                         trace: list | None) -> tuple[torch.Tensor | float, dict]:
        """``World.forward_backward``: under pipeline parallelism the schedule runs every
        micro-batch's forward and backward (each action a trace record of a traced step, timed
        to the device's end on a GPU: execution, not queueing); otherwise ``plain``."""
        pipe = self.pipeline
        if pipe is None:
            return plain(micro)
        pipe.sync_timing = trace is not None and self.device.type == "cuda"
        loss = pipe.run([self._micro_input(mb) for mb in micro], n)
        if trace is not None:
            trace.extend(pipe.records)
        return loss, {k: torch.tensor(v, dtype=torch.float64) for k, v in pipe.metrics.items()}

    def forward_only(self, micro: list[dict], plain: Callable) -> torch.Tensor | float:
        """``World.forward_only``: the pipeline's forward-only schedule, or ``plain``."""
        if self.pipeline is None:
            return plain(micro)
        return self.pipeline.evaluate([self._micro_input(mb) for mb in micro])

    def _tie_pipeline_ends(self, model) -> None:
        """Tied embeddings under pipeline parallelism (Megatron's embedding group): the first
        stage's embedding and the last stage's copy of it as LM head get their gradients summed
        over the two ranks (axis "pp_ends"), for every (dp, tp) position. Collective. In a V
        both are on rank 0 and their gradients are summed there, without a message."""
        if self.vshape:
            if model.model.embed_tokens is not None:
                copy = model.model.mtp_embed if model.model.mtp_embed is not None \
                    else model.lm_head
                self._tied = (model.model.embed_tokens.weight, copy.weight)
            return
        pairs = [[g[0], g[-1]] for g in self.dims.axis_groups("pp")]
        self.comm.add_axis("pp_ends", pairs, counted_as="pp")  # as the planner counts it
        self.comm.set_timeout(self._timeout_s)  # the new group's too
        replica = embedding_replica(model)
        if replica is not None:  # placed as such by split_model: counted and saved elsewhere
            self._tied = (replica, True)
        elif model.model.embed_tokens is not None:
            self._tied = (model.model.embed_tokens.weight, False)

    def reduce_tied_gradients(self, engine) -> None:
        """Sum the tied embedding's gradient between the first and last pipeline stages
        (after data-parallel/ZeRO reduction, before clipping); nothing elsewhere."""
        if self._tied is None or not self._tied[0].requires_grad:  # none, or frozen (LoRA)
            return
        if self.vshape:  # embedding and its copy as head, both here: sum them in place
            embed, head = (engine.gradient_of(q) for q in self._tied)
            embed.add_(head)
            head.copy_(embed)
            return
        self.comm.all_reduce(engine.gradient_of(self._tied[0]), "pp_ends")

    def split_sequence(self, micro: dict) -> dict:
        """This cp rank's tokens of a micro-batch of whole sequences (as they are for cp 1)."""
        if self.cp_size == 1:
            return micro
        p, u = self.cfg.parallel, self.dims.ulysses
        return shard_batch(micro, self.cp_size, self.cp_rank, u,
                           split_balance(p.cp_balance, p.cp_algorithm, u))

    def sequence_sum(self, partial: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(``partial`` summed over cp, 1/cp): see ``World.sequence_sum``."""
        if self.cp_size == 1:
            return partial, 1.0
        return SequenceSum.apply(partial, self.comm), 1.0 / self.cp_size

    def checkpoint_pieces(self, engine) -> list:
        """This rank's checkpoint pieces, each placed in its logical tensor and each
        replicated tensor written once (``threefold.weights.resharding.rank_pieces``, which sits
        below this package: it is given the placements and the engine's kind)."""
        placements = {n: placement(p) for n, p in engine.named_params}
        pieces = rank_pieces(engine, self.dims, self.rank, self.data_axis, placements,
                             zero=isinstance(engine, ZeroEngine))
        c = self.dims.coords(self.rank)
        if c[self.data_axis] == 0 and c["tp"] == 0:  # buffers: whole on every such rank
            pieces += buffer_pieces(engine.model)
        return pieces

    def barrier(self) -> None:
        """Wait for every rank."""
        self.control.barrier()

    def global_token_count(self, local_count: int) -> int:
        """Sum a per-rank count (target tokens, pairs) over dp (a scalar all-reduce)."""
        n = torch.tensor([int(local_count)], dtype=torch.int64)
        self.control.all_reduce(n, "dp")
        return int(n)

    def any_rank(self, flag: bool) -> bool:
        """Collective: whether ``flag`` is set on any rank of the world (a 1-element max
        all-reduce on the logging channel, not counted as training traffic)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self.control.all_reduce(t, "world", op="max")
        return bool(t.item())

    def sum_over_dp(self, value: torch.Tensor) -> float:
        """Sum a scalar over data-parallel ranks, and context-parallel ones (each holds the
        loss of its share of the tokens); for logging, not counted as training traffic."""
        v = value.detach().double().reshape(1).cpu()
        self.control.all_reduce(v, self.data_axis)
        return float(v)

    def before_step(self, step: int) -> None:
        """Open a new accounting window; after step 1 switch to the short collective timeout;
        leave a heartbeat (this rank reached ``step``)."""
        self.heartbeats.beat(step)
        faults.at_step(self.rank, step)
        self._step = step
        self.comm.set_step(step)
        self.control.set_step(step)
        self.comm.step_counters()  # discard traffic between steps (evaluation, checkpoints)
        if step > 0 and not self._step_timeout_set:
            set_timeout(self.cfg.parallel.step_timeout_s)
            self._timeout_s = self.cfg.parallel.step_timeout_s
            self._step_timeout_set = True

    def report_failure(self, exc: BaseException, step: int, grace_s: float = 3.0) -> str:
        """Who failed and where (``threefold.comm.liveness.Heartbeats.report_failure``)."""
        return self.heartbeats.report_failure(exc, step, grace_s)

    def step_metrics(self, count: bool = True) -> dict[str, Any]:
        """Bytes this rank sent per mesh axis during the step just finished; with ``count``
        False (after an evaluation) they are dropped: not training traffic."""
        counters = self.comm.step_counters()
        if not count:
            return {}
        self._steps.append(counters)
        return {"comm_bytes": counters}

    def summary_metrics(self) -> dict[str, Any]:
        """Mean bytes sent per rank per step on each axis; the nodes the ranks ran on."""
        out = {} if self.topology is None else {"topology": self.topology.summary(self.dims)}
        if not self._steps:
            return {**out, "comm_bytes_per_step": {}}
        axes = sorted({a for s in self._steps for a in s})
        return {**out, "comm_bytes_per_step": {
            a: sum(s.get(a, 0) for s in self._steps) / len(self._steps) for a in axes}}

    def topology_lines(self) -> list[str]:
        """The nodes the ranks run on, and a warning per axis (tp, cp) that leaves a node."""
        if self.topology is None:
            return []
        t = self.topology
        nodes = "; ".join(f"{h}: {n}" for h, n in zip(t.nodes, t.ranks_per_node))
        return [f"threefold: {self.world_size} ranks on {t.describe()} ({nodes})",
                *t.warnings(self.dims)]

    def describe(self) -> str:
        """One line for the log."""
        return f"{self.world_size} ranks ({self.dims.describe()}, zero {self.cfg.parallel.zero_stage})"

    def close(self) -> None:
        """The last check of the collectives, then barrier and destroy the process group
        (avoids aborts at exit on CPU). Each rank's last check record stays in the store (one
        key, which a restart's prefix or the next run's key never reads)."""
        self.check_collectives("the run")
        if self._owns_group:
            # every group destroyed and unreferenced now, so that each backend's threads end
            # while the interpreter is whole (why: threefold.comm.distributed.shutdown)
            shutdown(comms=(self.comm, self.control), meshes=(self.mesh,))
        else:
            self.control.barrier()
