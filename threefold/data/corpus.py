"""Reading a training corpus from local files; nothing is ever downloaded.

Sources (``DataConfig.corpus``):
- ``"stdlib"``: the ``.py`` sources of the running interpreter's standard library, skipping
  ``site-packages`` and the test suites (large and repetitive), in sorted walk order;
- a ``.jsonl`` file: one record per line, either a JSON string or an object whose
  ``DataConfig.text_key`` field holds the text;
- any other file: one plain-text document;
- a directory: every ``.txt``, ``.md``, ``.py`` and ``.jsonl`` file below it, in sorted order
  (hidden directories skipped).

At most ``max_corpus_mb`` MB (1 MB = 10^6 bytes of UTF-8 text) are read; the last document is cut
to fit. Undecodable bytes become U+FFFD, so reading is deterministic for any input.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from threefold.config import DataConfig
from threefold.data.errors import DataError

MB = 1_000_000
DIR_SUFFIXES = (".txt", ".md", ".py", ".jsonl")
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class Corpus:
    """The documents read from one source, with a digest of exactly the text kept."""

    docs: list[str]
    name: str  # a human-readable description of the source, for messages and metadata
    digest: str  # SHA-256 of the documents: changes with the source's content and the size cap
    nbytes: int  # UTF-8 bytes kept


class _Collector:
    """Keeps documents until the byte budget is spent, hashing exactly what it keeps."""

    def __init__(self, budget: int):
        self.left = budget
        self.docs: list[str] = []
        self.nbytes = 0
        self._hash = hashlib.sha256()

    @property
    def full(self) -> bool:
        """Whether the budget is spent."""
        return self.left <= 0

    def add(self, text: str) -> None:
        """Keep ``text``, cut to what is left of the budget."""
        if not text or self.full:
            return
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates are legal in JSON strings, not in UTF-8
            raw = text.encode("utf-8", "replace")
            text = raw.decode("utf-8")
        if len(raw) > self.left:
            text = raw[: self.left].decode("utf-8", "ignore")  # drops a character cut in half
            raw = text.encode("utf-8")
            if not text:  # not even one character fits: the budget is spent
                self.left = 0
                return
        self.docs.append(text)
        self.left -= len(raw)
        self.nbytes += len(raw)
        # Length-prefixed, so ["ab", "c"] and ["a", "bc"] hash differently.
        self._hash.update(len(raw).to_bytes(8, "little"))
        self._hash.update(raw)

    def digest(self) -> str:
        """Hex SHA-256 of the documents kept so far."""
        return self._hash.hexdigest()


def _walk(root: Path, suffixes: tuple[str, ...], skip: set[str]) -> list[Path]:
    """Files under ``root`` with one of ``suffixes``, sorted by their path below ``root``."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".")]
        found += [Path(folder) / name for name in files if name.endswith(suffixes)]
    # Sorting by path components puts a/b.txt before a_c.txt, as a file browser would.
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def _read_text(path: Path, out: _Collector) -> None:
    try:
        with open(path, "rb") as fh:
            data = fh.read(out.left)  # never more than the budget, however large the file
    except OSError as e:
        raise DataError(f"cannot read corpus file '{path}': {e.strerror or e}") from None
    out.add(data.decode("utf-8", "replace"))


def _read_jsonl(path: Path, key: str, out: _Collector) -> None:
    try:
        fh = open(path, encoding="utf-8", errors="replace")
    except OSError as e:
        raise DataError(f"cannot read corpus file '{path}': {e.strerror or e}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if out.full:
                return
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}); a .jsonl corpus needs "
                                "one JSON record per line") from None
            if isinstance(record, dict):
                if key not in record:
                    fields = ", ".join(map(str, list(record)[:8])) or "none"
                    raise DataError(f"{path}:{lineno}: record has no '{key}' field (fields: "
                                    f"{fields}); set data.text_key to the field holding the text")
                record = record[key]
            if not isinstance(record, str):
                raise DataError(f"{path}:{lineno}: expected text (a string, or an object with a "
                                f"'{key}' string), got {type(record).__name__}")
            out.add(record)


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def sample_corpus(path: Path, kb: int = 160) -> Path:
    """Write a small deterministic corpus to ``path``: the first ``kb`` KB of a few standard
    library modules (the tests' and benchmarks' data: the same text on every machine with the
    same Python). Returns ``path``."""
    parts, size = [], 0
    for name in ("argparse.py", "difflib.py", "textwrap.py", "fractions.py", "heapq.py"):
        text = (stdlib_root() / name).read_text(encoding="utf-8")
        parts.append(text)
        size += len(text)
        if size > kb * 1024:
            break
    path.write_text("\n\n".join(parts)[: kb * 1024], encoding="utf-8")
    return path


def read_corpus(cfg: DataConfig) -> Corpus:
    """Read the documents named by ``cfg.corpus``, at most ``cfg.max_corpus_mb`` MB of text."""
    if cfg.max_corpus_mb <= 0:
        raise DataError(f"data.max_corpus_mb: must be positive, got {cfg.max_corpus_mb}")
    if cfg.corpus == "stdlib":
        root = stdlib_root()
        name = f"stdlib ({root}, Python {platform.python_version()})"
        files = _walk(root, (".py",), _STDLIB_SKIP)
    else:
        root = Path(cfg.corpus).expanduser()
        name = str(root)
        if not root.exists():
            raise DataError(f"corpus '{root}' does not exist; set data.corpus to a text file, "
                            "a .jsonl file, a directory, or 'stdlib'")
        files = _walk(root, DIR_SUFFIXES, set()) if root.is_dir() else [root]
    out = _Collector(int(cfg.max_corpus_mb * MB))
    seen = 0
    for path in files:
        if out.full:
            break
        seen += 1
        if path.suffix == ".jsonl":
            _read_jsonl(path, cfg.text_key, out)
        else:
            _read_text(path, out)
    if seen == 0:
        raise DataError(f"corpus directory '{root}' holds no {', '.join(DIR_SUFFIXES)} files")
    if not out.docs:
        raise DataError(f"corpus '{name}' is empty: no text was found in it")
    return Corpus(docs=out.docs, name=name, digest=out.digest(), nbytes=out.nbytes)
