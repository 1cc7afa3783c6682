"""Group relative policy optimisation (Shao et al., DeepSeekMath, arXiv 2402.03300, §4.1):
the parts of ``threefold grpo`` that do not need the trainer (which is not wired yet).

For each prompt the policy samples G completions; a reward function scores each; the
advantage of completion i of a prompt is its reward minus the mean of its group, divided by
the group's standard deviation + 1e-4 (``scale_rewards`` "group"; "batch": the whole batch's
std; "none": not divided), as TRL's GRPOTrainer computes it (``advantages``). The loss per
completion token t (TRL's, with one policy update per generation; ``grpo_token_loss``):

    r_t = π(y_t) / π_old(y_t)    (π_old = π detached: r_t = 1, but its gradient is ∇ log π)
    ℓ_t = −min(r_t·A, clip(r_t, 1−ε, 1+ε)·A) + β·KL_t,
    KL_t = exp(log π_ref − log π) − (log π_ref − log π) − 1      (Schulman's k3 estimator)

to be summed over the completion tokens of the global batch and divided by their number
(TRL's default ``loss_type="dapo"``).

Rewards: a Python function ``f(prompts, completions, **columns) -> list[float]`` (TRL's
reward-function signature; ``columns`` are the prompt records' other fields, one list
each), named ``path/to/file.py:name`` or ``module:name`` (``load_reward``), or the built-in
``arithmetic`` (``arithmetic_reward`` on ``builtin_prompts``: sums of small numbers,
verifiable). ``call_reward`` refuses, naming the function, one that raises, returns another
number of values, or a value that is not finite.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import numpy as np
import torch

from threefold.data import DataError


# --------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------
_NUMBER = re.compile(r"\s*(-?\d+)")


def arithmetic_reward(prompts: list[str], completions: list[str], answer: list[str],
                      **_) -> list[float]:
    """The built-in verifiable reward: 1 when the completion starts with the right number,
    0.2 when it starts with some other number (the answer's form), else 0."""
    out = []
    for text, want in zip(completions, answer):
        m = _NUMBER.match(text)
        out.append(0.0 if m is None else 1.0 if m.group(1) == str(want).strip() else 0.2)
    return out


BUILTIN_REWARDS = {"arithmetic": arithmetic_reward}


def load_reward(spec: str):
    """The reward function ``spec`` names (see the module doc); DataError naming it if it
    cannot be found."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise DataError(f"grpo.reward: '{spec}' is neither a built-in reward "
                        f"({', '.join(BUILTIN_REWARDS)}) nor 'file.py:function' / "
                        "'module:function'")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise DataError(f"grpo.reward: file '{path}' does not exist")
            mod_spec = importlib.util.spec_from_file_location(f"threefold_reward_{path.stem}",
                                                              path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: say which and why
        raise DataError(f"grpo.reward: cannot load '{where}': {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise DataError(f"grpo.reward: '{where}' has no function '{name}'")
    return fn


def call_reward(fn, spec: str, prompts: list[str], completions: list[str],
                columns: dict[str, list]) -> np.ndarray:
    """``fn``'s rewards as float64, one per completion; DataError naming ``spec`` if it
    raises, returns another number of values, or a value that is not a finite number."""
    try:
        got = fn(prompts, completions, **columns)
    except Exception as e:  # noqa: BLE001 - the user's code
        raise DataError(f"grpo.reward: '{spec}' raised {type(e).__name__}: {e}") from None
    try:
        values = np.asarray(list(got), dtype=np.float64)
    except (TypeError, ValueError):
        raise DataError(f"grpo.reward: '{spec}' must return a list of numbers, got "
                        f"{type(got).__name__}") from None
    if values.shape != (len(completions),):
        raise DataError(f"grpo.reward: '{spec}' returned {values.size} value(s) for "
                        f"{len(completions)} completions")
    if not np.isfinite(values).all():
        raise DataError(f"grpo.reward: '{spec}' returned a value that is not finite "
                        f"(NaN or inf) for completion {int(np.argmin(np.isfinite(values)))}")
    return values


def advantages(rewards: np.ndarray, group: int, scale: str) -> np.ndarray:
    """Group-relative advantages (TRL's): reward minus its group's mean, divided by the
    group's (``scale`` "group") or the batch's ("batch") standard deviation (Bessel-
    corrected) + 1e-4, or not divided ("none"). ``rewards`` holds whole groups in order."""
    r = rewards.reshape(-1, group)
    out = r - r.mean(1, keepdims=True)
    if scale == "group":
        out = out / (r.std(1, ddof=1, keepdims=True) + 1e-4)
    elif scale == "batch":
        out = out / (rewards.std(ddof=1) + 1e-4)
    return out.reshape(-1)


def grpo_token_loss(logps: torch.Tensor, advantages: torch.Tensor, ref_logps, beta: float,
                    epsilon: float, old_logps: torch.Tensor | None = None):
    """Per-token GRPO loss (module doc) and, per token, the KL and whether the ratio was
    clipped; ``advantages`` broadcast over the tokens of each row. ``old_logps`` defaults to
    ``logps`` detached (one update per generation)."""
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    a = advantages[:, None]
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    loss = -torch.min(ratio * a, clipped * a)
    kl = torch.zeros_like(logps)
    if beta:
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        loss = loss + beta * kl
    region = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + epsilon) & (a > 0))
    return loss, kl.detach(), region


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------
def builtin_prompts(n: int = 200, seed: int = 0) -> list[dict]:
    """``n`` sums of two numbers below 10 ("3+4=" -> "7"), in a fixed order."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in g.integers(0, 10, size=2))
        out.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return out
