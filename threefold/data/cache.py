"""On-disk cache helpers: fingerprints, atomic writes and a build lock.

Every cache entry is written to a temporary file in the same directory and moved into place with
``os.replace``, which is atomic on POSIX and Windows: a crash leaves either the old state or the
complete new file, never a half-written file that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Iterator


def fingerprint(*parts: object) -> str:
    """A short stable hash of JSON-able ``parts``, used to name cache entries."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def file_sha256(path: Path, into=None) -> str:
    """Hex SHA-256 of a file's bytes, read 1 MiB at a time (``into``: a hashlib object to
    update instead of a new one; its digest so far is returned)."""
    h = into if into is not None else hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@contextmanager
def atomic_open(path: Path, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; on success it replaces ``path``.

    On any exception the temporary file is deleted and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        kwargs = {} if "b" in mode else {"encoding": "utf-8"}
        with os.fdopen(fd, mode, **kwargs) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())  # the data must be on disk before the name points at it
        os.chmod(tmp, 0o644)  # mkstemp makes files private; a shared cache must be readable
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock named after ``path`` while its cache entry is checked or built.

    Several ranks of one job call ``prepare_data`` at once; the lock makes one of them build the
    entry while the others wait and then find it, so every rank loads the very same files.
    Without ``fcntl`` (Windows) it does nothing: writes stay atomic, only work may be repeated.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
