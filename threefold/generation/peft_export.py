"""A LoRA run out of threefold: its adapters for PEFT, or merged into a Hugging Face folder.

A LoRA run (``lora.r > 0``) checkpoints only its adapters (``threefold.model.lora``: for each
adapted layer ``<layer>.lora_A.weight`` (r × in) and ``<layer>.lora_B.weight`` (out × r); the
layer computes y = x·Wᵀ + (alpha/r)·(x·Aᵀ)·Bᵀ). The frozen base W is wherever the run took it
from: ``checkpoint.init_from`` (a Hugging Face folder or a threefold run/checkpoint, read by
``threefold.weights.open_pretrained``), or, when that is empty, the seed's initial values
(``threefold.parallel.materialize.InitSource``: each tensor drawn by its name, on the CPU).
The model config and the LoRA settings are those the checkpoint's state.json records.

- ``open_lora(path)``: a ``LoRARun`` (model config, LoRA settings, the base as a source read
  tensor by tensor, the newest checkpoint's adapters, checked against the model's layers).
- ``export_peft(run, out)``: ``adapter_config.json`` and ``adapter_model.safetensors`` under
  PEFT's names (``base_model.model.<name>``, no adapter name), which
  ``peft.PeftModel.from_pretrained(base_model, out)`` loads onto the base. A base whose layers
  are fused (Phi-3's ``qkv_proj``, ``gate_up_proj``) gets the fused layers' exact adapters
  (``peft_adapters``: A stacked, B block-diagonal; rank and alpha per layer in
  ``rank_pattern``/``alpha_pattern``).
- ``export_merged(run, out)``: a Hugging Face folder (``threefold.weights.hf.write_hf_folder``: the
  files ``export_hf`` writes) whose adapted weights are W + (alpha/r)·B·A, the rest the base;
  written a file at a time, each merged tensor made as it is written.
- ``load_lora_model(path)``: the run's model with its adapters (``apply_lora``), base and
  adapters loaded: what ``threefold generate --from RUN`` runs.

Both exports write atomically (a temporary sibling, fsync, rename) and refuse a non-empty
``out``; a run with ``lora.r`` 0 is refused (``threefold convert --to hf`` exports it).
A base drawn from the seed is drawn by the CPU's generators: a LoRA run without
``checkpoint.init_from`` that trained on a GPU drew its base with CUDA's, which differ.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from threefold.config import ConfigError, LoRAConfig, ModelConfig
from threefold.config.validation import lora_targets
from threefold.weights.hf import (MAX_SHARD_BYTES, atomic_folder, check_new_folder, hub_tensors,
                          run_tokenizer, write_hf_folder)
from threefold.weights.hf_config import SHAPE_FIELDS, HFError, model_config_from_state
from threefold.weights.hub import locate
from threefold.model.lora import apply_lora, is_adapter
from threefold.model.decoder import CausalLM
from threefold.families import fused_files, spec_of
from threefold.parallel.materialize import InitSource
from threefold.weights import CheckpointSource, MissingTensor, WeightSource, find_checkpoint
from threefold.weights import open_pretrained
from threefold.weights.pretrained import run_checkpoint_root

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX", "LoRARun", "export_merged",
           "export_peft", "load_lora_model", "lora_checkpoint", "open_lora", "peft_adapters",
           "peft_config"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's name of the wrapped model's parameters


def _lora_settings(state: dict) -> LoRAConfig:
    """The ``lora`` section of the run config a checkpoint's state.json records (fields this
    version does not know are dropped; none at all is ``lora.r`` 0)."""
    saved = (state.get("config") or {}).get("lora") or {}
    known = {f.name for f in dataclasses.fields(LoRAConfig)}
    return LoRAConfig(**{k: v for k, v in saved.items() if k in known})


def _is_hf_folder(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face folder (config.json, no checkpoints), as
    ``open_pretrained`` decides."""
    return (path / "config.json").is_file() and not run_checkpoint_root(path).is_dir()


