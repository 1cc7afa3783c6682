"""Closed-form costs of a model: parameters, FLOPs (and, as the planner grows, memory and
communication). Pure functions of the configuration; imports no torch, so the planner can
evaluate a 1T-parameter layout in microseconds. The runtime's measured figures are compared
against these same functions.
"""

from __future__ import annotations

from threefold.config import ModelConfig


def layer_parameters(cfg: ModelConfig) -> int:
    """Weights of one transformer block: attention, SwiGLU MLP and its two RMSNorms."""
    h, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q = h * cfg.num_attention_heads * hd
    kv = 2 * h * cfg.num_key_value_heads * hd
    o = cfg.num_attention_heads * hd * h
    return q + kv + o + 3 * h * f + 2 * h


def num_parameters(cfg: ModelConfig) -> int:
    """Exact parameter count of the model built from ``cfg`` (a resolved config)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    head = 0 if cfg.tie_word_embeddings else v * h
    return v * h + cfg.num_hidden_layers * layer_parameters(cfg) + h + head


def matmul_parameters(cfg: ModelConfig) -> int:
    """Parameters that take part in a matrix multiply per token: every Linear weight,
    the LM head included (tied or not); the embedding lookup and the norms excluded."""
    h, v = cfg.hidden_size, cfg.vocab_size
    return cfg.num_hidden_layers * (layer_parameters(cfg) - 2 * h) + v * h


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM (arXiv 2204.02311, App. B): 6N + 12·L·H·Q·T, with N the
    matmul parameters, H heads, Q head dim, T the sequence length. Recomputation excluded, so
    this is the model-FLOPs (MFU) numerator, not the hardware-FLOPs one."""
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len
    return 6.0 * matmul_parameters(cfg) + attn
