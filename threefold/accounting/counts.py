"""Parameters and FLOPs of a model: exact counts of the weights threefold's model builds, the
PaLM FLOPs per token, and how tensor parallelism shards each weight. The value sets
and axis tables are ``threefold.config``'s and ``threefold.layout.axes``'s. Pure functions of the
configuration, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from threefold.config import ModelConfig
from threefold.layout import rules
from threefold.families.shapes import inactive_parameters, moe_layer_parameters, moe_layers


# --------------------------------------------------------------------------------------------
# Parameters of the model (exact; unchanged API)
# --------------------------------------------------------------------------------------------
def attention_parameters(cfg: ModelConfig) -> int:
    """A block's attention matmul weights: q, k, v, o; or latent attention's q_a, q_b (or
    q), kv_a, kv_b and o (``threefold.model.mla``)."""
    h, a = cfg.hidden_size, cfg.num_attention_heads
    if cfg.kv_lora_rank:
        ql, c, r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        q = ql * h + ql * a * cfg.head_dim if ql else h * a * cfg.head_dim
        return q + (c + r) * h + c * a * (cfg.qk_nope_head_dim + cfg.v_head_dim) \
            + a * cfg.v_head_dim * h
    hd = cfg.head_dim
    return 2 * h * a * hd + 2 * h * cfg.num_key_value_heads * hd


def block_parameters(cfg: ModelConfig, layer: int) -> int:
    """Weights of block ``layer``: attention, its MLP (SwiGLU of ``intermediate_size``; in a
    mixture of experts the router and every expert, or in a dense first block a SwiGLU of
    ``dense_intermediate_size``) and its norms."""
    h = cfg.hidden_size
    if cfg.num_local_experts and layer >= cfg.first_k_dense_replace:
        mlp = moe_layer_parameters(cfg)
    else:
        mlp = 3 * h * (cfg.dense_intermediate_size if cfg.num_local_experts
                       else cfg.intermediate_size)
    return attention_parameters(cfg) + mlp + norms_per_block(cfg) * h + attention_extras(cfg)


def layer_parameters(cfg: ModelConfig) -> int:
    """Weights of one transformer block (the last: a routed one where the first are dense)."""
    return block_parameters(cfg, cfg.num_hidden_layers - 1)


def blocks_parameters(cfg: ModelConfig) -> int:
    """Weights of all the blocks, the multi-token-prediction modules included."""
    dense = min(cfg.first_k_dense_replace, cfg.num_hidden_layers) if cfg.num_local_experts \
        else 0
    return dense * block_parameters(cfg, 0) + (cfg.num_hidden_layers - dense) \
        * layer_parameters(cfg) + cfg.num_nextn_predict_layers * mtp_module_parameters(cfg)


def mtp_module_parameters(cfg: ModelConfig) -> int:
    """Weights of one multi-token-prediction module (``threefold.model.mtp``): its block (a
    routed one in a mixture of experts), ``eh_proj`` (2h·h) and its three norms; the
    embedding and the head are the model's."""
    h = cfg.hidden_size
    return block_parameters(cfg, cfg.num_hidden_layers) + 2 * h * h + 3 * h


def latent_replicated_numels(cfg: ModelConfig) -> tuple[int, ...]:
    """Latent attention's weights every tp rank holds whole, in registration order: q_a_proj
    and q_a_layernorm (with a query latent), kv_a_proj_with_mqa, kv_a_layernorm."""
    h, ql, c = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    return (*((ql * h, ql) if ql else ()), (c + cfg.qk_rope_head_dim) * h, c)


def norms_per_block(cfg: ModelConfig) -> int:
    """A block's norms over the residual width: 2, or 4 with Gemma's sandwich layout."""
    return 4 if cfg.norm_layout == "sandwich" else 2


def attention_extras(cfg: ModelConfig) -> int:
    """A block's attention weights that are in no matmul: q/k/v biases (Qwen2; o's too and
    the sinks, GPT-OSS), the q/k norms (Qwen3's per head, OLMo 2's over the whole projections), latent attention's
    latent norms."""
    if cfg.kv_lora_rank:
        return cfg.q_lora_rank + cfg.kv_lora_rank
    hd = cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    bias = (q + 2 * kv if cfg.qkv_bias else 0) + (cfg.hidden_size if cfg.attention_out_bias
                                                  else 0) \
        + (cfg.num_attention_heads if cfg.attention_sinks else 0)  # GPT-OSS's o bias, sinks
    if not cfg.qk_norm:
        return bias
    return bias + (q + kv if cfg.qk_norm_over == "projection" else 2 * hd)


def num_parameters(cfg: ModelConfig) -> int:
    """Exact parameter count of the model built from ``cfg`` (a resolved config)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    head = 0 if cfg.tie_word_embeddings else v * h
    return v * h + blocks_parameters(cfg) + h + head


def active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token uses: all of them but, in a mixture of experts, the E − k experts
    per layer it is not routed to (the router counts: every token uses all of it). Equal to
    ``num_parameters`` for a dense model."""
    return num_parameters(cfg) - inactive_parameters(cfg)


def matmul_parameters(cfg: ModelConfig) -> int:
    """Parameters that take part in a matrix multiply per token: every Linear weight (of a
    mixture of experts, the router and the token's k experts), the LM head included (tied or
    not); the embedding lookup and the norms excluded."""
    h, v, d = cfg.hidden_size, cfg.vocab_size, cfg.num_nextn_predict_layers
    n = cfg.num_hidden_layers + d  # a multi-token-prediction module: a block, 3 norms, the head
    return blocks_parameters(cfg) - n * (norms_per_block(cfg) * h + attention_extras(cfg)) \
        - 3 * d * h + (1 + d) * v * h - inactive_parameters(cfg) \
        - moe_layers(cfg) * moe_biases(cfg)


