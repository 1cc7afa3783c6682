"""Throughput of ``threefold data prepare`` against the tokenizers library on
the same text with the same number of processes, side by side in one run; and the training
loader's cost per step.

    python3 bench/bench_data.py [--mb 1024] [--workers 2]
    python3 bench/bench_data.py --mb 8 --workers 1 --no-datasets   # quick

A JSON-lines corpus of ``--mb`` MB is generated in a temporary directory (``--files`` files,
documents of words drawn from a fixed Zipf-weighted vocabulary of made-up words with a seeded
RNG: the same bytes every run). One byte-level BPE tokenizer.json of ``--vocab-size`` (8192)
is trained on its first ``--sample-mb`` MB with threefold's trainer and given to every side:

- ``threefold``: ``python -m threefold data prepare CORPUS --out OUT --tokenizer T --workers N
  --quiet``; its output is checked with ``threefold.data.prepare.verify``;
- ``tokenizers``: a plain script (this file, ``--reference tokenizers``) that streams the same
  files, parses each line with ``json.loads`` and sends batches of about ``--batch-mb`` MB of
  text to a pool of N processes (no pool for N = 1), each loading the tokenizer once and calling
  its ``encode_batch_fast`` (``encode_batch`` without character offsets, the faster of the two;
  threefold calls the same), with the same Rayon thread setting as threefold (every core for one
  process, one thread per process in a pool); it writes nothing, the workers return only token
  counts: a lower bound on the work any tokenizing pipeline must do;
- ``datasets``: ``load_dataset("json")`` on the same files then ``Dataset.map(batched=True,
  num_proc=N)`` with the same tokenizer and call (when ``datasets`` imports; ``--no-datasets``
  skips it); its time includes the JSON-to-Arrow conversion, part of that route.

Each side runs as a subprocess whose process tree is polled every 50 ms through /proc: the peak
RSS (``VmHWM``) of every process seen, reported for the parent, the largest process, and summed
over all of them (each process's own peak, so an upper bound on the simultaneous total; pages
shared after a fork count in each). Throughput is corpus bytes on disk over wall time. Targets:
threefold / tokenizers throughput >= 0.9; peak RSS < 1 GB in every process and < 2 GB summed.

Loader: the time to draw one batch of the default config (``load_config(None, [])``: global
batch x seq_len) with ``threefold.data.sampler.MixtureSampler`` from the prepared directory, memory
mapped, against the default step's time from README's measured run (4,726 tokens/s at 8 x 256
tokens a step, 0.43 s; ``--step-seconds`` overrides). Target: below 1% of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import print_table, revision  # noqa: E402

MB = 1 << 20
GB = 1 << 30
README_TOKENS_PER_S = 4726.0  # README's default run (2026-12-05)
GOAL_RATIO, GOAL_PROC_RSS, GOAL_SUM_RSS, GOAL_LOADER = 0.9, 1 * GB, 2 * GB, 0.01


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=1024, help="corpus size in MB (2**20 bytes)")
    ap.add_argument("--workers", type=int, default=2, help="processes, every side")
    ap.add_argument("--files", type=int, default=8, help="corpus files")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--sample-mb", type=float, default=4.0, help="text the BPE is trained on")
    ap.add_argument("--batch-mb", type=float, default=4.0, help="text per batch (reference)")
    ap.add_argument("--no-datasets", action="store_true", help="skip datasets.map")
    ap.add_argument("--step-seconds", type=float, default=None,
                    help="the default step's time (default: from README's tokens/s)")
    ap.add_argument("--tmp", default=None, help="parent of the temporary directory")
    ap.add_argument("--reference", choices=("tokenizers", "datasets"), help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# -- the corpus and the tokenizer ---------------------------------------------------------------

def _vocabulary(rng: random.Random, n: int = 30000) -> tuple[list[str], list[float]]:
    """``n`` made-up words and Zipf cumulative weights (rank r has weight 1/r)."""
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = ["".join(rng.choices(letters, k=rng.randint(1, 10))) for _ in range(n)]
    words[:8] = [",", ".", "the", "of", "and", "to", "\n", "in"]
    cum, acc = [], 0.0
    for r in range(1, n + 1):
        acc += 1.0 / r
        cum.append(acc)
    return words, cum


def generate_corpus(directory: Path, mb: float, files: int, seed: int = 0) -> int:
    """JSON-lines files of about ``mb`` MB in total under ``directory``; returns their bytes."""
    rng = random.Random(seed)
    words, cum = _vocabulary(rng)
    directory.mkdir(parents=True, exist_ok=True)
    per_file, total = int(mb * MB / files), 0
    for f in range(files):
        size = 0
        with open(directory / f"part-{f:03d}.jsonl", "w", encoding="utf-8") as fh:
            while size < per_file:
                n = min(int(rng.expovariate(1 / 300)) + 5, 4000)
                text = " ".join(rng.choices(words, cum_weights=cum, k=n))
                line = json.dumps({"text": text, "id": size}) + "\n"
                fh.write(line)
                size += len(line)
        total += size
    return total


def _texts(path: Path):
    """The "text" of each line of a generated JSON-lines file."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            yield json.loads(line)["text"]


