"""GPT-OSS (threefold.families.gpt_oss): attention sinks, alternating sliding and full
attention, biased experts with the clamped SwiGLU and YaRN give transformers' logits and
greedy tokens; a folder whose experts are MXFP4 imports exactly, region by region; the
planner counts the published totals; the layouts train as one process does."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.conftest import hf_twin
from threefold.model.decoder import CausalLM

WINDOW = 7  # shorter than the prompts and the generation below
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
             sliding_window=WINDOW,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                              "original_max_position_embeddings": 64})


def hf_gpt_oss(**over):
    """A random tiny ``GptOssForCausalLM``, its sinks and biases far from their initial 0 and
    its experts' weights large enough for the clamp to act."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**SHAPE, **over}))
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                p.normal_(0.0, 1.0)
            elif "experts" in name:
                p.normal_(0.0, 0.4)
    return model


# each piece of its own decides the logits: without it they differ
OWN = [{"attention_sinks": False}, {"moe_activation": "swiglu"}, {"sliding_window": 0},
       {"swiglu_limit": 0.5}, {"rope_scaling": "none"}]


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """The random transformers model, its folder and threefold's twin (``hf_twin``: logits
    checked equal), made once for the tests below."""
    hf, folder = hf_gpt_oss(), tmp_path_factory.mktemp("gpt_oss") / "hf"
    return (hf, folder, *hf_twin(hf, folder))


def test_logits_equal_transformers_and_convert_round_trips(twin, tmp_path):
    from threefold.weights.hf import convert_from_hf, export_hf
    from threefold.weights.hf_config import model_config_from_hf

    transformers = pytest.importorskip("transformers")
    hf, folder, cfg, weights, model, ids, want = twin
    assert (cfg.family, type(model).__name__) == ("gpt_oss", "GptOssForCausalLM")
    assert (cfg.sliding_window, cfg.sliding_window_pattern, cfg.yarn_truncate) == (WINDOW, 2,
                                                                                    False)
    assert weights["model.layers.0.self_attn.sinks"].abs().min() > 0
    with torch.no_grad():
        for change in OWN:
            plain = CausalLM(dataclasses.replace(cfg, **change))
            plain.load_state_dict(weights, strict=False)
            assert (plain.eval()(ids) - want).abs().max() > 1e-3, change
        looped = CausalLM(dataclasses.replace(cfg, moe_impl="loop"))
        looped.load_state_dict(weights)
        torch.testing.assert_close(looped.eval()(ids), want, rtol=0, atol=1e-5)
    run = tmp_path / "run"
    convert_from_hf(folder, run)
    export_hf(run, tmp_path / "out")
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert conf["model_type"] == "gpt_oss" and model_config_from_hf(conf) == cfg
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                              dtype=torch.float32).eval()
    assert type(again).__name__ == "GptOssForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=1e-5)


def test_generation_past_the_window_equals_transformers(twin):
    """The KV cache with sinks and the window: 12 greedy tokens after 10 (window 7) equal
    transformers'; a left-padded batch row gives the tokens it gives alone."""
    from threefold.generation.generate import generate

    hf, model = twin[0], twin[4]
    prompt = torch.randint(0, 300, (1, 10))
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        got = generate(model.eval(), prompt.tolist(), max_new_tokens=12)
        both = generate(model, [prompt[0, 3:].tolist(), prompt[0].tolist()], max_new_tokens=12)
    assert got.tokens == want[:, 10:].tolist()
    assert both.tokens[1] == got.tokens[0]


def _mxfp4(rows: int, cols: int, experts: int, gen: torch.Generator):
    """Known weights (experts, rows, cols) that MXFP4 holds exactly, and their blocks and
    scales written by hand: nibble n is the e2m1 value E2M1[n], two per byte (the earlier
    one low), one scale byte 2^(s − 127) per 32 values."""
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    nibbles = torch.randint(0, 16, (experts, rows, cols), generator=gen)
    scales = torch.randint(120, 130, (experts, rows, cols // 32), generator=gen)
    values = e2m1[nibbles] * torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    pairs = nibbles.reshape(experts, rows, cols // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return values, blocks, scales.to(torch.uint8)


def test_mxfp4_experts_import_exactly_and_by_region(tmp_path):
    """A folder as published (experts in MXFP4, gate and up rows alternating) imports as the
    weights quantised, its logits transformers' on those weights; a box of experts reads
    exactly those experts' blocks and scales."""
    from safetensors.torch import load_file, save_file

    from threefold.weights import HFSource

    hf = hf_gpt_oss(hidden_size=64, intermediate_size=64)
    hf.save_pretrained(tmp_path / "bf16")
    files = load_file(tmp_path / "bf16" / "model.safetensors")
    gen, known = torch.Generator().manual_seed(1), {}
    for i in range(4):
        for proj, rows, cols in (("gate_up_proj", 128, 64), ("down_proj", 64, 64)):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            values, blocks, scales = _mxfp4(rows, cols, 4, gen)
            del files[name]
            files[name + "_blocks"], files[name + "_scales"] = blocks, scales
            known[name] = values
            with torch.no_grad():  # transformers holds the transpose: (E, cols, rows)
                hf.get_parameter(name).copy_(values.transpose(1, 2))
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    save_file(files, folder / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((tmp_path / "bf16" / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(conf))
    src = HFSource(folder)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    gate_up = src.read(name)
    deinterleave = torch.cat((torch.arange(0, 128, 2), torch.arange(1, 128, 2)))
    assert torch.equal(gate_up, known[name][:, deinterleave])  # gate rows, then up rows
    down = "model.layers.1.mlp.experts.down_proj"
    assert torch.equal(src.read(down), known[down])
    before = src.bytes_read
    assert torch.equal(src.read(name, ((2, 4),)), gate_up[2:4])  # an ep rank's experts
    assert src.bytes_read - before == 2 * 128 * (64 // 2 + 64 // 32)  # theirs alone
    model = CausalLM(src.config)
    model.load_state_dict(src.tensors())
    ids = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), hf(ids).logits, rtol=0, atol=1e-5)
