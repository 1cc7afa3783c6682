"""The models users bring: a Hugging Face folder or hub id defines the model everywhere — the
dry run, the planner, the layout checks before launch and the run — and a hub id is resolved
through huggingface_hub from a cache laid out as the hub lays it out (``HF_HUB_OFFLINE``: the
machines here have no hub).

The model is SmolLM2's kind, cut down: tied embeddings, 9 query and 3 key/value heads (a tp of
2 splits neither), RoPE base 100,000."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from tests.test_generate import CHATML  # ChatML, as transformers renders it
from threefold.plan.terms import count_text
from threefold.weights import hf_config
from threefold.commands.main import main
from threefold.config import ConfigError, ModelConfig
from threefold.data import train_bpe
from threefold.weights.hub import locate

REPO = "tf-test/smol-9-3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHAPE = dict(vocab_size=512, hidden_size=72, intermediate_size=192, num_hidden_layers=2,
             num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
             rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=256)


def make_folder(path: Path, tokenizer: bool = True, **config) -> Path:
    """A Hugging Face folder of the cut-down SmolLM2-like model (random weights), with a
    small BPE and a ChatML template unless ``tokenizer`` is False; ``config`` is merged into
    config.json."""
    path.mkdir(parents=True)
    cfg = ModelConfig(**SHAPE).resolved()
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g) * 0.05 for n, s in
               hf_config.expected_shapes(cfg).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**hf_config.hf_config(cfg), **config}))
    if tokenizer:  # threefold's BPE with ChatML's two special tokens added
        tok = train_bpe([Path(hf_config.__file__).read_text()], 300)
        tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
        tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return path


def add_to_cache(cache: Path, repo: str, folder: Path, commit: str = COMMIT) -> Path:
    """``folder``'s files put into the hub cache ``cache`` as huggingface_hub lays a download
    out: content-addressed blobs, the snapshot's files linking to them, refs/main naming the
    commit. Returns the snapshot folder."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline hub cache holding REPO; HF_HOME points at it for this process and any it
    starts."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf" / "hub"
    add_to_cache(cache, REPO, make_folder(tmp_path / "src"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_resolves_to_its_snapshot_by_branch_or_commit(hub):
    snap = hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    for spec in (REPO, f"{REPO}@main", f"{REPO}@{COMMIT}"):
        got = locate(spec, "checkpoint.init_from")
        assert got.path == snap and got.commit == COMMIT and got.name == f"{REPO}@{COMMIT}"
    assert locate(str(snap), "x").path == snap  # an existing path comes first


def test_the_launcher_resolves_once_and_ranks_read_that_commit_without_the_hub(hub,
                                                                                monkeypatch):
    import huggingface_hub.constants as constants

    from threefold.config import load_config
    from threefold.launch.launcher import resolve_init_from

    cfg = load_config(None, [("checkpoint.init_from", REPO)])
    argv = resolve_init_from(cfg, ["--checkpoint.init_from", REPO])
    assert argv[-2:] == ["--checkpoint.init_from_commit", COMMIT]
    # a rank: the hub unreachable and not offline, yet the launcher's commit is read from the
    # cache with no request made
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert locate(REPO, "x", commit=COMMIT).commit == COMMIT


def _gated(*args, **kwargs):
    import httpx
    from huggingface_hub.errors import GatedRepoError

    request = httpx.Request("GET", "https://huggingface.co/api/models/org/gated")
    raise GatedRepoError("gated", response=httpx.Response(401, request=request))


@pytest.mark.parametrize("case, words", [
    ("missing", ["tf-test/absent", "not in the local Hugging Face cache", "HF_HUB_OFFLINE"]),
    ("no network", ["tf-test/absent", "the hub cannot be reached"]),
    ("gated", ["is gated", "HF_TOKEN"]),
    ("pickles", ["only pickle weights (pytorch_model.bin)", "never unpickles"]),
    ("remote code", ["trust_remote_code", "auto_map"]),
])
def test_each_hub_failure_is_one_line_naming_the_fix(hub, tmp_path, monkeypatch, case, words):
    import huggingface_hub
    import huggingface_hub.constants as constants

    spec = "tf-test/absent"
    if case == "no network":  # a port nothing listens on: the connection is refused at once
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    elif case == "gated":
        monkeypatch.setattr(huggingface_hub, "snapshot_download", _gated)
    elif case == "pickles":
        folder = make_folder(tmp_path / "pickles")
        (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
        add_to_cache(hub, spec, folder)
    elif case == "remote code":
        add_to_cache(hub, spec, make_folder(tmp_path / "custom",
                                            auto_map={"AutoModel": "modeling.Custom"}))
    with pytest.raises(ConfigError) as e:
        locate(spec, "checkpoint.init_from")
    msg = str(e.value)
    assert msg.startswith("checkpoint.init_from: ") and "\n" not in msg
    for w in words:
        assert w in msg


def _first_lines(capsys, argv: list[str]) -> tuple[int, list[str], str]:
    rc = main(argv)
    got = capsys.readouterr()
    return rc, got.out.splitlines(), got.err.strip()


def test_dry_run_plan_and_layout_checks_read_the_checkpoint(hub, tmp_path, capsys):
    folder = make_folder(tmp_path / "bare", tokenizer=False)
    n = sum(torch.Size(s).numel() for s in hf_config.expected_shapes(
        ModelConfig(**SHAPE).resolved()).values())
    for spec in (REPO, str(folder)):  # a folder without a tokenizer still dry-runs
        rc, out, err = _first_lines(capsys, ["sft", "--checkpoint.init_from", spec,
                                             "--model.preset", "small", "--lora.r", "4",
                                             "--dry-run"])
        assert rc == 0, err
        assert out[0].startswith(f"threefold dry run: {n / 1e6:,.2f}M parameters (h 72, 2 "
                                 "layers, vocab 512)")
        assert any("model.preset 'small' is dropped" in line for line in out)
    # a shape override that contradicts the checkpoint; one that agrees is allowed
    rc, _, err = _first_lines(capsys, ["train", "--checkpoint.init_from", REPO,
                                       "--model.num_key_value_heads", "9", "--dry-run"])
    assert rc == 2 and "model.num_key_value_heads: 9, but the checkpoint" in err \
        and "has 3" in err
    rc, _, err = _first_lines(capsys, ["train", "--checkpoint.init_from", REPO,
                                       "--model.num_key_value_heads", "3", "--dry-run"])
    assert rc == 0, err
    # before launch, with a tp that does fit named
    rc, _, err = _first_lines(capsys, ["sft", "--checkpoint.init_from", REPO,
                                       "--nproc-per-node", "2", "--parallel.tp", "2"])
    assert rc == 2 and "num_attention_heads: 9" in err and "tp in 1, 3" in err
    # training from a folder without a tokenizer: refused, naming the file
    rc, _, err = _first_lines(capsys, ["sft", "--checkpoint.init_from", str(folder)])
    assert rc == 2 and "has no tokenizer.json" in err and "--data.tokenizer" in err
    # the planner: a hub id, a folder, a config.json
    for spec in (REPO, str(folder), str(folder / "config.json")):
        rc, out, err = _first_lines(capsys, ["plan", "--model", spec, "--gpus", "2",
                                             "--top", "1", "--seq-len", "128"])
        assert rc == 0, err
        assert out[0] == (f"{spec}: {count_text(n)} parameters, vocab 512 (padded to a "
                          "multiple of tp), seq 128, 32768 sequences per step, bf16")


def test_sft_from_a_hub_id_trains_and_records_its_commit(hub, tmp_path, capsys):
    out = tmp_path / "run"
    rc, _, err = _first_lines(capsys, [
        "sft", "--checkpoint.init_from", REPO, "--train.output_dir", str(out),
        "--train.steps", "2", "--data.seq_len", "64", "--train.global_batch_size", "4",
        "--train.micro_batch_size", "4", "--train.progress", "off", "--lora.r", "4"])
    assert rc == 0, err
    saved = json.loads((out / "config.json").read_text())["checkpoint"]
    assert saved["init_from"] == REPO and saved["init_from_commit"] == COMMIT
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] == summary["final_loss"]  # trained: a number, not NaN
    # the adapters for PEFT name the hub id and commit as their base; merged, a whole folder
    rc, _, err = _first_lines(capsys, ["convert", "--to", "peft", str(out),
                                       str(tmp_path / "adapter")])
    assert rc == 0, err
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == (REPO, COMMIT)
    rc, _, err = _first_lines(capsys, ["convert", "--to", "peft", "--merge", str(out),
                                       str(tmp_path / "merged")])
    assert rc == 0, err
    merged = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert (merged["num_attention_heads"], merged["num_key_value_heads"]) == (9, 3)


def test_generate_chats_with_a_hub_model_through_its_own_template(hub, capsys):
    rc, out, err = _first_lines(capsys, ["generate", "--from", REPO, "--chat", "--prompt",
                                         "def f", "--max-new-tokens", "3", "--json"])
    assert rc == 0, err
    got = json.loads(out[-1])
    tok = Tokenizer.from_file(str(locate(REPO, "x").path / "tokenizer.json"))
    # the ChatML rendering of the one user message, then the assistant's turn
    assert got["prompt_ids"][0] == tok.encode(
        "<|im_start|>user\ndef f<|im_end|>\n<|im_start|>assistant\n").ids
    assert tok.token_to_id("<|im_end|>") in got["stop_ids"]
