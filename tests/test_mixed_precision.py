"""16-bit gathers (FSDP2-style mixed precision): under bf16 compute, ZeRO-3 all-gathers bf16
copies of the fp32 master shards (half the bytes) and reduce-scatters gradients in
``parallel.reduce_dtype``. It trains to the losses and weights of one process holding bf16
compute copies of fp32 masters (``parallel.param_dtype bfloat16``) on the same micro-batches:
within fp32's tolerance with float32 reduction (the same bf16 gradients, summed in fp32 in
another order), within a stated looser one with bfloat16 reduction (each rank's gradient is
rounded to bf16 before the sum). The bytes each collective moves equal the closed form with
2-byte gathers."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed
from tests.test_comm import chunk
from threefold.layout import Layout, Workload
from threefold.accounting import comm_bytes_per_step, num_parameters
from threefold.config import load_config

STEPS = 4
# No clipping: the clip coefficient comes from a norm summed in another order on each layout,
# so masters would differ in their last fp32 bit, and their bf16 copies then round apart now
# and then (a 2^-8 jump); without it the masters are bit-identical on every layout.
BF16 = {"train__dtype": "bfloat16", "optim__grad_clip": "0"}


def _runs(rank, world, corpus, cache, root, runs):
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    out = {}
    for name, extra in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name, train__steps=STEPS,
                                               **extra))
        layout = Distributed(cfg) if world > 1 else None  # one rank: the plain process
        _, run = train(cfg, layout, return_run=True)
        units = getattr(run.engine, "units", None)
        out[name] = {"steps": layout._steps if layout else None,
                     "full_dtype": str(units[0].full.dtype) if units else None,
                     "shard_dtype": str(units[0].shard.dtype) if units else None}
    return out


def _reference(out):
    return [r["loss"] for r in metrics(out)], final_weights(out)


def _close(out, ref, rel, atol, rounding=False):
    """Losses within ``rel``, weights within (10·rel, ``atol``). With ``rounding`` (gradients
    rounded to bf16) an element whose gradient is near zero may take AdamW's ±lr steps the
    other way: every element stays within the largest distance those can make (2·STEPS·lr),
    and all but 0.1% within (10·rel, ``atol``)."""
    losses, weights = ref
    assert [r["loss"] for r in metrics(out)] == pytest.approx(losses, rel=rel), out.name
    got = final_weights(out)
    lr = float(dict(tiny_overrides("x", "x", "x"))["optim.lr"])  # the runs' peak lr
    for k, w in weights.items():
        if not rounding:
            torch.testing.assert_close(got[k], w, rtol=rel * 10, atol=atol,
                                       msg=f"{out.name}: {k}")
            continue
        diff = (got[k] - w).abs()
        assert float(diff.max()) <= 2 * STEPS * lr, (out.name, k)
        beyond = diff > atol + rel * 10 * w.abs()
        assert int(beyond.sum()) <= max(1, w.numel() // 1000), (out.name, k, int(beyond.sum()))


@pytest.mark.slow
def test_zero3_bf16_gathers_equal_one_process_with_the_same_policy(corpus, cache_dir,
                                                                     tmp_path):
    runs = [("z3", {"parallel__zero_stage": 3, "train__micro_batch_size": 4, **BF16}),
            ("z3_accum", {"parallel__zero_stage": 3, "train__micro_batch_size": 2, **BF16}),
            ("z3_bf16_reduce", {"parallel__zero_stage": 3, "train__micro_batch_size": 4,
                                "parallel__reduce_dtype": "bfloat16", **BF16}),
            ("z2_bf16_params", {"parallel__zero_stage": 2, "train__micro_batch_size": 4,
                                "parallel__param_dtype": "bfloat16", **BF16})]
    results = run_distributed(_runs, 2, corpus, cache_dir, tmp_path, runs, timeout=400)
    # the references in a one-rank group: one thread, as each rank above (bf16 matmuls
    # split their sums by thread, and a rounding flip is 2^-8)
    one = [(f"ref{mb}", {"train__micro_batch_size": mb, "parallel__param_dtype": "bfloat16",
                         **BF16}) for mb in (4, 2)]
    run_distributed(_runs, 1, corpus, cache_dir, tmp_path, one, timeout=400)
    ref4, ref2 = _reference(tmp_path / "ref4"), _reference(tmp_path / "ref2")
    # fp32 reduction: the same bf16 micro-batch gradients summed in fp32
    _close(tmp_path / "z3", ref4, 1e-5, 2e-5)
    _close(tmp_path / "z3_accum", ref2, 1e-5, 2e-5)
    _close(tmp_path / "z2_bf16_params", ref4, 1e-5, 2e-5)
    # bf16 reduction rounds each rank's gradient and the sum to bf16 (8 bits of mantissa):
    # AdamW normalises the update, so weights drift by a fraction of lr per step
    _close(tmp_path / "z3_bf16_reduce", ref4, 2e-3, 3e-3, rounding=True)
    cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path, **BF16))
    psi, emb = num_parameters(cfg.model.resolved(320)), 320 * cfg.model.hidden_size
    for rank, r in enumerate(results):
        assert r["z3"]["full_dtype"] == "torch.bfloat16"
        assert r["z3"]["shard_dtype"] == "torch.float32"  # the master stays fp32
        norm = 2 * (2 - chunk(2, 2, rank)) * 4  # the gradient norm's 2 fp32 sums
        for name, accum, grad_bytes in (("z3", 1, 4), ("z3_accum", 2, 4),
                                        ("z3_bf16_reduce", 1, 2)):
            # per micro-batch: gradients reduce-scattered in the reduce dtype, every unit
            # gathered in bf16 for forward and all but the embedding again for backward
            expect = accum * (psi * grad_bytes + (2 * psi - emb) * 2) // 2 + norm
            assert [s["dp_shard"] for s in r[name]["steps"]] == [expect] * STEPS, name
        # ZeRO-2 with bf16 parameters: one fp32 reduce-scatter, one bf16 gather per step
        assert [s["dp_shard"] for s in r["z2_bf16_params"]["steps"]] == \
            [(psi * 4 + psi * 2) // 2 + norm] * STEPS
    # the planner's and dry run's closed form counts the same bytes (rank 0)
    for name, extra in runs:
        c = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "x",
                                             **{k: v for k, v in extra.items()}))
        want = comm_bytes_per_step(c.model.resolved(320), Layout.from_config(c, 2),
                                   Workload.from_config(c), stage=0)["dp_shard"]
        assert results[0][name]["steps"][-1]["dp_shard"] == want, name
