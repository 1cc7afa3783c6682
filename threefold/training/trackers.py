"""The trackers people watch runs with, fed the same per-step record as metrics.jsonl:
TensorBoard event files (``metrics.tensorboard``) and Weights & Biases (``metrics.wandb``).
Both are optional extras, imported only on the writer rank of a run that asks for them;
``threefold.config`` checks they are installed before any process starts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def flat_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record's numbers by name, without ``step``: a per-axis dict such as
    ``comm_bytes`` becomes ``comm_bytes/dp``, ...; unknown values (an MFU of None) are left
    out rather than drawn as zero."""
    out: dict[str, float] = {}
    for key, value in record.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, x in items:
            if key != "step" and isinstance(x, (int, float)) and not isinstance(x, bool):
                out[key if sub is None else f"{key}/{sub}"] = float(x)
    return out


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """``Config.to_dict()`` as ``section.key`` -> a value TensorBoard's hparams accept (None
    as the string "None")."""
    return {f"{section}.{key}": value if isinstance(value, (bool, int, float, str)) else str(value)
            for section, fields in config.items() for key, value in fields.items()}


class TensorBoardTracker:
    """Event files in OUTPUT_DIR/tensorboard: each scalar under its metrics.jsonl name, the
    config as text (the JSON) and as hparams (``section.key``)."""

    def __init__(self, out: Path, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```")
        for summary in hparams(flat_config(config), {}):
            self.writer.file_writer.add_summary(summary)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Step ``step``'s scalars."""
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class WandbTracker:
    """A W&B run named after the output directory, in ``metrics.wandb_project``, with the
    config; its files go to WANDB_DIR, else OUTPUT_DIR (``WANDB_MODE=offline`` keeps it
    local, for ``wandb sync`` later)."""

    def __init__(self, out: Path, config: dict[str, Any], project: str):
        import wandb

        self.run = wandb.init(project=project, name=out.resolve().name, config=config,
                              dir=os.environ.get("WANDB_DIR") or str(out))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Step ``step``'s scalars."""
        self.run.log(scalars, step=step)

    def close(self) -> None:
        """Finish the run (an offline run's files are complete after this)."""
        self.run.finish()


def open_trackers(out: Path, config: dict[str, Any]) -> list:
    """The trackers ``config["metrics"]`` asks for, writing for the run in ``out``."""
    m = config["metrics"]
    return ([TensorBoardTracker(out, config)] if m["tensorboard"] else []) + (
        [WandbTracker(out, config, m["wandb_project"])] if m["wandb"] else [])
