"""Group relative policy optimisation (Shao et al., DeepSeekMath, arXiv 2402.03300, §4.1):
the ``GRPOTask`` that ``threefold grpo`` runs in the training loop.

Each step, every data-parallel rank samples ``grpo.num_generations`` completions of its own
prompts with ``threefold.generation.generate`` (whole groups, seeded by their place in the run, so
they do not depend on the layout), scores them (``threefold.post.grpo_rewards``), normalises the
rewards in each group (``advantages``) and builds training rows with the reference model's
log-probs. The loss is TRL's clipped-ratio token loss with a k3 KL to the reference
(``grpo_token_loss``), summed over completion tokens; ``count`` is those tokens, so the loop
divides by their number over the global batch (TRL's ``dapo``; ``grpo.loss_type`` picks
another of TRL's: ``threefold.post.grpo_loss``), with ``grpo.num_iterations`` updates per
generation. docs/post-training.md gives
the formulas, the metrics and the layouts GRPO runs under.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from threefold.config import ConfigError
from threefold.data import DataError
from threefold.data.sampler import rank_rows
from threefold.layout import task_layout
from threefold.model.lora import adapters_off, has_adapters
from threefold.data.chat import check_messages, encode_text, eot_token, load_chat_template
from threefold.post.grpo_loss import (
    LOSS_TYPES, advantages, grpo_token_loss, loss_units, reduce_token_loss)
from threefold.generation.rollouts import Sampling
from threefold.post.grpo_rollouts import (RolloutSource, check_engine, check_installed,
                                          importance_weights, mismatch_figures, mismatch_sums,
                                          server_layout)
from threefold.post.grpo_rewards import (
    call_reward, check_reward_function,
    columns_of, load_reward, reward_model_scorer, split_prompts)
from threefold.post.sft import IGNORE, EpochSampler, fingerprint, pad_id
from threefold.training.task import Task
from threefold.training.run import autocast, reference_engine


@dataclass
class GRPOOptions:
    """Options of ``threefold grpo`` beyond the run configuration (``--grpo.KEY VALUE``)."""

    prompts: str = ""  # JSONL of {"prompt": ..., other columns}; "" = the built-in sums
    val_prompts: str = ""  # validation JSONL; "" = the last data.val_fraction of the prompts
    reward: str = "arithmetic"  # built-in name, file.py:function or module:function; "" = none
    reward_model: str = ""  # a `threefold reward` run (or checkpoint) whose score is added
    num_generations: int = 4  # G: completions per prompt
    max_completion_length: int = 8  # new tokens per completion at most
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    beta: float = 0.04  # weight of the KL to the reference (0: no reference model)
    epsilon: float = 0.2  # clipping range of the policy ratio
    scale_rewards: str = "group"  # group, batch or none
    kl_bias_correction: bool = True  # TRL's use_bias_correction_kl
    loss_type: str = "dapo"  # dapo, grpo, dr_grpo or bnpo (TRL's; threefold.post.grpo_loss)
    num_iterations: int = 1  # μ: optimiser updates per generation batch
    shuffle: bool = True  # prompts in a new order each epoch (false: in file order)
    chat_template: str = "auto"  # for conversational prompts: auto, builtin or a .jinja path
    rollout_engine: str = "builtin"  # builtin (the training model) or vllm (colocated engine)
    vllm_kv_cache_mb: int = 64  # the vLLM engine's KV cache, MiB per rank
    importance_sampling: str = "token_truncate"  # token_truncate, sequence_mask or none (vllm)
    importance_sampling_cap: float = 3.0  # the ratio's cap (vllm: TRL's default, 3)
    max_staleness: int = 0  # vllm: generate step s+1 while step s trains (rollouts 1 step old)
    vllm_mode: str = "colocate"  # vllm: colocate (an engine per rank) or server (one process)
    vllm_server: str = ""  # server mode: host:port of a running server; "" = start one
    vllm_server_tp: int = 1  # server mode: the engine's tensor parallelism (vLLM shards)


# --------------------------------------------------------------------------------------------
# Rollouts
# --------------------------------------------------------------------------------------------
class RolloutSampler(EpochSampler):
    """Prompts, ``prompts_per_step`` per step (``EpochSampler`` order; evaluation wraps
    around), each rank's turned into G completions and their training rows by the task."""

    def __init__(self, task: "GRPOTask", prompts: list[list[int]], records: list[dict],
                 prompts_per_step: int, seed: int, shuffle: bool, evaluation: bool):
        self.task, self.prompts, self.records = task, prompts, records
        self.evaluation = evaluation
        self.figures: dict[str, float] = {}
        self.cached: tuple | None = None  # (step, dp_rank, batch, figures) made in setup
        self.reused: tuple | None = None  # (generation, dp_rank, batch, figures), μ > 1
        super().__init__(len(prompts), prompts_per_step, seed, shuffle,
                         fingerprint((np.asarray(p, dtype=np.int64) for p in prompts), 0))

    def indices(self, step: int, lo: int, hi: int) -> list[int]:
        """Prompts of rows [lo, hi) of ``step``'s prompts (evaluation: in order, wrapping)."""
        if self.shuffle:
            return super().indices(step, lo, hi)
        return [(step * self.global_batch_size + r) % self.n for r in range(lo, hi)]

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
        """This rank's completions of ``step`` as training rows (see ``GRPOTask.rollout``)."""
        if self.shuffle:
            self.step = int(step) + 1
        if self.cached is not None:
            cached, self.cached = self.cached, None
            if cached[:2] == (step, dp_rank):
                self.figures = cached[3]
                return cached[2]
        mu = 1 if self.evaluation else self.task.options.num_iterations
        gen = step // mu  # the generation batch: reused for μ optimiser steps
        if self.reused is not None and self.reused[:2] == (gen, dp_rank):
            self.figures = self.reused[3]
            return self.reused[2]
        lo, hi = rank_rows(self.global_batch_size, dp_rank, dp_size)
        batch, self.figures = self.task.rollout(self, gen, lo, self.indices(gen, lo, hi))
        if mu > 1:
            self.reused = (gen, dp_rank, batch, self.figures)
        return batch