def lora_checkpoint(path: Path | str) -> Path | None:
    """The newest checkpoint of ``path`` (a run directory or a checkpoint) when it is a LoRA
    run's; None for anything else (a Hugging Face folder, a run with ``lora.r`` 0, a path
    with no checkpoint). Reads state.json alone; nothing is verified."""
    path = Path(path)
    if _is_hf_folder(path):
        return None
    try:
        ckpt = find_checkpoint(path)
        state = json.loads((ckpt / "state.json").read_text())
    except (HFError, OSError, ValueError):
        return None
    return ckpt if isinstance(state, dict) and _lora_settings(state).r > 0 else None


@dataclass
class LoRARun:
    """A LoRA run's newest checkpoint, opened (``open_lora``).

    ``base_shapes``: every base tensor the model needs (a tied head appears once, as the
    embedding), by name, in the model's order; ``base``: where they are read from (a
    ``threefold.weights`` source or the seed's ``InitSource``; None when not opened);
    ``adapters``: the checkpoint's adapter tensors, fp32."""

    path: Path
    ckpt: Path
    model_cfg: ModelConfig
    lora: LoRAConfig
    init_from: str
    base_shapes: dict[str, tuple[int, ...]]
    adapters: dict[str, torch.Tensor]
    seed: int = 0  # train.seed: the base's values when there is no checkpoint.init_from
    base: Any = None
    init_from_commit: str = ""  # the hub snapshot a hub id in init_from resolved to

    @property
    def scale(self) -> float:
        """alpha / r: the factor of the adapter's output."""
        return self.lora.alpha / self.lora.r

    def read_base(self, name: str) -> torch.Tensor:
        """The whole base tensor ``name`` in fp32; HFError if the base lacks it."""
        try:
            return self.base.read(name, (), shape=self.base_shapes[name])
        except MissingTensor:
            raise HFError(f"{self.path}: its base (checkpoint.init_from "
                          f"'{self.init_from}') lacks {name}") from None

    def merged(self, name: str) -> torch.Tensor:
        """Base tensor ``name`` with its adapter merged in: W + (alpha/r)·B·A (fp32)."""
        w = self.read_base(name)
        stem = name.removesuffix("weight")
        a, b = self.adapters.get(stem + "lora_A.weight"), self.adapters.get(stem + "lora_B.weight")
        return w if a is None else w + self.scale * (b @ a)


def _base_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the plain model of ``cfg`` (built on the meta device: no
    memory), shared ones once."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _check_adapters(adapters: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
                    lora: LoRAConfig, where: Path) -> None:
    """HFError unless ``adapters`` are exactly the A and B of every layer ``lora`` targets,
    each of its shape (A r × in, B out × r)."""
    targets = set(lora_targets(lora))
    want = {}
    for name, shape in shapes.items():
        stem = name.removesuffix("weight")
        if len(shape) == 2 and stem.rstrip(".").rsplit(".", 1)[-1] in targets:
            want[stem + "lora_A.weight"] = (lora.r, shape[1])
            want[stem + "lora_B.weight"] = (shape[0], lora.r)
    other = sorted(n for n in adapters if not is_adapter(n))
    if other:
        raise HFError(f"{where}: holds {other[0]} beside the adapters (a task's new weights); "
                      "only a causal LM's adapters can be exported")
    for name in sorted(set(want) | set(adapters)):
        got = tuple(adapters[name].shape) if name in adapters else None
        if got != want.get(name):
            raise HFError(f"{where}: adapter {name} has shape {got}, lora.r={lora.r} and "
                          f"lora.target_modules={lora.target_modules!r} need {want.get(name)}")


def _open_base(run: LoRARun) -> Any:
    """The source of ``run``'s base: ``checkpoint.init_from``'s weights (their config must
    agree with the run's in every shape field), else the seed's initial values."""
    if not run.init_from:
        return InitSource(run.model_cfg, run.seed)
    try:  # a path, or a hub id read from the snapshot the run trained from
        src = locate(run.init_from, f"{run.path}: its base, checkpoint.init_from",
                     commit=run.init_from_commit).path
    except ConfigError as e:
        raise HFError(f"{e} (a relative path is taken from the current directory)") from None
    if lora_checkpoint(src) is not None:
        raise HFError(f"{run.path}: its base, checkpoint.init_from '{src}', is itself a LoRA "
                      "run (adapters only); export that with --to peft --merge and start from it")
    cfg, source = open_pretrained(src)
    for name in SHAPE_FIELDS:
        if getattr(cfg, name) != getattr(run.model_cfg, name):
            raise HFError(f"{run.path}: model.{name}={getattr(run.model_cfg, name)!r} but its "
                          f"base '{src}' has {getattr(cfg, name)!r}")
    return source


