"""What GRPO scores completions with, and the prompts it completes: reward functions
(the built-in ``arithmetic``, a user's ``file.py:name`` or ``module:name`` with TRL's
signature ``f(prompts, completions, **columns) -> list[float]``), the checks that refuse a
bad one by name, the prompt records (a JSONL file or the built-in sums) and the scorer of a
``threefold reward`` run. ``threefold.post.grpo`` runs them; docs/post-training.md tells how.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import numpy as np
import torch

from threefold.data import DataError
from threefold.weights.hf import load_pretrained
from threefold.model.decoder import CausalLM
from threefold.data.chat import read_jsonl
from threefold.post.reward import add_score_head

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
    except Exception as e:
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
    except Exception as e:
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


def prompt_records(path: str | None, n_builtin: int = 200) -> tuple[list[dict], str]:
    """(records, where they came from): the JSONL file's (each needs "prompt": a string or
    a list of messages), else ``builtin_prompts``."""
    if not path:
        return builtin_prompts(n_builtin), "built-in sums"
    recs = []
    for no, rec in read_jsonl(path):
        if "prompt" not in rec:
            raise DataError(f"{path}:{no}: record has no 'prompt' (fields: {', '.join(rec)})")
        recs.append(rec)
    return recs, path


def split_prompts(prompts: str, val_prompts: str,
                  val_fraction: float) -> tuple[list[dict], list[dict], str]:
    """(training records, validation records, where the training ones came from): those of
    ``val_prompts`` when given, else the last ``val_fraction`` of the prompts (at least one,
    and at least one left to train on)."""
    records, where = prompt_records(prompts)
    if val_prompts:
        return records, prompt_records(val_prompts)[0], where
    if len(records) < 2:
        raise DataError(f"grpo.prompts: '{where}' has one prompt; at least 2 are needed "
                        "to hold one out (or give grpo.val_prompts)")
    n_val = min(len(records) - 1, max(1, round(len(records) * val_fraction)))
    return records[:-n_val], records[-n_val:], where


def check_reward_function(fn, spec: str, records: list[dict]) -> None:
    """Call ``fn`` on the first records with two probe completions each (an empty one and the
    first record's text): a function that raises, returns the wrong number of values or a
    value that is not finite is refused here, before a run starts."""
    recs = records[:2]
    prompts = [r["prompt"] for r in recs for _ in range(2)]
    completions = [c for _ in recs for c in ("", " 1")]
    call_reward(fn, spec, prompts, completions, columns_of([r for r in recs for _ in range(2)]))


def columns_of(records: list[dict]) -> dict[str, list]:
    """The records' fields other than "prompt", one list each (TRL passes them so)."""
    keys = [k for k in records[0] if k != "prompt"] if records else []
    return {k: [r.get(k) for r in records] for k in keys}


# --------------------------------------------------------------------------------------------
# A reward model's scores
# --------------------------------------------------------------------------------------------
def reward_model_scorer(path: str, device):
    """A function (list of token id lists) -> (n,) float64 scores of a ``threefold reward``
    run's model (its score head at each sequence's last token), whole on this rank."""
    cfg, weights = load_pretrained(Path(path))
    if "score.weight" not in weights:
        raise DataError(f"grpo.reward_model: '{path}' has no score head (score.weight); give "
                        "the output of `threefold reward`")
    model = add_score_head(CausalLM(cfg), 0)
    own = dict(model.named_parameters())
    model.load_state_dict({k: v for k, v in weights.items() if k in own}, strict=True)
    model.to(device).eval().requires_grad_(False)

    @torch.no_grad()
    def score(seqs: list[list[int]]) -> np.ndarray:
        """(n,) float64 scores of right-padded token id lists."""
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
        hidden = model(ids)  # no LM head: the final hidden states
        last = torch.tensor([len(s) - 1 for s in seqs], device=device)
        return model.score(hidden[torch.arange(len(seqs)), last])[:, 0].double().cpu().numpy()
    return score
