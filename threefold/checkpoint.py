"""Checkpoints in OUTPUT_DIR/checkpoints/<step>/: safetensors for tensors, JSON for the rest,
no pickle anywhere.

A checkpoint holds *logical* tensors (each parameter and its AdamW state under the parameter's
Hugging Face name, whole, whatever layout wrote it), so any layout can load it. Writes are atomic:
everything goes into a temporary sibling directory which is fsynced and renamed into place, so a
crash during a save leaves the previous checkpoint as it was. A manifest lists every file with
its size and SHA-256; loading verifies it first and refuses a damaged checkpoint before any
tensor is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged or does not fit the run."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, ascending (temporary dirs ignored)."""
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        if p.is_dir() and p.name.isdigit() and (p / MANIFEST).is_file():
            steps.append(int(p.name))
    return sorted(steps)


def save_checkpoint(root: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                    state: dict[str, Any], keep_last: int) -> Path:
    """Write ``tensors`` (file stem -> {name: tensor}) and the JSON ``state`` atomically as
    ``root/<step>``, then delete all but the newest ``keep_last`` checkpoints."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / str(step)
    tmp = root / f".tmp-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files = {}
    for stem, group in tensors.items():
        name = f"{stem}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in group.items()}, str(tmp / name))
        files[name] = None
    (tmp / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
    files["state.json"] = None
    for name in files:
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
        files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
    manifest = {"format_version": FORMAT_VERSION, "step": step, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    with open(tmp / MANIFEST, "rb") as f:
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # same step saved again (e.g. final save right after an interval save)
        old = root / f".old-{step}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    for old_step in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(root / str(old_step), ignore_errors=True)
    return final


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check the manifest, every file's size and SHA-256; return the manifest or raise
    CheckpointError naming the damaged file."""
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
        fpath = (path / name).resolve()
        if path.resolve() not in fpath.parents:  # a manifest must not point outside
            raise CheckpointError(f"{mpath}: file entry '{name}' escapes the checkpoint")
        if not fpath.is_file():
            raise CheckpointError(f"{path}: missing file {name}")
        if fpath.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"{fpath}: size {fpath.stat().st_size} != {meta['bytes']} "
                                  "recorded (truncated?)")
        if _sha256(fpath) != meta["sha256"]:
            raise CheckpointError(f"{fpath}: checksum mismatch (corrupted)")
    return manifest


def load_checkpoint(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Verify, then read every tensor file and the JSON state of one checkpoint."""
    manifest = verify_checkpoint(path)
    tensors = {}
    for name in manifest["files"]:
        if name.endswith(".safetensors"):
            tensors[name[: -len(".safetensors")]] = load_file(str(path / name))
    state = json.loads((path / "state.json").read_text())
    return tensors, state
