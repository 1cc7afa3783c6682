"""Pipeline parallelism through the trainer, and full 3D (pp × tp × dp/ZeRO on one mesh):
equal to single-process training."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed, train_runs
from tests.test_dp_zero import STEPS
from threefold.weights.checkpoint import load_checkpoint
from threefold.config import load_config
from threefold.training.train import train

DEEP = {"model__num_hidden_layers": 4}


def _overrides(corpus, cache):
    """The tiny model, 4 blocks deep, STEPS steps unless a run says otherwise."""
    return functools.partial(tiny_overrides, corpus, cache, train__steps=STEPS, **DEEP)


@pytest.fixture(scope="module")
def reference(corpus, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref3d") / "single"
    train(load_config(None, tiny_overrides(corpus, cache_dir, out, train__steps=STEPS, **DEEP)))
    return {"losses": [r["loss"] for r in metrics(out)], "weights": final_weights(out)}


def _check(reference, out, atol):
    losses = [r["loss"] for r in metrics(out)]
    assert losses == pytest.approx(reference["losses"], rel=1e-5), out.name
    w = final_weights(out)
    assert set(w) == set(reference["weights"]), out.name
    for k, ref in reference["weights"].items():
        # Adam on near-zero gradients magnifies reordered sums (tp): atol 5e-5
        torch.testing.assert_close(w[k], ref, rtol=1e-4, atol=atol, msg=f"{out.name}: {k}")


@pytest.mark.slow
def test_pipeline_through_trainer(reference, corpus, cache_dir, tmp_path):
    runs = [("pp2_1f1b", {"parallel__pp": 2, "train__micro_batch_size": 2,
                          "train__trace_step": 2, "parallel__pipeline_split": "1,3"}),
            ("pp2_zbh1_clip", {"parallel__pp": 2, "parallel__schedule": "zb-h1",
                               "train__micro_batch_size": 2, "optim__grad_clip": "0.5",
                               "train__activation_checkpointing": "true",
                               "parallel__pipeline_split": "flops"}),
            ("pp2_interleaved", {"parallel__pp": 2, "parallel__vpp": 2,
                                 "parallel__schedule": "interleaved-1f1b",
                                 "train__micro_batch_size": 4,
                                 "train__recompute": "selective",
                                 "train__recompute_modules": "core_attn,mlp"})]
    run_distributed(train_runs, 2, _overrides(corpus, cache_dir), tmp_path, runs, timeout=400)
    for name, _ in runs[:1] + runs[2:]:
        _check(reference, tmp_path / name, 2e-5)
    _check_trace(tmp_path / "pp2_1f1b", micro=4)
    # clipping at 0.5 changes the run: it must still be the single-process clipped run
    out = tmp_path / "ref_clip"
    train(load_config(None, tiny_overrides(corpus, cache_dir, out, train__steps=STEPS, **DEEP,
                                           optim__grad_clip="0.5")))
    _check({"losses": [r["loss"] for r in metrics(out)], "weights": final_weights(out)},
           tmp_path / "pp2_zbh1_clip", 2e-5)


def _check_trace(out, micro):
    """train.trace_step wrote step 2's trace: on each of the 2 ranks one event per compute
    action of its 1F1B list (an F and a BW per microbatch), its message batches, and the
    step's gradient/optimiser phases; the summary carries the measured idle fraction."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trace"]["step"] == 2
    assert 0.0 < summary["trace"]["pipeline_idle_fraction"] < 1.0
    assert summary["trace"]["pipeline_unit_cost_bubble"] == pytest.approx(1 / (micro + 1))
    assert 0.0 < summary["trace"]["pipeline_simulated_bubble"] < 1.0
    trace = json.loads((out / "trace.json").read_text())
    assert trace["otherData"] == {"pipelines": [[0, 1]]}
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    for rank in (0, 1):
        names = [e["name"] for e in events if e["pid"] == rank]
        kinds = [n.split()[0] for n in names]
        assert kinds.count("F") == kinds.count("BW") == micro
        assert "optimizer step" in names and "finish gradients" in names
        assert any(k in ("SEND_F", "RECV_F") for k in kinds)
        # sends stay in flight, on a track of their own, over the compute that follows them
        flights = [e for e in events if e["pid"] == rank and e["cat"] == "send"]
        computes = [e for e in events if e["pid"] == rank and e["cat"] == "compute"
                    and e["name"].split()[0] in ("F", "BW")]
        assert flights and all(e["name"].startswith("in flight: SEND_") for e in flights)
        assert any(f["ts"] <= c["ts"] and c["ts"] + c["dur"] <= f["ts"] + f["dur"]
                   for f in flights for c in computes)


