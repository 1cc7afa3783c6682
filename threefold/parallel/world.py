"""A run's layout: which rank this is, how the batch is split, and which engine trains.

``SingleProcess`` is the reference layout. ``Distributed`` (built from torchrun's environment)
wraps the mesh and the communication layer; the training loop talks to both the same way.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

import torch

from threefold.comm import faults
from threefold.config import Config, ModelConfig
from threefold.parallel.materialize import buffer_pieces
from threefold.layout import validate_layout


class World:
    """What the training loop asks of the processes a run spans: which rank this is, how the
    batch is split, what the model is cut into, and the logging channel's sums. The
    defaults are one process's; ``Distributed`` (threefold.parallel.distributed_world)
    overrides them for a process group."""

    rank = local_rank = dp_rank = 0
    world_size = dp_size = 1
    tp_size = cp_size = ep_size = 1  # model-parallel degrees: tensor, context, expert
    comm = None  # the counted communication layer (threefold.comm.counted.Comm) of a process group
    shard_axis = "dp_shard"  # the axis ZeRO shards over
    device = None  # this rank's device, when the layout chooses it
    is_writer = True
    restarts = 0
    chunks = None     # this rank's pipeline chunks (pp > 1)
    pipeline = None   # their executor, once built
    data_axis = "dp"
    control = None  # the logging channel (a Comm) of a process group

    def gather_object(self, obj: Any) -> list | None:
        """Collective: every rank's ``obj`` on the writer (a list in rank order); None on
        the others. Here: [obj]."""
        return [obj]

    def sum_logged(self, v: torch.Tensor, over_stages: bool = False) -> torch.Tensor:
        """A small tensor summed in place over the data-parallel ranks (and the pipeline
        stages with ``over_stages``) on the logging channel, not counted as training traffic;
        unchanged in one process."""
        return v

    def reduce_over_dp(self, v: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``v`` reduced in place (``op``: sum, min or max) over the data-parallel ranks on
        the logging channel; unchanged in one process."""
        return v

    def pipeline_groups(self) -> list[list[int]]:
        """The ranks of each pipeline (none without pipeline parallelism)."""
        return []

    @contextlib.contextmanager
    def traced(self, records: list | None) -> Iterator[None]:
        """Inside, the collectives that time themselves (``threefold.comm.counted.Comm.trace``: data
        parallel's buckets, overlapped tensor parallelism's chunks) append their records to
        ``records``, a traced step's list (None: an untraced step; one process has no
        collectives to trace)."""
        if self.comm is None:
            yield
            return
        before, self.comm.trace = self.comm.trace, records
        try:
            yield
        finally:
            self.comm.trace = before

    def forward_backward(self, micro: list[dict], n: int, plain: Callable,
                         trace: list | None) -> tuple[torch.Tensor | float, dict]:
        """Forward and backward of this rank's micro-batches of one step, each loss divided by
        the step's ``n`` units: (summed loss, the task's summed metrics {name: tensor}). Here
        ``plain(micro)``, the step's own micro-steps; a pipeline runs its schedule instead
        (``threefold.parallel.distributed_world``)."""
        return plain(micro)

    def forward_only(self, micro: list[dict], plain: Callable) -> torch.Tensor | float:
        """The summed loss of this rank's micro-batches without a graph (evaluation): here
        ``plain(micro)``; a pipeline runs its forward-only schedule instead."""
        return plain(micro)


    def first_rank_first(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (e.g. data preparation that fills a shared cache) on rank 0 first."""
        return fn()

    def check(self, cfg: Config, mcfg: ModelConfig) -> None:
        """The rule book against the model, for one process (selective recompute and LoRA
        meet a mixture of experts here too)."""
        validate_layout(cfg, 1, mcfg)

    def split_pipeline(self, model: torch.nn.Module) -> torch.nn.Module:
        """This rank's pipeline stages (the whole model: one process has no pipeline)."""
        return model

    def split_sequence(self, micro: dict) -> dict:
        """This rank's tokens of a micro-batch (all of them: no context parallelism)."""
        return micro

    def sequence_sum(self, partial: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(per-sequence sums of ``partial``, this rank's tokens' share of them, over the
        context-parallel ranks; the share of a whole-sequence loss this rank returns): a
        task whose loss needs whole sequences (DPO's log-probs, a reward model's score)
        computes it alike on every cp rank and returns that share of it. Here: (``partial``,
        1.0)."""
        return partial, 1.0

    def checkpoint_pieces(self, engine) -> list:
        """The pieces this rank writes (everything, for one process: its persistent buffers
        too)."""
        return engine.local_pieces() + buffer_pieces(engine.model)

    def barrier(self) -> None:
        """Wait for every rank (nothing to wait for here)."""

    def reduce_tied_gradients(self, engine) -> None:
        """Sum tied weights' gradients across pipeline stages (none in one process)."""

    def global_token_count(self, local_count: int) -> int:
        """Sum a per-rank count (target tokens, pairs) over data-parallel ranks."""
        return int(local_count)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (here: this one)."""
        return bool(flag)

    def sum_over_dp(self, value: torch.Tensor) -> float:
        """Sum a per-rank scalar over data-parallel ranks."""
        return float(value)

    def before_step(self, step: int) -> None:
        """Hook at the start of each step."""

    def join(self, run, start: int) -> int:
        """After the run's own resume at ``start``: the step the loop starts at (replica groups
        may heal from a live group's memory to a later one, ``threefold.parallel.ft_replicas``)."""
        return start

    def run_step(self, step: int, fn: Callable[[], Any]) -> Any:
        """Run one training step, ``fn()`` (replica groups run it again when it does not
        commit)."""
        return fn()

    def phase(self, name: str, grace_s: Callable[[], float] = lambda: 0.0) -> ContextManager:
        """Tag the collectives issued inside with ``name`` and report a failed one (nothing
        to tag or report in one process)."""
        return contextlib.nullcontext()

    def check_collectives(self, where: str) -> None:
        """Compare every rank's collectives since the last check (one process: nothing)."""

    def report_failure(self, exc: BaseException, step: int, grace_s: float = 0.0) -> str:
        """Nothing to diagnose across ranks in one process."""
        return ""

    def step_metrics(self, count: bool = True) -> dict[str, Any]:
        """Extra per-step metrics (communication bytes under parallel layouts); with
        ``count`` False the traffic since the last call is dropped (not a step's)."""
        return {}

    def summary_metrics(self) -> dict[str, Any]:
        """Extra summary fields."""
        return {}

    def topology_lines(self) -> list[str]:
        """Log lines on the nodes the ranks run on (none for one process)."""
        return []

    def describe(self) -> str:
        """One line for the log."""
        return "single process"

    def close(self) -> None:
        """Release process groups."""


class SingleProcess(World):
    """One process, no process group: every default of ``World``, but the test's faults
    (``threefold.comm.faults``) fire for it as for rank 0 of a group."""

    def before_step(self, step: int) -> None:
        """Fire the faults named for rank 0 before ``step``."""
        faults.at_step(self.rank, step)
