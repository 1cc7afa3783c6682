"""The decoder every family builds, in plain PyTorch: RMSNorm, RoPE (with Llama-3 frequency
scaling), grouped-query attention through ``scaled_dot_product_attention``, SwiGLU, and the
loss.

Parameter names are exactly those of the family's Hugging Face model (transformers'
``LlamaForCausalLM``, ``Gemma3ForCausalLM``...), so a state dict moves between the two without
renaming. The classes here are family-neutral (``CausalLM``, ``DecoderModel``,
``DecoderLayer``); each family has its own subclasses, named as Hugging Face names them
(``Gemma3ForCausalLM``, ``Gemma3Model``, ``Gemma3DecoderLayer``), which ``CausalLM(cfg)``
builds for ``cfg``'s family so that ``print(model)`` says what the model is. They add nothing
but the name.

The model knows nothing of devices or ranks; parallelism is applied from outside, which is
why:

- every piece is its own reachable ``nn.Module`` (tensor parallel swaps or shards the Linear
  layers, the embedding and the head; pipeline parallel splits ``model.layers`` and may set
  ``model.embed_tokens``, ``model.norm`` or ``lm_head`` to ``None`` on stages that do not own
  them, in which case that step is skipped; activation checkpointing wraps each block);
- attention takes its head counts from the projections' outputs at run time, so a shard holding
  fewer heads runs the same code;
- a weight's initial values depend only on the seed and its name (see ``init_weights``), so a
  model initialised in pieces equals one initialised whole.

Architecture: Touvron et al., "LLaMA" (arXiv 2302.13971) and "The Llama 3 Herd of Models"
(arXiv 2407.21783).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from threefold.model.attention import (Attention, RotaryEmbedding, document_mask, window_cache_mask, window_mask)
from threefold.config import ModelConfig
from threefold.model.head_loss import LMHead
from threefold.model.kernels import matmul_input, swiglu
from threefold.model.kvcache import KVCache, LayerKV
from threefold.model.mla import LatentAttention
from threefold.families import FAMILIES, Family, FamilyError, spec_of
from threefold.model.moe import SparseMoeBlock
from threefold.model.mtp import depth_losses, is_mtp, mtp_block_class, run_modules
from threefold.model.norm import RMSNorm


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) · up(x)), with silu (SwiGLU, Shazeer, arXiv
    2002.05202) or the tanh approximation of GeLU (GeGLU, Gemma) as ``cfg.hidden_act`` says."""

    def __init__(self, cfg: ModelConfig, width: int = 0):
        super().__init__()
        h, f = cfg.hidden_size, width or cfg.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h)."""
        x = matmul_input(x)
        if self.gelu:
            return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def block_is_moe(cfg: ModelConfig, layer: int) -> bool:
    """Whether block ``layer``'s MLP is a mixture of experts: every block's in a mixture of
    experts but the first ``first_k_dense_replace`` (DeepSeek-V3's dense ones)."""
    return bool(cfg.num_local_experts) and layer >= cfg.first_k_dense_replace


class DecoderLayer(nn.Module):
    """One block, its norms placed as ``cfg.norm_layout`` says:

    - "pre" (Llama): x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm(·));
    - "post" (OLMo 2): x + post_attention_layernorm(attn(x)), then
      + post_feedforward_layernorm(mlp(·));
    - "sandwich" (Gemma 3): x + post_attention_layernorm(attn(input_layernorm(x))), then
      + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(·))).

    The MLP is a routed mixture of experts (``threefold.model.moe.SparseMoeBlock``) when
    ``cfg.num_local_experts``. ``layer`` is the block's index (a sliding window may depend
    on it)."""

    family = ""  # the Hugging Face model_type of a family's classes

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        h, eps, layout = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_layout
        one = (cfg.norm_plus_one, cfg.norm_fp32_weight)
        self.layout = layout
        if layout != "post":
            self.input_layernorm = RMSNorm(h, eps, *one)
        self.self_attn = LatentAttention(cfg, layer) if cfg.kv_lora_rank else \
            Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(h, eps, *one)
        if layout == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(h, eps, *one)
        self.mlp = SparseMoeBlock(cfg) if block_is_moe(cfg, layer) else \
            MLP(cfg, cfg.dense_intermediate_size if cfg.num_local_experts else 0)
        if layout != "pre":
            self.post_feedforward_layernorm = RMSNorm(h, eps, *one)

    def residual_norms(self) -> list[RMSNorm]:
        """The block's norms over the residual stream's width (sequence parallelism splits
        what they see by tokens), in registration order."""
        return [m for m in self.children() if isinstance(m, RMSNorm)]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None, cache: LayerKV | None = None
                ) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h); cos/sin from ``RotaryEmbedding``; ``cache`` this
        layer's part of a ``KVCache`` (generation)."""
        if self.layout == "pre":
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, cache=cache)
            return x + self.mlp(self.post_attention_layernorm(x))
        a = self.input_layernorm(x) if self.layout == "sandwich" else x
        x = x + self.post_attention_layernorm(self.self_attn(a, cos, sin, attn_mask,
                                                             cache=cache))
        m = self.pre_feedforward_layernorm(x) if self.layout == "sandwich" else x
        return x + self.post_feedforward_layernorm(self.mlp(m))


