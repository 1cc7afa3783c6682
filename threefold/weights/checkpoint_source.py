"""A threefold checkpoint directory as a source of logical tensors (``CheckpointSource``; the
format is ``threefold.weights.checkpoint``'s), read by region from only the pieces, and the parts of
pieces, that hold the region; ``open_checkpoint`` (one directory) and ``open_sharded`` (the
collective open for resuming, each node with its own root) verify before they open.
"""

from __future__ import annotations

import bisect
import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes

from threefold.weights.checkpoint_verify import (CheckpointError, NodeGroup, fetch_parts,
                                                 verify_checkpoint)
from threefold.weights.base import DTYPES, WeightSource, blocks, box_index, extent


@dataclass
class _Piece:
    """``key`` in rank file ``file``: elements [start, end) of a tensor-parallel slice,
    flattened, read from ``eff`` on (past what an earlier piece holds: replicas read once)."""

    file: str
    key: str
    start: int
    end: int
    eff: int
    crc: int | None


@dataclass
class _Tensor:
    """A checkpoint's logical tensor: shape, tensor-parallel split (slices ``ceil(n / count)``
    long along ``dim``, the last padded) and each slice's pieces."""

    label: str
    shape: tuple[int, ...]
    dim: int | None
    count: int
    dtype: torch.dtype
    slices: dict[int, list[_Piece]]

    @property
    def step(self) -> int:
        """The length of a slice along ``dim`` (0 if the tensor is not split)."""
        return math.ceil(self.shape[self.dim] / self.count) if self.dim is not None else 0

    @property
    def slice_shape(self) -> tuple[int, ...]:
        """The shape of one tensor-parallel slice, padding included."""
        if self.dim is None:
            return self.shape
        return (*self.shape[:self.dim], self.step, *self.shape[self.dim + 1:])


