"""Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms, a head width of its own) and Qwen3-MoE:
logits equal transformers' classes, import and export both ways, every layout
trains as one process, and the planner counts the new weights exactly."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed, train_runs
from threefold.config import load_config
from threefold.model.decoder import CausalLM
from threefold.training.train import train

FAMILIES = {"qwen2": {"model__qkv_bias": "true"},
            "qwen3": {"model__qk_norm": "true", "model__attention_head_dim": "32"},
            "qwen3_moe": {"model__qk_norm": "true", "model__attention_head_dim": "32",
                          "model__num_local_experts": "4", "model__num_experts_per_tok": "2",
                          "model__norm_topk_prob": "false",
                          # the router's losses are per micro-batch: each rank's rows, alike;
                          # per layer, so that pipeline stages can add their own
                          "model__router_aux_loss_per_layer": "true",
                          "train__micro_batch_size": "4"},
            "qwen2_moe": {"model__qkv_bias": "true", "model__num_local_experts": "4",
                          "model__num_experts_per_tok": "2", "model__norm_topk_prob": "false",
                          "model__shared_expert_intermediate_size": "80",
                          "model__router_aux_loss_per_layer": "true",
                          "train__micro_batch_size": "4"}}


def _hf_model(family: str, tied: bool):
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 tie_word_embeddings=tied)
    if family == "qwen2":
        conf, cls = transformers.Qwen2Config(**shape), transformers.Qwen2ForCausalLM
    elif family == "qwen2_moe":  # q/k/v biases, a shared expert of 80 with its gate
        conf = transformers.Qwen2MoeConfig(**shape, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=48,
                                           shared_expert_intermediate_size=80,
                                           norm_topk_prob=False)
        cls = transformers.Qwen2MoeForCausalLM
    elif family == "qwen3_moe":  # every block routed, experts of 48, no renormalisation
        conf = transformers.Qwen3MoeConfig(**shape, head_dim=32, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=48,
                                           norm_topk_prob=False)
        cls = transformers.Qwen3MoeForCausalLM
    else:  # a head of 32 where hidden / heads is 16
        conf, cls = transformers.Qwen3Config(**shape, head_dim=32), \
            transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(conf).float().eval()
    with torch.no_grad():  # biases and norms away from their initial 0 and 1
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen3", False),
                                         ("qwen2_moe", False), ("qwen3_moe", False)])
def test_logits_equal_transformers_and_export_round_trips(family, tied, tmp_path):
    from threefold.weights.hf import export_hf, load_pretrained
    from threefold.weights.hf_config import model_config_from_hf

    transformers = pytest.importorskip("transformers")
    hf = _hf_model(family, tied)
    hf.save_pretrained(tmp_path / "hf")
    cfg, weights = load_pretrained(tmp_path / "hf")
    qwen2 = family.startswith("qwen2")
    assert (cfg.qkv_bias, cfg.qk_norm) == (qwen2, not qwen2)
    assert cfg.num_local_experts == (4 if family.endswith("moe") else 0)
    assert cfg.shared_expert_intermediate_size == (80 if family == "qwen2_moe" else 0)
    model = CausalLM(cfg)
    model.load_state_dict(weights, strict=True)
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model.eval()(ids), want, rtol=0, atol=1e-5)
    # HF -> threefold checkpoint -> HF: loads as the same family, the same logits
    from threefold.weights.hf import convert_from_hf
    run = tmp_path / "run"
    convert_from_hf(tmp_path / "hf", run)
    export_hf(run, tmp_path / "out")
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert conf["model_type"] == family
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=1e-5)
    assert model_config_from_hf(conf) == cfg
    if family.endswith("moe"):  # the published per-expert layout, read and written
        from safetensors import safe_open
        keys = set(safe_open(str(tmp_path / "out" / "model.safetensors"), "pt").keys())
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in keys
        for bad in ({"decoder_sparse_step": 2}, {"mlp_only_layers": [0]}):
            with pytest.raises(Exception, match=next(iter(bad))):
                model_config_from_hf({**conf, **bad})


def test_sliding_window_is_refused_only_when_on(tmp_path):
    from threefold.weights.hf_config import HFError, model_config_from_hf

    conf = _hf_model("qwen2", True).config.to_dict()
    conf["sliding_window"] = 4096  # Qwen2's configs carry one, with use_sliding_window false
    conf["use_sliding_window"] = False
    assert model_config_from_hf(conf).qkv_bias
    conf["use_sliding_window"] = True
    with pytest.raises(HFError, match="use_sliding_window"):
        model_config_from_hf(conf)
    conf["use_sliding_window"] = False
    conf["layer_types"] = ["full_attention", "sliding_attention"]
    with pytest.raises(HFError, match="layer_types"):
        model_config_from_hf(conf)
    conf = _hf_model("qwen3", False).config.to_dict()
    conf["attention_bias"] = True  # Qwen3's would bias o_proj too
    with pytest.raises(HFError, match="attention_bias"):
        model_config_from_hf(conf)


LAYOUTS = [("dp2", {}), ("zero3", {"parallel__zero_stage": 3}),
           ("tp2_sp", {"parallel__tp": 2, "parallel__sequence_parallel": "true"}),
           ("pp2", {"parallel__pp": 2, "train__micro_batch_size": 2})]
# a mixture of experts runs without sequence parallelism (refused by name); its pipeline
# keeps the family's micro-batches of 4 (the router's losses are per micro-batch)
MOE_LAYOUTS = LAYOUTS[:2] + [("tp2", {"parallel__tp": 2}), ("ep2", {"parallel__ep": 2}),
                             ("pp2", {"parallel__pp": 2})]


def _overrides(family, corpus, cache, out, **extra):
    return tiny_overrides(corpus, cache, out, **{"train__steps": 3, **FAMILIES[family], **extra})


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_layouts_equal_single_process_and_the_planner_counts(family, corpus, cache_dir,
                                                             tmp_path):
    from threefold.accounting import num_parameters
    from threefold.launch.dryrun import predict

    over = functools.partial(_overrides, family, corpus, cache_dir)
    _, run = train(load_config(None, over(tmp_path / "single")), return_run=True)
    held = sum(p.numel() for p in run.engine.model.parameters())
    assert num_parameters(run.model_cfg) == held
    names = set(final_weights(tmp_path / "single"))
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == family.startswith("qwen2")
    assert ("model.layers.0.self_attn.k_norm.weight" in names) == family.startswith("qwen3")
    layouts = MOE_LAYOUTS if family.endswith("moe") else LAYOUTS
    run_distributed(train_runs, 2, over, tmp_path, layouts, timeout=300)
    ref, ref_w = metrics(tmp_path / "single"), final_weights(tmp_path / "single")
    for name, extra in layouts:
        got = metrics(tmp_path / name)
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5), \
            name
        w = final_weights(tmp_path / name)
        for k, v in ref_w.items():
            torch.testing.assert_close(w[k], v, rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")
        # the dry run's meta model and the planner's closed forms agree on this layout
        predict(load_config(None, over(tmp_path / f"{name}-plan", **extra)), 2,
                backend_copies=False)
    assert Path(tmp_path / "single" / "summary.json").is_file()
