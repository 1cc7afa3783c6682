"""The model families threefold computes, one spec each (``threefold.models.spec.Family``),
keyed by Hugging Face ``model_type``. ``config.json`` is read and written through the spec of
its ``model_type`` (``threefold.hf_config``); a model's family is named by ``model.family``
(import sets it, presets carry it), never guessed from its fields. Adding a family whose
blocks exist is one spec file plus its test (docs/models.md).
"""

from __future__ import annotations

from threefold.config import MODEL_FAMILIES, ModelConfig
from threefold.models.gemma3 import GEMMA3
from threefold.models.llama import LLAMA
from threefold.models.mistral import MISTRAL
from threefold.models.mixtral import MIXTRAL
from threefold.models.olmo2 import OLMO2
from threefold.models.phi3 import FUSED as PHI3_FUSED
from threefold.models.phi3 import PHI3
from threefold.models.qwen import QWEN2, QWEN3
from threefold.models.qwen_moe import QWEN2_MOE, QWEN3_MOE
from threefold.models.spec import Family, FamilyError, need

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    LLAMA, QWEN2, QWEN3, MIXTRAL, QWEN2_MOE, QWEN3_MOE, MISTRAL, OLMO2, GEMMA3, PHI3)}
# config names the families so that it can check model.family without importing this
if tuple(FAMILIES) != MODEL_FAMILIES:
    raise ImportError(f"threefold.config.MODEL_FAMILIES {MODEL_FAMILIES} must list the "
                      f"registered families {tuple(FAMILIES)}")

# Families that are known and refused by name (what each would need is in docs/models.md).
REFUSED = {"gemma2": "Gemma 2",
           "gemma3": "Gemma 3's multimodal model (its text_config, model_type gemma3_text, "
                     "is built: save the text model alone)",
           "deepseek_v3": "DeepSeek-V3", "granite": "Granite",
           "gpt_oss": "GPT-OSS", "qwen3_next": "Qwen3-Next"}

# Families whose files fuse some of a block's layers (the spec's ``Family`` has no field for
# it yet): model_type -> {fused layer: threefold's layers in its row order}
FUSED_LAYERS: dict[str, dict[str, tuple[str, ...]]] = {"phi3": PHI3_FUSED}

__all__ = ["FAMILIES", "FUSED_LAYERS", "Family", "FamilyError", "family_for", "fused_files",
           "legacy_family", "need", "spec_of"]


def family_for(c: dict, where: str = "config.json") -> Family:
    """The spec of config.json ``c``'s ``model_type``; FamilyError naming it otherwise."""
    kind = c.get("model_type")
    if kind in FAMILIES:
        return FAMILIES[kind]
    what = f" ({REFUSED[kind]} is not built)" if kind in REFUSED else ""
    raise FamilyError(f"{where}: model_type={kind!r} is not supported{what}; threefold "
                      f"imports {', '.join(FAMILIES)}")


def spec_of(cfg: ModelConfig) -> Family:
    """The spec ``cfg.family`` names (a resolved config: the preset's when unset), checked
    against the model: ConfigError naming the field that differs from the family."""
    spec = FAMILIES[cfg.family or "llama"]
    why = spec.refusal(cfg)
    if why:
        raise FamilyError(f"{why}; set model.family to the model's family (one of "
                          f"{', '.join(FAMILIES)}) or the field to the family's value")
    return spec


def legacy_family(fields: dict) -> str:
    """The family of a checkpoint written before ``model.family`` existed (its state.json
    has no such field), as threefold then wrote it: Qwen3/Qwen2 by q/k norms or biases,
    Mixtral or a Qwen MoE by experts, else Llama."""
    moe = bool(fields.get("num_local_experts"))
    if moe and fields.get("qk_norm"):
        return "qwen3_moe"
    if moe and (fields.get("qkv_bias") or fields.get("shared_expert_intermediate_size")):
        return "qwen2_moe"
    if moe:
        return "mixtral"
    return "qwen3" if fields.get("qk_norm") else "qwen2" if fields.get("qkv_bias") else "llama"


def fused_files(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """File tensor -> the logical tensors it holds, in its row order, for every fused layer
    of ``cfg``'s family (Phi-3's ``model.layers.0.self_attn.qkv_proj.weight`` ->
    ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight`` of layer 0); empty for a family
    whose files hold threefold's layers as they are."""
    out = {}
    for fused, parts in FUSED_LAYERS.get(cfg.family or "llama", {}).items():
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            out[p + fused + ".weight"] = tuple(p + part + ".weight" for part in parts)
    return out
