"""The tokenized corpus: one memory-mapped file of token ids, and ``prepare_data``, which
turns the configured data into sources (``threefold.data.sources``): the prepared directories
of ``data.mix``/``data.corpus``, or this cached stream of a raw corpus as one source.

The token stream is every document's ids followed by the end-of-text id, in corpus order. It is
written once per (tokenizer, corpus digest) to ``<cache_dir>/tokens/<fingerprint>.bin`` (uint16
when the vocabulary fits, else uint32) with a ``.json`` description written after it; an entry
is trusted only if the description exists and the file has exactly the length it records.

Validation split (``threefold.data.sources.train_split``): the last ``val_fraction`` of the token
stream (at least ``seq_len + 1`` tokens, one full window), so the split is exact for any corpus,
even a single document; the cost is that one document may straddle the boundary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from threefold.config import DataConfig
from threefold.data.cache import atomic_open, build_lock, file_sha256, fingerprint
from threefold.data.corpus import Corpus, read_corpus
from threefold.data.errors import DataError
from threefold.data.sources import (TokenSource, check_prepared, mix_entries, open_prepared,
                                     stream_source)
from threefold.data.tokenizer import (cache_root, eot_id, get_tokenizer, load_tokenizer,
                                       use_all_cores)

TOKENS_VERSION = 1
_ENCODE_CHUNK_CHARS = 4_000_000  # encode this much text per call: bounded memory, parallel work


@dataclass
class DataBundle:
    """Everything training needs from the data layer."""

    tokenizer: Tokenizer
    vocab_size: int  # rows the model's embedding needs; every token id is below it
    sources: list[TokenSource]  # what pre-training samples from, each with its held-out tail
    eot_id: int
    tokenizer_path: Path  # tokenizer.json to copy into the run directory
    corpus: str  # description of the source(s)
    tokens_path: Path | None = None  # a raw corpus's cached token file (None when prepared)

    @property
    def train(self) -> np.ndarray:
        """The first source's training tokens as one array (tests, benchmarks)."""
        return self.sources[0].tokens("train")

    @property
    def val(self) -> np.ndarray:
        """The first source's held-out tokens as one array."""
        return self.sources[0].tokens("val")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _chunks(docs: list[str], max_chars: int):
    start, size = 0, 0
    for i, doc in enumerate(docs):
        size += len(doc)
        if size >= max_chars:
            yield docs[start : i + 1]
            start, size = i + 1, 0
    if start < len(docs):
        yield docs[start:]


def write_tokens(tok: Tokenizer, docs: list[str], eot: int, dtype: np.dtype, path: Path) -> int:
    """Encode ``docs`` (each followed by ``eot``) into ``path`` atomically; returns the count."""
    use_all_cores()
    # Text that happens to contain "<|endoftext|>" must stay text: only the separators we add
    # are end-of-text tokens. The flag lives on this object only, so restore it afterwards.
    saved = tok.encode_special_tokens
    tok.encode_special_tokens = True
    # encode_batch_fast (tokenizers >= 0.20) skips computing character offsets we never use.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    total = 0
    try:
        with atomic_open(path, "wb") as fh:
            for chunk in _chunks(docs, _ENCODE_CHUNK_CHARS):
                encodings = encode(chunk, add_special_tokens=False)
                ids: list[int] = []
                for enc in encodings:
                    ids.extend(enc.ids)
                    ids.append(eot)
                arr = np.asarray(ids, dtype=np.int64)
                if arr.size and arr.max() > np.iinfo(dtype).max:
                    raise DataError(f"token id {arr.max()} does not fit {dtype}; the tokenizer's "
                                    "vocabulary is larger than it reports")
                fh.write(arr.astype(dtype).tobytes())
                total += arr.size
    finally:
        tok.encode_special_tokens = saved
    return total


def _read_meta(meta_path: Path, bin_path: Path) -> dict | None:
    """The cached entry's description if the entry is complete, else None."""
    try:
        meta = json.loads(meta_path.read_text())
        size = bin_path.stat().st_size
    except (OSError, ValueError):
        return None
    if size != meta.get("num_tokens", -1) * np.dtype(meta.get("dtype", "uint8")).itemsize:
        return None
    return meta


