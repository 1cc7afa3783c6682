"""Sharded start-up: fill a rank's own tensors, one logical tensor at a time.

The model is built on the meta device and parallelised there (pipeline split, tensor and
expert slicing only change shapes and placements, ``threefold.parallel.placement``); the
engine then allocates what the rank keeps — whole local tensors, or only its ZeRO shards —
and fills it from a *source* of logical tensors:

- ``InitSource``: the initial values, drawn per logical tensor by name exactly as
  ``CausalLM.init_weights`` draws them (``threefold.model.decoder.initial_weight``), so a
  rank's slice equals the same slice of a model initialised whole, on every layout;
- a checkpoint or a Hugging Face folder (``threefold.weights``): only the region the rank
  owns is read from the file.

At any moment a rank holds what it owns plus one logical tensor (the one being drawn; a file
read holds only the region). ``fill_local`` fills a whole local tensor, ``fill_flat`` the
part of a ZeRO unit's flat buffer that a shard covers.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from threefold.config import ModelConfig
from threefold.model.decoder import initial_weight
from threefold.weights.checkpoint_verify import Piece
from threefold.parallel.placement import logical_box, logical_shape, row_span, source_name
from threefold.weights import MissingTensor


class InitSource:
    """The initial value of every logical tensor (``threefold.model.decoder.initial_weight``: seeded
    by (seed, name)), read by region like a file. The last tensor drawn is kept, so the
    regions of one tensor that several calls ask for cost one draw."""

    def __init__(self, cfg: ModelConfig, seed: int, device: torch.device | str = "cpu"):
        self.cfg, self.seed, self.device = cfg, seed, torch.device(device)
        self.bytes_read = 0
        self._last: tuple[str, torch.Tensor] | None = None

    def read(self, name: str, box: Sequence[tuple[int, int]] = (), kind: str = "model",
             dtype: torch.dtype = torch.float32, shape: tuple[int, ...] | None = None
             ) -> torch.Tensor:
        """Region ``box`` of the initial ``name`` (of logical ``shape``: drawn whole, as
        ``threefold.weights`` sources read, by the same signature); ``MissingTensor`` for
        optimiser state (a fresh run has none)."""
        if kind != "model":
            raise MissingTensor(f"initial values: no {kind} of {name}")
        if self._last is None or self._last[0] != name:
            self._last = None  # drop the previous tensor before drawing the next
            self._last = (name, initial_weight(name, shape, self.cfg, self.seed, self.device))
        whole = self._last[1]
        return whole[tuple(slice(a, b) for a, b in box)].to(dtype, copy=True)

    def release(self) -> None:
        """Forget the kept tensor."""
        self._last = None


class ChainSource:
    """``primary`` for every tensor it holds; ``fallback`` for ``extra`` names (a task's new
    weights, such as a reward model's score head on a pretrained decoder) and for LoRA
    adapters (new on any pretrained model)."""

    def __init__(self, primary, fallback, extra: Sequence[str] = ()):
        self.primary, self.fallback, self.extra = primary, fallback, set(extra)

    @property
    def bytes_read(self) -> int:
        """Bytes the primary source read from files."""
        return self.primary.bytes_read

    def read(self, name, box=(), kind="model", dtype=torch.float32, shape=None):
        """From the fallback for the extra names, else from the primary."""
        new = name in self.extra or name.endswith(("lora_A.weight", "lora_B.weight"))
        return (self.fallback if new else self.primary).read(name, box, kind, dtype,
                                                             shape=shape)

    def release(self) -> None:
        """Forget what either keeps."""
        self.primary.release()
        self.fallback.release()


def read_rows(source, name: str, p: torch.Tensor, rows: tuple[int, int], kind: str = "model",
              dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Rows ``rows`` (dim-0 positions) of ``p``'s local tensor as the source holds them: the
    region of the logical tensor ``p`` is cut from, zero where ``p`` is padding (the last
    vocabulary slice). None if the source has no such optimiser state (a fresh run, a
    converted checkpoint); ``MissingTensor`` (a ``KeyError``) naming the tensor if it lacks a
    weight. Only a missing tensor is caught: any other error of the source passes through."""
    dtype = dtype or p.dtype
    src, dst = logical_box(p, rows)
    try:
        region = source.read(source_name(name, p), src, kind, dtype, shape=logical_shape(p))
    except MissingTensor:
        if kind == "model":
            raise MissingTensor(f"tensor {source_name(name, p)}") from None
        return None
    shape = (rows[1] - rows[0], *p.shape[1:]) if p.dim() else ()
    if not p.dim():
        return region.reshape(())
    if region.shape == shape:
        return region
    out = torch.zeros(shape, dtype=dtype)
    idx = tuple(slice(a - rows[0], b - rows[0]) if d == 0 else slice(a, b)
                for d, (a, b) in enumerate(dst))
    out[idx] = region
    return out


@torch.no_grad()
def fill_local(source, name: str, p: torch.Tensor, out: torch.Tensor, kind: str = "model"
               ) -> bool:
    """``out`` (``p``'s shape) ← this rank's tensor of ``name`` from ``source``; whether the
    source had it (only optimiser state may be missing: see ``read_rows``)."""
    rows = (0, p.shape[0] if p.dim() else 1)
    local = read_rows(source, name, p, rows, kind, out.dtype)
    if local is None:
        return False
    out.copy_(local.reshape(out.shape))
    return True


@torch.no_grad()
def fill_flat(source, named: list[tuple[str, nn.Parameter]], offsets: list[int],
              out: torch.Tensor, lo: int, kind: str = "model") -> bool:
    """``out`` ← elements [lo, lo + len(out)) of the flat buffer that concatenates ``named``
    (each parameter at its offset; padding past the last stays as it is). Reads, per
    parameter, only the rows the range covers. Whether the source had every tensor needed
    (only optimiser state may be missing: see ``read_rows``)."""
    hi = lo + out.numel()
    found = True
    for (name, p), off in zip(named, offsets):
        a, b = max(lo, off), min(hi, off + p.numel())
        if b <= a:
            continue
        r0, r1 = row_span(tuple(p.shape), a - off, b - off)
        rows = read_rows(source, name, p, (r0, r1), kind, out.dtype)
        if rows is None:
            found = False
            continue
        first = r0 * (math.prod(p.shape[1:]) if p.dim() else 1)
        flat = rows.reshape(-1)
        out[a - lo:b - lo].copy_(flat[a - off - first:b - off - first])
    return found


def hollow_parameters(model: nn.Module, device: torch.device) -> None:
    """Replace every meta parameter of ``model`` by a parameter on ``device`` of the same
    shape that holds no storage yet (a one-element tensor expanded to the shape), keeping its
    placement and its ties (a weight shared by two modules stays one parameter). The engines
    then give each the storage the layout keeps (``p.data = ...``), which a meta parameter
    cannot take."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                q = nn.Parameter(torch.empty(1, dtype=p.dtype, device=device).expand(p.shape),
                                 requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)  # the placement record and any other marks
                new[id(p)] = q
            module._parameters[key] = new[id(p)]


def is_hollow(p: torch.Tensor) -> bool:
    """Whether ``p`` was made by ``hollow_parameters`` and has no values yet."""
    return p.dim() > 0 and p.numel() > 1 and all(s == 0 for s in p.stride())


@torch.no_grad()
def materialize_parameters(model: nn.Module, source, device: torch.device) -> None:
    """Give every meta parameter of ``model`` storage on ``device`` and its values from
    ``source``, one tensor at a time (``hollow_parameters`` first). A tied weight is filled
    once."""
    hollow_parameters(model, device)
    for name, p in model.named_parameters():  # tied weights appear once
        if not is_hollow(p):
            continue
        p.data = torch.empty(p.shape, dtype=p.dtype, device=device)
        fill_local(source, name, p, p.data)
    source.release()


def materialize_buffers(model: nn.Module, device: torch.device, source=None) -> None:
    """Buffers still on the meta device get storage; those a checkpoint keeps (persistent:
    DeepSeek's routing bias, which moves outside the optimiser) are read from ``source``,
    whole on every rank; modules that can recompute theirs do (the RoPE frequencies)."""
    for module in model.modules():
        bufs = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        for n in bufs:
            b = getattr(module, n)
            setattr(module, n, torch.empty(b.shape, dtype=b.dtype, device=device))
        if bufs and hasattr(module, "reset_parameters") and not any(
                True for _ in module.parameters(recurse=False)):
            module.reset_parameters()
    if source is not None:
        load_buffers(model, source)


@torch.no_grad()
def load_buffers(model: nn.Module, source) -> None:
    """The persistent buffers of ``model`` (state a checkpoint keeps that is not a
    parameter: DeepSeek's routing bias) read whole from ``source``."""
    for name, b in model.named_buffers():
        if name.rsplit(".", 1)[-1] not in _non_persistent(model, name):
            b.copy_(source.read(name, [(0, k) for k in b.shape], shape=tuple(b.shape)))


def buffer_pieces(model: nn.Module) -> list[Piece]:
    """The persistent buffers of ``model`` as checkpoint pieces (whole tensors, "model"
    kind): state that is not a parameter but must survive a restart (DeepSeek's routing
    bias)."""
    return [Piece(n, "model", b.detach().reshape(-1), 0, b.numel(), tuple(b.shape))
            for n, b in model.named_buffers()
            if n.rsplit(".", 1)[-1] not in _non_persistent(model, n)]


def _non_persistent(model: nn.Module, name: str) -> set[str]:
    """The non-persistent buffer names of the module holding buffer ``name``."""
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    return owner._non_persistent_buffers_set