def make_tokenizer(corpus: Path, out: Path, vocab_size: int, sample_mb: float) -> Path:
    """A byte-level BPE trained with threefold's trainer on the corpus's leading text."""
    from threefold.data import train_bpe

    docs, used = [], 0
    for path in sorted(corpus.glob("*.jsonl")):
        for text in _texts(path):
            docs.append(text)
            used += len(text)
            if used >= sample_mb * MB / 2:
                break
        if used >= sample_mb * MB:
            break
    out.write_text(train_bpe(docs, vocab_size).to_str())
    return out


# -- measuring a process tree ---------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(c) for c in fh.read().split()]
    except OSError:
        return []


def _hwm_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_measured(cmd: list[str], env: dict | None = None, poll: float = 0.05) -> dict:
    """Run ``cmd``; its wall time, stdout, and the peak RSS of each process in its tree."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        todo = [proc.pid]
        while todo:
            pid = todo.pop()
            hwm = _hwm_bytes(pid)
            if hwm is not None:
                peaks[pid] = max(peaks.get(pid, 0), hwm)
            todo += _children(pid)
        time.sleep(poll)
    out, err = proc.communicate()
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])}... failed ({proc.returncode}): {err[-2000:]}")
    return {"seconds": seconds, "stdout": out, "parent_rss": peaks.get(proc.pid, 0),
            "max_rss": max(peaks.values(), default=0), "sum_rss": sum(peaks.values()),
            "processes": len(peaks)}


# -- the references (run as ``--reference NAME`` in a subprocess) -------------------------------

_TOK: dict = {}


def _ref_init(tok_path: str, threads: str | None) -> None:
    if threads:
        os.environ["RAYON_NUM_THREADS"] = threads
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    tok.encode_special_tokens = True
    _TOK["encode"] = getattr(tok, "encode_batch_fast", tok.encode_batch)


def _ref_encode(texts: list[str]) -> int:
    return sum(len(e.ids) for e in _TOK["encode"](texts, add_special_tokens=False))


def _ref_batches(corpus: Path, batch_chars: int):
    batch, size = [], 0
    for path in sorted(corpus.glob("*.jsonl")):
        for text in _texts(path):
            batch.append(text)
            size += len(text)
            if size >= batch_chars:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def reference_tokenizers(corpus: Path, tok_path: str, workers: int, batch_mb: float) -> dict:
    """Encode every document of ``corpus`` with a pool of ``workers``; token and doc counts."""
    import multiprocessing as mp

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    batches = _ref_batches(corpus, int(batch_mb * MB))
    tokens = docs = 0
    if workers == 1:
        os.environ.setdefault("RAYON_NUM_THREADS", str(cores or 1))
        _ref_init(tok_path, None)
        for b in batches:
            tokens, docs = tokens + _ref_encode(b), docs + len(b)
        return {"tokens": tokens, "documents": docs}
    with mp.get_context("fork").Pool(workers, _ref_init, (tok_path, "1")) as pool:
        pending: deque = deque()
        for b in batches:
            pending.append(pool.apply_async(_ref_encode, (b,)))
            docs += len(b)
            if len(pending) >= 2 * workers:
                tokens += pending.popleft().get()
        tokens += sum(p.get() for p in pending)
    return {"tokens": tokens, "documents": docs}


def _ds_encode(batch: dict) -> dict:
    if "encode" not in _TOK:
        _ref_init(os.environ["BENCH_DATA_TOKENIZER"], os.environ.get("BENCH_DATA_THREADS"))
    return {"ids": [e.ids for e in _TOK["encode"](batch["text"], add_special_tokens=False)]}


def reference_datasets(corpus: Path, tok_path: str, workers: int, cache: Path) -> dict:
    """``load_dataset("json")`` then ``map(num_proc=workers)``; token and document counts."""
    import datasets

    datasets.disable_progress_bars()
    os.environ["BENCH_DATA_TOKENIZER"] = tok_path
    os.environ["BENCH_DATA_THREADS"] = str(os.cpu_count() or 1) if workers == 1 else "1"
    files = [str(p) for p in sorted(corpus.glob("*.jsonl"))]
    ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(cache))
    ds = ds.map(_ds_encode, batched=True, batch_size=1000, num_proc=workers if workers > 1
                else None, remove_columns=ds.column_names)
    import pyarrow.compute as pc

    tokens = pc.sum(pc.list_value_length(ds.data.table.column("ids"))).as_py() or 0
    return {"tokens": tokens, "documents": len(ds)}


# -- the sides ----------------------------------------------------------------------------------

def _side_row(name: str, m: dict, nbytes: int, tokens: int) -> dict:
    return {"side": name, "seconds": m["seconds"], "MB_s": nbytes / MB / m["seconds"],
            "tokens": tokens, "parent_rss_MB": m["parent_rss"] / MB,
            "max_rss_MB": m["max_rss"] / MB, "sum_rss_MB": m["sum_rss"] / MB,
            "processes": m["processes"]}


def run_threefold(corpus: Path, tok: Path, out: Path, workers: int, nbytes: int) -> dict:
    """``threefold data prepare`` in a subprocess; its row (output verified)."""
    from threefold.data.prepare import verify

    cmd = [sys.executable, "-m", "threefold", "data", "prepare", str(corpus), "--out", str(out),
           "--tokenizer", str(tok), "--workers", str(workers), "--quiet"]
    m = run_measured(cmd)
    index = verify(out)
    if not index.get("complete"):
        raise RuntimeError(f"{out}: prepare did not complete")
    row = _side_row("threefold", m, nbytes, index["tokens"] - index["documents"])
    row["documents"] = index["documents"]
    return row


def run_reference(name: str, args, corpus: Path, tok: Path, nbytes: int, tmp: Path) -> dict:
    """A reference side (``tokenizers`` or ``datasets``) in a subprocess; its row."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--reference", name, "--corpus",
           str(corpus), "--tokenizer", str(tok), "--workers", str(args.workers),
           "--batch-mb", str(args.batch_mb), "--tmp", str(tmp)]
    m = run_measured(cmd)
    got = json.loads(m["stdout"].strip().splitlines()[-1])
    row = _side_row(name, m, nbytes, got["tokens"])
    row["documents"] = got["documents"]
    return row


