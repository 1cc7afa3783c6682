"""Data parallel and ZeRO 1/2/3 (and hybrid) train to the same losses and weights as one
process on the same global batch, move exactly the bytes the formulas say, and hold exactly
the model state ZeRO's formulas say."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed
from tests.test_comm import chunk
from threefold.config import load_config
from threefold.accounting import num_parameters
from threefold.training.train import train

STEPS = 4


def _layouts(rank, world, corpus, cache, root, runs):
    """Each rank: train every run in ``runs`` in this process group; report what the tests
    need from every rank (replica checksums, byte counters, state sizes)."""
    from threefold.parallel.distributed_world import Distributed

    out = {}
    for name, extra in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name, train__steps=STEPS,
                                               **extra))
        layout = Distributed(cfg)
        summary, run = train(cfg, layout, return_run=True)
        eng = run.engine
        full = [p.detach().clone() for _, p in eng.named_params] if not hasattr(eng, "units") \
            else None
        owned = sum(u.shard.numel() for u in eng.all_units) if hasattr(eng, "units") else None
        opt_elems = sum(t.numel() for st in eng.optimizer.state.values()
                        for k, t in st.items() if k != "step")
        out[name] = {"summary": summary, "steps": layout._steps, "totals": layout.comm.totals(),
                     "params_checksum": [float(t.double().sum()) for t in full] if full else None,
                     "owned_param_elems": owned, "optim_elems": opt_elems,
                     "dims": (layout.dims.dp_replicate, layout.dims.dp_shard)}
    return out


def _all_reduce_bytes(numel: int, n: int, i: int) -> int:
    """fp32 bytes rank i sends in a ring all-reduce: 2·(numel − its own chunk)."""
    return 2 * (numel - chunk(numel, n, i)) * 4


@pytest.fixture(scope="module")
def reference(corpus, cache_dir, tmp_path_factory):
    """The single-process run every layout must equal."""
    out = tmp_path_factory.mktemp("ref") / "single"
    cfg = load_config(None, tiny_overrides(corpus, cache_dir, out, train__steps=STEPS))
    train(cfg)
    return {"losses": [r["loss"] for r in metrics(out)], "weights": final_weights(out),
            "psi": num_parameters(cfg.model.resolved(320)),
            "embedding": 320 * cfg.model.resolved(320).hidden_size}


def _check_equal(reference, out):
    losses = [r["loss"] for r in metrics(out)]
    assert losses == pytest.approx(reference["losses"], rel=1e-5), out.name
    w = final_weights(out)
    assert set(w) == set(reference["weights"])
    for k, ref in reference["weights"].items():
        torch.testing.assert_close(w[k], ref, rtol=1e-4, atol=2e-5, msg=f"{out.name}: {k}")


RUNS_2 = [
    ("dp2", {}),
    ("dp2_accum", {"train__micro_batch_size": 2}),
    ("zero1", {"parallel__zero_stage": 1}),
    ("zero2", {"parallel__zero_stage": 2}),
    ("zero2_accum", {"parallel__zero_stage": 2, "train__micro_batch_size": 2}),
    ("zero3_selective", {"parallel__zero_stage": 3, "train__recompute": "selective"}),
    ("zero3_accum_ac", {"parallel__zero_stage": 3, "train__micro_batch_size": 2,
                        "train__activation_checkpointing": "true"}),
]
RUNS_4 = [
    ("dp4", {}),
    ("zero1_4", {"parallel__zero_stage": 1}),
    ("zero2_4", {"parallel__zero_stage": 2}),
    ("zero3_4", {"parallel__zero_stage": 3}),
    ("hybrid_2x2_zero3", {"parallel__zero_stage": 3, "parallel__dp_replicate": 2}),
    ("hybrid_2x2_zero2_accum", {"parallel__zero_stage": 2, "parallel__dp_replicate": 2,
                                "train__micro_batch_size": 1}),
]


@pytest.mark.slow
@pytest.mark.parametrize("world,runs", [(2, RUNS_2), (4, RUNS_4)], ids=["2ranks", "4ranks"])
def test_layouts_equal_single_process(world, runs, reference, corpus, cache_dir, tmp_path):
    results = run_distributed(_layouts, world, corpus, cache_dir, tmp_path, runs, timeout=400)
    psi = reference["psi"]
    for name, extra in runs:
        _check_equal(reference, tmp_path / name)
        per_rank = [r[name] for r in results]
        zero = int(extra.get("parallel__zero_stage", 0))
        rep, shard = per_rank[0]["dims"]
        accum = max(1, 8 // (rep * shard) // int(extra.get("train__micro_batch_size", 8)))
        if zero == 0:
            # replicas identical on every rank, bit for bit
            sums = [r["params_checksum"] for r in per_rank]
            assert all(s == sums[0] for s in sums[1:]), name
            for r in per_rank:  # DP: all-reduce of Ψ fp32 elements, 2Ψ(N-1)/N each rank
                assert [s["dp"] for s in r["steps"]] == [2 * psi * (world - 1) // world * 4] \
                    * STEPS, name
                assert r["optim_elems"] == 2 * psi
            continue
        n = shard
        # ZeRO §7: reduce-scatter Ψ + all-gather Ψ per step (stage 3 re-gathers for backward,
        # all but the embedding, whose backward reads no weight, and reduces every
        # micro-step); (N-1)/N of it leaves each rank
        scatters = accum if zero == 3 else 1
        gathered = (2 * psi - reference["embedding"]) * accum if zero == 3 else psi
        for rank, r in enumerate(per_rank):
            # the grad-norm all-reduce: 2 fp32 sums of squares (tp-sharded, replicated parts)
            norm_bytes = _all_reduce_bytes(2, n, rank % n)
            expect = (scatters * psi + gathered) * (n - 1) // n * 4 + norm_bytes
            assert [s["dp_shard"] for s in r["steps"]] == [expect] * STEPS, name
            # model state per rank: Ψ/N parameters owned, 2Ψ/N optimiser elements
            assert r["owned_param_elems"] == psi // n, name
            assert r["optim_elems"] == 2 * psi // n, name
            if rep > 1:  # hybrid: shard gradients all-reduced over replicas
                assert [s["dp_replicate"] for s in r["steps"]] == \
                    [2 * (psi // n) * (rep - 1) // rep * 4] * STEPS, name
