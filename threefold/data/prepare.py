"""``threefold data prepare SOURCES... --out DIR``: tokenize local corpora into token shards.

Nothing is downloaded: the inputs are local files read by ``threefold.data.readers``. The output
directory holds

- ``tokenizer.json``: the tokenizer used (the one given with ``--tokenizer``, copied, or a
  byte-level BPE trained on a sample of the inputs: the leading documents of every input, an
  equal share of ``--sample-mb`` each);
- ``shard-NNNNNN.bin``: token ids (uint16 when the vocabulary fits, else uint32), each document's
  ids followed by the end-of-text id, the same stream ``threefold.data.tokens`` writes;
- ``shard-NNNNNN.ends``: uint64, the end offset (exclusive) of each document in its shard;
- ``index.json``: format version, tokenizer digest and vocabulary size, dtype, end-of-text id,
  the shards (tokens, documents, SHA-256), the finished inputs (SHA-256, bytes, documents,
  tokens, bad records with up to 20 examples each by line or row) and, when the run is
  complete, the sources and their combined digest.

A shard never spans two inputs and is cut at document boundaries once it holds
``--shard-tokens`` tokens (a longer document gets a shard of its own). Every shard is written to
a temporary file, fsynced and renamed; ``index.json`` is replaced atomically after each shard.
So a crash, an interrupt or a failed write leaves a directory whose index lists only complete
shards. Resume works at input granularity: rerunning the same command keeps the inputs the
index marks finished (after checking their digests), deletes the shards of an unfinished input
and tokenizes it again from its start. The output is identical for any ``--workers`` and after
any number of interruptions.

Memory stays bounded: records are streamed, grouped into batches of about ``--batch-mb`` MB of
text and encoded by a process pool with at most ``2 * workers`` batches in flight.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from collections import deque
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from threefold.data.cache import atomic_open, file_sha256
from threefold.data.corpus import MB
from threefold.data.errors import DataError
from threefold.data.readers import input_digest, input_size, list_inputs, read_records
from threefold.data.tokenizer import eot_id, load_tokenizer, train_bpe, use_all_cores
from threefold.data.tokens import token_dtype

FORMAT_VERSION = 1
MAX_EXAMPLES = 20  # bad records kept by line in index.json, per input


@dataclass
class Options:
    """What ``threefold data prepare`` was asked to do."""

    sources: list[str]
    out: str
    tokenizer: str | None = None  # a tokenizer.json; None trains a BPE on a sample
    vocab_size: int = 32768
    text_key: str = "text"
    workers: int = 1
    shard_tokens: int = 100_000_000
    batch_mb: float = 4.0
    sample_mb: float = 8.0
    quiet: bool = False


def _write_bytes(fh, data: bytes) -> None:
    """Every output byte goes through here: the test hook for a failed write (a full disk)."""
    fh.write(data)


# -- encoding (runs in the pool's workers, or in this process for one worker) ------------------

_WORKER: dict = {}


def _init_worker(tok_path: str, dtype: str, eot: int, threads: str | None) -> None:
    if threads:
        os.environ["RAYON_NUM_THREADS"] = threads
    use_all_cores()
    tok = load_tokenizer(tok_path)
    tok.encode_special_tokens = True  # "<|endoftext|>" inside a document stays text
    _WORKER.update(tok=tok, dtype=np.dtype(dtype), eot=eot)


def _encode(docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``docs``, each followed by end-of-text, and each document's length."""
    tok, dtype, eot = _WORKER["tok"], _WORKER["dtype"], _WORKER["eot"]
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    encodings = encode(docs, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) + 1 for e in encodings), np.int64, len(encodings))
    ids = np.empty(int(lengths.sum()), dtype=np.int64)
    pos = 0
    for enc, n in zip(encodings, lengths):
        ids[pos : pos + n - 1] = enc.ids
        ids[pos + n - 1] = eot
        pos += n
    if ids.size and ids.max() > np.iinfo(dtype).max:
        raise DataError(f"token id {ids.max()} does not fit {dtype}")
    return ids.astype(dtype), lengths


