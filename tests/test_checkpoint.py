"""Sharded checkpoints: every layout's checkpoint resumes under every other layout (optimiser
state included) and equals single-process training; damaged checkpoints are refused, naming
file and tensor; a crash during a save leaves the previous checkpoint loadable."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import tiny_overrides
from tests.dist import run_distributed
from threefold.weights.checkpoint_verify import (CheckpointError, list_checkpoints,
    verify_checkpoint)
from threefold.weights.checkpoint import load_checkpoint, save_checkpoint
from threefold.config import load_config
from threefold.training.train import train

STEPS = 6


def _losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def _segment(rank, world, corpus, cache, out, extra, steps):
    from threefold.parallel.distributed_world import Distributed

    cfg = load_config(None, tiny_overrides(corpus, cache, out, train__steps=steps,
                                           checkpoint__interval=3, checkpoint__resume="true",
                                           **extra))
    train(cfg, Distributed(cfg))


@pytest.fixture(scope="module")
def reference(corpus, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckref") / "single"
    train(load_config(None, tiny_overrides(corpus, cache_dir, out, train__steps=STEPS)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [
    ((4, {"parallel__tp": 2, "parallel__zero_stage": 3}), (2, {"parallel__zero_stage": 1})),
    ((2, {"parallel__zero_stage": 2}), (4, {"parallel__tp": 2,
                                            "parallel__sequence_parallel": "true"})),
    ((4, {"parallel__dp_replicate": 2, "parallel__zero_stage": 3}), (1, {})),
    ((4, {"parallel__pp": 2, "parallel__tp": 2, "parallel__zero_stage": 1,
          "train__micro_batch_size": 2}), (2, {"parallel__zero_stage": 3})),
    # context parallelism holds no state of its own: ZeRO shards of dp_shard × cp, and the
    # data order of the dp ranks, resume anywhere and back
    ((4, {"parallel__cp": 2, "parallel__zero_stage": 3}), (1, {})),
    ((2, {"parallel__zero_stage": 1}), (4, {"parallel__cp": 2, "parallel__tp": 2,
                                            "parallel__cp_algorithm": "allgather"})),
], ids=["tp2zero3-to-zero1", "zero2-to-tp2sp_dp2", "hybrid-to-single", "pp2tp2zero1-to-zero3",
        "cp2zero3dp2-to-single", "zero1-to-cp2tp2allgather"])
def test_resume_under_another_layout(first, second, reference, corpus, cache_dir, tmp_path):
    out = tmp_path / "run"
    (w1, e1), (w2, e2) = first, second
    run_distributed(_segment, w1, corpus, cache_dir, out, e1, 3, timeout=300)
    assert list_checkpoints(out / "checkpoints") == [3]
    manifest = verify_checkpoint(out / "checkpoints" / "3")
    assert manifest["world_size"] == w1
    if w2 == 1:
        train(load_config(None, tiny_overrides(corpus, cache_dir, out, train__steps=STEPS,
                                               checkpoint__interval=3,
                                               checkpoint__resume="true", **e2)))
    else:
        run_distributed(_segment, w2, corpus, cache_dir, out, e2, STEPS, timeout=300)
    assert _losses(out) == pytest.approx(_losses(reference), rel=1e-5)
    a, _ = load_checkpoint(out / "checkpoints" / str(STEPS))
    b, _ = load_checkpoint(reference / "checkpoints" / str(STEPS))
    for kind in ("model", "optim"):
        assert set(a[kind]) == set(b[kind])
        for k in a[kind]:
            torch.testing.assert_close(a[kind][k], b[kind][k], rtol=1e-4, atol=2e-5, msg=k)


def _small_ckpt(tmp_path, step=1):
    tensors = {"model": {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(5)},
               "optim": {"w.exp_avg": torch.zeros(3, 4), "w.exp_avg_sq": torch.ones(3, 4)},
               "rng": {"cpu_rng": torch.get_rng_state()}}
    return save_checkpoint(tmp_path / "ck", step, tensors, {"step": step}, keep_last=3)


def test_round_trip_and_keep_last(tmp_path):
    for step in (1, 2, 3, 4):
        path = _small_ckpt(tmp_path, step)
    assert list_checkpoints(tmp_path / "ck") == [2, 3, 4]
    t, state = load_checkpoint(path)
    assert state == {"step": 4}
    assert torch.equal(t["model"]["w"], torch.arange(12.0).view(3, 4))
    assert torch.equal(t["optim"]["w.exp_avg_sq"], torch.ones(3, 4))


def test_bit_flip_is_detected_naming_file_and_tensor(tmp_path):
    path = _small_ckpt(tmp_path)
    f = path / "rank0.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's bytes
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank0\.safetensors.*checksum.*tensor"):
        load_checkpoint(path)


def test_truncation_is_detected(tmp_path):
    path = _small_ckpt(tmp_path)
    f = path / "rank0.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match=r"rank0\.safetensors.*truncated"):
        load_checkpoint(path)


def test_manifest_cannot_escape(tmp_path):
    path = _small_ckpt(tmp_path)
    m = json.loads((path / "manifest.json").read_text())
    m["files"]["../../etc/passwd"] = {"bytes": 1, "sha256": "0"}
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="escapes"):
        verify_checkpoint(path)


def test_crash_during_save_keeps_previous(tmp_path, monkeypatch):
    good = _small_ckpt(tmp_path, 1)
    import threefold.weights.checkpoint as ck

    def boom(*a, **k):
        raise OSError("disk died mid-write")
    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(OSError):
        _small_ckpt(tmp_path, 2)
    assert list_checkpoints(tmp_path / "ck") == [1]  # the half-written one is not listed
    load_checkpoint(good)


def test_resume_refuses_damaged_checkpoint(corpus, cache_dir, tmp_path, capsys):
    from threefold.commands.main import main

    out = tmp_path / "run"
    train(load_config(None, tiny_overrides(corpus, cache_dir, out, train__steps=2)))
    f = out / "checkpoints" / "2" / "rank0.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    args = [a for k, v in tiny_overrides(corpus, cache_dir, out, train__steps=4)
            for a in (f"--{k}", v)]
    assert main(["train", *args, "--checkpoint.resume", "true"]) == 2
    err = capsys.readouterr().err
    assert "rank0.safetensors" in err and len(err.strip().splitlines()) == 1
    shutil.rmtree(out)
