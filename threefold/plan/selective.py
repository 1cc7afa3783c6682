"""What a block keeps under selective recompute, per module policy
(``threefold.parallel.transforms.recompute``, ``train.recompute_modules``), and the matmuls a
named module runs again in backward.

A selective block keeps its input and the outputs of its matmuls and fused attention kernel;
every elementwise op (the norms, RoPE, SwiGLU's product, the residual additions, casts) is
recomputed from them. A named module keeps no matmul output: ``core_attn`` the fused kernel's
output and log-sum-exp, ``mla_up_proj`` latent attention's q_b and kv_b outputs, ``mlp`` a
dense MLP's gate, up and down outputs, ``moe`` the router's logits and every expert's outputs
(shared ones included), ``shared_experts`` the shared expert's. ``layernorm`` and ``moe_act``
keep nothing under any policy. What no policy drops: the router's choice (top-k) and, under
expert parallelism, the rows the all-to-alls moved. Counted per token, measured to the byte
against what the block keeps (tests/test_recompute_modules.py, tests/test_plan_moe.py,
tests/test_dryrun.py).

A mixture of experts' dense first blocks (DeepSeek-V3's three) are counted as what they are
(``dense``): the planner's stages hold them where the pipeline puts them
(``accounting.rank_dense_layers``).
"""

from __future__ import annotations

from threefold.accounting import nodes_per_token, tp_shard
from threefold.config import ModelConfig
from threefold.layout import Layout, Workload


def selective_block_bytes(tokens: int, h: int, heads: int, kv_heads: int, head_dim: int,
                          ffn: int, tp: int = 1, sequence_parallel: bool = False,
                          act_bytes: int = 2, residual_bytes: int = 0,
                          flash_attention: bool = True) -> float:
    """Bytes threefold's grouped-query block keeps for backward under selective recompute
    with the default policy, per rank, for ``tokens`` tokens (heads, kv heads and ffn per
    rank; d = ``act_bytes``, r = ``residual_bytes``, 0 = d). Per token:

    - the block's input, which the checkpoint keeps: r·h (/t under sequence parallelism);
    - the q, k and v projections' outputs (before RoPE): d·(heads + 2·kv heads)·head_dim;
    - the fused attention kernel's output and fp32 log-sum-exp: d·heads·head_dim + 4·heads
      (a materialised attention is recomputed whole: nothing);
    - o_proj's and down_proj's outputs (before tensor parallelism's reduction): 2·d·h;
    - gate and up: 2·d·ffn.

    Against ``plan.activations.block_activation_bytes`` this drops the norms' inputs and
    1/rms, the sub-layers' normed inputs, RoPE's cast tables and SwiGLU's product
    (recomputed, with autocast's casts of weights, which ``plan.memory.cast_weight_bytes``
    then does not count), for the block's input and the two projection outputs the residual
    additions need. tests/test_dryrun.py measures it."""
    d, r = act_bytes, residual_bytes or act_bytes
    norm_div = tp if sequence_parallel and tp > 1 else 1
    attn = d * (heads + 2 * kv_heads) * head_dim
    if flash_attention:
        attn += d * heads * head_dim + 4 * heads
    return tokens * (r * h / norm_div + attn + 2 * d * h + 2 * d * ffn)


def latent_attention_kept(cfg: ModelConfig, heads: int, act_bytes: int, modules: tuple,
                          flash_attention: bool) -> float:
    """What latent attention keeps per token under selective recompute (``heads`` per rank):
    the query latent d·q_lora_rank (or q_proj's output), q_b's output d·heads·(nope + rope),
    kv_a's d·(kv_lora_rank + rope), kv_b's d·heads·(nope + v), the fused kernel's output
    d·heads·v and 4·heads, and o_proj's d·h; ``mla_up_proj`` drops q_b's and kv_b's,
    ``core_attn`` the kernel's."""
    d, a = act_bytes, heads
    nope, rope, v, ql = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, \
        cfg.q_lora_rank
    up = a * (nope + rope) * (1 if ql else 0) + a * (nope + v)
    kept = ql + (0 if ql else a * (nope + rope)) + cfg.kv_lora_rank + rope + cfg.hidden_size
    if "mla_up_proj" not in modules:
        kept += up
    if flash_attention and "core_attn" not in modules:
        return d * (kept + a * v) + 4 * a
    return d * kept


