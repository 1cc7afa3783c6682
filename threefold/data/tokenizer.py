"""Tokenizers: train a byte-level BPE (cached) or load a Hugging Face tokenizer.json.

The BPE follows GPT-2's byte-level scheme (Radford et al., 2019, "Language Models are
Unsupervised Multitask Learners", §2.2): text is split with GPT-2's pre-tokenization regex, every
byte is mapped to a printable character, and merges are learned on top of all 256 bytes, so any
text encodes without an unknown token and decodes back exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from threefold.config import DataConfig
from threefold.data.cache import atomic_open, build_lock, fingerprint
from threefold.data.corpus import MB, Corpus
from threefold.data.errors import DataError

EOT = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOT, PAD]  # ids 0 and 1 in a trained BPE
# End-of-text names used by common published tokenizers, tried in order on a loaded one.
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")

# Bump when anything that changes the trained tokenizer changes: the cache key includes it.
BPE_VERSION = 1
# The BPE is trained on at most this much text, spread evenly over the corpus's documents, which
# keeps training to a few seconds on 2 cores; the whole corpus is still tokenized with it.
BPE_TRAIN_MB = 8.0


def use_all_cores() -> None:
    """Let tokenizers' Rust thread pool use every core this process may run on.

    On our 2-core machines the pool started with a single thread unless RAYON_NUM_THREADS was
    set, which halved encoding speed. This only takes effect before the pool's first use, and an
    explicit user setting wins.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("RAYON_NUM_THREADS", str(cores or 1))


def training_sample(docs: list[str], budget_bytes: int) -> list[str]:
    """Every k-th document, k chosen so the sample is about ``budget_bytes`` of text.

    Striding rather than taking a prefix keeps the sample representative of a sorted corpus.
    """
    total = sum(len(d) for d in docs)  # characters: close enough to bytes to pick a stride
    stride = max(1, -(-total // max(budget_bytes, 1)))
    sample, used = [], 0
    for doc in docs[::stride]:
        if used >= budget_bytes:
            break
        sample.append(doc[: budget_bytes - used])
        used += len(sample[-1])
    return sample


def train_bpe(docs: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` entries (fewer if the text has few pairs)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise DataError(f"data.vocab_size: {vocab_size} is too small for a byte-level BPE; use "
                        f"at least {256 + len(SPECIAL_TOKENS)}")
    use_all_cores()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a Hugging Face ``tokenizer.json``; DataError if it is missing or not valid."""
    path = Path(path).expanduser()
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DataError(f"tokenizer file '{path}' {what}; set data.tokenizer to a tokenizer.json "
                        "path or to 'bpe' to train one")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for unreadable or invalid JSON
        reason = (str(e).strip().splitlines() or ["unknown error"])[0]
        raise DataError(f"tokenizer file '{path}' is not a valid tokenizer.json ({reason}); point "
                        "data.tokenizer at a Hugging Face tokenizer.json or use 'bpe'") from None


def eot_id(tok: Tokenizer, where: str | Path = "tokenizer",
           missing_ok: bool = False) -> int | None:
    """Id of the end-of-text token that separates documents in the token stream (None for a
    tokenizer without one when ``missing_ok``: generation then stops on other tokens)."""
    for name in EOT_NAMES:
        tid = tok.token_to_id(name)
        if tid is not None:
            return tid
    if missing_ok:
        return None
    raise DataError(f"tokenizer '{where}' has no end-of-text token (looked for "
                    f"{', '.join(EOT_NAMES)}); add one to it or use data.tokenizer = 'bpe'")


def cache_root(cfg: DataConfig) -> Path:
    """The cache directory, with ``~`` expanded."""
    return Path(cfg.cache_dir).expanduser()


def get_tokenizer(cfg: DataConfig, corpus: Corpus | None) -> tuple[Tokenizer, Path]:
    """The tokenizer ``cfg`` asks for and the path of its tokenizer.json.

    A BPE is trained once per (corpus digest, vocab size, training cap, algorithm version) and
    cached as ``<cache_dir>/tokenizers/bpe-<fingerprint>.json``; the corpus digest already
    reflects the size cap, since it hashes exactly the text that was read. It is always loaded
    back from that file so that every rank, and every later run, uses the identical tokenizer.
    ``corpus`` may be None for a tokenizer.json (nothing is trained).
    """
    if cfg.tokenizer != "bpe":
        path = Path(cfg.tokenizer).expanduser().resolve()
        return load_tokenizer(path), path
    key = fingerprint("bpe", BPE_VERSION, corpus.digest, cfg.vocab_size, BPE_TRAIN_MB)
    path = cache_root(cfg) / "tokenizers" / f"bpe-{key}.json"
    with build_lock(path):
        if path.is_file():
            try:
                return load_tokenizer(path), path
            except DataError:
                pass  # a damaged cache entry (atomic writes make this rare): train it again
        tok = train_bpe(training_sample(corpus.docs, int(BPE_TRAIN_MB * MB)), cfg.vocab_size)
        with atomic_open(path, "w") as fh:
            fh.write(tok.to_str())
        return load_tokenizer(path), path
