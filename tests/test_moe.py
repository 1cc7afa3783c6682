"""Mixture of experts (threefold.model.moe): logits equal transformers' MixtralForCausalLM, dropless
sorted routing equals the dense all-experts sum, the router losses equal a direct computation
and transformers' load_balancing_loss_func, Hugging Face export/import, a training run that
logs per-expert counts, exact parameter counts of the presets, and the layout refusal."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed
from tests.test_hf import assert_round_trip
from threefold.commands import convert
from threefold.weights import hf
from threefold.weights import hf_config
from threefold.accounting import active_parameters, flops_per_token, num_parameters
from threefold.config import ConfigError, ModelConfig, load_config
from threefold.model.decoder import CausalLM
from threefold.model.moe import (RouterLog, SparseMoeBlock, load_balancing_loss, route,
                           router_z_loss, take_router_stats)

transformers = pytest.importorskip("transformers")
VOCAB = 300


def moe_cfg(**kw) -> ModelConfig:
    """A small resolved MoE config (hidden 64, 2 layers, GQA 4:2, 4 experts, top-2)."""
    base = dict(preset="tiny", vocab_size=VOCAB, hidden_size=64, intermediate_size=48,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                num_local_experts=4, num_experts_per_tok=2)
    base.update(kw)
    return ModelConfig(**base).resolved()


def mixtral(cfg: ModelConfig):
    """transformers.MixtralForCausalLM with the shape of ``cfg``."""
    hcfg = transformers.MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        num_local_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attn_implementation="eager")
    return transformers.MixtralForCausalLM(hcfg).eval()


def ours_random(cfg: ModelConfig, seed: int = 3) -> CausalLM:
    """Our model with a large init (peaked attention and routing) and random norm weights."""
    model = CausalLM(dataclasses.replace(cfg, init_std=0.1)).eval()
    model.init_weights(seed=seed)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model


CASES = {"gqa-top2": moe_cfg(), "mha-top1": moe_cfg(num_key_value_heads=4, num_experts_per_tok=1),
         "gqa-8experts-top3-tied": moe_cfg(num_local_experts=8, num_experts_per_tok=3,
                                            num_key_value_heads=1, tie_word_embeddings=True)}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_mixtral(case):
    cfg = CASES[case]
    ours = ours_random(cfg)
    ref = mixtral(cfg)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(0))
    pos = torch.stack([torch.arange(37), torch.arange(37) + 300])
    with torch.no_grad():
        for p in (None, pos):
            a, b = ours(ids, position_ids=p), ref(input_ids=ids, position_ids=p).logits
            assert (a - b).abs().max().item() <= 1e-5
    assert set(ours.state_dict()) == set(ref.state_dict())


def test_sorted_dropless_routing_equals_dense_sum_forward_and_backward():
    cfg = moe_cfg(num_local_experts=6, num_experts_per_tok=2)
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg)
    for p in block.parameters():
        nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 11, cfg.hidden_size, requires_grad=True)
    out = block(x)
    # reference: every expert on every token, weighted by the renormalised top-k (zero else)
    flat = x.reshape(-1, cfg.hidden_size)
    _, w, idx = route(flat @ block.gate.weight.T, 2)
    dense_w = torch.zeros(flat.shape[0], 6).scatter(1, idx, w)
    ref = torch.zeros_like(flat)
    for e in range(6):
        g, u = (flat @ block.experts.gate_up_proj[e].T).chunk(2, -1)
        ref = ref + dense_w[:, e:e + 1] * ((F.silu(g) * u) @ block.experts.down_proj[e].T)
    assert torch.allclose(out.reshape(-1, cfg.hidden_size), ref, atol=1e-5, rtol=1e-5)
    mine = torch.autograd.grad(out.square().sum(), [x, *block.parameters()])
    theirs = torch.autograd.grad(ref.square().sum(), [x, *block.parameters()])
    for a, b in zip(mine, theirs):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    # counts: every token reaches its k experts (no capacity, nothing dropped)
    assert int(block.router_stats.counts.sum()) == 33 * 2
    assert torch.equal(block.router_stats.counts, torch.bincount(idx.flatten(), minlength=6))


def test_router_losses_equal_direct_computation_and_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = CASES["gqa-top2"]
    ours = ours_random(cfg)
    ref = mixtral(cfg)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ids = torch.randint(0, VOCAB, (3, 29), generator=torch.Generator().manual_seed(2))
    logits = []  # each router's logits, captured from our own blocks
    hooks = [m.gate.register_forward_hook(lambda mod, i, o: logits.append(o.detach()))
             for m in ours.modules() if isinstance(m, SparseMoeBlock)]
    with torch.no_grad():
        ours(ids)
        out = ref(input_ids=ids, output_router_logits=True)
    for h in hooks:
        h.remove()
    stats = take_router_stats(ours)
    assert len(stats) == 2 and take_router_stats(ours) == []  # taken once
    aux, z = load_balancing_loss(stats, 4), router_z_loss(stats)
    # direct: pooled over layers, f = top-k assignments / rows, P = mean probability
    allp = F.softmax(torch.cat(logits), -1)
    top = allp.topk(2, -1).indices
    f = torch.bincount(top.flatten(), minlength=4).float() / allp.shape[0]
    assert aux.item() == pytest.approx(4 * (f * allp.mean(0)).sum().item(), rel=1e-6)
    want = load_balancing_loss_func(out.router_logits, 4, 2)
    assert aux.item() == pytest.approx(want.item(), rel=1e-6)
    assert z.item() == pytest.approx(torch.logsumexp(torch.cat(logits), -1).pow(2).mean().item(),
                                     rel=1e-6)
    for s in stats:  # routed assignments = tokens × top-k, in every layer
        assert int(s.counts.sum()) == 3 * 29 * 2 and s.tokens == 3 * 29
    # balanced routing gives k, whatever E
    even = dataclasses.replace(stats[0], prob_sum=torch.full((4,), 88 / 4),
                               counts=torch.full((4,), 88 * 2 // 4), tokens=88)
    assert load_balancing_loss([even], 4).item() == pytest.approx(2.0)


def test_router_log_weights_micro_batches_by_their_units():
    cfg = dataclasses.replace(CASES["gqa-top2"], router_aux_loss_coef=0.5, router_z_loss_coef=0.1)
    model = ours_random(cfg)
    log = RouterLog(cfg)
    terms, direct = [], []
    for rows, count in ((2, 40), (1, 20)):
        ids = torch.randint(0, VOCAB, (rows, 20), generator=torch.Generator().manual_seed(rows))
        model(ids)
        stats = list(s for s in (m.router_stats for m in model.modules()
                                 if isinstance(m, SparseMoeBlock)))
        direct.append((load_balancing_loss(stats, 4).item(), router_z_loss(stats).item(), count))
        terms.append(log.add(model, count).item())
    for t, (a, z, c) in zip(terms, direct):
        assert t == pytest.approx((0.5 * a + 0.1 * z) * c, rel=1e-6)
    m = log.metrics(60)
    assert m["router_aux_loss"] == pytest.approx((direct[0][0] * 40 + direct[1][0] * 20) / 60)
    assert m["router_z_loss"] == pytest.approx((direct[0][1] * 40 + direct[1][1] * 20) / 60)
    assert sum(m["expert_counts"]) == 60 * 2 * 2  # tokens × k × layers
    assert m["expert_imbalance"] == max(m["expert_counts"]) / (240 / 4)


# --------------------------------------------------------------------------------------------
# Training and Hugging Face interop
# --------------------------------------------------------------------------------------------
MOE_RUN = dict(model__num_local_experts=4, model__num_experts_per_tok=2,
               model__intermediate_size=64, model__router_z_loss_coef=0.001)


@pytest.fixture(scope="module")
def moe_run(corpus, cache_dir, tmp_path_factory):
    """A 6-step MoE run and its export to a Hugging Face folder."""
    from threefold.training.train import train

    root = tmp_path_factory.mktemp("moe")
    summary = train(load_config(None, tiny_overrides(corpus, cache_dir, root / "run",
                                                     **MOE_RUN)))
    assert convert.main(["--to", "hf", str(root / "run"), str(root / "exported")]) == 0
    return root, summary


def test_training_decreases_loss_and_logs_expert_counts(moe_run):
    root, summary = moe_run
    recs = metrics(root / "run")
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert summary["validation_loss"] < summary["initial_validation_loss"]
    mcfg = ModelConfig(**json.loads((root / "run" / "config.json").read_text())["model"])
    assert summary["parameters"] == num_parameters(mcfg.resolved(320))
    assert summary["active_parameters"] == active_parameters(mcfg.resolved(320)) \
        == summary["parameters"] - 2 * 2 * 3 * 64 * 64  # 2 idle experts of 3·h·f, 2 layers
    for r in recs:  # 8 sequences × 32 tokens, top-2, 2 layers
        assert len(r["expert_counts"]) == 4 and sum(r["expert_counts"]) == 8 * 32 * 2 * 2
        assert r["expert_imbalance"] == pytest.approx(max(r["expert_counts"]) / 256)
        assert r["router_aux_loss"] >= 2 - 1e-6 and r["router_z_loss"] > 0  # k when balanced


def test_resume_is_bit_identical(moe_run, corpus, cache_dir, tmp_path):
    import shutil

    from threefold.training.train import train

    root, _ = moe_run
    part = tmp_path / "part"
    for extra in ({"checkpoint__interval": 3, "checkpoint__save_final": "false"},
                  {"checkpoint__resume": "true"}):
        train(load_config(None, tiny_overrides(corpus, cache_dir, part, **MOE_RUN, **extra)))
        shutil.rmtree(part / "checkpoints" / "6", ignore_errors=True)  # stopped after step 3
    assert metrics(part)[3:] and [{k: r[k] for k in ("loss", "expert_counts")}
                                  for r in metrics(part)] == \
        [{k: r[k] for k in ("loss", "expert_counts")} for r in metrics(root / "run")]


def test_router_losses_reach_the_gradient_and_recompute_changes_nothing(corpus, cache_dir,
                                                                        tmp_path):
    from threefold.training.train import train

    def losses(name, **kw):
        train(load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / name,
                                               **{**MOE_RUN, "train__steps": 3, **kw})))
        return [r["loss"] for r in metrics(tmp_path / name)]

    base = losses("base")
    assert losses("recompute", train__activation_checkpointing="true") == \
        pytest.approx(base, rel=1e-5)
    # the first step's loss is the same, the later ones move with the router terms' gradient
    other = losses("no-router-loss", model__router_aux_loss_coef=0, model__router_z_loss_coef=0)
    assert other[0] == base[0] and other[2] != pytest.approx(base[2], rel=1e-7)


def test_export_loads_in_transformers_and_imports_back(moe_run, tmp_path):
    root, _ = moe_run
    conf = json.loads((root / "exported" / "config.json").read_text())
    assert conf["model_type"] == "mixtral" and conf["architectures"] == ["MixtralForCausalLM"]
    assert (conf["num_local_experts"], conf["num_experts_per_tok"]) == (4, 2)
    cfg, weights = hf.load_pretrained(root / "run")
    ours = CausalLM(cfg).eval()
    ours.load_state_dict(weights, strict=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(root / "exported").eval()
    assert type(theirs).__name__ == "MixtralForCausalLM"
    ids = torch.randint(0, conf["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= 1e-5
    back, bw, _ = hf.import_hf(root / "exported")
    assert (back.num_local_experts, back.num_experts_per_tok) == (4, 2)
    assert set(bw) == set(weights) and all(torch.equal(bw[k], weights[k]) for k in bw)
    # the file holds the published per-expert layout (what save_pretrained writes)
    from safetensors import safe_open

    with safe_open(str(root / "exported" / hf_config.SINGLE), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in keys
    assert not any(".mlp." in k for k in keys)
    # a folder in the fused in-memory layout imports too
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text(json.dumps(conf))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(fused / hf_config.SINGLE),
              metadata={"format": "pt"})
    _, fw, _ = hf.import_hf(fused)
    assert all(torch.equal(fw[k], weights[k]) for k in weights)
    # a missing expert is named
    with safe_open(str(root / "exported" / hf_config.SINGLE), "pt") as f:
        partial = {k: f.get_tensor(k) for k in keys if ".experts.2.w3" not in k}
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(conf))
    save_file(partial, str(broken / hf_config.SINGLE), metadata={"format": "pt"})
    with pytest.raises(hf_config.HFError, match=r"experts\.2\.w3\.weight is missing"):
        hf.import_hf(broken)


def test_hf_made_mixtral_round_trips(tmp_path):
    cfg = CASES["gqa-top2"]
    theirs = mixtral(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    theirs.save_pretrained(tmp_path / "src")
    got, weights, _ = hf.import_hf(tmp_path / "src")
    assert (got.num_local_experts, got.num_experts_per_tok) == (4, 2)
    ours = CausalLM(got).eval()
    hf.init_from_hf(ours, tmp_path / "src")
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(ids).logits
        assert (ours(ids) - want).abs().max().item() <= 1e-5
        assert_round_trip(tmp_path, ids, want)
    # another expert count is named, not loaded
    other = CausalLM(dataclasses.replace(got, num_local_experts=8))
    with pytest.raises(hf_config.HFError, match="num_local_experts"):
        hf.init_from_hf(other, tmp_path / "src")


# mistralai/Mixtral-8x7B-v0.1's config.json (transformers 4.x fields: rope_theta, no
# rope_parameters)
MIXTRAL_8X7B_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 32000}


def test_published_mixtral_config_imports_as_the_preset():
    got = hf_config.model_config_from_hf(MIXTRAL_8X7B_CONFIG)
    want = ModelConfig(preset="mixtral-8x7b").resolved()
    for name in hf_config.SHAPE_FIELDS + ("max_position_embeddings", "router_aux_loss_coef"):
        assert getattr(got, name) == getattr(want, name), name
    assert num_parameters(got) == 46_702_792_704
    assert hf_config.model_config_from_hf(hf_config.hf_config(got)) == got  # and back


@pytest.mark.parametrize("change,field", [({"sliding_window": 4096}, "sliding_window"),
                                          ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
                                          ({"num_experts_per_tok": 9}, "num_experts_per_tok")])
def test_unsupported_mixtral_configs_are_named(change, field):
    base = mixtral(CASES["gqa-top2"]).config.to_dict()
    assert hf_config.model_config_from_hf(base).num_local_experts == 4
    with pytest.raises(hf_config.HFError, match=field):
        hf_config.model_config_from_hf({**base, **change})


# --------------------------------------------------------------------------------------------
# Presets, counts and the layout
# --------------------------------------------------------------------------------------------
# (total, active per token): Mixtral-8x7B as published (46.7B / 12.9B); OLMoE-1B-7B's shape
# without its q/k norms (OLMoE: 6.92B / 1.28B, 65,536 more for the q/k norm weights).
PRESET_COUNTS = {"mixtral-8x7b": (46_702_792_704, 12_879_925_248),
                 "olmoe-shape-1b-7b": (6_919_096_320, 1_281_951_744),
                 "tiny-moe": (11_348_224, 5_007_616)}


@pytest.mark.parametrize("preset", list(PRESET_COUNTS))
def test_preset_parameter_counts_on_meta(preset):
    cfg = ModelConfig(preset=preset).resolved(vocab_size=4096)
    with torch.device("meta"):
        model = CausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    idle = experts * (cfg.num_local_experts - cfg.num_experts_per_tok) // cfg.num_local_experts
    assert (total, total - idle) == (num_parameters(cfg), active_parameters(cfg)) \
        == PRESET_COUNTS[preset]
    # MFU counts the active matmuls only (the router included)
    dense = dataclasses.replace(cfg, num_local_experts=0,
                                intermediate_size=cfg.intermediate_size * cfg.num_experts_per_tok)
    router = cfg.num_hidden_layers * cfg.num_local_experts * cfg.hidden_size
    assert flops_per_token(cfg, 128) == flops_per_token(dense, 128) + 6 * router


def test_dense_presets_are_unchanged():
    cfg = ModelConfig(preset="llama3-8b").resolved()
    assert cfg.num_local_experts == 0 and active_parameters(cfg) == num_parameters(cfg)
    assert not any(isinstance(m, SparseMoeBlock) for m in CausalLM(
        ModelConfig(preset="tiny").resolved(320)).modules())


def test_moe_is_refused_with_model_parallelism_and_bad_shapes_are_named(capsys):
    from threefold.commands.main import main
    from threefold.layout import validate_layout

    cfg = load_config(None, [("model.preset", "tiny-moe")])
    validate_layout(cfg, 1, cfg.model.resolved(320))
    validate_layout(cfg, 4, cfg.model.resolved(320))  # data parallel / ZeRO
    # cp takes experts now (router statistics pooled over cp: tests/test_ulysses.py
    # test_experts_under_cp_train_as_one_process);
    # sequence parallelism still does not (the MoE is whole on every tp rank)
    for mcfg in (cfg.model.resolved(320), None):
        validate_layout(load_config(None, [("model.preset", "tiny-moe"), ("parallel.cp", "2")]),
                        2, mcfg)
    bad = load_config(None, [("model.preset", "tiny-moe"), ("parallel.tp", "2"),
                             ("parallel.sequence_parallel", "true")])
    for mcfg in (bad.model.resolved(320), None):
        with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel: tp=2 with a mixture "
                           r"of experts \(model\.num_local_experts=8\)"):
            validate_layout(bad, 2, mcfg)
    # the dry run refuses what the runtime refuses, by name, before anything (the planner and
    # the dry run model experts: tests/test_plan_moe.py)
    capsys.readouterr()
    assert main(["train", "--dry-run", "--model.preset", "mixtral-8x7b", "--parallel.tp", "2",
                 "--parallel.sequence_parallel", "true", "--nproc-per-node", "8"]) == 2
    assert "num_local_experts" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="model.num_experts_per_tok"):
        load_config(None, [("model.preset", "tiny-moe"), ("model.num_experts_per_tok", "9")])
    with pytest.raises(ConfigError, match="model.num_local_experts"):
        load_config(None, [("model.num_local_experts", "-1")])


# --------------------------------------------------------------------------------------------
# Data parallel and ZeRO
# --------------------------------------------------------------------------------------------
def _dp_runs(rank, world, corpus, cache, root, runs):
    """Each rank: train every run of ``runs`` in this process group."""
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    for name, extra in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name,
                                               **{**MOE_RUN, "train__steps": 3, **extra}))
        train(cfg, Distributed(cfg))


def test_data_parallel_and_zero_train_as_one_process(corpus, cache_dir, tmp_path):
    """Two ranks of 4 sequences each route what one process routes with micro-batches of 4
    (the router losses are per micro-batch), so every ZeRO stage equals that run."""
    from threefold.training.train import train

    ref = tmp_path / "single"
    train(load_config(None, tiny_overrides(corpus, cache_dir, ref, **{
        **MOE_RUN, "train__steps": 3, "train__micro_batch_size": 4})))
    want, weights = metrics(ref), final_weights(ref)
    runs = [(f"zero{z}", {"parallel__zero_stage": z}) for z in (0, 1, 2, 3)]
    run_distributed(_dp_runs, 2, corpus, cache_dir, tmp_path, runs)
    for name, _ in runs:
        got = metrics(tmp_path / name)
        for key in ("loss", "router_aux_loss", "router_z_loss"):
            assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), \
                (name, key)
        assert [r["expert_counts"] for r in got] == [r["expert_counts"] for r in want], name
        for k, w in final_weights(tmp_path / name).items():
            torch.testing.assert_close(w, weights[k], rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")


# --------------------------------------------------------------------------------------------
# Qwen2-MoE-style options: a shared expert, no renormalisation of the top-k weights
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("normalise", [False, True])
def test_shared_expert_block_equals_qwen2_moe(normalise):
    """With ``shared_expert_intermediate_size`` and ``norm_topk_prob`` our block holds the
    parameters of transformers' Qwen2MoeSparseMoeBlock under the same names and computes
    the same output and input gradient (≤ 1e-5); the parameter count includes the shared
    expert and its gate, always active."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = moe_cfg(shared_expert_intermediate_size=40, norm_topk_prob=normalise)
    ours = SparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    hcfg = transformers.Qwen2MoeConfig(
        hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.intermediate_size,
        shared_expert_intermediate_size=40, num_experts=cfg.num_local_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=normalise)
    theirs = Qwen2MoeSparseMoeBlock(hcfg)
    theirs.load_state_dict(ours.state_dict(), strict=True)  # the same names and shapes
    x = torch.randn(3, 7, cfg.hidden_size, generator=g)
    dy = torch.randn(3, 7, cfg.hidden_size, generator=g)
    outs = []
    for block in (ours, theirs):
        xi = x.clone().requires_grad_()
        y = block(xi)
        (y * dy).sum().backward()
        outs.append((y.detach(), xi.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)
    full = moe_cfg(shared_expert_intermediate_size=40)
    shared = 3 * 64 * 40 + 64
    assert num_parameters(full) == num_parameters(moe_cfg()) + 2 * shared
    assert active_parameters(full) == active_parameters(moe_cfg()) + 2 * shared
    with torch.device("meta"):
        assert sum(p.numel() for p in CausalLM(full).parameters()) == num_parameters(full)
    # a shared expert exports as Qwen2-MoE; unrenormalised top-k weights alone have no family
    assert hf_config.family(full)["model_type"] == "qwen2_moe"
    with pytest.raises(ConfigError, match="model.norm_topk_prob"):
        hf_config.family(moe_cfg(norm_topk_prob=False))
