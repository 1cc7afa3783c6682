"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms, a head width of its own), dense; their
configs carry a ``sliding_window`` that is off (``use_sliding_window`` false), which loads."""

from threefold.families.llama import LLAMA_LIKE
from threefold.families.spec import Family, need

# what Qwen's config.json says of the window it does not use
NO_WINDOW = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 0}


def no_window(c: dict, where: str) -> None:
    """FamilyError for a Qwen config whose sliding window is on."""
    need(c, where, not c.get("use_sliding_window", False), "use_sliding_window",
         "this model attends to the whole causal context")
    layer_types = c.get("layer_types") or []
    need(c, where, all(t == "full_attention" for t in layer_types), "layer_types",
         "every layer must be full attention (no sliding window)")


def _read(c: dict, where: str) -> dict:
    no_window(c, where)
    return {}


QWEN2 = Family("qwen2", "Qwen2ForCausalLM", read=_read, write=lambda cfg: dict(NO_WINDOW),
               fixed=dict(**LLAMA_LIKE, qkv_bias=True, qk_norm=False, norm_layout="pre",
                          sliding_window=0),
               doc="Llama with q/k/v biases")
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", read=_read, write=lambda cfg: dict(NO_WINDOW),
               fixed=dict(**LLAMA_LIKE, qkv_bias=False, qk_norm=True, qk_norm_over="head",
                          norm_layout="pre", sliding_window=0),
               doc="Llama with per-head q/k norms")