class DecoderModel(nn.Module):
    """Embedding, the stack of blocks and the final norm (HF's ``model.`` prefix). The blocks
    are ``block_class``'s (a family's own ``DecoderLayer``)."""

    block_class: type = DecoderLayer
    family = ""  # the Hugging Face model_type of a family's classes

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # the multi-token-prediction modules are blocks L.. L+D-1 (threefold.model.mtp)
        mtp = mtp_block_class(self.block_class)
        self.layers = nn.ModuleList((self.block_class if i < cfg.num_hidden_layers else mtp)
                                    (cfg, i) for i in range(cfg.num_hidden_layers
                                                            + cfg.num_nextn_predict_layers))
        # a pipeline's last stage: its copy of the embedding (registered here, between the
        # blocks and the norm, as ZeRO's units and the planner order it)
        self.register_module("mtp_embed", None)
        self.window = cfg.sliding_window
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one,
                            cfg.norm_fp32_weight)
        self.rotary = RotaryEmbedding(cfg)
        # sliding-window blocks with a RoPE base of their own (Gemma 3)
        self.rotary_local = RotaryEmbedding(cfg, local=True) if cfg.rope_local_theta else None
        # Gemma scales the embeddings by sqrt(h), rounded to the embedding's dtype
        self.embed_scale = math.sqrt(cfg.hidden_size) if cfg.embed_scale else 0.0

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                mtp_ids: torch.Tensor | None = None):
        """Token ids (B, T) -> final normed hidden states (B, T, h).

        On a pipeline stage without the embedding (``embed_tokens is None``) ``input_ids`` is
        taken to be the hidden states from the previous stage; without ``norm`` the output is
        the un-normed residual stream. With ``cache`` (generation) the tokens follow the
        cached ones: positions and mask come from the cache, which then holds them too. With
        ``mtp_ids`` (the token ids, on the stage holding the multi-token-prediction modules)
        also each module's normed output: (hidden states, [depth 1, ...])."""
        x = self.embed_tokens(input_ids) if self.embed_tokens is not None else input_ids
        if self.embed_scale and self.embed_tokens is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        b, t = x.shape[:2]
        if position_ids is None:
            position_ids = (torch.arange(t, device=x.device).expand(b, t) if cache is None
                            else cache.positions(t))
        rope = self.rotary(position_ids)
        local = rope if self.rotary_local is None else self.rotary_local(position_ids)
        if cache is None:
            mask = self.attention_mask(document_ids)
            # the whole sequence's length: under sequence parallelism x holds a slice of it
            near = window_mask(mask, position_ids.shape[-1], self.window, x.device)
            for layer in self.main_layers():
                slide = layer.self_attn.window
                x = layer(x, *(local if slide else rope), near if slide else mask)
            if mtp_ids is not None:
                states = run_modules([m for m in self.layers if is_mtp(m)],
                                     self.mtp_embed if self.embed_tokens is None
                                     else self.embed_tokens, x, mtp_ids,
                                     (rope, local), (mask, near), self.embed_scale)
                return self.norm(x), states
        else:
            if document_ids is not None:
                raise ValueError("DecoderModel: document_ids and a KV cache do not combine")
            mask = cache.attention_mask(t)
            near = window_cache_mask(mask, cache.length, self.window)
            for i, layer in enumerate(self.main_layers()):
                slide = layer.self_attn.window
                x = layer(x, *(local if slide else rope), near if slide else mask,
                          cache=cache.layer(i))
            cache.advance(t)
        return self.norm(x) if self.norm is not None else x

    def main_layers(self) -> list[nn.Module]:
        """The blocks held, the multi-token-prediction modules left out."""
        return [layer for layer in self.layers if not is_mtp(layer)]

    def attention_mask(self, document_ids: torch.Tensor | None):
        """What every block's attention gets as ``attn_mask``: None (causal) or the packed
        documents' mask. Context parallelism overrides it (``ContextParallelDecoderModel``: its
        ranks need the whole sequence's document ids, not a local square mask)."""
        return document_mask(document_ids) if document_ids is not None else None