def datasets_available() -> bool:
    """Whether ``datasets`` imports (checked in a subprocess: importing it is slow)."""
    return subprocess.run([sys.executable, "-c", "import datasets"],
                          capture_output=True).returncode == 0


# -- the loader ---------------------------------------------------------------------------------

def loader_cost(prepared: Path, step_seconds: float | None, draws: int = 200) -> dict:
    """Median seconds for the training sampler to draw one default-config batch (every row,
    in epochs) from the ``prepared`` directory, read as training reads it."""
    from threefold.config import load_config
    from threefold.data import MixtureSampler
    from threefold.data.sources import open_prepared

    cfg = load_config(None, [])
    batch, seq_len = cfg.train.global_batch_size, cfg.data.seq_len
    source = open_prepared(prepared, "bench", cfg.data.val_fraction, seq_len)
    sampler = MixtureSampler([source], seq_len, batch, seed=0)
    times = []
    for step in range(draws):
        t0 = time.perf_counter()
        sampler.global_batch(step)
        times.append(time.perf_counter() - t0)
    step_s = step_seconds or batch * seq_len / README_TOKENS_PER_S
    draw = statistics.median(times)
    return {"batch": batch, "seq_len": seq_len, "draw_ms_median": draw * 1e3,
            "draw_ms_max": max(times) * 1e3, "step_s": step_s, "share_of_step": draw / step_s,
            "step_source": "--step-seconds" if step_seconds else
            f"README: {batch}x{seq_len} tokens at {README_TOKENS_PER_S:g} tokens/s",
            "goal": GOAL_LOADER, "meets_goal": draw / step_s < GOAL_LOADER}


