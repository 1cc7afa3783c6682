"""Gemma 3, the text model (``Gemma3ForCausalLM``, model_type ``gemma3_text``): sandwich
norms (before and after each sub-layer) that scale by (1 + weight), per-head q/k norms, GeGLU
(the tanh GeLU), embeddings scaled by sqrt(h), scores scaled by 1/sqrt(query_pre_attn_scalar),
and local sliding-window blocks, each with a RoPE base of its own, between global ones
(``layer_types``, every ``sliding_window_pattern``-th block global)."""

from threefold.families.llama import NOT_DEEPSEEK, PLAIN_BLOCKS
from threefold.families.spec import Family, FamilyError, need

ROPE_TYPES = ("default", "linear")


def window_pattern(c: dict, where: str) -> dict:
    """The window fields from ``layer_types`` (or the older ``sliding_window_pattern``)."""
    n = c.get("num_hidden_layers", 0)
    kinds = c.get("layer_types") or [
        "full_attention" if (i + 1) % c.get("sliding_window_pattern", 6) == 0
        else "sliding_attention" for i in range(n)]
    full = [k == "full_attention" for k in kinds]
    if len(kinds) != n or any(k not in ("full_attention", "sliding_attention") for k in kinds):
        raise FamilyError(f"{where}: layer_types is not supported (one full_attention or "
                          f"sliding_attention per layer is needed)")
    window = c.get("sliding_window", 4096) or 0  # (transformers' default when absent)
    if all(full) or not window:
        return dict(sliding_window=0, sliding_window_pattern=0)
    every = full.index(True) + 1 if any(full) else 0
    if any(f != bool(every and (i + 1) % every == 0) for i, f in enumerate(full)):
        raise FamilyError(f"{where}: layer_types is not supported (global layers must recur "
                          f"every N layers: sliding_window_pattern)")
    return dict(sliding_window=window, sliding_window_pattern=every)


def _rope(c: dict, where: str) -> dict:
    """The RoPE fields: the global blocks' base (and linear scaling), the local blocks'."""
    params = c.get("rope_parameters") or {}
    # each layer kind's parameters, their base falling back as transformers' does
    full = {"rope_theta": c.get("rope_theta", 1e6),
            **(params.get("full_attention") or c.get("rope_scaling") or {})}
    local = {"rope_theta": c.get("rope_local_base_freq", 1e4),
             **(params.get("sliding_attention") or {})}
    for key, rope in (("full_attention", full), ("sliding_attention", local)):
        kind = rope.get("rope_type", rope.get("type", "default"))
        need(c, where, kind in ROPE_TYPES and (key == "full_attention" or kind == "default"),
             "rope_parameters", f"{key}: rope_type {kind!r} is not built (default, or linear "
             "on full-attention layers)")
    linear = full.get("rope_type", full.get("type")) == "linear"
    need(c, where, not linear or isinstance(full.get("factor"), (int, float)),
         "rope_parameters", "linear scaling needs a factor")
    return dict(rope_theta=float(full.get("rope_theta", 1e6)),
                rope_local_theta=float(local.get("rope_theta", 1e4)),
                rope_scaling="linear" if linear else "none",
                **({"rope_scaling_factor": float(full["factor"])} if linear else {}))


def _read(c: dict, where: str) -> dict:
    need(c, where, c.get("hidden_activation", "gelu_pytorch_tanh") in
         ("gelu_pytorch_tanh", "gelu_tanh"), "hidden_activation", "GeGLU uses the tanh GeLU")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        need(c, where, c.get(name) is None, name, "soft-capping is not built (Gemma 3 has none)")
    need(c, where, not c.get("use_bidirectional_attention"), "use_bidirectional_attention",
         "attention is causal")
    scalar = c.get("query_pre_attn_scalar", 256)
    need(c, where, isinstance(scalar, (int, float)) and scalar > 0 and scalar == int(scalar),
         "query_pre_attn_scalar", "a positive whole number is needed")
    return dict(query_pre_attn_scalar=int(scalar), hidden_act="gelu_tanh",
                **window_pattern(c, where), **_rope(c, where))


def _write(cfg) -> dict:
    n, every, window = cfg.num_hidden_layers, cfg.sliding_window_pattern, cfg.sliding_window
    kinds = ["sliding_attention" if window and not (every and (i + 1) % every == 0)
             else "full_attention" for i in range(n)]
    full = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling == "linear":
        full.update(rope_type="linear", factor=float(cfg.rope_scaling_factor))
    local = {"rope_type": "default",
             "rope_theta": float(cfg.rope_local_theta or cfg.rope_theta)}
    # (transformers' Gemma 3 builds a sliding mask even when every layer is global, so a
    # window is always written: the context's, unused then)
    return {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
            "sliding_window": window or cfg.max_position_embeddings, "layer_types": kinds,
            "rope_parameters": {"full_attention": full, "sliding_attention": local},
            "rope_theta": float(cfg.rope_theta), "rope_local_base_freq": local["rope_theta"],
            "rope_scaling": None if cfg.rope_scaling != "linear" else
            {"rope_type": "linear", "factor": float(cfg.rope_scaling_factor)},
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "use_bidirectional_attention": False}


def _check(cfg) -> str | None:
    if cfg.rope_scaling == "llama3":
        return "model.rope_scaling: llama3, but gemma3_text scales RoPE linearly or not at all"
    if cfg.sliding_window and not cfg.rope_local_theta:
        return ("model.rope_local_theta: 0, but gemma3_text's sliding-window layers have a "
                "RoPE base of their own (10000)")
    return None


GEMMA3 = Family("gemma3_text", "Gemma3ForCausalLM", read=_read, write=_write,
                fixed=dict(**NOT_DEEPSEEK, **PLAIN_BLOCKS, qkv_bias=False, qk_norm=True, qk_norm_over="head",
                           norm_layout="sandwich", norm_plus_one=True, hidden_act="gelu_tanh",
                           embed_scale=True, partial_rotary_factor=1.0,
                           norm_fp32_weight=True, rope_fp32=False),
                check=_check, doc="local/global attention, sandwich (1 + w) norms, GeGLU")
