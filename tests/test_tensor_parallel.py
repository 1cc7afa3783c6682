"""Tensor parallel (Megatron column/row, vocab-parallel embedding and loss), sequence
parallel, and their compositions with DP and ZeRO train to the same losses and weights as one
process; per-layer collectives match Megatron's counts."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed
from tests.test_dp_zero import STEPS, _check_equal
from threefold.config import load_config
from threefold.schedules.timeline import read_chrome_trace
from threefold.training.train import train


def _runs(rank, world, corpus, cache, root, runs):
    from threefold.parallel.distributed_world import Distributed

    out = {}
    for name, extra in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name, train__steps=STEPS,
                                               **extra))
        layout = Distributed(cfg)
        summary, _ = train(cfg, layout, return_run=True)
        out[name] = {"steps": layout._steps, "summary": summary}
    return out


@pytest.fixture(scope="module")
def references(corpus, cache_dir, tmp_path_factory):
    """Single-process runs: the plain tiny model, and one with a vocabulary of 322 (not a
    multiple of 4: exercises padding)."""
    refs = {}
    for key, extra in (("plain", {}), ("vocab322", {"model__vocab_size": 322})):
        out = tmp_path_factory.mktemp("tpref") / key
        train(load_config(None, tiny_overrides(corpus, cache_dir, out, train__steps=STEPS,
                                               **extra)))
        refs[key] = {"losses": [r["loss"] for r in metrics(out)], "weights": final_weights(out)}
    return refs


RUNS_2 = [
    ("tp2", {"parallel__tp": 2}, "plain"),
    ("tp2_sp_selective", {"parallel__tp": 2, "parallel__sequence_parallel": "true",
                          "train__recompute": "selective"}, "plain"),
    ("tp2_sp_accum_ac", {"parallel__tp": 2, "parallel__sequence_parallel": "true",
                         "train__micro_batch_size": 2,
                         "train__activation_checkpointing": "true"}, "plain"),
    # tp_overlap 6: 16 tokens per rank cut into 4 chunks (the largest divisor not above 6);
    # traced at step 2. Compared bit for bit with tp2_sp_selective (test below)
    ("tp2_sp_selective_overlap", {"parallel__tp": 2, "parallel__sequence_parallel": "true",
                                  "train__recompute": "selective", "parallel__tp_overlap": 6,
                                  "train__trace_step": 2}, "plain"),
    ("tp2_sp_accum_ac_overlap", {"parallel__tp": 2, "parallel__sequence_parallel": "true",
                                 "train__micro_batch_size": 2, "parallel__tp_overlap": 2,
                                 "train__activation_checkpointing": "true"}, "plain"),
]
RUNS_4 = [
    ("tp4_kv_replicated_padded", {"parallel__tp": 4, "model__vocab_size": 322}, "vocab322"),
    ("tp2_dp2", {"parallel__tp": 2}, "plain"),
    ("tp2_zero3", {"parallel__tp": 2, "parallel__zero_stage": 3}, "plain"),
    ("tp2_sp_zero1", {"parallel__tp": 2, "parallel__sequence_parallel": "true",
                      "parallel__zero_stage": 1}, "plain"),
]


@pytest.mark.slow
@pytest.mark.parametrize("world,runs", [(2, RUNS_2), (4, RUNS_4)], ids=["2ranks", "4ranks"])
def test_tp_layouts_equal_single_process(world, runs, references, corpus, cache_dir, tmp_path):
    results = run_distributed(_runs, world, corpus, cache_dir, tmp_path,
                              [(n, e) for n, e, _ in runs], timeout=400)
    for name, extra, ref in runs:
        _check_equal(references[ref], tmp_path / name)
        assert all("tp" in r[name]["summary"]["comm_bytes_per_step"] for r in results), name
    if world == 2:
        _check_overlap(results, tmp_path / "tp2_sp_selective_overlap", "tp2_sp_selective", 4,
                       traced=True)
        _check_overlap(results, tmp_path / "tp2_sp_accum_ac_overlap", "tp2_sp_accum_ac", 2,
                       traced=False)


def _check_overlap(results, out, plain, chunks, traced):
    """parallel.tp_overlap: the same floats as the unoverlapped run (fp32, bit for bit), the
    same bytes per axis, the chunks the shapes allowed recorded, and the trace showing each
    async collective in flight during a chunk's matmul."""
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(out.parent / plain)]
    w, ref = final_weights(out), final_weights(out.parent / plain)
    assert [k for k in ref if not torch.equal(w[k], ref[k])] == []
    for r in results:
        ov = r[out.name]["summary"]
        assert ov["comm_bytes_per_step"] == r[plain]["summary"]["comm_bytes_per_step"]
        assert ov["tp_overlap_chunks"] == chunks
        assert "tp_overlap_chunks" not in r[plain]["summary"]
    assert (out / "trace.json").exists() == traced
    if not traced:
        return
    records, _ = read_chrome_trace(out / "trace.json")
    comm = [x for x in records if x.category == "tp comm (async)"]
    matmul = [x for x in records if x.category == "tp matmul"]
    assert len(comm) == len(matmul) > 0  # a span each per chunk, forward and backward
    assert any(c.rank == m.rank and c.start_s < m.start_s and m.end_s < c.end_s
               for c in comm for m in matmul)
