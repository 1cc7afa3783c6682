"""A local Hugging Face folder of a built family as a source of logical tensors (``HFSource``),
checked from its files' headers alone and read by region: which files hold the weights
(``weight_files``: the index or the single file; pickle refused, never opened; index entries
kept inside the folder), the published per-expert Mixtral layout served as the fused
tensors threefold computes with, and Phi-3's fused ``qkv_proj``/``gate_up_proj`` served as
threefold's separate projections (each a region of the fused tensor's rows).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from threefold.weights.checkpoint_verify import read_json
from threefold.config import ModelConfig
from threefold.weights.hf_config import (INDEX, SINGLE, HFError, check_shapes, expected_shapes,
                                 hub_names, hub_router, model_config_from_hf, mtp_copies,
                                 qwen_layout)
from threefold.families import fused_files
from threefold.weights.base import DTYPES, HEAD, WeightSource, blocks, box_index, extent
from threefold.weights.gpt_oss_files import ExpertFileTensor, gpt_oss_entries

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _safe_member(folder: Path, name: object, where: Path) -> Path:
    """``folder / name`` for a plain relative file name from an index; HFError for anything
    that could reach outside the folder (absolute, drive, ``..``) or is not safetensors."""
    if not isinstance(name, str) or not name:
        raise HFError(f"{where}: file entry {name!r} is not a file name")
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() \
            or PureWindowsPath(name).drive or ".." in parts or name.startswith(("/", "\\")):
        raise HFError(f"{where}: file entry '{name}' escapes the folder")
    if not name.endswith(".safetensors"):
        raise HFError(f"{where}: file entry '{name}' is not a .safetensors file (nothing is "
                      "unpickled)")
    return folder / name


def weight_files(folder: Path) -> dict[Path, list[str] | None]:
    """File -> tensor names it must hold (None: all it has), from the index or the single
    model.safetensors; HFError for a folder with only pickle weights or none."""
    index = folder / INDEX
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise HFError(f"{index}: not a valid safetensors index ({e})") from None
        if not isinstance(wmap, dict):
            raise HFError(f"{index}: weight_map is not a mapping")
        files: dict[Path, list[str] | None] = {}
        for tensor, name in wmap.items():
            files.setdefault(_safe_member(folder, name, index), []).append(tensor)
        return files
    if (folder / SINGLE).is_file():
        return {folder / SINGLE: None}
    pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise HFError(f"{folder}: weights only in pickle format ({pickles[0]}); threefold never "
                      "unpickles files: save the model with safetensors "
                      "(save_pretrained(..., safe_serialization=True)) and try again")
    raise HFError(f"{folder}: no {SINGLE} or {INDEX}")


def without_absent_mtp(cfg: ModelConfig, folder: Path) -> ModelConfig:
    """``cfg`` as the folder's weights have it: a config.json that names
    ``num_nextn_predict_layers`` (transformers writes DeepSeek-V3's 1 by default) over weights
    without layer ``num_hidden_layers`` (transformers' model ignores the module, and saves
    none) is a model without the modules, as transformers reads it. Reads the index, or the
    single file's header."""
    if not cfg.num_nextn_predict_layers:
        return cfg
    names: set[str] = set()
    for path, listed in weight_files(folder).items():
        if listed is None:
            try:
                with safe_open(str(path), "pt") as f:
                    listed = list(f.keys())
            except SafetensorError as e:
                raise HFError(f"{path}: not a readable safetensors file ({e})") from None
        names.update(listed)
    first = f"model.layers.{cfg.num_hidden_layers}."
    if any(n.startswith(first) for n in names):
        return cfg
    return dataclasses.replace(cfg, num_nextn_predict_layers=0)


@dataclass(frozen=True)
class _Part:
    """One file tensor, or its region starting at ``at`` (per dimension of the file tensor;
    empty: its start), that fills the logical region starting at ``lo`` (per dimension) of
    extent ``ext``; the file's region has ``ext``'s shape without the first ``drop``
    dimensions (size 1: a Mixtral expert's w1/w3/w2 inside the fused (E, ...) tensor).
    Phi-3's fused ``qkv_proj`` serves q, k and v as three parts, each at its rows."""

    path: Path
    key: str
    lo: tuple[int, ...]
    ext: tuple[int, ...]
    drop: int
    dtype: torch.dtype
    at: tuple[int, ...] = ()

    def origin(self) -> list[int]:
        """Where element 0 of the file tensor sits in logical coordinates (of the dimensions
        the file has)."""
        lo = self.lo[self.drop:]
        return [a - b for a, b in zip(lo, self.at or (0,) * len(lo))]


@dataclass
class _HFTensor:
    """A logical tensor of a Hugging Face folder: one file tensor, or a Mixtral layer's experts."""

    parts: list[_Part]
    shape: tuple[int, ...]
    dtype: torch.dtype


def _split_fused(cfg: ModelConfig, parts: dict[str, _Part]) -> dict[str, _Part]:
    """``parts`` with each fused file tensor of the family (``threefold.families.fused_files``:
    Phi-3's ``qkv_proj``, ``gate_up_proj``) replaced, in place in the order, by the logical
    tensors it holds, each a region of its rows; HFError names a fused tensor that is
    missing or of another shape than its parts make."""
    fused = fused_files(cfg)
    if not fused:
        return parts
    want = expected_shapes(cfg)
    owner = {names[0]: file for file, names in fused.items()}
    out = {}
    for name, part in parts.items():
        if name not in fused:
            out[name] = part
            continue
        rows = [want[n][0] for n in fused[name]]
        shape = (sum(rows), *want[fused[name][0]][1:])
        if part.ext != shape:
            raise HFError(f"{part.path}: tensor {name} has shape {part.ext}, config.json "
                          f"needs {shape} (its {len(rows)} fused projections)")
        at = 0
        for n, r in zip(fused[name], rows):
            out[n] = _Part(part.path, name, (0,) * len(shape), (r, *shape[1:]), 0, part.dtype,
                           (at, *(0,) * (len(shape) - 1)))
            at += r
    for first, file in owner.items():
        if file not in parts and first not in parts:
            raise HFError(f"tensor {file} is missing (a {cfg.family} folder stores its "
                          "projections fused)")
    return out


class HFSource(WeightSource):
    """A local Hugging Face folder of a built family (``config.json`` and ``model.safetensors``
    or the shards of ``model.safetensors.index.json``), opened from the files' headers only.

    Opening performs every check ``threefold.weights.hf.import_hf`` makes, with its messages: the
    config maps to a ``ModelConfig`` (``config``), pickle files are refused, index entries
    stay inside the folder, each listed tensor is present and floating point, every expected
    tensor has the config's shape and nothing else is there. ``rotary_emb.inv_freq`` is
    ignored, and so is a tied model's ``lm_head.weight`` (the model takes its head from the
    embedding). Mixtral files in the published per-expert layout
    (``block_sparse_moe.experts.N.w1/w3/w2``) serve the fused logical tensors: a box over
    experts reads those experts' tensors only (and of each, the rows and columns the box
    covers). A family's fused file tensors (Phi-3's ``qkv_proj``, ``gate_up_proj``) serve
    threefold's separate projections, each read from its rows of the fused tensor alone.
    ``tokenizer`` is the folder's tokenizer.json or None."""

    def __init__(self, folder: Path | str):
        self.folder, self.bytes_read = Path(folder), 0
        cpath = self.folder / "config.json"
        raw = read_json(cpath, HFError, "not a Hugging Face model folder", "not valid JSON")
        cfg = self.config = without_absent_mtp(model_config_from_hf(raw, str(cpath)),
                                               self.folder)
        tok = self.folder / "tokenizer.json"
        self.tokenizer = tok if tok.is_file() else None
        self._files: dict[Path, Any] = {}
        parts: dict[str, _Part] = {}
        for path, listed in weight_files(self.folder).items():
            if not path.is_file():
                raise HFError(f"{path}: missing (listed in {INDEX})")
            try:
                f = self._files[path] = safe_open(str(path), "pt")
                keys = set(f.keys())
                for name in listed if listed is not None else sorted(keys):
                    if name not in keys:
                        raise HFError(f"{path}: tensor {name} is missing (the index lists "
                                      "it here)")
                    sl = f.get_slice(name)
                    dt = DTYPES.get(sl.get_dtype(), sl.get_dtype())
                    packed = dt == torch.uint8 and name.endswith(("_blocks", "_scales"))
                    if not (isinstance(dt, torch.dtype) and dt.is_floating_point or packed):
                        raise HFError(f"{path}: tensor {name} has dtype {dt}, not floating "
                                      "point")
                    # Older checkpoints stored the RoPE buffer; it is recomputed, never loaded.
                    if not name.endswith("rotary_emb.inv_freq"):
                        shape = tuple(sl.get_shape())
                        parts[name] = _Part(path, name, (0,) * len(shape), shape, 0, dt)
            except SafetensorError as e:
                raise HFError(f"{path}: not a readable safetensors file, truncated or "
                              f"damaged ({e})") from None
        if cfg.tie_word_embeddings:
            parts.pop(HEAD, None)  # the model takes its head from the embedding
        # the multi-token-prediction modules' copies of the embedding and the head: the
        # model's own are read (check_copies compares them)
        self.copies = {n: (parts.pop(n), model) for n, model in mtp_copies(cfg).items()
                       if n in parts}
        parts = _split_fused(cfg, parts)
        self._entries = {("model", n): _HFTensor([p], p.ext, p.dtype) for n, p in parts.items()}
        if cfg.family == "gpt_oss":  # its own file layout, MXFP4 experts included
            gpt_oss_entries(cfg, self._entries, lambda e: (e.parts[0].path, e.parts[0].key,
                                                           e.shape, e.dtype))
        elif cfg.num_local_experts:
            self._fuse_experts(cfg)
        check_shapes(cfg, {n: e.shape for (_, n), e in self._entries.items()},
                     str(self.folder), files={n: getattr(e, "path", None) or e.parts[0].path
                                              for (_, n), e in self._entries.items()})

    def _fuse_experts(self, cfg: ModelConfig) -> None:
        """Each layer stored per expert becomes the fused logical tensors, as parts (a layer
        already fused is kept as it is); HFError names a missing or misshapen expert."""
        e_count, h, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        entries, qwen = self._entries, qwen_layout(cfg)  # Qwen MoE file names, or Mixtral's
        for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
            p = f"model.layers.{i}."
            if ("model", hub_names(i, 0, qwen)[0]) not in entries:
                continue  # stored fused already
            router = entries.pop(("model", hub_router(i, qwen)), None)
            if router is None:
                raise HFError(f"tensor {hub_router(i, qwen)} is missing")
            entries["model", p + "mlp.gate.weight"] = router
            gate_up, down = [], []
            for e in range(e_count):
                names = hub_names(i, e, qwen)
                for name, shape in zip(names, ((f, h), (f, h), (h, f))):
                    if ("model", name) not in entries:
                        raise HFError(f"tensor {name} is missing (config.json has "
                                      f"num_local_experts={e_count})")
                    got = entries["model", name].parts[0]
                    if got.ext != shape:
                        raise HFError(f"{got.path}: tensor {name} has shape {got.ext}, "
                                      f"config.json needs {shape}")
                w1, w3, w2 = (entries.pop(("model", n)).parts[0] for n in names)
                gate_up += [_Part(w1.path, w1.key, (e, 0, 0), (1, f, h), 1, w1.dtype),
                            _Part(w3.path, w3.key, (e, f, 0), (1, f, h), 1, w3.dtype)]
                down.append(_Part(w2.path, w2.key, (e, 0, 0), (1, h, f), 1, w2.dtype))
            entries["model", p + "mlp.experts.gate_up_proj"] = _HFTensor(
                gate_up, (e_count, 2 * f, h), gate_up[0].dtype)
            entries["model", p + "mlp.experts.down_proj"] = _HFTensor(
                down, (e_count, h, f), down[0].dtype)

    def __repr__(self) -> str:
        return f"HFSource({self.folder})"

    def check_copies(self) -> None:
        """HFError unless each multi-token-prediction module's stored embedding and head
        equal the model's (the modules share them: a folder whose copies differ is not the
        model threefold builds). Reads both whole."""
        for name, (part, model) in self.copies.items():
            copy = _HFTensor([part], part.ext, part.dtype)
            mine = torch.empty(part.ext, dtype=torch.float32)
            self._fill(copy, [(0, n) for n in part.ext], mine)
            if part.ext != self.shape(model) or not torch.equal(mine, self.read(model)):
                raise HFError(f"{part.path}: tensor {name} differs from {model}: the "
                              "multi-token-prediction module shares the model's embedding "
                              "and head")

    def release(self) -> None:
        """Close the files (they reopen on the next read)."""
        self._files.clear()

    def read_file(self, path: Path, key: str, index: tuple) -> torch.Tensor:
        """``index`` of file tensor ``key`` in ``path`` (counted in ``bytes_read``)."""
        if path not in self._files:
            self._files[path] = safe_open(str(path), "pt")
        t = self._files[path].get_slice(key)[index]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _fill(self, entry: _HFTensor, box, out: torch.Tensor) -> None:
        if isinstance(entry, ExpertFileTensor):  # GPT-OSS's layouts
            entry.fill(self, box, out)
            return
        for p in entry.parts:
            inter = [(max(a, lo), min(b, lo + n)) for (a, b), lo, n in zip(box, p.lo, p.ext)]
            if any(a >= b for a, b in inter):
                continue
            if p.path not in self._files:
                self._files[p.path] = safe_open(str(p.path), "pt")
            sl = self._files[p.path].get_slice(p.key)
            for blk in blocks(inter, p.dtype.itemsize):
                t = sl[box_index(blk[p.drop:], p.origin())]
                self.bytes_read += t.numel() * t.element_size()
                out[box_index(blk, [a for a, _ in box])].copy_(t.reshape(extent(blk)))

