"""Which positions of each packed row a context-parallel rank holds when the split follows the
documents (``parallel.cp_balance documents``), as tensors, and the masks that any such split
needs.

The schedule itself is ``threefold.accounting.row_spans``: a pure function of the documents'
lengths, which every rank computes alike from the whole row's ``document_ids`` (they stay
whole on every rank), so the ranks agree on who holds what without a message.

It applies to ``ring`` and ``allgather``: both attend a rank's queries to key blocks named by
global positions, so any split composes with their K/V exchange (the all-gather sees every
key; the ring meets every rank's block once, each under the mask of its positions). Other
algorithms keep the causal head-tail split.
"""

from __future__ import annotations

import torch

from threefold.accounting import row_spans

BALANCED_ALGORITHMS = ("ring", "allgather")


def split_balance(balance: str, algorithm: str, ulysses: int = 1) -> str:
    """The split that runs: ``balance`` where ``algorithm`` composes with any split and all
    cp ranks form its one group (``ulysses`` 1: no all-to-all degree inside cp), else the
    causal head-tail split."""
    return balance if algorithm in BALANCED_ALGORITHMS and ulysses == 1 else "causal"


def document_lengths(row: torch.Tensor) -> list[int]:
    """Lengths of the runs of equal document id along one row, in order."""
    return torch.unique_consecutive(row, return_counts=True)[1].tolist()


def rank_positions(document_ids: torch.Tensor, cp: int, balance: str) -> torch.Tensor:
    """(cp, B, T/cp) global positions each cp rank holds of each row of ``document_ids``
    (B, T), each rank's in increasing order."""
    rows = []
    for row in document_ids.cpu():
        spans = row_spans(document_lengths(row), cp, balance)
        rows.append(torch.stack([torch.cat([torch.arange(s, s + n) for s, n in rank])
                                 for rank in spans]))
    return torch.stack(rows, 1).to(document_ids.device)


def take_positions(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x`` (B, T, ...) at the positions ``idx`` (B, t) of each row -> (B, t, ...)."""
    shape = idx.shape + x.shape[2:]
    return x.gather(1, idx.reshape(*idx.shape, *([1] * (x.dim() - 2))).expand(shape))


def row_visibility(q_idx: torch.Tensor, k_idx: torch.Tensor, docs: torch.Tensor | None):
    """Which keys each query may attend, per row: q_idx (B, Tq) and k_idx (B, Tk) global
    positions -> (B, 1, Tq, Tk) boolean mask (the key not later than the query and, with
    ``docs``, in its document), None when every pair is visible, False when none is."""
    m = k_idx[:, None, :] <= q_idx[:, :, None]
    if docs is not None:
        m &= docs.gather(1, q_idx)[:, :, None] == docs.gather(1, k_idx)[:, None, :]
    if bool(m.all()):
        return None
    if not bool(m.any()):
        return False
    return m[:, None]


def masked_block(q_idx: torch.Tensor, k_idx: torch.Tensor, docs: torch.Tensor | None,
                 dtype: torch.dtype):
    """A ring step's block under a split by positions: (additive float mask (B, 1, Tq, Tk),
    rows that see any key (B, 1, Tq)), (None, None) when all is visible, False when nothing
    is (the block is skipped)."""
    vis = row_visibility(q_idx, k_idx, docs)
    if vis is None or vis is False:
        return (None, None) if vis is None else False
    mask = torch.zeros(vis.shape, dtype=dtype, device=vis.device)
    mask.masked_fill_(~vis, float("-inf"))
    return mask, vis.any(-1)
