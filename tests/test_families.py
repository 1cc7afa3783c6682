"""Model families as specs (threefold.families): Mistral's sliding window and OLMo 2's post-norms
and projection-wide q/k norms give transformers' logits, convert both ways as their own
family, train under tensor parallelism as one process, and are counted by the planner as the
runtime holds them; the registry reads and writes config.json by ``model_type`` and never
guesses a family."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import final_weights, hf_twin, metrics, tiny_overrides
from tests.dist import run_distributed, train_runs
from threefold.config import ConfigError, ModelConfig, load_config
from threefold.model.decoder import CausalLM

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             tie_word_embeddings=False)
WINDOW = 7  # shorter than the prompts below (24 tokens), so the window decides the logits


def _hf_model(family: str):
    transformers = pytest.importorskip("transformers")
    if family == "mistral":
        conf, cls = transformers.MistralConfig(**SHAPE, sliding_window=WINDOW), \
            transformers.MistralForCausalLM
    elif family == "gemma3_text":  # local, global, local, global; a head of 32 (not 16)
        conf = transformers.Gemma3TextConfig(**{**SHAPE, "num_hidden_layers": 4}, head_dim=32,
                                             query_pre_attn_scalar=24, sliding_window=WINDOW,
                                             layer_types=["sliding_attention",
                                                          "full_attention"] * 2)
        cls = transformers.Gemma3ForCausalLM
    else:
        conf, cls = transformers.Olmo2Config(**SHAPE, pad_token_id=0, eos_token_id=1), \
            transformers.Olmo2ForCausalLM
    torch.manual_seed(0)
    model = cls(conf).float().eval()
    with torch.no_grad():  # norms away from their initial ones
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # (Gemma's scale by 1 + w, from 0)
                p.normal_(0.0 if family == "gemma3_text" else 1.0, 0.3)
    return model


OWN = {"mistral": [{"sliding_window": 0}], "olmo2": [{"norm_layout": "pre"}],
       "gemma3_text": [{"sliding_window": 0}, {"rope_local_theta": 0.0},
                       {"query_pre_attn_scalar": 0}, {"embed_scale": False},
                       {"norm_plus_one": False}, {"hidden_act": "silu"}]}


@pytest.mark.parametrize("family", ["mistral", "olmo2", "gemma3_text"])
def test_logits_equal_transformers_and_convert_round_trips(family, tmp_path):
    from threefold.weights.hf import convert_from_hf, export_hf
    from threefold.weights.hf_config import model_config_from_hf

    transformers = pytest.importorskip("transformers")
    hf = _hf_model(family)
    cfg, weights, model, ids, want = hf_twin(hf, tmp_path / "hf")
    assert cfg.family == family and type(model).__name__ == type(hf).__name__  # its own name
    assert cfg.sliding_window == (0 if family == "olmo2" else WINDOW)
    assert (cfg.norm_layout, cfg.qk_norm) == {"olmo2": ("post", True), "mistral": ("pre", False),
                                              "gemma3_text": ("sandwich", True)}[family]
    with torch.no_grad():
        # in bf16 too, rounded where transformers rounds (Gemma's and OLMo 2's norms multiply
        # their weights in fp32, OLMo 2 turns RoPE in fp32)
        half = copy.deepcopy(model).to(torch.bfloat16)(ids)
        assert (half - copy.deepcopy(hf).to(torch.bfloat16)(ids).logits.float()).abs().max() \
            <= 1e-3
        # each of the family's own pieces decides the logits: without it they differ
        for change in OWN[family]:
            plain = CausalLM(dataclasses.replace(cfg, **change))
            plain.load_state_dict(weights, strict=False)
            assert (plain.eval()(ids) - want).abs().max() > 1e-2, change
    run = tmp_path / "run"
    convert_from_hf(tmp_path / "hf", run)
    export_hf(run, tmp_path / "out")
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert conf["model_type"] == family
    assert model_config_from_hf(conf) == cfg
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                              dtype=torch.float32).eval()
    assert type(again).__name__ == type(hf).__name__
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=1e-5)


def test_sliding_window_generation_equals_transformers(tmp_path):
    """The KV cache's mask keeps the window: greedy tokens past the window equal HF's."""
    from threefold.generation.generate import generate
    from threefold.weights.hf import load_pretrained

    hf = _hf_model("mistral")
    hf.save_pretrained(tmp_path / "hf")
    cfg, weights = load_pretrained(tmp_path / "hf")
    model = CausalLM(cfg)
    model.load_state_dict(weights, strict=True)
    prompt = torch.randint(0, 300, (1, 10))
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        got = generate(model.eval(), prompt.tolist(), max_new_tokens=12)
    assert got.tokens == want[:, 10:].tolist()


def test_registry_reads_by_model_type_and_never_guesses(tmp_path):
    from threefold.weights.hf_config import HFError, family, model_config_from_hf, \
        model_config_from_state
    from threefold.families import FAMILIES

    conf = _hf_model("mistral").config.to_dict()
    for kind, name in (("gemma3", "multimodal"), ("granite", "Granite"),
                       ("qwen3_next", "Qwen3-Next")):
        with pytest.raises(HFError, match=f"model_type='{kind}'.*{name}"):
            model_config_from_hf({**conf, "model_type": kind})
    with pytest.raises(HFError, match="sliding_window"):
        model_config_from_hf({**conf, "sliding_window": -3})
    # export writes the family the config names, after checking the model is one of it
    cfg = model_config_from_hf(conf)
    assert family(cfg)["architectures"] == ["MistralForCausalLM"]
    assert family(dataclasses.replace(cfg, sliding_window=0))["sliding_window"] is None
    with pytest.raises(ConfigError, match="model.sliding_window: 7, but llama has 0"):
        family(dataclasses.replace(cfg, family="llama"))
    # unset (flags on a preset that names none, or a checkpoint older than the field): the
    # one family whose spec the fields meet, Llama when it does
    qwen3 = ModelConfig(vocab_size=300, qk_norm=True).resolved()
    assert qwen3.family is None and family(qwen3)["model_type"] == "qwen3"
    assert family(ModelConfig(vocab_size=300).resolved())["model_type"] == "llama"
    assert family(dataclasses.replace(qwen3, qk_norm_over="projection", norm_layout="post",
                                      norm_fp32_weight=True, rope_fp32=True)
                  )["model_type"] == "olmo2"
    with pytest.raises(ConfigError, match="model.qk_norm: True, but llama has False"):
        family(dataclasses.replace(qwen3, family="llama"))
    with pytest.raises(ConfigError, match="model.q.*fit no family"):
        family(dataclasses.replace(qwen3, qkv_bias=True))  # no family has both
    old = dataclasses.asdict(qwen3)
    assert model_config_from_state({"model_config": old}, tmp_path).family is None
    assert set(FAMILIES) >= {"llama", "mistral", "olmo2", "qwen3_moe"}


GEMMA3 = {"model__family": "gemma3_text", "model__qk_norm": "true",
          "model__norm_layout": "sandwich", "model__norm_plus_one": "true",
          "model__hidden_act": "gelu_tanh", "model__embed_scale": "true",
          "model__query_pre_attn_scalar": 24, "model__sliding_window": 9,
          "model__sliding_window_pattern": 2, "model__rope_local_theta": 10000.0,
          "model__tie_word_embeddings": "true", "model__norm_fp32_weight": "true"}
FAMILY_RUNS = {"mistral": {"model__family": "mistral", "model__sliding_window": 9},
               "gemma3_text": GEMMA3,
               "olmo2": {"model__family": "olmo2", "model__qk_norm": "true",
                         "model__qk_norm_over": "projection", "model__norm_layout": "post",
                         "model__norm_fp32_weight": "true", "model__rope_fp32": "true"}}


def _overrides(family, corpus, cache, out, **extra):
    return tiny_overrides(corpus, cache, out, **{"train__steps": 3, **FAMILY_RUNS[family],
                                                 **extra})


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILY_RUNS))
def test_tensor_parallel_equals_single_process_and_the_planner_counts(family, corpus,
                                                                     cache_dir, tmp_path):
    from threefold.layout import Layout, Workload
    from threefold.accounting import comm_bytes_per_step, num_parameters
    from threefold.launch.dryrun import predict
    from threefold.training.train import train

    over = functools.partial(_overrides, family, corpus, cache_dir)
    _, run = train(load_config(None, over(tmp_path / "single")), return_run=True)
    assert run.model_cfg.family == family
    assert num_parameters(run.model_cfg) == sum(p.numel()
                                                for p in run.engine.model.parameters())
    layouts = [("tp2_sp", {"parallel__tp": 2, "parallel__sequence_parallel": "true"})]
    if family == "gemma3_text":  # the whole matrix for a dense family
        layouts += [("dp2", {}), ("zero3", {"parallel__zero_stage": 3}),
                    ("pp2", {"parallel__pp": 2, "train__micro_batch_size": 2})]
    run_distributed(train_runs, 2, over, tmp_path, layouts, timeout=300)
    ref, ref_w = metrics(tmp_path / "single"), final_weights(tmp_path / "single")
    for name, extra in layouts:
        got = metrics(tmp_path / name)
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
        w = final_weights(tmp_path / name)
        for k, v in ref_w.items():
            # (OLMo 2's norms sum their squares over tp ranks in another order: one embedding
            # row element of 20,480, at rounding-noise gradient, moves 2.5e-5 under Adam)
            torch.testing.assert_close(w[k], v, rtol=1e-4, atol=5e-5, msg=f"{name}: {k}")
        # the dry run's meta model and the planner's closed forms agree on this layout, and
        # the planner's bytes per step are what rank 0 moved, axis by axis
        cfg = load_config(None, over(tmp_path / f"{name}-plan", **extra))
        want = comm_bytes_per_step(cfg.model.resolved(cfg.data.vocab_size),
                                   Layout.from_config(cfg, 2), Workload.from_config(cfg), 0)
        moved = json.loads((tmp_path / name / "summary.json").read_text())
        assert moved["comm_bytes_per_step"] == {a: v for a, v in want.items() if v}
        assert predict(cfg, 2).comm_bytes == want


def test_projection_norms_need_split_kv_heads():
    from threefold.layout import rules

    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                      qk_norm=True, qk_norm_over="projection", norm_layout="post",
                      family="olmo2").resolved()
    with pytest.raises(ConfigError, match="model.qk_norm_over"):
        rules.k_norm_needs_split_kv(cfg, 2)
    rules.k_norm_needs_split_kv(cfg, 1)


def test_the_planner_and_the_specs_need_no_torch():
    """The specs and the planner's closed forms import no torch (a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys\nimport threefold.families, threefold.accounting, threefold.plan.search, "
            "threefold.plan.step, threefold.plan.memory, threefold.plan.report\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