def cached_tokens(cfg: DataConfig, corpus: Corpus, tok: Tokenizer, tok_path: Path,
                  eot: int, vocab_size: int) -> tuple[np.memmap, Path]:
    """The corpus's token stream as a read-only memmap, tokenizing it on the first call."""
    dtype = token_dtype(vocab_size)
    key = fingerprint("tokens", TOKENS_VERSION, file_sha256(tok_path), corpus.digest, eot,
                      dtype.name)
    bin_path = cache_root(cfg) / "tokens" / f"{key}.bin"
    meta_path = bin_path.with_suffix(".json")
    with build_lock(bin_path):
        meta = _read_meta(meta_path, bin_path)
        if meta is None:
            n = write_tokens(tok, corpus.docs, eot, dtype, bin_path)
            meta = {"version": TOKENS_VERSION, "num_tokens": n, "dtype": dtype.name,
                    "eot_id": eot, "num_docs": len(corpus.docs), "corpus": corpus.name,
                    "corpus_bytes": corpus.nbytes, "tokenizer": str(tok_path)}
            with atomic_open(meta_path, "w") as fh:  # written last: it marks the entry complete
                json.dump(meta, fh, indent=1)
    tokens = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r",
                       shape=(meta["num_tokens"],))
    return tokens, bin_path


def prepare_data(cfg: DataConfig, stream: bool = True) -> DataBundle:
    """The sources ``cfg`` names, with their tokenizer: the prepared directories of
    ``data.mix`` or ``data.corpus`` as they are, or a raw corpus read, tokenized (both cached)
    and made a source of one shard. Without ``stream`` (a task that trains on its own records:
    conversations, preference pairs, prompts) only the tokenizer: a raw corpus is read only
    to train a BPE and never tokenized, so the run holds no token stream it does not use."""
    entries = mix_entries(cfg.corpus, cfg.mix)
    if entries is not None:
        return _prepared(cfg, entries)
    if not stream and cfg.tokenizer != "bpe":
        tok, tok_path = get_tokenizer(cfg, None)
        return DataBundle(tokenizer=tok, vocab_size=tok.get_vocab_size(with_added_tokens=True),
                          sources=[], eot_id=eot_id(tok, tok_path), tokenizer_path=tok_path,
                          corpus="none (the task's own records)")
    corpus = read_corpus(cfg)
    tok, tok_path = get_tokenizer(cfg, corpus)
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    # A trained BPE may stop short of vocab_size on a small corpus; report the configured size
    # anyway so the model matches what the configuration (and the planner) said.
    vocab_size = max(cfg.vocab_size, n_vocab) if cfg.tokenizer == "bpe" else n_vocab
    eot = eot_id(tok, tok_path)
    if not stream:
        return DataBundle(tokenizer=tok, vocab_size=vocab_size, sources=[], eot_id=eot,
                          tokenizer_path=tok_path, corpus="none (the task's own records)")
    tokens, bin_path = cached_tokens(cfg, corpus, tok, tok_path, eot, vocab_size)
    source = stream_source(tokens, eot, corpus.name, corpus.digest, file_sha256(tok_path),
                           cfg.val_fraction, cfg.seq_len)
    return DataBundle(tokenizer=tok, vocab_size=vocab_size, sources=[source], eot_id=eot,
                      tokenizer_path=tok_path, corpus=corpus.name, tokens_path=bin_path)


def _prepared(cfg: DataConfig, entries) -> DataBundle:
    """The prepared directories ``entries`` (name, dir, weight) as weighted sources, read with
    the tokenizer they were prepared with (checked to be one)."""
    check_prepared(cfg.corpus, cfg.mix, cfg.tokenizer)
    field = "data.mix" if cfg.mix else "data.corpus"
    sources = []
    for name, where, weight in entries:
        source = open_prepared(where, name, cfg.val_fraction, cfg.seq_len, f"{field} '{name}'")
        source.weight = weight
        sources.append(source)
    tok_path = Path(sources[0].where) / "tokenizer.json"
    tok = load_tokenizer(tok_path)
    eot = eot_id(tok, tok_path)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    desc = ", ".join(f"{s.name}={s.where}:{float(s.weight):g}" for s in sources)
    return DataBundle(tokenizer=tok, vocab_size=vocab_size, sources=sources, eot_id=eot,
                      tokenizer_path=tok_path, corpus=desc)
