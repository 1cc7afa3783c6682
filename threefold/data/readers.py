"""Streaming readers for ``threefold data prepare``: local files only, one record at a time.

An input is a file or a Hugging Face dataset saved with ``save_to_disk`` (a directory holding
``dataset_info.json`` or ``dataset_dict.json``). Formats, by name:

- ``.txt``, ``.md``, ``.text`` (and any other explicitly named file): the whole file is one
  document; undecodable bytes become U+FFFD and the file is reported as a bad record (line of
  the first bad byte), the document is kept;
- ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``: one record per line, a JSON string or an object
  whose ``text_key`` field is a string; an undecodable or malformed line is skipped and
  reported by line number;
- ``.parquet``, ``.arrow`` (IPC file or stream format): the ``text_key`` column, row by row;
  a null value is skipped and reported by row number (1-based);
- a saved dataset: its ``text_key`` column, split by split in sorted order for a DatasetDict.

A missing ``text_key`` (column, or field of a JSON object) raises DataError naming the file and
the field. A directory that is not a saved dataset is read as every supported file below it,
in sorted order (hidden entries skipped); saved datasets below it are read whole.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Iterator, NamedTuple

from threefold.data.cache import file_sha256
from threefold.data.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
TABLE_SUFFIXES = (".parquet", ".arrow")
DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
_BATCH_ROWS = 1024


class Record(NamedTuple):
    """One record of an input: its text, or None and why it was skipped."""

    where: int  # line (text, JSON lines) or row (tables) number, 1-based
    text: str | None
    problem: str | None = None  # set for a bad record; the text is None unless it was kept


def _suffix(path: Path) -> str:
    name = path.name.lower()
    for suffix in JSONL_SUFFIXES + TABLE_SUFFIXES + TEXT_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    return ""


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and any((path / m).is_file() for m in DATASET_MARKERS[:2])


def list_inputs(sources: list[str | Path]) -> list[Path]:
    """Every input the sources name, resolved, in order (each directory's inputs sorted)."""
    out: list[Path] = []
    for src in sources:
        path = Path(src).expanduser().resolve()
        if not path.exists():
            raise DataError(f"source '{src}' does not exist")
        if path.is_file() or is_saved_dataset(path):
            out.append(path)
            continue
        found = []
        for root, dirs, files in os.walk(path):
            rootp = Path(root)
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for d in list(dirs):
                if is_saved_dataset(rootp / d):
                    found.append(rootp / d)
                    dirs.remove(d)
            found += [rootp / f for f in files if not f.startswith(".") and _suffix(rootp / f)]
        if not found:
            raise DataError(f"source directory '{src}' holds no supported input (text, "
                            f"{', '.join(JSONL_SUFFIXES + TABLE_SUFFIXES)} or a saved dataset)")
        out += sorted(found)
    if len(set(out)) != len(out):
        raise DataError("an input is named more than once among the sources")
    return out


def input_digest(path: Path) -> tuple[str, int]:
    """SHA-256 of an input's bytes (a saved dataset: of its files' names and bytes) and size."""
    if not path.is_dir():
        return file_sha256(path), path.stat().st_size
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0")
        file_sha256(f, into=h)
    return h.hexdigest(), input_size(path)


def input_size(path: Path) -> int:
    """Bytes of an input on disk (all files of a saved dataset)."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def _open_binary(path: Path, suffix: str):
    if suffix == ".jsonl.gz":
        return gzip.open(path, "rb")
    if suffix == ".jsonl.zst":
        import zstandard

        raw = open(path, "rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")


def _json_text(path: Path, line: int, obj: object, key: str) -> Record:
    if isinstance(obj, str):
        return Record(line, obj)
    if not isinstance(obj, dict):
        return Record(line, None, f"a JSON {type(obj).__name__}, not a string or an object")
    if key not in obj:
        raise DataError(f"{path}:{line}: the record has no text field '{key}' (fields: "
                        f"{', '.join(sorted(obj)[:8]) or 'none'}); pass --text-key FIELD")
    if not isinstance(obj[key], str):
        return Record(line, None, f"field '{key}' is {type(obj[key]).__name__}, not a string")
    return Record(line, obj[key])


def read_jsonl(path: Path, key: str) -> Iterator[Record]:
    """Records of a JSON-lines file (plain, gzip or zstandard), one per non-blank line."""
    with _open_binary(path, _suffix(path)) as fh:
        for line, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield Record(line, None, f"undecodable UTF-8 at byte {e.start}")
                continue
            except ValueError as e:
                yield Record(line, None, f"malformed JSON ({e.msg} at column {e.colno})")
                continue
            yield _json_text(path, line, obj, key)


def read_text(path: Path) -> Iterator[Record]:
    """A text file as one document."""
    raw = path.read_bytes()
    try:
        yield Record(1, raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        yield Record(line, raw.decode("utf-8", "replace"),
                     f"undecodable UTF-8 (byte {e.start}); kept with U+FFFD replacements")


def _column_batches(path: Path, key: str, names: list[str], batches) -> Iterator[Record]:
    if key not in names:
        raise DataError(f"{path}: no text field '{key}' (columns: {', '.join(names[:8])}); "
                        "pass --text-key FIELD")
    row = 0
    for batch in batches:
        for value in batch.column(batch.schema.get_field_index(key)).to_pylist():
            row += 1
            if isinstance(value, str):
                yield Record(row, value)
            else:
                yield Record(row, None, f"field '{key}' is {type(value).__name__}, not a string")


def read_parquet(path: Path, key: str) -> Iterator[Record]:
    """The ``key`` column of a Parquet file, a batch of rows at a time."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    batches = pf.iter_batches(batch_size=_BATCH_ROWS, columns=[key]) if key in names else []
    yield from _column_batches(path, key, names, batches)


def read_arrow(path: Path, key: str) -> Iterator[Record]:
    """The ``key`` column of an Arrow IPC file (file or stream format), memory-mapped."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        yield from _column_batches(path, key, reader.schema.names, batches)


def read_saved_dataset(path: Path, key: str) -> Iterator[Record]:
    """The ``key`` column of a dataset saved with ``save_to_disk`` (memory-mapped by datasets)."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    splits = [loaded[s] for s in sorted(loaded)] if isinstance(loaded, datasets.DatasetDict) \
        else [loaded]
    row = 0
    for ds in splits:
        table = ds.with_format("arrow")
        for batch in table.iter(batch_size=_BATCH_ROWS):
            for rec in _column_batches(path, key, ds.column_names, [batch]):
                row += 1
                yield rec._replace(where=row)


def read_records(path: Path, key: str) -> Iterator[Record]:
    """The records of one input, whatever its format."""
    if is_saved_dataset(path):
        return read_saved_dataset(path, key)
    suffix = _suffix(path)
    if suffix in JSONL_SUFFIXES:
        return read_jsonl(path, key)
    if suffix == ".parquet":
        return read_parquet(path, key)
    if suffix == ".arrow":
        return read_arrow(path, key)
    return read_text(path)
