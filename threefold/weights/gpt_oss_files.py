"""GPT-OSS's files <-> the shared experts' layout (``threefold.model.experts``), read by
region. In memory every mixture of experts holds ``mlp.gate`` (the router, here with a bias)
and ``mlp.experts.gate_up_proj`` (E, 2f, h) with each expert's gate rows before its up rows,
``down_proj`` (E, h, f), and GPT-OSS's biases ``gate_up_proj_bias`` (E, 2f, the same row
order) and ``down_proj_bias`` (E, h). GPT-OSS's files hold instead:

- the router as ``mlp.router.weight`` / ``mlp.router.bias``;
- as transformers saves them, ``gate_up_proj`` (E, h, 2f), gate and up alternating along the
  last dimension (gate j at column 2j, up j at 2j + 1), ``gate_up_proj_bias`` (E, 2f) in that
  order, and ``down_proj`` (E, f, h): each the transpose of what is computed;
- as published, ``gate_up_proj`` and ``down_proj`` in MXFP4 (``threefold.weights.mxfp4``):
  ``*_blocks`` / ``*_scales`` of the computed orientation (E, rows, cols), gate_up's rows
  alternating gate and up.

Each file tensor becomes one logical tensor whose region is read from the file's: a box of
experts reads those experts' rows only (a rank under expert parallelism reads its experts'
blocks and scales, nothing else). Export writes transformers' unquantised layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from threefold.weights.hf_config import HFError
from threefold.weights.mxfp4 import BLOCK, dequantise

EXPERTS = "mlp.experts."


def file_rows(r0: int, r1: int, f: int, interleaved: bool) -> torch.Tensor:
    """The file rows of logical rows [r0, r1): gate row r at 2r, up row f + j at 2j + 1 when
    ``interleaved``, else the same rows."""
    r = torch.arange(r0, r1)
    if not interleaved:
        return r
    return torch.where(r < f, 2 * r, 2 * (r - f) + 1)


@dataclass
class ExpertFileTensor:
    """A logical expert tensor (E, rows[, cols]) held by a file tensor in another layout:
    ``transposed`` (the file's last two dimensions swapped), rows ``interleaved`` (gate and
    up alternating: ``f`` gate rows), or in MXFP4 (``scales_key`` set: ``key`` names the
    blocks)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    path: object
    key: str
    f: int = 0
    interleaved: bool = False
    transposed: bool = False
    scales_key: str = ""

    def fill(self, src, box, out: torch.Tensor) -> None:
        """``out`` = logical region ``box``, expert by expert (one expert's region in memory
        at a time, with its file rows between the first and the last the box needs)."""
        (e0, e1), (r0, r1), *cols = box
        rows = file_rows(r0, r1, self.f, self.interleaved)
        lo, hi = int(rows.min()), int(rows.max()) + 1
        for e in range(e0, e1):
            out[e - e0].copy_(self._region(src, e, lo, hi, cols)[rows - lo])

    def _region(self, src, e: int, lo: int, hi: int, cols) -> torch.Tensor:
        """Expert ``e``'s file rows [lo, hi) over the box's columns, in the logical
        orientation (rows first)."""
        if not cols:  # a bias (E, rows)
            return src.read_file(self.path, self.key, (e, slice(lo, hi)))
        c0, c1 = cols[0]
        if self.scales_key:
            g0, g1 = c0 // BLOCK, -(-c1 // BLOCK)
            blocks = src.read_file(self.path, self.key, (e, slice(lo, hi), slice(g0, g1)))
            scales = src.read_file(self.path, self.scales_key,
                                   (e, slice(lo, hi), slice(g0, g1)))
            return dequantise(blocks, scales)[:, c0 - g0 * BLOCK:c1 - g0 * BLOCK]
        if self.transposed:
            return src.read_file(self.path, self.key, (e, slice(c0, c1), slice(lo, hi))).t()
        return src.read_file(self.path, self.key, (e, slice(lo, hi), slice(c0, c1)))


