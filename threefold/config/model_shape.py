"""The model's shape: ``ModelConfig``, every field documented, filled from a named preset."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from threefold.config.fields import ConfigError, doc_field as _f, unknown_value
from threefold.config.presets import MODEL_PRESETS


@dataclass
class ModelConfig:
    """Llama-style decoder shape. Unset (None) fields come from the preset."""

    preset: str = _f("tiny", "named shape to start from: " + ", ".join(MODEL_PRESETS))
    vocab_size: int | None = _f(None, "vocabulary size; 0 = the tokenizer's")
    hidden_size: int | None = _f(None, "model width h")
    intermediate_size: int | None = _f(None, "SwiGLU inner width")
    num_hidden_layers: int | None = _f(None, "number of transformer blocks")
    num_attention_heads: int | None = _f(None, "query heads")
    num_key_value_heads: int | None = _f(None, "key/value heads (GQA); equal to heads for MHA")
    rms_norm_eps: float | None = _f(None, "RMSNorm epsilon")
    rope_theta: float | None = _f(None, "RoPE base frequency")
    rope_scaling: str | None = _f(None, "RoPE scaling: none, llama3, linear (positions "
                                  "divided by the factor; Gemma 3's full-attention blocks) or "
                                  "yarn (DeepSeek-V3)")
    rope_scaling_factor: float | None = _f(None, "llama3 or linear RoPE scaling factor")
    low_freq_factor: float | None = _f(None, "llama3 RoPE low-frequency factor")
    high_freq_factor: float | None = _f(None, "llama3 RoPE high-frequency factor")
    original_max_position_embeddings: int | None = _f(None, "llama3 RoPE original context")
    max_position_embeddings: int | None = _f(None, "longest supported sequence")
    tie_word_embeddings: bool | None = _f(None, "share embedding and LM-head weights")
    attention_head_dim: int = _f(0, "width of one attention head; 0 = hidden_size / "
                                 "num_attention_heads (Qwen3's head_dim may differ)")
    qkv_bias: bool = _f(False, "biases on the q, k and v projections (Qwen2)")
    qk_norm: bool = _f(False, "RMSNorm over q and k before RoPE (Qwen3, OLMo 2)")
    qk_norm_over: str = _f("head", "what a q/k norm normalises: head (each head, Qwen3) or "
                           "projection (the whole q or k projection, OLMo 2)")
    norm_layout: str = _f("pre", "where a block's norms sit: pre (before each sub-layer, "
                          "Llama), post (on each sub-layer's output, before the residual "
                          "add, OLMo 2) or sandwich (both, Gemma 3)")
    norm_plus_one: bool = _f(False, "RMSNorms scale by (1 + weight), their weights starting "
                             "at 0 (Gemma)")
    norm_fp32_weight: bool = _f(False, "RMSNorms multiply their weight in fp32 and round once "
                                "(Gemma, OLMo 2); false: the normalised input is rounded "
                                "first (Llama); the same in fp32")
    hidden_act: str = _f("silu", "the MLP's gate activation: silu (SwiGLU) or gelu_tanh "
                         "(GeGLU, Gemma)")
    embed_scale: bool = _f(False, "multiply the embeddings by sqrt(hidden_size) (Gemma)")
    query_pre_attn_scalar: int = _f(0, "attention scores scaled by 1/sqrt(this) (Gemma 3); "
                                    "0 = by the head width")
    sliding_window: int = _f(0, "attention window: a token sees itself and the window - 1 "
                             "tokens before it (Mistral, Gemma 3's local blocks); 0 = the "
                             "whole causal context")
    sliding_window_pattern: int = _f(0, "with a sliding window, every N-th block attends to "
                                     "the whole context instead (Gemma 3: 6); 0 = every "
                                     "block slides")
    kv_lora_rank: int = _f(0, "multi-head latent attention (DeepSeek-V2/V3): keys and values "
                           "from a latent of this width; 0 = grouped-query attention")
    q_lora_rank: int = _f(0, "latent attention: queries through a latent of this width; 0 = "
                          "one projection")
    qk_nope_head_dim: int = _f(0, "latent attention: each head's query/key features without "
                               "RoPE")
    qk_rope_head_dim: int = _f(0, "latent attention: each head's query/key features with "
                               "RoPE (the key's shared by every head)")
    v_head_dim: int = _f(0, "latent attention: each head's value width")
    rope_fp32: bool = _f(False, "RoPE rotates queries and keys in fp32, rounded once "
                         "(OLMo 2); the same in fp32")
    rope_interleave: bool = _f(False, "RoPE rotates interleaved feature pairs (DeepSeek's "
                               "layout) instead of the two halves")
    yarn_beta_fast: float = _f(32.0, "YaRN: rotations above which frequencies are kept")
    yarn_beta_slow: float = _f(1.0, "YaRN: rotations below which frequencies are divided by "
                               "the factor")
    yarn_mscale: float = _f(1.0, "YaRN: the cos/sin scale's coefficient")
    yarn_mscale_all_dim: float = _f(0.0, "YaRN: the coefficient that also scales attention "
                                    "scores (DeepSeek); 0 = none")
    partial_rotary_factor: float = _f(1.0, "share of each head's features RoPE rotates, "
                                      "the first ones (Phi-3); 1 = all")
    rope_local_theta: float = _f(0.0, "RoPE base of the sliding-window blocks (Gemma 3: "
                                 "10000); 0 = rope_theta")
    yarn_truncate: bool = _f(True, "YaRN: the ramp's ends rounded to whole dimensions "
                             "(DeepSeek); false: kept fractional (GPT-OSS)")
    attention_sinks: bool = _f(False, "a learned logit per head that joins each query's "
                               "softmax denominator and takes no value (GPT-OSS's sinks)")
    attention_out_bias: bool = _f(False, "a bias on the attention's output projection o_proj "
                                  "(GPT-OSS, whose attention_bias covers q, k, v and o)")
    moe_bias: bool = _f(False, "biases on the router and on the experts' projections "
                        "(GPT-OSS)")
    moe_activation: str = _f("swiglu", "the experts' activation: swiglu, or clamped_swiglu "
                             "(GPT-OSS: gate clamped above and up both ways at swiglu_limit, "
                             "(up + 1) · gate · sigmoid(swiglu_alpha · gate))")
    swiglu_alpha: float = _f(1.702, "clamped_swiglu: the sigmoid's gain")
    swiglu_limit: float = _f(7.0, "clamped_swiglu: where gate and up are clamped")
    # (not compared: two configs that differ only in the name compute the same model)
    family: str | None = field(default=None, compare=False, metadata={
        "doc": "the Hugging Face model_type this model is and exports as (threefold.families "
               "lists them); unset = the preset's, else the one family whose spec the "
               "fields meet (llama when it does)"})
    init_std: float = _f(0.02, "std of the normal init of weights")
    num_local_experts: int | None = _f(None, "experts per MoE layer (Mixtral-style, every "
                                       "block's MLP routed); 0 = dense MLPs")
    num_experts_per_tok: int | None = _f(None, "experts each token is routed to (top-k)")
    router_aux_loss_coef: float = _f(0.02, "weight of the load-balancing loss E·Σ f_i·P_i "
                                     "(Switch/Mixtral; 0.02 as Mixtral-8x7B's config.json)")
    router_z_loss_coef: float = _f(0.0, "weight of the router z-loss mean(logsumexp(logits)²) "
                                   "(ST-MoE suggests 0.001; 0 = off, as Mixtral)")
    shared_expert_intermediate_size: int = _f(0, "width of a shared expert beside the routed "
                                              "ones, every token through it, its output "
                                              "scaled by sigmoid(x · shared_expert_gate) "
                                              "(Qwen2-MoE); 0 = none (Mixtral)")
    moe_router: str = _f("softmax", "how experts are chosen: softmax (top-k of the softmax, "
                         "Mixtral/Qwen) or sigmoid_grouped (sigmoid scores, top-k within the "
                         "best topk_group of n_group groups, a load-balancing bias added for "
                         "the choice only: DeepSeek-V3)")
    n_group: int = _f(1, "sigmoid_grouped routing: expert groups")
    topk_group: int = _f(1, "sigmoid_grouped routing: groups a token may use")
    routed_scaling_factor: float = _f(1.0, "routed experts' weights multiplied by this "
                                      "(DeepSeek-V3: 2.5)")
    router_bias_update_rate: float = _f(0.001, "sigmoid_grouped routing: each step the "
                                        "load-balancing bias moves this much toward "
                                        "under-loaded experts (DeepSeek-V3's gamma)")
    shared_expert_gate: bool = _f(True, "a shared expert's output scaled by a sigmoid gate "
                                  "(Qwen2-MoE's mlp.shared_expert); false: added as it is "
                                  "(DeepSeek's mlp.shared_experts)")
    first_k_dense_replace: int = _f(0, "the first blocks with a dense MLP of "
                                    "dense_intermediate_size in a mixture of experts "
                                    "(DeepSeek-V3: 3)")
    dense_intermediate_size: int = _f(0, "the dense blocks' MLP width (first_k_dense_replace)")
    norm_topk_prob: bool = _f(True, "renormalise the k chosen router probabilities to sum to "
                              "one (Mixtral; false: the softmax values as they are, as "
                              "Qwen1.5-MoE's norm_topk_prob false)")
    router_aux_loss_per_layer: bool = _f(False, "load-balancing loss per layer, averaged over "
                                         "layers (Megatron/DeepSeek style; what pipeline "
                                         "parallelism needs), instead of f and P pooled over "
                                         "all layers first (transformers' Mixtral)")
    num_nextn_predict_layers: int = _f(0, "multi-token prediction depth D (DeepSeek-V3: 1): "
                                       "D sequential modules after the last block, module k "
                                       "predicting the token k + 1 after the next; 0 = none")
    mtp_loss_weight: float = _f(0.1, "multi-token prediction: lambda, the D modules' mean "
                                "cross-entropy's weight in the loss (DeepSeek-V3: 0.3, then "
                                "0.1; Megatron's mtp_loss_scaling_factor)")
    moe_impl: str = field(default="grouped", compare=False, metadata={
        "doc": "how a rank runs its local experts: grouped (one torch._grouped_mm over the "
               "tokens sorted by expert) or loop (one matmul per expert, the reference); the "
               "same values either way"})

    def resolved(self, vocab_size: int | None = None) -> "ModelConfig":
        """A copy with every None filled from the preset, and every field the preset sets
        that was left at its own default (and vocab from the tokenizer)."""
        if self.preset not in MODEL_PRESETS:
            raise ConfigError(unknown_value("model.preset", self.preset, MODEL_PRESETS))
        base = dict(rope_scaling_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192, num_local_experts=0,
                    num_experts_per_tok=2)
        base.update(MODEL_PRESETS[self.preset])
        out = dataclasses.replace(self)
        preset = MODEL_PRESETS[self.preset]
        for f in dataclasses.fields(self):
            if getattr(out, f.name) is None:
                setattr(out, f.name, base.get(f.name))
            elif f.name in preset and getattr(out, f.name) == f.default:
                # a field with a default of its own (DeepSeek-V3's latent attention, its
                # routing): the preset's value where the field was left at that default
                setattr(out, f.name, preset[f.name])
        if not out.vocab_size:
            out.vocab_size = vocab_size or 0
        return out

    @property
    def head_dim(self) -> int:
        """Width of one attention head (of its queries and keys under latent attention)."""
        if self.kv_lora_rank:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads
