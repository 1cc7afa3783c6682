"""In-memory checkpoints (``checkpoint.memory_interval``) and the recovery ladder: two ranks
as two nodes (GROUP_RANK 0 and 1), each with its own memory directory; node k's part is also
kept by node k+1. A run resumed from its own memory, from the peer's copy after node 1's memory
is wiped, and from storage once both copies are gone, ends bitwise equal to an uninterrupted
run; the dry run's bytes are what the run holds and sends. Then a SIGKILLed rank under torchrun
(two agents as two nodes, ``--max-restarts 1``) resumes from memory, not storage."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from tests.conftest import metrics, tiny_overrides
from tests.dist import run_distributed
from tests.test_launch import _args, _env, _free_port, wait_agents
from threefold.config import load_config
from threefold.weights.checkpoint import load_checkpoint
from threefold.weights.checkpoint_memory import replica_files

BASE = {"parallel__zero_stage": 2, "checkpoint__interval": 3}
MEM = {"checkpoint__memory_interval": 2}
# memory every 3 steps, storage every 4: after 7 steps memory holds 6 (3 pruned), storage 4
LADDER = {"train__steps": 7, "checkpoint__interval": 4, "checkpoint__memory_interval": 3}


def _run(corpus, cache, root, name, **extra):
    """One run under the process group, on output ``root/name`` with node-local memory
    directories ``root/name-mem<node>``; returns (its summary, what rank 0 printed)."""
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    cfg = load_config(None, tiny_overrides(
        corpus, cache, root / name, checkpoint__memory_dir=str(root / f"{name}-mem{{node}}"),
        **{**BASE, **extra}))
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        summary = train(cfg, Distributed(cfg))
    return summary, log.getvalue()


def _copy(root, src, dst, rank):
    """``src``'s output (rank 0) and node memory directories (each rank its own) as ``dst``."""
    if rank == 0:
        shutil.copytree(root / src, root / dst)
    shutil.copytree(root / f"{src}-mem{rank}", root / f"{dst}-mem{rank}")


def _ladder(rank, world, corpus, cache, root):
    """Rank ``rank`` as node ``rank``: the reference run; a run of 7 steps without its final
    save, which leaves memory checkpoint 6 newer than storage's 4; three resumes of copies
    of it: own memory, node 1's memory wiped (node 0 holds its part), both copies of node
    1's part wiped."""
    import torch.distributed as dist

    os.environ["GROUP_RANK"] = str(rank)
    out = {"ref": _run(corpus, cache, root, "ref", train__steps=7)}
    out["x"] = _run(corpus, cache, root, "x", checkpoint__save_final="false", **LADDER)
    assert sorted(p.name for p in (root / f"x-mem{rank}").iterdir()) == ["6"]  # 3 pruned
    peer = root / f"x-mem{1 - rank}" / "6"  # the copy of this rank's files on the other node
    out["files"] = {n: (peer / n).stat().st_size for n in replica_files(rank, _Nodes())}
    with open(peer / f"rank{rank}.safetensors", "rb") as f:  # its tensors, headers aside
        out["tensors"] = out["files"][f"rank{rank}.safetensors"] - 8 - \
            struct.unpack("<Q", f.read(8))[0]
    dist.barrier()
    for name in ("own", "peer", "lost"):
        _copy(root, "x", name, rank)
    dist.barrier()
    if rank == 1:  # node 1 loses its memory; for "lost", node 0's copy of its part as well
        shutil.rmtree(root / "peer-mem1")
        shutil.rmtree(root / "lost-mem1")
        for n in ("rank1.json", "rank1.safetensors", "manifest.node1.json"):
            (root / "lost-mem0" / "6" / n).unlink()
    dist.barrier()
    for name in ("own", "peer", "lost"):
        out[name] = _run(corpus, cache, root, name, checkpoint__resume="true", **LADDER)
    return out


class _Nodes:
    """Two nodes of one rank each, as ``replica_files`` asks."""

    node_of = [0, 1]

    @staticmethod
    def is_leader(rank):
        return True


def _weights(out):
    return load_checkpoint(out / "checkpoints" / "7")[0]


@pytest.fixture(scope="module")
def ladder(corpus, cache_dir, tmp_path_factory):
    """(each rank's results of ``_ladder``, its root): one launch for the module."""
    root = tmp_path_factory.mktemp("ladder")
    return run_distributed(_ladder, 2, corpus, cache_dir, root, timeout=400), root


