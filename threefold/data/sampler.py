"""Deterministic sampling of training sequences from one or more token sources, in epochs.

Sequence ``g = step · global_batch_size + row`` of the run is a pure function of
(seed, step, row): no RNG state, nothing to replay on resume, and a data-parallel rank computes
only the rows it owns.

- **Which source.** The normalised weights become integers W_s over a period D (exact for
  weights with a common denominator up to 2^16, else rounded to 1/65,536). One period is laid
  out by Tijdeman's algorithm for the chairman assignment problem (among the sources whose
  quota is due, the one whose next deadline is earliest); it repeats. After any n sequences,
  each source has had within 1 − 1/(2k − 2) of w_s · n (k ≥ 2 sources): within one sequence of
  its share. Over a window that does not start at 0 two sources stay within one sequence; for
  three or more, no order can keep every window within one for most weights (balanced
  sequences exist only for special proportions), and this one stays within two.
- **Which sequence of that source.** A source of n_train training tokens has
  (n_train − 1) // seq_len samples: sample j is tokens [j·L, j·L + L + 1) (inputs and the labels
  shifted by one). The source's k-th sequence is in epoch k // samples, at position
  k mod samples of that epoch's permutation: a keyed Feistel network over the next even power
  of two, cycle-walked into range, keyed by (seed, source digest, epoch). It is computed per
  lookup and never stored: every sample once per epoch, a new order each epoch.
- **Document masking** (``data.document_mask``): each row also carries ``document_ids`` and
  ``position_ids`` restarting at each document, so attention stays inside documents; the
  label of a document's last token (the next document's first) is not a target.

Validation reads the held-out tail of each source: ``eval_batches`` fixed batches of windows
spread evenly over it.
"""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction

import numpy as np
import torch

from threefold.data.errors import DataError
from threefold.data.sources import TokenSource

PERIOD = 1 << 16  # the longest allocation period (rounding of the weights beyond it)
_M64 = (1 << 64) - 1


