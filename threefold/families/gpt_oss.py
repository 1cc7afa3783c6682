"""GPT-OSS (``GptOssForCausalLM``, OpenAI's gpt-oss-20b and gpt-oss-120b): attention with
biases on q, k, v and o and a learned sink logit per head, sliding-window blocks (128 tokens)
alternating with full ones (``layer_types``), YaRN without rounding its ramp, and every block
a mixture of experts whose router and projections have biases, top-k of the logits then a
softmax over the k, and a clamped SwiGLU. Files name the router ``mlp.router`` and store the
experts as transformers does, (E, h, 2f) with gate and up columns interleaved and (E, f, h),
or quantised to MXFP4 as published (``*_blocks`` / ``*_scales``): ``threefold.weights``
serves them as the shared experts' layout."""

from threefold.families.deepseek_v3 import YARN_KEYS
from threefold.families.gemma3 import window_pattern
from threefold.families.llama import LLAMA_LIKE, PLAIN_BLOCKS
from threefold.families.spec import Family, need


def _rope(c: dict, where: str) -> dict:
    rope = dict(c.get("rope_parameters") or {"rope_theta": c.get("rope_theta", 150000.0),
                                              **(c.get("rope_scaling") or {})})
    kind = rope.get("rope_type", rope.get("type", "default"))
    need(c, where, kind in ("default", "yarn"), "rope_parameters",
         f"rope_type {kind!r} is not built (default or yarn)")
    need(c, where, rope.get("attention_factor") is None, "rope_parameters",
         "YaRN's attention_factor is taken from its factor")
    out = dict(rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 150000.0))),
               rope_scaling="none")
    if kind == "yarn":
        need(c, where, "factor" in rope and "original_max_position_embeddings" in rope,
             "rope_parameters", "yarn needs factor and original_max_position_embeddings")
        out.update(rope_scaling="yarn", yarn_truncate=bool(rope.get("truncate", True)),
                   **{ours: float(rope[k]) for k, ours in YARN_KEYS.items()
                      if rope.get(k) is not None})
        out["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    return out


def _read(c: dict, where: str) -> dict:
    e, k = c.get("num_local_experts", 128), c.get("num_experts_per_tok", 4)
    need(c, where, isinstance(e, int) and e > 0, "num_local_experts", "a positive integer")
    need(c, where, isinstance(k, int) and 0 < k <= e, "num_experts_per_tok",
         "must be between 1 and num_local_experts")
    quant = c.get("quantization_config") or {}
    need(c, where, quant.get("quant_method", "mxfp4") == "mxfp4", "quantization_config",
         "only MXFP4 experts are read (dequantised on import)")
    n = c.get("num_hidden_layers", 0)
    kinds = c.get("layer_types") or ["full_attention" if i % 2 else "sliding_attention"
                                     for i in range(n)]
    bias = bool(c.get("attention_bias", True))
    return dict(num_local_experts=e, num_experts_per_tok=k, qkv_bias=bias,
                attention_out_bias=bias, norm_topk_prob=True,
                router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
                swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(c.get("swiglu_limit", 7.0)),
                **window_pattern({**c, "layer_types": kinds, "sliding_window":
                                  c.get("sliding_window", 128)}, where), **_rope(c, where))


def _write(cfg) -> dict:
    every, n = cfg.sliding_window_pattern, cfg.num_hidden_layers
    kinds = ["sliding_attention" if cfg.sliding_window and not (every and (i + 1) % every == 0)
             else "full_attention" for i in range(n)]
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling == "yarn":
        rope.update(rope_type="yarn", truncate=bool(cfg.yarn_truncate),
                    **{k: getattr(cfg, ours) for k, ours in YARN_KEYS.items()
                       if k not in ("mscale", "mscale_all_dim")})
    return {"num_local_experts": cfg.num_local_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok, "layer_types": kinds,
            "sliding_window": cfg.sliding_window or None, "rope_parameters": rope,
            "rope_scaling": None, "attention_bias": bool(cfg.qkv_bias),
            "swiglu_alpha": cfg.swiglu_alpha, "swiglu_limit": cfg.swiglu_limit,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False}


def _check(cfg) -> str | None:
    if cfg.qkv_bias != cfg.attention_out_bias:
        return (f"model.attention_out_bias: {cfg.attention_out_bias}, but gpt_oss's "
                f"attention_bias covers q, k, v and o alike (qkv_bias {cfg.qkv_bias})")
    if cfg.rope_scaling not in ("none", "yarn"):
        return f"model.rope_scaling: {cfg.rope_scaling}, but gpt_oss has none or yarn"
    if cfg.rope_scaling == "yarn" and cfg.yarn_mscale_all_dim:
        return "model.yarn_mscale_all_dim: gpt_oss's YaRN does not scale the scores"
    return None


GPT_OSS = Family("gpt_oss", "GptOssForCausalLM", read=_read, write=_write,
                 fixed={**{k: v for k, v in LLAMA_LIKE.items()
                           if k not in (*PLAIN_BLOCKS, "sliding_window_pattern",
                                        "norm_fp32_weight")},
                        "qk_norm": False, "norm_layout": "pre", "norm_fp32_weight": True,
                        "attention_sinks": True, "moe_bias": True,
                        "moe_activation": "clamped_swiglu", "norm_topk_prob": True,
                        "shared_expert_intermediate_size": 0},
                 experts=True, expert_files="gpt_oss", check=_check,
                 doc="attention sinks, alternating windows, biased clamped experts")