@pytest.mark.slow
def test_3d_pp2_tp2_dp2(reference, corpus, cache_dir, tmp_path):
    runs = [("3d_zero1", {"parallel__pp": 2, "parallel__tp": 2, "parallel__zero_stage": 1,
                          "train__micro_batch_size": 2}),
            ("3d_zero3_sp_zbh1", {"parallel__pp": 2, "parallel__tp": 2, "parallel__zero_stage": 3,
                                  "parallel__sequence_parallel": "true",
                                  "parallel__schedule": "zb-h1", "train__micro_batch_size": 2})]
    run_distributed(train_runs, 8, _overrides(corpus, cache_dir), tmp_path, runs, timeout=600)
    for name, _ in runs:
        _check(reference, tmp_path / name, 5e-5)


TIED = {"model__tie_word_embeddings": "true", "optim__grad_clip": "0.5"}


def _check_tied(reference, ref, outs, resumed, corpus, cache_dir) -> None:
    """Each run in ``outs`` equals the tied single-process run ``ref`` (losses, weights and
    the clipped norms); then one more step from ``ref``'s checkpoint, single process, equals
    the step ``resumed`` took from the same checkpoint pipelined."""
    for out in outs:
        _check(reference, out, 5e-5)
        norms = [r["grad_norm"] for r in metrics(out)]
        assert norms == pytest.approx([r["grad_norm"] for r in metrics(ref)], rel=1e-5)
    train(load_config(None, tiny_overrides(corpus, cache_dir, ref, train__steps=STEPS + 1,
                                           checkpoint__resume="true", **DEEP, **TIED)))
    last = [r for r in metrics(resumed) if r["step"] == STEPS + 1]
    assert last and last[0]["loss"] == pytest.approx(metrics(ref)[-1]["loss"], rel=1e-5)


@pytest.mark.slow
def test_tied_embeddings_across_pipeline_stages(corpus, cache_dir, tmp_path):
    """A tied head on the last stage is a copy of the first stage's embedding whose gradient
    is summed with it every step (counted once in the clipped norm, saved once): equal to the
    tied single-process run, under ZeRO-1 and under tp2 + ZB-H1; and a tied single-process
    checkpoint resumes pipelined (the head's copy loaded from the embedding)."""
    ref = tmp_path / "ref"
    train(load_config(None, tiny_overrides(corpus, cache_dir, ref, train__steps=STEPS, **DEEP,
                                           **TIED)))
    resumed = tmp_path / "tied_pp2_dp2_resumed"
    shutil.copytree(ref / "checkpoints", resumed / "checkpoints")
    runs = [("tied_pp2_zero1", {"parallel__pp": 2, "parallel__zero_stage": 1,
                                "train__micro_batch_size": 2, **TIED}),
            ("tied_pp2_tp2_zbh1", {"parallel__pp": 2, "parallel__tp": 2,
                                   "parallel__schedule": "zb-h1", "train__micro_batch_size": 2,
                                   **TIED}),
            ("tied_pp2_dp2_resumed", {"parallel__pp": 2, "train__micro_batch_size": 2,
                                      "train__steps": STEPS + 1, "checkpoint__resume": "true",
                                      **TIED})]
    run_distributed(train_runs, 4, _overrides(corpus, cache_dir), tmp_path, runs, timeout=500)
    reference = {"losses": [r["loss"] for r in metrics(ref)], "weights": final_weights(ref)}
    assert "lm_head.weight" not in reference["weights"]
    _check_tied(reference, ref, [tmp_path / name for name, _ in runs[:2]], resumed,
                corpus, cache_dir)
    got = load_checkpoint(resumed / "checkpoints" / str(STEPS + 1))[0]["model"]
    want = load_checkpoint(ref / "checkpoints" / str(STEPS + 1))[0]["model"]
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=2e-5, msg=k)


