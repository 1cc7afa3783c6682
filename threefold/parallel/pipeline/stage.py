"""Cut the plain model into pipeline stages.

With ``S = p·v`` virtual stages (``v`` model chunks per rank, Megatron's interleaved layout,
Narayanan et al. 2021 §2.2.2) the L transformer blocks are split into S contiguous runs, each
of at least one block; the embedding goes with the first run, the final norm and the LM head
with the last. Virtual stage ``s`` lives on rank ``s % p`` as its chunk ``s // p``, so chunk
``c`` of rank ``r`` is stage ``c·p + r``.

A chunk is a ``CausalLM`` holding only its own modules (the same module objects as
the model it was cut from): ``model.embed_tokens``, ``model.norm`` and ``lm_head`` are None
where the chunk does not own them (the model then skips that step and takes hidden states as
input), and ``model.layers`` keeps the blocks under their global indices, so every parameter
keeps its Hugging Face name (``model.layers.5.mlp.up_proj.weight`` on whichever rank holds
block 5). Initialisation by name (``init_weights(seed)``) therefore gives a chunk built on the
meta device exactly the values the whole model would have.

Balance: the runs minimise the largest per-stage cost, measured either in parameters (memory)
or in training FLOPs per token (time; PaLM's count, arXiv 2204.02311 App. B: 6 per matmul
weight, plus 12·H·Q·T for attention; the embedding lookup costs no FLOPs, the head 6·V·h).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from threefold.config import ModelConfig
from threefold.model.head_loss import LMHead
from threefold.model.decoder import CausalLM, family_class
from threefold.model.mtp import is_mtp
from threefold.model.moe import SparseMoeBlock
from threefold.schedules.actions import rank_stage
from threefold.schedules.balance import partition, runs_of, split_counts
from threefold.parallel.placement import place

BALANCES = ("params", "flops")


class StageLayers(nn.ModuleList):
    """The blocks of one chunk, registered under their global indices (``"4"``, ``"5"``) so
    parameter names match the whole model's. Iterates in order like a ModuleList; integer
    indexing is positional (``layers[0]`` is the chunk's first block)."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for i, layer in sorted(layers.items()):
            self.add_module(str(i), layer)

    @property
    def layer_ids(self) -> list[int]:
        """Global indices of the blocks held, in order."""
        return [int(name) for name, _ in self.named_children()]

    def __getitem__(self, idx):
        """Positional access (an int or a slice), whatever the global indices are."""
        layers = list(self.children())
        return nn.ModuleList(layers[idx]) if isinstance(idx, slice) else layers[idx]


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def _routed_weights(layer: nn.Module) -> int:
    """Weights of a mixture of experts' router and of the k experts each token is routed to:
    3-D tensors, not nn.Linear layers, yet most of an MoE block's FLOPs (DeepSeek-V3's 8
    routed experts are 8x its shared expert), so a FLOPs balance that left them out would
    take a dense first block for about two MoE blocks."""
    moe = getattr(layer, "mlp", None)
    if not isinstance(moe, SparseMoeBlock):
        return 0
    ex = moe.experts
    per_expert = ex.gate_up_proj.shape[1:].numel() + ex.down_proj.shape[1:].numel()
    return moe.gate.weight.numel() + moe.top_k * per_expert


def stage_costs(model: CausalLM, balance: str = "params",
                seq_len: int | None = None) -> tuple[list[float], float, float]:
    """(cost of each block, extra cost of the first stage, extra cost of the last stage),
    counted on the model's own modules (which may be on the meta device).

    ``params``: weights (the embedding's on the first stage; the final norm's and the head's
    on the last). ``flops``: training FLOPs per token, 6 per matmul weight plus 6·T per
    query and value feature (12·H·Q·T when they are as wide) for attention at sequence length
    ``seq_len`` (default ``cfg.max_position_embeddings``); the
    embedding is a lookup (0), the head 6·V·h."""
    if balance not in BALANCES:
        raise ValueError(f"pipeline balance must be one of {', '.join(BALANCES)}, got "
                         f"{balance!r}")
    inner = model.model
    main, mtp = inner.main_layers(), [m for m in inner.layers if is_mtp(m)]
    if balance == "params":
        count = lambda m: float(sum(q.numel() for q in m.parameters()))
        # the multi-token-prediction modules sit on the last stage, with the head (and,
        # when the embedding is elsewhere, a copy of it)
        return ([count(layer) for layer in main], count(inner.embed_tokens),
                count(inner.norm) + (0.0 if model.cfg.tie_word_embeddings
                                     else count(model.lm_head))
                + sum(map(count, mtp)) + (count(inner.embed_tokens) if mtp else 0.0))
    t = seq_len or model.cfg.max_position_embeddings
    flops = [6.0 * (_linear_weights(layer) + _routed_weights(layer))
             + 6.0 * layer.self_attn.score_features() * t
             for layer in inner.layers]
    head = 6.0 * model.lm_head.weight.numel()
    return flops[:len(main)], 0.0, head * (1 + len(mtp)) + sum(flops[len(main):])


def stage_layers(model: CausalLM, n_stages: int, balance: str = "params",
                 seq_len: int | None = None) -> list[range]:
    """The blocks of each virtual stage: balanced by ``balance`` "params" or "flops" (see
    ``stage_costs``), or split as ``parallel.pipeline_split`` says ("uniform", or explicit
    counts such as "7,9,9,7"; see balance.py)."""
    n, d = model.cfg.num_hidden_layers, model.cfg.num_nextn_predict_layers
    if balance not in BALANCES:  # uniform or explicit counts: no costs needed
        runs = runs_of(split_counts(balance, [0.0] * n, n_stages))
    else:
        layers, first, last = stage_costs(model, balance, seq_len)
        runs = partition(layers, n_stages, first, last)
    # the multi-token-prediction modules (blocks n.. n+d-1) join the last stage
    return runs[:-1] + [range(runs[-1].start, n + d)] if d else runs


def _shell(cfg: ModelConfig) -> CausalLM:
    """A CausalLM whose modules the caller replaces. Built for a minimal shape (one
    block, few-element weights) and then given the real configuration: nothing of size is
    allocated, and the constructor is the model's own. (Building it on the meta device would
    do the same, but meta initialisation imports torch's compiler stack, seconds per process.)"""
    tiny = dataclasses.replace(cfg, vocab_size=1, hidden_size=2, intermediate_size=1,
                               num_hidden_layers=1, num_attention_heads=1,
                               num_key_value_heads=1, tie_word_embeddings=False,
                               num_nextn_predict_layers=0)
    # the class of the whole model's family (the minimal shape is not asked which it meets)
    cls = family_class(cfg)
    with torch.random.fork_rng(devices=[]):  # leave the caller's random stream as it was
        shell = cls.__new__(cls)
        shell.__init__(tiny)
    shell.cfg = cfg
    return shell


def build_chunk(model: CausalLM, layers: range, first: bool, last: bool,
                stage: int | None = None, tied_replica: bool = False) -> CausalLM:
    """A CausalLM made of ``model``'s own modules: the blocks in ``layers``, the
    embedding if ``first``, the final norm and head if ``last`` (None otherwise), and the
    RoPE module; ``pipeline_stage`` records the virtual stage. ``tied_replica`` (a tied head
    on another rank than the embedding) gives the head its own weight, a copy of the
    embedding's (see ``embedding_replica``)."""
    chunk = _shell(model.cfg)
    chunk.model.embed_tokens = model.model.embed_tokens if first else None
    chunk.model.layers = StageLayers({i: model.model.layers[i] for i in layers})
    chunk.model.norm = model.model.norm if last else None
    chunk.lm_head = model.lm_head if last else None
    if last and tied_replica:
        head = model.lm_head
        chunk.lm_head = LMHead(head.in_features, head.out_features,
                               device=head.weight.device, dtype=head.weight.dtype)
        chunk.lm_head.shard, chunk.lm_head.chunk = head.shard, head.chunk
        chunk.lm_head.weight.requires_grad_(head.weight.requires_grad)  # frozen under LoRA
        with torch.no_grad():
            if not head.weight.is_meta:
                chunk.lm_head.weight.copy_(head.weight)
        # counted in the norm and saved by the first stage; its values are the embedding's
        place(chunk.lm_head.weight, tied_replica=True, source="model.embed_tokens.weight")
    # no weights; one buffer for all chunks (and the embedding's scale, which the shell's
    # minimal width would get wrong)
    if last and not first and any(map(is_mtp, chunk.model.layers)):
        chunk.model.mtp_embed = _embedding_copy(model)
    chunk.model.rotary, chunk.model.rotary_local = model.model.rotary, model.model.rotary_local
    chunk.model.embed_scale = model.model.embed_scale
    chunk.pipeline_stage = stage
    return chunk


def _embedding_copy(model: CausalLM) -> nn.Embedding:
    """The last stage's copy of the embedding for the multi-token-prediction modules (which
    embed the tokens ahead there, as DeepSeek-V3's last pipeline rank does): a replica of the
    first stage's, kept equal to it as a tied head's copy is (its gradient summed with the
    embedding's, counted and saved by the first stage)."""
    embed = model.model.embed_tokens
    copy = nn.Embedding(embed.num_embeddings, embed.embedding_dim, device=embed.weight.device,
                        dtype=embed.weight.dtype)
    copy.weight.requires_grad_(embed.weight.requires_grad)
    with torch.no_grad():
        if not embed.weight.is_meta:
            copy.weight.copy_(embed.weight)
    place(copy.weight, tied_replica=True, source="model.embed_tokens.weight")
    return copy


def split_model(model: CausalLM, p: int, v: int = 1, pp_rank: int = 0,
                balance: str = "params", seq_len: int | None = None,
                vshape: bool = False) -> list[CausalLM]:
    """This rank's chunks of ``model`` for ``p`` pipeline ranks with ``v`` chunks each:
    chunk ``c`` is virtual stage ``c·p + pp_rank`` (Megatron's interleaved assignment), or in
    a V (``vshape``: ZB-V, DualPipeV) chunk 1 is stage ``2p - 1 - pp_rank``. Works
    on a materialised model or on one still on the meta device (then ``to_empty`` and
    ``init_weights(seed)`` each chunk). Modules of other ranks are not referenced, so they are
    freed once the caller drops ``model``.

    Refuses (ConfigError) fewer blocks than ``p·v``."""
    for label, value in (("pp", p), ("vpp", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"split_model: {label} must be an integer >= 1, got {value!r}")
    if not 0 <= pp_rank < p:
        raise ValueError(f"split_model: pp_rank must be in [0, {p}), got {pp_rank}")
    if isinstance(model.model.layers, StageLayers):
        raise ValueError("split_model: this model is already a pipeline chunk; split the whole "
                         "model")
    n = p * v
    # A tied head on another rank than the embedding (any p > 1: the first stage is on rank 0,
    # the last on rank p-1) holds its own copy, as Megatron's embedding group does: both start
    # equal, their gradients are summed between the two ranks each step (the training layout
    # does it, see ``embedding_replica``), so identical AdamW updates keep them equal. In a V
    # both ends are on rank 0, in two chunks whose backwards run apart: one weight would get
    # two accumulations per micro-batch, which gradient buckets and ZeRO units count as one;
    # the copy keeps each chunk's parameters its own, and the sum is local (no message).
    replica = p > 1 and model.cfg.tie_word_embeddings
    runs = stage_layers(model, n, balance, seq_len)
    return [build_chunk(model, runs[s], first=s == 0, last=s == n - 1, stage=s,
                        tied_replica=replica)
            for s in (rank_stage(pp_rank, c, p, vshape) for c in range(v))]


def embedding_replica(model: CausalLM) -> torch.nn.Parameter | None:
    """The copy of the embedding a pipeline rank holds without the embedding itself
    (``split_model``): a tied LM head's weight, or the multi-token-prediction modules' copy
    (``model.mtp_embed``; the rule book refuses both at once), else None. Its gradient is
    summed with the embedding's on the first stage; it is counted once in the gradient norm
    and left out of checkpoints (it is the embedding, which the first stage saves)."""
    if model.model.embed_tokens is not None:
        return None
    if model.cfg.tie_word_embeddings and model.lm_head is not None:
        return model.lm_head.weight
    return model.model.mtp_embed.weight if model.model.mtp_embed is not None else None


def rank_model(chunks: list[CausalLM]) -> CausalLM:
    """One module over all of a rank's chunks (shared modules, HF names), for what wants a
    single model: the engines (optimiser, gradient sync, ZeRO units), tensor parallelism and
    checkpoints. Only the chunks are run; calling this module's forward would run the
    chunks' blocks back to back, which is not the model."""
    if len(chunks) == 1:
        return chunks[0]
    merged = _shell(chunks[0].cfg)
    merged.model.embed_tokens = chunks[0].model.embed_tokens
    merged.model.layers = StageLayers({i: layer for c in chunks
                                       for i, layer in zip(c.model.layers.layer_ids,
                                                           c.model.layers)})
    merged.model.norm = chunks[-1].model.norm
    merged.model.mtp_embed = chunks[-1].model.mtp_embed
    merged.lm_head = chunks[-1].lm_head
    merged.model.rotary, merged.model.rotary_local = chunks[0].model.rotary, \
        chunks[0].model.rotary_local
    merged.model.embed_scale = chunks[0].model.embed_scale
    merged.pipeline_stage = None
    return merged
