"""Token sources: the streams of token ids a pre-training run reads, each with its held-out tail.

A source is either a directory written by ``threefold data prepare`` (recognised by its
``index.json``; its shards are read in index order as one stream, its document ends from the
``.ends`` files) or the cached token file of a raw corpus (``threefold.data.tokens``; its
document ends are the end-of-text ids, which only separators are). The last ``data.val_fraction``
of each source's stream (at least one window) is held out for validation.

``data.mix`` names several prepared sources and their proportions:
``"web=/data/web:0.7,code=/data/code:0.3"``. Weights need not sum to 1 (they are normalised);
every source must have been prepared with the same tokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from threefold.data.errors import DataError

INDEX = "index.json"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+$")


class _Shard:
    """One file of token ids and the end offsets of its documents, opened on first use."""

    def __init__(self, path: Path | None, n_tokens: int, n_docs: int, dtype: np.dtype,
                 tokens: np.ndarray | None = None, ends: np.ndarray | None = None):
        self.path, self.n_tokens, self.n_docs, self.dtype = path, n_tokens, n_docs, dtype
        self._tokens, self._ends = tokens, ends

    def tokens(self) -> np.ndarray:
        """The shard's ids, memory-mapped read-only."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r",
                                     shape=(self.n_tokens,))
        return self._tokens

    def ends(self) -> np.ndarray:
        """uint64 end offset (exclusive) of each document in the shard."""
        if self._ends is None:
            self._ends = np.fromfile(self.path.with_suffix(".ends"), dtype="<u8")
        return self._ends


class TokenStream:
    """Shards read as one stream of token ids: shard i's tokens follow shard i-1's."""

    def __init__(self, shards: list[_Shard]):
        self.shards = shards
        self.offsets = np.cumsum([0] + [s.n_tokens for s in shards], dtype=np.int64)
        self.doc_offsets = np.cumsum([0] + [s.n_docs for s in shards], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _pieces(self, start: int, n: int):
        """(shard, lo, hi) pieces of the shards that cover [start, start + n)."""
        if start < 0 or start + n > len(self):
            raise DataError(f"tokens [{start}, {start + n}) are outside a stream of {len(self)}")
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        end = start + n
        while start < end:
            base = int(self.offsets[i])
            hi = min(end, int(self.offsets[i + 1]))
            yield i, start - base, hi - base
            start, i = hi, i + 1

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) as int64."""
        parts = [self.shards[i].tokens()[lo:hi] for i, lo, hi in self._pieces(start, n)]
        return np.concatenate(parts).astype(np.int64)

    def documents(self, start: int, n: int) -> np.ndarray:
        """The stream-wide document number of each token in [start, start + n), int64."""
        parts = []
        for i, lo, hi in self._pieces(start, n):
            pos = np.arange(lo, hi, dtype=np.uint64)
            inside = np.searchsorted(self.shards[i].ends(), pos, side="right")
            parts.append(inside.astype(np.int64) + self.doc_offsets[i])
        return np.concatenate(parts)


@dataclass
class TokenSource:
    """One source of training text: its stream, split into training tokens [0, n_train) and the
    held-out rest, and what identifies it (for checkpoints and refusals)."""

    name: str
    where: str  # the directory, or a description of the raw corpus
    stream: TokenStream
    n_train: int
    digest: str  # of the source text
    tokenizer_sha256: str
    weight: Fraction = Fraction(1)

    @property
    def n_val(self) -> int:
        """Held-out tokens."""
        return len(self.stream) - self.n_train

    def tokens(self, split: str = "train") -> np.ndarray:
        """A whole split as one array (a view when the source is one shard)."""
        lo, hi = (0, self.n_train) if split == "train" else (self.n_train, len(self.stream))
        if len(self.stream.shards) == 1:
            return self.stream.shards[0].tokens()[lo:hi]
        return self.stream.read(lo, hi - lo)


def train_split(n_tokens: int, val_fraction: float, seq_len: int, name: str) -> int:
    """Training tokens of a source of ``n_tokens``: all but the last ``val_fraction`` (at least
    one window of ``seq_len`` + 1) of them; DataError when training would get no window."""
    window = seq_len + 1
    n_val = max(round(n_tokens * val_fraction), window)
    if n_tokens - n_val < window:
        raise DataError(f"corpus '{name}' gives only {n_tokens} tokens, too few for "
                        f"data.seq_len={seq_len} (need {2 * window}: one window for training and "
                        "one for validation); use more text, raise data.max_corpus_mb or lower "
                        "data.seq_len")
    return n_tokens - n_val


def stream_source(tokens: np.ndarray, eot: int, name: str, digest: str, tok_sha: str,
                  val_fraction: float, seq_len: int) -> TokenSource:
    """A raw corpus's cached token stream as a source of one shard (documents end at its
    end-of-text ids)."""
    ends = (np.flatnonzero(np.asarray(tokens) == eot) + 1).astype(np.uint64)
    if not len(ends) or int(ends[-1]) != len(tokens):
        ends = np.append(ends, np.uint64(len(tokens)))
    shard = _Shard(None, len(tokens), len(ends), tokens.dtype, tokens=tokens, ends=ends)
    n_train = train_split(len(tokens), val_fraction, seq_len, name)
    return TokenSource(name, name, TokenStream([shard]), n_train, digest, tok_sha)


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a directory ``threefold data prepare`` wrote (it has an index)."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / INDEX).is_file()


def read_index(path: str | Path, field: str = "data.corpus") -> dict:
    """A prepared directory's index; DataError naming ``field`` unless it is complete."""
    p = Path(path).expanduser()
    try:
        index = json.loads((p / INDEX).read_text())
    except FileNotFoundError:
        raise DataError(f"{field}: '{p}' is not a prepared directory (no {INDEX}); run "
                        f"`threefold data prepare SOURCES... --out {p}` first") from None
    except ValueError:
        raise DataError(f"{field}: {p / INDEX} is not valid JSON; prepare the directory "
                        "again") from None
    if not index.get("complete"):
        raise DataError(f"{field}: '{p}' was not finished by `threefold data prepare`; rerun "
                        "the same command to complete it")
    return index


