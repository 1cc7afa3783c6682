"""What a CPU rank holds besides its model, in parts: its *baseline*.

- process: Python, torch and threefold's training code, and the kernels a step loads
  (``plan.calibrate.cpu_baseline_bytes``: measured once per machine, Python and torch);
- tokenizer: the run's tokenizer.json loaded (its vocabulary, merges and added tokens: a
  262,144-token vocabulary is ~100 MB). Measured once per tokenizer file, by its SHA-256, in a
  subprocess that loads it (cached beside the process's measurement); where it cannot be
  measured, ``TOKENIZER_BYTES`` per entry;
- chat template: a task that renders conversations (sft, dpo, reward, grpo) loads the
  template and, for a Jinja one, the jinja2 engine: measured with the tokenizer;
- data: what the data pipeline keeps resident. A task's own records (``TaskData.records``): each
  kept as token ids and labels (int64: ``HELD_BYTES_PER_TOKEN``), at most one token per byte
  of its JSON line (a byte-level tokenizer's bound) and at most ``rows_per_item`` rows of
  ``data.seq_len``, plus ``RECORD_OVERHEAD`` of objects per record. The token stream of a raw
  corpus: its cached token file, every page of which start-up touches (the scan for
  document ends), at most one token per byte of ``data.max_corpus_mb``. Prepared shards: the
  document ends (8 bytes each) and the pages a rank's rows touch over the run, at most the
  shards' files.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from threefold.data.cache import file_sha256
from threefold.data import DataError
from threefold.data.sources import mix_entries, read_index

# bytes a loaded tokenizer holds per vocabulary entry, merge and added token, fitted on
# byte-level BPEs of 50,000 to 262,144 entries (tokenizers 0.22, 2026-12-06): the fallback
# where the file cannot be loaded in a subprocess
TOKENIZER_BYTES = {"vocab": 270, "merges": 125, "added": 260}
HELD_BYTES_PER_TOKEN = 16  # a kept record's ids and labels, int64 each
RECORD_OVERHEAD = 400  # its arrays' and dataclass's objects
PAGE = 4096

_MEASURE = (
    "import sys\n"
    "def rss():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmRSS:'):\n"
    "            return int(line.split()[1]) * 1024\n"
    "from tokenizers import Tokenizer\n"
    "if sys.argv[2]:  # threefold.data imports torch: only where a template is rendered\n"
    "    from threefold.data.chat import (check_messages, encode_conversation,\n"
    "                                     load_chat_template)\n"
    "a = rss()\n"
    "tok = Tokenizer.from_file(sys.argv[1])\n"
    "b = rss()\n"
    "if sys.argv[2]:\n"
    "    t = load_chat_template(sys.argv[1], tok, sys.argv[2])\n"
    "    msgs = [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'yes'}]\n"
    "    encode_conversation(t, tok, check_messages(msgs, 'probe'), 'probe')\n"
    "print(b - a, rss() - b)\n")


@dataclass(frozen=True)
class TaskData:
    """What a task trains on instead of the token stream: its JSONL ``records`` ("": built-in
    ones, too few to count), the chat template it renders them with (None: none), and the
    rows each record becomes (a preference pair: 2)."""

    records: str = ""
    chat: str | None = None
    rows_per_item: int = 1
    rollout_engine: str = "builtin"  # GRPO's: "vllm" holds an engine beside each rank
    engine_kv_bytes: int = 0  # that engine's KV cache
    engine_mode: str = "colocate"  # or "server": the engine in a process of its own
    engine_tp: int = 1  # the server's tensor parallelism (a worker process per shard)
    engine_async: bool = False  # generates while the trainer trains (grpo.max_staleness > 0)


@dataclass(frozen=True)
class Baseline:
    """A CPU rank's bytes besides its model, by part (see the module doc)."""

    process: int = 0
    tokenizer: int = 0
    chat: int = 0
    data: int = 0
    said: dict = field(default_factory=dict)  # {part: how it was found}

    @property
    def total(self) -> int:
        """Every part together."""
        return self.process + self.tokenizer + self.chat + self.data

    def lines(self, gb) -> list[str]:
        """The dry run's line for each part (``gb`` formats bytes)."""
        out = [f"  baseline {gb(self.total)}: what this CPU process holds besides the model"]
        for part, what in (("process", "Python, torch, threefold's step code"),
                           ("tokenizer", self.said.get("tokenizer", "")),
                           ("chat", self.said.get("chat", "")),
                           ("data", self.said.get("data", ""))):
            if getattr(self, part) or part in self.said:
                out.append(f"    {part} {gb(getattr(self, part))}: {what}")
        return out


