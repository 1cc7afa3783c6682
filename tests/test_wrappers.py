"""Parallelisms change modules one way (``threefold.parallel.transforms.wrap.become``): context and
expert parallelism turn attentions, the model and MoE experts into wrapper classes that
``print(model)`` names, with their settings, and leave no function on an instance; the
wrappers survive recompute on top of them and deep copies, and expert parallelism's on one
rank computes what the plain layer does. No process group is needed: applying a
parallelism only asks the communication layer for sizes and ranks."""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch

from threefold.config import ModelConfig
from threefold.model.decoder import CausalLM, MixtralModel, Qwen3ForCausalLM
from threefold.parallel.transforms.context import (CPMask, ContextParallelAttention,
                                        ContextParallelDecoderModel, apply_context_parallel)
from threefold.parallel.transforms.expert import (ExpertParallelExperts, apply_expert_parallel,
                                                  take_rows_sent)
from threefold.parallel.transforms.recompute import apply_recompute
from threefold.parallel.transforms.wrap import become


class _SizesComm:
    """A communication layer of given axis sizes, seen from rank 0 of each; its only
    collective, ``all_to_all_single``, is the one-rank exchange (a copy)."""

    def __init__(self, **sizes: int):
        self.sizes = sizes

    def size(self, axis: str) -> int:
        return self.sizes.get(axis, 1)

    def rank(self, axis: str) -> int:
        return 0

    def all_to_all_single(self, out, x, axis, recv=None, send=None):
        assert self.size(axis) == 1, "only the one-rank exchange is defined here"
        out.copy_(x)


def _cfg() -> ModelConfig:
    return ModelConfig(preset="tiny", vocab_size=128, hidden_size=32, intermediate_size=24,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       num_local_experts=4, num_experts_per_tok=2).resolved()


def _model() -> CausalLM:
    model = CausalLM(_cfg())
    model.init_weights(seed=0)
    return model


def _patched(model) -> list[str]:
    """Modules holding one of the wrapped methods in their instance dict."""
    return [f"{name}.{k}" for name, m in model.named_modules() for k in vars(m)
            if k in ("attend", "attention_mask", "dispatch", "forward")]


@pytest.mark.parametrize("algorithm", ["ring", "allgather"])
def test_cp_and_ep_are_wrapper_classes_print_model_names(algorithm):
    model = _model()
    assert type(model).__name__ == "MixtralForCausalLM"  # the config's family
    names = [n for n, _ in model.named_parameters()]
    apply_context_parallel(model, _SizesComm(cp=2), algorithm)
    apply_expert_parallel(model, _SizesComm(ep=2))
    apply_recompute(model, "full")  # swaps the blocks' classes on top of the wrappers
    text = repr(model)
    # a wrapper over a family's class keeps the family's name after its own prefix
    assert re.search(r"ContextParallelMixtralModel\(\s+cp=2, masks from the whole sequence's",
                     text)
    for layer in model.model.layers:  # (print(model) folds equal layers into one)
        # a module with children prints its settings on the line after its name
        got = repr(layer)
        assert re.search(rf"ContextParallelAttention\(\s+cp=2, {algorithm}\n", got)
        assert "ExpertParallelExperts(experts [0, 2) of 4, ep=2, all-to-all)" in got
        assert got.startswith("CheckpointedMixtralDecoderLayer(")
    assert [n for n, _ in model.named_parameters()] == names
    assert not _patched(model)
    assert isinstance(model.model.attention_mask(None), CPMask)
    for layer in model.model.layers:
        assert type(layer.self_attn) is ContextParallelAttention
        assert layer.self_attn.algorithm == algorithm and layer.self_attn.cp == 2
        assert type(layer.mlp.experts) is ExpertParallelExperts
        assert layer.mlp.experts.gate_up_proj.shape[0] == 2
    assert isinstance(model.model, ContextParallelDecoderModel)
    assert type(model.model).__mro__[1:3] == (ContextParallelDecoderModel, MixtralModel)
    # wrappers are module-level classes: pickled by name, kept by a deep copy
    assert pickle.loads(pickle.dumps(ContextParallelAttention)) is ContextParallelAttention
    twin = copy.deepcopy(model)
    assert repr(twin) == text and not _patched(twin)


def test_cp_of_one_rank_leaves_the_model():
    model = _model()
    apply_context_parallel(model, _SizesComm(cp=1))
    assert "ContextParallel" not in repr(model)


def test_ep_wrapper_on_one_rank_computes_the_plain_layer():
    """Expert parallelism on one ep rank (the all-to-alls are copies) under full recompute:
    the same loss and gradients as the plain model, and its rows counted (none to others)."""
    plain, ep = _model(), _model()
    apply_expert_parallel(ep, _SizesComm(ep=1))
    apply_recompute(ep, "full")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (plain, ep):
        m(ids, labels=ids).sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ep.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    assert take_rows_sent(ep) == 0 and take_rows_sent(plain) == 0
    assert "ExpertParallelExperts(experts [0, 4) of 4, ep=1" in repr(ep)


def test_become_refuses_other_classes_and_undeclared_settings():
    model = _model()
    with pytest.raises(TypeError, match="not a subclass of LMHead"):
        become(model.lm_head, ContextParallelAttention)
    attn = model.model.layers[0].self_attn
    with pytest.raises(TypeError, match="declares no degree"):
        become(attn, ContextParallelAttention, degree=2)
    assert type(attn).__name__ == "Attention"


def test_tensor_parallelism_names_its_wrappers():
    """Tensor parallelism (sizes only: the sharding asks no collective) turns the model, its
    embedding, head, norms, sub-layers (with their f and g) and a LoRA adapter into classes
    print(model) names; context parallelism's attention composes over its sub-layer."""
    from threefold.config import LoRAConfig
    from threefold.model.lora import apply_lora
    from threefold.parallel.transforms.tensor import TensorParallelCausalLM, apply_tensor_parallel

    cfg = ModelConfig(preset="tiny", vocab_size=128, hidden_size=32, intermediate_size=24,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      qk_norm=True).resolved()
    model = apply_lora(CausalLM(cfg), LoRAConfig(r=4))
    model = apply_tensor_parallel(model, _SizesComm(tp=2), sequence_parallel=True)
    text = str(model)
    # (the config is a Qwen3's: the model's wrappers keep the family's name)
    for name in ("TensorParallelQwen3ForCausalLM", "VocabParallelEmbedding", "VocabParallelHead",
                 "SequenceParallelRMSNorm", "TensorParallelLoRALinear",
                 "TensorParallelSublayer", "SequenceParallelQwen3Model", "Qwen3DecoderLayer"):
        assert name in text, name
    assert isinstance(model, TensorParallelCausalLM) and isinstance(model, Qwen3ForCausalLM)
    assert "tp=2, sequence parallel" in text and "column-parallel adapter" in text
    assert "f: all-gather, g: reduce-scatter over tp" in text
    assert not _patched(model)
    # f and g are the sub-layers' own (no hooks), and context parallelism composes over them
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    apply_context_parallel(model, _SizesComm(tp=2, cp=2))
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, ContextParallelAttention) and "TensorParallelSublayer" in [
        c.__name__ for c in type(attn).__mro__]