def gpt_oss_entries(cfg, entries: dict, part_of) -> None:
    """Replace, in ``entries`` ({("model", name): entry}, an ``HFSource``'s), each layer's
    router and expert file tensors by the logical ones (``part_of(entry)``: the entry's file
    path, key, shape and dtype); a layer's tensors that are missing are left for the shape
    check to name."""
    h, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            router = entries.pop(("model", p + "mlp.router." + kind), None)
            if router is not None:
                entries["model", p + "mlp.gate." + kind] = router
        for proj, rows, cols in (("gate_up_proj", 2 * f, h), ("down_proj", h, f)):
            gate_up, name = proj == "gate_up_proj", p + EXPERTS + proj
            stored = entries.pop(("model", name), None)
            blocks = entries.pop(("model", name + "_blocks"), None)
            scales = entries.pop(("model", name + "_scales"), None)
            if stored is not None:
                path, key, _, dtype = part_of(stored)
                entries["model", name] = ExpertFileTensor(
                    (e, rows, cols), dtype, path, key, f, gate_up, transposed=True)
            elif blocks is not None or scales is not None:
                _check_mxfp4(name, part_of, blocks, scales, (e, rows, cols // BLOCK))
                path, key, _, _ = part_of(blocks)
                entries["model", name] = ExpertFileTensor(
                    (e, rows, cols), torch.bfloat16, path, key, f, gate_up,
                    scales_key=part_of(scales)[1])
            bias = entries.get(("model", name + "_bias"))
            if gate_up and bias is not None:
                path, key, shape, dtype = part_of(bias)
                entries["model", name + "_bias"] = ExpertFileTensor(
                    tuple(shape), dtype, path, key, f, interleaved=True)


def _check_mxfp4(name: str, part_of, blocks, scales, groups: tuple[int, ...]) -> None:
    """HFError naming the MXFP4 tensor of ``name`` that is missing or misshapen (blocks
    (E, rows, cols / 32, 16), scales (E, rows, cols / 32))."""
    for kind, entry, shape in (("_blocks", blocks, (*groups, BLOCK // 2)),
                               ("_scales", scales, groups)):
        if entry is None:
            raise HFError(f"tensor {name}{kind} is missing (MXFP4 experts need blocks and "
                          "scales)")
        path, _, got, _ = part_of(entry)
        if tuple(got) != shape:
            raise HFError(f"{path}: tensor {name}{kind} has shape {tuple(got)}, the config "
                          f"needs {shape}")


def interleave(t: torch.Tensor) -> torch.Tensor:
    """(E, 2f, ·) gate rows then up rows -> (E, 2f, ·) alternating (gate 0, up 0, gate 1...)."""
    e, rows = t.shape[:2]
    halves = t.reshape(e, 2, rows // 2, *t.shape[2:])
    return halves.transpose(1, 2).reshape(t.shape)


def gpt_oss_file_tensors(source, name: str, rest: str) -> list | None:
    """The file tensors (name, shape, reader) GPT-OSS's transformers model saves for the
    logical tensor ``name`` (``rest``: its name within its block), or None where the file
    holds it as it is."""
    p = name[:len(name) - len(rest)]
    if rest in ("mlp.gate.weight", "mlp.gate.bias"):
        return [(p + "mlp.router." + rest.rsplit(".", 1)[1], source.shape(name),
                 lambda: source.read(name))]
    if rest == EXPERTS + "gate_up_proj":
        e, rows, h = source.shape(name)
        return [(name, (e, h, rows), lambda: interleave(source.read(name)).transpose(1, 2))]
    if rest == EXPERTS + "gate_up_proj_bias":
        return [(name, source.shape(name), lambda: interleave(source.read(name)))]
    if rest == EXPERTS + "down_proj":
        e, h, f = source.shape(name)
        return [(name, (e, f, h), lambda: source.read(name).transpose(1, 2))]
    return None