class CheckpointSource(WeightSource):
    """A threefold checkpoint directory (format: ``threefold.weights.checkpoint``), read by region;
    ``state`` is its state.json. Opening verifies it (``verify_checkpoint``: index, parts,
    sizes, SHA-256) unless ``files`` maps every file name to a path or to a received file's
    bytes, verified by the caller (``open_sharded``; received rank files are loaded whole),
    then reads the rank files' JSON and tensor headers and checks every tensor is complete.

    A box is read from each tensor-parallel slice it crosses, in blocks of at most
    ``BLOCK_BYTES``; a block is runs of consecutive elements of the slice, and of each piece
    only the sub-range overlapping a run is read (``get_slice(key)[a:b]``): exactly the box's
    elements. A box that cuts the last dimensions costs one read call per run (per row, for a
    column slice). A piece's CRC-32 is checked whenever one read covers the whole piece; the
    files' SHA-256, checked on opening, is the integrity guarantee."""

    def __init__(self, path: Path | str, files: Mapping[str, Path | bytes] | None = None):
        self.path, self.bytes_read = Path(path), 0
        if files is None:
            files = {n: self.path / n for n in verify_checkpoint(self.path)["files"]}
        self._src, self._open = dict(files), {}
        self.state = json.loads(self._text("state.json"))
        self._rank_file: dict[int, str] = {}
        self._entries: dict[tuple[str, str], _Tensor] = {}
        for name in sorted(self._src):
            if not (name.startswith("rank") and name.endswith(".json")):
                continue
            meta = json.loads(self._text(name))
            tname = name[:-len(".json")] + ".safetensors"
            self._rank_file[meta["rank"]] = tname
            for p in meta["pieces"]:
                self._add(tname, p)
        for t in self._entries.values():
            self._index(t)

    def _add(self, tname: str, p: dict) -> None:
        f, key = self._file(tname), p["key"]
        if isinstance(f, dict):
            n, dtype = f[key].numel(), f[key].dtype
        else:
            sl = f.get_slice(key)
            n, dtype = math.prod(sl.get_shape()), DTYPES[sl.get_dtype()]
        if n != p["end"] - p["start"]:
            raise CheckpointError(f"{self.path / tname}: piece {key} holds {n} elements, its "
                                  f"range [{p['start']}, {p['end']}) needs {p['end'] - p['start']}")
        dim, count = p.get("tp_dim"), p.get("tp_count", 1)
        t = self._entries.setdefault((p["kind"], p["name"]), _Tensor(
            f"{p['kind']} {p['name']}", tuple(p["shape"]), dim, count, dtype, {}))
        if (t.dim, t.count) != (dim, count):
            raise CheckpointError(f"{self.path / tname}: tensor {p['name']} is split two ways")
        t.slices.setdefault(p.get("tp_index", 0), []).append(
            _Piece(tname, key, p["start"], p["end"], p["start"], p.get("crc32")))

    def _index(self, t: _Tensor) -> None:
        """Sort each slice's pieces and check they cover it; where pieces overlap (a tensor
        written twice), each element is read from the first that holds it."""
        numel = math.prod(t.slice_shape)
        for i in range(t.count):
            covered, kept = 0, []
            for p in sorted(t.slices.get(i, []), key=lambda p: p.start):
                if p.start > covered:
                    break
                p.eff = max(p.start, covered)
                if p.eff < p.end:
                    kept.append(p)
                covered = max(covered, p.end)
            if covered < numel:
                raise CheckpointError(f"{self.path}: tensor {t.label} is incomplete (slice "
                                      f"{i} of {t.count})")
            t.slices[i] = kept

    def _text(self, name: str) -> str:
        src = self._src[name]
        return src.decode() if isinstance(src, bytes) else Path(src).read_text()

    def _file(self, name: str) -> Any:
        """An open rank file: safetensors' lazy handle, or the tensors of received bytes."""
        if name not in self._open:
            src = self._src[name]
            self._open[name] = load_bytes(src) if isinstance(src, bytes) \
                else safe_open(str(src), "pt")
        return self._open[name]

    def __repr__(self) -> str:
        return f"CheckpointSource({self.path})"

    def release(self) -> None:
        """Close the rank files opened from disk (they reopen on the next read); received
        bytes stay loaded."""
        for name in [n for n, src in self._src.items() if not isinstance(src, bytes)]:
            self._open.pop(name, None)

    def rank_tensors(self, rank: int) -> dict[str, torch.Tensor]:
        """The per-rank tensors (RNG state) saved by ``rank``, or rank 0's where that rank
        saved none (a checkpoint written by fewer ranks)."""
        for r in (rank, 0):
            if r not in self._rank_file:
                continue
            f = self._file(self._rank_file[r])
            keys = [k for k in f.keys() if k.startswith("rank/")]
            if keys or r == 0:
                out = {k[5:]: f[k] if isinstance(f, dict) else f.get_tensor(k) for k in keys}
                self.bytes_read += sum(t.numel() * t.element_size() for t in out.values())
                return out
        return {}

    def _fill(self, t: _Tensor, box, out: torch.Tensor) -> None:
        crcs: dict[tuple[str, str], tuple[int, int]] = {}
        d, origin = t.dim, [a for a, _ in box]
        for i, pieces in sorted(t.slices.items()):
            sbox, lo = box, 0  # the box in this slice's coordinates
            if d is not None:
                lo = i * t.step
                a, b = max(box[d][0], lo), min(box[d][1], lo + t.step)
                if a >= b:
                    continue
                sbox = [*box[:d], (a - lo, b - lo), *box[d + 1:]]
            for blk in blocks(sbox, t.dtype.itemsize):
                region = blk if d is None else \
                    [*blk[:d], (blk[d][0] + lo, blk[d][1] + lo), *blk[d + 1:]]
                self._copy(t, pieces, blk, out[box_index(region, origin)], crcs)

    def _copy(self, t: _Tensor, pieces: list[_Piece], blk: list[tuple[int, int]],
              dst: torch.Tensor, crcs: dict) -> None:
        """``dst`` ← block ``blk`` of one slice, from the pieces. The block is whole in every
        dimension after the last one it cuts (k), so its elements are runs of ``run``
        consecutive flat positions of the slice, one per index of the dimensions before k."""
        shape = t.slice_shape
        strides = [math.prod(shape[j + 1:]) for j in range(len(shape))]
        ext = extent(blk)
        k = max((j for j in range(len(shape)) if ext[j] != shape[j]), default=0)
        run, starts = 1, torch.zeros(1, dtype=torch.int64)
        if shape:
            run = ext[k] * strides[k]
            for j in range(k):
                starts = (starts[:, None] + torch.arange(ext[j]) * strides[j]).reshape(-1)
            starts += sum(a * s for (a, _), s in zip(blk[:k + 1], strides))
        starts = starts.tolist()
        lo, hi = starts[0], starts[-1] + run
        buf = None
        for p in pieces:
            if p.end <= lo or p.eff >= hi:
                continue
            f = self._file(p.file)
            a0, b0 = max(lo, p.eff), min(hi, p.end)
            # safetensors slices its memory map: ``span`` is a view, read only where used
            span = (f[p.key] if isinstance(f, dict) else f.get_slice(p.key))[
                a0 - p.start:b0 - p.start]
            if (a0, b0) == (lo, hi):  # one piece holds the whole block: one strided copy
                if len(starts) == 1:
                    self._check_crc(t, p, a0, b0, span, crcs)
                src = span.as_strided(ext, strides, span.storage_offset())
                dst.copy_(src)
                self.bytes_read += src.numel() * t.dtype.itemsize
                return
            if buf is None:
                buf = torch.empty(len(starts) * run, dtype=t.dtype)
            j = bisect.bisect_right(starts, a0 - run)  # the first run that ends past a0
            while j < len(starts) and starts[j] < b0:
                a, b = max(starts[j], a0), min(starts[j] + run, b0)
                buf[j * run + a - starts[j]:j * run + b - starts[j]] = span[a - a0:b - a0]
                self.bytes_read += (b - a) * t.dtype.itemsize
                self._check_crc(t, p, a, b, span[a - a0:b - a0], crcs)
                j += 1
        dst.copy_(buf.view(ext))

    def _check_crc(self, t: _Tensor, p: _Piece, a: int, b: int, chunk: torch.Tensor,
                   crcs: dict) -> None:
        """Chain the CRC-32 of a piece's elements as one read takes them in order; compare
        when the piece is complete. A read that skips part of the piece cannot check it."""
        if p.crc is None or p.eff != p.start:  # no CRC, or part of it is read from another
            return
        done, crc = crcs.get((p.file, p.key), (p.start, 0))
        if a != done:
            crcs[p.file, p.key] = (-1, 0)
            return
        crc = zlib.crc32(chunk.contiguous().view(torch.uint8).numpy(), crc)
        crcs[p.file, p.key] = (b, crc)
        if b == p.end and crc != p.crc:
            raise CheckpointError(f"{self.path / p.file}: tensor {t.label} does not match its "
                                  "CRC-32 (corrupted)")


