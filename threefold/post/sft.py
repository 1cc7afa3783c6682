"""Supervised fine-tuning on conversations: the ``SFTTask`` the training loop runs.

Data: a JSONL file, one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line (the
built-in ``examples/sft.jsonl`` by default). Each conversation is rendered with the chat
template (``threefold.data.chat``), tokenized, and cut to ``data.seq_len`` tokens (its start is
kept; one left without a trained token is dropped). The loss is the summed cross-entropy of the
assistant tokens only; the loop divides it by the number of assistant tokens in the global
batch (``count``), so every trained token weighs the same whatever the accumulation and
data-parallel degree.

Packing: conversations are packed into rows of ``data.seq_len`` tokens by best-fit decreasing
(longest first, each into the fullest row it still fits), the rest of a row is padding. Every
row carries ``document_ids`` (which conversation a token belongs to; the model keeps attention
inside each) and ``position_ids`` restarting at 0 for each conversation, so a packed
conversation is computed exactly as if it were alone (a test checks it).

Sampling: rows are served epoch after epoch, each epoch in an order that is a pure function of
(seed, epoch) (rows sorted by a BLAKE2b hash), so the batch of a step depends only on
(seed, step): nothing to replay on resume, and each data-parallel rank builds just its slice.
Validation: the conversations of ``val_data``, or else the last ``data.val_fraction`` of the
file (at least one); validation batches take rows in order and fill the end with empty rows
(no trained tokens), so the validation loss is the exact mean over the validation rows (the
first ``train.eval_batches × train.global_batch_size`` of them).

The chat template used is saved as ``chat_template.jinja`` in the output directory.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from threefold.data import DataError
from threefold.data.sampler import rank_rows
from threefold.data import PAD
from threefold.data.chat import (announce, check_messages, encode_conversation,
                                 load_chat_template, read_jsonl)
from threefold.training.task import PretrainTask, Task

IGNORE = -100


def example_path(name: str) -> Path:
    """Path of a built-in example data file (``sft.jsonl``, ``dpo.jsonl``)."""
    return Path(str(resources.files("threefold.post") / "examples" / name))


@dataclass
class SFTOptions:
    """Options of ``threefold sft`` beyond the run configuration (``--sft.KEY VALUE``)."""

    data: str = ""  # JSONL of {"messages": [...]}; "" = the built-in examples
    val_data: str = ""  # validation JSONL; "" = the last data.val_fraction of ``data``
    chat_template: str = "auto"  # auto (tokenizer's, else built-in), builtin, or a .jinja path


# --------------------------------------------------------------------------------------------
# Sampling items (packed rows, preference pairs) epoch after epoch
# --------------------------------------------------------------------------------------------
def fingerprint(arrays, seq_len: int) -> str:
    """A short hash of a data set's token arrays and row length: a sampler's state names it,
    so a resume on other data is refused."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        h.update(a.tobytes())
    return f"{h.hexdigest()}/{int(seq_len)}"


