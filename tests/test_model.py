"""The Llama model: logits equal Hugging Face's, parameter counts equal the cost model's,
packed-document masking, meta-device init, and shard-friendliness for tensor/pipeline parallel."""

import copy
import dataclasses
import math
import time

import pytest
import torch
from torch import nn

from threefold.accounting import num_parameters
from threefold.config import MODEL_PRESETS, ModelConfig
from threefold.model.attention import document_position_ids, rope_inverse_frequencies
from threefold.model.decoder import CausalLM, causal_lm_loss, count_target_tokens

VOCAB = 300


def tiny(**kw) -> ModelConfig:
    """A small resolved config (hidden 64, 2 layers, GQA 4:2) with overrides."""
    base = dict(preset="tiny", vocab_size=VOCAB, hidden_size=64, intermediate_size=160,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    base.update(kw)
    return ModelConfig(**base).resolved()


def hf_model(cfg: ModelConfig):
    """transformers.LlamaForCausalLM with the same shape as ``cfg``."""
    transformers = pytest.importorskip("transformers")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_scaling_factor,
                    low_freq_factor=cfg.low_freq_factor, high_freq_factor=cfg.high_freq_factor,
                    original_max_position_embeddings=cfg.original_max_position_embeddings)
    hcfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, rope_parameters=rope,
        attn_implementation="eager")
    return transformers.LlamaForCausalLM(hcfg).eval()


