"""What a Hugging Face folder of a built family (``threefold.families``) says besides its tensors,
mapped field by field to and from threefold's ``ModelConfig``: ``config.json`` both ways
(``hf_config``, ``model_config_from_hf``), the names and shapes of the stored weights
(``expected_shapes``, ``check_shapes``; Mixtral's per-expert file names, ``hub_names``), the special
tokens of a tokenizer.json and the ``tokenizer_config.json`` that makes ``AutoTokenizer`` load it.

Every field is mapped explicitly and anything this model cannot express is refused with the
field's name: a mismatch in RoPE base, its Llama 3 rescaling, norm epsilon or tied head changes
the logits silently (the nanotron #79 kind). ``threefold.weights.hf`` (export, import, convert) and
``threefold.weights.HFSource`` (reading a folder by region) build on this module.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from tokenizers import Tokenizer

from threefold.weights.checkpoint_verify import CheckpointError
from threefold.config import ModelConfig
from threefold.families import FamilyError, family_for, spec_of
from threefold.families.spec import BLOCK_FIELDS

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Names our tokenizers use (threefold.data.tokenizer), plus common published ones.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
PAD_NAMES = ("<|pad|>", "<pad>", "<|finetune_right_pad_id|>")
# The fields that decide the model's function: a mismatch in any of them changes the logits.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "tie_word_embeddings",
                "rms_norm_eps", "rope_theta", "rope_scaling", "num_local_experts",
                "num_experts_per_tok", *BLOCK_FIELDS)
LLAMA3_FIELDS = ("rope_scaling_factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings")


class HFError(CheckpointError):
    """A Hugging Face folder or conversion this model cannot take; the message names the file,
    field or tensor."""


# --------------------------------------------------------------------------------------------
# Tensor names and shapes
# --------------------------------------------------------------------------------------------
def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every stored weight of a resolved config (``lm_head.weight`` only when
    the head is not tied, as Hugging Face stores it; DeepSeek's routing bias, a buffer,
    included)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        p = f"model.layers.{i}."
        out.update({p + name + ".weight": (h,) for name in block_norms(cfg)})
        out.update(_latent_shapes(cfg, p) if cfg.kv_lora_rank else _attention_shapes(cfg, p))
        out.update(_mlp_shapes(cfg, p, i))
        if i >= cfg.num_hidden_layers:  # a multi-token-prediction module's own weights
            out.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,),
                        p + "eh_proj.weight": (h, 2 * h), p + "shared_head.norm.weight": (h,)})
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


def mtp_copies(cfg: ModelConfig) -> dict[str, str]:
    """The tensors a folder stores again in each multi-token-prediction module (DeepSeek-V3's
    layer L holds the embedding and the head), each the copy of a model tensor: file name ->
    the model tensor it copies (the embedding for a tied head)."""
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    out = {}
    for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        out[f"model.layers.{i}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"model.layers.{i}.shared_head.head.weight"] = head
    return out


def _attention_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Grouped-query attention's weights in block prefix ``p``."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out = {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
           p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
    if cfg.qkv_bias:  # Qwen2
        out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,)})
    if cfg.attention_out_bias:  # GPT-OSS
        out[p + "self_attn.o_proj.bias"] = (h,)
    if cfg.attention_sinks:
        out[p + "self_attn.sinks"] = (cfg.num_attention_heads,)
    if cfg.qk_norm:  # Qwen3: per head; OLMo 2: over the whole projection
        whole = cfg.qk_norm_over == "projection"
        out.update({p + "self_attn.q_norm.weight": (q if whole else d,),
                    p + "self_attn.k_norm.weight": (kv if whole else d,)})
    return out


def _latent_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Latent attention's weights (``threefold.model.mla``) in block prefix ``p``."""
    h, a, r = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_rope_head_dim
    c, q = cfg.kv_lora_rank, cfg.num_attention_heads * cfg.head_dim
    s = p + "self_attn."
    out = {s + "kv_a_proj_with_mqa.weight": (c + r, h), s + "kv_a_layernorm.weight": (c,),
           s + "kv_b_proj.weight": (a * (cfg.qk_nope_head_dim + cfg.v_head_dim), c),
           s + "o_proj.weight": (h, a * cfg.v_head_dim)}
    if cfg.q_lora_rank:
        out.update({s + "q_a_proj.weight": (cfg.q_lora_rank, h),
                    s + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                    s + "q_b_proj.weight": (q, cfg.q_lora_rank)})
    else:
        out[s + "q_proj.weight"] = (q, h)
    return out


