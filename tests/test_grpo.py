"""GRPO (threefold.post.grpo): advantages as TRL computes them, the per-token loss and its
gradient, reward functions checked by name; the trainer's step losses and weights equal TRL's
GRPOTrainer fed the same completions; DP2, ZeRO-3×2 and TP2 equal one process (their own
generation included); resume is exact; the CLI runs out of the box after `threefold train`."""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed, train_runs
from tests.test_sft import OPTIM, base, trl_stack  # noqa: F401 (fixture)
from threefold.config import ConfigError, load_config
from threefold.data import DataError
from threefold.post.grpo import GRPOOptions, GRPOTask
from threefold.post.grpo_loss import advantages, grpo_token_loss
from threefold.post.grpo_rewards import (arithmetic_reward, builtin_prompts, call_reward,
    load_reward)
from threefold.training.train import train


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls(scale):
    trl_utils = pytest.importorskip("trl.trainer.utils")
    g = np.random.default_rng(0)
    rewards = g.random(12)
    r = torch.from_numpy(rewards)
    mean = r.view(-1, 4).mean(1).repeat_interleave(4)
    if scale == "group":
        std = trl_utils.nanstd(r.view(-1, 4), dim=1).repeat_interleave(4)
    else:
        std = trl_utils.nanstd(r).expand_as(r)
    want = r - mean
    if scale != "none":
        want = want / (std + 1e-4)
    np.testing.assert_allclose(advantages(rewards, 4, scale), want.numpy(), rtol=1e-6)  # TRL: fp32 Bessel factor


def test_token_loss_one_update_per_generation():
    """With π_old = π the ratio is 1: the loss is −A per token (+ β·KL, 0 when the reference
    is the policy), its gradient −A·∇log π; a ratio pushed out of [1−ε, 1+ε] in the
    advantage's direction is clipped (no gradient) and counted."""
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([1.5, -0.5])
    loss, kl, low, high = grpo_token_loss(logps, adv, logps.detach(), 0.1, 0.2)
    region = low | high
    torch.testing.assert_close(loss, -adv[:, None].expand(2, 2))
    assert torch.equal(kl, torch.zeros(2, 2)) and not region.any()
    loss.sum().backward()
    torch.testing.assert_close(logps.grad, -adv[:, None].expand(2, 2))
    old = logps.detach() - torch.tensor([[0.5, 0.0], [0.0, -0.5]])  # ratios e^0.5, e^-0.5
    loss, _, low, high = grpo_token_loss(logps.detach(), adv, None, 0.0, 0.2, old_logps=old)
    region = low | high
    assert region.tolist() == [[True, False], [False, True]]
    torch.testing.assert_close(loss[0, 0], torch.tensor(-1.2 * 1.5))
    torch.testing.assert_close(loss[1, 1], torch.tensor(-0.8 * -0.5))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_loss_types_reduce_as_trl_over_micro_batches_and_ranks(loss_type):
    """The loop's reduction (micro-batch sums in the type's units, divided by the units summed
    over micro-batches and ranks) equals TRL's formula for each loss type, with 2 ranks of 2
    micro-batches of uneven completion lengths; figures are weighted the same way."""
    from threefold.post.grpo_loss import loss_units, reduce_token_loss

    g = torch.Generator().manual_seed(0)
    token = torch.randn(8, 5, generator=g)
    mask = torch.arange(5)[None, :] < torch.tensor([1, 5, 3, 2, 4, 5, 1, 3])[:, None]
    micro = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]  # rank 0: two, rank 1: two
    units = sum(loss_units(loss_type, mask[s], 2) for s in (slice(0, 4), slice(4, 8)))
    parts = [reduce_token_loss(loss_type, token[s], mask[s], 5, {"x": token[s]}) for s in micro]
    ours = sum(p[0] for p in parts) / units
    m = mask.float()
    if loss_type == "dapo":
        want = (token * m).sum() / m.sum()
    elif loss_type == "grpo":
        want = ((token * m).sum(1) / m.sum(1)).mean()
    elif loss_type == "dr_grpo":
        want = (token * m).sum() / (8 * 5)
    else:  # each micro-batch's token mean, averaged over the accumulation steps and ranks
        want = torch.stack([(token[s] * m[s]).sum() / m[s].sum() for s in micro]).mean()
    torch.testing.assert_close(ours, want)
    figure = sum(p[1]["x"] for p in parts) / units
    if loss_type in ("bnpo", "dapo"):
        torch.testing.assert_close(figure.float(), want)


