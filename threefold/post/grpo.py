"""Group relative policy optimisation (Shao et al., DeepSeekMath, arXiv 2402.03300, §4.1):
the ``GRPOTask`` the training loop runs (``threefold grpo``).

Every step, for each prompt of the step (a slice of them on each data-parallel rank) the
policy — the model being trained, in the same code — samples G completions
(``threefold.generate``); a reward function scores each completion; the advantage of
completion i of a prompt is its reward minus the mean of its group, divided by the group's
standard deviation + 1e-4 (``scale_rewards`` "group"; "batch": the whole batch's std; "none":
not divided), as TRL's GRPOTrainer computes it. Then the loss, per completion token t
(TRL's, with one policy update per generation):

    r_t = π(y_t) / π_old(y_t)    (π_old = π detached: r_t = 1, but its gradient is ∇ log π)
    ℓ_t = −min(r_t·A, clip(r_t, 1−ε, 1+ε)·A) + β·KL_t,
    KL_t = exp(log π_ref − log π) − (log π_ref − log π) − 1      (Schulman's k3 estimator)

summed over the completion tokens of the global batch and divided by their number (TRL's
default ``loss_type="dapo"``; ``count`` is completion tokens). Metrics, TRL's names:
``reward``, ``reward_std`` (over the batch's completions), ``completions/mean_length``,
``kl`` and ``clip_ratio/region_mean`` (means over completion tokens).

Sampling: prompt k of the data set at step s draws its G completions from a generator seeded
by (train.seed, s, k), as one batch of G rows of the same prompt, so a completion does not
depend on the layout (which rank holds the prompt, how many ranks there are): every layout
trains on the same completions, and resumes reproduce them.

Reference: with β > 0 a second copy of the initial model (``checkpoint.init_from`` or the
seed's initialisation), parallelised like the policy (tensor-parallel slices; under ZeRO-3
sharded over the same ranks, by a ZeRO-3 engine that never steps) scores each rank's own
completions: the reference log-probs are computed once, where the completion is trained.

Rewards: a Python function ``f(prompts, completions, **columns) -> list[float]`` (TRL's
reward-function signature; ``columns`` are the prompt records' other fields, one list
each), named ``path/to/file.py:name`` or ``module:name``, or the built-in ``arithmetic``
(``arithmetic_reward``: sums of small numbers, verifiable). It is called once at setup on a
probe, so a function that raises, returns the wrong number of values or NaN is refused
before anything is written, and checked again on every call.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from threefold.data import DataError
from threefold.data.sampler import rank_rows
from threefold.post.chat import encode_text, eot_token, read_jsonl
from threefold.post.sft import IGNORE, EpochSampler, example_path, pad_id, stack_items


@dataclass
class GRPOOptions:
    """Options of ``threefold grpo`` beyond the run configuration (``--grpo.KEY VALUE``)."""

    prompts: str = ""  # JSONL of {"prompt": str, ...columns}; "" = the built-in arithmetic
    reward: str = "arithmetic"  # built-in name, "file.py:function" or "module:function"
    num_generations: int = 4  # G: completions per prompt
    max_new_tokens: int = 8  # longest completion
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    beta: float = 0.04  # KL weight (0: no reference model)
    epsilon: float = 0.2  # clipping of the policy ratio
    scale_rewards: str = "group"  # group, batch or none (TRL's)


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


class PromptSampler(EpochSampler):
    """The step's prompts (``global_batch_size`` of them), epoch after epoch; ``item`` is a
    prompt's index, tokens and its record."""

    def __init__(self, records: list[dict], ids: list[list[int]], prompts_per_step: int,
                 seed: int, shuffle: bool = True):
        self.records, self.ids = records, ids
        fp = "|".join(",".join(map(str, x)) for x in ids)
        import hashlib

        super().__init__(len(records), prompts_per_step, seed, shuffle,
                         hashlib.blake2b(fp.encode(), digest_size=8).hexdigest())

    def local_prompts(self, step: int, dp_rank: int, dp_size: int) -> list[int | None]:
        """Indices of this rank's prompts of ``step`` (None: none left, validation)."""
        lo, hi = rank_rows(self.global_batch_size, dp_rank, dp_size)
        if self.shuffle:
            self.step = int(step) + 1
        return self.indices(step, lo, hi)