def open_lora(path: Path | str, base: bool = True) -> LoRARun:
    """Open the LoRA run directory or checkpoint ``path`` (its newest checkpoint, verified):
    model config, LoRA settings and adapters from the checkpoint, checked against the
    model's layers; with ``base`` its base weights' source too (headers only: tensors are
    read when asked). HFError, naming ``lora.r``, if it is not a LoRA run."""
    path = Path(path)
    if _is_hf_folder(path):
        raise HFError(f"{path}: a Hugging Face folder, not a LoRA run (lora.r > 0)")
    ckpt = find_checkpoint(path)
    source = CheckpointSource(ckpt)
    state = source.state
    lora = _lora_settings(state)
    if lora.r <= 0:
        raise HFError(f"{path}: not a LoRA run (lora.r = {lora.r}): its checkpoints hold the "
                      "whole model; export it with --to hf")
    cfg = model_config_from_state(state, ckpt)
    shapes = _base_shapes(cfg)
    adapters = source.tensors()
    _check_adapters(adapters, shapes, lora, ckpt)
    saved = state.get("config") or {}
    start = saved.get("checkpoint") or {}
    run = LoRARun(path, ckpt, cfg, lora, start.get("init_from") or "", shapes, adapters,
                  seed=int((saved.get("train") or {}).get("seed", 0)),
                  init_from_commit=start.get("init_from_commit") or "")
    if base:
        run.base = _open_base(run)
    return run


def _fused_targets(run: LoRARun) -> tuple[list[str], dict[str, int], dict[str, float]]:
    """(PEFT's target modules, rank_pattern, alpha_pattern) of ``run`` on its base's own
    layers: where the base family's files fuse layers (Phi-3's ``qkv_proj``, ``gate_up_proj``:
    the family spec's ``fused``), the fused layer is the target in place of the
    threefold layers it holds, with rank n·r and alpha n·alpha for the n of them adapted
    (so its scale stays alpha / r)."""
    targets = set(lora_targets(run.lora))
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for fused, parts in spec_of(run.model_cfg).fused.items():
        mine = {p.rsplit(".", 1)[-1] for p in parts} & targets
        if not mine:
            continue
        name = fused.rsplit(".", 1)[-1]
        targets = (targets - mine) | {name}
        if len(mine) > 1:  # (one adapted part: the fused layer's rank is r, as everywhere)
            ranks[name], alphas[name] = len(mine) * run.lora.r, len(mine) * run.lora.alpha
    return sorted(targets), ranks, alphas


def peft_config(run: LoRARun) -> dict:
    """The adapter_config.json of ``run`` as peft's ``LoraConfig`` reads it: plain LoRA
    (no rsLoRA, DoRA or bias) on the named layers, scaled by lora_alpha / r (fused layers,
    Phi-3's: their own rank and alpha in rank_pattern / alpha_pattern, ``_fused_targets``)."""
    base = str(Path(run.init_from).resolve()) if run.init_from and \
        Path(run.init_from).exists() else (run.init_from or None)
    targets, ranks, alphas = _fused_targets(run)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "revision": run.init_from_commit or None, "inference_mode": True, "r": run.lora.r,
            "lora_alpha": run.lora.alpha, "lora_dropout": run.lora.dropout,
            "target_modules": targets, "exclude_modules": None,
            "bias": "none", "lora_bias": False, "fan_in_fan_out": False,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": ranks, "alpha_pattern": alphas}


