"""Which model a run builds. Without ``checkpoint.init_from`` it is the preset with the
``--model.*`` fields over it. With it, the checkpoint defines the model everywhere: the run,
the dry run, the planner and the layout checks before launch all read the checkpoint's
configuration (a Hugging Face folder's config.json, a threefold checkpoint's state.json; a hub
id is first resolved by ``threefold.weights.hub``). Only the configuration is read here, never a
tensor.

Over a checkpoint, the ``--model.*`` fields split three ways:
- shape (``SHAPE``, what changes the function the weights compute): an override that
  contradicts the checkpoint is refused, naming the field and both values; one that agrees
  is allowed;
- the context length (``max_position_embeddings``): may be changed (it is a limit; RoPE is
  not rescaled by it), and the run says so;
- training settings (``SETTINGS``: initialisation of new weights, router loss weights):
  applied as given.
A preset the user named is dropped, and the run says so on a line of its own.

The tokenizer comes with the weights (the vocabulary they were trained on): the folder's
tokenizer.json, or the run's that wrote a threefold checkpoint; ``data.tokenizer`` wins when
given; training from a folder with neither is refused before launch, naming the missing file.
``resolved_model`` is the model a dry run predicts for, either way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from threefold.config import Config, ConfigError, ModelConfig
from threefold.config.validation import check_against_model
from threefold.data import load_tokenizer
from threefold.data.sources import check_prepared
from threefold.weights.hub import Located, locate
from threefold.families.spec import BLOCK_FIELDS

FIELD = "checkpoint.init_from"
SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
         "rope_scaling", "rope_scaling_factor", "low_freq_factor", "high_freq_factor",
         "original_max_position_embeddings", "tie_word_embeddings", "num_local_experts",
         "num_experts_per_tok", *BLOCK_FIELDS)
CONTEXT = "max_position_embeddings"
SETTINGS = ("init_std", "router_aux_loss_coef", "router_z_loss_coef",
            "router_aux_loss_per_layer", "router_bias_update_rate", "mtp_loss_weight")
_DEFAULTS = ModelConfig()


def locate_init_from(cfg: Config, config_only: bool = False) -> Located:
    """Where ``checkpoint.init_from`` lies here (a hub id: its snapshot in the local cache,
    the launcher's commit when it resolved one)."""
    return locate(cfg.checkpoint.init_from, FIELD, commit=cfg.checkpoint.init_from_commit,
                  config_only=config_only)


def read_model(path: Path, name: str, field: str = FIELD) -> ModelConfig:
    """The resolved ModelConfig pretrained weights at ``path`` were saved with; ConfigError
    naming ``field`` when their configuration cannot be read or expressed."""
    # imported here: threefold.weights brings torch, which a preset-only launcher never needs
    from threefold.weights.checkpoint_verify import CheckpointError
    from threefold.weights.pretrained import pretrained_config

    try:
        return pretrained_config(path)
    except CheckpointError as e:
        raise ConfigError(f"{field}: '{name}': {e}") from None


def _user_set(model: ModelConfig, name: str):
    """The value of ``model.name`` when the user set it (not None, not the default), else
    None."""
    value = getattr(model, name)
    return None if value is None or value == getattr(_DEFAULTS, name) else value


def over_checkpoint(model: ModelConfig, ckpt: ModelConfig, name: str
                    ) -> tuple[ModelConfig, list[str]]:
    """(the model a run from checkpoint ``name`` builds, lines the run says about it):
    ``ckpt`` with the user's ``model`` fields applied or refused as the module docstring
    says."""
    out, notes = dataclasses.replace(ckpt), []
    for field in SHAPE:
        mine = _user_set(model, field)
        theirs = ckpt.head_dim if field == "attention_head_dim" else getattr(ckpt, field)
        if mine is not None and mine != theirs:
            raise ConfigError(f"model.{field}: {mine!r}, but the checkpoint '{name}' has "
                              f"{theirs!r}; the checkpoint defines the model's shape: drop "
                              f"--model.{field} (or start from other weights)")
    context = _user_set(model, CONTEXT)
    if context is not None and context != ckpt.max_position_embeddings:
        out.max_position_embeddings = context
        notes.append(f"model.{CONTEXT} {context} replaces the checkpoint's "
                     f"{ckpt.max_position_embeddings} (RoPE is not rescaled by it)")
    out.init_std = model.init_std  # what new weights (a reward head, adapters) start from
    for field in SETTINGS[1:]:  # the router's loss weights: the checkpoint's unless given
        if _user_set(model, field) is not None:
            setattr(out, field, getattr(model, field))
    if model.preset != _DEFAULTS.preset:
        notes.append(f"model.preset '{model.preset}' is dropped: the checkpoint '{name}' "
                     "defines the model")
    return out, notes


def init_from_model(cfg: Config, located: Located | None = None
                    ) -> tuple[ModelConfig, list[str], Located]:
    """(model, notes, where) of a run with ``checkpoint.init_from``: ``over_checkpoint`` of
    its configuration (``located``: where it lies, when already found), checked against the
    run's sequence length, recompute and LoRA settings."""
    located = located or locate_init_from(cfg, config_only=True)
    ckpt = read_model(located.path, located.name)
    model, notes = over_checkpoint(cfg.model, ckpt, located.name)
    check_against_model(cfg, model)  # what validate() checks against a preset's shape
    return model, notes, located


def run_tokenizer_of(path: Path) -> Path | None:
    """The tokenizer.json that comes with the weights at ``path``: the folder's own, or that
    of the run which wrote the checkpoint (run/checkpoints/<step>)."""
    for cand in (path / "tokenizer.json", path.parent.parent / "tokenizer.json"):
        if cand.is_file():
            return cand
    return None


def choose_tokenizer(cfg: Config, located: Located) -> None:
    """Set ``data.tokenizer`` to the weights' own tokenizer unless one was given (the weights
    only make sense with the vocabulary they were trained on); ConfigError naming the missing
    file when there is none."""
    if cfg.data.tokenizer != "bpe":
        return
    found = run_tokenizer_of(located.path)
    if found is None:
        raise ConfigError(f"{FIELD}: '{located.name}' has no tokenizer.json (its shapes come "
                          "from config.json, but training needs the vocabulary the weights "
                          "were trained on): give it with --data.tokenizer PATH/tokenizer.json")
    cfg.data.tokenizer = str(found)


def resolved_model(cfg: Config, notes: list[str] | None = None) -> ModelConfig:
    """The model config as the trainer resolves it, without preparing any data or reading a
    weight. With ``checkpoint.init_from``, the checkpoint's (``threefold.weights.model_source``: its
    configuration alone; what it says about the user's fields goes to ``notes``), checked
    against its tokenizer when it has one (a folder without still dry-runs). Otherwise the
    vocabulary is ``model.vocab_size`` if set, else the tokenizer's — ``data.vocab_size`` for
    a BPE trained on the corpus, the file's own size for a tokenizer.json or for prepared
    data."""
    if cfg.checkpoint.init_from:
        mcfg, said, located = init_from_model(cfg)
        (notes if notes is not None else []).extend(said)
        tok = cfg.data.tokenizer if cfg.data.tokenizer != "bpe" else \
            run_tokenizer_of(located.path)
        vocab = load_tokenizer(str(tok)).get_vocab_size(with_added_tokens=True) if tok else 0
        if mcfg.vocab_size < vocab:
            raise ConfigError(f"data.tokenizer: {vocab} tokens, more than the checkpoint's "
                              f"vocabulary ({mcfg.vocab_size}); use the tokenizer the weights "
                              "were trained with")
    else:
        vocab = cfg.data.vocab_size
        prepared = check_prepared(cfg.data.corpus, cfg.data.mix, cfg.data.tokenizer)
        if prepared is not None:  # the tokenizer the data was prepared with
            vocab = prepared["vocab_size"]
        elif cfg.data.tokenizer != "bpe":
            vocab = load_tokenizer(cfg.data.tokenizer).get_vocab_size(with_added_tokens=True)
        mcfg = cfg.model.resolved(vocab_size=vocab)
    if mcfg.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size: {mcfg.vocab_size} is smaller than the tokenizer's "
                          f"{vocab}; leave it unset (0) or raise it")
    return mcfg
