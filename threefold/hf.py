"""Hugging Face Llama and Mixtral folders <-> threefold checkpoints, with nothing unpickled on
the way. A mixture of experts (``model.num_local_experts``) is a ``MixtralForCausalLM``: in
memory threefold's names are transformers 5's (fused ``mlp.experts.gate_up_proj`` /
``down_proj``, router ``mlp.gate.weight``); files hold the published checkpoints' per-expert
layout (``block_sparse_moe.experts.N.w1/w2/w3``), which transformers 5 itself writes and
every version reads (``hub_tensors``); import takes either (``threefold.weights.HFSource``).

threefold's parameter names are exactly those of ``transformers.LlamaForCausalLM`` (see
``threefold.model``), so no tensor is renamed, split or permuted: export writes the checkpoint's
whole tensors under their own names, import reads them back. What can still go wrong silently is
the *configuration* (RoPE base, its Llama 3 rescaling, norm epsilon, tied head; the nanotron #79
kind of mismatch), so every field is mapped explicitly, anything this model cannot express is
refused with the field's name, and shapes are checked against the config before a tensor is used.

- ``export_hf(ckpt, out)``: a checkpoint (or a run directory: its newest checkpoint) to a folder
  that ``AutoModelForCausalLM`` and ``AutoTokenizer`` load (config.json, model.safetensors or
  shards ``model-0000K-of-0000N.safetensors`` with ``model.safetensors.index.json``,
  generation_config.json, tokenizer.json, tokenizer_config.json). Written atomically, one shard
  in memory at a time. A reward model's checkpoint (``score.weight``, no LM head: ``threefold
  reward``) becomes a ``LlamaForSequenceClassification`` with one label that
  ``AutoModelForSequenceClassification`` loads.
- ``import_hf(folder)``: (ModelConfig, {name: fp32 tensor}, tokenizer.json or None) from a local
  folder with ``model.safetensors`` or shards listed in ``model.safetensors.index.json`` (the
  checks, and reading by region, are ``threefold.weights.HFSource``'s). Pickle weights
  (``*.bin``, ``*.pt``...) are refused, never opened; paths in an index must stay inside the
  folder (symlinks inside it, as in the HF hub cache, are followed as the filesystem says).
- ``init_from_hf(model, path)``: load such weights into a freshly built model, strictly.
- ``main(argv)``: ``threefold convert --to hf CKPT OUT`` / ``--from hf HF_DIR OUT``; both
  directions stream tensor by tensor (at most one output file's tensors in memory).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from threefold.checkpoint import CheckpointError, Piece, list_checkpoints, save_streamed
from threefold.config import Config, ModelConfig
from threefold.weights import CheckpointSource, HFSource, WeightSource, open_pretrained

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_SHARD_BYTES = 2 << 30  # the most one written file holds (and so memory holds), as HF's 2 GiB
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
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


# --------------------------------------------------------------------------------------------
# Configuration mapping
# --------------------------------------------------------------------------------------------
def _token_ids(tokenizer_json: Path | None) -> dict[str, tuple[str, int] | None]:
    """The (name, id) of the eos, bos and pad tokens a tokenizer.json holds, where it has one."""
    out: dict[str, tuple[str, int] | None] = {"eos": None, "bos": None, "pad": None}
    if tokenizer_json is None:
        return out
    from tokenizers import Tokenizer

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
        **_family(cfg),
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


def _family(cfg: ModelConfig) -> dict:
    """The architecture fields of config.json: Llama, or Mixtral for a mixture of experts
    (no sliding window, no router jitter: what threefold.moe computes)."""
    if not cfg.num_local_experts:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if cfg.shared_expert_intermediate_size or not cfg.norm_topk_prob:
        from threefold.config import ConfigError

        raise ConfigError("model.shared_expert_intermediate_size / model.norm_topk_prob: "
                          "Mixtral has no shared expert and always renormalises; exporting "
                          "these Qwen2-MoE-style options to Hugging Face is not built (the "
                          "Qwen2-MoE family also has attention biases threefold lacks)")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": cfg.num_local_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "router_jitter_noise": 0.0,
            "output_router_logits": False, "sliding_window": None}


def model_config_from_hf(c: dict, where: str = "config.json") -> ModelConfig:
    """A resolved ModelConfig from a Hugging Face Llama config.json, or HFError naming the first
    field this model cannot express (biases, another head width, another activation, another
    RoPE scaling, a model type other than llama)."""
    def need(ok: bool, field: str, why: str) -> None:
        if not ok:
            raise HFError(f"{where}: {field}={c.get(field)!r} is not supported ({why})")

    need(c.get("model_type") in ("llama", "mixtral"), "model_type",
         "only Llama- and Mixtral-architecture models import")
    moe = {}
    if c["model_type"] == "mixtral":
        e, k = c.get("num_local_experts", 8), c.get("num_experts_per_tok", 2)
        need(isinstance(e, int) and e > 0, "num_local_experts", "a positive integer is needed")
        need(isinstance(k, int) and 0 < k <= e, "num_experts_per_tok",
             "must be between 1 and num_local_experts")
        need(c.get("sliding_window") is None, "sliding_window",
             "this model attends to the whole causal context")
        need(not c.get("router_jitter_noise", 0.0), "router_jitter_noise",
             "the router has no jitter")
        moe = dict(num_local_experts=e, num_experts_per_tok=k,
                   router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.02)))
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "vocab_size"):
        need(isinstance(c.get(field), int) and c[field] > 0, field, "a positive integer is needed")
    need(not c.get("attention_bias", False), "attention_bias", "this model has no biases")
    need(not c.get("mlp_bias", False), "mlp_bias", "this model has no biases")
    need(c.get("hidden_act", "silu") == "silu", "hidden_act", "SwiGLU uses silu")
    need(not c.get("attention_dropout", 0.0), "attention_dropout", "this model has no dropout")
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    need(c["hidden_size"] % heads == 0, "num_attention_heads", "must divide hidden_size")
    head_dim = c["hidden_size"] // heads
    need(c.get("head_dim") in (None, head_dim), "head_dim", f"must equal hidden_size/heads = "
         f"{head_dim}")
    need(isinstance(kv, int) and heads % kv == 0, "num_key_value_heads",
         "must divide num_attention_heads")
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
    fields = dict(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                  intermediate_size=c["intermediate_size"],
                  num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
                  num_key_value_heads=kv, rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                  rope_theta=float(rope.get("rope_theta", 10000.0)),
                  max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
                  tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                  rope_scaling="none", **({"num_local_experts": 0} | moe))
    if kind == "llama3":
        try:
            fields.update(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                          low_freq_factor=float(rope["low_freq_factor"]),
                          high_freq_factor=float(rope["high_freq_factor"]),
                          original_max_position_embeddings=int(
                              rope["original_max_position_embeddings"]))
        except KeyError as e:
            raise HFError(f"{where}: llama3 RoPE scaling lacks {e.args[0]}") from None
    return ModelConfig(**fields).resolved()


def _model_config_from_state(state: dict, where: Path) -> ModelConfig:
    saved = state.get("model_config")
    if not isinstance(saved, dict):
        raise HFError(f"{where}/state.json: no model_config; not a threefold checkpoint")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in known}).resolved()


# --------------------------------------------------------------------------------------------
# Mixtral experts: threefold's (= transformers 5's in-memory) fused tensors <-> the files' layout
# --------------------------------------------------------------------------------------------
def _hub_names(i: int, e: int) -> tuple[str, str, str]:
    p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
    return p + "w1.weight", p + "w3.weight", p + "w2.weight"


def hub_tensors(source: WeightSource, cfg: ModelConfig, names: list[str]
                ) -> list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """The tensors a Hugging Face file holds for the logical tensors ``names`` of ``source``:
    (file name, shape, a function that reads it as fp32), in order. A mixture of experts'
    fused tensors (``mlp.experts.gate_up_proj`` (E, 2f, h), ``down_proj`` (E, h, f), router
    ``mlp.gate.weight``) become what Mixtral checkpoints store, and transformers 5's
    ``save_pretrained`` writes: per expert ``block_sparse_moe.experts.N.w1`` (gate, (f, h)),
    ``w3`` (up) and ``w2`` (down, (h, f)), router ``block_sparse_moe.gate.weight``; each is
    read from the fused tensor's region, so no fused tensor is ever whole in memory. Every
    transformers version and the published checkpoints read this layout."""
    def reader(name, box=(), shape=None):
        return lambda: source.read(name, box).reshape(shape or source.shape(name))

    h, f = cfg.hidden_size, cfg.intermediate_size
    fused = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    out = []
    for name in names:
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if not cfg.num_local_experts or rest not in fused:
            out.append((name, source.shape(name), reader(name)))
        elif rest == "mlp.gate.weight":
            out.append((f"model.layers.{layer}.block_sparse_moe.gate.weight",
                        source.shape(name), reader(name)))
        else:  # an expert at a time: the rows of its w1 (gate), w3 (up); its w2 (down)
            for e in range(cfg.num_local_experts):
                w1, w3, w2 = _hub_names(int(layer), e)
                if rest == "mlp.experts.down_proj":
                    out.append((w2, (h, f), reader(name, ((e, e + 1),), (h, f))))
                else:
                    out += [(w1, (f, h), reader(name, ((e, e + 1), (0, f)), (f, h))),
                            (w3, (f, h), reader(name, ((e, e + 1), (f, 2 * f)), (f, h)))]
    return out


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------
def run_checkpoint_root(path: Path) -> Path:
    """Where the run directory ``path`` keeps its checkpoints: ``checkpoints/``, or node 0's
    ``checkpoint.dir`` (the one with the index) when its config.json sets one."""
    path = Path(path)
    try:
        saved = json.loads((path / "config.json").read_text())
        spec = saved["checkpoint"]["dir"] if isinstance(saved, dict) and "train" in saved else ""
    except (OSError, ValueError, KeyError, TypeError):
        spec = ""
    from threefold.checkpoint import resolve_root

    return resolve_root(spec, path, 0)


def find_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint directory, else the newest checkpoint of the run
    directory ``path``; HFError if neither."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    root = run_checkpoint_root(path)
    steps = list_checkpoints(root)
    if steps:
        return root / str(steps[-1])
    raise HFError(f"{path}: neither a checkpoint (no manifest.json) nor a run directory with "
                  f"checkpoints ({root}/<step>/)")


def _run_tokenizer(ckpt: Path, run: Path | None = None) -> Path | None:
    """tokenizer.json of the run that wrote ``ckpt`` (run/checkpoints/<step>, or the run
    directory ``run`` given), if any."""
    for d in (ckpt, *([run] if run is not None else []), ckpt.parent.parent):
        if (d / "tokenizer.json").is_file():
            return d / "tokenizer.json"
    return None


def _check_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str,
                  score: bool = False) -> None:
    """HFError naming ``where`` and the tensor if any expected weight is missing, extra or of
    another shape; ``score``: a reward model's (``score.weight`` in place of the LM head)."""
    want = expected_shapes(cfg)
    if score:
        want.pop("lm_head.weight", None)
        want["score.weight"] = (1, cfg.hidden_size)
    for name, shape in want.items():
        if name not in shapes:
            raise HFError(f"{where}: tensor {name} is missing")
        if tuple(shapes[name]) != shape:
            raise HFError(f"{where}: tensor {name} has shape {tuple(shapes[name])}, the "
                          f"config needs {shape}")
    extra = sorted(set(shapes) - set(want))
    if extra:
        raise HFError(f"{where}: unexpected tensor {extra[0]} (not part of this model)")


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_hf(ckpt_dir: Path, out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write checkpoint ``ckpt_dir`` (or a run directory's newest) as a Hugging Face Llama
    folder ``out_dir``; the checkpoint is verified first. ``out_dir`` must not exist or be
    empty; it appears complete or not at all (temporary sibling, fsync, rename).

    Tensors are read one at a time (a Mixtral expert at a time) and written in fp32 to files of
    at most ``max_shard_bytes`` (a tensor larger than that gets a file of its own): one
    ``model.safetensors``, or shards ``model-0000K-of-0000N.safetensors`` and
    ``model.safetensors.index.json`` as ``save_pretrained`` writes them. At most one file's
    tensors are in memory."""
    ckpt, out = find_checkpoint(Path(ckpt_dir)), Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HFError(f"{out}: already exists and is not empty; choose a new output folder")
    source = CheckpointSource(ckpt)
    cfg = _model_config_from_state(source.state, ckpt)
    names = source.names()
    if cfg.tie_word_embeddings and "lm_head.weight" in names:
        names.remove("lm_head.weight")  # HF stores a tied head once, as the embedding
    reward = "score.weight" in names  # a reward model (threefold.post.reward)
    _check_shapes(cfg, {n: source.shape(n) for n in names}, str(ckpt), score=reward)
    shards = _shards(hub_tensors(source, cfg, names), max_shard_bytes)
    tok_path = _run_tokenizer(ckpt, Path(ckpt_dir))
    tokens = _token_ids(tok_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        weight_map, total = {}, 0
        for k, shard in enumerate(shards):
            file = SINGLE if len(shards) == 1 else \
                f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {name: read().contiguous() for name, _, read in shard}
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(dict.fromkeys(tensors, file))
            # "format": "pt" is the metadata transformers checks before it loads a file.
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            del tensors  # before the next shard is read
        if len(shards) > 1:
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                 "weight_map": weight_map}, indent=2))
        conf = hf_config(cfg, tokens)
        if reward:
            conf = reward_hf_config(conf, tokens)
        (tmp / "config.json").write_text(json.dumps(conf, indent=2))
        gen = {k + "_token_id": v[1] for k, v in tokens.items() if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if tok_path is not None:
            shutil.copyfile(tok_path, tmp / "tokenizer.json")
            (tmp / "tokenizer_config.json").write_text(json.dumps(
                _tokenizer_config(tokens, cfg.max_position_embeddings), indent=2))
        _fsync_tree(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _shards(tensors: list[tuple[str, tuple[int, ...], Any]], max_bytes: int,
            itemsize: int = 4) -> list[list]:
    """``tensors`` (name, shape, ...) cut, in order, into groups of at most ``max_bytes``
    (of ``itemsize``-byte elements); a tensor larger than that forms a group of its own.
    Decided from shapes alone, so a shard's file name can say how many there are."""
    groups: list[list] = [[]]
    size = 0
    for t in tensors:
        nbytes = math.prod(t[1]) * itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    return groups


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


def _tokenizer_config(tokens: dict, max_len: int) -> dict:
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
# Import
# --------------------------------------------------------------------------------------------
def _safe_member(folder: Path, name: object, where: Path) -> Path:
    """``folder / name`` for a plain relative file name from an index; HFError for anything
    that could reach outside the folder (absolute, drive, ``..``) or is not safetensors."""
    if not isinstance(name, str) or not name:
        raise HFError(f"{where}: file entry {name!r} is not a file name")
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() \
            or PureWindowsPath(name).drive or ".." in parts or name.startswith(("/", "\\")):
        raise HFError(f"{where}: file entry '{name}' escapes the folder")
    if not name.endswith(".safetensors"):
        raise HFError(f"{where}: file entry '{name}' is not a .safetensors file (nothing is "
                      "unpickled)")
    return folder / name


def _weight_files(folder: Path) -> dict[Path, list[str] | None]:
    """File -> tensor names it must hold (None: all it has), from the index or the single
    model.safetensors; HFError for a folder with only pickle weights or none."""
    index = folder / INDEX
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise HFError(f"{index}: not a valid safetensors index ({e})") from None
        if not isinstance(wmap, dict):
            raise HFError(f"{index}: weight_map is not a mapping")
        files: dict[Path, list[str] | None] = {}
        for tensor, name in wmap.items():
            files.setdefault(_safe_member(folder, name, index), []).append(tensor)
        return files
    if (folder / SINGLE).is_file():
        return {folder / SINGLE: None}
    pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise HFError(f"{folder}: weights only in pickle format ({pickles[0]}); threefold never "
                      "unpickles files: save the model with safetensors "
                      "(save_pretrained(..., safe_serialization=True)) and try again")
    raise HFError(f"{folder}: no {SINGLE} or {INDEX}")


def import_hf(hf_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path | None]:
    """Read a local Hugging Face Llama folder: its resolved ModelConfig, its weights as whole
    fp32 tensors under threefold's (= HF's) names, checked against the config (a tied model's
    ``lm_head.weight`` is left out: the model takes it from the embedding), and the path of its
    tokenizer.json if it has one. HFError names the file, field or tensor at fault. Every
    tensor is whole in memory: ``threefold.weights.HFSource`` reads by region."""
    source = HFSource(Path(hf_dir))
    return source.config, source.tensors(), source.tokenizer


def load_pretrained(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, whole fp32 weights) from a Hugging Face folder (it has config.json) or a
    threefold checkpoint / run directory (its newest checkpoint): ``open_pretrained``'s
    tensors, all read."""
    cfg, source = open_pretrained(path)
    return cfg, source.tensors()


def init_from_hf(model: torch.nn.Module, path: Path) -> None:
    """Load pretrained weights into a freshly built, not yet parallelised ``LlamaForCausalLM``
    (strict: every parameter, nothing extra). ``path`` is a Hugging Face folder or a threefold
    checkpoint/run directory. The model's config must match the weights' in every field that
    changes the function (shape, norm epsilon, RoPE); HFError names the first that differs."""
    cfg, weights = load_pretrained(path)
    mine = model.cfg
    fields = SHAPE_FIELDS + (LLAMA3_FIELDS if cfg.rope_scaling == "llama3" else ())
    for name in fields:
        if getattr(cfg, name) != getattr(mine, name):
            raise HFError(f"{path}: model.{name}={getattr(cfg, name)!r} in the pretrained "
                          f"weights but {getattr(mine, name)!r} in this run; set --model.{name} "
                          f"{getattr(cfg, name)}")
    model.load_state_dict(weights, strict=True)


# --------------------------------------------------------------------------------------------
# threefold convert
# --------------------------------------------------------------------------------------------
def convert_from_hf(hf_dir: Path, out: Path, seed: int = 0,
                    max_file_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Import an HF folder as threefold run directory ``out``: ``out/checkpoints/0/`` (model
    weights in fp32, no optimiser state, a fresh RNG and sampler seeded by ``seed``),
    ``out/config.json`` and ``out/tokenizer.json`` if the folder has one. The checkpoint is
    resumable: train with ``--train.output_dir OUT --checkpoint.resume true`` and the model
    shape of config.json to fine-tune from it (optimiser moments start at zero); or point
    ``init_from_hf`` at it.

    The folder is checked from its headers first; then tensors are read one at a time into
    rank files of at most ``max_file_bytes`` each (whole tensors; a larger one gets a file of
    its own), so at most one file's tensors are in memory. A checkpoint's world size is only
    its number of rank files: it loads, by name, under any layout."""
    out = Path(out)
    if list_checkpoints(out / "checkpoints"):
        raise HFError(f"{out}: already holds checkpoints; choose a new output folder")
    source = HFSource(Path(hf_dir))
    cfg, tok = source.config, source.tokenizer
    out.mkdir(parents=True, exist_ok=True)
    if tok is not None:
        shutil.copyfile(tok, out / "tokenizer.json")
    run_cfg = Config(model=dataclasses.replace(cfg))
    (out / "config.json").write_text(json.dumps(run_cfg.to_dict(), indent=1))
    rng = torch.Generator().manual_seed(seed).get_state()
    # The keys the trainer's resume reads; the sampler takes its data sizes from the run.
    state = {"step": 0, "optim_step": 0, "sampler": {"seed": seed, "step": 0},
             "config": run_cfg.to_dict(), "model_config": dataclasses.asdict(cfg),
             "scheduler": {"last_step": 0, "lr": 0.0},
             "imported_from": str(Path(hf_dir).resolve())}

    def batches():  # a generator: the next file's tensors are read once the last is written
        for group in _shards([(n, source.shape(n)) for n in source.names()], max_file_bytes):
            yield [Piece(n, "model", source.read(n).reshape(-1), 0, math.prod(shape), shape)
                   for n, shape in group]

    return save_streamed(out / "checkpoints", 0, batches(), {"cpu_rng": rng}, state,
                         keep_last=1)


USAGE = """usage: threefold convert --to hf CKPT OUT      checkpoint (or run dir) -> HF folder
       threefold convert --from hf HF_DIR OUT  HF folder -> threefold run dir OUT"""


def _parse(argv: list[str]) -> tuple[str, str, str]:
    """(direction 'to'/'from', source, destination) or ValueError."""
    args, direction = [], None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith(("--to", "--from")):
            key, _, val = a[2:].partition("=")
            if key not in ("to", "from"):
                raise ValueError(f"unknown option '{a}'")
            if not val:
                if i + 1 >= len(argv):
                    raise ValueError(f"--{key}: missing format (hf)")
                val, i = argv[i + 1], i + 1
            if val != "hf":
                raise ValueError(f"--{key}: unknown format '{val}'; only 'hf' is supported")
            if direction:
                raise ValueError("give one of --to hf / --from hf")
            direction = key
        elif a.startswith("-"):
            raise ValueError(f"unknown option '{a}'")
        else:
            args.append(a)
        i += 1
    if direction is None:
        raise ValueError("give --to hf (export) or --from hf (import)")
    if len(args) != 2:
        raise ValueError(f"expected a source and a destination, got {len(args)} path(s)")
    return direction, args[0], args[1]


def main(argv: list[str]) -> int:
    """``threefold convert`` (``argv`` after the word ``convert``); 0 on success, 2 with one
    line on stderr for bad input."""
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        direction, src, dst = _parse(argv)
        if direction == "to":
            export_hf(Path(src), Path(dst))
            print(f"threefold convert: wrote Hugging Face folder {dst}")
        else:
            ckpt = convert_from_hf(Path(src), Path(dst))
            print(f"threefold convert: wrote threefold checkpoint {ckpt}")
    except (ValueError, CheckpointError, OSError) as e:
        msg = " ".join(str(e).split())  # one line, whatever the exception held
        print(f"threefold convert: error: {msg}", file=sys.stderr)
        return 2
    return 0
