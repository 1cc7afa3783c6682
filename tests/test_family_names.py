"""Every family runs under its own name: ``CausalLM(cfg)`` of a Gemma 3 is a
``Gemma3ForCausalLM`` of ``Gemma3Model`` and ``Gemma3DecoderLayer`` blocks, as Hugging Face names
them, and ``print(model)`` names no other family; the names change no parameter name (the
state dict is the family-neutral classes'), survive copies, pickling and recompute, and a
model that fits no family keeps the neutral names. Built on the meta device: no weights."""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch

from threefold.config import ModelConfig
from threefold.model.decoder import CausalLM, DecoderLayer, DecoderModel
from threefold.families import FAMILIES, spec_of
from threefold.parallel.transforms.recompute import apply_recompute

SHAPE = dict(preset="tiny", vocab_size=64, hidden_size=32, intermediate_size=16,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rope_scaling="none")
EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)
# what a family needs beyond the fields its spec fixes
EXTRA = {"qwen2_moe": dict(shared_expert_intermediate_size=16),
         "deepseek_v3": dict(kv_lora_rank=8, q_lora_rank=0, qk_nope_head_dim=8,
                             qk_rope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
                             first_k_dense_replace=1, dense_intermediate_size=48,
                             shared_expert_intermediate_size=16, norm_topk_prob=True)}
PREFIXES = {t: spec.architecture.removesuffix("ForCausalLM") for t, spec in FAMILIES.items()}


def _cfg(family: str) -> ModelConfig:
    spec = FAMILIES[family]
    return ModelConfig(**{**SHAPE, **spec.fixed, **(EXPERTS if spec.experts else {}),
                          **EXTRA.get(family, {})}, family=family).resolved()


def _built(cfg: ModelConfig, cls: type | None = None):
    """``CausalLM(cfg)`` on the meta device, or with ``cls`` a model of exactly that class."""
    with torch.device("meta"):
        if cls is None:
            return CausalLM(cfg)
        model = cls.__new__(cls)  # (CausalLM(cfg) would pick the family's class)
        model.__init__(cfg)
        return model


def _family_names(text: str) -> set[str]:
    """The family prefixes of the class names ``text`` (a ``print(model)``) shows: for each
    class name, the longest prefix in it (Qwen3Moe's names contain Qwen3)."""
    out = set()
    for name in re.findall(r"(\w+)\(", text):
        found = [p for p in PREFIXES.values() if p in name]
        if found:
            out.add(max(found, key=len))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_prints_its_own_name_and_keeps_hf_parameter_names(family):
    cfg = _cfg(family)
    assert spec_of(cfg) is FAMILIES[family]
    prefix = PREFIXES[family]
    model = _built(cfg)
    assert type(model).__name__ == FAMILIES[family].architecture
    assert type(model.model).__name__ == f"{prefix}Model"
    assert {type(b).__name__ for b in model.model.layers} == {f"{prefix}DecoderLayer"}
    assert isinstance(model.model, DecoderModel) and model.family == family
    text = repr(model)
    assert _family_names(text) == {prefix}, text
    if family != "llama":
        assert "Llama" not in text
    # one class per family, whatever the model's width
    assert type(_built(_cfg(family))) is type(model)
    # the names add nothing: the neutral classes' parameters, names and shapes
    neutral = _built(cfg, CausalLM)
    assert type(neutral.model) is DecoderModel and type(neutral.model.layers[0]) is DecoderLayer
    assert not _family_names(repr(neutral))
    assert [(k, v.shape) for k, v in model.state_dict().items()] == \
        [(k, v.shape) for k, v in neutral.state_dict().items()]
    # copies and pickles keep the class; recompute prefixes the family's block
    assert type(copy.deepcopy(model)) is type(model)
    assert pickle.loads(pickle.dumps(type(model))) is type(model)
    apply_recompute(model, "full")
    assert repr(model.model.layers[0]).startswith(f"Checkpointed{prefix}DecoderLayer(")


def test_a_family_is_resolved_when_unset_and_a_model_of_none_stays_neutral():
    """Unset ``model.family``: the one family whose fixed fields the model meets (Llama
    when it does); a model that fits none keeps the family-neutral names."""
    plain = ModelConfig(**SHAPE).resolved()
    assert plain.family is None and type(_built(plain)).__name__ == "LlamaForCausalLM"
    qwen3 = ModelConfig(**SHAPE, qk_norm=True).resolved()
    assert type(_built(qwen3)).__name__ == "Qwen3ForCausalLM"
    none = ModelConfig(**SHAPE, qk_norm=True, qkv_bias=True).resolved()  # no family has both
    model = _built(none)
    assert type(model) is CausalLM and type(model.model.layers[0]) is DecoderLayer
    assert not _family_names(repr(model)) and model.family == ""
