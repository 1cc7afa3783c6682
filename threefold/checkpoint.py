"""Sharded checkpoints in OUTPUT_DIR/checkpoints/<step>/: safetensors for tensors, JSON for
the rest, no pickle anywhere.

Each rank writes only what it holds — its *pieces* — to ``rank<r>.safetensors``, and describes
them in ``rank<r>.json``: for each piece the logical tensor (HF parameter name, and ``model``,
``exp_avg`` or ``exp_avg_sq``), its logical shape, where it sits — the tensor-parallel slice
(dimension, index, count) and the flat element range of that slice (a ZeRO shard covers a range)
— and a CRC-32 of its bytes. Replicated tensors are written once. Rank 0 adds ``state.json``
(step, sampler, scheduler, configs) and the ``manifest.json`` listing every file with its size
and SHA-256.

Loading reassembles whole logical tensors from the pieces, whatever layout wrote them, so a
run resumes under any other layout (each layout then takes its own slices).

Writes are atomic: every rank writes into one temporary sibling directory; after a barrier rank
0 writes the manifest, fsyncs and renames the directory into place. A crash during a save
leaves the previous checkpoint untouched. Loading verifies the manifest, sizes and checksums
first and names the damaged file (and tensor) before any tensor is used.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from threefold import faults

FORMAT_VERSION = 2
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged or does not fit the run."""