def rank_rows(rows: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """The contiguous [lo, hi) share of ``rows`` owned by ``dp_rank``."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    if rows % dp_size:
        raise DataError(f"batch of {rows} sequences does not split evenly over {dp_size} "
                        "data-parallel ranks; make it a multiple of the data-parallel degree")
    per = rows // dp_size
    return dp_rank * per, (dp_rank + 1) * per


def integer_weights(weights: list[Fraction]) -> list[int]:
    """Integers proportional to ``weights``, summing to their period: exact when the
    normalised weights' common denominator is at most ``PERIOD``, else the largest-remainder
    rounding of them to ``PERIOD``; DataError if a source would get no share."""
    total = sum(weights)
    shares = [w / total for w in weights]
    period = math.lcm(*(s.denominator for s in shares))
    if period <= PERIOD:
        return [int(s * period) for s in shares]
    exact = [s * PERIOD for s in shares]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(out)), key=lambda i: out[i] - exact[i])[:PERIOD - sum(out)]:
        out[i] += 1
    if min(out) == 0:
        raise DataError("data.mix: a weight is below 1/65536 of the total; raise it or drop "
                        "the source")
    return out


def allocation(counts: list[int]) -> np.ndarray:
    """One period of source indices, source s appearing ``counts[s]`` times, in Tijdeman's
    order: every prefix of length n gives s within 1 − 1/(2k−2) of n · counts[s] / D."""
    d, k = sum(counts), len(counts)
    m = max(2 * k - 2, 1)
    had = [0] * k
    order = np.empty(d, dtype=np.int32)
    for n in range(1, d + 1):
        best, key = -1, 0
        for s in range(k):
            # due: n·w_s − had_s ≥ 1/m; deadline ∝ (had_s + 1 − 1/m) / w_s, earliest first
            if m * (counts[s] * n - d * had[s]) >= d:
                num = m * (had[s] + 1) - 1
                if best < 0 or num * counts[best] < key * counts[s]:
                    best, key = s, num
        had[best] += 1
        order[n - 1] = best
    return order


def _mix64(x: int) -> int:
    """A 64-bit integer finaliser (splitmix64's): every output bit depends on every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Permutation:
    """A pseudo-random permutation of [0, n), computed per index: a 4-round Feistel network on
    the smallest even number of bits that holds n, cycle-walked (fewer than 4 rounds of it
    on average) back into range."""

    def __init__(self, n: int, *key: object):
        self.n = n
        half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
        self.half, self.mask = half, (1 << half) - 1
        digest = hashlib.blake2b(repr(key).encode(), digest_size=32).digest()
        self.keys = [int.from_bytes(digest[8 * i: 8 * i + 8], "little") for i in range(4)]

    def __call__(self, j: int) -> int:
        """The image of ``j`` in [0, n)."""
        if not 0 <= j < self.n:
            raise DataError(f"index {j} is outside a permutation of {self.n}")
        x = j
        while True:
            left, right = x >> self.half, x & self.mask
            for key in self.keys:
                left, right = right, left ^ (_mix64(right ^ key) & self.mask)
            x = (left << self.half) | right
            if x < self.n:
                return x


class MixtureSampler:
    """Training rows drawn from ``sources`` in epochs, in proportion to their weights."""

    def __init__(self, sources: list[TokenSource], seq_len: int, global_batch_size: int,
                 seed: int = 0, document_mask: bool = False):
        if seq_len < 1 or global_batch_size < 1:
            raise DataError(f"seq_len ({seq_len}) and global_batch_size ({global_batch_size}) "
                            "must be positive")
        self.sources, self.seq_len = sources, int(seq_len)
        self.global_batch_size, self.seed = int(global_batch_size), int(seed)
        self.document_mask = document_mask
        self.step = 0  # the step after the last one served
        self.samples = [(s.n_train - 1) // self.seq_len for s in sources]
        for s, n in zip(sources, self.samples):
            if n < 1:
                raise DataError(f"source '{s.name}' has {s.n_train} training tokens, too few for "
                                f"one window of data.seq_len={seq_len} (+1 label)")
        self.counts = integer_weights([s.weight for s in sources])
        self.order = allocation(self.counts)
        self.period = len(self.order)
        # the rank of each slot among the period's slots of the same source
        self.rank_in_period = np.zeros(self.period, dtype=np.int64)
        for s in range(len(sources)):
            slots = np.flatnonzero(self.order == s)
            self.rank_in_period[slots] = np.arange(len(slots))
        self._perms: dict[tuple[int, int], Permutation] = {}

    def locate(self, g: int) -> tuple[int, int, int]:
        """(source, epoch, sample) of the run's ``g``-th sequence."""
        slot = g % self.period
        s = int(self.order[slot])
        k = (g // self.period) * self.counts[s] + int(self.rank_in_period[slot])
        epoch, j = divmod(k, self.samples[s])
        perm = self._perms.get((s, epoch))
        if perm is None:
            if len(self._perms) > 64:  # keep a few epochs' keys, not one per epoch ever seen
                self._perms.clear()
            # keyed by the source's content, not its name or path: the same text gives the
            # same order wherever it lies
            perm = self._perms[(s, epoch)] = Permutation(
                self.samples[s], self.seed, self.sources[s].digest, epoch)
        return s, epoch, perm(j)

    def consumed(self, n: int) -> list[int]:
        """Sequences each source has given after the run's first ``n``."""
        full, part = divmod(n, self.period)
        head = np.bincount(self.order[:part], minlength=len(self.sources))
        return [full * c + int(h) for c, h in zip(self.counts, head)]

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
        """Rows [rank·G/dp, (rank+1)·G/dp) of step ``step``'s global batch, computed alone."""
        lo, hi = rank_rows(self.global_batch_size, dp_rank, dp_size)
        self.step = int(step) + 1
        rows = []
        for r in range(lo, hi):
            s, _, j = self.locate(step * self.global_batch_size + r)
            rows.append((self.sources[s], j * self.seq_len))
        return windows(rows, self.seq_len, self.document_mask)

    def global_batch(self, step: int) -> dict[str, torch.Tensor]:
        """Every row of step ``step``."""
        return self.local_batch(step, 0, 1)

    def progress(self, step: int) -> dict[str, dict[str, float]]:
        """After step ``step``: the tokens each source has given and its epoch (fractional:
        1.25 is a quarter into the second pass)."""
        done = self.consumed((step + 1) * self.global_batch_size)
        return {"tokens_seen": {s.name: c * self.seq_len for s, c in zip(self.sources, done)},
                "epoch": {s.name: c / n for s, c, n in zip(self.sources, done, self.samples)}}

    def state_dict(self) -> dict:
        """Plain values that, loaded into a sampler on the same sources, continue the order."""
        return {"seed": self.seed, "step": self.step, "seq_len": self.seq_len,
                "global_batch_size": self.global_batch_size,
                "document_mask": self.document_mask, "weights": self.counts,
                "sources": [[s.name, s.digest, s.n_train] for s in self.sources]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; DataError if it was made for other data or batches."""
        if set(state) <= {"seed", "step"}:  # a bare start (a converted model): no data yet
            self.seed, self.step = int(state["seed"]), int(state["step"])
            return
        if "sources" not in state:
            raise DataError("the checkpoint's data order came from the sampler before epochs "
                            "and mixtures (windows with replacement); it cannot be continued "
                            "the same: start a new run")
        mine = self.state_dict()
        for name in ("seq_len", "global_batch_size", "document_mask", "weights", "sources"):
            if json_like(state[name]) != json_like(mine[name]):
                raise DataError(f"sampler state has {name}={state[name]} but this run has "
                                f"{mine[name]}; resume with the same data settings and sources")
        self.seed, self.step = int(state["seed"]), int(state["step"])


def json_like(value):
    """Lists for tuples, as a state looks after a round trip through JSON."""
    return [json_like(v) for v in value] if isinstance(value, (list, tuple)) else value


def windows(rows: list[tuple[TokenSource, int]], seq_len: int, document_mask: bool
            ) -> dict[str, torch.Tensor]:
    """A batch of (source, start) training windows: input_ids and labels (the next tokens);
    with ``document_mask`` also document_ids and position_ids, and no target across a
    document's end."""
    if not rows:
        empty = torch.empty((0, seq_len), dtype=torch.int64)
        batch = {"input_ids": empty, "labels": empty.clone()}
        if document_mask:
            batch.update(document_ids=empty.clone(), position_ids=empty.clone())
        return batch
    ids = np.stack([src.stream.read(start, seq_len + 1) for src, start in rows])
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:].copy()}
    if document_mask:
        docs = np.stack([src.stream.documents(start, seq_len + 1) for src, start in rows])
        docs -= docs[:, :1]
        batch["labels"][docs[:, 1:] != docs[:, :-1]] = -100
        batch["document_ids"] = docs[:, :-1]
        batch["position_ids"] = _restart_positions(docs[:, :-1])
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}


def _restart_positions(docs: np.ndarray) -> np.ndarray:
    """Positions counting from 0 at each change of document id along each row."""
    b, t = docs.shape
    idx = np.broadcast_to(np.arange(t), (b, t))
    starts = np.ones((b, t), dtype=bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    first = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    return (idx - first).astype(np.int64)


class HeldOutSampler:
    """Fixed validation batches of one source's held-out tokens: ``n_batches`` batches of
    ``batch_size`` windows spread evenly over them, whatever the seed and the step."""

    def __init__(self, source: TokenSource, seq_len: int, batch_size: int, n_batches: int,
                 document_mask: bool = False):
        self.source, self.seq_len, self.batch_size = source, seq_len, batch_size
        self.document_mask = document_mask
        count = n_batches * batch_size
        last = source.n_val - seq_len - 1  # the largest offset in the held-out tokens
        self.offsets = [source.n_train + k * last // max(count - 1, 1) for k in range(count)]

    def local_batch(self, k: int, dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
        """This rank's rows of validation batch ``k``."""
        lo, hi = rank_rows(self.batch_size, dp_rank, dp_size)
        first = k * self.batch_size
        return windows([(self.source, o) for o in self.offsets[first + lo: first + hi]],
                       self.seq_len, self.document_mask)

    def state_dict(self) -> dict:
        """Nothing to keep: the batches are fixed."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""
