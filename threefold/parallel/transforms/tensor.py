"""Megatron-style tensor parallelism (Shoeybi et al., arXiv 1909.08053 §3), with sequence
parallelism (Korthikanti et al., arXiv 2205.05198 §4), applied to the plain model from outside.

The plan is data, the model family's (``threefold.families``: module name pattern -> style).
Column-parallel layers keep a slice of output rows (q/k/v by heads, gate/up by the SwiGLU
width, the LM head by vocabulary); row-parallel layers keep a slice of input columns (o,
down). Megatron's conjugate operators
wrap each sub-layer:

- ``f``: identity forward, all-reduce of the gradient backward — at the input of attention,
  the MLP and the LM head;
- ``g``: all-reduce forward, identity backward — at the output of o_proj and down_proj (and
  of the vocab-parallel embedding).

So each transformer layer does 2 all-reduces of b·s·h in forward and 2 in backward. With
sequence parallelism the activations between sub-layers are split on the sequence: ``f``
becomes an all-gather (reduce-scatter backward) and ``g`` a reduce-scatter (all-gather
backward) — the same bytes in ring terms, but norms, residuals and their activations are held
1/t per rank. Norm weights then see only their rank's tokens, so their gradients are
all-reduced over tp.

GQA: key/value heads are split over tp when tp divides their number. When there are fewer KV
heads than tp (tp a multiple of them), k_proj/v_proj stay whole on every rank (replicated);
each rank uses the rows of the one KV head its query heads attend with, and the weight
gradient is all-reduced over tp (zeros outside the rows a rank used), so it is complete.

The embedding is vocab-parallel and the loss a vocab-parallel cross-entropy that never
gathers the full logits: a max, a sum of exponentials and the target logit are all-reduced
(3·b·s elements). A vocabulary not divisible by tp is padded; padded logits are masked out.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ConfigError
from threefold.model.head_loss import LMHead, VocabShard
from threefold.model.lora import LoRALinear
from threefold.model.mtp import is_mtp
from threefold.model.decoder import CausalLM, DecoderModel
from threefold.model.norm import RMSNorm
from threefold.families import tp_plan
from threefold.parallel.placement import place
from threefold.parallel.transforms.tp_ops import (_CopyToTP, _GatherSeq, _ReduceFromTP,
                                       _ReduceScatterSeq, copy_to_tp)
from threefold.parallel.transforms.tp_overlap import (COLUMNS, ROWS, GatheredColumnLinear,
    OverlappedRowLinear, fuse_columns, overlappable, sublayer_kind)
from threefold.accounting.batches import overlap_chunks
from threefold.parallel.transforms.wrap import become, wrap

AXIS = "tp"



# --------------------------------------------------------------------------------------------
# Applying the plan
# --------------------------------------------------------------------------------------------
def _shard_rows(weight: torch.Tensor, rank: int, t: int, pad_to: int | None = None):
    rows = weight.shape[0]
    total = pad_to or rows
    n = total // t
    out = torch.zeros((n, *weight.shape[1:]), dtype=weight.dtype, device=weight.device)
    lo, hi = rank * n, min((rank + 1) * n, rows)
    if hi > lo:
        out[:hi - lo] = weight[lo:hi]
    return out


def _set_weight(module: nn.Module, new: torch.Tensor, shard_dim: int | None, full: int,
                rank: int = 0, t: int = 1, attr: str = "weight") -> None:
    p = getattr(module, attr)  # (attr: "weight" or "bias", both always present here)
    p.data = new.contiguous()
    if shard_dim is not None:  # None: replicated over tp (the default placement)
        place(p, tp_dim=shard_dim, tp_full=full, tp_index=rank, tp_count=t)


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding one tp rank's rows of the vocabulary (``apply_tensor_parallel``
    turns the model's embedding into one, in place): ids outside its rows give zeros, and the
    rows' sum over tp (a reduce-scatter on the sequence under sequence parallelism) is the
    whole embedding's output."""

    comm = None
    offset = rows = 0
    sequence_parallel = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embed ``ids``, summed over the tp ranks' vocabulary rows."""
        local = ids - self.offset
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(torch.where(outside, torch.zeros_like(local), local), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            return _ReduceScatterSeq.apply(out, self.comm)
        return _ReduceFromTP.apply(out, self.comm)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocabulary rows [{self.offset}, {self.offset + self.rows})"


class ReplicatedKVLinear(nn.Linear):
    """A k/v projection kept whole on every tp rank (fewer KV heads than tp): each rank uses
    the rows of the one KV head its query heads attend with; the weight's gradient is summed
    over tp (zeros outside the rows a rank used), so it is complete."""

    comm = None
    head_rows = slice(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's KV head of the projection."""
        bias = None if self.bias is None else _CopyToTP.apply(self.bias, self.comm)[self.head_rows]
        return F.linear(x, _CopyToTP.apply(self.weight, self.comm)[self.head_rows], bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows [{self.head_rows.start}, {self.head_rows.stop})"


class ReplicatedLinear(nn.Linear):
    """A projection every tp rank holds and computes whole (latent attention's q_a_proj and
    kv_a_proj_with_mqa: the latents each rank's heads expand): each rank's gradient comes
    from its own heads only, so the weight's is summed over tp."""

    comm = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole projection, its weight's gradient summed over tp."""
        return F.linear(x, _CopyToTP.apply(self.weight, self.comm), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, whole on every tp rank"


class RowParallelBiasLinear(nn.Linear):
    """A row-parallel projection with a bias (GPT-OSS's o_proj): the ranks' partial outputs
    are summed over tp, so the bias joins on tp rank 0 alone. The others add
    bias − bias.detach(), exactly 0, through which the output's gradient (the same on every
    rank: g's backward copies it) still reaches the bias, so every rank holds the whole
    gradient without a collective."""

    first = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the projection, the bias on the first rank."""
        bias = self.bias if self.first else self.bias - self.bias.detach()
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bias on tp rank 0"


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm over this rank's tokens (sequence parallelism), or over this rank's heads (a
    Qwen3 q/k norm): its weight's gradient is the sum over the tp ranks'."""

    comm = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise this rank's tokens."""
        return self.normalise(x, _CopyToTP.apply(self.weight, self.comm))


class ProjectionParallelRMSNorm(RMSNorm):
    """An RMSNorm over a whole q or k projection whose rows are split over tp (OLMo 2): each
    rank holds its heads' slice of the weight; the sum of squares is all-reduced over tp in
    forward and its gradient in backward, so every rank normalises by the whole row's rms."""

    comm = None
    full = 0  # the whole projection's width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise this rank's slice of each token's projection."""
        xf = x.float()
        squares = _CopyToTP.apply(_ReduceFromTP.apply(xf.pow(2).sum(-1, keepdim=True),
                                                      self.comm), self.comm)
        normed = xf * torch.rsqrt(squares / self.full + self.eps)
        if self.fp32_weight:  # (OLMo 2's: the weight multiplies in fp32, one rounding)
            return (normed * self.gain(self.weight)).to(x.dtype)
        return self.gain(self.weight) * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"rows of {self.full}, sum of squares all-reduced over tp"


class TensorParallelLoRALinear(LoRALinear):
    """A LoRA-adapted layer of a column- or row-parallel projection: the factor every rank
    holds whole (A of a column-parallel layer, B of a row-parallel one) has its gradient
    summed over tp, since each rank's part of the output uses it."""

    comm = None
    style = ""  # "column" or "row"

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A and B, the whole one through ``copy_to_tp``."""
        a, b = self.lora_A.weight, self.lora_B.weight
        if self.style == "column":
            return copy_to_tp(a, self.comm), b
        return a, copy_to_tp(b, self.comm)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.style}-parallel adapter"


class TensorParallelSublayer(nn.Module):
    """A sub-layer (attention, a dense MLP) whose projections tensor parallelism split:
    Megatron's ``f`` at its input (identity forward, the gradient all-reduced over tp; under
    sequence parallelism an all-gather of the sequence) and ``g`` at its output, which its
    row-parallel projection (o_proj, down_proj) makes (an all-reduce; under sequence
    parallelism a reduce-scatter). Composed over the sub-layer's own class
    (``threefold.parallel.transforms.wrap.wrap``). With ``tp_overlap`` chunks
    (``parallel.tp_overlap``, sequence parallelism only) the all-gather is fused with the column
    projections and the reduce-scatter with the row projection, chunk by chunk
    (``threefold.parallel.transforms.tp_overlap``).
    """

    comm = None
    sequence_parallel = False
    tp_overlap = 0  # chunks wanted per collective (0: the plain operators)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The sub-layer between its two conjugate operators."""
        if self.tp_overlap:
            # the column projections' outputs come with the gathered input; the row
            # projection (OverlappedRowLinear) returns its output reduce-scattered
            chunks = overlap_chunks(x.shape[1], self.tp_overlap)
            # (a traced step's records go to the communication layer's list: Comm.trace)
            x = fuse_columns(self, x, self.comm, chunks, self.comm.trace)
            return super().forward(x, *args, **kwargs)
        sp = self.sequence_parallel
        x = (_GatherSeq if sp else _CopyToTP).apply(x, self.comm)
        out = super().forward(x, *args, **kwargs)
        return (_ReduceScatterSeq if sp else _ReduceFromTP).apply(out, self.comm)

    def extra_repr(self) -> str:
        return (super().extra_repr() + (", " if super().extra_repr() else "")
                + ("f: all-gather, g: reduce-scatter" if self.sequence_parallel
                   else "f: identity, g: all-reduce") + " over tp")


class SequenceParallelDecoderModel(DecoderModel):
    """The decoder under sequence parallelism: each rank's blocks hold some of the tokens,
    so RoPE's positions are the whole sequence's (the caller's when given: the pipeline
    executor always passes them). Composed over the decoder's own class."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The decoder with the whole sequence's positions."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device) \
                .expand(input_ids.shape[0], -1)
        return super().forward(input_ids, position_ids, document_ids, **kwargs)


class VocabParallelHead(LMHead):
    """The LM head holding one tp rank's vocabulary rows: its input through ``f`` (an
    all-gather of the sequence under sequence parallelism), its loss the vocab-parallel
    cross-entropy (``threefold.model.head_loss``), its logits this rank's rows."""

    comm = None
    sequence_parallel = False

    def forward(self, h: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """This rank's rows of the head over the whole (gathered) hidden states."""
        h = (_GatherSeq if self.sequence_parallel else _CopyToTP).apply(h, self.comm)
        return super().forward(h, *args, **kwargs)

    def extra_repr(self) -> str:
        s = self.shard
        return f"{super().extra_repr()}, vocabulary rows from {s.offset} of {s.vocab}"


class TensorParallelCausalLM(CausalLM):
    """The model after tensor parallelism: its degree and whether activations between
    sub-layers are split on the sequence (generation reads both)."""

    def extra_repr(self) -> str:
        return f"tp={self.tp_size}" + (", sequence parallel" if self.sequence_parallel else "")


def _style(name: str, plan: dict[str, str]) -> str | None:
    for pattern, style in plan.items():
        if re.fullmatch(pattern, name):
            return style
    return None


def _shard_weights(model: CausalLM, comm, sp: bool) -> None:
    """Slice every weight of the plan to this rank's part (placements recorded)."""
    t, r = comm.size(AXIS), comm.rank(AXIS)
    cfg = model.cfg
    hd, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    vocab, vshard = cfg.vocab_size, math.ceil(cfg.vocab_size / t)
    plan = tp_plan(cfg)  # the family's, as data
    for name, module in list(model.named_modules()):
        style = _style(name, plan)
        if style is None or module is None:
            continue
        w = module.weight.detach()
        if style == "vocab_embedding":
            _set_weight(module, _shard_rows(w, r, t, vshard * t), 0, vocab, r, t)
            become(module, VocabParallelEmbedding, comm=comm, offset=r * vshard, rows=vshard,
                    sequence_parallel=sp)
        elif style == "vocab_column":
            if cfg.tie_word_embeddings and model.model.embed_tokens is not None:
                module.weight = model.model.embed_tokens.weight  # already vocab-sharded
            else:
                _set_weight(module, _shard_rows(w, r, t, vshard * t), 0, vocab, r, t)
        elif style == "column" and name.endswith(("k_proj", "v_proj")) and kv % t:
            kv_head = (r * (heads // t)) // (heads // kv)
            _set_weight(module, w.clone(), None, w.shape[0])
            for q in (module.weight, module.bias):
                if q is not None:
                    place(q, tp_grad_reduced=True)
            become(module, ReplicatedKVLinear, comm=comm,
                    head_rows=slice(kv_head * hd, (kv_head + 1) * hd))
        elif style == "column":
            _set_weight(module, _shard_rows(w, r, t), 0, w.shape[0], r, t)
            if module.bias is not None:  # (Qwen2's q/k/v biases: split like the rows)
                b = module.bias.detach()
                _set_weight(module, _shard_rows(b, r, t), 0, b.shape[0], r, t, "bias")
            _shard_adapter(module, "column", comm)
        elif style == "row":
            _set_weight(module, _shard_rows(w.t(), r, t).t(), 1, w.shape[1], r, t)
            if module.bias is not None:  # (GPT-OSS's o_proj)
                become(module, RowParallelBiasLinear, first=r == 0)
            _shard_adapter(module, "row", comm)


def _shard_adapter(module: nn.Module, style: str, comm) -> None:
    """A LoRA adapter split the way its layer is (``threefold.model.lora``): a column-parallel
    layer keeps its rows of B and a whole A, a row-parallel one its columns of A and a whole
    B; the whole factor's gradient is summed over tp (each rank sees part of it)."""
    if not hasattr(module, "lora_A"):
        return
    t, r = comm.size(AXIS), comm.rank(AXIS)
    a, b = module.lora_A, module.lora_B
    if style == "column":
        _set_weight(b, _shard_rows(b.weight.detach(), r, t), 0, b.weight.shape[0], r, t)
        place(a.weight, tp_grad_reduced=True)
    else:
        w = a.weight.detach()
        _set_weight(a, _shard_rows(w.t(), r, t).t(), 1, w.shape[1], r, t)
        place(b.weight, tp_grad_reduced=True)
    become(module, TensorParallelLoRALinear, comm=comm, style=style)


def _replicate_latents(attn: nn.Module, comm) -> list[RMSNorm]:
    """Latent attention under tp: its latent projections stay whole on every rank, their
    gradients summed over tp; returns its latent norms, which need the same."""
    for proj in (getattr(attn, "q_a_proj", None), attn.kv_a_proj_with_mqa):
        if proj is not None:
            become(proj, ReplicatedLinear, comm=comm)
            place(proj.weight, tp_grad_reduced=True)
    return [n for n in (getattr(attn, "q_a_layernorm", None), attn.kv_a_layernorm)
            if n is not None]


def _shard_projection_norms(attn: nn.Module, comm) -> None:
    """OLMo 2's q and k norms split by rows as their projections are (the KV heads split
    over tp: ``threefold.comm.mesh`` refuses a replicated k with such a norm)."""
    t, r = comm.size(AXIS), comm.rank(AXIS)
    for norm in (attn.q_norm, attn.k_norm):
        w = norm.weight.detach()
        _set_weight(norm, _shard_rows(w, r, t), 0, w.shape[0], r, t)
        become(norm, ProjectionParallelRMSNorm, comm=comm, full=w.shape[0])


def _overlap(sub: nn.Module, name: str, comm, chunks: int) -> None:
    """``sub``'s projections fused with its collectives in ``chunks`` (``parallel.tp_overlap``);
    a sub-layer whose projections are not plain Linears is refused before the first step."""
    why = overlappable(sub)
    if why:
        raise ConfigError(f"parallel.tp_overlap: {chunks} cannot overlap {name}: {why}; set "
                          "parallel.tp_overlap 0")
    kind = sublayer_kind(sub)
    for col in COLUMNS[kind]:
        become(getattr(sub, col), GatheredColumnLinear)
    become(getattr(sub, ROWS[kind]), OverlappedRowLinear, comm=comm, chunks=chunks)


def apply_tensor_parallel(model: CausalLM, comm, sequence_parallel: bool = False,
                          tp_overlap: int = 0):
    """Shard ``model`` in place over the "tp" axis of ``comm``, its sub-layers wrapped
    between the conjugate operators (``TensorParallelSublayer``). Returns the model; its head's loss
    is then vocab-parallel (``lm_head.shard``). ``tp_overlap`` >= 2 (with sequence parallelism)
    fuses each sub-layer's all-gather and reduce-scatter with its projections in that many chunks
    (``threefold.parallel.transforms.tp_overlap``). Weights are sliced from the full ones (or, on
    the meta device, only their shapes and placements change), so the sharded model computes exactly what the full one does."""
    sp = sequence_parallel
    overlap = tp_overlap if sp and tp_overlap >= 2 else 0
    _shard_weights(model, comm, sp)
    norms = [model.model.norm] if sp and model.model.norm is not None else []
    for i, layer in enumerate(model.model.layers):
        # a mixture of experts stays whole on every tp rank: its input and output are the
        # replicated residual stream, so it needs no operator (threefold.parallel.transforms.expert)
        dense = hasattr(layer.mlp, "down_proj")
        for sub in (layer.self_attn, *((layer.mlp,) if dense else ())):
            if overlap:
                _overlap(sub, f"block {i}'s {sublayer_kind(sub)}", comm, overlap)
            wrap(sub, TensorParallelSublayer, comm=comm, sequence_parallel=sp,
                 tp_overlap=overlap)
        if sp:
            norms += layer.residual_norms()
            if is_mtp(layer):  # its input projection sees this rank's tokens only
                become(layer.eh_proj, ReplicatedLinear, comm=comm)
                place(layer.eh_proj.weight, tp_grad_reduced=True)
        if hasattr(layer.self_attn, "kv_a_proj_with_mqa"):  # latent attention's latents
            norms += _replicate_latents(layer.self_attn, comm)
        sinks = getattr(layer.self_attn, "sinks", None)
        if sinks is not None:  # GPT-OSS: this rank's heads' sinks
            _set_weight(layer.self_attn, _shard_rows(sinks.detach(), comm.rank(AXIS),
                                                     comm.size(AXIS)),
                        0, sinks.shape[0], comm.rank(AXIS), comm.size(AXIS), "sinks")
        if layer.self_attn.qk_norm == "head":  # per-head norms over this rank's heads only
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        elif layer.self_attn.qk_norm == "projection":
            _shard_projection_norms(layer.self_attn, comm)
    for norm in norms:  # a pipeline stage may not hold the final norm
        become(norm, SequenceParallelRMSNorm, comm=comm)
        place(norm.weight, tp_grad_reduced=True)
    if sp:
        wrap(model.model, SequenceParallelDecoderModel)
    if model.lm_head is not None:
        rows = math.ceil(model.cfg.vocab_size / comm.size(AXIS))
        become(model.lm_head, VocabParallelHead, comm=comm, sequence_parallel=sp,
               shard=VocabShard(comm, AXIS, comm.rank(AXIS) * rows, model.cfg.vocab_size))
    # generation refuses sequence parallelism (its steps are 1 token)
    return wrap(model, TensorParallelCausalLM, tp_size=comm.size(AXIS), sequence_parallel=sp)


def gather_full(local: torch.Tensor, dim: int | None, full: int, comm) -> torch.Tensor:
    """A tensor split over tp along ``dim`` made whole again (vocabulary padding dropped)."""
    if dim is None or comm.size(AXIS) == 1:
        return local
    t = comm.size(AXIS)
    x = local.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] * t, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x, AXIS)
    return out[:full].movedim(0, dim).contiguous()
