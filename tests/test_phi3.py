"""Phi-3 (threefold.families.phi3): partial RoPE and a sliding window give transformers' logits;
the files' fused qkv_proj/gate_up_proj are split at import (each projection read as a region
of the fused tensor) and joined at export, so convert round-trips to a folder transformers
loads; longrope and dropout are refused by field; tensor parallelism trains as one process,
counted by the planner; a LoRA run's adapters become the fused layers' exact adapters, which
PEFT loads onto the Phi-3 base."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch
from safetensors import safe_open

from tests.conftest import final_weights, hf_twin, metrics, tiny_overrides
from tests.dist import run_distributed, train_runs
from threefold.config import ConfigError, load_config
from threefold.model.decoder import CausalLM

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
WINDOW = 7  # shorter than the prompts (24 tokens): the window decides the logits
FUSED = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")
SPLIT = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight")


def _hf_model():
    transformers = pytest.importorskip("transformers")
    conf = transformers.Phi3Config(**SHAPE, partial_rotary_factor=0.5, sliding_window=WINDOW)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(conf).float().eval()
    with torch.no_grad():  # norms away from their initial ones
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    return model


def _file_names(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_logits_equal_transformers_and_convert_round_trips(tmp_path):
    from threefold.weights.hf import convert_from_hf, export_hf
    from threefold.weights.hf_config import model_config_from_hf
    from threefold.weights import HFSource

    transformers = pytest.importorskip("transformers")
    hf = _hf_model()
    cfg, weights, model, ids, want = hf_twin(hf, tmp_path / "hf")
    assert (cfg.family, cfg.partial_rotary_factor, cfg.sliding_window) == ("phi3", 0.5, WINDOW)
    with torch.no_grad():
        for change in ({"partial_rotary_factor": 1.0}, {"sliding_window": 0}):
            plain = CausalLM(dataclasses.replace(cfg, **change))
            plain.load_state_dict(weights, strict=True)
            assert (plain.eval()(ids) - want).abs().max() > 1e-3, change  # 100 x atol
    # a projection is read as its region of the fused file tensor, and only that region
    source = HFSource(tmp_path / "hf")
    k = source.read("model.layers.1.self_attn.k_proj.weight", ((3, 10), (5, 20)))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        qkv = f.get_tensor("model.layers.1.self_attn.qkv_proj.weight")
        up = f.get_tensor("model.layers.1.mlp.gate_up_proj.weight")[96:]
    assert torch.equal(k, qkv[64 + 3:64 + 10, 5:20]) and source.bytes_read == 7 * 15 * 4
    assert torch.equal(source.read("model.layers.1.mlp.up_proj.weight"), up)
    run = tmp_path / "run"
    convert_from_hf(tmp_path / "hf", run)
    export_hf(run, tmp_path / "out")
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (conf["model_type"], conf["partial_rotary_factor"]) == ("phi3", 0.5)
    assert conf["original_max_position_embeddings"] == 4096
    assert model_config_from_hf(conf) == cfg
    names = _file_names(tmp_path / "out")
    assert names == _file_names(tmp_path / "hf")
    assert {f"model.layers.1.{n}" for n in FUSED} <= names
    assert not {f"model.layers.1.{n}" for n in SPLIT} & names
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                              dtype=torch.float32).eval()
    assert type(again).__name__ == "Phi3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=1e-5)


def test_longrope_dropout_and_other_rope_refused_by_field():
    from threefold.weights.hf_config import HFError, family, model_config_from_hf

    conf = _hf_model().config.to_dict()
    long = {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    cases = [({"rope_scaling": long, "rope_parameters": None},
              r"rope_scaling\.rope_type='longrope'.*longrope is not built"),
             ({"rope_parameters": {**long, "rope_type": "longrope", "rope_theta": 1e4}},
              r"rope_parameters\.rope_type='longrope'.*longrope is not built"),
             ({"resid_pdrop": 0.1}, "resid_pdrop=0.1"), ({"embd_pdrop": 0.1}, "embd_pdrop"),
             ({"attention_dropout": 0.1}, "attention_dropout"),
             ({"hidden_act": "gelu"}, "hidden_act"), ({"sliding_window": 0}, "sliding_window"),
             ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.1875}},
              "partial_rotary_factor=0.1875.*even")]  # 3 of a 16-wide head
    for change, match in cases:
        with pytest.raises(HFError, match=match) as err:
            model_config_from_hf({**conf, **change})
        assert "\n" not in str(err.value) and "long_factor" not in str(err.value)
    cfg = model_config_from_hf(conf)
    with pytest.raises(ConfigError, match="model.rope_scaling: 'linear', but phi3 has 'none'"):
        family(dataclasses.replace(cfg, rope_scaling="linear"))
    # a default RoPE written the older way (rope_theta, no rope_parameters) is read
    old = {**conf, "rope_parameters": None, "rope_theta": 5e5, "partial_rotary_factor": 0.75}
    assert (model_config_from_hf(old).rope_theta,
            model_config_from_hf(old).partial_rotary_factor) == (5e5, 0.75)


def test_misshapen_or_missing_fused_tensor_is_named(tmp_path):
    from safetensors.torch import save_file

    from threefold.weights.hf_config import HFError
    from threefold.weights import HFSource

    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    weights = {k: v.contiguous() for k, v in hf.state_dict().items()}
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    short = {**weights, qkv: weights[qkv][:-1]}
    missing = {k: v for k, v in weights.items() if k != qkv}
    for bad, match in ((short, r"qkv_proj.weight has shape \(127, 64\), config.json needs "
                               r"\(128, 64\)"), (missing, "qkv_proj.weight is missing")):
        save_file(bad, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(HFError, match=match):
            HFSource(tmp_path / "hf")


PHI3_RUN = {"model__family": "phi3", "model__partial_rotary_factor": 0.5,
            "model__sliding_window": 9}


def _overrides(corpus, cache, out, **extra):
    return tiny_overrides(corpus, cache, out, **{"train__steps": 3, **PHI3_RUN, **extra})


@pytest.mark.slow
def test_tensor_parallel_equals_single_process_and_the_planner_counts(corpus, cache_dir,
                                                                     tmp_path):
    from threefold.layout import Layout, Workload
    from threefold.accounting import comm_bytes_per_step, num_parameters
    from threefold.launch.dryrun import predict
    from threefold.training.train import train

    over = functools.partial(_overrides, corpus, cache_dir)  # (pickled to the ranks)
    _, run = train(load_config(None, over(tmp_path / "single")), return_run=True)
    assert run.model_cfg.family == "phi3"
    assert num_parameters(run.model_cfg) == sum(p.numel()
                                                for p in run.engine.model.parameters())
    extra = {"parallel__tp": 2, "parallel__sequence_parallel": "true"}
    run_distributed(train_runs, 2, over, tmp_path, [("tp2_sp", extra)], timeout=300)
    ref, ref_w = metrics(tmp_path / "single"), final_weights(tmp_path / "single")
    got, w = metrics(tmp_path / "tp2_sp"), final_weights(tmp_path / "tp2_sp")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    for k, v in ref_w.items():
        torch.testing.assert_close(w[k], v, rtol=1e-4, atol=5e-5, msg=k)
    # the planner's bytes per step are what rank 0 moved, axis by axis, as the dry run says
    cfg = load_config(None, over(tmp_path / "plan", **extra))
    want = comm_bytes_per_step(cfg.model.resolved(cfg.data.vocab_size),
                               Layout.from_config(cfg, 2), Workload.from_config(cfg), 0)
    moved = json.loads((tmp_path / "tp2_sp" / "summary.json").read_text())
    assert moved["comm_bytes_per_step"] == {a: v for a, v in want.items() if v}
    assert predict(cfg, 2).comm_bytes == want


def _base_folder(run_dir, out):
    """The Phi-3 folder of a LoRA run's base (the seed's weights), written by export's
    tensor mapping."""
    from threefold.weights.hf import hub_tensors, write_hf_folder
    from threefold.generation.peft_export import open_lora
    from threefold.weights import DictSource

    run = open_lora(run_dir)
    source = DictSource({n: run.read_base(n) for n in run.base_shapes})
    write_hf_folder(out, hub_tensors(source, run.model_cfg, source.names()), run.model_cfg,
                    None)
    return run


def test_lora_adapters_load_onto_the_fused_layers_with_peft(corpus, cache_dir, tmp_path):
    """q, v, o, gate, up adapted (k and down not): qkv_proj gets rank 2r with k's rows zero,
    gate_up_proj rank 2r, o_proj rank r; PEFT's model gives threefold's logits, and so does
    the merged folder."""
    from threefold.generation.generate import load_for_generation
    from threefold.commands.convert import main as convert
    from threefold.generation.peft_export import ADAPTER_CONFIG, PEFT_PREFIX
    from threefold.training.train import train

    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    train(load_config(None, tiny_overrides(
        corpus, cache_dir, tmp_path / "run", train__steps=2, train__eval_batches=1,
        optim__lr="1e-2", lora__r=4, lora__alpha=8,
        lora__target_modules="q_proj,v_proj,o_proj,gate_proj,up_proj", **PHI3_RUN)))
    run = _base_folder(tmp_path / "run", tmp_path / "base")
    assert convert(["--to", "peft", str(tmp_path / "run"), str(tmp_path / "adapter")]) == 0
    conf = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert conf["target_modules"] == ["gate_up_proj", "o_proj", "qkv_proj"]
    assert (conf["r"], conf["lora_alpha"]) == (4, 8.0)
    assert conf["rank_pattern"] == {"qkv_proj": 8, "gate_up_proj": 8}
    assert conf["alpha_pattern"] == {"qkv_proj": 16.0, "gate_up_proj": 16.0}
    ours_model, _, _ = load_for_generation(tmp_path / "run")
    ids = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(1))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base",
                                                             dtype=torch.float32).eval()
    with torch.no_grad():
        ours, plain = ours_model(ids), base(ids).logits
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    params = {k.removeprefix(PEFT_PREFIX).replace(".default", ""): p.detach()
              for k, p in model.named_parameters() if "lora_" in k}
    b = params["model.layers.0.self_attn.qkv_proj.lora_B.weight"]
    assert b.shape == (64 + 2 * 32, 8) and not b[64:96].any()  # k's rows: not adapted
    assert torch.equal(b[96:, 4:], run.adapters["model.layers.0.self_attn.v_proj.lora_B.weight"])
    assert params["model.layers.0.self_attn.o_proj.lora_A.weight"].shape == (4, 64)
    with torch.no_grad():
        theirs = model(ids).logits
    assert (ours - plain).abs().max() > 1e-3  # the adapters matter
    assert (ours - theirs).abs().max() <= 1e-5
    # --merge: a Phi-3 folder, fused names, the same logits
    assert convert(["--to", "peft", "--merge", str(tmp_path / "run"),
                    str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                               dtype=torch.float32).eval()
    assert type(merged).__name__ == "Phi3ForCausalLM"
    assert "model.layers.0.self_attn.qkv_proj.weight" in _file_names(tmp_path / "merged")
    with torch.no_grad():
        assert (ours - merged(ids).logits).abs().max() <= 1e-5
