"""What a Hugging Face Llama or Mixtral folder says besides its tensors, mapped field by field to
and from threefold's ``ModelConfig``: ``config.json`` both ways (``hf_config``,
``model_config_from_hf``), the names and shapes of the stored weights (``expected_shapes``,
``check_shapes``; Mixtral's per-expert file names, ``hub_names``), the special tokens of a
tokenizer.json and the ``tokenizer_config.json`` that makes ``AutoTokenizer`` load it.

Every field is mapped explicitly and anything this model cannot express is refused with the
field's name: a mismatch in RoPE base, its Llama 3 rescaling, norm epsilon or tied head changes
the logits silently (the nanotron #79 kind). ``threefold.hf`` (export, import, convert) and
``threefold.weights.HFSource`` (reading a folder by region) build on this module.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from tokenizers import Tokenizer

from threefold.checkpoint_verify import CheckpointError
from threefold.config import ConfigError, ModelConfig

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
                "num_experts_per_tok")
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
    the head is not tied, as Hugging Face stores it)."""
    h, d, f, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        if cfg.qkv_bias:  # Qwen2
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:  # Qwen3
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if cfg.num_local_experts:  # transformers 5's Mixtral layout (threefold.moe)
            e = cfg.num_local_experts
            out.update({p + "mlp.gate.weight": (e, h),
                        p + "mlp.experts.gate_up_proj": (e, 2 * f, h),
                        p + "mlp.experts.down_proj": (e, h, f)})
            fs = cfg.shared_expert_intermediate_size
            if fs:  # Qwen2-MoE's shared expert and its gate
                out.update({p + "mlp.shared_expert.gate_proj.weight": (fs, h),
                            p + "mlp.shared_expert.up_proj.weight": (fs, h),
                            p + "mlp.shared_expert.down_proj.weight": (h, fs),
                            p + "mlp.shared_expert_gate.weight": (1, h)})
        else:
            out.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                        p + "mlp.down_proj.weight": (h, f)})
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


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
    """The config.json of a transformers ``LlamaForCausalLM`` equal to ``cfg`` (resolved).

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
    ids = {role: (tokens.get(role) or (None, None))[1] for role in ("bos", "eos", "pad")}
    return {
        **family(cfg),
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
    }


def family(cfg: ModelConfig) -> dict:
    """The architecture fields of config.json: Llama; Qwen2 with q/k/v biases, Qwen3 with
    q/k norms (no sliding window in either); Mixtral for a mixture of experts (no sliding
    window, no router jitter: what threefold.moe computes)."""
    qwen = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 0}
    fs = cfg.shared_expert_intermediate_size
    if cfg.num_local_experts and (fs or cfg.qkv_bias or cfg.qk_norm):
        return _qwen_moe_family(cfg, qwen)
    if cfg.qk_norm or cfg.qkv_bias:
        if cfg.num_local_experts or (cfg.qk_norm and cfg.qkv_bias):
            raise ConfigError("model.qkv_bias / model.qk_norm: exporting these with a mixture "
                              "of experts other than Qwen3-MoE's, or both together, is not "
                              "built (Qwen2 has biases, Qwen3 norms)")
        name = "Qwen3" if cfg.qk_norm else "Qwen2"
        return {"architectures": [f"{name}ForCausalLM"], "model_type": name.lower(), **qwen}
    if not cfg.num_local_experts:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if not cfg.norm_topk_prob:
        raise ConfigError("model.norm_topk_prob: Mixtral always renormalises the top-k "
                          "weights; without a shared expert (Qwen2-MoE) or q/k norms "
                          "(Qwen3-MoE) this model has no Hugging Face family to export to")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": cfg.num_local_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "router_jitter_noise": 0.0,
            "output_router_logits": False, "sliding_window": None}


def _qwen_moe_family(cfg: ModelConfig, qwen: dict) -> dict:
    """Qwen2-MoE (a shared expert with its gate; q/k/v biases or not) or Qwen3-MoE (q/k
    norms, no shared expert): every block routed, experts of ``intermediate_size``."""
    fs = cfg.shared_expert_intermediate_size
    if cfg.qk_norm and (fs or cfg.qkv_bias):
        raise ConfigError("model.qk_norm: Qwen3-MoE has no shared expert and no q/k/v biases; "
                          "exporting q/k norms with either is not built")
    if not cfg.qk_norm and not fs:
        raise ConfigError("model.shared_expert_intermediate_size: 0, but Qwen2-MoE has a "
                          "shared expert; q/k/v biases on a Mixtral-style mixture have no "
                          "Hugging Face family to export to")
    experts = {"num_experts": cfg.num_local_experts,
               "num_local_experts": cfg.num_local_experts,
               "num_experts_per_tok": cfg.num_experts_per_tok,
               "moe_intermediate_size": cfg.intermediate_size, "decoder_sparse_step": 1,
               "mlp_only_layers": [], "norm_topk_prob": bool(cfg.norm_topk_prob),
               "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False}
    if cfg.qk_norm:
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **qwen,
                **experts}
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **qwen,
            **experts, "shared_expert_intermediate_size": fs, "qkv_bias": bool(cfg.qkv_bias)}


def qwen_layout(cfg: ModelConfig) -> bool:
    """Whether a mixture of experts' files use the Qwen MoE layout (``mlp.experts.N.
    gate_proj``...) rather than Mixtral's (``block_sparse_moe.experts.N.w1``...)."""
    return bool(cfg.qk_norm or cfg.qkv_bias or cfg.shared_expert_intermediate_size)