@pytest.mark.slow
def test_v_schedules_through_trainer(reference, corpus, cache_dir, tmp_path):
    """ZB-V and DualPipeV through the trainer: rank r holds stages r and 2p-1-r (rank 0 both
    ends). 3D (pp 2 × tp 2 + SP × ZeRO-3 over dp 2) with ZB-V, and pp 2 × ZeRO-1 with
    DualPipeV and activation checkpointing, interleaved 1F1B bounded to 3 chunk activations
    (``parallel.pipeline_inflight``), and cp 2 × ZB-V equal the single-process run; each writes a
    checkpoint of whole tensors equal to the single process's (``final_weights``)."""
    runs = [("3d_zero3_sp_zbv", {"parallel__pp": 2, "parallel__vpp": 2, "parallel__tp": 2,
                                 "parallel__zero_stage": 3, "parallel__sequence_parallel": "true",
                                 "parallel__schedule": "zb-v", "train__micro_batch_size": 1}),
            ("pp2_zero1_dualpipev_ac", {"parallel__pp": 2, "parallel__vpp": 2,
                                        "parallel__zero_stage": 1,
                                        "parallel__schedule": "dualpipe-v",
                                        "train__activation_checkpointing": "true",
                                        "train__micro_batch_size": 1}),
            ("pp2_interleaved_inflight3", {"parallel__pp": 2, "parallel__vpp": 2,
                                           "parallel__schedule": "interleaved-1f1b",
                                           "parallel__pipeline_inflight": 3,
                                           "train__micro_batch_size": 1}),
            ("cp2_pp2_zbv", {"parallel__cp": 2, "parallel__pp": 2, "parallel__vpp": 2,
                             "parallel__schedule": "zb-v", "train__micro_batch_size": 2})]
    run_distributed(train_runs, 8, _overrides(corpus, cache_dir), tmp_path, runs[:1], timeout=600)
    run_distributed(train_runs, 4, _overrides(corpus, cache_dir), tmp_path, runs[1:], timeout=600)
    for name, _ in runs:
        _check(reference, tmp_path / name, 5e-5)


@pytest.mark.slow
def test_tied_embeddings_in_a_v(corpus, cache_dir, tmp_path):
    """In a V the embedding and the tied head are both on rank 0, in two chunks whose
    backwards run apart: the head is a copy whose gradient is summed with the embedding's
    there, with no message (one shared weight would get two accumulations per micro-batch,
    which gradient buckets and ZeRO units count as one). Equal to the tied single-process
    run under data parallelism and ZeRO-3, and a tied single-process checkpoint resumes into
    ZB-V and trains one more equal step."""
    ref = tmp_path / "ref"
    train(load_config(None, tiny_overrides(corpus, cache_dir, ref, train__steps=STEPS, **DEEP,
                                           **TIED)))
    resumed = tmp_path / "tied_zbv_resumed"
    shutil.copytree(ref / "checkpoints", resumed / "checkpoints")
    v = {"parallel__pp": 2, "parallel__vpp": 2, "parallel__schedule": "zb-v",
         "train__micro_batch_size": 2, **TIED}
    runs = [("tied_zbv_dp2", v), ("tied_zbv_zero3", {**v, "parallel__zero_stage": 3}),
            ("tied_zbv_resumed", {**v, "train__steps": STEPS + 1, "checkpoint__resume": "true"})]
    run_distributed(train_runs, 4, _overrides(corpus, cache_dir), tmp_path, runs, timeout=500)
    reference = {"losses": [r["loss"] for r in metrics(ref)], "weights": final_weights(ref)}
    _check_tied(reference, ref, [tmp_path / "tied_zbv_dp2", tmp_path / "tied_zbv_zero3"],
                resumed, corpus, cache_dir)
