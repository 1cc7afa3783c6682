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
from threefold.config import ModelConfig
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
    """The KV cache with sinks and the window: 9 greedy tokens after 10 (window 7) equal
    transformers'; a left-padded batch row gives the tokens it gives alone."""
    from threefold.generation.generate import generate

    hf, model = twin[0], twin[4]
    prompt = torch.randint(0, 300, (1, 10))
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=9, do_sample=False, min_new_tokens=9)
        got = generate(model.eval(), prompt.tolist(), max_new_tokens=9)
        both = generate(model, [prompt[0, 3:].tolist(), prompt[0].tolist()], max_new_tokens=9)
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


def _mxfp4_folder(tmp_path):
    """A folder as published, written here: (folder, its safetensors dict, the known expert
    weights by name in the file's orientation, transformers' model holding them)."""
    from safetensors.torch import load_file, save_file

    from threefold.data import train_bpe

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
    train_bpe(["a few words to learn merges from"] * 4, 300).save(str(folder / "tokenizer.json"))
    return folder, files, known, hf


def test_mxfp4_experts_import_exactly_and_by_region(tmp_path):
    """A folder as published (experts in MXFP4, gate and up rows alternating) imports as the
    weights quantised, its logits transformers' on those weights; a box of experts reads
    exactly those experts' blocks and scales."""
    from safetensors.torch import save_file

    from threefold.weights import HFSource
    from threefold.weights.hf_config import HFError

    folder, files, known, hf = _mxfp4_folder(tmp_path)
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
    scales = files.pop(name + "_scales")  # a folder without them is refused by name
    save_file(files, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFError, match=f"{name}_scales is missing"):
        HFSource(folder)
    files[name + "_scales"] = scales
    ids = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), hf(ids).logits, rtol=0, atol=1e-5)