def reward_hf_config(conf: dict, tokens: dict) -> dict:
    """``conf`` (a causal LM's config.json) as that of the reward model on the same decoder:
    ``*ForSequenceClassification`` with one label, and a padding id, without which
    transformers cannot find each row's last token. threefold pads with the tokenizer's
    padding token, else end-of-text (``threefold.post.sft.pad_id``), and scores the rightmost
    token that is not padding, as transformers does."""
    pad = tokens.get("pad") or tokens.get("eos")
    arch = [a.replace("ForCausalLM", "ForSequenceClassification") for a in conf["architectures"]]
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
    """A resolved ModelConfig from a Hugging Face Llama config.json, or HFError naming the first
    field this model cannot express (biases, another head width, another activation, another
    RoPE scaling, a model type other than llama)."""
    need = functools.partial(_need, c, where)
    need(c.get("model_type") in ("llama", "mixtral", "qwen2", "qwen3", "qwen2_moe",
                                  "qwen3_moe"), "model_type",
         "only Llama-, Mixtral-, Qwen2-, Qwen3-, Qwen2-MoE- and Qwen3-MoE-architecture "
         "models import")
    moe = _moe_fields(c, where) if c["model_type"] in ("mixtral", "qwen2_moe",
                                                       "qwen3_moe") else {}
    qwen = _qwen_fields(c, where) if c["model_type"].startswith("qwen") else {}
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "vocab_size"):
        need(isinstance(c.get(field), int) and c[field] > 0, field, "a positive integer is needed")
    need(not c.get("attention_bias", False), "attention_bias", "this model has no biases")
    need(not c.get("mlp_bias", False), "mlp_bias", "this model has no biases")
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
    rope = _rope_fields(c, where)
    fields = dict(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                  intermediate_size=c["intermediate_size"],
                  num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
                  num_key_value_heads=kv, rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                  max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
                  tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                  attention_head_dim=0 if head_dim * heads == c["hidden_size"] else head_dim,
                  **rope, **qwen)
    fields.update({"num_local_experts": 0} | moe)  # (Qwen3-MoE's experts set the width)
    return ModelConfig(**fields).resolved()


