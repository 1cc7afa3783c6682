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
from tests.test_launch import _args, _env, _free_port, _losses, wait_agents
from threefold.weights.checkpoint_verify import CheckpointError, list_checkpoints
from threefold.weights.checkpoint import load_checkpoint
from threefold.config import ConfigError, load_config
from threefold.training.train import train

TWO_NODE = {"parallel__zero_stage": 2, "checkpoint__interval": 3}  # each node holds half


def _two_agents(corpus, cache, out, disks, steps, **extra):
    """Run two torchrun agents (one process each) as two nodes; return (rcs, outputs). Not
    retried: a finished run exits 0 on every rank (threefold.comm.distributed.shutdown), and an
    agent whose worker failed leaves the other in torchrun's exit barrier for 300 s, so a
    hang here is a failure, reported with both agents' output."""
    port, procs = _free_port(), []
    for node in range(2):
        cmd = [sys.executable, "-m", "threefold", "train", "--nnodes", "2",
               "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", f"ckptnodes{port}",
               *_args(corpus, cache, out, train__steps=steps,
                      checkpoint__dir=str(disks / "disk{node}"), **{**TWO_NODE, **extra})]
        procs.append(subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
        time.sleep(0.5)
    outs = wait_agents(procs)
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
    reads it back from there, and the run directory still names its checkpoints for a
    Hugging Face export and ``checkpoint.init_from`` (through its config.json)."""
    from threefold.weights.hf import export_hf, load_pretrained

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
    weights = load_checkpoint(root / "3")[0]["model"]
    _, loaded = load_pretrained(tmp_path / "o")
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    export_hf(tmp_path / "o", tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    _, exported = load_pretrained(tmp_path / "hf")
    assert all(torch.equal(exported[k], v) for k, v in weights.items())


# ---- the save/load protocol with two "nodes" as threads (fast; no process group) ----------
def _thread_groups(n):
    import threading

    from threefold.weights.checkpoint_verify import NodeGroup

    bar, slots = threading.Barrier(n), [None] * n

    def all_gather(rank, obj):
        bar.wait()
        slots[rank] = obj
        bar.wait()
        out = list(slots)
        bar.wait()
        return out

    return [NodeGroup(list(range(n)), bar.wait,
                      lambda o, r=r: all_gather(r, o) if r == 0 else (all_gather(r, o), None)[1],
                      lambda o, r=r: all_gather(r, o), lambda o, r=r: all_gather(r, o)[0])
            for r in range(n)]


def _in_threads(fn, n=2):
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(n) as ex:
        futs = [ex.submit(fn, r, g) for r, g in enumerate(_thread_groups(n))]
        out = []
        for f in futs:
            try:
                out.append(f.result(timeout=60))
            except Exception as e:  # noqa: BLE001 - returned for the test to check
                out.append(e)
        return out


W = torch.arange(12.0)


def _save_two(roots, step):
    from threefold.weights.checkpoint_verify import Piece
    from threefold.weights.checkpoint import save_sharded

    def one(rank, g):
        piece = Piece("w", "model", W[rank * 6:(rank + 1) * 6], rank * 6, rank * 6 + 6, (3, 4))
        save_sharded(roots[rank], step, rank, 2, [piece], {"cpu_rng": torch.ones(2) * rank},
                     {"step": step} if rank == 0 else None, 1, group=g)
    assert _in_threads(one) == [None, None]


def test_nodes_protocol_in_threads(tmp_path):
    from threefold.weights.checkpoint import load_sharded

    roots = [tmp_path / "n0", tmp_path / "n1"]
    _save_two(roots, 1)
    _save_two(roots, 2)  # keep_last 1: step 1 pruned on both nodes
    assert _names(roots[0]) == ["2"] and _names(roots[1]) == ["2"]
    assert _names(roots[1] / "2") == ["manifest.node1.json", "rank1.json", "rank1.safetensors"]
    got = _in_threads(lambda r, g: load_sharded(roots[r], 2, r, g))
    for rank, (t, state) in enumerate(got):  # node 1's half came over the "network"
        assert torch.equal(t["model"]["w"], W.view(3, 4)) and state == {"step": 2}
        assert torch.equal(t["rng"]["cpu_rng"], torch.ones(2) * rank)
    (roots[1] / "2" / "rank1.safetensors").unlink()
    errs = _in_threads(lambda r, g: load_sharded(roots[r], 2, r, g))
    assert all(isinstance(e, CheckpointError) and "node 1's part" in str(e)
               and "rank1.safetensors" in str(e) for e in errs), errs


def test_async_save_across_nodes_equals_the_sync_one(tmp_path, monkeypatch):
    """checkpoint.async_save on two nodes without a shared directory: the writers' digests
    make the same node parts and index as a synchronous save's leaders reading the files,
    and the leaders read none again."""
    import threefold.weights.checkpoint as checkpoint
    from threefold.weights.checkpoint_verify import Piece, sha256_file
    from threefold.weights.checkpoint_async import AsyncSaver

    sync, asyn = [tmp_path / "s0", tmp_path / "s1"], [tmp_path / "a0", tmp_path / "a1"]
    _save_two(sync, 2)

    def reread(tmp, rank):  # the commit's describe step, had it not the writers' digests
        raise AssertionError(f"rank {rank}'s files hashed again at the commit")
    monkeypatch.setattr(checkpoint, "rank_digests", reread)  # the writers hold their own

    def one(rank, g):
        piece = Piece("w", "model", W[rank * 6:(rank + 1) * 6], rank * 6, rank * 6 + 6, (3, 4))
        saver = AsyncSaver()
        saver.start(asyn[rank], 2, rank, 2, [piece], {"cpu_rng": torch.ones(2) * rank},
                    {"step": 2} if rank == 0 else None, 1, g)
        return saver.finish()[0]
    assert _in_threads(one) == [2, 2]
    for s, a in zip(sync, asyn):
        assert _names(a / "2") == _names(s / "2")
        for f in _names(s / "2"):
            assert sha256_file(a / "2" / f) == sha256_file(s / "2" / f), f


def test_nodes_sharing_one_directory(tmp_path):
    root = tmp_path / "shared"
    _save_two([root, root], 3)
    assert _names(root) == ["3"]
    t, _ = load_checkpoint(root / "3")
    assert torch.equal(t["model"]["w"], W.view(3, 4))


def test_version_2_still_loads(tmp_path):
    from threefold.weights.checkpoint import save_checkpoint
    from threefold.weights.checkpoint_verify import sha256_file

    path = save_checkpoint(tmp_path / "ck", 1, {"model": {"w": W.view(3, 4)}, "optim": {},
                                               "rng": {}}, {"step": 1}, 1)
    (path / "manifest.node0.json").unlink()
    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
             for f in path.iterdir() if f.name != "manifest.json"}
    (path / "manifest.json").write_text(json.dumps({"format_version": 2, "step": 1,
                                                    "world_size": 1, "files": files}))
    t, state = load_checkpoint(path)
    assert torch.equal(t["model"]["w"], W.view(3, 4)) and state == {"step": 1}
