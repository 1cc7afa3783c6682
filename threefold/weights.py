"""Sources of logical tensors, read by region: only the slices a rank owns leave the file.

A *source* serves threefold's logical tensors (Hugging Face names; a mixture of experts as the
fused ``mlp.experts.gate_up_proj`` (E, 2f, h) / ``down_proj`` (E, h, f) and router
``mlp.gate.weight``) and reads any box of one, ``logical[a0:b0, a1:b1, ...]``, through
safetensors' lazy slicing (``safe_open(...).get_slice(key)[...]``), never a whole file:
``DictSource`` (tensors in memory), ``HFSource`` (a Hugging Face folder, checked from its
headers alone), ``CheckpointSource`` (a threefold checkpoint, whose tensors lie in *pieces*:
flat element ranges of tensor-parallel slices). ``open_checkpoint`` / ``open_sharded``
verify and open a checkpoint (the latter collectively, for resuming); ``open_pretrained``
opens either kind of folder for ``checkpoint.init_from``.

The bound: reading a box takes exactly the box's elements, each once, so ``bytes_read`` (bytes
of tensor data taken from files, in the files' dtype) grows by exactly ``box elements × stored
element size``, whichever pieces or files hold them. Memory: the result (the box, in the dtype
asked for) plus a temporary of at most ``2 × BLOCK_BYTES``. (safetensors slices its memory
map: a slice is a view, so a strided copy out of it touches only the box's pages.)
"""

from __future__ import annotations

import bisect
import json
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_bytes

from threefold.checkpoint import CheckpointError, NodeGroup, fetch_parts, verify_checkpoint
from threefold.config import ModelConfig

BLOCK_BYTES = 64 << 20  # the most one read call takes from a file (and so holds) at once
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}

Box = Sequence[tuple[int, int]]


def _full_box(box: Box, shape: Sequence[int]) -> list[tuple[int, int]]:
    """``box`` with the dimensions it leaves out made whole; IndexError if it leaves
    ``shape``."""
    if len(box) > len(shape):
        raise IndexError(f"box {tuple(box)} has more dimensions than shape {tuple(shape)}")
    out = [(int(box[d][0]), int(box[d][1])) if d < len(box) else (0, n)
           for d, n in enumerate(shape)]
    if not all(0 <= a <= b <= n for (a, b), n in zip(out, shape)):
        raise IndexError(f"box {tuple(box)} is outside shape {tuple(shape)}")
    return out


def _blocks(box: list[tuple[int, int]], itemsize: int) -> Iterator[list[tuple[int, int]]]:
    """Sub-boxes that cover ``box`` in row-major order, each of at most ``BLOCK_BYTES``:
    runs of whole leading rows where a row fits, else one leading index at a time, split
    further inside."""
    if not box:
        yield []
        return
    (a, b), rest = box[0], box[1:]
    inner = itemsize * math.prod(e - s for s, e in rest)
    if inner * (b - a) <= BLOCK_BYTES:
        yield list(box)
    elif inner <= BLOCK_BYTES:
        step = BLOCK_BYTES // inner
        for s in range(a, b, step):
            yield [(s, min(s + step, b)), *rest]
    else:
        for s in range(a, b):
            for sub in _blocks(rest, itemsize):
                yield [(s, s + 1), *sub]


def _at(box: Sequence[tuple[int, int]], origin: Sequence[int]) -> tuple:
    """Index of ``box`` inside a tensor whose element 0 sits at ``origin``."""
    return tuple(slice(a - o, b - o) for (a, b), o in zip(box, origin))


def _extent(box: Sequence[tuple[int, int]]) -> list[int]:
    return [b - a for a, b in box]


