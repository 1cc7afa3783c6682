"""Phi-3 (``Phi3ForCausalLM``; Phi-3-mini/medium 4k; longrope's 128k variants and Phi-4-mini
are refused by field): Llama's block, with RoPE over the first ``partial_rotary_factor`` of
each head and an optional sliding window on every layer (transformers 5 masks it as
Mistral's: a token sees itself and the ``sliding_window`` - 1 before it). Files fuse the
projections: ``self_attn.qkv_proj`` (q rows, then k, then v) and ``mlp.gate_up_proj`` (gate rows,
then up); threefold keeps Llama's separate layers in memory and splits or joins them at the files'
boundary only (``FUSED``: ``threefold.weights.HFSource`` reads each part as a region of the fused
tensor, ``threefold.weights.hf.hub_tensors`` writes the fused tensors,
``threefold.generation.peft_export`` fuses the adapters). The long-context models' ``longrope`` RoPE
(Phi-3-mini-128k) is not built and is refused by field."""

from __future__ import annotations

from threefold.families.llama import LLAMA_LIKE
from threefold.families.spec import Family, FamilyError, need

# fused layer of a block (as files and PEFT name it) -> threefold's layers it holds, in the
# fused weight's row order
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# transformers calls Phi-3's long-context RoPE longrope; older configs called it su or yarn
LONGROPE = ("longrope", "su", "yarn")


def _rope_type(c: dict, where: str) -> None:
    """FamilyError naming the RoPE field unless Phi-3's RoPE is the default (unscaled) one."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = c.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) \
            else rope
        if kind != "default":  # the message leaves out the factor lists (a hundred numbers)
            what = "longrope is not built" if kind in LONGROPE else "Phi-3's RoPE is default"
            raise FamilyError(f"{where}: {key}.rope_type={kind!r} is not supported ({what}; "
                              "the 4k-context Phi-3 models' default RoPE is)")


def _rotary(c: dict, where: str) -> float:
    """``partial_rotary_factor`` (in rope_parameters, as transformers 5 keeps it, else at
    the top level), checked to rotate an even number of each head's features."""
    rope = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    ok = isinstance(factor, (int, float)) and 0 < factor <= 1
    need({**c, "partial_rotary_factor": factor}, where, ok, "partial_rotary_factor",
         "a share in (0, 1] is needed")
    heads, h = c.get("num_attention_heads"), c.get("hidden_size")
    head_dim = c.get("head_dim") or (h // heads if isinstance(h, int) and
                                     isinstance(heads, int) and heads > 0 else 0)
    if isinstance(head_dim, int) and head_dim > 0:  # (a bad shape is named by the shared check)
        dim = int(head_dim * factor)
        need({**c, "partial_rotary_factor": factor}, where, dim > 0 and dim % 2 == 0,
             "partial_rotary_factor", f"RoPE needs an even number of features; it gives "
             f"{dim} of the head's {head_dim}")
    return float(factor)


def _read(c: dict, where: str) -> dict:
    _rope_type(c, where)
    window = c.get("sliding_window")
    need(c, where, window is None or (isinstance(window, int) and window > 0),
         "sliding_window", "a positive integer or null is needed")
    for name in ("resid_pdrop", "embd_pdrop"):
        need(c, where, not c.get(name), name, "this model has no dropout")
    original = c.get("original_max_position_embeddings")
    need(c, where, original is None or (isinstance(original, int) and original > 0),
         "original_max_position_embeddings", "a positive integer is needed")
    return dict(sliding_window=window or 0, partial_rotary_factor=_rotary(c, where),
                **({"original_max_position_embeddings": original} if original else {}))


def _write(cfg) -> dict:
    factor, theta = float(cfg.partial_rotary_factor), float(cfg.rope_theta)
    return {"sliding_window": cfg.sliding_window or None, "partial_rotary_factor": factor,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                                "partial_rotary_factor": factor},
            "rope_scaling": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            # only longrope reads it; written back so that the folder says what it said
            "original_max_position_embeddings": int(cfg.original_max_position_embeddings)}


_LLAMA = {k: v for k, v in LLAMA_LIKE.items() if k != "partial_rotary_factor"}  # Phi-3's own

PHI3 = Family("phi3", "Phi3ForCausalLM", read=_read, write=_write,
              fixed=dict(**_LLAMA, qkv_bias=False, qk_norm=False, norm_layout="pre",
                         rope_scaling="none"),
              fused=FUSED,
              doc="Llama with partial RoPE, a sliding window, fused qkv/gate_up files")
