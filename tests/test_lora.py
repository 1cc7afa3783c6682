"""LoRA: adapters on the named layers, only they train, reduce and
checkpoint; DP2, ZeRO-2×2, ZeRO-3×2 and TP2(+SP) equal one process; resume is bit-identical from
adapter-only checkpoints; GRPO's reference is the base with adapters off; SFT equals PEFT +
TRL's SFTTrainer from the same initial adapters."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed, train_runs
from tests.test_sft import OPTIM, TRL_CONVS, base, trl_args, trl_stack  # noqa: F401
from threefold.layout import Layout, Workload
from threefold.accounting import comm_bytes_per_step
from threefold.config import ConfigError, LoRAConfig, ModelConfig, load_config
from threefold.model.lora import LoRALinear, adapters_off, apply_lora
from threefold.model.decoder import CausalLM, initial_weight
from threefold.post import SFTOptions, SFTTask
from threefold.launch.dryrun import predict
from threefold.training.train import train

LORA = {"lora__r": "4", "lora__alpha": "8"}


def test_adapters_start_at_the_base_and_only_they_train():
    cfg = ModelConfig(preset="tiny", vocab_size=300).resolved()
    torch.manual_seed(0)
    model = CausalLM(cfg)
    ids = torch.randint(0, 300, (2, 16))
    before = model(ids)
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules="q_proj,down_proj"),
               trainable=("lm_head.weight",))
    for name, p in model.named_parameters():
        p.data = initial_weight(name, tuple(p.shape), cfg, 0) if "lora" in name else p.data
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoRALinear) and q.lora_scale == 2.0
    assert q.lora_A.weight.shape == (4, cfg.hidden_size)
    assert not isinstance(model.model.layers[0].self_attn.k_proj, LoRALinear)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {f"model.layers.{i}.{m}.{ab}.weight" for i in range(cfg.num_hidden_layers)
                       for m in ("self_attn.q_proj", "mlp.down_proj")
                       for ab in ("lora_A", "lora_B")} | {"lm_head.weight"}
    assert torch.equal(model(ids), before)  # B starts at zero
    bound = 1 / cfg.hidden_size ** 0.5
    assert q.lora_A.weight.abs().max() <= bound and q.lora_A.weight.std() > bound / 4
    with torch.no_grad():
        q.lora_B.weight.fill_(0.01)
    assert not torch.equal(model(ids), before)
    with adapters_off(model):
        assert torch.equal(model(ids), before)


def test_bad_lora_settings_are_refused_by_field():
    for over, needle in (({"lora.r": "-1"}, "lora.r"), ({"lora.r": "4", "lora.dropout": "1"},
                                                        "lora.dropout"),
                         ({"lora.r": "4", "lora.target_modules": "qkv"}, "lora.target_modules")):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, list(over.items()))
    # what LoRA runs with is the rule book's, checked against the layout before launch
    from threefold.layout import validate_layout

    for over, needle in (({"lora.r": "4", "parallel.ep": "2", "model.preset": "tiny-moe"},
                          "lora.r: LoRA does not adapt a mixture of experts"),
                         ({"lora.r": "4", "model.num_local_experts": "4"}, "lora.r")):
        with pytest.raises(ConfigError, match=needle):
            validate_layout(load_config(None, list(over.items())), 2)


def lora_overrides(corpus, cache, out, **extra):
    return tiny_overrides(corpus, cache, out, **{"data__seq_len": 128, "train__steps": 3,
                                                 "train__eval_batches": 1, **LORA, **extra})


LAYOUTS = [("dp2", {"train__micro_batch_size": 2}),
           ("zero2", {"parallel__zero_stage": 2}),
           ("zero3_accum", {"parallel__zero_stage": 3, "train__micro_batch_size": 2}),
           ("tp2_sp", {"parallel__tp": 2, "parallel__sequence_parallel": "true"}),
           ("tp2", {"parallel__tp": 2, "parallel__sequence_parallel": "false",
                    "train__micro_batch_size": 2}),
           ("pp2", {"parallel__pp": 2, "train__micro_batch_size": 2}),
           ("pp2_zb", {"parallel__pp": 2, "parallel__schedule": "zb-h1",
                       "train__micro_batch_size": 2}),
           ("cp2", {"parallel__cp": 2}),
           ("cp2_zero3", {"parallel__cp": 2, "parallel__zero_stage": 3})]
FOUR = {"model__num_hidden_layers": 4}  # a V needs a block per chunk: its own reference
V_LAYOUT = [("pp2_zbv", {"parallel__pp": 2, "parallel__vpp": 2, "parallel__schedule": "zb-v",
                         "train__micro_batch_size": 2, **FOUR}),
            ("pp2_interleaved", {"parallel__pp": 2, "parallel__vpp": 2,
                                 "parallel__schedule": "interleaved-1f1b",
                                 "train__micro_batch_size": 2, **FOUR})]


# another model (tied embeddings: ZeRO-3's frozen root unit, gathered once a step): bytes only
BYTES_ONLY = [("zero3_tied", {"parallel__zero_stage": 3, "model__tie_word_embeddings": "true",
                              "train__micro_batch_size": 2}),
              ("pp2_tied", {"parallel__pp": 2, "model__tie_word_embeddings": "true",
                            "train__micro_batch_size": 2})]


@pytest.mark.slow
def test_lora_layouts_equal_single_process_and_resume(corpus, cache_dir, tmp_path):
    """SFT with LoRA: every layout's losses and adapters equal one process's; only the
    adapters are in the checkpoints, and data parallelism all-reduces only their gradients
    (the dp bytes of a step are the adapters' fp32 gradients: a 2-rank all-reduce sends one
    copy); a resume from step 2 is bit-identical."""
    over = functools.partial(lora_overrides, corpus, cache_dir)
    summary, run = train(load_config(None, over(tmp_path / "single")), task=SFTTask(),
                         return_run=True)
    n_adapters = sum(p.numel() for _, p in run.engine.named_params)
    ref, ref_w = metrics(tmp_path / "single"), final_weights(tmp_path / "single")
    assert set(ref_w) == {n for n, _ in run.engine.named_params}
    assert all("lora_" in k for k in ref_w) and ref[-1]["loss"] != ref[0]["loss"]
    train(load_config(None, over(tmp_path / "single4", **FOUR)), task=SFTTask())
    run_distributed(train_runs, 2, over, tmp_path, LAYOUTS + V_LAYOUT + BYTES_ONLY, SFTTask,
                    timeout=300)
    for name, extra in LAYOUTS + V_LAYOUT:
        base = tmp_path / ("single4" if (name, extra) in V_LAYOUT else "single")
        got, want, want_w = metrics(tmp_path / name), metrics(base), final_weights(base)
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5), \
            name
        w = final_weights(tmp_path / name)
        assert set(w) == set(want_w), name
        for k, v in want_w.items():
            torch.testing.assert_close(w[k], v, rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")
    dp = metrics(tmp_path / "dp2")
    assert all(r["comm_bytes"]["dp"] == 4 * n_adapters for r in dp)
    for name, extra in LAYOUTS + V_LAYOUT + BYTES_ONLY:  # every byte sent: the planner's
        cfg = load_config(None, over(tmp_path / name, **extra))
        want = comm_bytes_per_step(cfg.model.resolved(cfg.data.vocab_size),
                                   Layout.from_config(cfg, 2), Workload.from_config(cfg))
        got = json.loads((tmp_path / name / "summary.json").read_text())["comm_bytes_per_step"]
        assert set(got) <= set(want), (name, got)
        assert {a: got.get(a, 0) for a in want} == {a: float(v) for a, v in want.items()}, name
        assert predict(cfg, 2).comm_bytes == want, name  # what the dry run prints
    cut = tmp_path / "cut"
    train(load_config(None, over(cut, train__steps=2)), task=SFTTask())
    train(load_config(None, over(cut, checkpoint__resume="true")), task=SFTTask())
    assert [r["loss"] for r in metrics(cut)] == [r["loss"] for r in ref]
    for k, v in ref_w.items():
        assert torch.equal(final_weights(cut)[k], v), k


def test_lora_sft_equals_peft_and_trl(corpus, cache_dir, base, tmp_path):
    """The same HF model, conversations and initial adapters (ours, copied into PEFT's
    LoRA layers), dropout 0: the loss of steps 1 and 2 and the adapters after two steps equal
    PEFT + TRL's SFTTrainer's."""
    trl, datasets, transformers = trl_stack()
    peft = pytest.importorskip("peft")
    hf_dir = base / "hf"
    path = tmp_path / "convs.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in TRL_CONVS))
    seq_len, n = 160, len(TRL_CONVS)
    over = tiny_overrides(corpus, cache_dir, tmp_path / "ours", data__seq_len=seq_len,
                          checkpoint__init_from=str(hf_dir), train__steps=2,
                          train__eval_batches=1, **OPTIM, **LORA)
    task = SFTTask(SFTOptions(data=str(path), val_data=str(path)))
    probe = load_config(None, over)
    from threefold.data import prepare_data
    probe.data.tokenizer = str(hf_dir / "tokenizer.json")
    rows = task.samplers(probe, prepare_data(probe.data))[0].n
    cfg = load_config(None, over + [("train.global_batch_size", str(rows)),
                                    ("train.micro_batch_size", str(rows))])
    _, run = train(cfg, task=SFTTask(SFTOptions(data=str(path), val_data=str(path))),
                   return_run=True)
    ours, ours_w = [r["loss"] for r in metrics(tmp_path / "ours")], final_weights(
        tmp_path / "ours")

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    targets = cfg.lora.target_modules.split(",")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                       target_modules=targets))
    initial = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                ours_name = name.removeprefix("base_model.model.").replace(".default", "")
                p.copy_(initial_weight(ours_name, tuple(p.shape), run.model_cfg,
                                       cfg.train.seed))
                initial[ours_name] = p.detach().clone()
    assert set(initial) == set(ours_w)
    args = trl_args(trl.SFTConfig, tmp_path / "trl", n, seq_len, assistant_only_loss=True,
                    packing=False)
    trainer = trl.SFTTrainer(model=model, args=args, processing_class=tok,
                             train_dataset=datasets.Dataset.from_list(
                                 [{"messages": m} for m in TRL_CONVS]))
    trainer.train()
    theirs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert ours == pytest.approx(theirs, abs=1e-5)
    for name, p in trainer.model.named_parameters():
        if "lora_" in name:
            k = name.removeprefix("base_model.model.").replace(".default", "")
            torch.testing.assert_close(ours_w[k], p.detach(), rtol=1e-5, atol=1e-5, msg=k)
            if k.endswith("lora_B.weight"):
                assert p.detach().abs().max() > 0  # it moved


def test_lora_under_dpo_reward_and_grpo(corpus, cache_dir, base, tmp_path):
    """Each post-training task trains only its adapters (and a reward model's new score
    head); DPO starts at ln 2 (the base is the policy at step 0); GRPO's reference is the
    base with the adapters off: the KL is 0 at step 1 and grows once the adapters move,
    with no second model built."""
    from tests.test_dpo import dpo_task
    from tests.test_dpo import write_pairs as dpo_pairs
    from tests.test_grpo import grpo_overrides, grpo_task
    from tests.test_reward import reward_overrides, reward_task
    from tests.test_reward import write_pairs as reward_pairs

    dpo_pairs(tmp_path)
    train(load_config(None, lora_overrides(corpus, cache_dir, tmp_path / "dpo",
                                           train__steps=2, optim__lr="1e-2")),
          task=dpo_task(tmp_path))
    assert metrics(tmp_path / "dpo")[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert all("lora_" in k for k in final_weights(tmp_path / "dpo"))
    (tmp_path / "rm").mkdir()
    reward_pairs(tmp_path / "rm")
    train(load_config(None, reward_overrides(corpus, cache_dir, tmp_path / "reward",
                                             train__steps=2, **LORA)),
          task=reward_task(tmp_path / "rm"))
    assert {k for k in final_weights(tmp_path / "reward") if "lora_" not in k} == \
        {"score.weight"}
    import threefold.post.grpo as grpo
    built = []
    real = grpo.reference_engine
    grpo.reference_engine = lambda run: built.append(run) or real(run)
    try:
        train(load_config(None, grpo_overrides(corpus, cache_dir, base / "run",
                                               tmp_path / "grpo", optim__lr="1e-2", **LORA)),
              task=grpo_task(tmp_path))
    finally:
        grpo.reference_engine = real
    rec = metrics(tmp_path / "grpo")
    assert not built and rec[0]["kl"] == 0.0 and rec[-1]["kl"] > 0


def _states_measured_and_predicted(rank, world, over):
    """(bytes of weights, of AdamW state) this rank holds after a LoRA run, and the dry
    run's count of them."""
    from threefold.parallel.distributed_world import Distributed
    from threefold.launch.dryrun import predict

    cfg = load_config(None, over)
    _, run = train(cfg, Distributed(cfg) if world > 1 else None, return_run=True)
    eng = run.engine
    units = getattr(eng, "units", None)  # (test only) a ZeRO engine's flat units
    if units is not None:
        held = [u.shard for u in units + [eng.root, eng.frozen_root] if u is not None]
    else:
        held = [p for p in {id(p): p for p in eng.model.parameters()}.values()]
    weights = sum(t.numel() * t.element_size() for t in held)
    optim = sum(v.numel() * v.element_size() for st in eng.optimizer.state.values()
                for k, v in st.items() if k != "step")
    mem = predict(cfg, world, backend_copies=False).memory
    return weights, optim, mem.params, mem.optimizer


