"""What a run optimises: where its batches come from and what its loss is.

The loop (threefold.training.train) is the same for pre-training, SFT and DPO; a ``Task`` supplies

- ``samplers(cfg, data)``: (train, validation) samplers whose ``local_batch(step, dp_rank,
  dp_size)`` returns this rank's slice of the global batch of ``step`` as a dict of tensors
  (first dimension = sequences), a pure function of (seed, step), with ``state_dict`` /
  ``load_state_dict`` for checkpoints;
- ``count(batch)``: the units the loss is normalised by in this rank's slice (target tokens
  for language modelling, pairs for DPO); the loop sums it over data-parallel ranks, so every
  unit weighs the same whatever the accumulation and data-parallel degree;
- ``loss(run, micro)``: the *summed* loss of a micro-batch and extra summed metrics
  ({name: tensor}), logged as sums over the global batch divided by the global count.

``Task`` declares these and the optional hooks (with their defaults); every task derives
from it.
"""

from __future__ import annotations

from typing import Any

import torch

from threefold.data import HeldOutSampler, MixtureSampler


class Task:
    """What the loop asks of a task, each with the default most tasks want (see the module
    doc for ``samplers``, ``count`` and ``loss``, which every task defines)."""

    name = "task"
    # extra summed metrics ``loss`` returns, logged as sums over the global batch / count
    metric_names: tuple[str, ...] = ()
    # weights the task adds to the causal LM, drawn from the seed even when the rest of the
    # model comes from ``checkpoint.init_from`` (a reward model's score head)
    new_weights: tuple[str, ...] = ()
    # positions of a training row, when not data.seq_len (what tokens/s and MFU count)
    row_length: int | None = None
    # a loss on a pipeline's last stage from its output and the micro-batch, when the task's
    # ``loss`` cannot run as is there: ``pipeline_loss(run, token_losses, micro) -> (sum,
    # metrics)``, from the last stage's per-token losses (B, T)
    pipeline_loss = None
    # whether it samples the tokenized corpus (``data.sources``): tasks that train on their own
    # records load the tokenizer alone, and hold no token stream (nor tokenize one on a
    # machine's first run, which left its freed text resident)
    token_stream = False
    # whether the objective is the next tokens', to which a model's multi-token-prediction
    # modules add theirs (pre-training, SFT); other tasks leave their loss out
    next_token = False

    def adapt_model(self, model):
        """The plain (meta) causal LM as this task trains it (unchanged here)."""
        return model

    def setup(self, run) -> None:
        """Called once the run (model, engine) exists; nothing to do here."""

    def close(self) -> None:
        """Called once the run's last step, save and summary are done, before its process
        group goes, or when the run fails (what ``setup`` started stops here; a second call
        does nothing); nothing to do here."""

    def pipeline_micro(self, micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A micro-batch as the pipeline executor takes it (as it is here)."""
        return micro

    def step_metrics(self) -> dict[str, float]:
        """Figures of the step as a whole, after it (none here)."""
        return {}

    def data_metrics(self, run, step: int) -> dict:
        """What the data has given after step ``step`` (nothing to say here)."""
        return {}

    def val_sets(self, run) -> list[tuple[str, float, Any]]:
        """(name, weight, sampler) of each validation set; the validation loss is their
        weighted sum (here the one set of ``samplers``)."""
        return [("", 1.0, run.val_sampler)]

    def samplers(self, cfg, data) -> tuple[Any, Any]:
        """(train, validation) samplers."""
        raise NotImplementedError

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """The units this rank's slice of the batch normalises the loss by."""
        raise NotImplementedError

    def loss(self, run, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The summed loss of a micro-batch and extra summed metrics."""
        raise NotImplementedError


class PretrainTask(Task):
    """Next-token prediction on windows of the token stream."""

    name = "pretrain"
    token_stream = True
    next_token = True

    def samplers(self, cfg, data) -> tuple[Any, Any]:
        """Windows of the sources' training tokens, in epochs and in proportion; the fixed
        held-out windows of every source (a list, one sampler each)."""
        t, d = cfg.train, cfg.data
        train = MixtureSampler(data.sources, d.seq_len, t.global_batch_size, t.seed,
                               d.document_mask)
        held_out = [HeldOutSampler(s, d.seq_len, t.global_batch_size, t.eval_batches,
                                   d.document_mask) for s in data.sources]
        return train, held_out

    def data_metrics(self, run, step: int) -> dict:
        """Tokens each source has given, and its epoch."""
        return run.sampler.progress(step)

    def val_sets(self, run) -> list[tuple[str, float, Any]]:
        """Each source's held-out tokens, weighted as the mixture."""
        total = sum(s.weight for s in run.data.sources)
        return [(s.name, float(s.weight / total), v)
                for s, v in zip(run.data.sources, run.val_sampler)]

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Target tokens (labels of -100 are not targets)."""
        return int((batch["labels"] != -100).sum())

    def loss(self, run, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Summed token cross-entropy (vocab-parallel under tensor parallelism)."""
        return run.token_losses(micro).sum(), {}
