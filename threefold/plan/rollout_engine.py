"""What a colocated rollout engine (GRPO with ``grpo.rollout_engine vllm``) adds to a rank:
its copy of the policy's weights and its KV cache, and the bytes each weight sync hands it.

The engine holds every weight in the training dtype, a tied head twice (it is built untied:
``threefold.generation.policy_weights.untied_config``), plus the KV cache it was given. Each
sync sends the same tensors in fp32, once per optimiser step. vLLM's own runtime (its modules,
oneDNN's packed copies of the linear weights on a CPU) comes on top and is not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.accounting import num_parameters
from threefold.config import ModelConfig


@dataclass(frozen=True)
class EngineBytes:
    """A colocated engine's bytes on one rank: ``resident`` (weights + KV cache) and
    ``sync`` (handed over per optimiser step)."""

    resident: int
    sync: int


def engine_bytes(m: ModelConfig, dtype_bytes: int, kv_bytes: int) -> EngineBytes:
    """The engine of model ``m`` (resolved) in a dtype of ``dtype_bytes`` with ``kv_bytes``
    of KV cache."""
    weights = num_parameters(m) + (m.vocab_size * m.hidden_size if m.tie_word_embeddings
                                   else 0)
    return EngineBytes(weights * dtype_bytes + kv_bytes, weights * 4)
