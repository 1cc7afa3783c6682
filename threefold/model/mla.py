"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 §2.1; DeepSeek-V3, arXiv
2412.19437 §2.1), with Hugging Face ``DeepseekV3Attention``'s parameter names.

Keys and values come from one latent per token: ``kv_a_proj_with_mqa`` makes a latent of
``kv_lora_rank`` (normed by ``kv_a_layernorm``) and one RoPE key of ``qk_rope_head_dim``
shared by every head; ``kv_b_proj`` expands the latent into each head's key features without
RoPE (``qk_nope_head_dim``) and its value (``v_head_dim``). Queries go through a latent of
``q_lora_rank`` too (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``), or one ``q_proj`` when it
is 0. A head's query and key are its features without RoPE, then its RoPE features. The
scores are scaled by 1/sqrt(query width), times YaRN's temperature squared when the config
scales RoPE that way (``score_scale``).

Like ``threefold.model.attention.Attention`` it knows nothing of ranks: head counts come from
what ``q_b_proj`` and ``kv_b_proj`` return, so a tensor-parallel shard holding some heads runs
the same code.
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.model.attention import apply_rope, apply_rope_interleaved, sdpa_attention, yarn_mscale
from threefold.config import ModelConfig
from threefold.model.kernels import matmul_input
from threefold.model.kvcache import LayerKV
from threefold.model.norm import RMSNorm


def score_scale(cfg: ModelConfig) -> float:
    """The scores' scale: 1/sqrt(query width), times YaRN's temperature squared for every
    feature when ``yarn_mscale_all_dim`` is set (DeepSeek's reference does so)."""
    scale = cfg.head_dim ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.yarn_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_scaling_factor, cfg.yarn_mscale_all_dim) ** 2
    return scale


class LatentAttention(nn.Module):
    """Causal multi-head latent attention (see the module docstring)."""

    qk_norm = ""  # (what the blocks ask every attention: no q/k norms of Qwen's kind)

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, \
            cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        q_width = heads * (self.nope + self.rope)
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(h, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.latent + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.latent, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.latent, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=False)
        self.interleave, self.scale, self.window = cfg.rope_interleave, score_scale(cfg), 0
        self.low_rank_q = bool(cfg.q_lora_rank)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotate = apply_rope_interleaved if self.interleave else apply_rope
        return rotate(x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None, cache: LayerKV | None = None
                ) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h); ``attn_mask`` and ``cache`` as ``Attention``'s
        (the cache holds the expanded keys and values)."""
        x = matmul_input(x)
        b, t = x.shape[:2]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_q \
            else self.q_proj(x)
        q = q.view(b, t, -1, self.nope + self.rope).transpose(1, 2)
        q_pass, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(b, t, -1, self.nope + self.v_dim).transpose(1, 2)
        k_pass, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = self._rope(k_rot.view(b, 1, t, self.rope), cos, sin)
        q = torch.cat((q_pass, self._rope(q_rot, cos, sin)), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(-1, k_pass.shape[1], -1, -1)), dim=-1)
        if cache is None:
            out = self.attend(q, k, v, attn_mask)
        else:
            k, v = cache.append(k, v)
            out = sdpa_attention(q, k, v, attn_mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def score_features(self) -> int:
        """Query plus value features per token, H·(nope + rope + v): attention's FLOPs per
        token are 6·T times this (the pipeline's flops balance)."""
        heads = self.kv_b_proj.out_features // (self.nope + self.v_dim)
        return heads * (self.nope + self.rope + self.v_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask=None) -> torch.Tensor:
        """The attention core: q, k (B, heads, T, nope + rope), v (B, heads, T, v width)."""
        return sdpa_attention(q, k, v, attn_mask, self.scale)