def fill_tied_head(weights: dict, prefix: str = "", suffixes: tuple[str, ...] = ("",)) -> dict:
    """Give ``weights`` (in place; returned) the tied head's entries where only the
    embedding's are present, as tied checkpoints (HF's, threefold's) store them: for each
    suffix (e.g. ".exp_avg" for optimiser state), ``lm_head.weight<suffix>`` from
    ``model.embed_tokens.weight<suffix>``."""
    for sfx in suffixes:
        embed = f"{prefix}model.embed_tokens.weight{sfx}"
        if embed in weights:
            weights.setdefault(f"{prefix}lm_head.weight{sfx}", weights[embed])
    return weights


def _init_in_place(p: torch.Tensor, name: str, cfg: ModelConfig,
                   gen: torch.Generator | None) -> None:
    """The initialisation rule (see ``CausalLM.init_weights``) applied to ``p``; a
    LoRA adapter's as PEFT draws it (``threefold.model.lora.init_adapter``)."""
    if name.endswith(("lora_A.weight", "lora_B.weight")):
        from threefold.model.lora import init_adapter
        init_adapter(p, name, gen)
        return
    if name.endswith(("_bias", ".sinks")):  # experts' biases (2-D), attention sinks: 0
        nn.init.zeros_(p)
        return
    if p.ndim == 1:  # biases 0 (DeepSeek's routing bias too); norm weights 1, or 0 where
        # the norm adds 1 (Gemma)
        zero = name.endswith((".bias", "e_score_correction_bias")) or cfg.norm_plus_one
        (nn.init.zeros_ if zero else nn.init.ones_)(p)
        return
    std = cfg.init_std
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        std = std / math.sqrt(2 * cfg.num_hidden_layers)  # GPT-2's scaled residual init
    nn.init.normal_(p, mean=0.0, std=std, generator=gen)