def _bounded_map(pool, items, depth: int):
    """``pool`` applied to ``items`` in order, with at most ``depth`` results outstanding."""
    if pool is None:
        yield from map(_encode, items)
        return
    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(_encode, (item,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# -- shards and the index ----------------------------------------------------------------------

def _write_failed(out: Path, what: str, err: OSError, index: dict) -> DataError:
    return DataError(f"writing {what} failed ({err.strerror or err}); the "
                     f"{len(index['shards'])} shards listed in {out / 'index.json'} are complete "
                     "and valid: free space and rerun the same command to continue")


class _Shard:
    """One shard being written: a temporary file, fsynced and renamed by ``finish``."""

    def __init__(self, out: Path, number: int, index: dict):
        self.out, self.index, self.name = out, index, f"shard-{number:06d}"
        fd, self.tmp = tempfile.mkstemp(dir=out, prefix=f".{self.name}.", suffix=".tmp")
        self.fh = os.fdopen(fd, "wb")
        self.hash, self.tokens, self.ends = hashlib.sha256(), 0, []

    def add(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        data = ids.tobytes()
        try:
            _write_bytes(self.fh, data)
        except OSError as e:
            self.abort()
            raise _write_failed(self.out, self.name + ".bin", e, self.index) from e
        self.hash.update(data)
        self.ends.append(self.tokens + np.cumsum(lengths, dtype=np.uint64))
        self.tokens += int(lengths.sum())

    def finish(self, source: int) -> dict:
        ends = np.concatenate(self.ends).astype("<u8")
        try:
            with atomic_open(self.out / f"{self.name}.ends", "wb") as fh:
                _write_bytes(fh, ends.tobytes())
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()
            os.chmod(self.tmp, 0o644)
            os.replace(self.tmp, self.out / f"{self.name}.bin")
        except OSError as e:
            self.abort()
            raise _write_failed(self.out, self.name, e, self.index) from e
        return {"name": self.name, "tokens": self.tokens, "documents": len(ends),
                "sha256": self.hash.hexdigest(), "source": source}

    def abort(self) -> None:
        with suppress(OSError):
            self.fh.close()
        with suppress(FileNotFoundError):
            os.unlink(self.tmp)


def _save_index(out: Path, index: dict) -> None:
    try:
        with atomic_open(out / "index.json", "w") as fh:
            fh.write(json.dumps(index, indent=1))
    except OSError as e:
        raise _write_failed(out, "index.json", e, index) from e


def _trim(out: Path, index: dict) -> None:
    """Drop the shards of unfinished inputs, and any file the index does not list."""
    done = {f["input"] for f in index["files"].values()}
    index["shards"] = [s for s in index["shards"] if s["source"] in done]
    keep = {f"{s['name']}{ext}" for s in index["shards"] for ext in (".bin", ".ends")}
    for p in list(out.glob("shard-*")) + list(out.glob(".shard-*")):
        if p.name not in keep:
            p.unlink()


def verify(out: str | Path) -> dict:
    """Check every shard ``index.json`` lists (length, SHA-256, document ends); the index."""
    out = Path(out)
    index = json.loads((out / "index.json").read_text())
    size = np.dtype(index["settings"]["dtype"]).itemsize
    for s in index["shards"]:
        data = (out / f"{s['name']}.bin").read_bytes()
        ends = np.fromfile(out / f"{s['name']}.ends", dtype="<u8")
        if len(data) != s["tokens"] * size or hashlib.sha256(data).hexdigest() != s["sha256"]:
            raise DataError(f"{out / s['name']}.bin does not match index.json")
        if len(ends) != s["documents"] or (len(ends) and int(ends[-1]) != s["tokens"]):
            raise DataError(f"{out / s['name']}.ends does not match index.json")
    return index


# -- the tokenizer -----------------------------------------------------------------------------

def _sample(inputs: list[Path], key: str, budget: int) -> list[str]:
    """The leading documents of every input, up to an equal share of ``budget`` characters."""
    share, docs = max(1, budget // len(inputs)), []
    for path in inputs:
        used = 0
        for rec in read_records(path, key):
            if rec.text:
                docs.append(rec.text[: share - used])
                used += len(docs[-1])
            if used >= share:
                break
    return docs


def _tokenizer(opts: Options, out: Path, inputs: list[Path]) -> tuple[Path, str]:
    """out/tokenizer.json (kept from an earlier run, copied, or trained) and how it was made."""
    path = out / "tokenizer.json"
    made = f"file {file_sha256(Path(opts.tokenizer))}" if opts.tokenizer else \
        f"bpe vocab_size={opts.vocab_size} sample_mb={opts.sample_mb}"
    if path.is_file():
        return path, made
    if opts.tokenizer:
        load_tokenizer(opts.tokenizer)  # a clear error for a bad file
        text = Path(opts.tokenizer).read_text()
    else:
        text = train_bpe(_sample(inputs, opts.text_key, int(opts.sample_mb * MB)),
                         opts.vocab_size).to_str()
    with atomic_open(path, "w") as fh:
        fh.write(text)
    return path, made


# -- the run -----------------------------------------------------------------------------------

@dataclass
class _Input:
    """What one input gave: documents, tokens and bad records."""

    documents: int = 0
    tokens: int = 0
    bad: int = 0
    shown: int = 0  # bytes the progress bar has been advanced by
    examples: list[str] = field(default_factory=list)


def _batches(path: Path, key: str, stats: _Input, batch_chars: int, bar, budget: int):
    """Batches of about ``batch_chars`` characters of ``path``'s documents; counts bad ones."""
    batch, size = [], 0
    for rec in read_records(path, key):
        if rec.problem:
            stats.bad += 1
            if len(stats.examples) < MAX_EXAMPLES:
                stats.examples.append(f"{path}:{rec.where}: {rec.problem}")
        if not rec.text:
            continue
        batch.append(rec.text)
        size += len(rec.text)
        if size >= batch_chars:
            step = min(size, budget - stats.shown)  # the bar counts input bytes on disk
            bar.update(step)
            stats.shown += step
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _one_input(opts: Options, out: Path, index: dict, number: int, path: Path, pool, bar):
    """Tokenize one input into its shards, recording each shard in the index as it finishes."""
    digest, nbytes = input_digest(path)
    stats, shard = _Input(), None
    batches = _batches(path, opts.text_key, stats, int(opts.batch_mb * MB), bar, nbytes)
    try:
        for ids, lengths in _bounded_map(pool, batches, 2 * max(opts.workers, 1)):
            stats.documents += len(lengths)
            stats.tokens += len(ids)
            while len(lengths):
                shard = shard or _Shard(out, len(index["shards"]), index)
                room = opts.shard_tokens - shard.tokens  # whole documents only, at least one
                k = int(np.searchsorted(np.cumsum(lengths), room, side="right"))
                k = max(k, 1) if shard.tokens == 0 else k
                if k:
                    n = int(lengths[:k].sum())
                    shard.add(ids[:n], lengths[:k])
                    ids, lengths = ids[n:], lengths[k:]
                if k == 0 or shard.tokens >= opts.shard_tokens:
                    index["shards"].append(shard.finish(number))
                    _save_index(out, index)
                    shard = None
        if shard is not None:
            index["shards"].append(shard.finish(number))
    except BaseException:  # an interrupt or a bad record: no temporary file is left behind
        if shard is not None:
            shard.abort()
        raise
    index["files"][str(path)] = {"input": number, "sha256": digest, "bytes": nbytes,
                                 "documents": stats.documents, "tokens": stats.tokens,
                                 "bad_records": stats.bad, "bad_examples": stats.examples}
    _save_index(out, index)
    bar.update(nbytes - stats.shown)


def _check_resume(index: dict, settings: dict, inputs: list[Path], out: Path) -> None:
    """DataError unless ``index`` was written by this command on these inputs, unchanged."""
    if index.get("version") != FORMAT_VERSION or index.get("settings") != settings:
        raise DataError(f"{out} was prepared with other settings ({index.get('settings')}); "
                        "use a new --out directory or the same options")
    names = [str(p) for p in inputs]
    for name, done in index["files"].items():
        if done["input"] >= len(names) or names[done["input"]] != name:
            raise DataError(f"{out} was prepared from other sources ({name} is not input "
                            f"{done['input'] + 1} now); use a new --out directory")
        if input_digest(Path(name))[0] != done["sha256"]:
            raise DataError(f"input {name} changed since {out} was started; use a new --out "
                            "directory")


def _start(opts: Options) -> tuple[Path, list[Path], dict, Path]:
    """The output directory, the inputs, the index (new, or trimmed for a resume), tokenizer."""
    out = Path(opts.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    inputs = list_inputs(opts.sources)
    if any(p == out or out in p.parents for p in inputs):
        raise DataError(f"--out {out} is inside the sources; choose another directory")
    tok_path, made = _tokenizer(opts, out, inputs)
    tok = load_tokenizer(tok_path)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    settings = {"tokenizer_sha256": file_sha256(tok_path), "tokenizer_made": made,
                "vocab_size": vocab, "dtype": token_dtype(vocab).name,
                "eot_id": eot_id(tok, tok_path), "text_key": opts.text_key,
                "shard_tokens": opts.shard_tokens}
    try:
        index = json.loads((out / "index.json").read_text())
    except FileNotFoundError:
        index = {"version": FORMAT_VERSION, "settings": settings, "shards": [], "files": {},
                 "complete": False}
    except ValueError:
        raise DataError(f"{out / 'index.json'} is not valid JSON; use a new --out") from None
    _check_resume(index, settings, inputs, out)
    _trim(out, index)
    index["complete"] = False
    return out, inputs, index, tok_path


def _finish(out: Path, inputs: list[Path], index: dict) -> None:
    files = [index["files"][str(p)] for p in inputs]
    index["sources"] = [{"path": str(p), "sha256": f["sha256"], "bytes": f["bytes"]}
                        for p, f in zip(inputs, files)]
    index["source_digest"] = hashlib.sha256(
        "".join(f["sha256"] for f in files).encode()).hexdigest()
    index.update({k: sum(f[k] for f in files) for k in ("documents", "tokens", "bad_records")})
    index["complete"] = True
    _save_index(out, index)


def prepare(opts: Options) -> dict:
    """Run (or continue) ``threefold data prepare``; returns the final index."""
    from tqdm import tqdm

    out, inputs, index, tok_path = _start(opts)
    todo = [(i, p) for i, p in enumerate(inputs) if str(p) not in index["files"]]
    total = sum(input_size(p) for _, p in todo)
    settings = index["settings"]
    init = (str(tok_path), settings["dtype"], settings["eot_id"])
    pool = None
    if opts.workers > 1:
        import multiprocessing as mp

        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        pool = mp.get_context(method).Pool(opts.workers, _init_worker, (*init, "1"))
    else:
        _init_worker(*init, None)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=opts.quiet,
                  dynamic_ncols=True) as bar:
            for number, path in todo:
                _one_input(opts, out, index, number, path, pool, bar)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    _finish(out, inputs, index)
    return index


def _report(index: dict, out: str) -> None:
    print(f"{index['documents']:,} documents, {index['tokens']:,} tokens "
          f"({index['settings']['dtype']}) in {len(index['shards'])} shards in {out}",
          file=sys.stderr)
    if index["bad_records"]:
        print(f"{index['bad_records']:,} bad records (skipped or repaired):", file=sys.stderr)
        examples = [e for f in index["files"].values() for e in f["bad_examples"]]
        for line in examples[:10]:
            print(f"  {line}", file=sys.stderr)
        if len(examples) > 10:
            print(f"  ... all counts and up to {MAX_EXAMPLES} lines per input are in "
                  "index.json", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="threefold data prepare",
                                description="Tokenize local files into token shards (offline, "
                                            "resumable: rerun the same command to continue).")
    p.add_argument("sources", nargs="+", help="files or directories: text, .jsonl(.gz|.zst), "
                   ".parquet, .arrow, or a dataset saved with datasets' save_to_disk")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", help="a tokenizer.json (default: train a byte-level BPE)")
    p.add_argument("--vocab-size", type=int, default=32768, help="BPE vocabulary size")
    p.add_argument("--sample-mb", type=float, default=8.0, help="text the BPE is trained on")
    p.add_argument("--text-key", default="text", help="field or column holding the text")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard")
    p.add_argument("--batch-mb", type=float, default=4.0, help="text per batch sent to a worker")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    return p


def main(argv: list[str]) -> int:
    """`threefold data prepare ...`: exit 0 when done, 2 on bad input or a failed write."""
    if argv[:1] in (["-h"], ["--help"]):  # the one subcommand's usage and options
        return _parser().print_help() or 0
    if not argv or argv[0] != "prepare":
        print("usage: threefold data prepare SOURCES... --out DIR [options] (--help for them)",
              file=sys.stderr)
        return 2
    args = _parser().parse_args(argv[1:])
    opts = Options(**vars(args))
    if opts.workers < 1 or opts.shard_tokens < 1 or opts.batch_mb <= 0:
        print("threefold: error: --workers, --shard-tokens and --batch-mb must be positive",
              file=sys.stderr)
        return 2
    try:
        index = prepare(opts)
    except DataError as e:
        print(f"threefold: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"threefold: interrupted; rerun the same command to continue in {opts.out}",
              file=sys.stderr)
        return 130
    if not opts.quiet:
        _report(index, opts.out)
    return 0
