"""The interface every source of logical tensors offers (``WeightSource``), the one that holds
them in memory (``DictSource``), and the region arithmetic the file sources share: a box
``logical[a0:b0, a1:b1, ...]`` completed to the tensor's rank and cut into blocks of at most
``BLOCK_BYTES`` (``blocks``), so that a read's temporary stays bounded whatever the box.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

BLOCK_BYTES = 64 << 20  # the most one read call takes from a file (and so holds) at once
HEAD = "lm_head.weight"
# safetensors' dtype names -> torch's
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}

Box = Sequence[tuple[int, int]]


class MissingTensor(KeyError):
    """A source has no such tensor (its message names it). A ``KeyError``, so that callers
    may catch exactly this and let any other ``KeyError`` through."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


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


def blocks(box: list[tuple[int, int]], itemsize: int) -> Iterator[list[tuple[int, int]]]:
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
            for sub in blocks(rest, itemsize):
                yield [(s, s + 1), *sub]


def box_index(box: Sequence[tuple[int, int]], origin: Sequence[int]) -> tuple:
    """Index of ``box`` inside a tensor whose element 0 sits at ``origin``."""
    return tuple(slice(a - o, b - o) for (a, b), o in zip(box, origin))


def extent(box: Sequence[tuple[int, int]]) -> list[int]:
    """The size of ``box`` in each dimension."""
    return [b - a for a, b in box]


class WeightSource:
    """Logical tensors by name and ``kind`` ("model", "exp_avg" or "exp_avg_sq": AdamW's
    moments, in threefold checkpoints), read by region.

    ``bytes_read`` counts the bytes of tensor data this source has taken from its files, in
    the files' dtype, since it was opened; ``names`` lists what is stored."""

    bytes_read: int = 0

    def shape(self, name: str, kind: str = "model") -> tuple[int, ...] | None:
        """The logical shape of ``name``; None if the source has no such tensor."""
        entry = self._entry(name, kind)
        return None if entry is None else tuple(entry.shape)

    def names(self, kind: str = "model") -> list[str]:
        """The stored tensors of ``kind``, in the order the files list them."""
        return [n for k, n in self._entries if k == kind]

    def read(self, name: str, box: Box = (), kind: str = "model",
             dtype: torch.dtype | None = torch.float32,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """``logical[box[0][0]:box[0][1], box[1][0]:box[1][1], ...]`` as a new contiguous
        tensor of ``dtype`` (None: the dtype stored). A box shorter than the tensor's rank
        leaves the remaining dimensions whole; ``()`` reads the whole tensor. Only the box's
        elements are read; ``MissingTensor`` if there is no such tensor, ValueError if
        ``shape`` (the logical shape the caller's model has) is given and the stored one
        differs."""
        entry = self._entry(name, kind)
        if entry is None:
            raise MissingTensor(f"{self}: no tensor {kind} {name}")
        if shape is not None and tuple(entry.shape) != tuple(shape):
            raise ValueError(f"{self}: tensor {kind} {name} has shape {tuple(entry.shape)}, "
                             f"the model needs {tuple(shape)}")
        box = _full_box(box, entry.shape)
        out = torch.empty(extent(box), dtype=dtype or entry.dtype)
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
        return self._entries.get((kind, name))

    def _fill(self, entry: Any, box: list[tuple[int, int]], out: torch.Tensor) -> None:
        raise NotImplementedError


class DictSource(WeightSource):
    """Tensors in memory: ``{name: tensor}``, or ``{"model": {name: t}, "optim":
    {"name.exp_avg": t, ...}}`` as ``threefold.weights.checkpoint.load_checkpoint`` returns them.
    ``bytes_read`` counts the bytes copied out, as if they came from a file."""

    def __init__(self, tensors: Mapping[str, Any]):
        self.bytes_read = 0
        model = tensors.get("model")
        if isinstance(model, Mapping):
            self._entries = {("model", n): t for n, t in model.items()}
            for key, t in tensors.get("optim", {}).items():
                name, kind = key.rsplit(".", 1)
                self._entries[(kind, name)] = t
        else:
            self._entries = {("model", n): t for n, t in tensors.items()}

    def _fill(self, entry: torch.Tensor, box, out: torch.Tensor) -> None:
        region = entry[box_index(box, [0] * len(box))]
        out.copy_(region)
        self.bytes_read += region.numel() * entry.element_size()