def peft_adapters(run: LoRARun) -> dict[str, torch.Tensor]:
    """``run``'s adapters on its base's own layers. Where the base's files fuse layers
    (Phi-3: q, k, v in ``qkv_proj``; gate, up in ``gate_up_proj``), the fused layer's adapter
    is exactly the sum of its parts': A = its adapted parts' A stacked (n·r × in), B = their
    B on the block diagonal (each part's output rows × its r columns; a part not adapted
    keeps zero rows), so B·A holds each part's B·A at its rows."""
    adapters, r = dict(run.adapters), run.lora.r
    for file, parts in fused_files(run.model_cfg).items():
        stems = [p.removesuffix("weight") for p in parts]
        a = [adapters.pop(s + "lora_A.weight", None) for s in stems]
        b = [adapters.pop(s + "lora_B.weight", None) for s in stems]
        taken = [i for i, t in enumerate(a) if t is not None]
        if not taken:
            continue
        rows = [run.base_shapes[p][0] for p in parts]
        fused_b = torch.zeros(sum(rows), len(taken) * r, dtype=b[taken[0]].dtype)
        for j, i in enumerate(taken):
            top = sum(rows[:i])
            fused_b[top:top + rows[i], j * r:(j + 1) * r] = b[i]
        stem = file.removesuffix("weight")
        adapters[stem + "lora_A.weight"] = torch.cat([a[i] for i in taken])
        adapters[stem + "lora_B.weight"] = fused_b
    return adapters


def export_peft(run_or_ckpt: Path | str, out: Path | str) -> None:
    """Write the adapters of LoRA run (or checkpoint) ``run_or_ckpt`` as a PEFT adapter folder
    ``out``: adapter_config.json (``peft_config``) and adapter_model.safetensors (fp32, under
    PEFT's names ``base_model.model.<name>``). ``out`` must be absent or empty; it appears
    complete or not at all. The base is not read (it need not be present)."""
    out = Path(out)
    check_new_folder(out)
    run = open_lora(run_or_ckpt, base=False)
    tensors = {PEFT_PREFIX + n: t.contiguous() for n, t in peft_adapters(run).items()}
    conf = peft_config(run)
    with atomic_folder(out) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(conf, indent=2))


class _MergedSource(WeightSource):
    """A LoRA run's base tensors with the adapters merged in, read whole and cut to the box
    asked for (the ``threefold.weights`` interface ``hub_tensors`` reads through)."""

    def __init__(self, run: LoRARun):
        self.run, self.bytes_read = run, 0

    def names(self, kind: str = "model") -> list[str]:
        """The base tensors, in the model's order."""
        return list(self.run.base_shapes) if kind == "model" else []

    def shape(self, name: str, kind: str = "model") -> tuple[int, ...] | None:
        """The base tensor's shape; None if there is none."""
        return self.run.base_shapes.get(name) if kind == "model" else None

    def read(self, name: str, box=(), kind: str = "model",
             dtype: torch.dtype | None = torch.float32, shape=None) -> torch.Tensor:
        """Region ``box`` of the merged tensor ``name``, as ``dtype``."""
        if kind != "model" or name not in self.run.base_shapes:
            raise MissingTensor(f"{self.run.path}: no tensor {kind} {name}")
        whole = self.run.merged(name)
        self.bytes_read += whole.numel() * whole.element_size()
        return whole[tuple(slice(a, b) for a, b in box)].to(dtype or whole.dtype, copy=True)


def export_merged(run_or_ckpt: Path | str, out: Path | str,
                  max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write LoRA run (or checkpoint) ``run_or_ckpt`` as a Hugging Face folder ``out`` with
    its adapters merged: W + (alpha/r)·B·A for every adapted layer, the base elsewhere; the
    files ``threefold.weights.hf.export_hf`` writes (config.json, model.safetensors or shards,
    generation_config.json, the run's tokenizer). ``out`` must be absent or empty; it
    appears complete or not at all. At most one output file's tensors are in memory."""
    out = Path(out)
    check_new_folder(out)
    run = open_lora(run_or_ckpt)
    source = _MergedSource(run)
    tok = run_tokenizer(run.ckpt, run.path)
    write_hf_folder(out, hub_tensors(source, run.model_cfg, source.names()), run.model_cfg,
                    tok, max_shard_bytes=max_shard_bytes)


def load_lora_model(path: Path | str, device: torch.device | str = "cpu") -> CausalLM:
    """The model of LoRA run (or checkpoint) ``path`` with its adapters (``apply_lora``, as
    the run trained it), base and adapters loaded strictly, on ``device``, in eval mode."""
    run = open_lora(path)
    model = apply_lora(CausalLM(run.model_cfg), run.lora)
    weights = {n: run.read_base(n) for n in run.base_shapes}
    weights.update(run.adapters)
    model.load_state_dict(weights, strict=True)
    return model.to(device).eval()
