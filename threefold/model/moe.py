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

How a rank runs its local experts (``model.moe_impl``: grouped or loop) is
``threefold.model.experts``'s.

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
from threefold.model.experts import Experts, SharedExpert
from threefold.model.mtp import take_mtp_losses


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
        # GPT-OSS's router has a bias (``moe_bias``)
        self.bias = nn.Parameter(torch.empty(cfg.num_local_experts)) if cfg.moe_bias else None
        self.fp32 = cfg.moe_router == "sigmoid_grouped"
        if self.fp32:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(cfg.num_local_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, h) -> logits (N, E)."""
        if self.fp32:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight, self.bias)


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


def pooled(stats: list[RouterStats], pool) -> list[RouterStats]:
    """Each layer's statistics over the whole sequences when this rank routes a share of
    their tokens (context parallelism): probability sums, z sums and counts summed by
    ``pool`` (``World.sequence_sum``: one all-reduce of (2E + 1)·layers fp32 over cp, whose
    backward sums the gradients too), so the router losses are those of every token, as in
    one process. Every cp rank routes as many tokens (1/share of the sequences' whole)."""
    e = stats[0].prob_sum.shape[0]
    flat = torch.cat([torch.cat([s.prob_sum.float(), s.z_sum.float().reshape(1),
                                 s.counts.float()]) for s in stats])
    total, share = pool(flat)
    out = []
    for s, row in zip(stats, total.view(len(stats), 2 * e + 1)):
        out.append(RouterStats(row[:e], row[e + 1:2 * e + 1].detach().round().long(), row[e],
                               round(s.tokens / share)))
    return out


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
    micro-batch's routing before the first backward).

    Multi-token prediction's losses (``threefold.model.mtp``) are the model's too: ``add``
    also takes the per-depth sums its modules recorded and adds λ/D times their total, a sum
    over tokens that the loop divides by the count as it does the token loss; where the
    task's objective is not the next tokens' (``next_token`` False: DPO, GRPO, a reward
    model) it takes and drops them."""

    def __init__(self, cfg: ModelConfig, model: nn.Module | None = None,
                 next_token: bool = True, pool=None):
        self.cfg, self.pool = cfg, pool  # pool: ``World.sequence_sum`` under cp, else None
        self.routed = bool(cfg.num_local_experts)
        self.depth = cfg.num_nextn_predict_layers
        self.next_token = next_token  # else the modules' losses are taken and dropped
        # the model's MoE blocks, its multi-token-prediction modules' included: what a
        # pipeline stage's per-layer terms are shares of
        self.moe_layers = (max(cfg.num_hidden_layers - cfg.first_k_dense_replace, 0)
                           + self.depth) if self.routed else 0
        self.biased = [m for m in (model.modules() if model is not None else ())  # found once
                       if isinstance(m, SparseMoeBlock) and m.grouped]
        self.restart()

    def restart(self) -> None:
        """Begin a step: no terms, no assignments yet."""
        self.aux = self.z = self.mtp = 0.0
        self.counts = torch.zeros(self.cfg.num_local_experts, dtype=torch.int64)

    def add(self, model: nn.Module, count, part: bool = False) -> torch.Tensor | None:
        """Take the blocks' statistics of the forward just run; return the router term to add
        to that micro-batch's summed loss (``count``: its loss units, e.g. target tokens, or
        a function giving them, called only if something routed: no device read for a dense
        model), or None (a dense model, a chunk without MoE layers). ``part``: ``model``
        holds some of the layers (a pipeline chunk: per-layer terms, shares of the model's)."""
        stats = take_router_stats(model) if self.routed else None  # (dense: no walk)
        depths = take_mtp_losses(model) if self.depth else None
        term = None
        if depths and self.next_token:
            total = torch.stack(depths).sum()
            self.mtp += float(total.detach())
            term = self.cfg.mtp_loss_weight / self.depth * total
        if not stats:
            return term
        count = count() if callable(count) else count
        layers = self.moe_layers if part else None
        whole = stats if self.pool is None else pooled(stats, self.pool)
        aux = load_balancing_loss(whole, self.cfg.num_local_experts,
                                  self.cfg.router_aux_loss_per_layer, layers)
        z = router_z_loss(whole, layers)
        self.aux += float(aux.detach()) * count
        self.z += float(z.detach()) * count
        self.counts += torch.stack([s.counts for s in stats]).sum(0).cpu()
        routed = (self.cfg.router_aux_loss_coef * aux + self.cfg.router_z_loss_coef * z) * count
        return routed if term is None else routed + term

    def balance(self, sum_over_data) -> None:
        """After the optimiser step: the grouped routers' bias update (``balance_routers``)."""
        balance_routers(self.biased, sum_over_data, self.cfg.router_bias_update_rate)

    def metrics(self, n: int, sum_scalar=float, sum_vector=lambda v: v) -> dict:
        """For metrics.jsonl: the count-weighted mean aux and z losses (unscaled by their
        coefficients), the step's assignments per expert summed over layers and micro-batches
        (they sum to tokens × k × layers), and their imbalance max / mean (1 = even). ``n`` is
        the global count; ``sum_scalar`` / ``sum_vector`` sum a rank's figures over the
        data-parallel ranks (identity in one process); {} for a dense model (no sums). With
        multi-token prediction, ``mtp_loss``: the depths' mean cross-entropy per target token
        (unweighted by λ)."""
        out = {}
        if self.depth and self.next_token:
            out["mtp_loss"] = sum_scalar(torch.tensor(self.mtp, dtype=torch.float64)) / n \
                / self.depth
        if not self.routed:
            return out
        counts = sum_vector(self.counts.clone()).tolist()
        mean = sum(counts) / len(counts)
        aux, z = (torch.tensor(x, dtype=torch.float64) for x in (self.aux, self.z))
        return {**out, "router_aux_loss": sum_scalar(aux) / n,
                "router_z_loss": sum_scalar(z) / n, "expert_counts": counts,
                "expert_imbalance": max(counts) / mean if mean else None}