def test_k3_kl_matches_its_formula():
    logps = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    _, kl, _, _ = grpo_token_loss(logps, torch.zeros(1), ref, 0.04, 0.2)
    d = ref - logps
    torch.testing.assert_close(kl, torch.exp(d) - d - 1)
    assert (kl > 0).all()


def test_arithmetic_reward_and_prompts():
    prompts = builtin_prompts(5)
    assert all(p["prompt"].endswith("=") for p in prompts)
    a, b = prompts[0]["prompt"][:-1].split("+")
    right = str(int(a) + int(b))
    got = arithmetic_reward([prompts[0]["prompt"]] * 3, [right + " ok", "123", "no"],
                            [right] * 3)
    assert got == [1.0, 0.2 if right != "123" else 1.0, 0.0]


def test_bad_reward_functions_are_named(tmp_path):
    f = tmp_path / "rewards.py"
    f.write_text("def boom(prompts, completions, **kw):\n    raise KeyError('answer')\n"
                 "def short(prompts, completions, **kw):\n    return [1.0]\n"
                 "def nan(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n"
                 "def good(prompts, completions, **kw):\n    return [len(c) for c in completions]\n")
    for name, match in (("boom", r"'.*:boom' raised KeyError"),
                        ("short", r"returned 1 value\(s\) for 2 completions"),
                        ("nan", "not finite")):
        spec = f"{f}:{name}"
        with pytest.raises(DataError, match=match):
            call_reward(load_reward(spec), spec, ["p", "p"], ["a", "bb"], {})
    spec = f"{f}:good"
    assert call_reward(load_reward(spec), spec, ["p", "p"], ["a", "bb"], {}).tolist() == [1, 2]
    with pytest.raises(DataError, match="has no function 'missing'"):
        load_reward(f"{f}:missing")
    with pytest.raises(DataError, match="neither a built-in reward"):
        load_reward("nonsense")


def test_kl_bias_correction_same_value_gradient_adds_kl():
    """TRL's use_bias_correction_kl: KL·ratio has the KL's value at ratio 1 and the gradient
    ∇KL + KL·∇log π."""
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    plain, kl, _, _ = grpo_token_loss(logps, torch.zeros(1), ref, 0.5, 0.2)
    corrected, _, _, _ = grpo_token_loss(logps, torch.zeros(1), ref, 0.5, 0.2,
                                         kl_bias_correction=True)
    torch.testing.assert_close(plain, corrected)
    g_plain, = torch.autograd.grad(plain.sum(), logps)
    g_corr, = torch.autograd.grad(corrected.sum(), logps)
    torch.testing.assert_close(g_corr, g_plain + 0.5 * kl)


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------
REWARD = ("def shape(prompts, completions, answer, **kw):\n"
          "    # a reward with spread for an untrained model: distinct characters, and the\n"
          "    # right answer first\n"
          "    return [len(set(c)) / 8 + (c.strip().startswith(a)) for c, a in\n"
          "            zip(completions, answer)]\n")


def reward_spec(root) -> str:
    f = root / "shape_reward.py"
    if not f.is_file():
        f.write_text(REWARD)
    return f"{f}:shape"


def grpo_overrides(corpus, cache, init, out, **extra):
    """A tiny GRPO run: 2 prompts x 4 completions per step from the 1-step base model."""
    return tiny_overrides(corpus, cache, out, **{
        "checkpoint__init_from": str(init), "train__steps": 3, "train__eval_batches": 1,
        "train__global_batch_size": 8, "train__micro_batch_size": 4, **OPTIM, **extra})


def grpo_task(root, **kw):
    return GRPOTask(GRPOOptions(reward=reward_spec(root), max_completion_length=6, beta=0.1,
                                **kw))


KEYS = ("loss", "kl", "reward", "reward_std", "completions/mean_length",
        "clip_ratio/region_mean", "frac_reward_zero_std")
