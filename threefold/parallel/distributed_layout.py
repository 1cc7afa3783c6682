"""The layout of a run under torchrun: process group, mesh, communication layer, and which
engine (data parallel or ZeRO) trains the model."""

from __future__ import annotations

from typing import Any, Callable

import torch

from threefold.config import Config, ModelConfig


class Distributed:
    """Several processes on one DeviceMesh: pp × dp_replicate × dp_shard × tp."""

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
        c = self.dims.coords(self.rank)
        self.dp_size = self.dims.dp_replicate * self.dims.dp_shard
        self.dp_rank = c["dp_replicate"] * self.dims.dp_shard + c["dp_shard"]
        self.is_writer = self.rank == 0
        self.cfg = cfg
        self._steps: list[dict[str, int]] = []
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
        """Divisibility of the model by the layout, and what is not built yet."""
        from threefold.parallel.layout import check_batch

        self.dims.validate_model(mcfg, vpp=cfg.parallel.vpp)
        check_batch(cfg, self.dp_size)
        if self.dims.tp > 1 or self.dims.pp > 1:
            from threefold.config import ConfigError

            raise ConfigError("parallel.tp/parallel.pp: tensor and pipeline parallel are not "
                              "available in this build yet; use dp_replicate/dp_shard")

    def build_engine(self, model: torch.nn.Module, cfg: Config):
        """Data parallel for ZeRO stage 0, the ZeRO engine for stages 1-3."""
        from threefold.parallel.data import DataParallelEngine
        from threefold.parallel.engine import LocalEngine
        from threefold.parallel.zero import ZeroEngine

        p = cfg.parallel
        if p.zero_stage == 0:
            if self.dp_size == 1:
                return LocalEngine(model, cfg.optim)
            return DataParallelEngine(model, cfg.optim, self.comm, p.bucket_mb, axis="dp")
        units = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
        return ZeroEngine(model, units, cfg.optim, self.comm, p.zero_stage)

    def global_token_count(self, labels: torch.Tensor) -> int:
        """Target tokens over the whole global batch (a scalar all-reduce over dp)."""
        n = torch.tensor([int((labels != -100).sum())], dtype=torch.int64)
        self.control.all_reduce(n, "dp")
        return int(n)

    def sum_over_dp(self, value: torch.Tensor) -> float:
        """Sum a scalar over data-parallel ranks (for logging; not counted as training
        traffic)."""
        v = value.detach().double().reshape(1).cpu()
        self.control.all_reduce(v, "dp")
        return float(v)

    def before_step(self, step: int) -> None:
        """Open a new accounting window; after step 1 switch to the short collective timeout."""
        self.comm.set_step(step)
        self.comm.step_counters()  # discard traffic between steps (evaluation, checkpoints)
        if step > 0 and not self._step_timeout_set:
            from threefold.distributed import set_timeout

            set_timeout(self.cfg.parallel.step_timeout_s)
            self._step_timeout_set = True

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

    def close(self) -> None:
        """Barrier and destroy the process group (avoids aborts at exit on CPU)."""
        from threefold.distributed import shutdown

        if self._owns_group:
            shutdown()
        else:
            self.control.barrier()