def perturb_norms(model: nn.Module) -> None:
    """Give the norm weights non-trivial values so a mix-up between norms would show."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))


HF_CASES = {
    "gqa": tiny(rope_theta=10000.0),
    "mha-tied": tiny(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=50000.0),
    # head_dim 16, theta 1e4: wavelengths 6.3 … 19869. With an original context of 256 and
    # low/high factors 1/4, the cut-offs are 256 and 64, so frequencies fall in all three
    # regimes (kept, interpolated, divided by the factor).
    "llama3-rope": tiny(num_attention_heads=4, num_key_value_heads=1, rope_scaling="llama3",
                        rope_theta=10000.0, rope_scaling_factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=256,
                        max_position_embeddings=1024),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_logits_match_huggingface(case):
    # A larger init than training's makes attention peaked, so position and masking errors
    # move the logits well past the tolerance.
    cfg = dataclasses.replace(HF_CASES[case], init_std=0.1)
    torch.manual_seed(0)
    ours = CausalLM(cfg).eval()
    ours.init_weights(seed=3)
    perturb_norms(ours)
    ref = hf_model(cfg)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ids = torch.randint(0, VOCAB, (2, 37))
    pos = torch.stack([torch.arange(37), torch.arange(37) + 500])  # large positions as well
    with torch.no_grad():
        for p in (None, pos):
            a = ours(ids, position_ids=p)
            b = ref(input_ids=ids, position_ids=p).logits
            assert a.dtype == torch.float32 and a.shape == (2, 37, VOCAB)
            assert (a - b).abs().max().item() <= 1e-5
    # The RoPE frequencies are HF's exactly (checks the scaling regimes on their own).
    assert torch.equal(ours.model.rotary.inv_freq, ref.model.rotary_emb.inv_freq)


def test_llama3_rope_scaling_hits_every_regime():
    cfg = HF_CASES["llama3-rope"]
    scaled = rope_inverse_frequencies(cfg)
    plain = rope_inverse_frequencies(dataclasses.replace(cfg, rope_scaling="none"))
    ratio = plain / scaled
    assert (ratio == 1).any()                                 # high frequencies kept
    assert torch.isclose(ratio, torch.tensor(8.0)).any()      # low frequencies divided by 8
    assert ((ratio > 1.01) & (ratio < 7.99)).any()            # the band between interpolated


def test_tied_weights_share_storage_and_load_hf_style():
    cfg = HF_CASES["mha-tied"]
    model = CausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sd = model.state_dict()
    assert "lm_head.weight" in sd  # HF's state_dict also has both names
    # HF's tied checkpoints omit lm_head.weight; they must still load strictly.
    sd = {k: v.clone() + 1 for k, v in sd.items() if k != "lm_head.weight"}
    model.load_state_dict(sd, strict=True)
    assert torch.equal(model.lm_head.weight, sd["model.embed_tokens.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def count(model: nn.Module) -> int:
    """Parameters, each shared tensor once (Module.parameters() deduplicates)."""
    return sum(p.numel() for p in model.parameters())


def test_parameter_count_tiny():
    for cfg in HF_CASES.values():
        assert count(CausalLM(cfg)) == num_parameters(cfg)


@pytest.mark.parametrize("preset", ["llama3-8b", "llama3-70b", "llama3-405b", "gpt-7.5b"])
def test_parameter_count_presets_on_meta(preset):
    cfg = ModelConfig(preset=preset).resolved()
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = CausalLM(cfg)
    assert time.perf_counter() - t0 < 10
    n = count(model)
    assert n == num_parameters(cfg)
    if preset == "llama3-8b":
        assert n == 8_030_261_248
    assert all(p.is_meta for p in model.parameters())
    if MODEL_PRESETS[preset]["tie_word_embeddings"]:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_document_position_ids():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    want = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert torch.equal(document_position_ids(docs), want)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_packed_documents_equal_separate_runs(kv_heads):
    cfg = tiny(num_key_value_heads=kv_heads)
    model = CausalLM(cfg).eval()
    model.init_weights(seed=0)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, VOCAB, (1, 9), generator=g), torch.randint(0, VOCAB, (1, 14),
                                                                        generator=g)
    packed = torch.cat([a, b], dim=1)
    docs = torch.tensor([[0] * 9 + [1] * 14])
    pos = document_position_ids(docs)
    with torch.no_grad():
        together = model(packed, position_ids=pos, document_ids=docs)
        alone = torch.cat([model(a), model(b)], dim=1)
        unmasked = model(packed)
    assert (together - alone).abs().max().item() <= 1e-5
    # Without the mask, the second document sees the first: the test can tell the difference.
    assert (unmasked[:, 9:] - alone[:, 9:]).abs().max().item() > 1e-3
    # All-one-document ids reduce to plain causal attention.
    with torch.no_grad():
        same = model(packed, document_ids=torch.zeros_like(docs))
    assert (same - unmasked).abs().max().item() <= 1e-5


def test_meta_to_empty_init_is_deterministic_and_sane():
    cfg = tiny(num_hidden_layers=3, tie_word_embeddings=True)

    def build(seed):
        with torch.device("meta"):
            m = CausalLM(cfg)
        m.to_empty(device="cpu")
        m.init_weights(seed=seed)
        return m

    m1, m2, m3 = build(7), build(7), build(8)
    eager = CausalLM(cfg)
    eager.init_weights(seed=7)
    s1, s2, s3, se = (m.state_dict() for m in (m1, m2, m3, eager))
    for k in s1:
        assert torch.isfinite(s1[k]).all(), k
        assert torch.equal(s1[k], s2[k]), k
        assert torch.equal(s1[k], se[k]), k  # name-seeded: meta path == eager path
        if s1[k].ndim == 2:
            assert not torch.equal(s1[k], s3[k]), k
    assert m1.lm_head.weight is m1.model.embed_tokens.weight  # re-tied after to_empty
    assert torch.equal(m1.model.rotary.inv_freq, eager.model.rotary.inv_freq)
    assert torch.all(s1["model.norm.weight"] == 1)
    std = cfg.init_std
    assert abs(s1["model.layers.0.mlp.up_proj.weight"].std().item() - std) < 0.1 * std
    scaled = std / math.sqrt(2 * cfg.num_hidden_layers)
    assert abs(s1["model.layers.0.self_attn.o_proj.weight"].std().item() - scaled) < 0.1 * scaled

    ids = torch.randint(0, VOCAB, (4, 32))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    with torch.no_grad():
        loss = causal_lm_loss(m1(ids), labels) / count_target_tokens(labels)
    assert abs(loss.item() - math.log(VOCAB)) < 0.1


def test_loss_sum_and_count():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, :2] = -100
    total = causal_lm_loss(logits, labels)
    assert total.dtype == torch.float32
    assert count_target_tokens(labels).item() == 8
    lp = torch.log_softmax(logits.float(), -1)
    keep = labels != -100
    want = -lp[keep].gather(-1, labels[keep][:, None]).sum()
    assert torch.allclose(total, want, atol=1e-5)
    assert torch.allclose(causal_lm_loss(logits, labels, reduction="mean"), want / 8, atol=1e-6)


def test_head_sharded_layers_sum_to_the_whole():
    """What tensor parallelism relies on: split q/k/v/gate/up by output rows (whole heads) and
    o/down by input columns; each shard runs the unchanged modules with fewer heads, and the
    shards' outputs add up to the full layer's output."""
    cfg = tiny()
    model = CausalLM(cfg).eval()
    model.init_weights(seed=1)
    layer = model.model.layers[0]
    x = torch.randn(2, 10, cfg.hidden_size)
    pos = torch.arange(10).expand(2, 10)
    cos, sin = model.model.rotary(pos)
    with torch.no_grad():
        full_attn, full_mlp = layer.self_attn(x, cos, sin), layer.mlp(x)
        parts_attn, parts_mlp = 0, 0
        for r in range(2):  # 2 shards: 2 query heads and 1 kv head each
            shard = copy.deepcopy(layer)
            att, mlp = shard.self_attn, shard.mlp
            for lin, dim in ((att.q_proj, 0), (att.k_proj, 0), (att.v_proj, 0), (att.o_proj, 1),
                             (mlp.gate_proj, 0), (mlp.up_proj, 0), (mlp.down_proj, 1)):
                lin.weight = nn.Parameter(lin.weight.chunk(2, dim=dim)[r].clone())
            parts_attn = parts_attn + att(x, cos, sin)
            parts_mlp = parts_mlp + mlp(x)
    assert (parts_attn - full_attn).abs().max().item() <= 1e-5
    assert (parts_mlp - full_mlp).abs().max().item() <= 1e-5


def test_pipeline_stages_compose_to_the_whole():
    """Stages without embedding / norm / head (set to None) chain to the full forward."""
    cfg = tiny(num_hidden_layers=4)
    model = CausalLM(cfg).eval()
    model.init_weights(seed=2)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    first.model.layers = first.model.layers[:2]
    first.model.norm = first.lm_head = None
    last.model.layers = last.model.layers[2:]
    last.model.embed_tokens = None
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert (last(first(ids)) - model(ids)).abs().max().item() <= 1e-5
