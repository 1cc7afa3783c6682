"""Model presets: named shapes a ``ModelConfig`` starts from (``model.preset``). Pure data."""

from __future__ import annotations

from typing import Any

# --------------------------------------------------------------------------------------------
# Model presets. Shapes are the published ones (Llama 3 model cards / HF config.json files;
# GPT sizes from Narayanan et al. 2021, Table 1). `tiny` is the CPU default.
# GPT presets are written as this project's Llama-style block with multi-head attention, tied
# embeddings and a SwiGLU width of 8h/3, which gives the same 12·h² weights per layer as a GPT
# block (4h² attention + 8h² MLP); they are for planning on the meta device.
# --------------------------------------------------------------------------------------------
_LLAMA3_ROPE = dict(rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=8.0,
                    low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192, max_position_embeddings=131072,
                    vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=False)

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=0, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
                 rope_theta=10000.0, rope_scaling="none", max_position_embeddings=1024,
                 tie_word_embeddings=False),
    "small": dict(vocab_size=0, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
                  rope_theta=10000.0, rope_scaling="none", max_position_embeddings=2048,
                  tie_word_embeddings=False),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, **_LLAMA3_ROPE),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, **_LLAMA3_ROPE),
    "llama3-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                        num_attention_heads=128, num_key_value_heads=8, **_LLAMA3_ROPE),
    # Mixture of experts (threefold.model.moe). tiny-moe: the CPU MoE (8 experts of half tiny's MLP
    # width, top-2, so a token's MLP work is tiny's). mixtral-8x7b: mistralai/Mixtral-8x7B-v0.1
    # config.json (46,702,792,704 parameters, 12,879,925,248 active per token).
    # olmoe-shape-1b-7b: OLMoE-1B-7B's shape (Muennighoff et al., arXiv 2409.02060: 64 experts,
    # top-8) as a Mixtral block: OLMoE's q/k RMSNorms (2·2048 weights per layer) are not
    # modelled, so it has 6,919,096,320 parameters (OLMoE: 6,919,161,856) and
    # 1,281,951,744 active; it cannot load OLMoE's weights.
    "tiny-moe": dict(vocab_size=0, hidden_size=256, intermediate_size=344, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
                     rope_theta=10000.0, rope_scaling="none", max_position_embeddings=1024,
                     tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
                     family="mixtral"),
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         rms_norm_eps=1e-5, rope_theta=1e6, rope_scaling="none",
                         max_position_embeddings=32768, tie_word_embeddings=False,
                         num_local_experts=8, num_experts_per_tok=2, family="mixtral"),
    "olmoe-shape-1b-7b": dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                              num_hidden_layers=16, num_attention_heads=16,
                              num_key_value_heads=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                              rope_scaling="none", max_position_embeddings=4096,
                              tie_word_embeddings=False, num_local_experts=64,
                              num_experts_per_tok=8, family="mixtral"),
    # deepseek-ai/DeepSeek-V3 config.json (arXiv 2412.19437): 671B parameters without the
    # multi-token-prediction module, 37B active per token
    "deepseek-v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=2048,
                        dense_intermediate_size=18432, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512,
                        q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, rope_interleave=True, num_local_experts=256,
                        num_experts_per_tok=8, n_group=8, topk_group=4,
                        moe_router="sigmoid_grouped", routed_scaling_factor=2.5,
                        shared_expert_intermediate_size=2048, shared_expert_gate=False,
                        first_k_dense_replace=3, norm_topk_prob=True, router_aux_loss_coef=0.0,
                        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling="yarn",
                        rope_scaling_factor=40.0, original_max_position_embeddings=4096,
                        yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
                        max_position_embeddings=163840, tie_word_embeddings=False,
                        family="deepseek_v3"),
}
# openai/gpt-oss-120b and gpt-oss-20b config.json (OpenAI's model card: 116.8B parameters,
# 5.1B active per token without the embedding; 20.9B, 3.6B): 36 or 24 blocks alternating a
# 128-token window with full attention, 128 or 32 experts of which 4 per token
GPT_OSS_SHAPE = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                     num_attention_heads=64, num_key_value_heads=8, attention_head_dim=64,
                     num_experts_per_tok=4, sliding_window=128, sliding_window_pattern=2,
                     rms_norm_eps=1e-5, rope_theta=150000.0, rope_scaling="yarn",
                     rope_scaling_factor=32.0, original_max_position_embeddings=4096,
                     yarn_truncate=False, max_position_embeddings=131072,
                     tie_word_embeddings=False, qkv_bias=True, attention_out_bias=True,
                     attention_sinks=True, moe_bias=True, moe_activation="clamped_swiglu",
                     norm_fp32_weight=True, norm_topk_prob=True,
                     router_aux_loss_coef=0.001,  # (transformers' default, not OpenAI's)
                     family="gpt_oss")
MODEL_PRESETS["gpt-oss-120b"] = dict(GPT_OSS_SHAPE, num_hidden_layers=36, num_local_experts=128)
MODEL_PRESETS["gpt-oss-20b"] = dict(GPT_OSS_SHAPE, num_hidden_layers=24, num_local_experts=32)

# (params in billions as published, heads, hidden, layers) — Narayanan et al. 2021, Table 1.
GPT_SHAPES = {
    "gpt-1.7b": (24, 2304, 24), "gpt-3.6b": (32, 3072, 30), "gpt-7.5b": (32, 4096, 36),
    "gpt-18b": (48, 6144, 40), "gpt-39b": (64, 8192, 48), "gpt-76b": (80, 10240, 60),
    "gpt-145b": (96, 12288, 80), "gpt-310b": (128, 16384, 96), "gpt-530b": (128, 20480, 105),
    "gpt-1t": (160, 25600, 128),
}
for _name, (_a, _h, _l) in GPT_SHAPES.items():
    MODEL_PRESETS[_name] = dict(vocab_size=51200, hidden_size=_h, intermediate_size=8 * _h // 3,
                                num_hidden_layers=_l, num_attention_heads=_a,
                                num_key_value_heads=_a, rms_norm_eps=1e-5, rope_theta=10000.0,
                                rope_scaling="none", max_position_embeddings=2048,
                                tie_word_embeddings=True)