# -- the run ------------------------------------------------------------------------------------

def verdicts(rows: list[dict]) -> dict:
    """The targets, met or not: throughput ratio against tokenizers, and threefold's RSS."""
    by = {r["side"]: r for r in rows}
    tf, ref = by["threefold"], by["tokenizers"]
    ratio = tf["MB_s"] / ref["MB_s"]
    out = {"ratio_vs_tokenizers": ratio, "ratio_goal": GOAL_RATIO,
           "ratio_met": ratio >= GOAL_RATIO,
           "max_rss_met": tf["max_rss_MB"] * MB < GOAL_PROC_RSS,
           "sum_rss_met": tf["sum_rss_MB"] * MB < GOAL_SUM_RSS,
           "same_tokens": tf["tokens"] == ref["tokens"]}
    if "datasets" in by:
        out["ratio_vs_datasets"] = tf["MB_s"] / by["datasets"]["MB_s"]
    return out


def run_all(args, tmp: Path) -> dict:
    """Generate the corpus and tokenizer under ``tmp``, run every side, time the loader."""
    corpus = tmp / "corpus"
    t0 = time.perf_counter()
    nbytes = generate_corpus(corpus, args.mb, args.files)
    gen_s = time.perf_counter() - t0
    tok = make_tokenizer(corpus, tmp / "tokenizer.json", args.vocab_size, args.sample_mb)
    rows = [run_threefold(corpus, tok, tmp / "out", args.workers, nbytes),
            run_reference("tokenizers", args, corpus, tok, nbytes, tmp)]
    if not args.no_datasets and datasets_available():
        rows.append(run_reference("datasets", args, corpus, tok, nbytes, tmp))
    loader = loader_cost(tmp / "out", args.step_seconds)
    return {"bytes": nbytes, "generate_s": gen_s, "rows": rows, "verdicts": verdicts(rows),
            "loader": loader}


def print_results(args, res: dict) -> None:
    """The table, one JSON line per side, the targets, and the loader's line."""
    print(f"corpus {res['bytes'] / MB:.1f} MB in {args.files} files (generated in "
          f"{res['generate_s']:.0f} s), {args.workers} worker(s), vocab {args.vocab_size}")
    print_table(res["rows"], width=13)
    for r in res["rows"]:
        print(json.dumps({"benchmark": "data_prepare", "mb": args.mb, "workers": args.workers,
                          **r}))
    v = res["verdicts"]
    mark = {True: "met", False: "NOT met"}
    print(f"threefold / tokenizers throughput: {v['ratio_vs_tokenizers']:.3f} (goal >= "
          f"{GOAL_RATIO}: {mark[v['ratio_met']]}); peak RSS per process < 1 GB: "
          f"{mark[v['max_rss_met']]}; summed < 2 GB: {mark[v['sum_rss_met']]}; "
          f"same token count: {v['same_tokens']}")
    lo = res["loader"]
    print(f"loader: {lo['batch']}x{lo['seq_len']} batch drawn in {lo['draw_ms_median']:.3f} ms "
          f"(median; max {lo['draw_ms_max']:.3f}), step {lo['step_s']:.3f} s ({lo['step_source']})"
          f": {lo['share_of_step']:.4%} of the step (goal < 1%: {mark[lo['meets_goal']]})")
    print(json.dumps({"benchmark": "data_prepare_summary", "mb": args.mb,
                      "workers": args.workers, **v}))
    print(json.dumps({"benchmark": "data_loader", **lo}))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, or (``--reference``) one reference side, printing its counts."""
    args = parse_args(argv)
    if args.reference == "tokenizers":
        got = reference_tokenizers(Path(args.corpus), args.tokenizer, args.workers,
                                   args.batch_mb)
        print(json.dumps(got))
        return 0
    if args.reference == "datasets":
        with tempfile.TemporaryDirectory(dir=args.tmp, prefix="hf-cache-") as cache:
            print(json.dumps(reference_datasets(Path(args.corpus), args.tokenizer,
                                                args.workers, Path(cache))))
        return 0
    print(f"bench_data: {revision()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}")
    tmp = Path(tempfile.mkdtemp(dir=args.tmp, prefix="bench-data-"))
    try:
        print_results(args, run_all(args, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
