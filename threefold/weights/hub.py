"""Where a pretrained model named by the user lies on this machine: an existing path, or a
Hugging Face hub id ``org/name[@revision]`` resolved through ``huggingface_hub`` into its
local cache (``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` honoured, as
the library reads them).

A run resolves its hub id once per node, in the launcher, before any rank starts: the
snapshot's commit goes to the ranks (``checkpoint.init_from_commit``), which then read that
snapshot from the cache without asking the hub again, and it is recorded in the run's
config.json. Only what a run reads is downloaded (``RUN_FILES``: the config, the tokenizer,
the stop tokens of ``generation_config.json`` and the safetensors shards), or, for planning,
the config alone.

Every failure is one ``ConfigError`` line naming the field and what to do: a model that does
not exist, a hub that cannot be reached, a gated repository without a token, a repository
whose weights are only pickles (``.bin``, never unpickled here), one that needs
``trust_remote_code``. No name is ever looked up by listing a directory: the cache's own
``refs/`` and ``snapshots/<commit>/`` are what ``huggingface_hub`` resolves.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from threefold.config import ConfigError

# org/name, each part as the hub allows (letters, digits, '-', '_', '.'), optionally @revision
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")
CONFIG_FILES = ["config.json"]
RUN_FILES = ["config.json", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "model.safetensors.index.json", "*.safetensors"]
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


@dataclass(frozen=True)
class Located:
    """A model's local folder, and where it came from when it is a hub snapshot."""

    path: Path
    repo: str = ""  # the hub id without its revision ("" for a local path)
    commit: str = ""  # the snapshot's commit

    @property
    def name(self) -> str:
        """How a user would name it again: the path, or ``org/name@commit``."""
        return f"{self.repo}@{self.commit}" if self.repo else str(self.path)


def hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo, revision or None) when ``spec`` is written as a hub id and is not a local path;
    else None. A name whose folder part is a local directory (``runs/default`` where
    ``runs/`` exists) is taken as a path that is missing, not looked up on the hub."""
    path = Path(spec).expanduser()
    if not spec or path.exists() or path.parent.is_dir() and str(path.parent) != ".":
        return None
    m = HUB_ID.match(spec)
    return (m["repo"], m["rev"]) if m else None


def locate(spec: str, field: str, *, commit: str = "", config_only: bool = False) -> Located:
    """The local folder of ``spec`` (see the module docstring); ``commit``: the snapshot the
    launcher resolved (read from the cache alone); ``config_only``: fetch config.json alone
    (planning). ConfigError naming ``field`` when it cannot be had."""
    path = Path(spec).expanduser()
    if path.exists():
        return Located(path)
    parsed = hub_id(spec)
    if parsed is None:
        raise ConfigError(f"{field}: '{spec}' does not exist (neither a path nor a Hugging "
                          "Face hub id org/name[@revision])")
    repo, revision = parsed
    folder = _download(repo, commit or revision, field, config_only, local_only=bool(commit))
    located = Located(folder, repo, folder.name)
    check_snapshot(located, field, weights=not config_only)
    return located


def _download(repo: str, revision: str | None, field: str, config_only: bool,
              local_only: bool) -> Path:
    """``snapshot_download`` of the files a run (or a plan) needs; its errors as one line."""
    # imported here: only a hub id needs it, and it takes a while to import
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    name = f"{repo}@{revision}" if revision else repo
    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=local_only,
                                      allow_patterns=CONFIG_FILES if config_only else RUN_FILES))
    except GatedRepoError:  # (a kind of RepositoryNotFoundError: first)
        raise ConfigError(f"{field}: '{repo}' is gated: accept its conditions on its hub page, "
                          "then set HF_TOKEN (or run `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{field}: '{repo}' is not a model on the Hugging Face hub (or it is "
                          "private: set HF_TOKEN); check the name") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{field}: '{repo}' has no revision '{revision}'") from None
    except LocalEntryNotFoundError:
        raise ConfigError(_not_cached(field, name, local_only)) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{field}: '{name}' could not be fetched from the Hugging Face hub: "
                          f"{first}") from None


def _not_cached(field: str, name: str, local_only: bool) -> str:
    """Why a hub id is in neither the hub's reach nor the local cache, and what to do."""
    from huggingface_hub import constants

    where = f"not in the local Hugging Face cache ({constants.HF_HUB_CACHE})"
    if local_only:
        return (f"{field}: '{name}' is {where}, which the launcher filled: give every node "
                "the same HF_HOME, or let each node's launcher download it")
    if constants.HF_HUB_OFFLINE:
        return (f"{field}: '{name}' is {where} and HF_HUB_OFFLINE is set: download it once "
                f"where the hub can be reached (`hf download {name.split('@')[0]}`), or unset "
                "HF_HUB_OFFLINE")
    return (f"{field}: '{name}' is {where} and the hub cannot be reached: check the network "
            "(HF_ENDPOINT, a proxy), or download it where the hub can be reached")


def check_snapshot(located: Located, field: str, weights: bool = True) -> None:
    """Refuse, by name, a snapshot threefold cannot use: no config.json, a config that needs
    ``trust_remote_code``, and (with ``weights``) no safetensors weights."""
    folder, name = located.path, located.name
    conf = folder / "config.json"
    if not conf.is_file():
        raise ConfigError(f"{field}: '{name}' has no config.json (not a transformers model)")
    try:
        data = json.loads(conf.read_text())
    except ValueError as e:
        raise ConfigError(f"{field}: '{name}': config.json is not valid JSON ({e})") from None
    if isinstance(data, dict) and data.get("auto_map"):
        raise ConfigError(f"{field}: '{name}' needs trust_remote_code (its model is code in the "
                          "repository, config.json auto_map); threefold runs no downloaded "
                          "code: use a model of a family transformers ships")
    if weights and not any(folder.glob("*.safetensors")):
        pickles = sorted(p.name for pat in PICKLES for p in folder.glob(pat))
        what = f"only pickle weights ({pickles[0]})" if pickles else "no .safetensors weights"
        raise ConfigError(f"{field}: '{name}' has {what}; threefold never unpickles files: "
                          "use a revision with safetensors weights, or convert it "
                          "(transformers' save_pretrained(..., safe_serialization=True))")