ACTIVATION_CASES = {
    "olmo2": dict(qk_norm=True, qk_norm_over="projection", norm_layout="post"),
    "gemma3": dict(qk_norm=True, norm_layout="sandwich", norm_plus_one=True,
                   hidden_act="gelu_tanh", embed_scale=True, query_pre_attn_scalar=24,
                   sliding_window=16, sliding_window_pattern=2, rope_local_theta=1e4),
    "mistral": dict(sliding_window=16),
}


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
@pytest.mark.parametrize("family", list(ACTIVATION_CASES))
def test_block_activation_bytes_equal_autograd_saved_tensors(family, tp, sp):
    """What one block of each new family saves for backward (fp32, weights excluded) is the
    planner's per-block count plus the fp32 RoPE tables, as tests/test_dryrun.py measures it
    for Llama: OLMo 2's projection norms, Gemma 3's extra norms, (1 + w) gains and GeGLU,
    and a sliding window's mask (the masked kernel's repeated K/V and converted mask; in
    Gemma 3's local blocks only, the global ones unmasked) are all counted."""
    from tests.test_dryrun import _Loopback
    from tests.test_tp_layer import SavedBytes
    from threefold.layout import Layout, Workload
    from threefold.model.attention import window_mask
    from threefold.parallel.transforms.tensor import apply_tensor_parallel
    from threefold.plan.activations import model_layer_activation_bytes

    cfg = ModelConfig(preset="tiny", vocab_size=512, **ACTIVATION_CASES[family]).resolved()
    model = CausalLM(cfg)
    if tp > 1:
        apply_tensor_parallel(model, _Loopback(tp), sp)
    b, s, h = 2, 64, cfg.hidden_size
    x = torch.randn(b, s // tp if sp else s, h, requires_grad=True)
    cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
    total = 0
    for block in model.model.layers[:2]:  # Gemma 3's: a sliding block, then a global one
        mask = window_mask(None, s, block.self_attn.window, x.device)
        with SavedBytes(list(model.parameters())) as saved:
            block(x, cos, sin, mask)
        total += saved.total
    lay = Layout(tp=tp, sequence_parallel=sp, microbatch_size=b)
    want = model_layer_activation_bytes(cfg, lay, Workload(s, b, precision="fp32",
                                                           residual_bytes=4))
    # the planner's is the blocks' average (+ RoPE's cos and sin, which the model keeps once)
    assert total / 2 == want + 2 * 4 * b * s * cfg.head_dim


# SmolLM2's widths (tests/test_memory_finetune.py) with Gemma 3's block, the family that
# differs most (OLMo 2 measured 1.02, 1.04, 0.96 of the dry run in the same test, 2026-12-06)
MEMORY_FAMILIES = {
    "gemma3_text": dict(family="gemma3_text", qk_norm=True, norm_layout="sandwich",
                        norm_plus_one=True, hidden_act="gelu_tanh", embed_scale=True,
                        query_pre_attn_scalar=64, sliding_window=64, sliding_window_pattern=2,
                        rope_local_theta=1e4, norm_fp32_weight=True),
}


def test_fine_tuning_each_family_peaks_as_the_dry_run_says(corpus, cache_dir, tmp_path):
    """Memory is a promise for the new families too: a full fine-tune (one process, SFT from
    a Hugging Face folder of Gemma 3, 128 tokens against its window of 64) measures
    within 10% of the dry run at start-up, loading and the step, as tests/test_memory_finetune
    measures Llama's, in fresh interpreters."""
    from tests.test_memory_finetune import (LAYERS, SEQ, SMOL, compare, finetune_overrides,
                                            run_children, write_conversations)
    from threefold.config import load_config
    from threefold.data import prepare_data
    from threefold.weights.hf import write_hf_folder
    from threefold.model.decoder import initial_weight
    from threefold.launch.dryrun import predict
    from threefold.plan.baseline import TaskData

    data = prepare_data(load_config(None, tiny_overrides(corpus, cache_dir,
                                                         tmp_path / "x")).data)
    chats = write_conversations(tmp_path / "chats.jsonl")
    specs, after, configs = {}, {}, {}
    for name, fields in MEMORY_FAMILIES.items():
        cfg = ModelConfig(**{**SMOL, "num_hidden_layers": LAYERS, **fields}).resolved()
        with torch.device("meta"):
            shapes = [(n, tuple(p.shape)) for n, p in CausalLM(cfg).named_parameters()]
        write_hf_folder(tmp_path / name, [(n, s, lambda n=n, s=s: initial_weight(n, s, cfg, 0))
                                          for n, s in shapes], cfg, Path(data.tokenizer_path))
        over = finetune_overrides(tmp_path / name, tmp_path / f"{name}-run", seq=SEQ, world=1,
                                  extra={"train.host_mmap_threshold_mb": "1"})
        configs[name] = over
        specs[name] = {"world": 1, "rank": 0, "overrides": over, "conversations": str(chats),
                       "resume": False, "save": True}
        specs[name + " (resumed)"] = {**specs[name], "resume": True, "save": False}
        after[name + " (resumed)"] = name
    results = run_children(specs, after)
    lines, failures = [], []
    for name, over in configs.items():
        got = {"startup": results[name]["startup"], "step": max(results[name]["steps"]),
               "loading": results[name + " (resumed)"]["loading"]}
        table, bad = compare(name, got, predict(load_config(None, over), 1,
                                                task=TaskData(str(chats), "auto")))
        lines += table
        failures += bad
    print("\n" + "\n".join(lines))
    assert not failures, "\n".join(lines)
