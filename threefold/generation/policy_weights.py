"""The policy's current weights as a Hugging Face checkpoint names them, streamed tensor by
tensor from a training engine, for a rollout engine's weight sync.

The engine hands its weights over a group at a time (``weight_groups``: one group where every
rank holds them whole; under ZeRO-3 one unit, gathered only while it is read), so the training
side never holds the whole model at once beyond what its layout already does. Each group is
renamed and reshaped as a checkpoint file holds it (``threefold.weights.hf.hub_tensors``: a
mixture of experts' fused tensors become per-expert ones, Phi-3's separate projections are
joined), and a LoRA run's adapters are merged into their base weights first
(W + scale · B · A), so the engine serves exactly the policy being trained.
"""

from __future__ import annotations

from typing import Iterator

import torch

from threefold.config import ModelConfig
from threefold.model.lora import LoRALinear
from threefold.weights import DictSource
from threefold.weights.hf import hub_tensors

_A, _B = ".lora_A.weight", ".lora_B.weight"


def policy_weights(engine, cfg: ModelConfig, untied_head: bool = False
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, fp32 tensor) of every weight of ``engine``'s model (``cfg``: its
    resolved shape), adapters merged. With ``untied_head`` a tied model's head is sent as
    ``lm_head.weight`` too (a receiver built untied: ``untied_config``). Collective under
    ZeRO-3: every rank must iterate it to the end, in step."""
    scales = {name: m.lora_scale for name, m in engine.model.named_modules()
              if isinstance(m, LoRALinear)}
    for group in engine.weight_groups():
        group = merged(group, scales)
        names = list(group)
        if cfg.tie_word_embeddings and "lm_head.weight" in names:
            names.remove("lm_head.weight")  # a checkpoint stores a tied head once
        for name, _shape, read in hub_tensors(DictSource(group), cfg, names):
            t = read()
            yield name, t
            if untied_head and cfg.tie_word_embeddings and name == "model.embed_tokens.weight":
                yield "lm_head.weight", t


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
