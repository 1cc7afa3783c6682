"""The layout of a run under torchrun: process group, mesh, communication layer, and which
engine (data parallel or ZeRO) trains the model."""

from __future__ import annotations

from typing import Any, Callable

import torch

from threefold import faults
from threefold.config import Config, ModelConfig
from threefold.parallel.layout import World
from threefold.parallel.placement import placement


class Distributed(World):
    """Several processes on one DeviceMesh: pp × dp_replicate × dp_shard × cp × tp.

    Context-parallel ranks see the same sequences (the same ``dp_rank``) and keep their share
    of each (``split_sequence``); they hold the same weights, so gradients are reduced over
    ``data_axis`` (dp, or dp_cp with cp > 1) and ZeRO shards over ``shard_axis`` (dp_shard,
    or dp_shard_cp)."""

    def __init__(self, cfg: Config):
        from threefold.comm import Comm
        from threefold.distributed import init_distributed
        from threefold.mesh import ParallelDims

        import torch.distributed as dist

        # A group made by someone else (a test launcher running several runs in one group)
        # is left for its owner to destroy.
        self._owns_group = not dist.is_initialized()
        self.env = init_distributed(cfg.parallel.timeout_s, cfg.train.device)
        self.rank, self.world_size = self.env.rank, self.env.world_size
        self.local_rank = self.env.local_rank
        self.dims = ParallelDims.from_config(cfg.parallel, self.world_size)
        self.mesh = self.dims.build_mesh(self.env.device.type)
        self.comm = Comm(self.dims, self.mesh)
        # Logging traffic (loss sums, token counts) goes through its own counter so that
        # `comm` holds exactly what training itself moves.
        self.control = Comm(self.dims, self.mesh)
        if self.dims.ep > 1:  # expert parallelism: groups carved out of dp_shard
            from threefold.mesh import EXPERT_AXES

            for axis in EXPERT_AXES:
                self.comm.add_axis(axis, self.dims.axis_groups(axis))
        c = self.dims.coords(self.rank)
        self.dp_size = self.dims.dp_replicate * self.dims.dp_shard
        self.dp_rank = c["dp_replicate"] * self.dims.dp_shard + c["dp_shard"]
        self.cp_size, self.cp_rank = self.dims.cp, c["cp"]
        self.data_axis = "dp" if self.cp_size == 1 else "dp_cp"
        self.shard_axis = "dp_shard" if self.cp_size == 1 else "dp_shard_cp"
        self.is_writer = self.rank == 0
        self.pp_rank = c["pp"]
        self.chunks = self.pipeline = None
        self._tied = None  # (this rank's tied weight, is it the head's copy) at pipeline ends
        self.cfg = cfg
        self._steps: list[dict[str, int]] = []
        # one id per run so several runs in one process group keep separate heartbeats
        import zlib

        self._run_id = f"{zlib.crc32(f'{cfg.train.output_dir}|{cfg.train.steps}'.encode()):08x}"
        self.restarts = self.env.restart_count
        self._step_timeout_set = False

    def first_rank_first(self, fn: Callable[[], Any]) -> Any:
        """Rank 0 fills shared caches (tokenizer, token file) before the others read them."""
        if self.rank == 0:
            out = fn()
            self.control.barrier()
            return out
        self.comm.barrier()
        return fn()

    def check(self, cfg: Config, mcfg: ModelConfig) -> None:
        """The layout's rules against the model (``parallel.layout.validate_layout``)."""
        from threefold.parallel.layout import validate_layout

        validate_layout(cfg, self.world_size, mcfg)

    @property
    def ep_size(self) -> int:
        """The expert-parallel degree."""
        return self.dims.ep

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

    def pipeline_groups(self) -> list[list[int]]:
        """The ranks of each pipeline."""
        return self.dims.axis_groups("pp") if self.dims.pp > 1 else []

    def microbatches(self, cfg: Config) -> int:
        """Pipeline microbatches per step on this layout."""
        from threefold.parallel.layout import pipeline_microbatches

        return pipeline_microbatches(cfg, self.dp_size)

    def split_pipeline(self, model):
        """This rank's pipeline chunks of the (meta) model, kept in ``self.chunks``; returns one
        module over them (what TP, activation checkpointing, the engine and checkpoints see)."""
        if self.dims.pp == 1:
            return model
        from threefold.parallel.pipeline.stage import rank_model, split_model

        self.chunks = split_model(model, self.dims.pp, self.cfg.parallel.vpp, self.pp_rank,
                                  balance=self.cfg.parallel.pipeline_split,
                                  seq_len=self.cfg.data.seq_len)
        return rank_model(self.chunks)

    def build_pipeline(self, engine, loss_fn, micro_context, hidden: int,
                       task_loss=None, metric_names=(), extra_loss=None) -> None:
        """The executor of this rank's schedule (pp > 1), once the engine exists;
        ``task_loss``/``metric_names`` as ``PipelineExecutor`` takes them (a task's own loss
        on the last stage)."""
        if self.chunks is None:
            return
        from threefold.parallel.pipeline.executor import PipelineExecutor

        p = self.cfg.parallel
        split = self.dims.tp if p.sequence_parallel and self.dims.tp > 1 else 1
        if self.chunks[0].cfg.tie_word_embeddings:
            self._tie_pipeline_ends(engine.model)
        self.pipeline = PipelineExecutor(
            self.chunks, p.schedule, self.dims.pp, self.microbatches(self.cfg), p.vpp,
            self.pp_rank, self.comm, loss_fn, micro_context=micro_context,
            grad_sync=engine.micro_step, loss_comm=self.control,
            activation_shape=lambda ids: (ids.shape[0], ids.shape[1] // split, hidden),
            task_loss=task_loss, metric_names=metric_names, extra_loss=extra_loss)

    def _tie_pipeline_ends(self, model) -> None:
        """Tied embeddings under pipeline parallelism (Megatron's embedding group): the first
        stage's embedding and the last stage's copy of it as LM head get their gradients summed
        over the two ranks (axis "pp_ends"), for every (dp, tp) position. Collective."""
        from threefold.parallel.pipeline.stage import tied_head_replica

        pairs = [[g[0], g[-1]] for g in self.dims.axis_groups("pp")]
        self.comm.add_axis("pp_ends", pairs, counted_as="pp")  # as the planner counts it
        replica = tied_head_replica(model)
        if replica is not None:  # placed as such by split_model: counted and saved elsewhere
            self._tied = (replica, True)
        elif model.model.embed_tokens is not None:
            self._tied = (model.model.embed_tokens.weight, False)

    def reduce_tied_gradients(self, engine) -> None:
        """Sum the tied embedding's gradient between the first and last pipeline stages
        (after data-parallel/ZeRO reduction, before clipping); nothing elsewhere."""
        if self._tied is not None:
            self.comm.all_reduce(engine.gradient_of(self._tied[0]), "pp_ends")

    def parallelize(self, model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
        """Tensor parallelism (and sequence parallelism) over "tp", when tp > 1; context
        parallelism over "cp", when cp > 1."""
        if self.dims.tp > 1:
            from threefold.parallel.tensor import apply_tensor_parallel

            model = apply_tensor_parallel(model, self.comm, cfg.parallel.sequence_parallel)
        if self.cp_size > 1:
            from threefold.parallel.context import apply_context_parallel

            model = apply_context_parallel(model, self.comm, cfg.parallel.cp_algorithm)
        if self.dims.ep > 1:
            from threefold.parallel.expert import apply_expert_parallel

            model = apply_expert_parallel(model, self.comm)
        return model

    def split_sequence(self, micro: dict) -> dict:
        """This cp rank's tokens of a micro-batch of whole sequences (as they are for cp 1)."""
        if self.cp_size == 1:
            return micro
        from threefold.parallel.context import shard_batch

        return shard_batch(micro, self.cp_size, self.cp_rank)

    def checkpoint_pieces(self, engine) -> list:
        """This rank's pieces, each replicated tensor written by one rank only: ZeRO shards by
        the first replica group, data-parallel copies by dp rank 0, tp-replicated tensors by
        tp rank 0; tp slices get their place in the logical tensor. Context-parallel ranks
        hold copies (or, under ZeRO, shards of the dp_shard × cp group) as data-parallel ones
        do."""
        from threefold.parallel.zero import ZeroEngine

        c = self.dims.coords(self.rank)
        zero = isinstance(engine, ZeroEngine)
        if zero and c["dp_replicate"] != 0:
            return []
        params = dict(engine.named_params)
        t, out = self.dims.tp, []
        for piece in engine.local_pieces():
            p = params[piece.name]
            rec = placement(p)
            if rec.tied_replica:
                continue  # a tied head's copy: the embedding, saved by the first stage
            expert = rec.ep_sharded
            if not zero and c["edp" if expert else self.data_axis] != 0:
                continue  # a data-parallel copy (of this rank's experts: over edp)
            if expert:  # this ep rank's experts: a contiguous run of the whole tensor
                off = rec.ep_index * p.numel()
                piece.start, piece.end = piece.start + off, piece.end + off
                piece.shape = (p.shape[0] * rec.ep_count, *p.shape[1:])
            dim = rec.tp_dim if t > 1 else None
            if dim is None:
                if c["tp"] == 0:
                    out.append(piece)
                continue
            shape = list(piece.shape)
            shape[dim] = rec.tp_full
            piece.shape, piece.tp_dim, piece.tp_index, piece.tp_count = (tuple(shape), dim,
                                                                         c["tp"], t)
            out.append(piece)
        return out

    def barrier(self) -> None:
        """Wait for every rank."""
        self.control.barrier()

    def build_engine(self, model: torch.nn.Module, cfg: Config, source=None,
                     device: torch.device | None = None):
        """Data parallel for ZeRO stage 0, the ZeRO engine for stages 1-3 (over dp × cp); the
        optimiser in host memory with ``parallel.offload_optimizer``. With a ``source`` the
        parameters are still on the meta device (see ``layout.build_engine``)."""
        from threefold.parallel.data import DataParallelEngine
        from threefold.parallel.engine import LocalEngine
        from threefold.parallel.materialize import materialize_parameters
        from threefold.parallel.zero import ZeroEngine

        from threefold.parallel.layout import dtypes

        p = cfg.parallel
        off = p.offload_optimizer
        param_dtype, reduce_dtype = dtypes(cfg)
        if p.zero_stage == 0:
            if source is not None:
                materialize_parameters(model, source, device or self.env.device)
            if self.dims.axis_size(self.data_axis) == 1:
                return LocalEngine(model, cfg.optim, self.comm, offload=off,
                                   param_dtype=param_dtype)
            return DataParallelEngine(model, cfg.optim, self.comm, p.bucket_mb,
                                      axis=self.data_axis, offload=off,
                                      expert_axis="edp" if self.dims.ep > 1 else None)
        m = model.model  # a pipeline stage holds only some of these
        units, axes = [], {}
        for u in (m.embed_tokens, *m.layers, m.norm, model.lm_head):
            if u is None:
                continue
            units.append(u)
            experts = getattr(getattr(u, "mlp", None), "experts", None)
            if self.dims.ep > 1 and experts is not None:  # the layer's experts: own unit
                units.append(experts)
                axes[len(units) - 1] = "edp_shard"
        return ZeroEngine(model, units, cfg.optim, self.comm, p.zero_stage,
                          shard_axis=self.shard_axis, offload=off, unit_axes=axes,
                          source=source, device=device or self.env.device,
                          param_dtype=param_dtype, reduce_dtype=reduce_dtype)

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

    # -- liveness: heartbeats in the rendezvous store, read back when a collective fails ------
    def _store(self):
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()

    def _key(self, what: str, rank: int) -> str:
        return f"threefold/{self._run_id}/{what}/{rank}"

    def before_step(self, step: int) -> None:
        """Open a new accounting window; after step 1 switch to the short collective timeout;
        leave a heartbeat (this rank reached ``step``)."""
        self._store().set(self._key("step", self.rank), str(step))
        faults.at_step(self.rank, step)
        self.comm.set_step(step)
        self.comm.step_counters()  # discard traffic between steps (evaluation, checkpoints)
        if step > 0 and not self._step_timeout_set:
            from threefold.distributed import set_timeout

            set_timeout(self.cfg.parallel.step_timeout_s)
            self._step_timeout_set = True

    def report_failure(self, exc: BaseException, step: int, grace_s: float = 3.0) -> str:
        """After a failed or timed-out collective: say which ranks did not report the failure
        (dead or stuck), where every rank's heartbeat stands, and this rank's last collectives.
        Printed to stderr and returned. ``grace_s``: how long to give the other live ranks to
        report first (0 when torchrun is already tearing the group down)."""
        import sys
        import time

        lines = [f"threefold: rank {self.rank}: collective failed at step {step + 1}: "
                 f"{str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}"]
        try:
            store = self._store()
            store.set(self._key("failed", self.rank), str(step))
            time.sleep(grace_s)  # let the other live ranks reach their own failure
            silent = [r for r in range(self.world_size)
                      if not store.check([self._key("failed", r)])]
            beats = {}
            for r in range(self.world_size):
                k = self._key("step", r)
                beats[r] = int(store.get(k)) + 1 if store.check([k]) else 0
            if silent:
                lines.append("threefold: ranks that did not report (dead or stuck): "
                             + ", ".join(f"rank {r} (last reached step {beats[r]})"
                                         for r in silent))
            lines.append("threefold: steps reached: " + ", ".join(
                f"rank {r}: {b}" for r, b in beats.items()))
        except Exception as e:  # noqa: BLE001 - the store may be gone with its host
            lines.append(f"threefold: (rendezvous store unreachable: {e})")
        lines.append("threefold: last collectives on rank {}: {}".format(self.rank, "; ".join(
            f"{r['op']} on {r['axis']} {list(r['shape'])} step {None if r['step'] is None else r['step'] + 1}"
            for r in self.comm.recent()[-5:])))
        report = "\n".join(lines)
        print(report, file=sys.stderr, flush=True)
        return report

    def step_metrics(self) -> dict[str, Any]:
        """Bytes this rank sent per mesh axis during the step just finished."""
        counters = self.comm.step_counters()
        self._steps.append(counters)
        return {"comm_bytes": counters}

    def summary_metrics(self) -> dict[str, Any]:
        """Mean bytes sent per rank per step on each axis."""
        if not self._steps:
            return {"comm_bytes_per_step": {}}
        axes = sorted({a for s in self._steps for a in s})
        return {"comm_bytes_per_step": {a: sum(s.get(a, 0) for s in self._steps) / len(self._steps)
                                        for a in axes}}

    def describe(self) -> str:
        """One line for the log."""
        return f"{self.world_size} ranks ({self.dims.describe()}, zero {self.cfg.parallel.zero_stage})"

    def checkpoint_group(self):
        """Which node every rank is on (torchrun's GROUP_RANK; 0 without it) and the control
        channel's collectives, for checkpoints on nodes that may share no filesystem
        (``threefold.checkpoint.NodeGroup``). Collective the first time (an all-gather)."""
        if getattr(self, "_ckpt_group", None) is None:
            import os

            from threefold.checkpoint import NodeGroup

            node = int(os.environ.get("GROUP_RANK") or 0)
            c = self.control
            self._ckpt_group = NodeGroup(c.all_gather_object(node), c.barrier, c.gather_object,
                                         c.all_gather_object, c.broadcast_object)
        return self._ckpt_group

    def close(self) -> None:
        """Barrier and destroy the process group (avoids aborts at exit on CPU)."""
        from threefold.distributed import shutdown

        if self._owns_group:
            shutdown()
        else:
            self.control.barrier()