@pytest.mark.parametrize("world,extra", [(1, {}), (2, {"parallel__zero_stage": 3})],
                         ids=["single", "zero3x2"])
def test_lora_model_states_are_what_the_dry_run_counts(corpus, cache_dir, tmp_path, world,
                                                       extra):
    over = lora_overrides(corpus, cache_dir, tmp_path / "run", train__steps=1, **extra)
    if world == 1:
        got = [_states_measured_and_predicted(0, 1, over)]
    else:
        got = run_distributed(_states_measured_and_predicted, world, over)
    for weights, optim, want_weights, want_optim in got:
        assert (weights, optim) == (want_weights, want_optim)


def _meta_units(mcfg, lora, tp):
    """(adapter units, frozen units) read off the meta model as the runtime builds it: LoRA
    applied, tensor parallelism slicing base and adapters, ZeRO's per-module grouping."""
    from threefold.parallel.parallelize import zero_units
    from threefold.parallel.transforms.tensor import apply_tensor_parallel
    from threefold.launch.dryrun import _MetaComm

    with torch.device("meta"):
        model = apply_lora(CausalLM(mcfg), lora)
    if tp > 1:
        apply_tensor_parallel(model, _MetaComm(tp), True)
    modules, _ = zero_units(model, 1)
    seen, trained, frozen = set(), [], []
    for module in modules:
        t, f = [], []
        for p in module.parameters():
            if id(p) not in seen:  # a tied weight once, where first used
                seen.add(id(p))
                (t if p.requires_grad else f).append(p.numel())
        trained += [tuple(t)] if t else []
        frozen += [tuple(f)] if f else []
    return tuple(trained), tuple(frozen)


