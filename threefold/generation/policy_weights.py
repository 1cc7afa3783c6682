"""The policy's current weights as a Hugging Face checkpoint names them, streamed tensor by
tensor from a training engine, for a rollout engine's weight sync.

The engine hands its weights over a group at a time (``weight_groups``: one group where every
rank holds them whole; under ZeRO-3 one unit, gathered only while it is read), so the training
side never holds the whole model at once beyond what its layout already does. Each group is
renamed and reshaped as a checkpoint file holds it (``threefold.weights.hf.hub_tensors``: a
mixture of experts' fused tensors become per-expert ones, Phi-3's separate projections are
joined), and a LoRA run's adapters are merged into their base weights first
(W + scale · B · A), so the engine serves exactly the policy being trained.

Under tensor parallelism each rank holds slices of the sliced weights (their placement
records say which dimension: ``threefold.parallel.placement``). A rollout engine takes whole
tensors (vLLM's loaders cut their own shard from them), so the slices are all-gathered over
the tp axis, counted there, one layer at a time: a rank holds one layer's weights whole
beyond its own slices, never the model's.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch

from threefold.config import ModelConfig
from threefold.model.lora import LoRALinear
from threefold.parallel.engines.engine import unique_named_parameters
from threefold.parallel.placement import Placement, placement
from threefold.weights import DictSource
from threefold.weights.hf import hub_tensors

_A, _B = ".lora_A.weight", ".lora_B.weight"


def policy_weights(engine, cfg: ModelConfig, untied_head: bool = False, comm=None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, fp32 tensor) of every weight of ``engine``'s model (``cfg``: its
    resolved shape), adapters merged. With ``untied_head`` a tied model's head is sent as
    ``lm_head.weight`` too (a receiver built untied: ``untied_config``). ``comm``: the run's
    counted communication, whose tp axis gathers tensor-parallel slices (module doc).
    Collective under ZeRO-3 and tensor parallelism: every rank must iterate it to the end,
    in step."""
    scales = {name: m.lora_scale for name, m in engine.model.named_modules()
              if isinstance(m, LoRALinear)}
    for group in _whole_groups(engine, comm):
        group = merged(group, scales)
        names = list(group)
        if cfg.tie_word_embeddings and "lm_head.weight" in names:
            names.remove("lm_head.weight")  # a checkpoint stores a tied head once
        for name, _shape, read in hub_tensors(DictSource(group), cfg, names):
            t = read()
            yield name, t
            if untied_head and cfg.tie_word_embeddings and name == "model.embed_tokens.weight":
                yield "lm_head.weight", t


def _whole_groups(engine, comm) -> Iterator[dict[str, torch.Tensor]]:
    """The engine's weight groups with every tensor whole: under tensor parallelism each
    group split by layer and its slices gathered over tp (module doc)."""
    tp = comm.size("tp") if comm is not None else 1
    if tp == 1:
        yield from engine.weight_groups()
        return
    # (every name is one of the model's parameters: a miss is a KeyError, never a slice sent
    # as if it were whole)
    places = {n: placement(p) for n, p in unique_named_parameters(engine.model)}
    for group in engine.weight_groups():
        for part in by_layer(group):
            yield {n: whole(t, places[n], comm) for n, t in part.items()}


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def by_layer(group: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """``group`` split into one dict per decoder layer, in the order the layers first appear,
    and one of whatever belongs to no layer (embedding, final norm, head), first."""
    parts: dict[str, dict[str, torch.Tensor]] = {"": {}}
    for name, t in group.items():
        m = _LAYER.search(name)
        parts.setdefault(m.group(1) if m else "", {})[name] = t
    return [p for p in parts.values() if p]


def whole(t: torch.Tensor, rec: Placement, comm) -> torch.Tensor:
    """The logical tensor of this rank's slice ``t`` (``rec``: its placement), all-gathered
    over tp and cut to the logical size (a vocabulary padded to a multiple of tp loses its
    padding); ``t`` itself when tp does not slice it."""
    if rec.tp_dim is None or rec.tp_count == 1:
        return t
    flat = torch.empty(rec.tp_count * t.numel(), dtype=t.dtype, device=t.device)
    comm.all_gather(flat, t.contiguous().view(-1), "tp")
    slices = flat.view(rec.tp_count, *t.shape).unbind(0)
    full = torch.cat(slices, dim=rec.tp_dim)
    return full.narrow(rec.tp_dim, 0, rec.tp_full) if rec.tp_full is not None else full


def untied_config(hf: dict) -> dict:
    """A config.json with the head untied: vLLM's CPU backend packs the head's weight when it
    builds the model, and an in-place reload of a tied model refreshes only the embedding,
    leaving the head at its build-time values; an untied head that is sent the embedding's
    values computes the same logits."""
    return {**hf, "tie_word_embeddings": False}


def merged(group: dict[str, torch.Tensor], scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """``group`` with every LoRA layer's adapters folded into its weight (both must be in the
    group: the rule book keeps ZeRO-3, whose units split them, from LoRA with an engine)."""
    out = {}
    for name, t in group.items():
        if name.endswith((_A, _B)):
            continue
        layer = name.removesuffix(".weight")
        if layer + _A in group:
            a, b = group[layer + _A].float(), group[layer + _B].float()
            t = t.float() + scales[layer] * (b @ a)
        out[name] = t
    return out
