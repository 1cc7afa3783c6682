"""What a model family is, as data: ``Family``. A family is a Hugging Face ``model_type``
(``config.json``'s) that threefold's decoder (``threefold.model.decoder``, built from the shared
blocks of ``threefold.model.attention``, ``threefold.model.norm`` and ``threefold.model.moe``)
computes exactly. Its spec says how its ``config.json`` maps to and from ``ModelConfig`` fields,
which fields the family fixes (what export checks before it writes the family's name), and how its
experts are named in files. No torch here: the planner and the launcher read specs before any
process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from threefold.config import ConfigError, ModelConfig


# Tensor parallelism's plan, as data: module name pattern (relative to the model) -> style.
# Column-parallel layers keep a slice of output rows (q/k/v by heads, gate/up by width, the
# head by vocabulary), row-parallel ones a slice of input columns; the rest is replicated.
# Every family built so far keeps threefold's (Hugging Face's Llama) module names in memory.
LLAMA_TP_PLAN: dict[str, str] = {
    r"model\.embed_tokens": "vocab_embedding",
    r"model\.mtp_embed": "vocab_embedding",  # a pipeline's last-stage copy (multi-token)
    r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)": "column",
    # latent attention's per-head expansions (DeepSeek-V3), split by heads like q/k/v
    r"model\.layers\.\d+\.self_attn\.(q_b_proj|kv_b_proj)": "column",
    r"model\.layers\.\d+\.self_attn\.o_proj": "row",
    r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj)": "column",
    r"model\.layers\.\d+\.mlp\.down_proj": "row",
    r"lm_head": "vocab_column",
}


# The ModelConfig fields the families' blocks read besides the widths: a difference in any
# of them changes the function a checkpoint's weights compute (checked where weights load).
BLOCK_FIELDS = ("attention_head_dim", "qkv_bias", "qk_norm", "qk_norm_over", "norm_layout",
                "norm_plus_one", "norm_fp32_weight", "hidden_act", "embed_scale",
                "query_pre_attn_scalar", "sliding_window", "sliding_window_pattern",
                "rope_local_theta", "rope_fp32", "partial_rotary_factor", "kv_lora_rank",
                "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "rope_interleave", "moe_router", "n_group", "topk_group",
                "routed_scaling_factor", "shared_expert_gate", "first_k_dense_replace",
                "dense_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                "num_nextn_predict_layers", "yarn_truncate", "attention_sinks",
                "attention_out_bias", "moe_bias", "moe_activation", "swiglu_alpha",
                "swiglu_limit")


class FamilyError(ConfigError):
    """A config.json this family cannot take, or a model that is not of the family; the
    message names the file or field."""


def need(c: dict, where: str, ok: bool, name: str, why: str) -> None:
    """FamilyError naming ``name`` of config ``c`` (read from ``where``) unless ``ok``."""
    if not ok:
        raise FamilyError(f"{where}: {name}={c.get(name)!r} is not supported ({why})")


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family.

    ``read(c, where)`` gives the ``ModelConfig`` fields of ``config.json`` ``c`` beyond those
    every family shares (widths, heads, RoPE, norm epsilon: ``threefold.weights.hf_config``), or a
    FamilyError naming the first field threefold cannot compute. ``write(cfg)`` gives the
    family's own ``config.json`` fields. ``fixed`` are the ``ModelConfig`` values the family
    always has (a Qwen3 has q/k norms per head, no biases...): import sets them, export
    refuses a model that differs. ``experts`` says whether every block's MLP is a mixture of
    experts (True), never (False); ``expert_files`` how experts are named in files ("mixtral":
    ``block_sparse_moe.experts.N.w1``; "qwen": ``mlp.experts.N.gate_proj``). ``fused``: the
    layers a family's files fuse, each to threefold's layers in its row order (Phi-3's
    ``self_attn.qkv_proj``: q_proj, k_proj, v_proj), split at import and joined at export.
    ``tp_plan``: tensor parallelism's plan (``LLAMA_TP_PLAN``'s form)."""

    model_type: str
    architecture: str
    read: Callable[[dict, str], dict]
    write: Callable[[ModelConfig], dict]
    fixed: dict[str, Any] = field(default_factory=dict)
    experts: bool = False
    expert_files: str = ""
    check: Callable[[ModelConfig], str | None] = lambda cfg: None
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    tp_plan: dict[str, str] = field(default_factory=lambda: dict(LLAMA_TP_PLAN))
    doc: str = ""

    def distance(self, cfg: ModelConfig) -> int:
        """How many of the family's rules ``cfg`` breaks (0: it is one of the family)."""
        return (sum(getattr(cfg, k) != v for k, v in self.fixed.items())
                + (bool(cfg.num_local_experts) != self.experts) + bool(self.check(cfg)))

    def refusal(self, cfg: ModelConfig) -> str | None:
        """Why ``cfg`` is not a model of this family (naming the field), or None."""
        if bool(cfg.num_local_experts) != self.experts:
            kind = "a mixture of experts" if self.experts else "dense"
            return (f"model.num_local_experts: {cfg.num_local_experts}, but {self.model_type} "
                    f"is {kind}")
        for name, value in self.fixed.items():
            if getattr(cfg, name) != value:
                return (f"model.{name}: {getattr(cfg, name)!r}, but {self.model_type} has "
                        f"{value!r}")
        return self.check(cfg)
