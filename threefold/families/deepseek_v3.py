"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, arXiv 2412.19437): multi-head latent attention
(``threefold.model.mla``), DeepSeekMoE (sigmoid scores, group-limited top-k, weights scaled by
``routed_scaling_factor``, ungated shared experts, a load-balancing bias that moves outside
the optimiser) after ``first_k_dense_replace`` dense blocks, RoPE on interleaved pairs, and
YaRN. config.json's ``intermediate_size`` is the dense blocks' width and
``moe_intermediate_size`` an expert's. The multi-token-prediction modules
(``num_nextn_predict_layers``, stored as layers ``num_hidden_layers`` onwards) are built and
trained (``threefold.model.mtp``); transformers' model ignores them."""

from threefold.families.llama import LLAMA_LIKE, NOT_DEEPSEEK
from threefold.families.spec import Family, need

YARN_KEYS = {"factor": "rope_scaling_factor", "beta_fast": "yarn_beta_fast",
             "beta_slow": "yarn_beta_slow", "mscale": "yarn_mscale",
             "mscale_all_dim": "yarn_mscale_all_dim",
             "original_max_position_embeddings": "original_max_position_embeddings"}


def _rope(c: dict, where: str) -> dict:
    rope = dict(c.get("rope_parameters") or {"rope_theta": c.get("rope_theta", 10000.0),
                                              **(c.get("rope_scaling") or {})})
    kind = rope.get("rope_type", rope.get("type", "default"))
    need(c, where, kind in ("default", "yarn"), "rope_parameters",
         f"rope_type {kind!r} is not built (default or yarn)")
    out = dict(rope_theta=float(rope.get("rope_theta", 10000.0)), rope_scaling="none")
    if kind == "yarn":
        need(c, where, "factor" in rope and "original_max_position_embeddings" in rope,
             "rope_parameters", "yarn needs factor and original_max_position_embeddings")
        out.update(rope_scaling="yarn", **{ours: float(rope[k]) for k, ours in YARN_KEYS.items()
                                           if rope.get(k) is not None})
        out["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    return out


def _read(c: dict, where: str) -> dict:
    e, k, groups = c.get("n_routed_experts"), c.get("num_experts_per_tok"), c.get("n_group") or 1
    top_groups = c.get("topk_group") or 1
    need(c, where, isinstance(e, int) and e > 0, "n_routed_experts", "a positive integer")
    need(c, where, isinstance(k, int) and 0 < k <= e, "num_experts_per_tok",
         "must be between 1 and n_routed_experts")
    need(c, where, e % groups == 0 and e // groups >= 2 and 0 < top_groups <= groups,
         "n_group", "experts must split into groups of two or more, topk_group of them kept")
    need(c, where, c.get("kv_lora_rank", 0) > 0, "kv_lora_rank", "latent attention needs it")
    need(c, where, c.get("scoring_func", "sigmoid") == "sigmoid", "scoring_func",
         "DeepSeek-V3 routes by sigmoid scores")
    return dict(
        attention_head_dim=0, kv_lora_rank=c["kv_lora_rank"],
        q_lora_rank=c.get("q_lora_rank") or 0,
        qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"], rope_interleave=bool(c.get("rope_interleave", True)),
        num_local_experts=e, num_experts_per_tok=k, n_group=groups, topk_group=top_groups,
        intermediate_size=c["moe_intermediate_size"],
        dense_intermediate_size=c["intermediate_size"],
        first_k_dense_replace=int(c.get("first_k_dense_replace") or 0),
        shared_expert_intermediate_size=c["moe_intermediate_size"] * (c.get("n_shared_experts")
                                                                      or 0),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)), router_aux_loss_coef=0.0,
        num_nextn_predict_layers=int(c.get("num_nextn_predict_layers") or 0), **_rope(c, where))


def _write(cfg) -> dict:
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling == "yarn":
        rope.update(rope_type="yarn", **{k: getattr(cfg, ours) for k, ours in YARN_KEYS.items()})
    shared = cfg.shared_expert_intermediate_size // cfg.intermediate_size
    return {"kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank or None,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "head_dim": cfg.qk_rope_head_dim,
            "rope_interleave": cfg.rope_interleave, "n_routed_experts": cfg.num_local_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok, "n_group": cfg.n_group,
            "topk_group": cfg.topk_group, "moe_intermediate_size": cfg.intermediate_size,
            "intermediate_size": cfg.dense_intermediate_size or cfg.intermediate_size,
            "first_k_dense_replace": cfg.first_k_dense_replace, "n_shared_experts": shared,
            "routed_scaling_factor": cfg.routed_scaling_factor,
            "norm_topk_prob": bool(cfg.norm_topk_prob),
            "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
            "rope_parameters": rope, "rope_scaling": None if cfg.rope_scaling != "yarn" else rope}


def _check(cfg) -> str | None:
    if not cfg.kv_lora_rank:
        return "model.kv_lora_rank: 0, but deepseek_v3 has latent attention"
    if cfg.shared_expert_intermediate_size % cfg.intermediate_size:
        return ("model.shared_expert_intermediate_size: not a whole number of experts "
                "(deepseek_v3's n_shared_experts)")
    if cfg.rope_scaling not in ("none", "yarn"):
        return f"model.rope_scaling: {cfg.rope_scaling}, but deepseek_v3 has none or yarn"
    return None


DEEPSEEK_V3 = Family("deepseek_v3", "DeepseekV3ForCausalLM", read=_read, write=_write,
                     fixed={**{k: v for k, v in LLAMA_LIKE.items() if k not in NOT_DEEPSEEK},
                            "qkv_bias": False, "qk_norm": False,
                            "norm_layout": "pre", "sliding_window": 0,
                            "moe_router": "sigmoid_grouped", "shared_expert_gate": False,
                            "rope_interleave": True},
                     experts=True, expert_files="qwen", check=_check,
                     doc="latent attention, DeepSeekMoE after dense first blocks, YaRN")