def test_presets_count_the_published_totals():
    """gpt-oss-120b and gpt-oss-20b as the planner counts them: OpenAI's model card gives
    116.8B and 20.9B parameters, 5.1B and 3.6B active per token (the embedding left out,
    the unembedding in); the model built on the meta device holds what the accounting says,
    in its registration order."""
    from threefold.accounting import active_parameters, num_parameters
    from threefold.accounting import block_parameter_numels

    for name, total, active in (("gpt-oss-120b", 116.8, 5.1), ("gpt-oss-20b", 20.9, 3.6)):
        cfg = ModelConfig(preset=name).resolved()
        assert round(num_parameters(cfg) / 1e9, 1) == total, name
        embedding = cfg.vocab_size * cfg.hidden_size
        assert round((active_parameters(cfg) - embedding) / 1e9, 1) == active, name
        small = dataclasses.replace(cfg, num_hidden_layers=2)
        with torch.device("meta"):
            model = CausalLM(small)
        assert sum(p.numel() for p in model.parameters()) == num_parameters(small)
        assert list(block_parameter_numels(small, 1)) == [
            p.numel() for p in model.model.layers[0].parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_block_activation_bytes_equal_autograd_saved_tensors(documents, dtype):
    """One GPT-OSS block (sinks, windows, biases, the clamped experts) keeps for backward
    what the planner counts, to the byte: the fused attention's count with the sink
    attention's whole scores in its place (``threefold.plan.sink_bytes``), the experts' as a
    mixture's, in a sliding block and a full one alike."""
    import contextlib

    from tests.test_tp_layer import SavedBytes
    from threefold.accounting import layer_parameters_per_rank
    from threefold.layout import Layout, Workload
    from threefold.model.attention import document_mask, window_mask
    from threefold.plan.activations import model_layer_activation_bytes
    from threefold.plan.moe_memory import moe_block_extra_bytes, moe_cast_weight_bytes

    cfg = dataclasses.replace(ModelConfig(preset="gpt-oss-20b").resolved(), vocab_size=512,
                              hidden_size=64, intermediate_size=64, num_attention_heads=8,
                              num_key_value_heads=4, attention_head_dim=16,
                              num_hidden_layers=2, num_local_experts=4,
                              num_experts_per_tok=2, sliding_window=16)
    model, tp = CausalLM(cfg), 1
    b, s, h = 2, 64, cfg.hidden_size
    x = torch.randn(b, s, h, requires_grad=True)
    cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
    docs = document_mask(torch.tensor([[0] * 30 + [1] * 34] * b)) if documents else None
    auto = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else \
        contextlib.nullcontext()
    d = 2 if dtype == torch.bfloat16 else 4
    lay = Layout(tp=tp, microbatch_size=b)
    work = Workload(s, b, precision="bf16" if d == 2 else "fp32", residual_bytes=4,
                    master_bytes=4, document_mask=documents, backend_copies=True, eager=True)
    want = model_layer_activation_bytes(cfg, lay, work) + moe_block_extra_bytes(cfg, lay, work)
    want += 2 * 4 * b * s * cfg.head_dim if d == 4 else \
        d * layer_parameters_per_rank(cfg, tp)[0] + moe_cast_weight_bytes(cfg, lay, work, 0) / 2
    for block in model.model.layers:  # a sliding block, then a full one
        with SavedBytes(list(model.parameters())) as saved, auto:
            block(x, cos, sin, window_mask(docs, s, block.self_attn.window, x.device))
        assert saved.total == want, block.self_attn.window


def test_sinks_under_tensor_parallelism_keep_what_the_planner_counts():
    """Under tp 2 a rank's sinks are its heads' and its scores those heads' only: what sinks
    add to a block's saved bytes is the planner's sink term at the rank's head count."""
    from tests.test_dryrun import _Loopback
    from tests.test_tp_layer import SavedBytes
    from threefold.layout import Layout, Workload
    from threefold.parallel.transforms.tensor import apply_tensor_parallel
    from threefold.plan.activations import model_layer_activation_bytes

    b, s, saved, want = 2, 64, [], []
    for sinks in (False, True):
        cfg = ModelConfig(preset="tiny", vocab_size=512, num_local_experts=4,
                          num_experts_per_tok=2, attention_sinks=sinks).resolved()
        model = apply_tensor_parallel(CausalLM(cfg), _Loopback(2), False)
        if sinks:  # the rank's 4 of the 8 heads
            assert model.model.layers[0].self_attn.sinks.shape == (4,)
        x = torch.randn(b, s, cfg.hidden_size, requires_grad=True)
        cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
        with SavedBytes(list(model.parameters())) as kept:
            model.model.layers[0](x, cos, sin)
        saved.append(kept.total)
        want.append(model_layer_activation_bytes(cfg, Layout(tp=2, microbatch_size=b),
                                                 Workload(s, b, precision="fp32",
                                                          residual_bytes=4)))
    assert saved[1] - saved[0] == want[1] - want[0] > 0


TRAIN = {"model__family": "gpt_oss", "model__num_local_experts": 4,
         "model__num_experts_per_tok": 2, "model__intermediate_size": 64,
         "model__qkv_bias": "true", "model__attention_out_bias": "true",
         "model__attention_sinks": "true", "model__moe_bias": "true",
         "model__moe_activation": "clamped_swiglu", "model__swiglu_limit": 0.05,
         "model__norm_fp32_weight": "true", "model__sliding_window": 8,
         "model__sliding_window_pattern": 2, "model__rope_scaling": "yarn",
         "model__rope_scaling_factor": 4.0, "model__original_max_position_embeddings": 16,
         "model__yarn_truncate": "false", "model__router_aux_loss_per_layer": "true",
         "train__micro_batch_size": 4, "train__steps": 3}
LAYOUTS = [("dp2", {}), ("zero3", {"parallel__zero_stage": 3}), ("tp2", {"parallel__tp": 2}),
           ("pp2", {"parallel__pp": 2}), ("ep2", {"parallel__ep": 2})]


def _overrides(corpus, cache, out, **extra):
    from tests.conftest import tiny_overrides

    return tiny_overrides(corpus, cache, out, **{**TRAIN, **extra})


@pytest.mark.slow
def test_layouts_equal_single_process_and_the_planner_counts(corpus, cache_dir, tmp_path):
    """DP, ZeRO-3, TP 2 (each rank its heads' sinks, o_proj's bias on one rank), PP 2 and
    EP 2 (each rank its experts' biases) train as one process does (the sinks and biases
    move from 0, the clamp acting), with the bytes per axis the planner says."""
    import functools

    from tests.conftest import assert_layouts_train_as_one_process
    from tests.dist import run_distributed, train_runs
    from threefold.accounting import num_parameters
    from threefold.config import load_config
    from threefold.training.train import train

    over = functools.partial(_overrides, corpus, cache_dir)
    _, run = train(load_config(None, over(tmp_path / "single")), return_run=True)
    assert run.model_cfg.family == "gpt_oss"
    assert num_parameters(run.model_cfg) == sum(p.numel() for p in run.engine.model.parameters())
    run_distributed(train_runs, 2, over, tmp_path, LAYOUTS, timeout=300)
    ref_w = assert_layouts_train_as_one_process(tmp_path, over, LAYOUTS)
    for key in ("self_attn.sinks", "self_attn.o_proj.bias", "mlp.gate.bias",
                "experts.gate_up_proj_bias", "experts.down_proj_bias"):
        assert ref_w[f"model.layers.0.{key.replace('experts', 'mlp.experts')}"].abs().max() > 0


def test_selective_recompute_with_sinks_keeps_what_the_planner_counts(monkeypatch):
    """Under selective recompute a block with sinks keeps its input and the matmuls' outputs
    (the sink attention's products are recomputed with its scores): to the byte the
    planner's selective count."""
    from tests.test_plan_moe import _first_block_saved, _kept_bytes
    from threefold.layout import Layout, Workload
    from threefold.parallel.transforms import recompute
    from threefold.plan.activations import model_layer_activation_bytes

    keeps = []
    init = recompute._Keep.__init__
    monkeypatch.setattr(recompute._Keep, "__init__",
                        lambda self, kept, modules=(): (keeps.append(kept),
                                                        init(self, kept, modules))[1])
    cfg = ModelConfig(preset="tiny", vocab_size=512, num_local_experts=8,
                      num_experts_per_tok=2, attention_sinks=True, moe_bias=True,
                      moe_activation="clamped_swiglu").resolved()
    model = CausalLM(cfg)
    recompute.apply_recompute(model, "selective")
    b, s, h = 2, 64, cfg.hidden_size
    saved, x = _first_block_saved(model, b, s, h, torch.float32)
    rope = 2 * 4 * b * s * cfg.head_dim
    assert saved.total == 4 * b * s * h + rope  # autograd saves the checkpoint's inputs only
    work = Workload(seq_len=s, global_batch=b, precision="fp32", residual_bytes=4,
                    master_bytes=4)
    got = saved.total + _kept_bytes(keeps[0], [x, *model.parameters()])
    assert got - rope == model_layer_activation_bytes(
        cfg, Layout(microbatch_size=b, recompute="selective"), work)


def test_a_published_config_reads_as_the_preset():
    """gpt-oss-20b's config.json as OpenAI publishes it (RoPE in 4.x's rope_theta and
    rope_scaling, YaRN untruncated, MXFP4 experts) reads as the gpt-oss-20b preset, but for
    the load-balancing loss's weight, which the preset leaves at transformers' default;
    another quantisation is refused by name."""
    from threefold.weights.hf_config import HFError, model_config_from_hf

    conf = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "attention_bias": True, "attention_dropout": 0.0, "head_dim": 64,
            "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
            "max_position_embeddings": 131072, "num_attention_heads": 64,
            "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
            "num_local_experts": 32, "quantization_config": {"quant_method": "mxfp4"},
            "rms_norm_eps": 1e-05, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "rope_type": "yarn",
                             "truncate": False},
            "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
            "vocab_size": 201088}
    got = model_config_from_hf(conf)
    assert got == dataclasses.replace(ModelConfig(preset="gpt-oss-20b").resolved(),
                                      preset="tiny", router_aux_loss_coef=0.9)
    with pytest.raises(HFError, match="quantization_config.*MXFP4"):
        model_config_from_hf({**conf, "quantization_config": {"quant_method": "fp8"}})


