"""Qwen2-MoE (a shared expert with its sigmoid gate; q/k/v biases as its config says) and
Qwen3-MoE (per-head q/k norms, no shared expert): every block routed, experts of
``moe_intermediate_size``; files name experts ``mlp.experts.N.gate_proj/up_proj/down_proj``."""

from threefold.families.llama import LLAMA_LIKE
from threefold.families.qwen import NO_WINDOW, no_window
from threefold.families.spec import Family, need


def _read(c: dict, where: str) -> dict:
    no_window(c, where)
    e = c.get("num_local_experts") or c.get("num_experts")
    k, f = c.get("num_experts_per_tok", 8), c.get("moe_intermediate_size")
    need(c, where, isinstance(e, int) and e > 0, "num_experts", "a positive integer is needed")
    need(c, where, isinstance(k, int) and 0 < k <= e, "num_experts_per_tok",
         "must be between 1 and num_experts")
    need(c, where, isinstance(f, int) and f > 0, "moe_intermediate_size",
         "a positive integer is needed")
    need(c, where, c.get("decoder_sparse_step", 1) == 1, "decoder_sparse_step",
         "every block's MLP must be routed (1)")
    need(c, where, not c.get("mlp_only_layers"), "mlp_only_layers",
         "every block's MLP must be routed (no dense layers)")
    qwen2 = c["model_type"] == "qwen2_moe"
    fs = c.get("shared_expert_intermediate_size", 0) if qwen2 else 0
    need(c, where, isinstance(fs, int) and fs >= 0, "shared_expert_intermediate_size",
         "a non-negative integer is needed")
    return dict(num_local_experts=e, num_experts_per_tok=k, intermediate_size=f,
                norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
                shared_expert_intermediate_size=fs,
                **({"qkv_bias": bool(c.get("qkv_bias", True))} if qwen2 else {}))


def _write(cfg) -> dict:
    out = {**NO_WINDOW, "num_experts": cfg.num_local_experts,
           "num_local_experts": cfg.num_local_experts,
           "num_experts_per_tok": cfg.num_experts_per_tok,
           "moe_intermediate_size": cfg.intermediate_size, "decoder_sparse_step": 1,
           "mlp_only_layers": [], "norm_topk_prob": bool(cfg.norm_topk_prob),
           "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False}
    if cfg.family == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                   qkv_bias=bool(cfg.qkv_bias))
    return out


def _shared(cfg) -> str | None:
    if not cfg.shared_expert_intermediate_size:
        return ("model.shared_expert_intermediate_size: 0, but qwen2_moe has a shared "
                "expert")
    return None


QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", read=_read, write=_write,
                   fixed=dict(**LLAMA_LIKE, qk_norm=False, norm_layout="pre", sliding_window=0),
                   experts=True, expert_files="qwen", check=_shared,
                   doc="experts with a gated shared expert")
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", read=_read, write=_write,
                   fixed=dict(**LLAMA_LIKE, qkv_bias=False, qk_norm=True, qk_norm_over="head",
                              norm_layout="pre", sliding_window=0,
                              shared_expert_intermediate_size=0),
                   experts=True, expert_files="qwen", doc="experts, per-head q/k norms")
