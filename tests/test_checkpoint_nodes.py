"""Checkpoints on nodes that share no filesystem: two torchrun agents on 127.0.0.1 act as two
nodes, each with its own checkpoint directory (``checkpoint.dir`` with ``{node}``). Each
directory holds only its node's rank files and manifest part, rank 0's the global index; a
resume on the same layout continues exactly; a lost part is named before any tensor is read;
the parts copied together load in one process and resume under another layout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import tiny_overrides
from tests.test_launch import _args, _env, _free_port, _losses
from threefold.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from threefold.config import ConfigError, load_config
from threefold.train import train

TWO_NODE = {"parallel__zero_stage": 2, "checkpoint__interval": 3}  # each node holds half


def _two_agents(corpus, cache, out, disks, steps, **extra):
    """Run two torchrun agents (one process each) as two nodes; return (rcs, outputs)."""
    port, procs = _free_port(), []
    for node in range(2):
        cmd = [sys.executable, "-m", "threefold", "train", "--nnodes", "2", "--nproc-per-node",
               "1", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "ckptnodes",
               *_args(corpus, cache, out, train__steps=steps,
                      checkpoint__dir=str(disks / "disk{node}"), **{**TWO_NODE, **extra})]
        procs.append(subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
        time.sleep(0.5)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return [p.returncode for p in procs], outs


def _names(d):
    return sorted(p.name for p in d.iterdir())


@pytest.mark.slow
def test_two_nodes_without_shared_filesystem(corpus, cache_dir, tmp_path):
    ref = tmp_path / "ref"
    train(load_config(None, tiny_overrides(corpus, cache_dir, ref, train__steps=6,
                                           checkpoint__interval=3)))
    out, disks = tmp_path / "run", tmp_path / "disks"
    rcs, outs = _two_agents(corpus, cache_dir, out, disks, 3)
    assert rcs == [0, 0], "\n".join(o[-3000:] for o in outs)
    d0, d1 = disks / "disk0", disks / "disk1"
    assert _names(d0 / "3") == ["manifest.json", "manifest.node0.json", "rank0.json",
                                "rank0.safetensors", "state.json"]
    assert _names(d1 / "3") == ["manifest.node1.json", "rank1.json", "rank1.safetensors"]
    assert _names(d1) == ["3"]  # no probe or temporary left behind
    assert list_checkpoints(d0) == [3] and list_checkpoints(d1) == []  # the index commits
    index = json.loads((d0 / "3" / "manifest.json").read_text())
    assert sorted(index["parts"]) == ["manifest.node0.json", "manifest.node1.json"]
    assert index["parts"]["manifest.node1.json"]["files"] == ["rank1.json", "rank1.safetensors"]
    with pytest.raises(CheckpointError, match=r"node 1's part manifest\.node1\.json.*rank1"):
        load_checkpoint(d0 / "3")  # node 0's directory alone is not the whole checkpoint

    # the parts copied together: one process loads it and resumes under another layout
    merged = tmp_path / "merged"
    for d in (d0, d1):
        shutil.copytree(d / "3", merged / "checkpoints" / "3", dirs_exist_ok=True)
    shutil.copyfile(out / "metrics.jsonl", merged / "metrics.jsonl")
    train(load_config(None, tiny_overrides(corpus, cache_dir, merged, train__steps=6,
                                           checkpoint__interval=3, checkpoint__resume="true")))
    assert _losses(merged) == pytest.approx(_losses(ref), rel=1e-5)

    # same layout, each node reading its own disk: continues to the uninterrupted losses
    rcs, outs = _two_agents(corpus, cache_dir, out, disks, 6, checkpoint__resume="true")
    assert rcs == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert _losses(out) == pytest.approx(_losses(ref), rel=1e-5)
    assert list_checkpoints(d0) == [3, 6] and _names(d1) == ["3", "6"]
    for d in (d0, d1):
        shutil.copytree(d / "6", tmp_path / "together" / "6", dirs_exist_ok=True)
    a, _ = load_checkpoint(tmp_path / "together" / "6")
    b, _ = load_checkpoint(ref / "checkpoints" / "6")
    for kind in ("model", "optim"):
        assert set(a[kind]) == set(b[kind])
        for k in a[kind]:
            torch.testing.assert_close(a[kind][k], b[kind][k], rtol=1e-4, atol=2e-5, msg=k)

    # node 1's disk loses its part: every rank refuses, naming node 1's files
    shutil.rmtree(d1 / "6")
    rcs, outs = _two_agents(corpus, cache_dir, out, disks, 9, checkpoint__resume="true")
    assert all(rc != 0 for rc in rcs)
    text = "\n".join(outs)
    assert "node 1's part manifest.node1.json is missing on every node" in text, text[-3000:]
    assert "rank1.json, rank1.safetensors" in text
    assert list_checkpoints(d0) == [3, 6]  # nothing was written


def test_checkpoint_dir_is_validated(corpus, cache_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint\.dir: .*placeholder"):
        load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "o",
                                         checkpoint__dir=str(tmp_path / "d{rank}")))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "o", train__steps=1,
                                           checkpoint__dir=str(blocker / "ck{node}")))
    with pytest.raises(ConfigError, match=r"checkpoint\.dir: .*node 0.*not a directory"):
        train(cfg)
    assert not (tmp_path / "o").exists()


def test_single_process_with_checkpoint_dir(corpus, cache_dir, tmp_path):
    """One node: the checkpoint root holds rank files, node 0's part and the index; resume
    reads it back from there."""
    disk = tmp_path / "disk{node}"
    over = dict(train__steps=2, checkpoint__dir=str(disk))
    train(load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "o", **over)))
    root = tmp_path / "disk0"
    assert list_checkpoints(root) == [2] and not (tmp_path / "o" / "checkpoints").exists()
    assert "manifest.node0.json" in _names(root / "2")
    s = train(load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "o",
                                               **{**over, "train__steps": 3},
                                               checkpoint__resume="true")))
    assert s["resumed_from_step"] == 2 and list_checkpoints(root) == [2, 3]