class GRPOTask(Task):
    """GRPO with μ policy updates per generation (docs/post-training.md)."""

    name = "grpo"
    metric_names = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
                    "clip_ratio/region_mean")

    def __init__(self, options: GRPOOptions | None = None, rollout=None):
        """``rollout``: a function (step, prompt token lists, completion indices) -> completion
        token lists, used instead of generating (to feed given completions, as a test does)."""
        self.options = o = options or GRPOOptions()
        if o.num_generations < 2:
            raise DataError(f"grpo.num_generations: need at least 2 completions per prompt "
                            f"(a group of one has no relative advantage), got {o.num_generations}")
        if o.max_completion_length < 1:
            raise DataError("grpo.max_completion_length: must be at least 1")
        if not (o.temperature > 0 and 0 < o.top_p <= 1 and o.top_k >= 0):
            raise DataError("grpo.temperature must be > 0, grpo.top_p in (0, 1], grpo.top_k "
                            ">= 0")
        if o.beta < 0 or not 0 < o.epsilon < 1:
            raise DataError("grpo.beta must be >= 0 and grpo.epsilon in (0, 1)")
        if o.scale_rewards not in ("group", "batch", "none"):
            raise DataError(f"grpo.scale_rewards: '{o.scale_rewards}' is not group, batch or "
                            "none")
        if o.loss_type not in LOSS_TYPES:
            raise DataError(f"grpo.loss_type: '{o.loss_type}' is not one of "
                            f"{', '.join(LOSS_TYPES)}")
        if o.num_iterations < 1:
            raise DataError(f"grpo.num_iterations: must be at least 1, got {o.num_iterations}")
        check_engine(o.rollout_engine, o.importance_sampling, o.importance_sampling_cap,
                     o.max_staleness, o.num_iterations, o.vllm_mode, o.vllm_server_tp)
        if not o.reward and not o.reward_model:
            raise DataError("grpo.reward: give a reward function or grpo.reward_model")
        self.reward_fn = load_reward(o.reward) if o.reward else None
        self.fixed_rollout = rollout
        self.reference = None  # the frozen initial policy's engine (beta > 0)
        self.base_is_reference = False  # LoRA: the reference is the policy, adapters off
        self.score = None

    # -- checks before launch ----------------------------------------------------------------
    def check(self, cfg) -> None:
        """ConfigError for a layout or batch GRPO does not run with."""
        p, t, g = cfg.parallel, cfg.train, self.options.num_generations
        task_layout("grpo", cfg, *server_layout(cfg, self.options))  # the rule book's
        check_installed(self.options.rollout_engine)
        mu, every = self.options.num_iterations, cfg.checkpoint.interval
        if mu > 1 and (every == "auto" or every % mu):  # (auto's count is chosen at run time)
            raise ConfigError(f"checkpoint.interval: {every} is not a multiple of "
                              f"grpo.num_iterations={mu}; a resume inside a generation cycle "
                              "would lose the sampling policy's log-probs: use a multiple")
        if t.global_batch_size % g:
            raise ConfigError(f"train.global_batch_size: {t.global_batch_size} completions is "
                              f"not a multiple of grpo.num_generations={g}; use a multiple")
        dp = p.dp_replicate * p.dp_shard
        prompts = t.global_batch_size // g
        if prompts % dp:
            raise ConfigError(f"train.global_batch_size: its {prompts} prompts per step "
                              f"({t.global_batch_size} / {g} completions) do not divide over "
                              f"{dp} data-parallel ranks; make global_batch_size a multiple "
                              f"of {g * dp}")

    # -- data ------------------------------------------------------------------------------
    def samplers(self, cfg, data) -> tuple[RolloutSampler, RolloutSampler]:
        """Training prompts (shuffled per epoch unless grpo.shuffle is false) and validation
        prompts (in order)."""
        self.check(cfg)
        o, t = self.options, cfg.train
        tok = data.tokenizer
        self.tok, self.eos = tok, data.eot_id
        self.pad = pad_id(tok, data.eot_id)
        records, val_records, where = split_prompts(o.prompts, o.val_prompts,
                                                    cfg.data.val_fraction)
        if self.reward_fn is not None:
            check_reward_function(self.reward_fn, o.reward, records)
        self.template = None
        if any(isinstance(r["prompt"], list) for r in records + val_records):
            self.template = load_chat_template(data.tokenizer_path, tok, o.chat_template)
        eot_token(tok, str(data.tokenizer_path))  # the tokenizer must have one
        train_ids = [self._encode(r, where) for r in records]
        val_ids = [self._encode(r, o.val_prompts or where) for r in val_records]
        longest = max(len(p) for p in train_ids + val_ids)
        self.width = longest + o.max_completion_length
        if self.width > cfg.data.seq_len:
            raise ConfigError(f"data.seq_len: {cfg.data.seq_len} is shorter than the longest "
                              f"prompt ({longest} tokens) + grpo.max_completion_length "
                              f"({o.max_completion_length}); raise data.seq_len to at least "
                              f"{self.width}")
        self.where = where
        self.row_length = self.width  # the loop's tokens/s and MFU count these positions
        per_step = t.global_batch_size // o.num_generations
        self.train = RolloutSampler(self, train_ids, records, per_step, t.seed, o.shuffle,
                                    evaluation=False)
        self.val = RolloutSampler(self, val_ids, val_records, per_step, t.seed + 1, False,
                                  evaluation=True)
        return self.train, self.val

    def _encode(self, rec: dict, where: str) -> list[int]:
        p = rec["prompt"]
        if isinstance(p, list):
            text = self.template.render(check_messages(p, where + " prompt",
                                                       need_assistant=False),
                                        add_generation_prompt=True)
        elif isinstance(p, str):
            text = p
        else:
            raise DataError(f"{where}: a prompt must be a string or a list of messages")
        ids = list(encode_text(self.tok, text).ids)
        if not ids:
            raise DataError(f"{where}: the prompt {p!r} encodes to no tokens")
        return ids

    def setup(self, run) -> None:
        """The reference model (when beta > 0), the reward model, and the first step's
        rollout (before anything is written: a reward function failing on real completions
        stops the run here)."""
        o = self.options
        self.run = run
        if o.beta:  # the initial policy: under LoRA the policy with its adapters off (no
            # second copy), else an engine of its own, sharded like the policy, never stepping
            self.base_is_reference = has_adapters(run.engine.model)
            self.reference = run.engine if self.base_is_reference else reference_engine(run)
        if o.reward_model:
            self.score = reward_model_scorer(o.reward_model, run.device)
        self.source = RolloutSource(run, o.rollout_engine, self.width, o.vllm_kv_cache_mb,
                                    o.vllm_mode, o.vllm_server, o.vllm_server_tp, o.max_staleness)
        lay = run.world
        batch = self.train.local_batch(0, lay.dp_rank, lay.dp_size)  # (also kept for μ > 1)
        self.train.cached = (0, lay.dp_rank, batch, self.train.figures)
        self.train.step = 0
        if lay.is_writer:
            g = o.num_generations
            print(f"grpo: {self.train.n} prompts ({self.val.n} held out) from {self.where}, "
                  f"{run.cfg.train.global_batch_size // g} prompts x {g} completions per step, "
                  f"up to {o.max_completion_length} new tokens, reward "
                  f"{' + '.join(x for x in (o.reward, o.reward_model) if x)}, beta {o.beta}",
                  flush=True)

    def close(self) -> None:
        """Stop the rollout engine (a colocated one's process groups go before the run's)."""
        self.source.close()

    # -- one step's completions --------------------------------------------------------------
    def _completions(self, sampler: RolloutSampler, step: int, lo: int,
                     prompt_ids: list[list[int]]) -> list[list[int]]:
        """G completions per prompt, prompt-major; completion j of the step's global rows
        draws from the generator seeded by its place in the run."""
        indices = self._indices(sampler, step, lo, len(prompt_ids))
        self.generation, self.sampled = (0.0, 0), None
        if self.fixed_rollout is not None:
            return [list(c) for c in self.fixed_rollout(step, prompt_ids, indices)]
        res = self.source.complete(prompt_ids, indices, self._sampling(sampler))
        self.generation, self.sampled = (res.seconds, res.generated), res
        return res.tokens

    def _indices(self, sampler: RolloutSampler, step: int, lo: int, n: int) -> list[int]:
        """The run-wide indices of a step's completions from row ``lo`` (their seeds)."""
        first = (step * sampler.global_batch_size + lo) * self.options.num_generations
        return list(range(first, first + n))

    def _sampling(self, sampler: RolloutSampler) -> Sampling:
        o = self.options
        return Sampling(o.max_completion_length, o.temperature, o.top_p, o.top_k, self.eos,
                        sampler.seed, self.pad)

    def _prefetch(self, sampler: RolloutSampler, step: int, lo: int, n: int) -> None:
        """With ``max_staleness``, start the next generation's completions (module doc)."""
        if not self.options.max_staleness or sampler.evaluation or self.fixed_rollout:
            return
        g = self.options.num_generations
        ids = [sampler.prompts[i] for i in sampler.indices(step + 1, lo, lo + n)
               for _ in range(g)]
        self.source.prefetch(ids, self._indices(sampler, step + 1, lo, len(ids)),
                             self._sampling(sampler))

    def rollout(self, sampler: RolloutSampler, step: int, lo: int,
                prompts: list[int]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """(this rank's training rows, the step's figures) for its prompts (indices)."""
        o = self.options
        g = o.num_generations
        ids = [sampler.prompts[i] for i in prompts for _ in range(g)]
        recs = [sampler.records[i] for i in prompts for _ in range(g)]
        comps = self._completions(sampler, step, lo, ids)
        self._prefetch(sampler, step, lo, len(prompts))
        if len(comps) != len(ids) or any(len(c) > o.max_completion_length for c in comps):
            raise DataError("grpo: the rollout gave the wrong number or length of completions")
        texts = [self.tok.decode(c, skip_special_tokens=True) for c in comps]
        per_func: dict[str, np.ndarray] = {}
        if self.reward_fn is not None:
            name = getattr(self.reward_fn, "__name__", o.reward)
            per_func[name] = call_reward(self.reward_fn, o.reward, [r["prompt"] for r in recs],
                                         texts, columns_of(recs))
        if self.score is not None:
            per_func["reward_model"] = self.score([p + c for p, c in zip(ids, comps)])
        rewards = sum(per_func.values())
        adv = advantages(rewards, g, "none" if o.scale_rewards == "batch" else o.scale_rewards)
        figures, batch_std = self._figures(rewards, per_func, comps, g)
        if o.scale_rewards == "batch":
            adv = adv / (batch_std + 1e-4)
        batch = self._rows(ids, comps, adv)
        if "sampled_logps" in batch:
            figures.update(self._mismatch(batch))
        if self.sampled is not None:
            figures.update(self.sampled.figures)
        return batch, figures

    def _mismatch(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """The step's trainer-engine log-prob gap and importance ratios, over every rank."""
        o, mask = self.options, (batch["labels"] != IGNORE).float()
        old, sampled = batch["old_logps"], batch["sampled_logps"]
        sums = mismatch_sums(old, sampled, mask, importance_weights(
            old, sampled, mask, o.importance_sampling, o.importance_sampling_cap))
        return mismatch_figures(self._dp_reduce(sums, "sum"), self._dp_reduce(sums, "max"),
                                self._dp_reduce(sums, "min"))

    def _figures(self, rewards: np.ndarray, per_func: dict, comps: list[list[int]],
                 g: int) -> tuple[dict[str, float], float]:
        """The step's rollout figures over every data-parallel rank (TRL's names) and the
        global reward standard deviation."""
        lens = np.array([len(c) for c in comps], dtype=np.float64)
        ended = np.array([bool(c) and c[-1] == self.eos for c in comps])
        zero_std = (rewards.reshape(-1, g).std(1, ddof=1) < 1e-8).sum()
        sums = [len(rewards), rewards.sum(), (rewards ** 2).sum(), zero_std, len(rewards) / g,
                lens.sum(), (~ended).sum()]
        for v in per_func.values():
            sums += [v.sum(), (v ** 2).sum()]
        sums = self._dp_reduce(np.array(sums), "sum")
        lo_hi = self._dp_reduce(np.array([-lens.min(), lens.max()]), "max")
        n = sums[0]

        def std(total, sq):
            return math.sqrt(max(0.0, (sq - total * total / n) / (n - 1))) if n > 1 else 0.0
        out = {"reward": sums[1] / n, "reward_std": std(sums[1], sums[2]),
               "frac_reward_zero_std": sums[3] / sums[4],
               "completions/mean_length": sums[5] / n, "completions/min_length": -lo_hi[0],
               "completions/max_length": lo_hi[1], "completions/clipped_ratio": sums[6] / n}
        for k, name in enumerate(per_func):
            total, sq = sums[7 + 2 * k], sums[8 + 2 * k]
            out[f"rewards/{name}/mean"] = total / n
            out[f"rewards/{name}/std"] = std(total, sq)
        seconds, made = self.generation  # this rank's
        out["generation_seconds"] = seconds
        out["generation_tokens_per_s"] = made / seconds if seconds else 0.0
        return out, out["reward_std"]

    def _dp_reduce(self, values: np.ndarray, op: str) -> np.ndarray:
        """``values`` reduced over the data-parallel ranks (logging channel; as is in one
        process)."""
        t = torch.from_numpy(values.astype(np.float64))
        return self.run.world.reduce_over_dp(t, op).numpy()

    def _rows(self, prompts: list[list[int]], comps: list[list[int]],
              adv: np.ndarray) -> dict[str, torch.Tensor]:
        """Training rows: prompt + completion right-padded to the task's width, labels on the
        completion tokens, advantages, and the reference's token log-probs."""
        n, w = len(prompts), self.width
        x = np.full((n, w), self.pad, dtype=np.int64)
        y = np.full((n, w), IGNORE, dtype=np.int64)
        for i, (p, c) in enumerate(zip(prompts, comps)):
            x[i, :len(p) + len(c)] = p + c
            y[i, len(p) - 1:len(p) + len(c) - 1] = c
        batch = {"input_ids": torch.from_numpy(x), "labels": torch.from_numpy(y),
                 "advantages": torch.from_numpy(adv.astype(np.float32))}
        batch["ref_logps"] = self._logps(self.reference, batch, base=self.base_is_reference)
        res = self.sampled
        if res is None or res.logps is None:
            if self.options.num_iterations > 1:  # the sampling policy's, for μ updates' ratios
                batch["old_logps"] = self._logps(self.run.engine, batch)
            return batch
        lp = torch.zeros(y.shape, dtype=torch.float32)  # the engine's, where the labels are
        for i, (p, c) in enumerate(zip(prompts, res.logps)):
            lp[i, len(p) - 1:len(p) + len(c) - 1] = torch.tensor(c, dtype=torch.float32)
        stale = self.run.engine.optim_step() - res.version
        res.figures["rollout/staleness"] = stale
        if stale:  # sampled by an older policy: the ratio is against it (the engine's
            batch["old_logps"] = lp  # log-probs), the clip bounds how far the update goes
        else:  # the trainer's own log-probs, corrected for the engine's sampling
            batch["old_logps"], batch["sampled_logps"] = self._logps(self.run.engine, batch), lp
        return batch

    @torch.no_grad()
    def _logps(self, engine, batch: dict[str, torch.Tensor], base: bool = False
               ) -> torch.Tensor:
        """(rows, width) token log-probs under ``engine``'s model (the reference, or the
        policy as it samples; with ``base``, its adapters off), in micro-batches; zeros
        without one (beta 0: no reference)."""
        labels = batch["labels"]
        if engine is None:
            return torch.zeros(labels.shape, dtype=torch.float32)
        with adapters_off(engine.model) if base else contextlib.nullcontext():
            return self._model_logps(engine.model, batch)

    def _model_logps(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        run, out = self.run, []
        mb = run.cfg.train.micro_batch_size
        for i in range(0, labels.shape[0], mb):
            ids = batch["input_ids"][i:i + mb].to(run.device)
            with autocast(run):
                losses = model(ids, labels=labels[i:i + mb].to(run.device),
                               temperature=self.options.temperature)
            out.append((-losses).float().cpu())
        return torch.cat(out)

    # -- the loss ------------------------------------------------------------------------------
    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """The loss type's units: completion tokens (dapo), completions (grpo, dr_grpo) or
        micro-batches (bnpo)."""
        return loss_units(self.options.loss_type, batch["labels"] != IGNORE,
                          self.run.cfg.train.micro_batch_size)

    def loss(self, run, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Summed GRPO token loss over the micro-batch's completion tokens, summed metrics."""
        o = self.options
        labels = micro["labels"]
        logps = -run.token_losses({"input_ids": micro["input_ids"]}, labels, o.temperature)
        mask = labels != IGNORE
        loss, kl, low, high = grpo_token_loss(logps, micro["advantages"], micro["ref_logps"],
                                              o.beta, o.epsilon, micro.get("old_logps"),
                                              kl_bias_correction=o.kl_bias_correction)
        if "sampled_logps" in micro:  # an engine sampled: weigh by π_trainer / π_engine
            loss = loss * importance_weights(micro["old_logps"], micro["sampled_logps"], mask,
                                             o.importance_sampling, o.importance_sampling_cap)
        figures = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high,
                   "clip_ratio/region_mean": low | high}
        if o.beta:
            figures["kl"] = kl
        return reduce_token_loss(o.loss_type, loss, mask, o.max_completion_length, figures)

    def step_metrics(self) -> dict[str, float]:
        """The last training rollout's figures (``train_step`` adds them to the step's)."""
        return dict(self.train.figures)