def _mlp_shapes(cfg: ModelConfig, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    """Block ``layer``'s MLP weights: dense, or a mixture of experts in transformers 5's
    fused layout (``threefold.model.moe``) with its shared expert and router bias if any."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    if not cfg.num_local_experts or layer < cfg.first_k_dense_replace:
        w = cfg.dense_intermediate_size if cfg.num_local_experts else f
        return {p + "mlp.gate_proj.weight": (w, h), p + "mlp.up_proj.weight": (w, h),
                p + "mlp.down_proj.weight": (h, w)}
    e, fs = cfg.num_local_experts, cfg.shared_expert_intermediate_size
    out = {p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_up_proj": (e, 2 * f, h),
           p + "mlp.experts.down_proj": (e, h, f)}
    if cfg.moe_router == "sigmoid_grouped":
        out[p + "mlp.gate.e_score_correction_bias"] = (e,)
    if cfg.moe_bias:  # GPT-OSS
        out.update({p + "mlp.gate.bias": (e,), p + "mlp.experts.gate_up_proj_bias": (e, 2 * f),
                    p + "mlp.experts.down_proj_bias": (e, h)})
    shared = "shared_expert" if cfg.shared_expert_gate else "shared_experts"
    if fs:  # Qwen2-MoE's shared expert and its gate, or DeepSeek's ungated ones
        out.update({p + f"mlp.{shared}.gate_proj.weight": (fs, h),
                    p + f"mlp.{shared}.up_proj.weight": (fs, h),
                    p + f"mlp.{shared}.down_proj.weight": (h, fs)})
        if cfg.shared_expert_gate:
            out[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return out


def block_norms(cfg: ModelConfig) -> tuple[str, ...]:
    """The names of a block's residual-width norms, as ``cfg.norm_layout`` places them."""
    if cfg.norm_layout == "post":
        return ("post_attention_layernorm", "post_feedforward_layernorm")
    if cfg.norm_layout == "sandwich":
        return ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
    return ("input_layernorm", "post_attention_layernorm")


def check_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str,
                 score: bool = False, files: dict[str, Path] | None = None) -> None:
    """HFError naming ``where`` and the tensor if any expected weight is missing, extra or of
    another shape (a misshapen one by the file that holds it, where ``files`` says);
    ``score``: a reward model's (``score.weight`` in place of the LM head)."""
    want = expected_shapes(cfg)
    if score:
        want.pop("lm_head.weight", None)
        want["score.weight"] = (1, cfg.hidden_size)
    for name, shape in shapes.items():  # in the order given (a folder's: its files')
        if name in want and tuple(shape) != want[name]:
            raise HFError(f"{(files or {}).get(name, where)}: tensor {name} has shape "
                          f"{tuple(shape)}, the config needs {want[name]}")
    missing = [name for name in want if name not in shapes]
    if missing:
        raise HFError(f"{where}: tensor {missing[0]} is missing")
    extra = sorted(set(shapes) - set(want))
    if extra:
        raise HFError(f"{where}: unexpected tensor {extra[0]} (not part of this model)")


def hub_names(i: int, e: int, qwen: bool = False) -> tuple[str, str, str]:
    """The file names of expert ``e`` of layer ``i`` in the published layout: its gate, up
    and down weights, in that order (Mixtral's w1, w3, w2; with ``qwen``, Qwen3-MoE's
    gate_proj, up_proj, down_proj)."""
    if qwen:
        p = f"model.layers.{i}.mlp.experts.{e}."
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"
    p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
    return p + "w1.weight", p + "w3.weight", p + "w2.weight"


def hub_router(i: int, qwen: bool = False) -> str:
    """The file name of layer ``i``'s router (Mixtral's, or Qwen3-MoE's with ``qwen``)."""
    return f"model.layers.{i}.mlp.gate.weight" if qwen else \
        f"model.layers.{i}.block_sparse_moe.gate.weight"