def _qwen_fields(c: dict, where: str) -> dict:
    """The ModelConfig fields of a Qwen2 (q/k/v biases) or Qwen3 (q/k norms) config.json;
    HFError for a sliding window that is on (Qwen2's configs carry a ``sliding_window``
    value with ``use_sliding_window`` false: they load)."""
    need = functools.partial(_need, c, where)
    need(not c.get("use_sliding_window", False), "use_sliding_window",
         "this model attends to the whole causal context")
    layer_types = c.get("layer_types") or []
    need(all(t == "full_attention" for t in layer_types), "layer_types",
         "every layer must be full attention (no sliding window)")
    if c["model_type"] == "qwen2":
        return dict(qkv_bias=True)
    if c["model_type"] == "qwen2_moe":
        return dict(qkv_bias=bool(c.get("qkv_bias", True)))
    return dict(qk_norm=True)


def _moe_fields(c: dict, where: str) -> dict:
    """The ModelConfig fields of a Mixtral config.json (experts, routing); HFError for what
    threefold.moe does not compute (a sliding window, router jitter)."""
    need = functools.partial(_need, c, where)
    if c["model_type"] in ("qwen2_moe", "qwen3_moe"):
        return _qwen_moe_fields(c, where)
    e, k = c.get("num_local_experts", 8), c.get("num_experts_per_tok", 2)
    need(isinstance(e, int) and e > 0, "num_local_experts", "a positive integer is needed")
    need(isinstance(k, int) and 0 < k <= e, "num_experts_per_tok",
         "must be between 1 and num_local_experts")
    need(c.get("sliding_window") is None, "sliding_window",
         "this model attends to the whole causal context")
    need(not c.get("router_jitter_noise", 0.0), "router_jitter_noise",
         "the router has no jitter")
    return dict(num_local_experts=e, num_experts_per_tok=k,
                router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.02)))


def _qwen_moe_fields(c: dict, where: str) -> dict:
    """The ModelConfig fields of a Qwen2-MoE or Qwen3-MoE config.json: every block's MLP
    routed (HFError naming ``decoder_sparse_step`` or ``mlp_only_layers`` when some are
    dense), experts of ``moe_intermediate_size``, ``norm_topk_prob`` as given, and Qwen2-MoE's
    shared expert."""
    need = functools.partial(_need, c, where)
    e = c.get("num_local_experts") or c.get("num_experts")
    k, f = c.get("num_experts_per_tok", 8), c.get("moe_intermediate_size")
    need(isinstance(e, int) and e > 0, "num_experts", "a positive integer is needed")
    need(isinstance(k, int) and 0 < k <= e, "num_experts_per_tok",
         "must be between 1 and num_experts")
    need(isinstance(f, int) and f > 0, "moe_intermediate_size", "a positive integer is needed")
    need(c.get("decoder_sparse_step", 1) == 1, "decoder_sparse_step",
         "every block's MLP must be routed (1)")
    need(not c.get("mlp_only_layers"), "mlp_only_layers",
         "every block's MLP must be routed (no dense layers)")
    fs = c.get("shared_expert_intermediate_size", 0) if c["model_type"] == "qwen2_moe" else 0
    need(isinstance(fs, int) and fs >= 0, "shared_expert_intermediate_size",
         "a non-negative integer is needed")
    return dict(num_local_experts=e, num_experts_per_tok=k, intermediate_size=f,
                norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
                shared_expert_intermediate_size=fs)


def _rope_fields(c: dict, where: str) -> dict:
    """The ModelConfig RoPE fields of a config.json: its base, and the Llama 3 rescaling if
    it has one; HFError for any other scaling, or a llama3 one that lacks a parameter."""
    # transformers 5 keeps theta and scaling in rope_parameters; 4.x in rope_theta/rope_scaling.
    rope = dict(c.get("rope_parameters") or {})
    scaling = c.get("rope_scaling") or {}
    if not rope:
        rope = dict(scaling, rope_theta=c.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
        raise HFError(f"{where}: {key}.rope_type={kind!r} is not supported (use default or "
                      "llama3)")
    fields = dict(rope_theta=float(rope.get("rope_theta", 10000.0)), rope_scaling="none")
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
    return ModelConfig(**{k: v for k, v in saved.items() if k in known}).resolved()
