"""A mixture of experts' experts: ``Experts`` (every local expert's SwiGLU over the rows routed
to it, stored as transformers' two 3-D tensors) and ``SharedExpert`` (one expert every token goes
through). Routing, dispatch and the router losses are ``threefold.model.moe``'s.

How a rank runs its local experts on those grouped rows (``model.moe_impl``):

- ``grouped`` (default): two ``torch._grouped_mm`` calls over all rows at once, the group
  boundaries given as int32 offsets (the cumulative counts), straight on the stored (E, ·, ·)
  tensors (a transposed view: no copy, the gradient lands on the same parameters);
- ``loop``: one matmul pair per expert that got rows, the reference, and the fallback wherever
  ``grouped_mm_unfit`` names a reason (dtype, widths, device; see there).

Both give the same values and gradients (fp32 to rounding: tests/test_moe_grouped.py) and keep
the same tensors for backward, grouped also its offsets (4 bytes per local expert), which the
planner counts (``threefold.plan.moe_memory.grouped_experts_run``).

This module imports torch, the config and the kernels only, and the plain-number width rule
from ``threefold.families.shapes``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.model.kernels import clamped_swiglu, matmul_dtype, swiglu
from threefold.families.shapes import grouped_widths_unfit


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_unfit(device: torch.device, dtype: torch.dtype, hidden: int, ffn: int,
                     capability: tuple[int, int] | None = None,
                     compiling: bool = False) -> str | None:
    """Why ``torch._grouped_mm`` should not run these experts (None: it should), from what
    torch 2.13 checks (aten/src/ATen/native/GroupedMMUtils.h, ``_grouped_mm_validate_inputs``,
    the same checks on CPU and CUDA) and where CUDA runs its own kernel (GroupedBlas.cpp,
    ``_grouped_mm_cuda``):

    - dtype float32, bfloat16 or float16 (anything else is refused);
    - each operand has one unit stride and its other (leading) stride a multiple of 16 bytes.
      The operands here, forward and backward, are rows (·, h), the first product (·, 2f), the
      SwiGLU output (·, f) and the weights' transposed views, whose leading strides are h and
      f: so h and f must be multiples of 16 / element size (4 in fp32, 8 in bf16/fp16;
      tiny-moe's f 344 = 8 · 43 passes). Group offsets need no alignment: a group starts
      ``offset`` leading strides into its operand, so it stays 16-byte aligned; an empty group
      is allowed (its weight gradient is zero). The multiple-of-16-elements rule some guides
      quote is ``_scaled_grouped_mm``'s (FP8), not this op's;
    - on CUDA, torch's grouped kernel (CUTLASS) runs only for bf16 on compute capability 9.x or
      10.x; elsewhere torch falls back to a per-group matmul loop after copying the offsets to
      the host, no better than ours, so the loop runs there (``capability``: the device's,
      read from it when None);
    - under torch.compile (``compiling``) the op's meta function checks CUDA's rule on every
      device (bf16 only), so a traced fp32 block would fail to compile: the loop runs there."""
    if dtype not in GROUPED_MM_DTYPES:
        return f"dtype {dtype} (grouped_mm takes float32, bfloat16, float16)"
    unfit = grouped_widths_unfit(hidden, ffn, dtype.itemsize)
    if unfit:
        return unfit
    if compiling and dtype != torch.bfloat16:
        return f"dtype {dtype} under torch.compile (grouped_mm's meta function takes bf16 only)"
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return f"dtype {dtype} on CUDA (torch's grouped kernel is bf16 only)"
        major = (capability or torch.cuda.get_device_capability(device))[0]
        if major not in (9, 10):
            return f"compute capability {major}.x (torch's grouped kernel needs 9.x or 10.x)"
    elif device.type != "cpu":
        return f"device {device.type} (grouped_mm checked on cpu and cuda only)"
    return None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on its gradient made contiguous: ``_grouped_mm``'s
    backward refuses a gradient with a zero stride (\"Invalid strides/sizes\", e.g. what
    ``y.sum()`` sends back), so any loss may follow the grouped product."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


class Experts(nn.Module):
    """E SwiGLU MLPs stored as two 3-D tensors (HF's ``mlp.experts``): expert e computes
    down_e(silu(gate_e x) · up_e x), with [gate_e; up_e] = gate_up_proj[e]. ``impl`` is
    ``model.moe_impl`` (see the module doc)."""

    impl = "grouped"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, f))
        self.impl = cfg.moe_impl
        self.gate_up_proj_bias = self.down_proj_bias = None
        self.act = swiglu
        add_gpt_oss_pieces(self, cfg)

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows grouped by expert (``counts`` (E,) rows each, in order) -> each row through its
        expert, in the same order. Here every expert is local (one host sync per block, for
        the slices); expert parallelism's ``ExpertParallelExperts``
        (``threefold.parallel.transforms.expert``) moves the rows to the ranks holding their experts."""
        return self.compute(rows, counts.tolist())

    def compute(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by this module's experts (``counts[e]`` rows for expert e, in order)
        -> each row through its expert's SwiGLU. Every expert tensor gets a gradient, zero
        where no row went (also when no row went anywhere), so every engine sees the same
        gradients each step. Grouped (``impl``) where ``grouped_mm_unfit`` finds no reason
        against it, else the loop."""
        if self.impl == "grouped" and rows.shape[0] and grouped_mm_unfit(
                rows.device, matmul_dtype(rows), self.down_proj.shape[1],
                self.down_proj.shape[2], compiling=torch.compiler.is_compiling()) is None:
            return self.compute_grouped(rows, counts)
        return self.compute_loop(rows, counts)

    def compute_grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``compute`` as two grouped matmuls over every row (at least one), expert e's rows
        ending at offset counts[0] + ... + counts[e]. Saves for backward what the loop does:
        the rows (cast), the first product (its gate and up halves share it), the SwiGLU
        output, and under autocast the cast expert weights."""
        dtype = matmul_dtype(rows)
        offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        offs = offs.to(rows.device, non_blocking=True)
        r = rows.to(dtype)
        gate_up = torch._grouped_mm(r, self.gate_up_proj.to(dtype).transpose(1, 2), offs=offs)
        gate_up = with_bias(gate_up, self.gate_up_proj_bias, counts)
        gate, up = _ContiguousGrad.apply(gate_up).chunk(2, dim=-1)
        y = torch._grouped_mm(self.act(gate, up), self.down_proj.to(dtype).transpose(1, 2),
                              offs=offs)
        return with_bias(_ContiguousGrad.apply(y), self.down_proj_bias, counts)

    def compute_loop(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``compute`` one expert at a time (the reference)."""
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                r = rows[start:start + n]
                b1, b2 = (None if b is None else b[e]
                          for b in (self.gate_up_proj_bias, self.down_proj_bias))
                gate, up = F.linear(r, self.gate_up_proj[e], b1).chunk(2, dim=-1)
                outs.append(F.linear(self.act(gate, up), self.down_proj[e], b2))
                start += n
        if not outs:  # no rows at all: a zero that still reaches every tensor
            return rows.new_zeros(rows.shape) + 0.0 * sum(p.sum() for p in self.parameters())
        return torch.cat(outs)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """x (N, h), each token's k expert ids and weights (N, k), assignments per expert (E,)
        -> (N, h): Σ_j weights[:, j] · expert_{experts[:, j]}(x)."""
        k = experts.shape[-1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        token = order // k                          # the token of each grouped assignment
        y = self.dispatch(x[token], counts)
        y = y * weights.reshape(-1)[order, None]  # fp32 weights, as HF
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


# --------------------------------------------------------------------------------------------
# GPT-OSS's experts: biases on both projections, the clamped SwiGLU
# --------------------------------------------------------------------------------------------
def add_gpt_oss_pieces(experts: Experts, cfg: ModelConfig) -> None:
    """Give ``experts`` what ``cfg`` asks beyond plain SwiGLU experts: biases (E, 2f) and
    (E, h) registered after the weights (``moe_bias``; in the weights' row order, gate rows
    then up rows), and the activation (``moe_activation``)."""
    e, h, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    if cfg.moe_bias:
        experts.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * f))
        experts.down_proj_bias = nn.Parameter(torch.empty(e, h))
    if cfg.moe_activation == "clamped_swiglu":
        experts.act = functools.partial(clamped_swiglu, alpha=cfg.swiglu_alpha,
                                        limit=cfg.swiglu_limit)


class _GroupRows(torch.autograd.Function):
    """Row e of ``bias`` repeated ``counts[e]`` times (one per row routed to expert e); the
    backward sums each group's gradient rows. Saves no tensor."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ctx.counts = counts
        repeats = torch.tensor(counts, device=bias.device)
        return bias.repeat_interleave(repeats, dim=0, output_size=sum(counts))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        counts = torch.tensor(ctx.counts, device=g.device)
        ids = torch.repeat_interleave(torch.arange(len(ctx.counts), device=g.device), counts)
        return g.new_zeros((len(ctx.counts), g.shape[-1])).index_add_(0, ids, g), None


def with_bias(y: torch.Tensor, bias: torch.Tensor | None, counts: list[int]) -> torch.Tensor:
    """Grouped rows ``y`` (``counts[e]`` rows of expert e, in order) plus their expert's row of
    ``bias`` (None: ``y`` as it is)."""
    if bias is None:
        return y
    return y + _GroupRows.apply(bias.to(y.dtype), counts)


class SharedExpert(nn.Module):
    """A SwiGLU MLP every token goes through (Qwen2-MoE's ``mlp.shared_expert``)."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
