"""The model families threefold computes, one spec each (``threefold.families.spec.Family``),
keyed by Hugging Face ``model_type``. ``config.json`` is read and written through the spec of
its ``model_type`` (``threefold.weights.hf_config``); a model's family is named by ``model.family``
(import sets it, presets carry it), never guessed from its fields. Adding a family whose
blocks exist is one spec file plus its test (docs/models.md).
"""

from __future__ import annotations

from threefold.config import MODEL_FAMILIES, ModelConfig
from threefold.families.deepseek_v3 import DEEPSEEK_V3
from threefold.families.gemma3 import GEMMA3
from threefold.families.gpt_oss import GPT_OSS
from threefold.families.llama import LLAMA
from threefold.families.mistral import MISTRAL
from threefold.families.mixtral import MIXTRAL
from threefold.families.olmo2 import OLMO2
from threefold.families.phi3 import PHI3
from threefold.families.qwen import QWEN2, QWEN3
from threefold.families.qwen_moe import QWEN2_MOE, QWEN3_MOE
from threefold.families.spec import LLAMA_TP_PLAN, Family, FamilyError, need

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    LLAMA, QWEN2, QWEN3, MIXTRAL, QWEN2_MOE, QWEN3_MOE, MISTRAL, OLMO2, GEMMA3, PHI3,
    DEEPSEEK_V3, GPT_OSS)}
# config names the families so that it can check model.family without importing this
if tuple(FAMILIES) != MODEL_FAMILIES:
    raise ImportError(f"threefold.config.MODEL_FAMILIES {MODEL_FAMILIES} must list the "
                      f"registered families {tuple(FAMILIES)}")

# Families that are known and refused by name (what each would need is in docs/models.md).
REFUSED = {"gemma2": "Gemma 2",
           "gemma3": "Gemma 3's multimodal model (its text_config, model_type gemma3_text, "
                     "is built: save the text model alone)",
           "granite": "Granite",
           "qwen3_next": "Qwen3-Next"}

__all__ = ["FAMILIES", "Family", "FamilyError", "family_for", "fused_files", "need",
           "spec_of", "tp_plan"]


def family_for(c: dict, where: str = "config.json") -> Family:
    """The spec of config.json ``c``'s ``model_type``; FamilyError naming it otherwise."""
    kind = c.get("model_type")
    if kind in FAMILIES:
        return FAMILIES[kind]
    what = f" ({REFUSED[kind]} is not built)" if kind in REFUSED else ""
    raise FamilyError(f"{where}: model_type={kind!r} is not supported{what}; threefold "
                      f"imports {', '.join(FAMILIES)}")


def spec_of(cfg: ModelConfig) -> Family:
    """The spec of ``cfg``'s family: the one ``model.family`` names, checked against the
    model (FamilyError naming the field that differs); unset (flags on a preset that names
    no family, or a checkpoint older than the field), the one registered family whose spec
    the fields meet, Llama when it does (a Mistral without a window is a Llama)."""
    if cfg.family:
        if cfg.family not in FAMILIES:
            raise FamilyError(f"model.family: unknown value '{cfg.family}'; threefold builds "
                              f"{', '.join(FAMILIES)}")
        spec = FAMILIES[cfg.family]
        why = spec.refusal(cfg)
        if why:
            raise FamilyError(f"{why}; set model.family to the model's family (one of "
                              f"{', '.join(FAMILIES)}) or the field to the family's value")
        return spec
    fits = [f for f in FAMILIES.values() if f.refusal(cfg) is None]
    plain = [f for f in fits if not f.fused]  # (a windowed Llama is a Mistral, not a Phi-3)
    if LLAMA in fits or len(plain) == 1:
        return LLAMA if LLAMA in fits else plain[0]
    if fits:
        raise FamilyError(f"model.family: unset, and the model fits "
                          f"{', '.join(f.model_type for f in fits)}; set model.family")
    # the nearest family of the same kind (dense, or experts): the first of them
    near = min(FAMILIES.values(), key=lambda f: (bool(cfg.num_local_experts) != f.experts,
                                                 f.distance(cfg)))
    raise FamilyError(f"{near.refusal(cfg)}; the model's fields fit no family (model.family "
                      f"is unset): change the field, or build the family")


def fused_files(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """File tensor -> the logical tensors it holds, in its row order, for every fused layer
    of ``cfg``'s family (Phi-3's ``model.layers.0.self_attn.qkv_proj.weight`` ->
    ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight`` of layer 0); empty for a family
    whose files hold threefold's layers as they are."""
    try:
        spec = spec_of(cfg)
    except FamilyError:  # a model of no family (it trains; only export needs one)
        return {}
    out = {}
    for fused, parts in spec.fused.items():
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            out[p + fused + ".weight"] = tuple(p + part + ".weight" for part in parts)
    return out


def tp_plan(cfg: ModelConfig) -> dict[str, str]:
    """Tensor parallelism's plan for ``cfg``: its family's (the shared plan for a model
    that names no family and fits none: such a model still trains, it only cannot export)."""
    try:
        return spec_of(cfg).tp_plan
    except FamilyError:
        return LLAMA_TP_PLAN
