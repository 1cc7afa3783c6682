"""Sparse mixture-of-experts feed-forward (Mixtral-style), its router losses and their log.

A block's MLP becomes ``SparseMoeBlock``: a router ``gate`` (a bias-free linear map to one
logit per expert), softmax over the experts in fp32, the top-k probabilities renormalised to
sum to one, and each token's output the weighted sum of its k experts' SwiGLU outputs
(Jiang et al., "Mixtral of Experts", arXiv 2401.04088; Shazeer et al., arXiv 1701.06538).

Parameter names and layouts are those of transformers' ``MixtralForCausalLM`` (5.x), so a
state dict moves between the two unchanged: ``mlp.gate.weight`` (E, h);
``mlp.experts.gate_up_proj`` (E, 2f, h), each expert's gate rows then its up rows;
``mlp.experts.down_proj`` (E, h, f). Storing the experts as two 3-D tensors also means an
expert that no token picked still gets a (zero) gradient slice, so every engine sees the
same set of gradients every step.

Routing is dropless (no capacity factor: every token reaches its k experts). The k·N
(token, expert) assignments are sorted by expert (a stable argsort), ``torch.bincount`` gives
each expert's contiguous slice, each expert runs one matmul pair on its own tokens, and the
weighted rows are added back to their tokens (``index_add_``): compute is k/E of the dense
all-experts product.

How a rank runs its local experts on those grouped rows (``model.moe_impl``):

- ``grouped`` (default): two ``torch._grouped_mm`` calls over all rows at once, the group
  boundaries given as int32 offsets (the cumulative counts), straight on the stored (E, ·, ·)
  tensors (a transposed view: no copy, the gradient lands on the same parameters);
- ``loop``: one matmul pair per expert that got rows, the reference, and the fallback wherever
  ``grouped_mm_unfit`` names a reason (dtype, widths, device; see there).

Both give the same values and gradients (fp32 to rounding: tests/test_moe_grouped.py) and keep
the same tensors for backward, grouped also its offsets (4 bytes per local expert), which the
planner counts (``threefold.plan.memory.grouped_experts_run``).

Router losses, from per-layer statistics each block records in its forward
(``SparseMoeBlock.router_stats``, taken with ``take_router_stats``):

- load balancing (Fedus et al., Switch Transformer, arXiv 2101.03961, eqs. 4-6; Mixtral's
  ``router_aux_loss_coef``): E · Σ_i f_i · P_i, where f_i is the number of top-k assignments to
  expert i over all layers and tokens divided by (layers × tokens) and P_i the mean router
  probability of expert i over the same rows. Layers are pooled before the product, as
  transformers' ``load_balancing_loss_func`` does; perfectly balanced routing gives k.
- router z-loss (Zoph et al., ST-MoE, arXiv 2202.08906, eq. 5): the mean over layers and
  tokens of logsumexp(router logits)², which keeps the logits small (bf16-safe).

This module imports torch, the config and the kernels only (it sits beside
``threefold.model.decoder``), and the plain-number width rule from ``threefold.families.shapes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.model.kernels import matmul_dtype, swiglu
from threefold.families.shapes import grouped_widths_unfit


@dataclass
class RouterStats:
    """One block's routing in one forward: per-expert probability sums (fp32, differentiable),
    per-expert assignment counts (int64), the sum of logsumexp(logits)² over tokens
    (differentiable) and the number of tokens routed."""

    prob_sum: torch.Tensor
    counts: torch.Tensor
    z_sum: torch.Tensor
    tokens: int


def route(logits: torch.Tensor, top_k: int, normalise: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> (probabilities (N, E) fp32, top-k weights (N, k) fp32 renormalised
    to sum to one, top-k expert ids (N, k)): softmax first, then top-k, then renormalise (the
    Mixtral order; softmax over only the k chosen logits is the same numbers). Without
    ``normalise`` the k weights are the softmax values themselves (Qwen2-MoE's
    ``norm_topk_prob`` false)."""
    probs = F.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, experts