def moe_biases(cfg: ModelConfig) -> int:
    """A routed block's biases a token uses, in no matmul: the router's and its k experts'
    (GPT-OSS; 0 without them)."""
    if not cfg.moe_bias or not cfg.num_local_experts:
        return 0
    return cfg.num_local_experts + cfg.num_experts_per_tok * (2 * cfg.intermediate_size
                                                              + cfg.hidden_size)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM (arXiv 2204.02311, App. B): 6N + 12·L·H·Q·T, with N the
    matmul parameters, H heads, Q head dim, T the sequence length; 6·L·H·(Q + V)·T when the
    values are narrower than the queries (latent attention). Recomputation excluded, so
    this is the model-FLOPs (MFU) numerator, not the hardware-FLOPs one."""
    v = cfg.v_head_dim if cfg.kv_lora_rank else cfg.head_dim
    blocks = cfg.num_hidden_layers + cfg.num_nextn_predict_layers  # each module's block too
    attn = 6 * blocks * cfg.num_attention_heads * (cfg.head_dim + v) * seq_len
    return 6.0 * matmul_parameters(cfg) + attn


@dataclass(frozen=True)
class TPShard:
    """Per-rank widths of one block under tensor parallelism."""

    heads: int  # query heads per rank
    kv_heads: int  # kv heads per rank (1 when replicated)
    kv_replicas: int  # ranks that hold a copy of each kv head (1 = sharded)
    ffn: int  # intermediate width per rank (ceil(f/tp))
    vocab: int  # padded vocabulary rows per rank


def padded_vocab(cfg: ModelConfig, tp: int) -> int:
    """Vocabulary padded to a multiple of tp, as ``threefold.parallel.transforms.tensor`` pads it."""
    return -(-cfg.vocab_size // tp) * tp


@lru_cache(maxsize=4096)
def tp_shard_for(h: int, a: int, kv: int, f: int, vocab: int, tp: int) -> TPShard:
    """``tp_shard`` of hidden size h, a heads, kv heads, SwiGLU width f and vocabulary
    ``vocab`` (cached); LayoutError if tp does not fit."""
    rules.heads_over_tp(a, kv, f, tp)
    rules.kv_heads_over_tp(a, kv, f, tp)
    if kv % tp == 0:
        kv_r, reps = kv // tp, 1
    else:
        kv_r, reps = 1, tp // kv  # each kv head replicated on tp/kv ranks
    return TPShard(a // tp, kv_r, reps, -(-f // tp), -(-vocab // tp))


def tp_shard(cfg: ModelConfig, tp: int) -> TPShard:
    """Per-rank head counts and widths under ``tp``; LayoutError if tp does not fit."""
    return tp_shard_for(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                     cfg.intermediate_size, cfg.vocab_size, tp)


# --------------------------------------------------------------------------------------------
# Parameters per rank, as the runtime groups them
# --------------------------------------------------------------------------------------------
def layer_parameters_per_rank(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(tp-sharded, tp-replicated) weights of one block on one rank, as the FLOPs see them: the
    replicated ones are the two RMSNorm weights; a replicated kv projection counts as the one
    kv head the rank computes with. A mixture of experts' feed-forward is in neither (it is
    whole on every tp rank and a token uses k of its experts: ``moe_matmul_parameters``)."""
    sh, h, hd = tp_shard(cfg, tp), cfg.hidden_size, cfg.head_dim
    mlp = 0 if cfg.num_local_experts else 3 * h * sh.ffn
    if cfg.kv_lora_rank:  # latent attention: its latents are computed whole on every rank
        ql, c, r, a = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, sh.heads
        q = ql * h + ql * a * hd if ql else h * a * hd
        attention = q + (c + r) * h + c * a * (cfg.qk_nope_head_dim + cfg.v_head_dim) \
            + a * cfg.v_head_dim * h
    else:
        attention = 2 * h * sh.heads * hd + 2 * h * sh.kv_heads * hd
    return attention + mlp, norms_per_block(cfg) * h


def moe_key(cfg: ModelConfig) -> tuple[int, int, int, int, int, bool]:
    """(experts E, experts per token k, shared expert width, dense first blocks, their
    width, shared expert gated), (0, 0, 0, 0, 0, True) for a dense model."""
    if not cfg.num_local_experts:
        return (0, 0, 0, 0, 0, True)
    return (cfg.num_local_experts, cfg.num_experts_per_tok,
            cfg.shared_expert_intermediate_size or 0, cfg.first_k_dense_replace,
            cfg.dense_intermediate_size, bool(cfg.shared_expert_gate))


def moe_matmul_parameters(cfg: ModelConfig) -> int:
    """Weights of one MoE feed-forward that take part in a matmul per token: the router
    (E·h), the token's k experts (3·h·f each) and a shared expert with its gate. 0 for a
    dense model. Not split by tp (the runtime keeps the MoE whole on every tp rank)."""
    e, k, fs, *_ = moe_key(cfg)
    if not e:
        return 0
    h = cfg.hidden_size
    gate = h if cfg.shared_expert_gate else 0
    return e * h + k * 3 * h * cfg.intermediate_size + (3 * h * fs + gate if fs else 0)