# --------------------------------------------------------------------------------------------
# threefold -> config.json, tokenizer_config.json
# --------------------------------------------------------------------------------------------
def token_ids(tokenizer_json: Path | None) -> dict[str, tuple[str, int] | None]:
    """The (name, id) of the eos, bos and pad tokens a tokenizer.json holds, where it has one."""
    out: dict[str, tuple[str, int] | None] = {"eos": None, "bos": None, "pad": None}
    if tokenizer_json is None:
        return out
    try:
        tok = Tokenizer.from_file(str(tokenizer_json))
    except Exception as e:  # tokenizers raises a bare Exception for an invalid file
        raise HFError(f"{tokenizer_json}: not a valid tokenizer.json ({e})") from None
    for role, names in (("eos", EOS_NAMES), ("bos", BOS_NAMES), ("pad", PAD_NAMES)):
        for name in names:
            if tok.token_to_id(name) is not None:
                out[role] = (name, tok.token_to_id(name))
                break
    return out


def hf_config(cfg: ModelConfig, tokens: dict | None = None) -> dict:
    """The config.json of the transformers model of ``cfg``'s family equal to ``cfg``
    (resolved): the fields every family shares, then the family's own (``family``).

    RoPE is written both ways: ``rope_theta`` + ``rope_scaling`` (transformers 4.x) and
    ``rope_parameters`` (5.x); they say the same thing, so either reader gets the same model."""
    tokens = tokens or {}
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    scaling = None
    if cfg.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": float(cfg.rope_scaling_factor),
                   "low_freq_factor": float(cfg.low_freq_factor),
                   "high_freq_factor": float(cfg.high_freq_factor),
                   "original_max_position_embeddings": int(cfg.original_max_position_embeddings)}
        rope.update(scaling)
    elif cfg.rope_scaling == "linear":
        scaling = {"rope_type": "linear", "factor": float(cfg.rope_scaling_factor)}
        rope.update(scaling)
    ids = {role: (tokens.get(role) or (None, None))[1] for role in ("bos", "eos", "pad")}
    return {
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float(cfg.rope_theta), "rope_scaling": scaling, "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings), "attention_bias": False,
        "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": cfg.init_std,
        "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
        **family(cfg),  # last: a family's own fields (Gemma 3's RoPE, activation) win
    }


def family(cfg: ModelConfig) -> dict:
    """The architecture fields of config.json: those of the family ``model.family`` names
    (``threefold.families``), after checking that the model is one of it (ConfigError naming
    the field that differs)."""
    spec = spec_of(cfg)
    return {"architectures": [spec.architecture], "model_type": spec.model_type,
            **spec.write(cfg)}


def qwen_layout(cfg: ModelConfig) -> bool:
    """Whether a mixture of experts' files use the Qwen MoE layout (``mlp.experts.N.
    gate_proj``...) rather than Mixtral's (``block_sparse_moe.experts.N.w1``...)."""
    return spec_of(cfg).expert_files == "qwen"


def reward_hf_config(conf: dict, tokens: dict) -> dict:
    """``conf`` (a causal LM's config.json) as that of the reward model on the same decoder:
    ``*ForSequenceClassification`` with one label, and a padding id, without which
    transformers cannot find each row's last token. threefold pads with the tokenizer's
    padding token, else end-of-text (``threefold.post.sft.pad_id``), and scores the rightmost
    token that is not padding, as transformers does."""
    pad = tokens.get("pad") or tokens.get("eos")
    # (Gemma 3's text classifier is Gemma3TextForSequenceClassification: Gemma3For... is
    # the multimodal one)
    arch = [a.replace("Gemma3ForCausalLM", "Gemma3TextForCausalLM")
             .replace("ForCausalLM", "ForSequenceClassification") for a in conf["architectures"]]
    return {**conf, "architectures": arch, "id2label": {"0": "LABEL_0"},
            "label2id": {"LABEL_0": 0}, "pad_token_id": pad[1] if pad else None,
            "use_cache": False}


def tokenizer_config(tokens: dict, max_len: int) -> dict:
    """tokenizer_config.json that makes AutoTokenizer load tokenizer.json as a fast tokenizer
    adding nothing of its own (our token streams carry no BOS, documents end in eos)."""
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
           "clean_up_tokenization_spaces": False, "add_bos_token": False,
           "add_eos_token": False}
    for role in ("bos", "eos", "pad"):
        if tokens.get(role):
            out[f"{role}_token"] = tokens[role][0]
    return out


