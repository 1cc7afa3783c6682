"""Mixtral (``MixtralForCausalLM``): every block's MLP a routed mixture of SwiGLU experts,
top-k renormalised; files name experts ``block_sparse_moe.experts.N.w1/w3/w2``."""

from threefold.families.llama import LLAMA_LIKE
from threefold.families.spec import Family, need


def _read(c: dict, where: str) -> dict:
    e, k = c.get("num_local_experts", 8), c.get("num_experts_per_tok", 2)
    need(c, where, isinstance(e, int) and e > 0, "num_local_experts",
         "a positive integer is needed")
    need(c, where, isinstance(k, int) and 0 < k <= e, "num_experts_per_tok",
         "must be between 1 and num_local_experts")
    need(c, where, c.get("sliding_window") is None, "sliding_window",
         "this model attends to the whole causal context")
    need(c, where, not c.get("router_jitter_noise", 0.0), "router_jitter_noise",
         "the router has no jitter")
    return dict(num_local_experts=e, num_experts_per_tok=k,
                router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.02)))


def _write(cfg) -> dict:
    return {"num_local_experts": cfg.num_local_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "router_jitter_noise": 0.0,
            "output_router_logits": False, "sliding_window": None}


MIXTRAL = Family("mixtral", "MixtralForCausalLM", read=_read, write=_write,
                 fixed=dict(**LLAMA_LIKE, qkv_bias=False, qk_norm=False, norm_layout="pre",
                            sliding_window=0,
                            norm_topk_prob=True, shared_expert_intermediate_size=0),
                 experts=True, expert_files="mixtral",
                 doc="every block a mixture of experts, top-k renormalised")