def moe_kept(cfg: ModelConfig, layout: Layout, work: Workload, modules: tuple) -> float:
    """What a mixture-of-experts feed-forward keeps per token under selective recompute: the
    router's logits d·E and the k experts' products d·(2f + h) each (not under ``moe``), a
    shared expert's gate, up and down d·(2f_s + h) and its gate's d (not under ``moe`` or
    ``shared_experts``), always the router's choice (top-k's fp32 weights and int64 ids, 12
    bytes each; the grouped router's group top-2 and group choice also) and under ep the
    dispatched rows r·h and the rows combined back d·h per assignment (N·k in expectation,
    uniform routing); under the hierarchical dispatch also the network level's pair rows
    received and returned, (r + d)·h for each of the D expected nodes per token
    (``nodes_per_token``), and the assignments' ids and weights (12·k)."""
    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    h, f, d, r = cfg.hidden_size, cfg.intermediate_size, work.act_bytes, work.resid_bytes
    fs = cfg.shared_expert_intermediate_size or 0
    choice = k
    if cfg.moe_router == "sigmoid_grouped":
        choice += 2 * cfg.n_group + cfg.topk_group
    kept = 12 * choice + (k * (r + d) * h if layout.ep > 1 else 0)
    if layout.ep > 1 and layout.ep_dispatch == "hierarchical":  # the network level's pair
        # rows received and returned, for the D expected nodes per token, and its
        # assignments' ids and weights
        kept += float(nodes_per_token(cfg, layout.ep_inter)) * (r + d) * h + 12 * k
    if "moe" not in modules:
        kept += d * e + k * d * (2 * f + h)
        if fs and "shared_experts" not in modules:
            kept += d * (2 * fs + h) + (d if cfg.shared_expert_gate else 0)
    return kept


def selective_layer_bytes(cfg: ModelConfig, layout: Layout, work: Workload,
                          tokens: int, dense: bool = False) -> float:
    """Bytes one block keeps per rank for ``tokens`` tokens under selective recompute with
    ``layout.recompute_modules``: its input, its attention's kept outputs (grouped-query as
    ``selective_block_bytes``, latent as ``latent_attention_kept``), o_proj's output, and
    the MLP's (d·(2·ffn + h), none under ``mlp``) or the mixture of experts' (``moe_kept``,
    plus the ep count exchange's 8·E bytes per block). ``dense``: a mixture of experts'
    dense first block (``dense_intermediate_size`` wide, split over tp)."""
    mods, sh, d = layout.recompute_modules, tp_shard(cfg, layout.tp), work.act_bytes
    h, r = cfg.hidden_size, work.resid_bytes or work.act_bytes
    flash = work.flash_attention and "core_attn" not in mods
    if cfg.kv_lora_rank:
        attn = latent_attention_kept(cfg, sh.heads, d, mods, work.flash_attention)
    else:
        attn = selective_block_bytes(1, 0, sh.heads, sh.kv_heads, cfg.head_dim, 0,
                                     act_bytes=d, flash_attention=flash) + d * h
    per_token = r * h / (layout.tp if layout.sp and layout.tp > 1 else 1) + attn
    if cfg.num_local_experts and not dense:
        per_token += moe_kept(cfg, layout, work, mods)
        return tokens * per_token + _count_exchange(cfg, layout)
    ffn = cfg.dense_intermediate_size // layout.tp if cfg.num_local_experts else sh.ffn
    return tokens * (per_token + (0 if "mlp" in mods else d * (2 * ffn + h)))


def _count_exchange(cfg: ModelConfig, layout: Layout) -> int:
    """The count exchange's kept bytes per MoE block: 8·E over a flat ep, 16·A + 8·E/A over
    the hierarchical dispatch's A nodes."""
    if layout.ep == 1:
        return 0
    if layout.ep_dispatch == "hierarchical":
        return 16 * layout.ep_inter + 8 * cfg.num_local_experts // layout.ep_inter
    return 8 * cfg.num_local_experts


def recomputed_matmul_parameters(cfg: ModelConfig, layout: Layout) -> int:
    """Weights per rank whose matmuls a selective block runs again in backward, per token:
    ``mla_up_proj``'s q_b and kv_b, ``mlp``'s dense MLP, ``moe``'s router and k experts (and
    shared expert), ``shared_experts``' shared expert. 0 under the default policy."""
    mods, sh, h = layout.recompute_modules, tp_shard(cfg, layout.tp), cfg.hidden_size
    if layout.recompute != "selective" or not mods:
        return 0
    out = 0
    if "mla_up_proj" in mods and cfg.kv_lora_rank:
        q = cfg.q_lora_rank * sh.heads * cfg.head_dim
        out += q + cfg.kv_lora_rank * sh.heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    if not cfg.num_local_experts:
        return out + (3 * h * sh.ffn if "mlp" in mods else 0)
    fs = cfg.shared_expert_intermediate_size or 0
    shared = 3 * h * fs + (h if cfg.shared_expert_gate else 0) if fs else 0
    if "moe" in mods:
        return out + cfg.num_local_experts * h \
            + cfg.num_experts_per_tok * 3 * h * cfg.intermediate_size + shared
    return out + (shared if "shared_experts" in mods else 0)


def recomputed_core(layout: Layout, work: Workload) -> bool:
    """Whether a selective block runs its attention core again in backward: a materialised
    one always, the fused kernel under ``core_attn``."""
    return layout.recompute == "selective" and (
        not work.flash_attention or "core_attn" in layout.recompute_modules)
