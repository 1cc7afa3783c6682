"""GRPO's pure parts (threefold.post.grpo; the trainer is not wired yet): advantages as TRL
computes them, the per-token loss and its gradient, reward functions checked by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from threefold.data import DataError
from threefold.post.grpo import (advantages, arithmetic_reward, builtin_prompts, call_reward,
                                 grpo_token_loss, load_reward)


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
    loss, kl, region = grpo_token_loss(logps, adv, logps.detach(), 0.1, 0.2)
    torch.testing.assert_close(loss, -adv[:, None].expand(2, 2))
    assert torch.equal(kl, torch.zeros(2, 2)) and not region.any()
    loss.sum().backward()
    torch.testing.assert_close(logps.grad, -adv[:, None].expand(2, 2))
    old = logps.detach() - torch.tensor([[0.5, 0.0], [0.0, -0.5]])  # ratios e^0.5, e^-0.5
    loss, _, region = grpo_token_loss(logps.detach(), adv, None, 0.0, 0.2, old_logps=old)
    assert region.tolist() == [[True, False], [False, True]]
    torch.testing.assert_close(loss[0, 0], torch.tensor(-1.2 * 1.5))
    torch.testing.assert_close(loss[1, 1], torch.tensor(-0.8 * -0.5))


def test_k3_kl_matches_its_formula():
    logps = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    _, kl, _ = grpo_token_loss(logps, torch.zeros(1), ref, 0.04, 0.2)
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