# --------------------------------------------------------------------------------------------
# config.json -> threefold
# --------------------------------------------------------------------------------------------
def _need(c: dict, where: str, ok: bool, field: str, why: str) -> None:
    """HFError naming ``field`` of config ``c`` (read from ``where``) unless ``ok``."""
    if not ok:
        raise HFError(f"{where}: {field}={c.get(field)!r} is not supported ({why})")


def model_config_from_hf(c: dict, where: str = "config.json") -> ModelConfig:
    """A resolved ModelConfig from a Hugging Face config.json, read through the spec of its
    ``model_type`` (``threefold.families``), or HFError naming the first field this model
    cannot express (biases where the family has none, another activation, another RoPE
    scaling, a model type that is not built)."""
    try:
        spec = family_for(c, where)
        own = spec.read(c, where)
    except FamilyError as e:
        raise HFError(str(e)) from None
    need = functools.partial(_need, c, where)
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "vocab_size"):
        need(isinstance(c.get(field), int) and c[field] > 0, field, "a positive integer is needed")
    need(not c.get("attention_bias", False) or own.get("attention_out_bias"), "attention_bias",
         "this model has no biases")
    need(not c.get("mlp_bias", False), "mlp_bias", "this model has no biases")
    if "hidden_act" not in own:  # (Gemma's GeGLU is its family's to read)
        need(c.get("hidden_act", "silu") == "silu", "hidden_act", "SwiGLU uses silu")
    need(not c.get("attention_dropout", 0.0), "attention_dropout", "this model has no dropout")
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    need(isinstance(head_dim, int) and head_dim % 2 == 0, "head_dim",
         "an even integer is needed (RoPE)")
    need(c.get("head_dim") is not None or c["hidden_size"] % heads == 0, "num_attention_heads",
         "must divide hidden_size when head_dim is not given")
    need(isinstance(kv, int) and heads % kv == 0, "num_key_value_heads",
         "must divide num_attention_heads")
    fields = dict(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                  intermediate_size=c["intermediate_size"],
                  num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
                  num_key_value_heads=kv, rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                  max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
                  tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                  attention_head_dim=0 if head_dim * heads == c["hidden_size"] else head_dim,
                  num_local_experts=0, family=spec.model_type,
                  # RoPE as every family writes it, unless the family reads its own (Gemma 3)
                  **({} if "rope_theta" in own else _rope_fields(c, where)))
    # the family's fixed values, then what its config.json says (experts' width included)
    return ModelConfig(**{**fields, **spec.fixed, **own}).resolved()


def _rope_fields(c: dict, where: str) -> dict:
    """The ModelConfig RoPE fields of a config.json: its base, and the Llama 3 rescaling if
    it has one; HFError for any other scaling, or a llama3 one that lacks a parameter."""
    # transformers 5 keeps theta and scaling in rope_parameters; 4.x in rope_theta/rope_scaling.
    rope = dict(c.get("rope_parameters") or {})
    scaling = c.get("rope_scaling") or {}
    if not rope:
        rope = dict(scaling, rope_theta=c.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3", "linear"):
        key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
        raise HFError(f"{where}: {key}.rope_type={kind!r} is not supported (use default, "
                      "llama3 or linear)")
    fields = dict(rope_theta=float(rope.get("rope_theta", 10000.0)), rope_scaling="none")
    if kind == "linear":
        fields.update(rope_scaling="linear", rope_scaling_factor=float(rope["factor"]))
    if kind == "llama3":
        try:
            fields.update(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                          low_freq_factor=float(rope["low_freq_factor"]),
                          high_freq_factor=float(rope["high_freq_factor"]),
                          original_max_position_embeddings=int(
                              rope["original_max_position_embeddings"]))
        except KeyError as e:
            raise HFError(f"{where}: llama3 RoPE scaling lacks {e.args[0]}") from None
    return fields


def model_config_from_state(state: dict, where: Path) -> ModelConfig:
    """The resolved ModelConfig a threefold checkpoint's state.json records (fields this
    version does not know are dropped); HFError if it records none."""
    saved = state.get("model_config")
    if not isinstance(saved, dict):
        raise HFError(f"{where}/state.json: no model_config; not a threefold checkpoint")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    # (a checkpoint older than model.family has none: its fields say it, threefold.families)
    return ModelConfig(**{k: v for k, v in saved.items() if k in known}).resolved()