LAYOUTS = [("dp2", {}), ("zero3", {"parallel__zero_stage": "3"}),
           ("tp2", {"parallel__tp": "2"})]


@pytest.mark.slow
def test_grpo_layouts_equal_single_process_and_resume_is_exact(corpus, cache_dir, base,
                                                                tmp_path):
    over = functools.partial(grpo_overrides, corpus, cache_dir, base / "run")
    train(load_config(None, over(tmp_path / "single")), task=grpo_task(tmp_path))
    ref = metrics(tmp_path / "single")
    assert [r["step"] for r in ref] == [1, 2, 3]
    assert all(set(KEYS) <= set(r) for r in ref)
    assert ref[0]["kl"] == 0.0  # the policy is the reference at step 1
    assert ref[1]["kl"] > 0 and ref[0]["reward_std"] > 0
    assert ref[0]["rewards/shape/mean"] == pytest.approx(ref[0]["reward"])
    assert 0 < ref[0]["completions/mean_length"] <= 6
    run_distributed(train_runs, 2, over, tmp_path, LAYOUTS,
                    functools.partial(grpo_task, tmp_path), timeout=300)
    ref_w = final_weights(tmp_path / "single")
    for name, _ in LAYOUTS:
        got = metrics(tmp_path / name)
        for k in KEYS:
            assert [r[k] for r in got] == pytest.approx([r[k] for r in ref], rel=1e-5,
                                                        abs=1e-7), (name, k)
        w = final_weights(tmp_path / name)
        for k, v in ref_w.items():
            torch.testing.assert_close(w[k], v, rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")
    # resume: 2 steps with a checkpoint, then on to 3 = the uninterrupted run
    cut = over(tmp_path / "cut", train__steps=2)
    train(load_config(None, cut), task=grpo_task(tmp_path))
    train(load_config(None, over(tmp_path / "cut", checkpoint__resume="true")),
          task=grpo_task(tmp_path))
    got = metrics(tmp_path / "cut")
    assert [r["step"] for r in got] == [1, 2, 3]
    for k in KEYS:
        assert [r[k] for r in got] == [r[k] for r in ref], k
    for k, v in ref_w.items():
        assert torch.equal(final_weights(tmp_path / "cut")[k], v), k


@pytest.mark.parametrize("loss_type,mu", [("dapo", 1), ("grpo", 1), ("dr_grpo", 1),
                                          ("bnpo", 1), ("dapo", 2)])
def test_grpo_step_losses_and_weights_equal_trl(corpus, cache_dir, base, tmp_path, loss_type,
                                                mu):
    """Same HF model, prompts and sampled completions (ours, fed to both through TRL's
    rollout_func): TRL's GRPOTrainer and ours log the same loss, reward and KL at the first
    step and, after one AdamW update, at the second, and end with the same weights; for each
    of TRL's loss types, and with two updates per generation (num_iterations 2: the second
    step reuses the first's completions, its ratio against the sampling policy)."""
    trl, datasets, transformers = trl_stack()
    from threefold.generation.generate import generate, load_for_generation

    hf_dir, g, n_prompts, new = base / "hf", 4, 2, 6
    records = builtin_prompts(200)[:8]
    model, tok, _ = load_for_generation(base / "run")
    eos = tok.token_to_id("<|endoftext|>")
    comps = {}
    for step in range(2):  # the completions of each step: sampled from the base model
        ids = [tok.encode(r["prompt"]).ids for r in records[step * n_prompts:
                                                            (step + 1) * n_prompts]
               for _ in range(g)]
        tokens = generate(model, ids, new, temperature=1.0, eos_id=eos, seed=7,
                          prompt_indices=range(step * 8, step * 8 + 8)).tokens
        # the 1-step model never ends a completion: end every other one early with EOS, so
        # lengths differ and the loss at step 1 is not zero
        tokens = [t if i % 2 else t[:1 + i % 4] + [eos] for i, t in enumerate(tokens)]
        comps[step] = (ids, tokens)
    assert any(len(set(c)) > 1 for c in comps[0][1])

    def fixed(step, prompt_ids, indices):
        assert prompt_ids == comps[step][0]
        return comps[step][1]

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = reward_spec(tmp_path)
    opts = GRPOOptions(prompts=str(prompts), val_prompts=str(prompts), reward=spec, beta=0.1,
                       max_completion_length=new, num_generations=g, shuffle=False,
                       loss_type=loss_type, num_iterations=mu)
    cfg = load_config(None, grpo_overrides(corpus, cache_dir, hf_dir, tmp_path / "ours",
                                           train__steps=2, train__micro_batch_size=8))
    train(cfg, task=GRPOTask(opts, rollout=fixed))
    ours = metrics(tmp_path / "ours")

    def rollout_func(prompts, trainer):
        ids, tokens = comps[trainer.state.global_step]
        assert [tok.encode(p).ids for p in prompts] == ids
        return {"prompt_ids": ids, "completion_ids": tokens, "logprobs": None}

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=g * n_prompts,
        num_generations=g, max_completion_length=new, max_steps=2, learning_rate=1e-3,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.95, adam_epsilon=1e-6, max_grad_norm=1.0, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        bf16=False, fp16=False, beta=0.1, epsilon=0.2, loss_type=loss_type, num_iterations=mu,
        scale_rewards="group", temperature=1.0, shuffle_dataset=False)
    reward = load_reward(spec)
    trainer = trl.GRPOTrainer(model=str(hf_dir), reward_funcs=reward, args=args,
                              processing_class=transformers.AutoTokenizer.from_pretrained(hf_dir),
                              train_dataset=datasets.Dataset.from_list(records),
                              rollout_func=rollout_func)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(theirs) == 2
    for k in ("loss", "reward", "reward_std", "kl", "completions/mean_length",
              "clip_ratio/region_mean", "frac_reward_zero_std", "rewards/shape/mean"):
        # (TRL logs a generation's figures, reward..., at the step that generated it)
        pairs = [(r[k], h[k]) for r, h in zip(ours, theirs) if k in h]
        assert len(pairs) >= 1 and [a for a, _ in pairs] == pytest.approx(
            [b for _, b in pairs], rel=1e-4, abs=1e-7), k
    # (grpo's per-completion means of −A sum to 0 over a group at step 0)
    assert ours[1]["kl"] > 0 and (loss_type == "grpo" or abs(ours[0]["loss"]) > 1e-3)
    if mu > 1:
        assert ours[1]["clip_ratio/region_mean"] > 0 or ours[1]["loss"] != ours[0]["loss"]
    assert ours[0]["completions/clipped_ratio"] == 0.5
    w = final_weights(tmp_path / "ours")
    for name, p in trainer.model.named_parameters():
        name = name.removeprefix("module.")
        if name in w:
            torch.testing.assert_close(w[name], p.detach(), rtol=1e-4, atol=2e-5, msg=name)


