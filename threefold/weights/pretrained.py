"""Pretrained weights wherever they lie (``checkpoint.init_from``, ``threefold convert --to
hf``, generation): a Hugging Face folder, a threefold checkpoint, or a run directory (its newest
checkpoint, under ``checkpoints/`` or the ``checkpoint.dir`` its config.json names).
"""

from __future__ import annotations

import json
from pathlib import Path

from threefold.weights.checkpoint_verify import list_checkpoints, read_json, resolve_root
from threefold.config import ModelConfig
from threefold.weights.hf_config import HFError, model_config_from_hf, model_config_from_state
from threefold.weights.base import WeightSource
from threefold.weights.checkpoint_source import CheckpointSource
from threefold.weights.hf_source import HFSource, without_absent_mtp


def run_checkpoint_root(path: Path) -> Path:
    """Where the run directory ``path`` keeps its checkpoints: ``checkpoints/``, or node 0's
    ``checkpoint.dir`` (the one with the index) when its config.json sets one."""
    path = Path(path)
    try:
        saved = json.loads((path / "config.json").read_text())
        spec = saved["checkpoint"]["dir"] if isinstance(saved, dict) and "train" in saved else ""
    except (OSError, ValueError, KeyError, TypeError):
        spec = ""
    return resolve_root(spec, path, 0)


def find_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint directory, else the newest checkpoint of the run
    directory ``path``; HFError if neither."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    root = run_checkpoint_root(path)
    steps = list_checkpoints(root)
    if steps:
        return root / str(steps[-1])
    raise HFError(f"{path}: neither a checkpoint (no manifest.json) nor a run directory with "
                  f"checkpoints ({root}/<step>/)")


def is_hf_folder(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face folder: it has config.json and is not a threefold
    run directory (which has one too, beside its checkpoints)."""
    return (path / "config.json").is_file() and not run_checkpoint_root(path).is_dir()


def pretrained_config(path: Path | str) -> ModelConfig:
    """The ModelConfig of pretrained weights from their configuration alone: a Hugging Face
    folder's config.json, or a threefold checkpoint's state.json (a run directory: its newest
    checkpoint's). No tensor is read (of a Hugging Face folder whose config names
    multi-token-prediction modules, the index or header says whether it holds them):
    what planning and the dry run use."""
    path = Path(path)
    if is_hf_folder(path):
        conf = path / "config.json"
        return without_absent_mtp(model_config_from_hf(
            read_json(conf, HFError, "not a Hugging Face folder", "not valid JSON"),
            str(conf)), path)
    ckpt = find_checkpoint(path)
    state = read_json(ckpt / "state.json", HFError, "not a threefold checkpoint", "not valid JSON")
    return model_config_from_state(state, ckpt)


def open_pretrained(path: Path | str) -> tuple[ModelConfig, WeightSource]:
    """(ModelConfig, WeightSource) of pretrained weights: a Hugging Face folder (it has
    config.json and is not a run directory), or a threefold checkpoint or run directory (its
    newest checkpoint, config from its state). Nothing but headers is read until asked."""
    path = Path(path)
    if is_hf_folder(path):
        source = HFSource(path)
        return source.config, source
    ckpt = find_checkpoint(path)
    source = CheckpointSource(ckpt)
    return model_config_from_state(source.state, ckpt), source
