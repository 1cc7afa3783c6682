"""What the training loop works on: the ``Run`` (everything built and checked before the first
step), the ``Engine`` it drives (the interface every engine of ``threefold.parallel`` meets)
and the helpers that act on a run rather than orchestrate it (``autocast``, the seed's or the
pretrained weights as a source, a frozen reference engine).

This module sits below ``threefold.training.train`` (which builds a ``Run`` and loops over it) and
below everything that takes one: the step (``threefold.training.steps``), what a run reports
(``threefold.training.runlog``), its checkpoints (``threefold.training.resume``) and the tasks of
``post/``. None of them imports the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ContextManager, Protocol

import torch
from torch import nn

from threefold.config import Config, ModelConfig
from threefold.model.moe import RouterLog
from threefold.parallel.materialize import ChainSource, InitSource
from threefold.parallel.parallelize import parallelize

if TYPE_CHECKING:  # annotations only: the fields' types
    from threefold.data import DataBundle
    from threefold.parallel.world import World
    from threefold.training.task import Task
    from threefold.weights import WeightSource


class Engine(Protocol):
    """What the loop, the layouts and the checkpoints use of an engine (``LocalEngine``,
    ``DataParallelEngine``, ``ZeroEngine``: ``threefold.parallel``). What a traced step
    records of the engine's collectives goes through the communication layer
    (``World.traced``), not through the engine."""

    model: nn.Module
    named_params: list[tuple[str, nn.Parameter]]  # what it trains, under logical names

    def begin_step(self) -> None:
        """Before a step's first forward: the engine's per-step counts restart."""

    def step_metrics(self) -> dict:
        """The step's figures of the engine's own traffic (expert parallelism's rows)."""

    def micro_step(self, last: bool) -> ContextManager[None]:
        """Context for one micro-batch's backward; ``last`` marks the accumulation boundary."""

    def finish_gradients(self) -> None:
        """Wait for the gradients' outstanding communication."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (a 0-dim device tensor), clipped to ``max_norm``."""

    def step(self, lr: float) -> None:
        """One optimiser step at learning rate ``lr``."""

    def release_roots(self) -> None:
        """After a forward-only pass: release what was gathered for it."""

    def gradient_of(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor holding ``p``'s synchronised gradient on this rank."""

    def state_dict(self) -> dict:
        """Logical (whole, HF-named) tensors of the model and the optimiser."""

    def local_pieces(self) -> list:
        """What this rank holds, as checkpoint pieces."""

    def optim_step(self) -> int:
        """Optimiser steps taken so far."""

    def load_from(self, source, optim_step: int = 0) -> None:
        """Take this rank's part of every tensor in ``source`` (and AdamW's moments)."""


class Sampler(Protocol):
    """A task's batches (``threefold.training.task``): this rank's slice of each step's global batch,
    a pure function of (seed, step), with its state for checkpoints."""

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
        """This rank's sequences of the global batch of ``step``."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the sampler."""

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's ``state_dict``."""


@dataclass
class Run:
    """Everything the loop needs, built and checked before the output directory is touched
    (``threefold.training.train.build_run``)."""

    cfg: Config
    model_cfg: ModelConfig
    data: DataBundle
    sampler: Sampler
    val_sampler: Sampler
    device: torch.device
    dtype: torch.dtype
    engine: Engine
    world: World
    out: Path
    task: Task | None = None  # build_run always gives one (pre-training's by default)
    pretrained: WeightSource | None = None  # checkpoint.init_from's weights, opened once
    # bytes held before the model, and the peaks of start-up, loading and the steps
    memory: dict[str, int] = dataclasses.field(default_factory=dict)
    # files the task adds to the output directory (name -> text), written with config.json
    # when the run opens its outputs, so that a run that has no step to do writes none
    outputs: dict[str, str] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def router_log(self) -> RouterLog:
        """What routing adds to the steps (``threefold.model.moe.RouterLog``: a mixture of experts'
        router losses and their log, the grouped routers' bias update; the
        multi-token-prediction loss where the task's objective is the next tokens'; nothing
        for a dense model), made once for this rank's model."""
        # under context parallelism a rank routes a share of each sequence's tokens: the
        # router losses pool the statistics over cp (``World.sequence_sum``)
        pool = self.world.sequence_sum if self.world.cp_size > 1 else None
        return RouterLog(self.model_cfg, self.engine.model, next_token=self.task.next_token,
                         pool=pool)

    def forward(self, micro: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model on a micro-batch dict (positions and document ids when it has them)."""
        with autocast(self):
            return self.engine.model(micro["input_ids"], position_ids=micro.get("position_ids"),
                                     document_ids=micro.get("document_ids"))

    def token_losses(self, micro: dict[str, torch.Tensor], labels: torch.Tensor | None = None,
                     temperature: float = 1.0) -> torch.Tensor:
        """Each token's fp32 loss (B, T), 0 where the label is -100, from the model's chunked
        head loss (vocab-parallel under tensor parallelism; the logits are never whole).
        ``labels`` default to the micro-batch's."""
        with autocast(self):
            return self.engine.model(
                micro["input_ids"], position_ids=micro.get("position_ids"),
                document_ids=micro.get("document_ids"),
                labels=micro["labels"] if labels is None else labels, temperature=temperature)


def autocast(run: Run):
    """The run's autocast context for a forward (none in float32)."""
    if run.dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(run.device.type, dtype=run.dtype)


def weights_source(cfg: Config, mcfg: ModelConfig, device: torch.device, pretrained,
                   new_weights: tuple[str, ...] = ()):
    """Where a run's weights start from: ``checkpoint.init_from``'s (``pretrained``, a
    ``threefold.weights`` source) with a task's new weights (a reward model's score head)
    drawn from the seed, or every weight drawn from the seed."""
    init = InitSource(mcfg, cfg.train.seed, device)
    return ChainSource(pretrained, init, new_weights) if pretrained is not None else init


def reference_engine(run: Run):
    """The run's causal LM as it starts (``checkpoint.init_from``'s weights, else the seed's),
    frozen, in an engine of its own laid out like the run's (``parallelize(frozen=True)``:
    under ZeRO-3 each rank keeps its shards and gathers one unit at a time; no optimiser
    buffers anywhere): a reference model (GRPO's). Keep the engine: its hooks hold it weakly.
    The pretrained weights are read again from the source the run opened (``run.pretrained``),
    not opened a second time."""
    cfg = run.cfg
    engine = parallelize(run.model_cfg, cfg, run.world,
                         weights_source(cfg, run.model_cfg, run.device, run.pretrained),
                         run.device, frozen=True)
    engine.model.eval().requires_grad_(False)
    return engine