@torch.no_grad()
def initial_weight(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """The initial value of the whole tensor ``name`` (of ``shape``), drawn from its own
    generator seeded by (``seed``, ``name``): what ``init_weights(seed)`` puts there, so any
    slice of it can be made on its own (``threefold.parallel.materialize``)."""
    out = torch.empty(shape, dtype=torch.float32, device=device)
    gen = None
    if out.ndim > 1:
        gen = torch.Generator(device=out.device)
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    _init_in_place(out, name, cfg, gen)
    return out


class CausalLM(nn.Module):
    """The decoder (``model_class``'s) plus the LM head; ``forward`` returns fp32 logits, or
    with ``labels`` each token's fp32 loss from the chunked head loss
    (``threefold.model.head_loss``: the logits of the whole batch never exist).

    ``cfg`` must be resolved (every field set, ``vocab_size > 0``). With
    ``cfg.tie_word_embeddings`` the head shares the embedding's weight; the state dict then
    still holds both names (as HF's does) and a state dict without ``lm_head.weight`` (as HF
    saves tied checkpoints) loads too.

    Tensor parallelism (``threefold.parallel.transforms.tensor``) sets its degree, whether
    activations between sub-layers are split on the sequence, and the head's vocabulary shard.

    ``CausalLM(cfg)`` is a model of ``cfg``'s family (``family_class``): a
    ``Gemma3ForCausalLM`` for a Gemma 3; a model that fits no family stays a ``CausalLM``."""

    tp_size = 1
    sequence_parallel = False
    model_class: type = DecoderModel
    family = ""  # the Hugging Face model_type of a family's classes

    def __new__(cls, cfg: ModelConfig | None = None):
        # (no cfg: copy and pickle make an instance of the class they already know)
        if cls is CausalLM and cfg is not None:
            cls = family_class(cfg)
        return super().__new__(cls)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not cfg.vocab_size or cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (resolve the config first)")
        self.cfg = cfg
        self.model = self.model_class(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)
        self.tie_weights()
        self.register_load_state_dict_pre_hook(CausalLM._fill_tied_head)
        self.init_weights()

    def tie_weights(self) -> None:
        """Point ``lm_head.weight`` at the embedding when tied. ``Module.to_empty`` makes new
        tensors per module and so unties them; ``init_weights`` calls this again."""
        if self.cfg.tie_word_embeddings and self.lm_head is not None \
                and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _fill_tied_head(self, state_dict, prefix, *args) -> None:
        # HF omits lm_head.weight from tied checkpoints; take it from the embedding.
        if self.cfg.tie_word_embeddings:
            fill_tied_head(state_dict, prefix)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every weight in place, and recompute the RoPE buffer.

        Matrices (embedding, projections, router, experts, head): normal(0, init_std). The
        residual-output projections ``o_proj`` and ``down_proj`` (the experts' too) use
        init_std / sqrt(2·layers), the GPT-2 scaled init (Radford et al. 2019, §2.3), so the
        residual stream's variance does not grow with depth (two residual additions per
        block). Norm weights: 1.

        With ``seed`` each weight draws from its own generator seeded by (seed, its name), so
        the result does not depend on the order of initialisation or on which other weights
        exist (a pipeline stage initialised alone equals the same layers of the whole model);
        values are reproducible per device type (CPU and CUDA generators differ). Without
        ``seed`` the global RNG is used. Parameters still on the meta device are skipped, so
        this works after ``CausalLM(cfg)`` under ``torch.device("meta")`` followed by
        ``to_empty(device=...)``."""
        self.tie_weights()
        # a pipeline stage with a tied head but no embedding holds a copy of the embedding
        # (parallel/pipeline/stage.py): it starts from the embedding's values
        replica = self.cfg.tie_word_embeddings and self.model.embed_tokens is None
        for name, p in self.named_parameters():  # tied weights appear once
            if p.is_meta:
                continue
            if seed is None or p.ndim == 1:
                _init_in_place(p, name, self.cfg, None)
                continue
            copy = (replica and name == "lm_head.weight") or name == "model.mtp_embed.weight"
            key = "model.embed_tokens.weight" if copy else name
            p.copy_(initial_weight(key, tuple(p.shape), self.cfg, seed, p.device))
        for rotary in (self.model.rotary, self.model.rotary_local):
            if rotary is not None and not rotary.inv_freq.is_meta:
                rotary.reset_parameters()

    def forward_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                       document_ids: torch.Tensor | None = None, cache: KVCache | None = None
                       ) -> torch.Tensor:
        """Final normed hidden states (B, T, h), before the head (for chunked or
        vocab-parallel loss, or generation's last-position logits)."""
        if cache is None:
            return self.model(input_ids, position_ids, document_ids)
        return self.model(input_ids, position_ids, document_ids, cache=cache)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                labels: torch.Tensor | None = None, temperature: float = 1.0,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V) in fp32, or with ``labels`` (B, T) the loss
        of each token, −log softmax(logits / temperature) at its label (0 where it is -100),
        computed in chunks. ``position_ids`` default to 0..T-1; with ``document_ids`` (B, T)
        attention stays within each packed document (pass positions that restart per
        document, e.g. from ``document_position_ids``). With a ``KVCache`` the tokens
        continue the cached sequence (see ``threefold.generation.generate``). A pipeline stage
        without the head returns its hidden states. ``token_ids``: the micro-batch's token ids
        where ``input_ids`` are a previous stage's hidden states (the multi-token-prediction
        modules embed the tokens ahead); a training forward with labels records their losses
        in ``mtp_losses`` (``threefold.model.mtp``)."""
        if labels is not None and token_ids is None and self.model.embed_tokens is not None:
            token_ids = input_ids
        if labels is not None and torch.is_grad_enabled() and \
                any(map(is_mtp, self.model.layers)):
            # a training forward of the stage with the multi-token-prediction modules: their
            # losses are recorded for the step's model hook (RouterLog.add)
            h, states = self.model(input_ids, position_ids, document_ids, mtp_ids=token_ids)
            self.mtp_losses = depth_losses(self.lm_head, states, labels, temperature)
            return self.lm_head(h, labels=labels, temperature=temperature)
        h = self.forward_hidden(input_ids, position_ids, document_ids, cache)
        if self.lm_head is None:
            return h
        if labels is not None:
            return self.lm_head(h, labels=labels, temperature=temperature)
        return self.lm_head(h).float()


def _family_classes(spec: Family) -> type:
    """``spec``'s family's own ``CausalLM``, ``DecoderModel`` and ``DecoderLayer``, named as
    Hugging Face names them (``Gemma3ForCausalLM``, ``Gemma3Model``, ``Gemma3DecoderLayer``)
    and made module attributes here, so that they pickle by name; returns the first. They
    add nothing but the name: parameters, state dicts and results are the neutral ones'."""
    prefix = spec.architecture.removesuffix("ForCausalLM")

    def made(name: str, base: type, **attrs) -> type:
        cls = type(name, (base,), {"__module__": __name__, "__qualname__": name,
                                   "__doc__": f"{base.__name__} of {spec.model_type} "
                                              f"({spec.doc}).",
                                   "family": spec.model_type, **attrs})
        globals()[name] = cls
        return cls

    layer = made(f"{prefix}DecoderLayer", DecoderLayer)
    model = made(f"{prefix}Model", DecoderModel, block_class=layer)
    return made(spec.architecture, CausalLM, model_class=model)


# made once at import: two models of a family have the same classes
FAMILY_MODELS: dict[str, type] = {t: _family_classes(spec) for t, spec in FAMILIES.items()}


def family_class(cfg: ModelConfig) -> type:
    """The ``CausalLM`` class of ``cfg``'s family (``threefold.families.spec_of``); the neutral
    ``CausalLM`` for a model that fits no family (it trains; only export needs one)."""
    try:
        return FAMILY_MODELS[spec_of(cfg).model_type]
    except FamilyError:
        return CausalLM


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                   reduction: str = "sum") -> torch.Tensor:
    """Token cross-entropy in fp32 from whole logits: a reference for callers that hold them
    (training calls the model with ``labels``, which never makes the logits whole).
    ``labels`` are aligned with ``logits`` (labels[:, t] is the target of position t: the
    caller has already shifted them) and ``ignore_index`` marks tokens without a target.
    ``reduction`` "sum" (the default), "mean" (over this call's target tokens) or "none"."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(),
                           ignore_index=ignore_index, reduction=reduction)


def count_target_tokens(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Number of labels that are not ``ignore_index`` (an int64 scalar tensor, ready for an
    all-reduce)."""
    return (labels != ignore_index).sum()