def stack_items(items: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Items with the same fields stacked into one tensor per field (a batch)."""
    return {k: torch.from_numpy(np.stack([it[k] for it in items])) for k in items[0]}


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """A permutation of range(n), a pure function of (seed, epoch): items sorted by a hash
    (independent of numpy's or Python's RNG versions)."""
    def key(i: int) -> bytes:
        return hashlib.blake2b(f"{seed}/{epoch}/{i}".encode(), digest_size=8).digest()

    return sorted(range(n), key=key)


class EpochSampler:
    """Serves ``n`` items as a global batch of ``global_batch_size`` per step.

    Training (``shuffle``): position ``step·G + r`` of the endless stream is item
    ``epoch_order(seed, epoch)[k]`` with ``epoch, k = divmod(position, n)``. Evaluation (not
    ``shuffle``): batch ``k`` holds items ``k·G ...`` in order, then empty items. Subclasses
    give ``item(i)`` and ``empty()`` as dicts of numpy arrays of fixed shapes."""

    def __init__(self, n: int, global_batch_size: int, seed: int, shuffle: bool,
                 fingerprint: str):
        if n < 1:
            raise DataError("no items to sample from")
        self.n, self.global_batch_size, self.seed = n, int(global_batch_size), int(seed)
        self.shuffle, self.fingerprint = shuffle, fingerprint
        self.step = 0  # the step after the last one served
        self._orders: dict[int, list[int]] = {}

    def item(self, i: int) -> dict[str, np.ndarray]:
        """Item ``i`` as arrays."""
        raise NotImplementedError

    def empty(self) -> dict[str, np.ndarray]:
        """An item that contributes nothing (no targets, weight 0)."""
        raise NotImplementedError

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if len(self._orders) > 1:  # a step spans at most two epochs
                self._orders.pop(min(self._orders))
            self._orders[epoch] = epoch_order(self.seed, epoch, self.n)
        return self._orders[epoch]

    def indices(self, step: int, lo: int, hi: int) -> list[int | None]:
        """Items of rows [lo, hi) of the global batch of ``step`` (None: an empty item)."""
        out: list[int | None] = []
        for r in range(lo, hi):
            pos = step * self.global_batch_size + r
            if self.shuffle:
                epoch, k = divmod(pos, self.n)
                out.append(self._order(epoch)[k])
            else:
                out.append(pos if pos < self.n else None)
        return out

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
        """This rank's slice of the global batch of ``step``, stacked into tensors."""
        lo, hi = rank_rows(self.global_batch_size, dp_rank, dp_size)
        if self.shuffle:
            self.step = int(step) + 1
        return stack_items([self.item(i) if i is not None else self.empty()
                            for i in self.indices(step, lo, hi)])

    def state_dict(self) -> dict:
        """Plain values that let the same data continue in the same order."""
        return {"seed": self.seed, "step": self.step, "items": self.n,
                "global_batch_size": self.global_batch_size, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; DataError if it was made for other data or batches."""
        for name in ("items", "global_batch_size", "fingerprint"):
            if state.get(name) != self.state_dict()[name]:
                raise DataError(f"sampler state has {name}={state.get(name)!r} but this run has "
                                f"{self.state_dict()[name]!r}; resume with the same data, "
                                "template and batch settings")
        self.seed, self.step = int(state["seed"]), int(state["step"])


# --------------------------------------------------------------------------------------------
# Packing conversations into rows
# --------------------------------------------------------------------------------------------
def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing bin packing: indices of ``lengths`` grouped into rows whose lengths
    sum to at most ``capacity`` (each length must be <= capacity). Deterministic."""
    free: list[tuple[int, int]] = []  # sorted (space left, row)
    rows: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        k = bisect.bisect_left(free, (lengths[i], -1))  # the fullest row it still fits
        if k == len(free):
            rows.append([i])
            bisect.insort(free, (capacity - lengths[i], len(rows) - 1))
        else:
            space, r = free.pop(k)
            rows[r].append(i)
            bisect.insort(free, (space - lengths[i], r))
    return rows


@dataclass
class Conversation:
    """A tokenized conversation: its ids and, per position, the target (-100: none)."""

    ids: np.ndarray  # int64 (n,)
    labels: np.ndarray  # int64 (n,): labels[t] = ids[t + 1] if that token is trained


def to_conversation(ids: list[int], trained: list[bool], seq_len: int) -> Conversation | None:
    """Cut to ``seq_len`` tokens and shift the trained tokens into targets; None if no
    trained token is left."""
    ids_a = np.asarray(ids[:seq_len], dtype=np.int64)
    mask = np.asarray(trained[:seq_len], dtype=bool)
    labels = np.full_like(ids_a, IGNORE)
    labels[:-1] = np.where(mask[1:], ids_a[1:], IGNORE)  # the last token predicts nothing
    if not (labels != IGNORE).any():
        return None
    return Conversation(ids_a, labels)


class PackedSampler(EpochSampler):
    """Packed rows of conversations: input_ids, labels, document_ids, position_ids."""

    def __init__(self, convs: list[Conversation], seq_len: int, global_batch_size: int,
                 seed: int, pad_id: int, shuffle: bool = True):
        self.convs, self.seq_len, self.pad_id = convs, int(seq_len), int(pad_id)
        self.rows = pack([len(c.ids) for c in convs], self.seq_len)
        super().__init__(len(self.rows), global_batch_size, seed, shuffle,
                         fingerprint((a for c in convs for a in (c.ids, c.labels)), seq_len))

    def empty(self) -> dict[str, np.ndarray]:
        """A row of padding: no targets."""
        t = self.seq_len
        return {"input_ids": np.full(t, self.pad_id, dtype=np.int64),
                "labels": np.full(t, IGNORE, dtype=np.int64),
                "document_ids": np.zeros(t, dtype=np.int64),
                "position_ids": np.arange(t, dtype=np.int64)}

    def item(self, i: int) -> dict[str, np.ndarray]:
        """Row ``i``: its conversations one after another, then padding (its own document)."""
        row = self.empty()
        at = 0
        for doc, c in enumerate(self.rows[i]):
            conv, n = self.convs[c], len(self.convs[c].ids)
            row["input_ids"][at:at + n] = conv.ids
            row["labels"][at:at + n] = conv.labels
            row["document_ids"][at:at + n] = doc
            row["position_ids"][at:at + n] = np.arange(n)
            at += n
        row["document_ids"][at:] = len(self.rows[i])
        row["position_ids"][at:] = np.arange(self.seq_len - at)
        return row

    def fill(self) -> float:
        """Share of row positions holding conversation tokens."""
        return sum(len(c.ids) for c in self.convs) / (len(self.rows) * self.seq_len)


# --------------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------------
def pad_id(tok, eot: int) -> int:
    """The tokenizer's padding token if it has one, else end-of-text (padding is never a
    target, so which id it is does not matter)."""
    for name in (PAD, "<pad>", "<|finetune_right_pad_id|>"):
        if tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    return eot


def split_records(cfg, path: str, val_path: str, default: str) -> tuple[list, list, str]:
    """(train records, validation records, train path) from the options: ``val_path``, or the
    last ``data.val_fraction`` of the records (at least one, and at least one left)."""
    path = path or str(example_path(default))
    recs = read_jsonl(path)
    if val_path:
        return recs, read_jsonl(val_path), path
    if len(recs) < 2:
        raise DataError(f"'{path}' has {len(recs)} record; at least 2 are needed to hold one "
                        "out for validation (or give a validation file)")
    n_val = min(len(recs) - 1, max(1, round(len(recs) * cfg.data.val_fraction)))
    return recs[:-n_val], recs[-n_val:], path


class SFTTask(PretrainTask):
    """Next-token loss on the assistant turns of packed conversations."""

    name = "sft"
    metric_names: tuple[str, ...] = ()
    # its rows are conversations, not the pre-training sources: one validation set
    data_metrics = Task.data_metrics
    val_sets = Task.val_sets
    token_stream = False

    def __init__(self, options: SFTOptions | None = None):
        self.options = options or SFTOptions()
        self.stats: dict = {}

    def _encode(self, records, template, tok, seq_len: int, path: str) -> list[Conversation]:
        convs = []
        for no, rec in records:
            where = f"{path}:{no}"
            msgs = check_messages(rec.get("messages"), where)
            enc = encode_conversation(template, tok, msgs, where)
            self.stats["truncated"] = self.stats.get("truncated", 0) + (len(enc.ids) > seq_len)
            conv = to_conversation(enc.ids, enc.trained, seq_len)
            if conv is None:
                self.stats["dropped"] = self.stats.get("dropped", 0) + 1
            else:
                convs.append(conv)
        if not convs:
            raise DataError(f"'{path}': no conversation has an assistant token within "
                            f"data.seq_len={seq_len}; raise data.seq_len")
        return convs

    def samplers(self, cfg, data) -> tuple[PackedSampler, PackedSampler]:
        """Packed training rows (shuffled per epoch) and validation rows (in order)."""
        o, t, seq_len = self.options, cfg.train, cfg.data.seq_len
        template = load_chat_template(data.tokenizer_path, data.tokenizer, o.chat_template)
        train_recs, val_recs, path = split_records(cfg, o.data, o.val_data, "sft.jsonl")
        self.template, self.stats = template, {"template": template.source, "data": path}
        train = self._encode(train_recs, template, data.tokenizer, seq_len, path)
        val = self._encode(val_recs, template, data.tokenizer, seq_len, o.val_data or path)
        pad = pad_id(data.tokenizer, data.eot_id)
        tr = PackedSampler(train, seq_len, t.global_batch_size, t.seed, pad, shuffle=True)
        va = PackedSampler(val, seq_len, t.global_batch_size, t.seed, pad, shuffle=False)
        self.stats.update(conversations=len(train), val_conversations=len(val), rows=tr.n,
                          fill=tr.fill())
        return tr, va

    def setup(self, run) -> None:
        """Save the chat template into the run directory and say what is being trained on
        (writer rank only)."""
        s = self.stats
        announce(run, self.template,
                 f"sft: {s['conversations']} conversations ({s['val_conversations']} held out) "
                 f"from {s['data']}, template {s['template']}, packed into {s['rows']} rows of "
                 f"{run.cfg.data.seq_len} tokens ({s['fill']:.0%} filled)", s,
                 "no assistant token left")