@pytest.mark.slow
def test_recovery_ladder_on_two_nodes(ladder, corpus, cache_dir, monkeypatch):
    from threefold.launch.dryrun import predict
    from threefold.launch.dryrun_report import memory_copy_line

    per_rank, tmp_path = ladder
    log = {name: per_rank[0][name][1] for name in ("own", "peer", "lost")}
    assert "resumed step 6 from memory" in log["own"], log["own"]
    assert "resumed step 6 from peer memory" in log["peer"], log["peer"]
    assert "memory checkpoint 6 skipped: node 1's part is in no node's memory" in log["lost"]
    assert "resumed step 4 from storage" in log["lost"], log["lost"]
    # every resume continues the uninterrupted run bit for bit
    ref, want = _weights(tmp_path / "ref"), [r["loss"] for r in metrics(tmp_path / "ref")]
    for name in ("own", "peer", "lost"):
        assert [r["loss"] for r in metrics(tmp_path / name)] == want, name
        got = _weights(tmp_path / name)
        for kind in ("model", "optim"):
            assert all(torch.equal(got[kind][k], v) for k, v in ref[kind].items()), name
    # the run ended with its final storage checkpoint: its host memory is given back
    assert not (tmp_path / "own-mem0").exists() and not (tmp_path / "own-mem1").exists()
    # the bytes: each rank's copy holds the dry run's tensor bytes; the replica's counted
    # bytes are the files it put on the other node
    monkeypatch.setenv("THREEFOLD_GPUS_PER_NODE", "1")  # two nodes of one rank, as above
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")  # no CPU probe: the bytes are the same
    cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "dry", **BASE, **MEM))
    m = predict(cfg, 2).memory_copy
    assert m.nodes == 2 and m.sent == m.own == m.peer and m.peak == 2 * (m.own + m.peer)
    assert f"sends {m.sent / 1e6:.2f} MB ({m.sent:,} bytes of tensors) to node 1 every 2 " \
        "steps" in memory_copy_line(m)
    for rank in (0, 1):
        mem = per_rank[rank]["x"][0]["memory"]
        assert mem["memory_checkpoint_tensor_bytes"] == per_rank[rank]["tensors"] == m.own
        assert mem["memory_replica_bytes_sent"] == sum(per_rank[rank]["files"].values())
        assert mem["memory_replica_bytes_received"] == \
            sum(per_rank[1 - rank]["files"].values())


def _torchrun(corpus, cache, out, fault, **extra):
    """One torchrun agent of two ranks, ``--max-restarts 1``, with ``fault``."""
    cmd = [sys.executable, "-m", "threefold", "train", "--nproc-per-node", "2",
           "--max-restarts", "1", *_args(corpus, cache, out, **extra)]
    env = {**_env(), "THREEFOLD_FAULT": fault}
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        text = wait_agents([p], timeout=300)[0]
        return p.returncode, text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, 9)


@pytest.mark.slow
def test_killed_rank_resumes_from_memory(ladder, corpus, cache_dir, tmp_path):
    """kill:1:6 with memory checkpoints every 2 steps and storage every 3: memory's 4 is
    newer than storage's 3, so the restart reads memory (the log says so; storage is not
    read) and the run ends with the uninterrupted run's losses and weights, bit for bit."""
    out = tmp_path / "killed"
    rc, text = _torchrun(corpus, cache_dir, out, "kill:1:6", train__steps=7,
                         checkpoint__memory_dir=str(tmp_path / "mem{node}"), **BASE, **MEM)
    assert rc == 0, text[-4000:]
    assert "resumed step 4 from memory" in text, text[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["restarts"] == 1 and s["resumed_from_step"] == 4 and s["lost_steps"] == 1
    ref = ladder[1] / "ref"
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(ref)]
    a, b = _weights(out), _weights(ref)
    for kind in ("model", "optim"):
        assert all(torch.equal(a[kind][k], v) for k, v in b[kind].items()), kind


@pytest.mark.parametrize("field,value,needle", [
    ("checkpoint.memory_interval", "-1", "must be a step count >= 0"),
    ("checkpoint.memory_dir", "/dev/shm/x{rank}", "placeholder other than {node}")])
def test_memory_fields_are_validated(field, value, needle, corpus, cache_dir, tmp_path):
    from threefold.config import ConfigError

    with pytest.raises(ConfigError, match=rf"{field}: .*{re.escape(needle)}"):
        load_config(None, tiny_overrides(corpus, cache_dir, tmp_path, **{
            field.replace(".", "__"): value}))


def test_unwritable_memory_dir_is_named_before_a_save(corpus, cache_dir, tmp_path):
    from threefold.config import ConfigError
    from threefold.training.train import train

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "o", train__steps=1,
                                           checkpoint__memory_interval=1,
                                           checkpoint__memory_dir=str(blocker / "m{node}")))
    with pytest.raises(ConfigError, match=r"checkpoint\.memory_dir: .*node 0.*not a directory"):
        train(cfg)
