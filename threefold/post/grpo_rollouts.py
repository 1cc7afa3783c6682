"""Where GRPO's completions come from, for one training rank (``grpo.rollout_engine``), and the
correction for sampling with an engine that is not the trainer.

``builtin`` generates with the training model (``threefold.generation.generate``). ``vllm``
keeps a colocated vLLM engine (``threefold.generation.vllm_rollouts``) per rank: started at
set-up from the model's config.json alone, synced with the policy's weights
(``threefold.generation.policy_weights``) whenever the policy has stepped since the last sync,
that is, before the first rollout and after every optimiser step that precedes one. The sync
is collective under ZeRO-3 (the units are gathered): every rank syncs at the same steps, since
the step count alone decides it. Its seconds and bytes are logged (``rollout/sync_seconds``,
``rollout/sync_bytes``), with the engine's start-up time once.

Importance correction (``importance_weights``): vLLM's log-probability of a sampled token
differs from the trainer's for the same weights (other kernels, bf16 rounding); the
token loss is weighed by the ratio π_trainer / π_engine, truncated at a cap per token
(``token_truncate``, TIS as veRL and TRL apply it) or, per completion, zeroed when the
sequence's ratio leaves [1/cap, cap] (``sequence_mask``, TRL's default), or not at all
(``none``). The mismatch is logged each step under TRL's names.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from threefold.config import ConfigError
from threefold.generation.generate import generate
from threefold.generation.policy_weights import policy_weights
from threefold.generation.rollouts import (ROLLOUT_ENGINES, VLLM_INSTALL, Rollouts, Sampling,
                                           vllm_installed)
from threefold.weights.hf_config import hf_config

IMPORTANCE_MODES = ("token_truncate", "sequence_mask", "none")


def check_engine(engine: str, importance: str, cap: float) -> None:
    """ConfigError for an unknown engine or correction."""
    if engine not in ROLLOUT_ENGINES:
        raise ConfigError(f"grpo.rollout_engine: '{engine}' is not one of "
                          f"{', '.join(ROLLOUT_ENGINES)}")
    if importance not in IMPORTANCE_MODES:
        raise ConfigError(f"grpo.importance_sampling: '{importance}' is not one of "
                          f"{', '.join(IMPORTANCE_MODES)}")
    if not cap > 1:
        raise ConfigError(f"grpo.importance_sampling_cap: {cap} must be > 1")


def check_installed(engine: str) -> None:
    """ConfigError when vLLM is asked for and not installed (after the layout's rules: a
    layout the engine cannot run is refused for that first)."""
    if engine == "vllm" and not vllm_installed():
        raise ConfigError(f"grpo.rollout_engine: vllm is not installed here; install it with "
                          f"{VLLM_INSTALL}, or use grpo.rollout_engine builtin")


class RolloutSource:
    """One rank's completions for GRPO: ``complete(prompts, indices, sampling)``."""

    def __init__(self, run, engine: str, max_len: int, kv_cache_mb: int):
        self.run, self.kind = run, engine
        self.engine = None
        self.started = 0.0
        if engine == "vllm":
            from threefold.generation.vllm_rollouts import VLLMRollouts, write_engine_config

            folder = write_engine_config(run.out / "rollout_engine" / f"rank{run.world.rank}",
                                         hf_config(run.model_cfg))
            dtype = "bfloat16" if run.dtype == torch.bfloat16 else "float32"
            self.engine = VLLMRollouts(folder, dtype, max_len, kv_cache_mb << 20,
                                       seed=run.cfg.train.seed)
            self.started = self.engine.start_seconds

    def sync(self) -> dict[str, float]:
        """Send the policy's weights when it has stepped since the engine's; the figures."""
        version = self.run.engine.optim_step()
        if self.engine is None or self.engine.version == version:
            return {}
        t0 = time.perf_counter()
        sent = self.engine.load(policy_weights(self.run.engine, self.run.model_cfg), version)
        return {"rollout/sync_seconds": time.perf_counter() - t0, "rollout/sync_bytes": sent}

    def complete(self, prompts: list[list[int]], indices: list[int], s: Sampling) -> Rollouts:
        """Completions of ``prompts``, completion i seeded by ``indices[i]``."""
        if self.engine is not None:
            figures = self.sync()
            if self.started:
                figures["rollout/engine_start_seconds"], self.started = self.started, 0.0
            out = self.engine.generate(prompts, indices, s)
            out.figures.update(figures)
            return out
        model = self.run.engine.model
        tp = model.tp_size
        # under ZeRO-3 each forward gathers one unit at a time, as training does: the whole
        # model is never on the rank (more gathers per token, the memory the planner promised)
        res = generate(model, prompts, s.max_new_tokens, temperature=s.temperature,
                       top_p=s.top_p, top_k=s.top_k, eos_id=s.eos_id, seed=s.seed,
                       prompt_indices=indices, comm=self.run.world.comm if tp > 1 else None,
                       pad_id=s.pad_id)
        return Rollouts(res.tokens, None, res.seconds, sum(res.lengths),
                        self.run.engine.optim_step())


def importance_weights(old: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor,
                       mode: str, cap: float) -> torch.Tensor:
    """Per-token weights (rows, T) for the loss: the trainer's log-probs ``old`` against the
    engine's ``sampled`` on the completion tokens ``mask`` (module doc)."""
    diff = (old - sampled) * mask
    if mode == "token_truncate":
        return torch.exp(diff).clamp(max=cap)
    if mode == "sequence_mask":
        seq = diff.sum(1, keepdim=True)
        keep = (seq <= math.log(cap)) & (seq >= -math.log(cap))
        return keep.to(old.dtype).expand_as(old)
    return torch.ones_like(old)


def mismatch_sums(old: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor,
                  weights: torch.Tensor) -> np.ndarray:
    """[tokens, Σ|Δlogp|, max|Δlogp|, Σ ratio, min ratio, max ratio] over the completion
    tokens, to be reduced over the data-parallel ranks (sum, sum, max, sum, min, max)."""
    m = mask.bool()
    if not m.any():
        return np.array([0.0, 0.0, 0.0, 0.0, math.inf, -math.inf])
    d = (old - sampled)[m].abs().double()
    r = weights[m].double()
    return np.array([float(m.sum()), float(d.sum()), float(d.max()), float(r.sum()),
                     float(r.min()), float(r.max())])


def mismatch_figures(sums: np.ndarray, maxes: np.ndarray, mins: np.ndarray) -> dict[str, float]:
    """TRL's sampling metrics from ``mismatch_sums`` reduced over the ranks (three ways)."""
    n = max(sums[0], 1.0)
    return {"sampling/sampling_logp_difference/mean": sums[1] / n,
            "sampling/sampling_logp_difference/max": maxes[2],
            "sampling/importance_sampling_ratio/mean": sums[3] / n,
            "sampling/importance_sampling_ratio/min": mins[4],
            "sampling/importance_sampling_ratio/max": maxes[5]}