@pytest.mark.parametrize("tp,targets,extra", [
    (1, "all-linear", {}), (2, "all-linear", {"qkv_bias": True, "qk_norm": True}),
    (2, "q_proj,v_proj,down_proj", {"intermediate_size": 96}),
    (1, "o_proj,up_proj", {"tie_word_embeddings": True})])
def test_lora_units_closed_forms_are_the_meta_models(tp, targets, extra):
    """accounting.lora's units (what the planner, dry run and bytes build on) equal the meta
    model's, per unit and in order; a tied weight's root unit is listed last, as
    ``ZeroEngine`` keeps it."""
    from threefold.accounting.lora_counts import lora_units
    from threefold.config.validation import lora_targets

    mcfg = ModelConfig(preset="tiny", vocab_size=512, **extra).resolved()
    lora = LoRAConfig(r=4, target_modules=targets)
    work = Workload(64, 4, lora_r=4, lora_targets=lora_targets(lora))
    trained, frozen = _meta_units(mcfg, lora, tp)
    want_trained, want_frozen = lora_units(mcfg, Layout(tp=tp), work)
    assert trained == want_trained and len(trained) == mcfg.num_hidden_layers
    if mcfg.tie_word_embeddings:  # the shared weight: first in the model, ZeRO's root last
        frozen = frozen[1:] + frozen[:1]
    assert frozen == want_frozen
