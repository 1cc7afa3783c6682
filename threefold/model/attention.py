"""Attention and its position encoding, shared by every family: RoPE (with Llama 3 frequency
scaling), grouped-query attention through ``scaled_dot_product_attention``, optional q/k norms
(per head as Qwen3's, or over the whole projection as OLMo 2's), and the masks: causal, packed
documents, and a sliding window (Mistral, Gemma 3) where a token sees itself and the
``window - 1`` tokens before it, as transformers 5 defines it.

The module knows nothing of ranks: tensor parallelism shards the projections (head counts come
from what they return), context parallelism replaces the attention class.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.model.kernels import matmul_input
from threefold.model.kvcache import LayerKV
from threefold.model.norm import RMSNorm


def rope_inverse_frequencies(cfg: ModelConfig, device=None, local: bool = False
                             ) -> torch.Tensor:
    """RoPE inverse frequencies θ^(-2i/d), i < d/2 (Su et al., arXiv 2104.09864), with the
    Llama 3 long-context rescaling when ``cfg.rope_scaling == "llama3"``: wavelengths longer
    than original_context/low_freq_factor are divided by ``factor``, those shorter than
    original_context/high_freq_factor are kept, and the band between is interpolated smoothly
    (arXiv 2407.21783 and Meta's reference code); "linear" divides every frequency by the
    factor. ``local``: a sliding-window block's, of base ``rope_local_theta`` and unscaled
    (Gemma 3)."""
    d = rotary_dim(cfg)
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=device).float() / d))
    if local or cfg.rope_scaling in (None, "none"):
        return inv
    if cfg.rope_scaling == "linear":
        return inv / cfg.rope_scaling_factor
    if cfg.rope_scaling == "yarn":
        return yarn_frequencies(cfg, inv, d, theta)
    if cfg.rope_scaling != "llama3":
        raise ValueError(f"unknown rope_scaling {cfg.rope_scaling!r}; use none, llama3 or "
                         "linear")
    factor, lo, hi = cfg.rope_scaling_factor, cfg.low_freq_factor, cfg.high_freq_factor
    old_ctx = cfg.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(medium, smoothed, scaled)


def yarn_frequencies(cfg: ModelConfig, inv: torch.Tensor, d: int, theta: float
                     ) -> torch.Tensor:
    """YaRN's frequencies (Peng et al., arXiv 2309.00071 §3.2): those that turn more than
    ``yarn_beta_fast`` times over the original context are kept, those that turn fewer than
    ``yarn_beta_slow`` times are divided by the factor, and a linear ramp between the two
    (in whole dimensions, as DeepSeek's reference rounds them, or fractional ones:
    ``yarn_truncate``) blends them."""
    factor, old = cfg.rope_scaling_factor, cfg.original_max_position_embeddings

    def dim_of(turns: float) -> float:  # the dimension whose frequency turns this often
        return d * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(cfg.yarn_beta_fast), dim_of(cfg.yarn_beta_slow)
    if cfg.yarn_truncate:  # (GPT-OSS keeps them fractional)
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=inv.device) - lo)
            / ((hi - lo) or 0.001)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def yarn_mscale(factor: float, coefficient: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1·coefficient·ln(factor) + 1 (1 without scaling)."""
    return 0.1 * coefficient * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_table_scale(cfg: ModelConfig) -> float:
    """What YaRN multiplies the cos/sin tables by (1 for other RoPE): the temperature, or
    with ``yarn_mscale_all_dim`` (DeepSeek) the ratio that leaves the scores' scale to
    ``score_scale``."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    f = cfg.rope_scaling_factor
    if cfg.yarn_mscale_all_dim:
        return yarn_mscale(f, cfg.yarn_mscale) / yarn_mscale(f, cfg.yarn_mscale_all_dim)
    return yarn_mscale(f)


def rotary_dim(cfg: ModelConfig) -> int:
    """The features of a head that RoPE rotates: all, the first head_dim·partial_rotary_factor
    (Phi-3), as transformers rounds it, or latent attention's ``qk_rope_head_dim``."""
    if cfg.kv_lora_rank:
        return cfg.qk_rope_head_dim
    return int(cfg.head_dim * cfg.partial_rotary_factor)


class RotaryEmbedding(nn.Module):
    """Holds the RoPE inverse frequencies (a non-persistent buffer: never checkpointed, always
    recomputable) and turns position ids into cos/sin tables.

    We keep the d/2 frequencies rather than a (max_positions × d) cos/sin table: cos/sin for a
    batch cost B·T·d element-wise ops, nothing next to the matmuls, they are bit-identical to
    Hugging Face's (same fp32 products), they need no memory that grows with the context length
    (131072 positions for Llama 3.1), and position ids may restart per packed document."""

    def __init__(self, cfg: ModelConfig, local: bool = False):
        super().__init__()
        self.cfg, self.local = cfg, local
        self.table_scale = 1.0 if local else rope_table_scale(cfg)  # (YaRN's)
        self.register_buffer("inv_freq", rope_inverse_frequencies(cfg, local=local),
                             persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the frequencies in place (needed after ``to_empty``)."""
        with torch.no_grad():
            self.inv_freq.copy_(rope_inverse_frequencies(self.cfg, self.inv_freq.device,
                                                         self.local))

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) integer positions -> (cos, sin), each (B, T, head_dim) fp32, in the
        rotate-half layout (frequencies repeated over the two halves of a head)."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.table_scale != 1.0:
            return emb.cos() * self.table_scale, emb.sin() * self.table_scale
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension (HF / Llama layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               fp32: bool = False) -> torch.Tensor:
    """Rotate ``x`` (B, heads, T, d) by position: x·cos + rotate_half(x)·sin. Tables
    narrower than d (a partial rotary factor, Phi-3) rotate the first features only.
    ``fp32``: rotate in fp32 and round once (OLMo 2's order; the same numbers in fp32)."""
    if fp32 and x.dtype != torch.float32:
        return apply_rope(x.float(), cos, sin).to(x.dtype)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    r = cos.shape[-1]
    if r < x.shape[-1]:
        turn, keep = x[..., :r], x[..., r:]
        return torch.cat((turn * cos + rotate_half(turn) * sin, keep), dim=-1)
    return x * cos + rotate_half(x) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3)... each turned by one frequency
    (DeepSeek's layout), written out in the rotate-half order: the same numbers as
    de-interleaving the features and rotating their halves."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :, :half].to(x.dtype), sin[:, None, :, :half].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) boolean mask, True where query i may attend key j:
    j <= i and both tokens belong to the same document (packed sequences)."""
    t = document_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


def document_position_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids (each document one contiguous run) -> positions restarting at 0 at
    the start of each document, e.g. [0,0,0,1,1] -> [0,1,2,0,1]."""
    b, t = document_ids.shape
    idx = torch.arange(t, device=document_ids.device).expand(b, t)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # Index of the most recent document start at or before each token.
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx


class Attention(nn.Module):
    """Causal grouped-query self-attention (Ainslie et al., arXiv 2305.13245) with RoPE."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.qkv_bias
        self.head_dim = d
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=cfg.attention_out_bias)
        # q/k norms, registered after the projections (as Qwen3's and OLMo 2's attention
        # do): per head (width d) or over the whole projection (OLMo 2)
        self.qk_norm = cfg.qk_norm and cfg.qk_norm_over
        if self.qk_norm:
            whole, eps = self.qk_norm == "projection", cfg.rms_norm_eps
            kind = (cfg.norm_plus_one, cfg.norm_fp32_weight)
            self.q_norm = RMSNorm(cfg.num_attention_heads * d if whole else d, eps, *kind)
            self.k_norm = RMSNorm(cfg.num_key_value_heads * d if whole else d, eps, *kind)
        # a sliding-window layer's window (0: the whole causal context)
        self.window = cfg.sliding_window if layer_is_sliding(cfg, layer) else 0
        self.rope_fp32 = cfg.rope_fp32
        # the scores' scale: 1/sqrt(head width), or Gemma 3's 1/sqrt(query_pre_attn_scalar)
        self.scale = cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar else None
        # GPT-OSS's sinks: one logit per query head in every softmax's denominator (tensor
        # parallelism keeps a rank's heads' sinks)
        self.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads)) \
            if cfg.attention_sinks else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None, cache: LayerKV | None = None
                ) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h). ``attn_mask`` None means plain causal attention, else a
        boolean (B, 1, T, T) mask (True = attend), e.g. from ``document_mask``. With
        ``cache`` (generation) the keys/values are appended to it and the queries attend to
        all of them under ``attn_mask`` (B, 1, T, cached + T) from ``KVCache.attention_mask``."""
        # Head counts come from what the projections return, so a tensor-parallel shard with
        # fewer local heads (or a replaced Linear) needs no change here.
        x = matmul_input(x)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        b, t = q.shape[:2]
        q = q.view(b, t, -1, self.head_dim)
        k = k.view(b, t, -1, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, self.rope_fp32), apply_rope(k, cos, sin, self.rope_fp32)
        if cache is None:
            out = self.attend(q, k, v, attn_mask)
        else:
            k, v = cache.append(k, v)
            out = sdpa_attention(q, k, v, attn_mask, self.scale, self.sinks)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def score_features(self) -> int:
        """Query plus value features per token (H·d each): attention's FLOPs per token are
        6·T times this (the pipeline's flops balance)."""
        return 2 * self.q_proj.out_features

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask=None) -> torch.Tensor:
        """The attention core: q (B, heads, T, d), k/v (B, kv heads, T, d) after RoPE ->
        (B, heads, T, d). Context parallelism overrides it (``ContextParallelAttention``: its
        queries and keys are the rank's share of a longer sequence); ``attn_mask`` is what
        ``DecoderModel.attention_mask`` made."""
        return sdpa_attention(q, k, v, attn_mask, self.scale, self.sinks)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attn_mask: torch.Tensor | None = None,
                   scale: float | None = None, sinks: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Causal (``attn_mask`` None) or masked (boolean, True = attend) grouped-query attention
    through ``scaled_dot_product_attention``; ``scale`` None is 1/sqrt(head width). With
    ``sinks`` (one logit per query head: GPT-OSS) ``sink_attention``."""
    if sinks is not None:
        return sink_attention(q, k, v, sinks, attn_mask, scale)
    groups = q.shape[1] // k.shape[1]
    if attn_mask is None:
        # SDPA's own GQA avoids materialising repeated keys/values.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1,
                                              scale=scale)
    # With an explicit mask, not every fused kernel takes enable_gqa; repeating K/V keeps
    # the memory-efficient kernels eligible.
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   attn_mask: torch.Tensor | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, ``sinks[h]``, that takes no value:
    p_ij = exp(s_ij) / (exp(sink_h) + Σ_j exp(s_ij)), so a query may attend to nothing (GPT-OSS;
    Xiao et al.'s attention sinks, arXiv 2309.17453, learned). No fused kernel takes the extra
    logit, so the scores are made whole: backward keeps q, the repeated k and v, the fp32
    probabilities (B, heads, T, keys + 1) and their copy in v's dtype, and the mask
    (``threefold.plan.sink_bytes`` counts them). ``attn_mask`` None is causal, queries being the last T of the keys."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    t, keys = q.shape[-2], k.shape[-2]
    if attn_mask is None:
        attn_mask = torch.ones(t, keys, dtype=torch.bool, device=q.device).tril(keys - t)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    # the softmax in fp32 whatever the device's autocast would choose, so that what it keeps
    # (and the planner counts) is the same on a CPU and a GPU
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)
    return torch.matmul(probs[..., :-1].to(v.dtype), v)


def layer_is_sliding(cfg: ModelConfig, layer: int) -> bool:
    """Whether block ``layer`` attends within a sliding window: every block when
    ``sliding_window`` is set (Mistral), but every ``sliding_window_pattern``-th one with a
    pattern (Gemma 3: blocks 6, 12, ... see the whole context)."""
    n = cfg.sliding_window_pattern
    return bool(cfg.sliding_window) and not (n and (layer + 1) % n == 0)


def window_mask(mask: torch.Tensor | None, t: int, window: int,
                device: torch.device) -> torch.Tensor | None:
    """``mask`` (None: causal; else a boolean (B, 1, T, T) one) further limited to a sliding
    window over ``t`` tokens: query i sees key j when i - window < j <= i. A window that
    covers the sequence leaves ``mask`` as it is (the causal kernel stays eligible)."""
    if window <= 0 or window >= t:
        return mask
    i = torch.arange(t, device=device)
    near = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return near[None, None] if mask is None else mask & near


def window_cache_mask(mask: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """A KV cache's (B, 1, t, length + t) mask (``KVCache.attention_mask``: queries are the
    slots after ``length``) limited to a sliding window over cache slots, as transformers
    measures it: slot j is seen from slot i when j > i - window."""
    if window <= 0:
        return mask
    t, keys = mask.shape[-2], torch.arange(mask.shape[-1], device=mask.device)
    queries = torch.arange(length, length + t, device=mask.device)[:, None]
    return mask & (keys[None] > queries - window)
