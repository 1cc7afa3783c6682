"""OLMo 2 (``Olmo2ForCausalLM``, arXiv 2501.00656): norms on each sub-layer's output before
the residual add (no input norm), and RMSNorms over the whole q and k projections (before
the heads are split; under tensor parallelism their sums of squares are all-reduced)."""

from threefold.families.llama import LLAMA_LIKE
from threefold.families.spec import Family

OLMO2 = Family("olmo2", "Olmo2ForCausalLM", read=lambda c, where: {},
               write=lambda cfg: {},
               fixed={**LLAMA_LIKE, "norm_fp32_weight": True, "rope_fp32": True,
                      "qkv_bias": False,
                      "qk_norm": True, "qk_norm_over": "projection", "norm_layout": "post",
                      "sliding_window": 0},
               doc="post-norm blocks, q/k norms over the projections")
