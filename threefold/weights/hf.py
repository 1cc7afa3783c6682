"""Hugging Face folders of the built families (``threefold.families``) <-> threefold checkpoints,
with nothing unpickled on the way. Of a mixture of experts (``model.num_local_experts``), in
memory threefold's names are transformers 5's (fused ``mlp.experts.gate_up_proj`` /
``down_proj``, router ``mlp.gate.weight``); files hold the published checkpoints' per-expert
layout (``block_sparse_moe.experts.N.w1/w2/w3``), which transformers 5 itself writes and
every version reads (``hub_tensors``); import takes either (``threefold.weights.HFSource``).

threefold's parameter names are those of the family's transformers model (see
``threefold.model.decoder``), so no tensor is permuted, and only experts (stored per expert) and
Phi-3's fused projections are split or joined, by ``hub_tensors`` and ``HFSource``: export writes
the checkpoint's whole tensors under their own names, import reads them back. What can still go
wrong silently is the *configuration* (RoPE base, its Llama 3 rescaling, norm epsilon, tied head;
the nanotron #79 kind of mismatch), so every field is mapped explicitly, anything this model cannot
express is refused with the field's name, and shapes are checked against the config before a tensor
is used.

- ``export_hf(ckpt, out)``: a checkpoint (or a run directory: its newest checkpoint) to a folder
  that ``AutoModelForCausalLM`` and ``AutoTokenizer`` load (config.json, model.safetensors or
  shards ``model-0000K-of-0000N.safetensors`` with ``model.safetensors.index.json``,
  generation_config.json, tokenizer.json, tokenizer_config.json). Written atomically, one shard
  in memory at a time. A reward model's checkpoint (``score.weight``, no LM head: ``threefold
  reward``) becomes a ``*ForSequenceClassification`` of its family with one label that
  ``AutoModelForSequenceClassification`` loads.
- ``import_hf(folder)``: (ModelConfig, {name: fp32 tensor}, tokenizer.json or None) from a local
  folder with ``model.safetensors`` or shards listed in ``model.safetensors.index.json`` (the
  checks, and reading by region, are ``threefold.weights.HFSource``'s). Pickle weights
  (``*.bin``, ``*.pt``...) are refused, never opened; paths in an index must stay inside the
  folder (symlinks inside it, as in the HF hub cache, are followed as the filesystem says).
- ``init_from_hf(model, path)``: load such weights into a freshly built model, strictly.
- ``convert_from_hf(folder, out)``: such a folder as a threefold run directory (a step-0
  checkpoint). Export and import both stream tensor by tensor (at most one output file's
  tensors in memory). The command, ``threefold convert``, is ``threefold.commands.convert``; a LoRA
  run's adapter-only checkpoints are exported by ``threefold.generation.peft_export``.

The mapping of config.json, tokenizer files and tensor names is ``threefold.weights.hf_config``;
reading a folder by region, and finding pretrained weights, ``threefold.weights``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import save_file

from threefold.weights.checkpoint import fsync_path, save_streamed, whole_pieces
from threefold.weights.checkpoint_verify import list_checkpoints
from threefold.config import Config, ModelConfig
from threefold.weights.hf_config import (INDEX, LLAMA3_FIELDS, SHAPE_FIELDS, SINGLE, HFError,
                                 check_shapes, hf_config, hub_names,
                                 hub_router, model_config_from_state, mtp_copies,
                                 qwen_layout, reward_hf_config, token_ids, tokenizer_config)
from threefold.model.lora import is_adapter
from threefold.families import fused_files
from threefold.weights.checkpoint_source import CheckpointSource
from threefold.weights.hf_source import HFSource
from threefold.weights.gpt_oss_files import gpt_oss_file_tensors
from threefold.weights.base import WeightSource
from threefold.weights.pretrained import find_checkpoint, open_pretrained

__all__ = ["LORA_REFUSAL", "MAX_SHARD_BYTES", "atomic_folder", "check_new_folder",
           "convert_from_hf", "export_hf", "hub_tensors", "import_hf", "init_from_hf",
           "load_pretrained", "run_tokenizer", "write_hf_folder"]

MAX_SHARD_BYTES = 2 << 30  # the most one written file holds (and so memory holds), as HF's 2 GiB


# --------------------------------------------------------------------------------------------
# Mixtral experts: threefold's (= transformers 5's in-memory) fused tensors <-> the files' layout
# --------------------------------------------------------------------------------------------
def hub_tensors(source: WeightSource, cfg: ModelConfig, names: list[str]
                ) -> list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """The tensors a Hugging Face file holds for the logical tensors ``names`` of ``source``:
    (file name, shape, a function that reads it as fp32), in order. A mixture of experts'
    fused tensors (``mlp.experts.gate_up_proj`` (E, 2f, h), ``down_proj`` (E, h, f), router
    ``mlp.gate.weight``) become what Mixtral checkpoints store, and transformers 5's
    ``save_pretrained`` writes: per expert ``block_sparse_moe.experts.N.w1`` (gate, (f, h)),
    ``w3`` (up) and ``w2`` (down, (h, f)), router ``block_sparse_moe.gate.weight``; each is
    read from the fused tensor's region, so no fused tensor is ever whole in memory. Every
    transformers version and the published checkpoints read this layout. A family whose
    files fuse projections (Phi-3: ``self_attn.qkv_proj``, ``mlp.gate_up_proj``) gets them
    joined from threefold's separate ones, at the first part's place (``_joined``)."""
    def reader(name, box=(), shape=None):
        """A function reading ``box`` of ``name`` as fp32, reshaped to ``shape``."""
        return lambda: source.read(name, box).reshape(shape or source.shape(name))

    h, f, qwen = cfg.hidden_size, cfg.intermediate_size, qwen_layout(cfg)  # Qwen MoE names?
    fused = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    joined = _joined(source, cfg, names)
    oss = cfg.family == "gpt_oss"  # GPT-OSS's own file layout (threefold.weights.gpt_oss_files)
    out = []
    for name in names:
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if name in joined:
            if joined[name] is not None:  # the fused tensor, where its first part was
                out.append(joined[name])
        elif oss and gpt_oss_file_tensors(source, name, rest) is not None:
            out += gpt_oss_file_tensors(source, name, rest)
        elif not cfg.num_local_experts or rest not in fused or oss:
            out.append((name, source.shape(name), reader(name)))
        elif rest == "mlp.gate.weight":
            out.append((hub_router(int(layer), qwen), source.shape(name), reader(name)))
        else:  # an expert at a time: the rows of its w1 (gate), w3 (up); its w2 (down)
            for e in range(cfg.num_local_experts):
                w1, w3, w2 = hub_names(int(layer), e, qwen)
                if rest == "mlp.experts.down_proj":
                    out.append((w2, (h, f), reader(name, ((e, e + 1),), (h, f))))
                else:
                    out += [(w1, (f, h), reader(name, ((e, e + 1), (0, f)), (f, h))),
                            (w3, (f, h), reader(name, ((e, e + 1), (f, 2 * f)), (f, h)))]
    listed = set(names)  # a multi-token-prediction module's copies of the embedding and head
    out += [(copy, source.shape(model), reader(model))
            for copy, model in mtp_copies(cfg).items() if model in listed]
    return out


def _joined(source: WeightSource, cfg: ModelConfig, names: list[str]) -> dict[str, Any]:
    """For each logical tensor that a family's files fuse with others (Phi-3's q/k/v into
    ``qkv_proj``, gate/up into ``gate_up_proj``: ``threefold.families.fused_files``): the
    fused file tensor (name, shape, a function reading its parts and joining their rows)
    under its first part, None under the others. One fused tensor is in memory at a time,
    while it is written. HFError if ``names`` holds only some of a fused tensor's parts."""
    out: dict[str, Any] = {}
    listed = set(names)
    for file, parts in fused_files(cfg).items():
        have = [n for n in parts if n in listed]
        if not have:
            continue
        if len(have) != len(parts):
            missing = next(n for n in parts if n not in listed)
            raise HFError(f"{source}: tensor {missing} is missing (it is part of {file})")
        shapes = [tuple(source.shape(n)) for n in parts]
        shape = (sum(s[0] for s in shapes), *shapes[0][1:])

        def read(parts=parts, shapes=shapes):
            """The parts, read whole, joined along the rows as the fused file holds them."""
            return torch.cat([source.read(n).reshape(s) for n, s in zip(parts, shapes)])

        out.update(dict.fromkeys(parts[1:]))
        out[parts[0]] = (file, shape, read)
    return out


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------
def run_tokenizer(ckpt: Path, run: Path | None = None) -> Path | None:
    """tokenizer.json of the run that wrote ``ckpt`` (run/checkpoints/<step>, or the run
    directory ``run`` given), if any."""
    for d in (ckpt, *([run] if run is not None else []), ckpt.parent.parent):
        if (d / "tokenizer.json").is_file():
            return d / "tokenizer.json"
    return None