class WeightSource:
    """Logical tensors by name and ``kind`` ("model", "exp_avg" or "exp_avg_sq": AdamW's
    moments, in threefold checkpoints), read by region.

    ``bytes_read`` counts the bytes of tensor data this source has taken from its files, in
    the files' dtype, since it was opened. A tied model (``tied``) serves ``lm_head.weight``
    from ``model.embed_tokens.weight`` when it has no head of its own (a pipeline's last
    stage asks for it); ``names`` lists what is stored."""

    bytes_read: int = 0
    tied: bool = False

    def shape(self, name: str, kind: str = "model") -> tuple[int, ...] | None:
        """The logical shape of ``name``; None if the source has no such tensor."""
        entry = self._entry(name, kind)
        return None if entry is None else tuple(entry.shape)

    def names(self, kind: str = "model") -> list[str]:
        """The stored tensors of ``kind``, in the order the files list them."""
        return [n for k, n in self._entries if k == kind]

    def read(self, name: str, box: Box = (), kind: str = "model",
             dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """``logical[box[0][0]:box[0][1], box[1][0]:box[1][1], ...]`` as a new contiguous
        tensor of ``dtype`` (None: the dtype stored). A box shorter than the tensor's rank
        leaves the remaining dimensions whole; ``()`` reads the whole tensor. Only the box's
        elements are read; KeyError if there is no such tensor."""
        entry = self._entry(name, kind)
        if entry is None:
            raise KeyError(f"{self}: no tensor {kind} {name}")
        box = _full_box(box, entry.shape)
        out = torch.empty(_extent(box), dtype=dtype or entry.dtype)
        if out.numel():
            self._fill(entry, box, out)
        # unmap the files: a memory map's pages count in the resident set while it lives, so
        # keeping it would hold every region read so far (a rank's whole share) twice
        self.release()
        return out

    def release(self) -> None:
        """Close the files read so far (they reopen on the next read)."""

    def tensors(self, kind: str = "model", dtype: torch.dtype | None = torch.float32
                ) -> dict[str, torch.Tensor]:
        """Every stored tensor of ``kind``, whole (all in memory at once: for small models)."""
        return {n: self.read(n, (), kind, dtype) for n in self.names(kind)}

    # A subclass holds ``_entries``, {(kind, name): entry with .shape and .dtype}, and fills
    # ``out`` with region ``box`` (whole rank, inside the shape, not empty) of an entry.
    _entries: dict[tuple[str, str], Any] = {}

    def _entry(self, name: str, kind: str) -> Any:
        entry = self._entries.get((kind, name))
        if entry is None and self.tied and name == HEAD:
            entry = self._entries.get((kind, EMBED))
        return entry

    def _fill(self, entry: Any, box: list[tuple[int, int]], out: torch.Tensor) -> None:
        raise NotImplementedError


class DictSource(WeightSource):
    """Tensors in memory: ``{name: tensor}``, or ``{"model": {name: t}, "optim":
    {"name.exp_avg": t, ...}}`` as ``threefold.checkpoint.load_checkpoint`` returns them.
    ``bytes_read`` counts the bytes copied out, as if they came from a file."""

    def __init__(self, tensors: Mapping[str, Any], tied: bool = False):
        self.bytes_read, self.tied = 0, tied
        model = tensors.get("model")
        if isinstance(model, Mapping):
            self._entries = {("model", n): t for n, t in model.items()}
            for key, t in tensors.get("optim", {}).items():
                name, kind = key.rsplit(".", 1)
                self._entries[(kind, name)] = t
        else:
            self._entries = {("model", n): t for n, t in tensors.items()}

    def _fill(self, entry: torch.Tensor, box, out: torch.Tensor) -> None:
        out.copy_(entry[_at(box, [0] * len(box))])
        self.bytes_read += out.numel() * entry.element_size()


# --------------------------------------------------------------------------------------------
# Hugging Face folders
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Part:
    """One file tensor that fills the logical region starting at ``lo`` (per dimension) of
    extent ``ext``; its own shape is ``ext`` without the first ``drop`` dimensions (size 1:
    a Mixtral expert's w1/w3/w2 inside the fused (E, ...) tensor)."""

    path: Path
    key: str
    lo: tuple[int, ...]
    ext: tuple[int, ...]
    drop: int
    dtype: torch.dtype


@dataclass
class _HFTensor:
    """A logical tensor of a Hugging Face folder: one file tensor, or a Mixtral layer's experts."""

    parts: list[_Part]
    shape: tuple[int, ...]
    dtype: torch.dtype


class HFSource(WeightSource):
    """A local Hugging Face Llama or Mixtral folder (``config.json`` and ``model.safetensors``
    or the shards of ``model.safetensors.index.json``), opened from the files' headers only.

    Opening performs every check ``threefold.hf.import_hf`` makes, with its messages: the
    config maps to a ``ModelConfig`` (``config``), pickle files are refused, index entries
    stay inside the folder, each listed tensor is present and floating point, every expected
    tensor has the config's shape and nothing else is there. ``rotary_emb.inv_freq`` is
    ignored; a tied model serves ``lm_head.weight`` from the embedding. Mixtral files in the
    published per-expert layout (``block_sparse_moe.experts.N.w1/w3/w2``) serve the fused
    logical tensors: a box over experts reads those experts' tensors only (and of each, the
    rows and columns the box covers). ``tokenizer`` is the folder's tokenizer.json or None."""

    def __init__(self, folder: Path | str):
        from threefold import hf  # hf builds export/import on this module, so import it here

        self.folder, self.bytes_read = Path(folder), 0
        cpath = self.folder / "config.json"
        if not cpath.is_file():
            raise hf.HFError(f"{self.folder}: no config.json; not a Hugging Face model folder")
        try:
            raw = json.loads(cpath.read_text())
        except ValueError as e:
            raise hf.HFError(f"{cpath}: not valid JSON ({e})") from None
        cfg = self.config = hf.model_config_from_hf(raw, str(cpath))
        self.tied = bool(cfg.tie_word_embeddings)
        tok = self.folder / "tokenizer.json"
        self.tokenizer = tok if tok.is_file() else None
        self._files: dict[Path, Any] = {}
        parts: dict[str, _Part] = {}
        for path, listed in hf._weight_files(self.folder).items():
            if not path.is_file():
                raise hf.HFError(f"{path}: missing (listed in {hf.INDEX})")
            try:
                f = self._files[path] = safe_open(str(path), "pt")
                keys = set(f.keys())
                for name in listed if listed is not None else sorted(keys):
                    if name not in keys:
                        raise hf.HFError(f"{path}: tensor {name} is missing (the index lists "
                                         "it here)")
                    sl = f.get_slice(name)
                    dt = _DTYPES.get(sl.get_dtype(), sl.get_dtype())
                    if not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                        raise hf.HFError(f"{path}: tensor {name} has dtype {dt}, not floating "
                                         "point")
                    # Older checkpoints stored the RoPE buffer; it is recomputed, never loaded.
                    if not name.endswith("rotary_emb.inv_freq"):
                        shape = tuple(sl.get_shape())
                        parts[name] = _Part(path, name, (0,) * len(shape), shape, 0, dt)
            except SafetensorError as e:
                raise hf.HFError(f"{path}: not a readable safetensors file, truncated or "
                                 f"damaged ({e})") from None
        if self.tied:
            parts.pop(HEAD, None)  # the model takes its head from the embedding
        self._entries = {("model", n): _HFTensor([p], p.ext, p.dtype) for n, p in parts.items()}
        if cfg.num_local_experts:
            self._fuse_experts(hf, cfg)
        want = hf.expected_shapes(cfg)
        shapes = {n: e.shape for (_, n), e in self._entries.items()}
        for name, shape in shapes.items():  # name the file holding a bad tensor
            if name in want and shape != want[name]:
                raise hf.HFError(f"{self._entries['model', name].parts[0].path}: tensor {name} has "
                                 f"shape {shape}, config.json needs {want[name]}")
        hf._check_shapes(cfg, shapes, str(self.folder))

    def _fuse_experts(self, hf, cfg) -> None:
        """Each layer stored per expert becomes the fused logical tensors, as parts (a layer
        already fused is kept as it is); HFError names a missing or misshapen expert."""
        e_count, h, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        entries = self._entries
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            router = entries.pop(("model", p + "block_sparse_moe.gate.weight"), None)
            if router is None:
                continue
            entries["model", p + "mlp.gate.weight"] = router
            gate_up, down = [], []
            for e in range(e_count):
                names = hf._hub_names(i, e)
                for name, shape in zip(names, ((f, h), (f, h), (h, f))):
                    if ("model", name) not in entries:
                        raise hf.HFError(f"tensor {name} is missing (config.json has "
                                         f"num_local_experts={e_count})")
                    got = entries["model", name].parts[0]
                    if got.ext != shape:
                        raise hf.HFError(f"{got.path}: tensor {name} has shape {got.ext}, "
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

    def release(self) -> None:
        """Close the files (they reopen on the next read)."""
        self._files.clear()

    def _fill(self, entry: _HFTensor, box, out: torch.Tensor) -> None:
        for p in entry.parts:
            inter = [(max(a, lo), min(b, lo + n)) for (a, b), lo, n in zip(box, p.lo, p.ext)]
            if any(a >= b for a, b in inter):
                continue
            if p.path not in self._files:
                self._files[p.path] = safe_open(str(p.path), "pt")
            sl = self._files[p.path].get_slice(p.key)
            for blk in _blocks(inter, p.dtype.itemsize):
                t = sl[_at(blk[p.drop:], p.lo[p.drop:])]
                self.bytes_read += t.numel() * t.element_size()
                out[_at(blk, [a for a, _ in box])].copy_(t.reshape(_extent(blk)))


# --------------------------------------------------------------------------------------------
# threefold checkpoints
# --------------------------------------------------------------------------------------------
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
        return math.ceil(self.shape[self.dim] / self.count) if self.dim is not None else 0

    @property
    def slice_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        return (*self.shape[:self.dim], self.step, *self.shape[self.dim + 1:])


class CheckpointSource(WeightSource):
    """A threefold checkpoint directory (format: ``threefold.checkpoint``), read by region;
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
        self.tied = bool((self.state.get("model_config") or {}).get("tie_word_embeddings"))
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
            n, dtype = math.prod(sl.get_shape()), _DTYPES[sl.get_dtype()]
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
            for blk in _blocks(sbox, t.dtype.itemsize):
                region = blk if d is None else \
                    [*blk[:d], (blk[d][0] + lo, blk[d][1] + lo), *blk[d + 1:]]
                self._copy(t, pieces, blk, out[_at(region, origin)], crcs)

    def _copy(self, t: _Tensor, pieces: list[_Piece], blk: list[tuple[int, int]],
              dst: torch.Tensor, crcs: dict) -> None:
        """``dst`` ← block ``blk`` of one slice, from the pieces. The block is whole in every
        dimension after the last one it cuts (k), so its elements are runs of ``run``
        consecutive flat positions of the slice, one per index of the dimensions before k."""
        shape = t.slice_shape
        strides = [math.prod(shape[j + 1:]) for j in range(len(shape))]
        ext = _extent(blk)
        k = max((j for j in range(len(shape)) if ext[j] != shape[j]), default=0)
        run, starts = 1, torch.zeros(1, dtype=torch.int64)
        if shape:
            run = ext[k] * strides[k]
            for j in range(k):
                starts = (starts[:, None] + torch.arange(ext[j]) * strides[j]).reshape(-1)
            starts += sum(a * s for (a, _), s in zip(blk[:k + 1], strides))
        starts = starts.tolist()
        lo, hi = starts[0], starts[-1] + run
        self.bytes_read += dst.numel() * t.dtype.itemsize
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
                dst.copy_(span.as_strided(ext, strides, span.storage_offset()))
                return
            if buf is None:
                buf = torch.empty(len(starts) * run, dtype=t.dtype)
            j = bisect.bisect_right(starts, a0 - run)  # the first run that ends past a0
            while j < len(starts) and starts[j] < b0:
                a, b = max(starts[j], a0), min(starts[j] + run, b0)
                buf[j * run + a - starts[j]:j * run + b - starts[j]] = span[a - a0:b - a0]
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
    (``threefold.checkpoint.fetch_parts``): each node's leader verifies the parts it holds, a
    part on no node is an error naming it, parts a node lacks are sent to it over the control
    channel. Returns (source, state, this rank's per-rank tensors, rank 0's if absent).

    Files on this node's disk are read by region. A rank file received from another node (a
    multi-node run without a shared filesystem, where this node lacks that part) arrives
    whole and is loaded whole (``safetensors.torch.load``) before regions are cut from it."""
    path, files = fetch_parts(Path(root), step, rank, group)
    source = CheckpointSource(path, files)
    return source, source.state, source.rank_tensors(rank)


def open_pretrained(path: Path | str) -> tuple[ModelConfig, WeightSource]:
    """(ModelConfig, WeightSource) of pretrained weights: a Hugging Face folder (it has
    config.json and is not a run directory), or a threefold checkpoint or run directory (its
    newest checkpoint, config from its state). Nothing but headers is read until asked."""
    from threefold import hf  # hf builds export/import on this module, so import it here

    path = Path(path)
    if (path / "config.json").is_file() and not hf.run_checkpoint_root(path).is_dir():
        source = HFSource(path)
        return source.config, source
    ckpt = hf.find_checkpoint(path)
    source = CheckpointSource(ckpt)
    return hf._model_config_from_state(source.state, ckpt), source
