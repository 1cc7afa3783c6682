"""Packed rows split over context-parallel ranks by their documents: every rank gets the same
number of tokens and (within 2·cp keys) the same attention work under the document mask,
where the head-tail split of the whole row does not; the simulator's figures on synthetic
length mixtures say by how much. Pure arithmetic and one small torch split."""

from __future__ import annotations

import random

import pytest
import torch

from threefold.accounting import attention_work, document_spans, headtail_spans, imbalance
from threefold.plan.packed_rows import MIXTURES, packed_rows, work_imbalance


def _positions(spans):
    return [p for s, n in spans for p in range(s, s + n)]


def _brute_work(lengths, positions):
    """Keys each query sees under the document mask, counted from an explicit mask."""
    doc = [d for d, n in enumerate(lengths) for _ in range(n)]
    return sum(sum(1 for k in range(q + 1) if doc[k] == doc[q]) for q in positions)


def _random_rows(n_rows, seq_len, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n_rows):
        cuts = sorted(rng.sample(range(1, seq_len), rng.randint(0, 9)))
        rows.append([b - a for a, b in zip([0] + cuts, cuts + [seq_len])])
    return rows


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_document_split_covers_the_row_with_equal_tokens_and_work(cp):
    for lengths in _random_rows(40, 48 * cp, seed=cp):
        spans = document_spans(lengths, cp)
        pos = [_positions(s) for s in spans]
        assert sorted(p for r in pos for p in r) == list(range(sum(lengths)))
        assert all(len(r) == sum(lengths) // cp and r == sorted(r) for r in pos)
        work = attention_work(lengths, spans)
        assert work == [_brute_work(lengths, r) for r in pos]
        assert max(work) - min(work) <= 2 * cp  # the spare tokens' spread, at most
        # the whole-row split under the same mask, counted the same two ways
        before = attention_work(lengths, headtail_spans(sum(lengths), cp))
        assert before == [_brute_work(lengths, _positions(s)) for s in
                          headtail_spans(sum(lengths), cp)]


def test_one_document_is_the_head_tail_split():
    for cp in (1, 2, 4, 8):
        want = [_positions(s) for s in headtail_spans(64, cp)]
        assert [_positions(s) for s in document_spans([64], cp)] == want
        w = attention_work([64], headtail_spans(64, cp))
        assert imbalance(w) == 1.0  # causal mask: the head-tail pairs do equal work
    with pytest.raises(ValueError, match="2·cp = 8"):
        document_spans([30], 4)


@pytest.mark.parametrize("mixture", MIXTURES)
def test_simulated_imbalance_before_and_after(mixture):
    """Rows of 8192 tokens packed from the stated length mixtures, cp 4: the whole-row split
    leaves ranks with unequal work under the document mask; the split by documents evens it."""
    rows = packed_rows(mixture, 8192, 24, seed=1)
    assert all(sum(r) == 8192 for r in rows) and max(len(r) for r in rows) > 2
    before, after = work_imbalance(rows, 4, "causal"), work_imbalance(rows, 4, "documents")
    print(f"{mixture}: max/mean before {before.mean:.3f} (worst {before.worst:.3f}), "
          f"after {after.mean:.4f} (worst {after.worst:.4f})")
    assert before.worst > 1.2 and after.worst < 1.001 < before.mean


def test_shard_batch_by_documents_keeps_positions_and_labels():
    from threefold.parallel.transforms.context import shard_batch
    from threefold.parallel.transforms.cp_order import rank_positions

    docs = torch.tensor([[0] * 3 + [1] * 17 + [2] * 12, [0] * 20 + [1] * 12])
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    micro = {"input_ids": ids, "labels": ids.roll(-1, 1), "document_ids": docs,
             "position_ids": torch.arange(32).expand(2, 32) % 7}
    parts = [shard_batch(micro, 2, r, balance="documents") for r in range(2)]
    pos = rank_positions(docs, 2, "documents")
    for r, part in enumerate(parts):
        assert torch.equal(part["document_ids"], docs)  # whole on every rank
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(part[key], micro[key].gather(1, pos[r]))
    for b in range(2):  # the two ranks hold every position of every row once
        assert sorted(torch.cat([pos[0, b], pos[1, b]]).tolist()) == list(range(32))