def open_checkpoint(path: Path | str, rank: int = 0
                    ) -> tuple[CheckpointSource, dict[str, Any], dict[str, torch.Tensor]]:
    """Verify and open the checkpoint directory ``path`` (every node part in it): (source,
    state, ``rank``'s per-rank tensors, rank 0's if it saved none)."""
    source = CheckpointSource(path)
    return source, source.state, source.rank_tensors(rank)


def open_sharded(root: Path | str, step: int, rank: int, group: NodeGroup
                 ) -> tuple[CheckpointSource, dict[str, Any], dict[str, torch.Tensor]]:
    """Collective open of checkpoint ``step`` for resuming, with ``load_sharded``'s contract
    (``threefold.weights.checkpoint_verify.fetch_parts``): each node's leader verifies the parts it
    holds, a part on no node is an error naming it, parts a node lacks are sent to it over the
    control channel. Returns (source, state, this rank's per-rank tensors, rank 0's if absent).

    Files on this node's disk are read by region. A rank file received from another node (a
    multi-node run without a shared filesystem, where this node lacks that part) arrives
    whole and is loaded whole (``safetensors.torch.load``) before regions are cut from it."""
    path, files = fetch_parts(Path(root), step, rank, group)
    source = CheckpointSource(path, files)
    return source, source.state, source.rank_tensors(rank)
