"""Data parallel's gradients are views of its communication buckets (no second copy of the
gradients exists), and each bucket's all-reduce starts while backward is still running."""

from __future__ import annotations

from tests.conftest import tiny_overrides
from tests.dist import run_distributed
from threefold.config import load_config
from threefold.training.train import train


def _dp_run(rank, world, corpus, cache, out):
    """Train dp2 with accumulation and several small buckets, tracing step 2; report how
    the gradients and the buckets share storage."""
    import torch

    from threefold.parallel.distributed_world import Distributed

    cfg = load_config(None, tiny_overrides(corpus, cache, out, train__steps=3,
                                           train__micro_batch_size=2, train__trace_step=2,
                                           parallel__bucket_mb="0.05"))
    _, run = train(cfg, Distributed(cfg), return_run=True)
    eng = run.engine
    flats = {b.flat.untyped_storage().data_ptr() for b in eng.buckets}
    grads = [p.grad for _, p in eng.named_params]
    return {"buckets": len(eng.buckets),
            "all_views": all(g is not None and g.untyped_storage().data_ptr() in flats
                             for g in grads),
            "flat_elems": sum(b.flat.numel() for b in eng.buckets),
            "param_elems": sum(p.numel() for _, p in eng.named_params),
            "zeroed": all(float(g.abs().sum()) == 0.0 for g in grads)}


def test_gradients_are_bucket_views_and_all_reduces_overlap_backward(corpus, cache_dir,
                                                                      tmp_path):
    from threefold.schedules.timeline import read_chrome_trace

    out = tmp_path / "dp2"
    results = run_distributed(_dp_run, 2, corpus, cache_dir, out, timeout=300)
    for r in results:
        assert r["buckets"] > 3
        # one buffer per parameter element: the buckets, and .grad only views of them
        assert r["all_views"] and r["flat_elems"] == r["param_elems"]
        assert r["zeroed"]  # after the optimiser step, ready for the next accumulation
    records, _ = read_chrome_trace(out / "trace.json")
    for rank in (0, 1):
        mine = [x for x in records if x.rank == rank]
        backward_end = max(x.end_s for x in mine if x.name.startswith("BW"))
        reduces = [x for x in mine if x.name.startswith("all-reduce bucket")]
        assert len(reduces) == results[rank]["buckets"]
        # every bucket's all-reduce was launched from inside the last micro-batch's backward
        last_bw = max((x for x in mine if x.name.startswith("BW")), key=lambda x: x.end_s)
        assert all(last_bw.start_s < x.start_s < backward_end for x in reduces), reduces