def route_grouped(logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int,
                  top_groups: int, normalise: bool, scaling: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (arXiv 2412.19437 §2.1.2): scores sigmoid(logits) in fp32; the
    choice adds the load-balancing ``bias`` to them, keeps the ``top_groups`` of ``groups``
    expert groups whose two best biased scores sum highest, and takes the top-k there; each
    chosen expert weighs its unbiased score, renormalised over the k (``normalise``), times
    ``scaling``. Returns (scores normalised per token, the router losses' P; weights;
    expert ids)."""
    scores = torch.sigmoid(logits.float())
    pick = scores + bias
    n, e = pick.shape
    best = pick.view(n, groups, e // groups).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(best).scatter_(1, best.topk(top_groups, dim=-1).indices, 1.0)
    keep = keep.bool()[:, :, None].expand(n, groups, e // groups).reshape(n, e)
    experts = pick.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return scores / scores.sum(-1, keepdim=True), weights * scaling, experts


class TopKRouter(nn.Module):
    """The router: logits = x · weightᵀ, one per expert (HF's ``mlp.gate``). DeepSeek-V3's
    (``moe_router`` sigmoid_grouped) computes them in fp32 and holds the load-balancing bias
    ``e_score_correction_bias`` (a buffer, checkpointed: it moves outside the optimiser,
    ``threefold.moe_balance``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_local_experts, cfg.hidden_size))
        self.fp32 = cfg.moe_router == "sigmoid_grouped"
        if self.fp32:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(cfg.num_local_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, h) -> logits (N, E)."""
        if self.fp32:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight)


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
        gate, up = _ContiguousGrad.apply(gate_up).chunk(2, dim=-1)
        y = torch._grouped_mm(swiglu(gate, up), self.down_proj.to(dtype).transpose(1, 2),
                              offs=offs)
        return _ContiguousGrad.apply(y)

    def compute_loop(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``compute`` one expert at a time (the reference)."""
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                r = rows[start:start + n]
                gate, up = F.linear(r, self.gate_up_proj[e]).chunk(2, dim=-1)
                outs.append(F.linear(swiglu(gate, up), self.down_proj[e]))
                start += n
        if not outs:  # no rows at all: a zero that still reaches both tensors
            return rows.new_zeros(rows.shape) + 0.0 * (self.gate_up_proj.sum()
                                                       + self.down_proj.sum())
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


class SharedExpert(nn.Module):
    """A SwiGLU MLP every token goes through (Qwen2-MoE's ``mlp.shared_expert``)."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Top-k routed experts in place of a block's MLP (HF's ``MixtralSparseMoeBlock``), with
    ``shared_expert_intermediate_size`` also a shared expert whose output, scaled by
    sigmoid(x · ``shared_expert_gate``), is added (HF's ``Qwen2MoeSparseMoeBlock``).

    Each forward leaves its ``RouterStats`` in ``router_stats`` for the trainer's router
    losses (``take_router_stats``); a later forward replaces them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_local_experts, cfg.num_experts_per_tok
        self.normalise = cfg.norm_topk_prob
        self.grouped = (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) \
            if cfg.moe_router == "sigmoid_grouped" else None
        self.gate = TopKRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = self.shared_expert_gate = self.shared_experts = None
        fs = cfg.shared_expert_intermediate_size
        if fs and cfg.shared_expert_gate:  # Qwen2-MoE's names
            self.shared_expert = SharedExpert(cfg.hidden_size, fs)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        elif fs:  # DeepSeek's: ungated
            self.shared_experts = SharedExpert(cfg.hidden_size, fs)
        self.router_stats: RouterStats | None = None
        self.load: torch.Tensor | None = None  # this step's tokens per expert (grouped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        if self.grouped:
            probs, weights, experts = route_grouped(
                logits, self.gate.e_score_correction_bias, self.top_k, *self.grouped[:2],
                self.normalise, self.grouped[2])
        else:
            probs, weights, experts = route(logits, self.top_k, self.normalise)
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        self.router_stats = RouterStats(probs.sum(0), counts,
                                        torch.logsumexp(logits.float(), -1).pow(2).sum(),
                                        x.shape[0])
        y = self.experts(x, experts, weights, counts)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(shape)


@torch.no_grad()
def balance_routers(blocks: list[SparseMoeBlock], sum_over_data, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437 §2.1.2), after each
    optimiser step: every grouped router's bias (``blocks``: their MoE blocks) moves by
    ``rate`` toward its under-loaded experts, bias += rate · sign(mean load − load), the loads
    being the step's tokens per expert summed over every data-parallel rank
    (``sum_over_data``: one all-reduce for the rank's blocks together), so every replica
    moves its bias alike."""
    if not blocks:
        return
    loads = torch.stack([m.load if m.load is not None
                         else torch.zeros(m.num_experts, dtype=torch.int64,
                                          device=m.gate.weight.device) for m in blocks])
    loads = sum_over_data(loads.double().cpu())
    for m, load in zip(blocks, loads):
        bias = m.gate.e_score_correction_bias
        bias += rate * torch.sign(load.mean() - load).to(bias.device, bias.dtype)
        m.load = None


# --------------------------------------------------------------------------------------------
# Router losses
# --------------------------------------------------------------------------------------------
def take_router_stats(model: nn.Module) -> list[RouterStats]:
    """The ``RouterStats`` every MoE block of ``model`` recorded in its last forward, in layer
    order; each block's slot is cleared (so a stale forward is never counted twice)."""
    out = []
    for m in model.modules():
        if isinstance(m, SparseMoeBlock) and m.router_stats is not None:
            out.append(m.router_stats)
            if m.grouped:  # the step's loads, for the routing bias (``balance_routers``):
                # taken once per training forward, never from a recomputed one
                c = m.router_stats.counts
                m.load = c if m.load is None else m.load + c
            m.router_stats = None
    return out


def load_balancing_loss(stats: list[RouterStats], num_experts: int,
                        per_layer: bool = False, layers: int | None = None) -> torch.Tensor:
    """E · Σ_i f_i · P_i with f and P pooled over the layers' rows (see the module doc);
    gradients reach the router through P only (f is a count). ``per_layer``: each layer's
    E · Σ_i f_li · P_li, summed and divided by ``layers`` (default: those in ``stats``; a
    pipeline stage passes the model's, so the stages' terms add up to the mean)."""
    if per_layer:
        each = [num_experts * (s.counts.float() / s.tokens * s.prob_sum / s.tokens).sum()
                for s in stats]
        return torch.stack(each).sum() / (layers or len(stats))
    rows = sum(s.tokens for s in stats)
    f = torch.stack([s.counts for s in stats]).sum(0).float() / rows
    p = torch.stack([s.prob_sum for s in stats]).sum(0) / rows
    return num_experts * (f * p).sum()


def router_z_loss(stats: list[RouterStats], layers: int | None = None) -> torch.Tensor:
    """Mean over layers and tokens of logsumexp(router logits)² (over ``layers`` layers
    when ``stats`` holds only some of them: a pipeline stage's)."""
    z = torch.stack([s.z_sum for s in stats]).sum()
    if layers is None:
        return z / sum(s.tokens for s in stats)
    return z / (layers * stats[0].tokens)


class RouterLog:
    """The router terms of a run's optimiser steps, micro-batch by micro-batch (``restart``
    begins a step): what a mixture of experts adds to a step, on the model's side (a dense
    model's adds and logs nothing). Given the rank's ``model``, ``balance`` also moves the
    grouped routers' biases after each optimiser step.

    Gradient accumulation: the aux and z losses are statistics of the tokens one forward
    routes, so each micro-batch's are computed on its own (as Megatron and transformers do per
    forward) and weighted by its share of the step's loss units: ``add`` returns
    coef · loss · count, which the loop divides by the global count like the summed token
    loss. One micro-batch therefore adds exactly coef · loss of its batch; several add the
    count-weighted mean of theirs (not the loss of the pooled batch, whose f_i would need every
    micro-batch's routing before the first backward)."""

    def __init__(self, cfg: ModelConfig, model: nn.Module | None = None):
        self.cfg = cfg
        self.routed = bool(cfg.num_local_experts)
        self.biased = [m for m in (model.modules() if model is not None else ())  # found once
                       if isinstance(m, SparseMoeBlock) and m.grouped]
        self.restart()

    def restart(self) -> None:
        """Begin a step: no terms, no assignments yet."""
        self.aux = self.z = 0.0
        self.counts = torch.zeros(self.cfg.num_local_experts, dtype=torch.int64)

    def add(self, model: nn.Module, count, part: bool = False) -> torch.Tensor | None:
        """Take the blocks' statistics of the forward just run; return the router term to add
        to that micro-batch's summed loss (``count``: its loss units, e.g. target tokens, or
        a function giving them, called only if something routed: no device read for a dense
        model), or None (a dense model, a chunk without MoE layers). ``part``: ``model``
        holds some of the layers (a pipeline chunk: per-layer terms, shares of the model's)."""
        stats = take_router_stats(model) if self.routed else None  # (dense: no walk)
        if not stats:
            return None
        count = count() if callable(count) else count
        layers = self.cfg.num_hidden_layers if part else None
        aux = load_balancing_loss(stats, self.cfg.num_local_experts,
                                  self.cfg.router_aux_loss_per_layer, layers)
        z = router_z_loss(stats, layers)
        self.aux += float(aux.detach()) * count
        self.z += float(z.detach()) * count
        self.counts += torch.stack([s.counts for s in stats]).sum(0).cpu()
        return (self.cfg.router_aux_loss_coef * aux + self.cfg.router_z_loss_coef * z) * count

    def balance(self, sum_over_data) -> None:
        """After the optimiser step: the grouped routers' bias update (``balance_routers``)."""
        balance_routers(self.biased, sum_over_data, self.cfg.router_bias_update_rate)

    def metrics(self, n: int, sum_scalar=float, sum_vector=lambda v: v) -> dict:
        """For metrics.jsonl: the count-weighted mean aux and z losses (unscaled by their
        coefficients), the step's assignments per expert summed over layers and micro-batches
        (they sum to tokens × k × layers), and their imbalance max / mean (1 = even). ``n`` is
        the global count; ``sum_scalar`` / ``sum_vector`` sum a rank's figures over the
        data-parallel ranks (identity in one process); {} for a dense model (no sums)."""
        if not self.routed:
            return {}
        counts = sum_vector(self.counts.clone()).tolist()
        mean = sum(counts) / len(counts)
        aux, z = (torch.tensor(x, dtype=torch.float64) for x in (self.aux, self.z))
        return {"router_aux_loss": sum_scalar(aux) / n, "router_z_loss": sum_scalar(z) / n,
                "expert_counts": counts, "expert_imbalance": max(counts) / mean if mean else None}

