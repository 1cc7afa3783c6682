"""Checkpoints written in the background (``checkpoint.async_save``): the files equal a
synchronous save's byte for byte at the same step, under ZeRO on two ranks; a save still being
written when the next is due is waited for with one log line; the host copy is what the dry
run predicts; a writer that fails surfaces on the main thread, commits nothing, and the run
resumes from the previous checkpoint to the same losses; a preemption commits the save it
starts before the run stops."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from tests.conftest import metrics, tiny_overrides
from tests.dist import run_distributed
from threefold.weights.checkpoint_verify import (CheckpointError, list_checkpoints, sha256_file,
    verify_checkpoint)
from threefold.config import ConfigError, load_config
from threefold.training.train import train

ZERO = {"parallel__zero_stage": 1, "checkpoint__interval": 2, "train__steps": 4}
SLOW = "slowsave:0:2:0.5"  # rank 0's writer of checkpoint 2 sleeps: still in flight after step 3


def _sync_and_async(rank, world, corpus, cache, root):
    """On each rank: the same ZeRO-1 run saved synchronously, then in the background with
    rank 0's writer slowed down, then in the background with rank 1 sent SIGTERM before step
    4 (a preemption at a save point); returns each run's log, host copy and preemption."""
    from threefold.parallel.distributed_world import Distributed

    out = {}
    # the first run of a process leaves the CPU RNG elsewhere than later ones (a one-time
    # draw), and the RNG state is in the checkpoint: a first run makes the two comparable
    asyn = {"checkpoint__async_save": "true"}
    runs = (("first", {"train__steps": 1, "checkpoint__save_final": "false"}, ""),
            ("sync", {}, ""), ("async", asyn, SLOW),
            ("preempt", {**asyn, "train__steps": 6}, "term:1:4"))
    for name, extra, fault in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name, **{**ZERO, **extra}))
        os.environ["THREEFOLD_FAULT"] = fault
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            summary = train(cfg, Distributed(cfg))
        out[name] = (log.getvalue(), summary["memory"].get("async_save_copy_bytes"),
                     summary.get("preempted"))
    os.environ.pop("THREEFOLD_FAULT")
    return out


def test_async_checkpoints_equal_sync_ones_and_wait_when_due(corpus, cache_dir, tmp_path):
    from threefold.launch.dryrun import predict

    per_rank = run_distributed(_sync_and_async, 2, corpus, cache_dir, tmp_path, timeout=300)
    sync, asyn = tmp_path / "sync" / "checkpoints", tmp_path / "async" / "checkpoints"
    assert list_checkpoints(asyn) == list_checkpoints(sync) == [2, 4]
    for step in (2, 4):
        for f in ("rank0.safetensors", "rank1.safetensors", "rank0.json", "rank1.json"):
            assert sha256_file(asyn / str(step) / f) == sha256_file(sync / str(step) / f), f
        a, s = (json.loads((d / str(step) / "state.json").read_text()) for d in (asyn, sync))
        for key in ("step", "optim_step", "sampler", "scheduler", "model_config", "layout"):
            assert a[key] == s[key], key
    assert [r["loss"] for r in metrics(tmp_path / "async")] == \
        [r["loss"] for r in metrics(tmp_path / "sync")]
    log0 = per_rank[0]["async"][0]
    waits = [ln for ln in log0.splitlines() if "still being written" in ln]
    assert len(waits) == 1 and waits[0].startswith(
        "checkpoint 2: still being written when its commit after step 3"), log0
    assert "still being written" not in per_rank[0]["sync"][0]
    # the host copy rank 0 held is the dry run's prediction
    cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "dry", **ZERO,
                                           checkpoint__async_save="true"))
    assert per_rank[0]["async"][1] == predict(cfg, 2).async_copy > 0
    assert per_rank[0]["sync"][1] is None
    # SIGTERM before step 4: the save started after step 4 is committed before the exit
    assert [r[2] for r in per_rank[0].values()] == [None, None, None, {"step": 4}]
    assert list_checkpoints(tmp_path / "preempt" / "checkpoints") == [2, 4]
    verify_checkpoint(tmp_path / "preempt" / "checkpoints" / "4")


def test_failed_background_write_raises_keeps_previous_and_resumes(corpus, cache_dir, tmp_path,
                                                                   monkeypatch):
    import threefold.weights.checkpoint as ck

    out = tmp_path / "run"
    over = dict(checkpoint__interval=2, checkpoint__async_save="true", train__steps=4,
                checkpoint__save_final="false")
    real = ck._write_rank

    def dies_at_4(tmp, *a):
        if tmp.name == ".tmp-4":
            raise OSError("disk full")
        real(tmp, *a)
    monkeypatch.setattr(ck, "_write_rank", dies_at_4)
    with pytest.raises(CheckpointError, match=r"checkpoint 4: the background write failed on "
                                              r"rank 0 \(OSError: disk full\)"):
        train(load_config(None, tiny_overrides(corpus, cache_dir, out, **over)))
    assert list_checkpoints(out / "checkpoints") == [2]
    uninterrupted = [r["loss"] for r in metrics(out)]
    monkeypatch.undo()
    train(load_config(None, tiny_overrides(corpus, cache_dir, out, **over,
                                           checkpoint__resume="true")))
    assert list_checkpoints(out / "checkpoints") == [2, 4]
    assert [r["loss"] for r in metrics(out)] == uninterrupted and len(uninterrupted) == 4


def test_async_save_without_interval_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="^checkpoint.async_save: .*checkpoint.interval is 0"):
        load_config(None, [("checkpoint.async_save", "true"),
                           ("train.output_dir", str(tmp_path))])

