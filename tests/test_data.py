"""Tests for threefold.data: corpora, tokenizers, cached token files and sampling."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

import threefold.data.tokenizer as tokenizer_mod
import threefold.data.tokens as tokens_mod
from threefold.config import DataConfig
from threefold.data import DataError, load_tokenizer, prepare_data, read_corpus
from threefold.data.cache import atomic_open
from threefold.data.tokens import token_dtype

WORDS = ("alpha beta gamma delta epsilon model layer tensor rank shard pipeline stage grad "
         "naïve café Straße 東京 данные 🙂 def return self").split()


def make_text(n_words: int, seed: int) -> str:
    """Deterministic pseudo-prose with line breaks and some non-ASCII words."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
             for _ in range(n_words // 7)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(make_text(6000, seed=1), encoding="utf-8")
    return path


def cfg_for(corpus, cache, **kw) -> DataConfig:
    kw.setdefault("vocab_size", 300)
    kw.setdefault("seq_len", 16)
    return DataConfig(corpus=str(corpus), cache_dir=str(cache), **kw)


# ---------------------------------------------------------------------------------- tokenizer
def test_bpe_round_trip_on_unicode(corpus_file, tmp_path):
    bundle = prepare_data(cfg_for(corpus_file, tmp_path))
    tok = bundle.tokenizer
    # Includes characters never seen in training: byte-level BPE must still encode them.
    text = ("  naïve café\n\tΣίσυφος 東京タワー 🙂🚀 Ωmega\r\n"
            "\x00 zero-width\u200bjoin ﬁ\n")
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert max(ids) < bundle.vocab_size
    assert bundle.vocab_size == 300 and tok.get_vocab_size() <= 300
    assert tok.id_to_token(bundle.eot_id) == "<|endoftext|>"
    # Merges were learned: common words take fewer tokens than bytes.
    assert len(tok.encode(" pipeline").ids) < len(" pipeline".encode())


def test_token_stream_layout(corpus_file, tmp_path):
    cfg = cfg_for(corpus_file, tmp_path, val_fraction=0.1)
    bundle = prepare_data(cfg)
    stream = np.concatenate([bundle.train, bundle.val])
    assert bundle.train.dtype == np.uint16
    assert isinstance(bundle.train, np.memmap) and isinstance(bundle.val, np.memmap)
    assert abs(len(bundle.val) - 0.1 * len(stream)) <= 1
    # One document: its tokens then a single end-of-text at the very end.
    assert stream[-1] == bundle.eot_id and (stream == bundle.eot_id).sum() == 1
    assert bundle.tokenizer.decode(stream[:-1].tolist()) == corpus_file.read_text()


def test_literal_endoftext_in_text_is_not_a_separator(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.txt").write_text(make_text(300, i) + "the <|endoftext|> marker\n")
    bundle = prepare_data(cfg_for(d, tmp_path / "cache", seq_len=8))
    stream = np.concatenate([bundle.train, bundle.val])
    assert (stream == bundle.eot_id).sum() == 3  # one per document, none from the text


def test_cache_hit_does_not_retrain_or_retokenize(corpus_file, tmp_path, monkeypatch):
    cfg = cfg_for(corpus_file, tmp_path)
    first = prepare_data(cfg)
    mtimes = (os.stat(first.tokenizer_path).st_mtime_ns, os.stat(first.tokens_path).st_mtime_ns)

    def fail(*a, **k):
        raise AssertionError("cache miss: rebuilt an entry that was cached")

    monkeypatch.setattr(tokenizer_mod, "train_bpe", fail)
    monkeypatch.setattr(tokens_mod, "write_tokens", fail)
    second = prepare_data(cfg)
    assert second.tokenizer_path == first.tokenizer_path
    assert (os.stat(second.tokenizer_path).st_mtime_ns,
            os.stat(second.tokens_path).st_mtime_ns) == mtimes
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)
    # A different vocabulary size or different text is a different cache entry.
    monkeypatch.undo()
    assert prepare_data(cfg_for(corpus_file, tmp_path, vocab_size=280)).tokenizer_path \
        != first.tokenizer_path
    assert prepare_data(cfg_for(corpus_file, tmp_path, max_corpus_mb=0.01)).tokenizer_path \
        != first.tokenizer_path


def test_damaged_token_cache_is_rebuilt(corpus_file, tmp_path):
    cfg = cfg_for(corpus_file, tmp_path)
    good = np.array(prepare_data(cfg).train)
    bundle = prepare_data(cfg)
    with open(bundle.tokens_path, "r+b") as fh:  # as if a writer had died half-way
        fh.truncate(os.path.getsize(bundle.tokens_path) // 2)
    assert np.array_equal(prepare_data(cfg).train, good)


def test_atomic_open_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "entry.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_open(target) as fh:
            fh.write(b"half of the new")
            raise RuntimeError("crash")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.bin"]


def test_load_saved_tokenizer_json(corpus_file, tmp_path):
    trained = prepare_data(cfg_for(corpus_file, tmp_path / "a"))
    saved = tmp_path / "my_tokenizer.json"
    saved.write_bytes(trained.tokenizer_path.read_bytes())
    loaded = prepare_data(cfg_for(corpus_file, tmp_path / "b", tokenizer=str(saved)))
    assert loaded.tokenizer_path == saved.resolve()
    assert loaded.vocab_size == trained.tokenizer.get_vocab_size()
    assert loaded.eot_id == trained.eot_id
    assert np.array_equal(loaded.train, trained.train)
    assert load_tokenizer(saved).encode("beta gamma").ids == \
        trained.tokenizer.encode("beta gamma").ids


def test_token_dtype():
    assert token_dtype(4096) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(128256) == np.uint32


# ---------------------------------------------------------------------------------- corpora
def test_jsonl_corpus(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"body": "first record", "id": 1}, "a raw string record", {"body": "third ✓"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    corpus = read_corpus(cfg_for(path, tmp_path, text_key="body"))
    assert corpus.docs == ["first record", "a raw string record", "third ✓"]


def test_directory_corpus_is_recursive_sorted_and_filtered(tmp_path):
    root = tmp_path / "corpus"
    (root / "b_sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "a.md").write_text("doc a")
    (root / "b_sub" / "c.py").write_text("doc c")
    (root / "b_sub" / "d.jsonl").write_text(json.dumps({"text": "doc d"}) + "\n")
    (root / "z.txt").write_text("doc z")
    (root / "image.bin").write_bytes(b"\x00\x01 not text")
    (root / ".hidden" / "e.txt").write_text("hidden")
    corpus = read_corpus(cfg_for(root, tmp_path))
    assert corpus.docs == ["doc a", "doc c", "doc d", "doc z"]


def test_size_cap_and_digest(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text("é" * 5000, encoding="utf-8")  # 2 bytes per character
    small = read_corpus(cfg_for(path, tmp_path, max_corpus_mb=0.000101))  # 101 bytes
    assert small.docs == ["é" * 50] and small.nbytes == 100  # the split character is dropped
    full = read_corpus(cfg_for(path, tmp_path))
    assert full.nbytes == 10000 and full.digest != small.digest
    assert read_corpus(cfg_for(path, tmp_path)).digest == full.digest


def test_stdlib_corpus_found(tmp_path):
    cfg = DataConfig(corpus="stdlib", max_corpus_mb=0.2, cache_dir=str(tmp_path), vocab_size=300,
                     seq_len=32)
    corpus = read_corpus(cfg)
    assert "stdlib" in corpus.name and len(corpus.docs) > 1
    assert 0.19e6 < corpus.nbytes <= 0.2e6
    assert "import" in "".join(corpus.docs)
    bundle = prepare_data(cfg)
    assert len(bundle.train) > 10_000 and len(bundle.val) > 32


# ---------------------------------------------------------------------------------- errors
def test_missing_corpus_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match="nope.txt.*does not exist"):
        prepare_data(cfg_for(missing, tmp_path))


def test_bad_and_missing_tokenizer_json(corpus_file, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{ this is not json")
    with pytest.raises(DataError, match=r"tokenizer\.json.*not a valid tokenizer\.json"):
        prepare_data(cfg_for(corpus_file, tmp_path, tokenizer=str(bad)))
    with pytest.raises(DataError, match="absent.json.*does not exist"):
        prepare_data(cfg_for(corpus_file, tmp_path, tokenizer=str(tmp_path / "absent.json")))


def test_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "recs.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "x"}) + "\n")
    with pytest.raises(DataError, match=r"recs\.jsonl:2: record has no 'text' field.*content"):
        read_corpus(cfg_for(path, tmp_path))
    path.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"recs\.jsonl:2: not valid JSON"):
        read_corpus(cfg_for(path, tmp_path))
    path.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match=r"recs\.jsonl:1: expected text"):
        read_corpus(cfg_for(path, tmp_path))


def test_empty_corpora(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.txt.*empty"):
        read_corpus(cfg_for(empty, tmp_path))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "data.csv").write_text("a,b")
    with pytest.raises(DataError, match="folder.*holds no"):
        read_corpus(cfg_for(folder, tmp_path))


def test_corpus_too_small_for_seq_len(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("just a few words here")
    with pytest.raises(DataError, match="tiny.txt.*too few for data.seq_len=64"):
        prepare_data(cfg_for(path, tmp_path, seq_len=64))
