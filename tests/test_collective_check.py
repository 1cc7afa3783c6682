"""The collective check (``threefold.comm.collective_check``) and the hang report: ranks whose
collectives differ are stopped with one message naming the group, the ranks and the first
differing call; a rank stuck in a collective its peers never issue is named, with its axis,
within the collective timeout."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from tests.conftest import tiny_overrides
from tests.dist import run_distributed
from threefold.comm.collective_check import (CollectiveHang, CollectiveMismatch, GroupCheck, Ledger,
                                        first_difference)


def _ranks_checking(calls: dict[int, list[tuple]], groups: dict[int, list], timeout_s=5.0):
    """Each fake rank (a thread over one store) issues ``calls[rank]`` (op, axis, numel) and
    runs one check; returns each rank's exception (None when it passed)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    out: dict[int, BaseException | None] = {}

    def rank_main(rank):
        # a client of its own, as each process has: one client's wait blocks its socket
        client = dist.TCPStore("127.0.0.1", store.port, 1, is_master=False)
        led = Ledger(rank, enabled=True)
        for op, axis, numel in calls[rank]:
            led.issue(op, axis, "float32", numel)
        try:
            GroupCheck(led, client, "t", groups[rank]).check("start-up", timeout_s)
            out[rank] = None
        except Exception as e:  # noqa: BLE001 - returned for the test to read
            out[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_same_calls_pass_and_a_difference_is_named():
    groups = {0: [("dp", (0, 1)), ("world", (0, 1))], 1: [("dp", (0, 1)), ("world", (0, 1))]}
    same = [("all_reduce", "dp", 10), ("all_reduce", "edp", 4)]
    assert _ranks_checking({0: same, 1: same}, groups) == {0: None, 1: None}
    # the MoE start-up deadlock's shape, had the calls been paired: the same two reductions in
    # the other order (the element counts differ)
    other = [("all_reduce", "edp", 4), ("all_reduce", "dp", 10)]
    groups = {r: [("dp", (0, 1)), ("edp", (0, 1))] for r in (0, 1)}
    out = _ranks_checking({0: same, 1: other}, groups)
    for r in (0, 1):
        assert isinstance(out[r], CollectiveMismatch), out
        msg = str(out[r])
        assert "groups dp [0, 1], edp [0, 1]): their call 1 on these groups is" in msg, msg
        assert "all_reduce on 'dp' (#1 there) float32 × 10 (start-up)" in msg, msg
        assert "all_reduce on 'edp' (#1 there) float32 × 4 (start-up)" in msg, msg
    # one call too many on one group
    out = _ranks_checking({0: same, 1: same[:1]}, groups)
    assert "on rank 1, nothing (it issued 1 calls on them)" in str(out[0]), out


def test_a_rank_that_never_reaches_the_check_is_named():
    groups = {0: [("tp", (0, 1))]}
    t0 = time.monotonic()
    out = _ranks_checking({0: []}, groups, timeout_s=1.0)
    assert isinstance(out[0], CollectiveHang)
    assert "rank(s) 1 did not reach it within 1 s" in str(out[0])
    assert time.monotonic() - t0 < 10


def test_first_difference_reads_positions():
    """The hang report's input: positions as ``Ledger.position`` writes them; a rank with
    no record is left out, a rank that issued nothing on an axis compares as empty."""
    a = Ledger(0, True)
    b = Ledger(1, True)
    for led in (a, b):
        led.issue("all_reduce", "dp", "float32", 8)
    b.issue("all_reduce", "dp", "float32", 1)
    b.issue("broadcast", "tp", "float32", 3)
    groups = [("tp", (0, 1)), ("dp", (0, 1))]
    diff = first_difference(groups, {0: a.position(), 1: b.position()})
    assert diff.startswith("ranks 0 and 1 (groups tp [0, 1], dp [0, 1]): their call 2 on "
                           "these groups is, on rank 0, nothing"), diff
    assert diff.endswith("on rank 1, all_reduce on 'dp' (#2 there) float32 × 1 (start-up)"), diff
    assert first_difference(groups, {1: b.position()}) is None
    assert first_difference([("dp", (0, 1))], {0: a.position(), 1: a.position()}) is None


def _extra_collective(rank, world, corpus, cache, out):
    """A 2-rank run in which rank 1 issues an all-reduce on dp that rank 0 never does."""
    from threefold.config import load_config
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    cfg = load_config(None, tiny_overrides(corpus, cache, out, parallel__timeout_s=4,
                                           parallel__check_collectives="true"))
    train(cfg, Distributed(cfg))


@pytest.mark.slow
def test_extra_collective_at_startup_is_named(corpus, cache_dir, tmp_path, monkeypatch):
    """One rank issues one collective too many at start-up (``THREEFOLD_FAULT=extra``): both
    ranks stop within the collective timeout plus the report's grace, and the report names
    that rank, the axis and the call."""
    monkeypatch.setenv("THREEFOLD_FAULT", "extra:1:dp")
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as err:
        run_distributed(_extra_collective, 2, corpus, cache_dir, tmp_path / "run", timeout=90)
    text = str(err.value)
    assert time.monotonic() - t0 < 60, text[-3000:]
    # rank 0 waited at the check; rank 1 sat in the extra all-reduce
    assert "rank(s) 1 did not reach it within 4 s" in text, text[-3000:]
    assert "rank 1: start-up, inside all_reduce on dp" in text, text[-3000:]
    assert "first difference: ranks 0 and 1 (groups " in text, text[-3000:]
    assert "on rank 1, all_reduce on 'dp' (#" in text, text[-3000:]


def test_flight_recorder_environment(monkeypatch, tmp_path):
    """On CUDA the NCCL flight recorder is turned on with the run's buffer size and dump
    folder; variables the user set win; 0 turns it off; the hang report names the folder."""
    from threefold.comm.distributed import flight_recorder_env
    from threefold.comm.liveness import torch_cuda_flight_recorder

    for k in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    env = flight_recorder_env(2000, tmp_path)
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "rank"),
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "rank")}
    assert flight_recorder_env(0, tmp_path) == {}
    assert torch_cuda_flight_recorder() is None
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in flight_recorder_env(2000, tmp_path)
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/x/rank")
    assert torch_cuda_flight_recorder() == "/x/rank"
