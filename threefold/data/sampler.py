"""Deterministic, resumable sampling of training windows, sharded by data-parallel rank.

Row ``r`` of step ``t``'s global batch is the window that starts at offset
``H(seed, t, r) mod (len(tokens) - seq_len)``, H being BLAKE2b. A batch therefore depends only on
(seed, step): no hidden RNG state, nothing to replay on resume, and any data-parallel layout
computes exactly the rows of the single-process global batch it owns, without building the
rest. Windows are drawn with replacement (no epochs); labels are the inputs shifted by one
token in the stream.
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import numpy as np
import torch

from threefold.data.errors import DataError


def _window_offset(seed: int, step: int, row: int, num_windows: int) -> int:
    """A uniform offset in [0, num_windows), a pure function of (seed, step, row)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{row}".encode(), digest_size=8).digest()
    # 64 random bits mod a count below 2**40: the bias is under 2**-24, far below any effect.
    return int.from_bytes(digest, "little") % num_windows


def _gather(tokens: np.ndarray, offsets: list[int], seq_len: int):
    """(inputs, labels) int64 tensors for windows starting at ``offsets``."""
    if not offsets:
        empty = torch.empty((0, seq_len), dtype=torch.int64)
        return empty, empty.clone()
    windows = np.stack([tokens[o : o + seq_len + 1] for o in offsets]).astype(np.int64)
    windows = torch.from_numpy(windows)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def rank_rows(rows: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """The contiguous [lo, hi) share of ``rows`` owned by ``dp_rank``."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    if rows % dp_size:
        raise DataError(f"batch of {rows} sequences does not split evenly over {dp_size} "
                        "data-parallel ranks; make it a multiple of the data-parallel degree")
    per = rows // dp_size
    return dp_rank * per, (dp_rank + 1) * per


class BatchSampler:
    """Random training windows whose order is a pure function of (seed, step)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch_size: int, seed: int = 0):
        """``tokens``: 1-D token ids; each batch is ``global_batch_size`` windows of ``seq_len``."""
        if tokens.ndim != 1:
            raise DataError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1 or global_batch_size < 1:
            raise DataError(f"seq_len ({seq_len}) and global_batch_size ({global_batch_size}) "
                            "must be positive")
        if len(tokens) < seq_len + 1:
            raise DataError(f"{len(tokens)} tokens are too few for one window of seq_len="
                            f"{seq_len} (+1 label); use a larger corpus or a shorter seq_len")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.step = 0  # the step after the last one served: what ``next_batch`` serves next
        self.num_windows = len(tokens) - self.seq_len

    def _rows(self, step: int, lo: int, hi: int):
        # Serving a step makes the following one "next", so state_dict() is right whether the
        # trainer calls next_batch() or passes its own step to local_batch().
        self.step = int(step) + 1
        offsets = [_window_offset(self.seed, step, r, self.num_windows) for r in range(lo, hi)]
        return _gather(self.tokens, offsets, self.seq_len)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each int64 of shape (global_batch_size, seq_len), for ``step``.

        Like ``local_batch``, it sets ``self.step`` to ``step + 1``.
        """
        return self._rows(step, 0, self.global_batch_size)

    def local_batch(self, step: int, dp_rank: int, dp_size: int):
        """Rows [rank·G/dp, (rank+1)·G/dp) of ``global_batch(step)``, computed alone."""
        lo, hi = rank_rows(self.global_batch_size, dp_rank, dp_size)
        return self._rows(step, lo, hi)

    def next_batch(self, dp_rank: int = 0, dp_size: int = 1):
        """This rank's share of the batch for ``self.step``, then advance ``self.step``."""
        return self.local_batch(self.step, dp_rank, dp_size)  # which advances self.step

    def state_dict(self) -> dict[str, int]:
        """Plain ints that, loaded into a sampler on the same tokens, continue the same order."""
        return {"seed": self.seed, "step": self.step, "seq_len": self.seq_len,
                "global_batch_size": self.global_batch_size, "num_tokens": len(self.tokens)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; DataError if it was made for other windows or other data."""
        for name in ("seq_len", "global_batch_size", "num_tokens"):
            mine = self.state_dict()[name]
            if int(state.get(name, mine)) != mine:
                raise DataError(f"sampler state has {name}={state[name]} but this run has "
                                f"{mine}; resume with the same data settings and corpus")
        self.seed = int(state["seed"])
        self.step = int(state["step"])

    def val_batches(self, n_batches: int, batch_size: int, dp_rank: int = 0,
                    dp_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``n_batches`` fixed batches of windows spread evenly over the tokens.

        They ignore the seed and the step, so every evaluation scores the very same text; with
        ``dp_size`` > 1 each rank gets its contiguous share of every batch.
        """
        lo, hi = rank_rows(batch_size, dp_rank, dp_size)
        count = n_batches * batch_size
        last = self.num_windows - 1  # the largest valid offset
        offsets = [k * last // max(count - 1, 1) for k in range(count)]
        for b in range(n_batches):
            yield _gather(self.tokens, offsets[b * batch_size + lo : b * batch_size + hi],
                          self.seq_len)
