"""Llama (``LlamaForCausalLM``): the plain pre-norm decoder, SwiGLU, RoPE with optional
Llama 3 rescaling; no biases, no q/k norms, no window."""

from threefold.families.spec import Family

# what every family but DeepSeek-V3 has: grouped-query attention, softmax routing
NOT_DEEPSEEK = dict(kv_lora_rank=0, rope_interleave=False, moe_router="softmax",
                    first_k_dense_replace=0, shared_expert_gate=True,
                    num_nextn_predict_layers=0)
# what every family but GPT-OSS has: no attention sinks, no biases beyond q/k/v, plain SwiGLU
PLAIN_BLOCKS = dict(attention_sinks=False, attention_out_bias=False, moe_bias=False,
                    moe_activation="swiglu")
# what every Llama-like family (Llama, Qwen, Mixtral, Mistral) has: none of Gemma's pieces
LLAMA_LIKE = dict(**NOT_DEEPSEEK, norm_plus_one=False, hidden_act="silu", embed_scale=False,
                  query_pre_attn_scalar=0, rope_local_theta=0.0, sliding_window_pattern=0,
                  partial_rotary_factor=1.0, norm_fp32_weight=False, rope_fp32=False,
                  **PLAIN_BLOCKS)
DENSE = dict(qkv_bias=False, qk_norm=False, norm_layout="pre", sliding_window=0, **LLAMA_LIKE)

LLAMA = Family("llama", "LlamaForCausalLM", read=lambda c, where: {},
               write=lambda cfg: {}, fixed=DENSE, doc="the plain decoder")
