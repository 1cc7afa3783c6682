"""DeepSeek-V3 (threefold.families.deepseek_v3): multi-head latent attention, DeepSeekMoE's
grouped sigmoid routing with its load-balancing bias, ungated shared experts, dense first
blocks, interleaved RoPE and YaRN give transformers' logits, and convert both ways."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import hf_twin

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
    from threefold.commands.convert import main as convert
    from threefold.weights.hf_config import model_config_from_hf

    transformers = pytest.importorskip("transformers")
    hf = hf_deepseek(**({"rope_parameters": YARN} if rope == "yarn" else {}))
    cfg, weights, model, ids, want = hf_twin(hf, tmp_path / "hf")
    assert (cfg.family, cfg.kv_lora_rank, cfg.first_k_dense_replace) == ("deepseek_v3", 32, 1)
    assert cfg.rope_scaling == ("yarn" if rope == "yarn" else "none")
    with torch.no_grad():
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
    from threefold.weights.hf_config import (HFError, check_shapes, expected_shapes,
                                             model_config_from_hf)

    conf = hf_deepseek().config.to_dict()
    for change, field in (({"n_group": 3}, "n_group"), ({"kv_lora_rank": 0}, "kv_lora_rank"),
                          ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
                           "rope_parameters"), ({"scoring_func": "softmax"}, "scoring_func")):
        with pytest.raises(HFError, match=field):
            model_config_from_hf({**conf, **change})
    # the multi-token-prediction module is layer L (tests/test_mtp.py); one past it is not
    cfg = model_config_from_hf(conf)
    assert cfg.num_nextn_predict_layers == 1 and "model.layers.3.enorm.weight" in \
        expected_shapes(cfg)
    shapes = {**expected_shapes(cfg), "model.layers.4.enorm.weight": (64,)}
    with pytest.raises(HFError, match="unexpected tensor model.layers.4.enorm.weight"):
        check_shapes(cfg, shapes, "folder")


# the tiny DeepSeek-V3 as a training config: 3 blocks, the first dense (width 128), 8
# experts of 64 in 4 groups (2 kept), top-2, one ungated shared expert, latent attention,
# and its multi-token-prediction module (a fourth, routed block on the last stage)
TRAIN = {"model__family": "deepseek_v3", "model__num_hidden_layers": 3,
         "model__num_key_value_heads": 4, "model__kv_lora_rank": 32, "model__q_lora_rank": 48,
         "model__qk_nope_head_dim": 16, "model__qk_rope_head_dim": 8, "model__v_head_dim": 16,
         "model__rope_interleave": "true", "model__num_local_experts": 8,
         "model__num_experts_per_tok": 2, "model__n_group": 4, "model__topk_group": 2,
         "model__moe_router": "sigmoid_grouped", "model__routed_scaling_factor": 2.5,
         "model__intermediate_size": 64, "model__shared_expert_intermediate_size": 64,
         "model__shared_expert_gate": "false", "model__first_k_dense_replace": 1,
         "model__dense_intermediate_size": 128, "model__router_aux_loss_coef": 0.0,
         "model__router_aux_loss_per_layer": "true", "model__router_bias_update_rate": 0.01,
         "model__num_nextn_predict_layers": 1, "model__mtp_loss_weight": 0.3,
         "train__micro_batch_size": 4, "train__steps": 3}


def _overrides(corpus, cache, out, **extra):
    from tests.conftest import tiny_overrides

    return tiny_overrides(corpus, cache, out, **{**TRAIN, **extra})


LAYOUTS = [("dp2", {}), ("zero3", {"parallel__zero_stage": 3}), ("tp2", {"parallel__tp": 2}),
           ("pp2", {"parallel__pp": 2}), ("ep2", {"parallel__ep": 2})]


@pytest.mark.slow
def test_layouts_equal_single_process_and_the_planner_counts(corpus, cache_dir, tmp_path):
    """DP, ZeRO-3, TP 2 (latent projections whole on each rank, the per-head expansions
    split), PP 2 (the dense block and a routed one on the first stage) and EP 2 train as one
    process does, the routing biases moving alike (their loads summed over the data ranks);
    the planner's parameters and bytes per axis are the runtime's."""
    import functools

    from tests.conftest import assert_layouts_train_as_one_process
    from tests.dist import run_distributed, train_runs
    from threefold.accounting import num_parameters
    from threefold.config import load_config
    from threefold.training.train import train

    over = functools.partial(_overrides, corpus, cache_dir)
    _, run = train(load_config(None, over(tmp_path / "single")), return_run=True)
    assert num_parameters(run.model_cfg) == sum(p.numel() for p in run.engine.model.parameters())
    run_distributed(train_runs, 2, over, tmp_path, LAYOUTS, timeout=300)
    ref_w = assert_layouts_train_as_one_process(tmp_path, over, LAYOUTS)
    assert any(v.abs().max() > 0 for k, v in ref_w.items() if k.endswith("correction_bias"))


def test_resume_restores_the_routing_bias(corpus, cache_dir, tmp_path):
    """The routing bias is checkpointed: a run stopped after step 2 and resumed trains steps
    3 and 4 as the uninterrupted run does, to the same biases."""
    import shutil

    from tests.conftest import final_weights, metrics
    from threefold.config import load_config
    from threefold.training.train import train

    whole, part = tmp_path / "whole", tmp_path / "part"
    train(load_config(None, _overrides(corpus, cache_dir, whole, train__steps=4)))
    train(load_config(None, _overrides(corpus, cache_dir, part, train__steps=4,
                                       checkpoint__interval=2)))
    shutil.rmtree(part / "checkpoints" / "4")  # as if stopped after step 2
    train(load_config(None, _overrides(corpus, cache_dir, part, train__steps=4,
                                       checkpoint__resume="true")))
    assert [r["loss"] for r in metrics(part)][-2:] == [r["loss"] for r in metrics(whole)][-2:]
    a, b = final_weights(whole), final_weights(part)
    for k in a:
        if k.endswith("correction_bias"):
            assert torch.equal(a[k], b[k]) and a[k].abs().max() > 0, k


def test_the_planner_ranks_deepseek_v3_on_2048_h100s(capsys):
    """The ``deepseek-v3`` preset is the published model (671B without the multi-token
    prediction module, 37B active per token), and the planner lays it out on 2,048 H100s with
    DeepSeek-V3's own split (pipeline 16, experts over 64 ranks, ZeRO-1, DualPipeV): latent
    attention, the experts and the dense first blocks counted."""
    from threefold.accounting import active_parameters, num_parameters
    from threefold.commands.main import main
    from threefold.config import ModelConfig

    cfg = ModelConfig(preset="deepseek-v3").resolved()
    assert round(num_parameters(cfg) / 1e9, 2) == 671.03
    assert round(active_parameters(cfg) / 1e9) == 38  # (the paper rounds to 37B)
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "2048", "--gpu", "h100",
                 "--tp", "1", "--pp", "16", "--ep", "64", "--zero-stage", "1",
                 "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "671B parameters (37.6B active: 256 experts, top-8)" in out
    assert "layouts fit" in out and "schedule dualpipe-v" in out
    # the split that balances FLOPs, not parameters (routed experts and dense blocks weighed)
    assert "parallel.pipeline_split flops: blocks per stage 2,2,1,1,2," in out


def test_generation_equals_transformers(tmp_path):
    """Latent attention with the KV cache (threefold caches the expanded keys and values,
    transformers the latents): greedy tokens equal transformers'."""
    from threefold.generation.generate import generate

    _, _, model, _, _ = hf_twin(hf_deepseek(), tmp_path / "hf")
    prompt = torch.randint(0, 300, (1, 10))
    hf = hf_deepseek()
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        got = generate(model.eval(), prompt.tolist(), max_new_tokens=12)
    assert got.tokens == want[:, 10:].tolist()
