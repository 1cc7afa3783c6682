"""The baseline's parts (threefold.plan.baseline): the tokenizer measured per file and its
formula's terms, a task's records, the token stream; tasks on their own records never
tokenize the corpus; the planner's parameter counts; the families docs/your-model.md lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.test_memory_finetune import write_conversations, write_large_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def test_parameter_counts_have_three_significant_digits():
    from threefold.plan.terms import count_text

    assert [count_text(n) for n in (688_800, 35_390_000, 134_515_008, 1_711_376_384)] == \
        ["0.689M", "35.4M", "135M", "1.71B"]


def test_your_model_lists_the_registered_families():
    from threefold.families import FAMILIES

    text = (ROOT / "docs" / "your-model.md").read_text()
    said = re.search(r"families that import \(.*?\) are (.*?); any other", text, re.S).group(1)
    assert re.findall(r"`([a-z0-9_]+)`", said) == list(FAMILIES)


def test_the_tokenizer_is_measured_once_per_file_else_counted(tmp_path, monkeypatch):
    from threefold.plan.baseline import TOKENIZER_BYTES, measured_tokenizer, tokenizer_part

    tok = write_large_tokenizer(tmp_path / "tokenizer.json", 20_000)
    cache = tmp_path / "baseline.json"
    size, chat, said = tokenizer_part(tok, 0, None, cache)
    # the measurement is cached by the file's hash: a second call reads it back
    assert len(json.loads(cache.read_text())) == 1 and chat == 0
    assert measured_tokenizer(tok, None, cache) == (size, chat)
    formula = TOKENIZER_BYTES["vocab"] * 20_000 + TOKENIZER_BYTES["merges"] * (20_000 - 258) \
        + TOKENIZER_BYTES["added"] * 2
    assert formula / 3 < size < 3 * formula
    assert "20,000 tokens, 19,742 merges, 2 added tokens" in said["tokenizer"]
    # where it cannot be measured: the formula, its terms printed
    monkeypatch.setattr("threefold.plan.baseline.measured_tokenizer", lambda *a: None)
    size, chat, said = tokenizer_part(tok, 0, None, cache)
    assert size == formula and chat == 0
    assert "× 270, 125, 260 bytes" in said["tokenizer"] and "chat" not in said
    # a BPE not trained yet: counted from data.vocab_size
    assert tokenizer_part(None, 20_000, None, cache)[0] == formula


def test_the_data_share_follows_the_data_configuration(tmp_path, monkeypatch):
    from threefold.config import load_config
    from threefold.plan.baseline import (HELD_BYTES_PER_TOKEN, RECORD_OVERHEAD, TaskData,
                                         run_baseline)

    # the tokenizer's part is the test above's
    monkeypatch.setattr("threefold.plan.baseline.measured_tokenizer", lambda *a: None)
    chats = write_conversations(tmp_path / "chats.jsonl", n=10)
    lines = chats.read_bytes().splitlines()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n" * 1000)
    cfg = load_config(None, [("data.corpus", str(corpus)), ("data.seq_len", "64"),
                             ("data.tokenizer", str(write_large_tokenizer(
                                 tmp_path / "tokenizer.json", 1000)))])
    sft = run_baseline(cfg, 1, 1000, 1, TaskData(str(chats), "builtin"))
    assert sft.data == sum(HELD_BYTES_PER_TOKEN * min(len(x) + 1, 64) + RECORD_OVERHEAD
                           for x in lines)
    pairs = run_baseline(cfg, 1, 1000, 1, TaskData(str(chats), "builtin", 2))
    assert pairs.data > sft.data  # two rows of a record hold more of its tokens
    stream = run_baseline(cfg, 1, 1000, 1)
    assert stream.data == 2 * 10_000 and stream.chat == 0  # uint16 ids, a token per byte
    assert stream.process == sft.process and stream.tokenizer == sft.tokenizer > 0
    assert sft.total == sft.process + sft.tokenizer + sft.chat + sft.data


def test_a_task_on_its_own_records_tokenizes_no_corpus(tmp_path):
    from threefold.config import load_config
    from threefold.data import prepare_data

    tok = write_large_tokenizer(tmp_path / "tokenizer.json", 1000)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n" * 100)
    cfg = load_config(None, [("data.corpus", str(corpus)), ("data.tokenizer", str(tok)),
                             ("data.cache_dir", str(tmp_path / "cache"))]).data
    data = prepare_data(cfg, stream=False)
    assert data.sources == [] and data.vocab_size == 1000 and data.eot_id == 0
    assert not (tmp_path / "cache").exists()
    assert len(prepare_data(cfg).sources) == 1 and (tmp_path / "cache" / "tokens").is_dir()


def test_a_measurement_is_kept_per_environment(tmp_path, monkeypatch):
    """A process's measured bytes are reused only under the same installed packages and
    threefold source: a cached figure from before an install (vLLM's makes torch import
    Triton, +85 MB a process) must not be read back after it."""
    import sys

    from threefold.plan import calibrate

    path = tmp_path / "calibration.json"
    probe = [sys.executable, "-c", "print(7)"]
    assert calibrate.measured_once("probe", probe, {}, path) == [7]
    # the same key, environment unchanged: read back, never re-run
    assert calibrate.measured_once("probe", [sys.executable, "-c", "print(8)"], {}, path) == [7]
    monkeypatch.setattr(calibrate, "_DIGEST", "another-environment")
    assert calibrate.measured_once("probe", [sys.executable, "-c", "print(8)"], {}, path) == [8]
    kept = json.loads((tmp_path / "baseline.json").read_text())
    assert list(kept) == ["probe|env=another-environment"]  # the stale figure is dropped
