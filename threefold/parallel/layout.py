"""A run's layout: which rank this is, how the batch is split, and which engine trains.

``SingleProcess`` is the reference layout. ``Distributed`` (built from torchrun's environment)
wraps the mesh and the communication layer; the training loop talks to both the same way.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from threefold.config import Config, ModelConfig


class SingleProcess:
    """One process, no process group."""

    rank = local_rank = dp_rank = 0
    world_size = dp_size = 1
    is_writer = True

    def first_rank_first(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (e.g. data preparation that fills a shared cache) on rank 0 first."""
        return fn()

    def check(self, cfg: Config, mcfg: ModelConfig) -> None:
        """Layout rules against the model (nothing to check for one process)."""

    def parallelize(self, model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
        """Apply the layout's model parallelism (none for one process)."""
        return model

    def gather_state(self, sd: dict, engine) -> dict:
        """Whole logical tensors from an engine's state (already whole here)."""
        return sd

    def shard_state(self, sd: dict, engine) -> dict:
        """This rank's part of whole logical tensors (all of it here)."""
        return sd

    def checkpoint_pieces(self, engine) -> list:
        """The pieces this rank writes (everything, for one process)."""
        return engine.local_pieces()

    def barrier(self) -> None:
        """Wait for every rank (nothing to wait for here)."""

    def reduce_tied_gradients(self, engine) -> None:
        """Sum tied weights' gradients across pipeline stages (none in one process)."""

    def global_token_count(self, local_count: int) -> int:
        """Sum a per-rank count (target tokens, pairs) over data-parallel ranks."""
        return int(local_count)

    def sum_over_dp(self, value: torch.Tensor) -> float:
        """Sum a per-rank scalar over data-parallel ranks."""
        return float(value)

    def before_step(self, step: int) -> None:
        """Hook at the start of each step."""

    restarts = 0

    def report_failure(self, exc: BaseException, step: int) -> str:
        """Nothing to diagnose across ranks in one process."""
        return ""

    def step_metrics(self) -> dict[str, Any]:
        """Extra per-step metrics (communication bytes under parallel layouts)."""
        return {}

    def summary_metrics(self) -> dict[str, Any]:
        """Extra summary fields."""
        return {}

    def describe(self) -> str:
        """One line for the log."""
        return "single process"

    def close(self) -> None:
        """Release process groups."""


def check_batch(cfg: Config, dp: int) -> None:
    """The global batch must split evenly over data-parallel ranks, and each rank's share
    into micro-batches (a micro-batch larger than a rank's share is that share)."""
    from threefold.config import ConfigError

    g, mb = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if g % dp:
        raise ConfigError(f"train.global_batch_size: {g} does not split over {dp} data-parallel "
                          f"ranks; use a multiple of {dp}")
    local = g // dp
    if local % min(mb, local):
        raise ConfigError(f"train.micro_batch_size: {mb} does not divide the {local} sequences "
                          f"each rank gets; use a divisor of {local}")


def build_engine(model: torch.nn.Module, cfg: Config, layout) -> Any:
    """The engine for ``layout``: plain AdamW for one process, data parallel or ZeRO else."""
    from threefold.parallel.engine import LocalEngine

    if isinstance(layout, SingleProcess):
        return LocalEngine(model, cfg.optim)
    return layout.build_engine(model, cfg)