LORA_REFUSAL = ("{}: a LoRA run (lora.r > 0): its checkpoints hold only the adapters, no base "
                "weights; export with --to peft (the adapter, for PEFT) or --to peft --merge "
                "(a Hugging Face folder with the adapters merged)")


def export_hf(ckpt_dir: Path, out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write checkpoint ``ckpt_dir`` (or a run directory's newest) as a Hugging Face
    folder ``out_dir``; the checkpoint is verified first. ``out_dir`` must not exist or be
    empty; it appears complete or not at all (``write_hf_folder``). A LoRA run's
    adapter-only checkpoint is refused (``threefold.generation.peft_export`` exports those)."""
    ckpt, out = find_checkpoint(Path(ckpt_dir)), Path(out_dir)
    check_new_folder(out)
    source = CheckpointSource(ckpt)
    names = source.names()
    if any(is_adapter(n) for n in names):
        raise HFError(LORA_REFUSAL.format(ckpt_dir))
    cfg = model_config_from_state(source.state, ckpt)
    if cfg.tie_word_embeddings and "lm_head.weight" in names:
        names.remove("lm_head.weight")  # HF stores a tied head once, as the embedding
    reward = "score.weight" in names  # a reward model (threefold.post.reward)
    check_shapes(cfg, {n: source.shape(n) for n in names}, str(ckpt), score=reward)
    write_hf_folder(out, hub_tensors(source, cfg, names), cfg,
                    run_tokenizer(ckpt, Path(ckpt_dir)), reward, max_shard_bytes)


def check_new_folder(out: Path) -> None:
    """HFError unless ``out`` is absent or an empty folder (an export never merges into, or
    overwrites, what is there)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HFError(f"{out}: already exists and is not empty; choose a new output folder")


@contextlib.contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` to write into; when the block ends without an error
    its files are fsynced and it is renamed to ``out`` (absent or empty: ``check_new_folder``),
    else it is removed. ``out`` appears complete or not at all."""
    check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for f in sorted(tmp.iterdir()):
            fsync_path(f)
        fsync_path(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_hf_folder(out: Path, tensors: list[tuple[str, tuple[int, ...], Callable]],
                    cfg: ModelConfig, tok_path: Path | None, reward: bool = False,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write a Hugging Face folder ``out`` atomically (``atomic_folder``): ``tensors`` (file
    name, shape, a function reading it as fp32, as ``hub_tensors`` gives them) in files of
    at most ``max_shard_bytes`` (a tensor larger than that gets a file of its own): one
    ``model.safetensors``, or shards ``model-0000K-of-0000N.safetensors`` and
    ``model.safetensors.index.json`` as ``save_pretrained`` writes them, at most one file's
    tensors in memory; config.json for ``cfg`` (a one-label sequence classifier when
    ``reward``), generation_config.json, and the tokenizer files when ``tok_path`` is
    given."""
    shards = _shards(tensors, max_shard_bytes)
    tokens = token_ids(tok_path)
    with atomic_folder(out) as tmp:
        _write_shards(tmp, shards)
        conf = hf_config(cfg, tokens)
        if reward:
            conf = reward_hf_config(conf, tokens)
        (tmp / "config.json").write_text(json.dumps(conf, indent=2))
        gen = {k + "_token_id": v[1] for k, v in tokens.items() if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if tok_path is not None:
            shutil.copyfile(tok_path, tmp / "tokenizer.json")
            (tmp / "tokenizer_config.json").write_text(json.dumps(
                tokenizer_config(tokens, cfg.max_position_embeddings), indent=2))


def _write_shards(folder: Path, shards: list[list]) -> None:
    """Write ``shards`` (groups of (file name, shape, read)) into ``folder`` as
    ``model.safetensors``, or as numbered shards with their index; one shard in memory."""
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        file = SINGLE if len(shards) == 1 else \
            f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: read().contiguous() for name, _, read in shard}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        # "format": "pt" is the metadata transformers checks before it loads a file.
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors  # before the next shard is read
    if len(shards) > 1:
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                "weight_map": weight_map}, indent=2))


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


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------
def import_hf(hf_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path | None]:
    """Read a local Hugging Face folder of a built family: its resolved ModelConfig, its weights as whole
    fp32 tensors under threefold's (= HF's) names, checked against the config (a tied model's
    ``lm_head.weight`` is left out: the model takes it from the embedding), and the path of its
    tokenizer.json if it has one. HFError names the file, field or tensor at fault. Every
    tensor is whole in memory: ``threefold.weights.HFSource`` reads by region."""
    source = HFSource(Path(hf_dir))
    source.check_copies()
    return source.config, source.tensors(), source.tokenizer


def load_pretrained(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, whole fp32 weights) from a Hugging Face folder (it has config.json) or a
    threefold checkpoint / run directory (its newest checkpoint): ``open_pretrained``'s
    tensors, all read."""
    cfg, source = open_pretrained(path)
    return cfg, source.tensors()


def init_from_hf(model: torch.nn.Module, path: Path) -> None:
    """Load pretrained weights into a freshly built, not yet parallelised ``CausalLM``
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
    source.check_copies()
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

    def batches():
        """One file's pieces at a time: the next file's tensors are read once the last is
        written."""
        for group in _shards([(n, source.shape(n)) for n in source.names()], max_file_bytes):
            yield whole_pieces({"model": {n: source.read(n) for n, _ in group}})

    return save_streamed(out / "checkpoints", 0, batches(), {"cpu_rng": rng}, state,
                         keep_last=1)