def test_grpo_refuses_bad_input_before_launch(corpus, cache_dir, base, tmp_path, monkeypatch):
    """A reward function that raises, returns the wrong number of values or NaN, an
    impossible batch or layout: one line naming it, exit code 2, nothing written."""
    from threefold.commands.posttrain import grpo_main

    monkeypatch.chdir(tmp_path)
    shutil.copytree(base / "run", "runs/default")
    f = tmp_path / "bad.py"
    f.write_text("def boom(prompts, completions, **kw):\n    raise ValueError('no')\n"
                 "def short(prompts, completions, **kw):\n    return [0.0]\n"
                 "def nan(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n")
    common = ["--data.corpus", str(corpus), "--data.cache_dir", str(cache_dir),
              "--train.progress", "off"]
    for args in (["--grpo.reward", f"{f}:boom"], ["--grpo.reward", f"{f}:short"],
                 ["--grpo.reward", f"{f}:nan"], ["--grpo.num_generations", "3"],
                 ["--parallel.pp", "2", "--nproc-per-node", "2"],
                 ["--grpo.prompts", "missing.jsonl"], ["--grpo.shuffle", "maybe"]):
        assert grpo_main(common + args) == 2, args
    assert not (tmp_path / "runs/grpo").exists()
    with pytest.raises(ConfigError, match="global_batch_size"):
        GRPOTask(GRPOOptions()).check(load_config(None, [("train.global_batch_size", "6")]))
    with pytest.raises(DataError, match="num_generations"):
        GRPOTask(GRPOOptions(num_generations=1))


