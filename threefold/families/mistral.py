"""Mistral (``MistralForCausalLM``): Llama's block with an optional sliding window over every
layer (``sliding_window`` in config.json; null = the whole causal context)."""

from threefold.families.llama import LLAMA_LIKE
from threefold.families.spec import Family, need


def _read(c: dict, where: str) -> dict:
    window = c.get("sliding_window")
    need(c, where, window is None or (isinstance(window, int) and window > 0),
         "sliding_window", "a positive integer or null is needed")
    return dict(sliding_window=window or 0)


MISTRAL = Family("mistral", "MistralForCausalLM", read=_read,
                 write=lambda cfg: {"sliding_window": cfg.sliding_window or None},
                 fixed=dict(**LLAMA_LIKE, qkv_bias=False, qk_norm=False, norm_layout="pre"),
                 doc="Llama with a sliding window on every layer")
