"""The shapes of a family's blocks as plain numbers, for the accounting and the planner (no
torch): the weights of a mixture of experts' feed-forward, and how many tokens' logits the
chunked head (``threefold.model.head_loss``) makes at once, and whether the grouped experts'
widths meet ``torch._grouped_mm``'s stride rule.
"""

from __future__ import annotations

from threefold.config import ModelConfig


def expert_parameters(cfg: ModelConfig) -> int:
    """Weights of one expert (a SwiGLU MLP of width ``intermediate_size``; with its biases,
    2f + h, where it has them: GPT-OSS)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    return 3 * h * f + (2 * f + h if cfg.moe_bias else 0)


def moe_layer_parameters(cfg: ModelConfig) -> int:
    """Weights of one MoE feed-forward: the router (with its bias where it has one) and all
    experts (and a shared expert, with its gate where it has one)."""
    h, fs = cfg.hidden_size, cfg.shared_expert_intermediate_size
    shared = 3 * h * fs + (h if cfg.shared_expert_gate else 0) if fs else 0
    router = h + 1 if cfg.moe_bias else h
    return cfg.num_local_experts * (router + expert_parameters(cfg)) + shared


def grouped_widths_unfit(h: int, f: int, element_size: int) -> str | None:
    """Why the experts' widths h and f keep ``torch._grouped_mm`` off (None: they do not): every
    operand it multiplies, forward and backward, has a leading stride of h or f elements (or
    2f), which torch requires to be a multiple of 16 bytes (``threefold.model.experts.grouped_mm_unfit``
    has the whole rule, dtype and device too)."""
    align = 16 // element_size
    if h % align or f % align:
        return (f"hidden {h} and intermediate {f} must be multiples of {align} "
                f"({element_size}-byte elements: 16-byte strides)")
    return None


def moe_layers(cfg: ModelConfig) -> int:
    """Blocks whose MLP is a mixture of experts: all of a mixture's but its dense first
    ``first_k_dense_replace`` (DeepSeek-V3), none of a dense model's; the
    multi-token-prediction modules' blocks (``num_nextn_predict_layers``) included."""
    if not cfg.num_local_experts:
        return 0
    return max(cfg.num_hidden_layers - cfg.first_k_dense_replace, 0) \
        + cfg.num_nextn_predict_layers


def inactive_parameters(cfg: ModelConfig) -> int:
    """Weights a token does not use: the E − k experts it was not routed to, in every layer
    (0 for a dense model)."""
    if not cfg.num_local_experts:
        return 0
    idle = cfg.num_local_experts - cfg.num_experts_per_tok
    return moe_layers(cfg) * idle * expert_parameters(cfg)


LOGITS_CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk, at most (one token at least)


def chunk_tokens(tokens: int, vocab_rows: int, budget: int = LOGITS_CHUNK_BYTES) -> int:
    """Tokens per chunk: as many as keep a chunk's fp32 logits (``vocab_rows`` per token,
    this rank's rows) within ``budget`` bytes, at least one and at most ``tokens``."""
    return max(1, min(tokens, budget // (4 * vocab_rows)))
