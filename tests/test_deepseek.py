"""DeepSeek-V3 (threefold.models.deepseek_v3): multi-head latent attention, DeepSeekMoE's
grouped sigmoid routing with its load-balancing bias, ungated shared experts, dense first
blocks, interleaved RoPE and YaRN give transformers' logits, and convert both ways."""

from __future__ import annotations

import json

import pytest
import torch

from threefold.model import LlamaForCausalLM

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32, q_lora_rank=48,
             qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
             num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=128)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def hf_deepseek(**over):
    """A tiny random transformers DeepSeek-V3 (3 blocks, the first dense), its weights and
    routing bias away from their initial values so that every piece shows in the logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{**SHAPE, **over})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.3) if name.endswith("norm.weight") else p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_logits_equal_transformers_and_convert_round_trips(rope, tmp_path):
    from threefold.convert import main as convert
    from threefold.hf import load_pretrained
    from threefold.hf_config import model_config_from_hf

    transformers = pytest.importorskip("transformers")
    hf = hf_deepseek(**({"rope_parameters": YARN} if rope == "yarn" else {}))
    hf.save_pretrained(tmp_path / "hf")
    cfg, weights = load_pretrained(tmp_path / "hf")
    assert (cfg.family, cfg.kv_lora_rank, cfg.first_k_dense_replace) == ("deepseek_v3", 32, 1)
    assert cfg.rope_scaling == ("yarn" if rope == "yarn" else "none")
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(weights, strict=True)
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model.eval()(ids), want, rtol=0, atol=1e-5)
        # the routing bias decides which experts run: without it the logits differ
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
        assert (model(ids) - want).abs().max() > 1e-3
    assert convert(["--from", "hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    assert convert(["--to", "hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert conf["model_type"] == "deepseek_v3" and model_config_from_hf(conf) == cfg
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=1e-5)


def test_unsupported_fields_are_named():
    from threefold.hf_config import HFError, model_config_from_hf

    conf = hf_deepseek().config.to_dict()
    for change, field in (({"n_group": 3}, "n_group"), ({"kv_lora_rank": 0}, "kv_lora_rank"),
                          ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
                           "rope_parameters"), ({"scoring_func": "softmax"}, "scoring_func")):
        with pytest.raises(HFError, match=field):
            model_config_from_hf({**conf, **change})
