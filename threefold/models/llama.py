"""Llama (``LlamaForCausalLM``): the plain pre-norm decoder, SwiGLU, RoPE with optional
Llama 3 rescaling; no biases, no q/k norms, no window."""

from threefold.models.spec import Family

DENSE = dict(qkv_bias=False, qk_norm=False, norm_layout="pre", sliding_window=0)

LLAMA = Family("llama", "LlamaForCausalLM", read=lambda c, where: {},
               write=lambda cfg: {}, fixed=DENSE, doc="the plain decoder")