def open_prepared(path: str | Path, name: str, val_fraction: float, seq_len: int,
                  field: str = "data.corpus") -> TokenSource:
    """A prepared directory as a source; DataError if a shard's size disagrees with the index."""
    p = Path(path).expanduser().resolve()
    index = read_index(p, field)
    dtype = np.dtype(index["settings"]["dtype"])
    shards = []
    for s in index["shards"]:
        shard = _Shard(p / f"{s['name']}.bin", int(s["tokens"]), int(s["documents"]), dtype)
        for file, size in ((shard.path, shard.n_tokens * dtype.itemsize),
                           (shard.path.with_suffix(".ends"), shard.n_docs * 8)):
            if not file.is_file() or file.stat().st_size != size:
                raise DataError(f"{field}: {file} is missing or not the size {INDEX} records "
                                f"({size} bytes); prepare '{p}' again")
        shards.append(shard)
    n_train = train_split(int(index["tokens"]), val_fraction, seq_len, str(p))
    return TokenSource(name, str(p), TokenStream(shards), n_train, index["source_digest"],
                       index["settings"]["tokenizer_sha256"])


def parse_mix(text: str) -> list[tuple[str, str, Fraction]]:
    """``"name=DIR:weight,..."`` as (name, dir, weight); DataError naming data.mix if malformed."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, rest = item.partition("=")
        where, colon, weight = rest.rpartition(":")
        if not (eq and colon and where and _NAME.match(name.strip())):
            raise DataError(f"data.mix: '{item}' is not NAME=DIR:WEIGHT (e.g. "
                            "\"web=/data/web:0.7,code=/data/code:0.3\"; names of letters, digits, "
                            "'_', '.', '-')")
        try:
            w = Fraction(weight.strip())
        except ValueError:
            raise DataError(f"data.mix: weight '{weight}' of '{name}' is not a number") from None
        if w <= 0:
            raise DataError(f"data.mix: weight of '{name}' must be positive, got {weight}")
        out.append((name.strip(), where.strip(), w))
    names = [n for n, _, _ in out]
    if not out or len(set(names)) != len(names):
        raise DataError(f"data.mix: '{text}' names no source or one name twice; give each "
                        "source a distinct name")
    return out


def mix_entries(corpus: str, mix: str) -> list[tuple[str, str, Fraction]] | None:
    """The prepared sources ``data.corpus``/``data.mix`` name as (name, dir, weight), or None
    when the corpus is raw text (or the built-in one)."""
    if mix:
        if corpus != "stdlib":
            raise DataError(f"data.mix and data.corpus ('{corpus}') are both set; name every "
                            "source in data.mix, or give one corpus")
        return parse_mix(mix)
    if is_prepared(corpus):
        return [(Path(corpus).expanduser().resolve().name or "corpus", corpus, Fraction(1))]
    return None


def check_prepared(corpus: str, mix: str, tokenizer: str) -> dict | None:
    """Before launch: the prepared sources exist, are complete and share one tokenizer (also
    ``data.tokenizer``'s when one is given); returns the first index's settings (None for a
    raw corpus). DataError names the sources that disagree."""
    entries = mix_entries(corpus, mix)
    if entries is None:
        return None
    field = "data.mix" if mix else "data.corpus"
    settings = {name: read_index(where, f"{field} '{name}'")["settings"]
                for name, where, _ in entries}
    first, *rest = entries
    for name, where, _ in rest:
        if settings[name]["tokenizer_sha256"] != settings[first[0]]["tokenizer_sha256"]:
            raise DataError(f"{field}: sources '{first[0]}' ({first[1]}) and '{name}' ({where}) "
                            "were prepared with different tokenizers; prepare them again with "
                            "the same --tokenizer")
    if tokenizer != "bpe":
        from threefold.data.cache import file_sha256
        path = Path(tokenizer).expanduser()
        if path.is_file() and file_sha256(path) != settings[first[0]]["tokenizer_sha256"]:
            raise DataError(f"data.tokenizer: '{path}' is not the tokenizer source "
                            f"'{first[0]}' ({first[1]}) was prepared with; leave data.tokenizer "
                            "as 'bpe' (the prepared tokenizer.json is used) or prepare the data "
                            "with this tokenizer")
    return settings[first[0]]