@dataclass
class Piece:
    """Part of one logical tensor held by this rank."""

    name: str                 # HF parameter name
    kind: str                 # "model", "exp_avg" or "exp_avg_sq"
    data: torch.Tensor        # 1-D: elements [start, end) of the tp slice, flattened
    start: int
    end: int
    shape: tuple              # logical (whole) shape
    tp_dim: int | None = None  # dimension split over tensor parallelism, None = not split
    tp_index: int = 0
    tp_count: int = 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, ascending (temporary dirs ignored)."""
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir()
                  if p.is_dir() and p.name.isdigit() and (p / MANIFEST).is_file())


def _slice_shape(shape: tuple, dim: int | None, index: int, count: int) -> tuple:
    """Shape of tp slice ``index`` of ``count`` (the last may be padding-short: size is
    ceil(n / count) for every slice, padding included)."""
    if dim is None:
        return tuple(shape)
    s = list(shape)
    s[dim] = math.ceil(shape[dim] / count)
    return tuple(s)


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------
def save_sharded(root: Path, step: int, rank: int, world: int, pieces: list[Piece],
                 rank_tensors: dict[str, torch.Tensor], state: dict[str, Any] | None,
                 keep_last: int, barrier: Callable[[], None] = lambda: None) -> Path:
    """Collective save of checkpoint ``step``: every rank calls it with its pieces (and
    per-rank tensors such as RNG state); rank 0 passes the JSON ``state``."""
    root.mkdir(parents=True, exist_ok=True)
    tmp, final = root / f".tmp-{step}", root / str(step)
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    tmp.mkdir(exist_ok=True)
    tensors, meta = {}, []
    for i, p in enumerate(pieces):
        key = f"{p.kind}/{p.name}/{i}"
        tensors[key] = p.data.detach().contiguous().cpu()
        d = asdict(p)
        d.pop("data")
        d.update(key=key, shape=list(p.shape), crc32=_crc(tensors[key]))
        meta.append(d)
    for k, t in rank_tensors.items():
        tensors[f"rank/{k}"] = t.detach().contiguous().cpu()
    save_file(tensors, str(tmp / f"rank{rank}.safetensors"))
    extra = {k: _crc(t) for k, t in tensors.items() if k.startswith("rank/")}
    (tmp / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "pieces": meta,
                                                      "rank_tensors": extra}))
    for name in (f"rank{rank}.safetensors", f"rank{rank}.json"):
        _fsync(tmp / name)
    faults.during_save(rank, step)
    barrier()
    if rank == 0:
        (tmp / "state.json").write_text(json.dumps(state or {}, indent=1, sort_keys=True))
        files = {}
        for f in sorted(tmp.iterdir()):
            _fsync(f)
            files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        manifest = {"format_version": FORMAT_VERSION, "step": step, "world_size": world,
                    "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        if final.exists():  # the same step saved again: swap, then drop the old one
            old = root / f".old-{step}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        _fsync(root)
        for old_step in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(root / str(old_step), ignore_errors=True)
    barrier()
    return final


def whole_pieces(tensors: dict[str, dict[str, torch.Tensor]]) -> list[Piece]:
    """Pieces for whole tensors: {"model": {name: t}, "optim": {name.exp_avg: t, ...}}."""
    out = []
    for name, t in tensors.get("model", {}).items():
        out.append(Piece(name, "model", t.reshape(-1), 0, t.numel(), tuple(t.shape)))
    for key, t in tensors.get("optim", {}).items():
        name, kind = key.rsplit(".", 1)
        out.append(Piece(name, kind, t.reshape(-1), 0, t.numel(), tuple(t.shape)))
    return out


def save_checkpoint(root: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                    state: dict[str, Any], keep_last: int) -> Path:
    """One-process save of whole tensors ({"model": ..., "optim": ..., "rng": ...})."""
    return save_sharded(root, step, 0, 1, whole_pieces(tensors), tensors.get("rng", {}), state,
                        keep_last)


# --------------------------------------------------------------------------------------------
# Verifying and loading
# --------------------------------------------------------------------------------------------
def _inside(path: Path, name: str) -> Path:
    f = (path / name).resolve()
    if path.resolve() not in f.parents:
        raise CheckpointError(f"{path / MANIFEST}: entry '{name}' escapes the checkpoint")
    return f


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check the manifest, every file's size and SHA-256; return the manifest or raise
    CheckpointError naming the damaged file (and tensor, where one can be found)."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST}; not a complete checkpoint")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format version {manifest.get('format_version')} "
                              f"is not {FORMAT_VERSION}")
    for name, meta in manifest.get("files", {}).items():
        f = _inside(path, name)
        if not f.is_file():
            raise CheckpointError(f"{path}: missing file {name}")
        if f.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"{f}: {f.stat().st_size} bytes, {meta['bytes']} recorded "
                                  "(truncated?)")
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{f}: checksum mismatch (corrupted){_bad_tensor(path, f)}")
    return manifest


def _bad_tensor(path: Path, f: Path) -> str:
    """Name the first tensor whose CRC no longer matches, if the file can still be read."""
    if not f.name.endswith(".safetensors"):
        return ""
    try:
        meta = json.loads((path / f.name.replace(".safetensors", ".json")).read_text())
        with safe_open(str(f), "pt") as sf:
            for p in meta["pieces"]:
                if _crc(sf.get_tensor(p["key"])) != p["crc32"]:
                    return f"; tensor {p['kind']} {p['name']}"
            for key, crc in meta.get("rank_tensors", {}).items():
                if _crc(sf.get_tensor(key)) != crc:
                    return f"; tensor {key}"
    except Exception:  # noqa: BLE001 - header itself damaged: the file name is what we have
        return ""
    return ""


def load_checkpoint(path: Path, rank: int = 0) -> tuple[dict[str, dict[str, torch.Tensor]],
                                                        dict[str, Any]]:
    """Verify, then reassemble whole logical tensors: {"model": {name: t}, "optim":
    {name.exp_avg: t, ...}, "rng": this rank's per-rank tensors (rank 0's if absent)}."""
    manifest = verify_checkpoint(path)
    state = json.loads((path / "state.json").read_text())
    slices: dict[tuple, dict] = {}
    rng: dict[str, torch.Tensor] = {}
    for name in manifest["files"]:
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        meta = json.loads(_inside(path, name).read_text())
        tfile = _inside(path, name.replace(".json", ".safetensors"))
        with safe_open(str(tfile), "pt") as sf:
            for p in meta["pieces"]:
                key = (p["kind"], p["name"])
                entry = slices.setdefault(key, {"shape": tuple(p["shape"]), "dim": p["tp_dim"],
                                                "count": p["tp_count"], "parts": {}})
                if (entry["dim"], entry["count"]) != (p["tp_dim"], p["tp_count"]):
                    raise CheckpointError(f"{tfile}: tensor {p['name']} is split two ways")
                sl = _slice_shape(entry["shape"], p["tp_dim"], p["tp_index"], p["tp_count"])
                buf, filled = entry["parts"].setdefault(
                    p["tp_index"], (None, 0))
                t = sf.get_tensor(p["key"])
                if buf is None:
                    buf = torch.zeros(math.prod(sl), dtype=t.dtype)
                buf[p["start"]:p["end"]] = t
                entry["parts"][p["tp_index"]] = (buf, filled + (p["end"] - p["start"]))
            if meta["rank"] == rank or (meta["rank"] == 0 and not rng):
                rng = {k[5:]: sf.get_tensor(k) for k in sf.keys() if k.startswith("rank/")}
    out: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}, "rng": rng}
    for (kind, name), e in slices.items():
        sl = _slice_shape(e["shape"], e["dim"], 0, e["count"])
        parts = []
        for i in range(e["count"]):
            if i not in e["parts"] or e["parts"][i][1] != math.prod(sl):
                raise CheckpointError(f"{path}: tensor {kind} {name} is incomplete "
                                      f"(slice {i} of {e['count']})")
            parts.append(e["parts"][i][0].view(sl))
        whole = parts[0] if e["dim"] is None else torch.cat(parts, e["dim"])
        if e["dim"] is not None:
            whole = whole.narrow(e["dim"], 0, e["shape"][e["dim"]]).contiguous()
        if kind == "model":
            out["model"][name] = whole
        else:
            out["optim"][f"{name}.{kind}"] = whole
    return out, state