def tokenizer_counts(path: Path) -> dict[str, int]:
    """{vocab, merges, added} of a tokenizer.json (zeros where the file does not say)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"vocab": 0, "merges": 0, "added": 0}
    model = doc.get("model") or {}
    vocab = model.get("vocab") or {}
    return {"vocab": len(vocab), "merges": len(model.get("merges") or ()),
            "added": len(doc.get("added_tokens") or ())}


def measured_tokenizer(path: Path, chat: str | None, cache: Path) -> tuple[int, int] | None:
    """(tokenizer bytes, chat template bytes) of loading ``path`` (and rendering a probe
    conversation with ``chat``) in a fresh process, measured once per file hash
    (``calibrate.measured_once``, kept in ``cache``'s file); None where it cannot be
    measured."""
    import tokenizers

    from threefold.plan.calibrate import measured_once

    key = f"tokenizer|{sys.executable}|{tokenizers.__version__}|{file_sha256(path)}|{chat}"
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    got = measured_once(key, [sys.executable, "-c", _MEASURE, str(path), chat or ""], env,
                        cache)
    if not got or len(got) < 2:
        return None
    return max(0, got[-2]), max(0, got[-1])


def tokenizer_part(path: Path | None, vocab_size: int, chat: str | None,
                   cache: Path) -> tuple[int, int, dict]:
    """(tokenizer bytes, chat bytes, {part: how}) for the tokenizer at ``path`` (None: a BPE
    not trained yet, of ``vocab_size`` entries)."""
    counts = tokenizer_counts(path) if path else \
        {"vocab": vocab_size, "merges": max(0, vocab_size - 258), "added": 2}
    terms = (f"{counts['vocab']:,} tokens, {counts['merges']:,} merges, "
             f"{counts['added']:,} added tokens")
    got = measured_tokenizer(path, chat, cache) if path else None
    if got is not None:
        said = {"tokenizer": f"{Path(path).name} of {terms} (measured loading it)"}
        tok, chat_bytes = got
    else:
        tok = sum(TOKENIZER_BYTES[k] * counts[k] for k in TOKENIZER_BYTES)
        said = {"tokenizer": f"{terms} × {TOKENIZER_BYTES['vocab']}, "
                             f"{TOKENIZER_BYTES['merges']}, {TOKENIZER_BYTES['added']} bytes"}
        chat_bytes = 0
    if chat is not None:
        said["chat"] = f"chat template '{chat}' loaded and rendered" + \
            (" (measured)" if got is not None else " (not measured)")
    return tok, chat_bytes, said


def records_bytes(path: str, seq_len: int, rows_per_item: int) -> int:
    """Bytes a task keeps of the records in ``path`` (the module doc's bound)."""
    total = 0
    try:
        with open(Path(path).expanduser(), "rb") as f:
            for line in f:
                if line.strip():
                    tokens = min(len(line), rows_per_item * seq_len)
                    total += HELD_BYTES_PER_TOKEN * tokens + RECORD_OVERHEAD
    except OSError:
        return 0
    return total


def corpus_bytes(corpus: str, cap: int) -> int:
    """Bytes of text a raw corpus gives (a file's or a directory's files'), at most ``cap``
    (``data.max_corpus_mb``; 'stdlib' is larger than any cap)."""
    path = Path(corpus).expanduser()
    if corpus == "stdlib" or not path.exists():
        return cap
    total = 0
    for f in [path] if path.is_file() else path.rglob("*"):
        if total >= cap:
            break
        total += f.stat().st_size if f.is_file() else 0
    return min(total, cap)


def stream_bytes(data, rows_read: int, itemsize: int) -> tuple[int, str]:
    """(bytes, how) of the token stream's resident state: a raw corpus's token file whole;
    prepared shards' document ends and the pages ``rows_read`` rows touch."""
    entries = mix_entries(data.corpus, data.mix)
    if entries is None:
        text = corpus_bytes(data.corpus, int(data.max_corpus_mb * 1e6))
        return text * itemsize, (f"the token file's pages, at most one token per byte of the "
                                 f"corpus's {text:,} bytes read")
    ends = pages = files = 0
    per_row = (-(-(data.seq_len + 1) * itemsize // PAGE) + 1) * PAGE
    for _, where, _ in entries:
        try:
            index = read_index(where)
        except DataError:  # the run refuses it; the dry run counts nothing for it
            continue
        size = np.dtype(index["settings"]["dtype"]).itemsize
        for shard in index["shards"]:
            ends += 8 * int(shard["documents"])
            files += int(shard["tokens"]) * size
    pages = min(files, rows_read * per_row)
    return ends + pages, (f"prepared shards: document ends {ends:,} bytes, pages of "
                          f"{rows_read:,} rows read")


def run_tokenizer(cfg) -> Path | None:
    """The tokenizer.json a run of ``cfg`` loads: ``data.tokenizer``, else the one that comes
    with ``checkpoint.init_from``; None for a BPE trained on the corpus."""
    from threefold.weights.model_source import locate_init_from, run_tokenizer_of

    if cfg.data.tokenizer != "bpe":
        return Path(cfg.data.tokenizer).expanduser()
    if cfg.checkpoint.init_from:
        return run_tokenizer_of(locate_init_from(cfg).path)
    return None


def run_baseline(cfg, dp: int, vocab_size: int, threads: int,
                 task: TaskData | None = None) -> Baseline:
    """The baseline of one rank of ``cfg`` (``dp`` data-parallel ranks share the batch; the
    model's ``vocab_size`` sets the token files' width; ``threads`` per rank), by part;
    ``task``: what a post-training task reads instead of the token stream (None: pre-training)."""
    from threefold.plan.calibrate import DEFAULT_PATH, cpu_baseline_bytes

    cache = Path(DEFAULT_PATH).expanduser().with_name("baseline.json")
    tok, chat, said = tokenizer_part(run_tokenizer(cfg), cfg.data.vocab_size,
                                     task.chat if task else None, cache)
    if task is not None:
        data = records_bytes(task.records, cfg.data.seq_len, task.rows_per_item) \
            if task.records else 0
        said["data"] = (f"{Path(task.records).name}'s records kept as token ids and labels "
                        f"(at most a token per byte, {task.rows_per_item} × data.seq_len each)"
                        if task.records else "built-in records")
    else:
        t = cfg.train
        rows = -(-t.global_batch_size // max(1, dp)) * (t.steps + t.eval_batches)
        data, said["data"] = stream_bytes(cfg.data, rows, 2 if vocab_size <= 2**16 else 4)
    return Baseline(cpu_baseline_bytes(threads), tok, chat, data, said)


def heap_note(threshold_mb: float) -> str:
    """One CPU process keeps freed blocks below ``train.host_mmap_threshold_mb`` in its heap
    (threefold.training.hostmem): what it holds then exceeds its live tensors by what the heap
    keeps, which no count of tensors predicts."""
    return (f"one process on a CPU keeps freed blocks below {threshold_mb:g} MiB for reuse "
            "(train.host_mmap_threshold_mb): its resident step peak can exceed the prediction "
            "by what the heap keeps (SmolLM2-135M fine-tuned at seq 2048: +1.4 GiB fully, "
            "+2.4 GiB with LoRA); --train.host_mmap_threshold_mb 1 holds the prediction, "
            "steps run slower")