class GRPOBatches:
    """The sampler the loop sees: ``local_batch`` generates, scores and packs this rank's
    completions of the step (``GRPOTask.rollout``)."""

    def __init__(self, task: "GRPOTask", prompts: PromptSampler, train: bool):
        self.task, self.prompts, self.train = task, prompts, train

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
        """This rank's completions of ``step`` as rows (see ``GRPOTask.rollout``)."""
        idx = self.prompts.local_prompts(step, dp_rank, dp_size)
        return self.task.rollout(step if self.train else -1 - step, idx, self.prompts)

    def state_dict(self) -> dict:
        """For checkpoints."""
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """From checkpoints."""
        self.prompts.load_state_dict(state)


# --------------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------------
class GRPOTask:
    """GRPO on prompts with a reward function (module doc)."""

    name = "grpo"
    metric_names = ("kl", "clip_ratio/region_mean")

    def __init__(self, options: GRPOOptions | None = None):
        self.options = o = options or GRPOOptions()
        if o.num_generations < 2:
            raise DataError(f"grpo.num_generations: {o.num_generations}; a group needs at least "
                            "2 completions to compare")
        if o.max_new_tokens < 1:
            raise DataError(f"grpo.max_new_tokens: must be >= 1, got {o.max_new_tokens}")
        if o.scale_rewards not in ("group", "batch", "none"):
            raise DataError(f"grpo.scale_rewards: '{o.scale_rewards}'; use group, batch or none")
        if o.beta < 0 or not 0 < o.epsilon < 1:
            raise DataError(f"grpo.beta / grpo.epsilon: need beta >= 0 and 0 < epsilon < 1, "
                            f"got {o.beta}, {o.epsilon}")
        if o.temperature < 0 or not 0 < o.top_p <= 1 or o.top_k < 0:
            raise DataError("grpo.temperature / top_p / top_k: need temperature >= 0, "
                            "0 < top_p <= 1, top_k >= 0")
        self.reward_fn = load_reward(o.reward)
        self.run = self.ref = None
        self.stats: dict = {}
        self._batch_metrics: dict[str, float] = {}

    # -- data ---------------------------------------------------------------------------
    def samplers(self, cfg, data):
        """Prompt samplers; global_batch_size is completions per step (G per prompt)."""
        o, t = self.options, cfg.train
        g = o.num_generations
        if t.global_batch_size % g:
            raise DataError(f"train.global_batch_size: {t.global_batch_size} completions per "
                            f"step is not a multiple of grpo.num_generations={g}")
        if o.prompts:
            recs = [rec for _, rec in read_jsonl(o.prompts)]
            where = o.prompts
            for no, rec in enumerate(recs, 1):
                if not isinstance(rec.get("prompt"), str):
                    raise DataError(f"{where}:{no}: each line needs a \"prompt\" string")
        else:
            recs, where = builtin_prompts(seed=0), "built-in arithmetic"
        tok = data.tokenizer
        ids = [list(encode_text(tok, rec["prompt"]).ids) for rec in recs]
        longest = max(len(x) for x in ids)
        if longest + o.max_new_tokens > cfg.data.seq_len:
            raise DataError(f"data.seq_len: {cfg.data.seq_len} cannot hold the longest prompt "
                            f"({longest} tokens) and grpo.max_new_tokens={o.max_new_tokens}; "
                            f"raise it to {longest + o.max_new_tokens}")
        n_val = max(1, round(len(recs) * cfg.data.val_fraction)) if len(recs) > 1 else 0
        if n_val == 0:
            raise DataError(f"'{where}': at least 2 prompts are needed (one held out)")
        self.seq_len, self.eos = cfg.data.seq_len, data.eot_id
        self.pad = pad_id(tok, data.eot_id)
        self.tokenizer = tok
        per_step = t.global_batch_size // g
        self.train_prompts = PromptSampler(recs[:-n_val], ids[:-n_val], per_step, t.seed)
        self.val_prompts = PromptSampler(recs[-n_val:], ids[-n_val:], per_step, t.seed,
                                         shuffle=False)
        self.stats = {"prompts": len(recs) - n_val, "val_prompts": n_val, "data": where}
        return GRPOBatches(self, self.train_prompts, True), GRPOBatches(self, self.val_prompts,
                                                                       False)

    # -- set-up: the reference model, the reward function's probe -------------------------
    def setup(self, run) -> None:
        """Check the reward function on a probe; build the reference model (β > 0)."""
        lay = run.layout
        if getattr(lay, "chunks", None) is not None:
            raise DataError("parallel.pp: GRPO generates with the whole model on each rank; "
                            "pipeline parallelism is not supported, set parallel.pp 1")
        rec = self.train_prompts.records[0]
        call_reward(self.reward_fn, self.options.reward, [rec["prompt"]] * 2, ["1", ""],
                    self._columns([rec, rec]))
        self.run = run
        if self.options.beta:
            self.ref = _reference_model(run)
        if lay.is_writer:
            o = self.options
            print(f"grpo: {self.stats['prompts']} prompts ({self.stats['val_prompts']} held "
                  f"out) from {self.stats['data']}, G={o.num_generations}, reward {o.reward}, "
                  f"beta {o.beta}, epsilon {o.epsilon}, max {o.max_new_tokens} new tokens",
                  flush=True)

    @staticmethod
    def _columns(recs: list[dict]) -> dict[str, list]:
        keys = sorted({k for r in recs for k in r if k != "prompt"})
        return {k: [r.get(k) for r in recs] for k in keys}

    # -- a step's completions -------------------------------------------------------------
    def rollout(self, step: int, idx: list[int | None], prompts: PromptSampler
                ) -> dict[str, torch.Tensor]:
        """Generate G completions for each of this rank's prompts (module doc: seeded by
        (seed, step, prompt)), score them, and pack the rows: input_ids = prompt +
        completion (right-padded), labels = the completion tokens, the advantage and
        reward of the row, the reference's per-token log-probs (β > 0)."""
        from threefold.generate import generate

        o, run = self.options, self.run
        g = o.num_generations
        model = run.engine.model
        rows, recs, texts, lengths = [], [], [], []
        was_training = model.training
        model.eval()
        zero3 = run.cfg.parallel.zero_stage == 3
        try:
            for k in idx:
                if k is None:
                    continue
                seed = (run.cfg.train.seed * 1_000_003 + (step + 10_000) * 7_919 + k) % 2**63
                out = generate(model, [prompts.ids[k]] * g, max_new_tokens=o.max_new_tokens,
                               temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                               eos_id=self.eos, seed=seed, fixed_steps=zero3)
                for comp in out.completions:
                    rows.append((prompts.ids[k], comp))
                    recs.append(prompts.records[k])
                    lengths.append(len(comp))
                    texts.append(self.tokenizer.decode([t for t in comp if t != self.eos]))
        finally:
            model.train(was_training)
        if not rows:
            raise DataError("grpo: a rank has no prompts this step; lower the number of "
                            "data-parallel ranks or raise train.global_batch_size")
        rewards = call_reward(self.reward_fn, o.reward, [r["prompt"] for r in recs], texts,
                              self._columns(recs))
        adv = advantages(rewards, g, o.scale_rewards)
        t = self.seq_len
        x = np.full((len(rows), t), self.pad, dtype=np.int64)
        y = np.full((len(rows), t), IGNORE, dtype=np.int64)
        for i, (p, c) in enumerate(rows):
            ids = p + c
            x[i, :len(ids)] = ids
            y[i, len(p) - 1:len(ids) - 1] = c
        batch = {"input_ids": torch.from_numpy(x), "labels": torch.from_numpy(y),
                 "advantages": torch.from_numpy(adv), "rewards": torch.from_numpy(rewards),
                 "lengths": torch.tensor(lengths, dtype=torch.float64)}
        batch = {k: v.to(run.device) for k, v in batch.items()}
        if self.ref is not None:
            with torch.no_grad():
                batch["ref_logps"] = token_logps(run, self.ref, batch)
        self._batch_metrics = self._rollout_metrics(batch)
        return batch

    def _rollout_metrics(self, batch) -> dict[str, float]:
        """reward, reward_std and completions/mean_length over the global batch (sums over the
        data-parallel ranks on the logging channel)."""
        lay = self.run.layout
        r = batch["rewards"].double()
        parts = torch.stack([r.sum(), (r * r).sum(), torch.tensor(float(r.numel()),
                                                                  dtype=torch.float64,
                                                                  device=r.device),
                             batch["lengths"].sum()]).cpu()
        control = getattr(lay, "control", None)
        if control is not None:
            control.all_reduce(parts, "dp")
        s, s2, n, length = parts.tolist()
        mean = s / n
        var = (s2 - n * mean * mean) / (n - 1) if n > 1 else float("nan")
        return {"reward": mean, "reward_std": math.sqrt(max(var, 0.0)),
                "completions/mean_length": length / n}

    def batch_metrics(self) -> dict[str, float]:
        """The last rollout's figures (``train_step`` adds them to the step's metrics)."""
        return dict(self._batch_metrics)

    # -- the loss -------------------------------------------------------------------------
    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Completion tokens (TRL's "dapo" normaliser: every token weighs the same)."""
        return int((batch["labels"] != IGNORE).sum())

    def loss(self, run, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Summed per-token GRPO loss of the micro-batch, summed KL and clipped tokens."""
        o = self.options
        mask = micro["labels"] != IGNORE
        logps = token_logps(run, run.engine.model, micro, grad=True)
        per_token, kl, region = grpo_token_loss(logps, micro["advantages"].float(),
                                                micro.get("ref_logps"), o.beta, o.epsilon)
        m = mask.to(per_token.dtype)
        return (per_token * m).sum(), {"kl": (kl * m).sum().double(),
                                       "clip_ratio/region_mean": (region * mask).sum().double()}


def token_logps(run, model, batch: dict[str, torch.Tensor], grad: bool = False) -> torch.Tensor:
    """(rows, seq) log-probability of each labelled token under ``model`` (0 elsewhere),
    through the same forward and loss code as training (vocab-parallel under tp)."""
    from threefold.train import _autocast

    with _autocast(run):
        logits = model(batch["input_ids"])
    fn = getattr(model, "loss_function", None)
    if fn is None:
        from threefold.model import causal_lm_loss as fn
    nll = fn(logits, batch["labels"], reduction="none").reshape(batch["labels"].shape)
    out = -nll.float()
    return out if grad else out.detach()


def _reference_model(run):
    """A frozen copy of the initial policy, parallelised like it (module doc)."""
    from threefold.parallel.layout import SingleProcess
    from threefold.train import _pretrained, build_model

    cfg = run.cfg
    ref = build_model(run.model_cfg, run.device, cfg.train.seed)
    if cfg.checkpoint.init_from:
        ref.load_state_dict(_pretrained(cfg)[1], strict=True)
    if not isinstance(run.layout, SingleProcess):
        ref = run.layout.parallelize(ref, cfg)
    if cfg.parallel.zero_stage == 3 and not isinstance(run.layout, SingleProcess):
        ref._engine = run.layout.build_engine(ref, cfg)  # sharded like the policy, never steps
    for p in ref.parameters():
        p.requires_grad_(False)
    ref.eval()
    return ref


__all__ = ["GRPOOptions", "GRPOTask", "advantages", "arithmetic_reward", "call_reward",
           "grpo_token_loss", "load_reward", "example_path"]