def test_an_ep_rank_starts_from_mxfp4_reading_its_experts_alone(corpus, cache_dir, tmp_path,
                                                                monkeypatch):
    """Each rank of ep 2 (one at a time, on torch's fake process group: starting needs no
    collective) starts from the MXFP4 folder: its experts hold exactly the known weights of
    its half, and it reads every other tensor once and of the experts its own half's
    blocks, scales and biases, nothing of the other half."""

    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers "fake")

    from tests.conftest import tiny_overrides
    from tests.dist import local_object_collectives
    from threefold.config import load_config
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import build_run

    folder, files, known, _ = _mxfp4_folder(tmp_path)
    total = sum(t.numel() * t.element_size() for t in files.values())
    expert_bytes = sum(t.numel() * t.element_size() for n, t in files.items()
                       if ".mlp.experts." in n)
    local_object_collectives(dist)
    deinterleave = torch.cat((torch.arange(0, 128, 2), torch.arange(1, 128, 2)))
    for r in range(2):
        over = tiny_overrides(corpus, cache_dir, tmp_path / f"r{r}", parallel__ep=2,
                              checkpoint__init_from=str(folder), data__seq_len=16,
                              train__global_batch_size=2, train__micro_batch_size=1,
                              model__router_aux_loss_per_layer="true")
        cfg = load_config(None, [(k, v) for k, v in over if not k.startswith("model.")
                                 or k == "model.router_aux_loss_per_layer"])
        for key, value in (("RANK", r), ("WORLD_SIZE", 2), ("LOCAL_RANK", r)):
            monkeypatch.setenv(key, str(value))  # (undone after the test)
        dist.init_process_group("fake", store=dist.HashStore(), rank=r, world_size=2)
        try:
            run = build_run(cfg, Distributed(cfg))
            experts = run.engine.model.model.layers[3].mlp.experts
            name = "model.layers.3.mlp.experts."
            assert torch.equal(experts.gate_up_proj.detach(),
                               known[name + "gate_up_proj"][2 * r:2 * r + 2][:, deinterleave])
            assert torch.equal(experts.down_proj.detach(),
                               known[name + "down_proj"][2 * r:2 * r + 2])
            assert run.memory["init_from_bytes_read"] == total - expert_bytes / 2
        finally:
            dist.destroy_process_group()