@pytest.mark.slow
def test_grpo_cli_out_of_the_box_after_train(corpus, cache_dir, base, tmp_path, monkeypatch):
    """`threefold grpo` with no data or init option: runs/default -> runs/grpo on the
    built-in sums, with the TRL metric names and a checkpoint."""
    from threefold.commands.posttrain import grpo_main

    monkeypatch.chdir(tmp_path)
    shutil.copytree(base / "run", "runs/default")
    assert grpo_main(["--data.corpus", str(corpus), "--data.cache_dir", str(cache_dir),
                      "--train.progress", "off", "--train.steps", "2",
                      "--train.global_batch_size", "8", "--train.micro_batch_size", "8"]) == 0
    recs = metrics(tmp_path / "runs/grpo")
    assert [r["step"] for r in recs] == [1, 2]
    assert {"reward", "reward_std", "kl", "completions/clipped_ratio",
            "rewards/arithmetic_reward/mean"} <= set(recs[0])
    assert (tmp_path / "runs/grpo/checkpoints/2").is_dir()


def test_grpo_rewards_from_a_reward_model(corpus, cache_dir, base, tmp_path):
    """grpo.reward_model: the logged reward is the mean score the reward run's model gives
    prompt + completion (computed here by a fresh copy of that model)."""
    from tests.test_reward import our_scores, reward_overrides
    from threefold.weights.hf import load_pretrained
    from threefold.post.reward import RewardOptions, RewardTask

    train(load_config(None, reward_overrides(corpus, cache_dir, tmp_path / "rm", train__steps=2,
                                             checkpoint__init_from=str(base / "run"))),
          task=RewardTask(RewardOptions()))
    seen = {}

    def fixed(step, prompt_ids, indices):
        rows = [p + [40 + i % 7, 50 + i % 3] for i, p in enumerate(prompt_ids)]
        seen.setdefault(step, rows)  # the first call of a step is training's (setup's)
        return [s[len(p):] for s, p in zip(rows, prompt_ids)]

    task = GRPOTask(GRPOOptions(reward="", reward_model=str(tmp_path / "rm"),
                                max_completion_length=4), rollout=fixed)
    train(load_config(None, grpo_overrides(corpus, cache_dir, base / "run", tmp_path / "g",
                                           train__steps=1)), task=task)
    got = metrics(tmp_path / "g")[0]
    mcfg, weights = load_pretrained(tmp_path / "rm")
    scores = our_scores(weights, mcfg, torch.tensor(seen[0]), -1)
    assert scores.std() > 0
    assert got["reward"] == pytest.approx(scores.double().mean().item(), rel=1e-5)
    assert got["rewards/reward_model/mean"] == got["reward"]


@pytest.mark.slow
def test_grpo_loss_type_and_iterations_under_layouts_equal_single_process(corpus, cache_dir,
                                                                         base, tmp_path):
    """bnpo (per-micro-batch means) with two updates per generation: DP2 and ZeRO-3 equal
    one process step by step; an interval that would cut a generation cycle is refused."""
    over = functools.partial(grpo_overrides, corpus, cache_dir, base / "run")
    task = functools.partial(grpo_task, tmp_path, loss_type="bnpo", num_iterations=2)
    train(load_config(None, over(tmp_path / "single")), task=task())
    ref = metrics(tmp_path / "single")
    assert ref[0]["reward"] == ref[1]["reward"] != ref[2]["reward"]  # generations 0, 0, 1
    layouts = LAYOUTS[:2]
    run_distributed(train_runs, 2, over, tmp_path, layouts, task, timeout=300)
    for name, _ in layouts:
        got = metrics(tmp_path / name)
        for k in KEYS:
            assert [r[k] for r in got] == pytest.approx([r[k] for r in ref], rel=1e-5,
                                                        abs=1e-7), (name, k)
    with pytest.raises(ConfigError, match="checkpoint.interval.*num_iterations=2"):
        train(load_config(None, over(tmp_path / "bad", checkpoint__interval=3)), task=task())
