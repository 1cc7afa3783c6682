"""Comm: values of every op on 2 and 4 ranks, exact byte counts, async handles, world of one;
plus the process-group helpers and the test launcher itself."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
from tests.dist import run_checks, run_distributed
from threefold.comm.counted import Comm
from threefold.config import ParallelConfig
from threefold.comm.distributed import init_distributed, set_timeout
from threefold.layout import Layout
from threefold.comm.mesh import build_mesh

F32 = 4  # bytes per fp32 element


def make_comm(world: int, **kw) -> Comm:
    """A Comm over ParallelConfig(**kw) on the running process group."""
    dims = Layout.from_parallel(ParallelConfig(**kw), world)
    return Comm(dims, build_mesh(dims, "cpu"))


def chunk(numel: int, n: int, i: int) -> int:
    """tensor_split's chunk i of numel elements in n pieces (the accounting's layout)."""
    return numel // n + (1 if i < numel % n else 0)


# ------------------------------------------------------------------ workers (run on every rank)
def dp_ops(rank: int, world: int) -> dict:
    """Every collective over the dp axis (all ranks) and the size-1 tp axis, and the warnings
    they raised (none: Comm uses the non-deprecated reduce_scatter/all_gather_single)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _dp_ops(rank, world)
    out["warnings"] = [str(w.message) for w in caught]
    return out


def _dp_ops(rank: int, world: int) -> dict:
    comm, n, out = make_comm(world), world, {}
    comm.set_step(3)
    psi = 12 * n  # a parameter count divisible by N
    g = torch.full((psi,), float(rank + 1))
    comm.all_reduce(g, "dp")
    out["sum"] = g[0].item()
    out["ar_bytes"] = comm.step_counters()
    m = torch.tensor([float(rank), -float(rank)])
    comm.all_reduce(m, "dp", op="max")
    out["max"] = m.tolist()
    a = torch.full((5,), float(rank))
    comm.all_reduce(a, "dp", op="avg")
    out["avg"] = a[0].item()
    odd = torch.ones(7)  # 7 elements do not divide by N: per-rank counts differ
    before = comm.totals()["dp"]["all_reduce"]
    comm.all_reduce(odd, "dp")
    out["odd_bytes"] = comm.totals()["dp"]["all_reduce"] - before
    comm.step_counters()

    inp = torch.arange(3 * n, dtype=torch.float32) + rank  # N chunks of 3
    rs = torch.empty(3)
    comm.reduce_scatter(rs, inp, "dp")
    out["rs"] = rs.tolist()
    ag = torch.empty(2 * n)
    comm.all_gather(ag, torch.tensor([float(rank), 10.0 + rank]), "dp")
    out["ag"] = ag.tolist()
    b = torch.full((6,), float(rank))
    comm.broadcast(b, 1, "dp")
    out["bc"] = b.tolist()
    a2a_in = torch.arange(n, dtype=torch.float32) + 100 * rank  # row j goes to rank j
    a2a = torch.empty(n)
    comm.all_to_all_single(a2a, a2a_in, "dp")
    out["a2a"] = a2a.tolist()
    out["uneven"] = comm.all_gather_uneven(torch.full((rank + 1,), float(rank)), "dp").tolist()
    out["window"] = comm.step_counters()
    out["window_after_reset"] = comm.step_counters()

    # async: the handle completes the op (avg divides only after wait)
    x = torch.full((4,), float(rank + 1))
    h = comm.all_reduce(x, "dp", op="avg", async_op=True)
    h.wait()
    out["async_avg"] = x[0].item()
    y, z = torch.empty(2 * n), torch.empty(2)
    h1 = comm.all_gather(y, torch.full((2,), float(rank)), "dp", async_op=True)
    h2 = comm.reduce_scatter(z, torch.ones(2 * n), "dp", async_op=True)
    h1.wait()
    h2.wait()
    out["async_ag"], out["async_rs"] = y.tolist(), z.tolist()

    # tp has one rank here: local semantics, no c10d, zero bytes, but counted as calls
    t = torch.full((4,), 7.0)
    h = comm.all_reduce(t, "tp", async_op=True)
    out["tp_local"] = (h.is_completed(), t.tolist())
    o = torch.empty(4)
    comm.all_gather(o, torch.arange(4.0), "tp")
    out["tp_gather"] = o.tolist()
    out["tp_size"] = (comm.size("tp"), comm.rank("tp"), comm.size("dp"), comm.rank("dp"))
    out["stats"], out["totals"] = comm.stats(), comm.totals()
    out["recent"] = comm.recent()
    comm.barrier()
    return out


def hybrid_ops(rank: int, world: int) -> dict:
    """4 ranks as dp_replicate 2 × tp 2, then pp 2 × tp 2 with point-to-point."""
    comm, out = make_comm(world, dp_replicate=2, dp_shard=1, tp=2), {}
    for axis in ("tp", "dp_replicate", "dp_shard", "dp", "world"):
        t = torch.tensor([float(rank)] * 4)
        comm.all_reduce(t, axis)
        out[axis] = (t[0].item(), comm.dims.axis_ranks(rank, axis))
    out["bytes"] = comm.step_counters()
    pp = make_comm(world, pp=2, tp=2, dp_shard=1)
    peer = pp.dims.axis_ranks(rank, "pp")[1 - pp.rank("pp")]
    send, recv = torch.full((3,), float(rank)), torch.empty(3)
    pp.batch_isend_irecv([("send", send, peer), ("recv", recv, peer)])
    out["p2p"] = (peer, recv.tolist(), pp.stats()["pp"])
    h = pp.batch_isend_irecv([("send", send * 2, peer), ("recv", recv, peer)], async_op=True)
    h.wait()
    out["p2p_async"] = recv.tolist()
    with pytest.raises(ValueError, match="bad op"):
        pp.batch_isend_irecv([("send", send, rank)])
    return out


def timeout_turns_hang_into_error(rank: int, world: int) -> tuple:
    """A short timeout on a spare group: rank 0 waits alone and must get an error quickly."""
    import torch.distributed as dist

    spare = dist.new_group(list(range(world)))
    changed = set_timeout(1.0, [spare])
    result = None
    if rank == 0:
        t0 = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1), group=spare)
            result = "no error"
        except RuntimeError as e:
            result = (time.perf_counter() - t0, "Timed out" in str(e))
    comm = make_comm(world)
    t = torch.ones(1)
    comm.all_reduce(t, "world")  # the world group is unaffected
    return changed, result, t.item(), os.environ["TORCHELASTIC_USE_AGENT_STORE"]


def raises_on_rank_one(rank: int, world: int) -> int:
    """Fails on rank 1 only; rank 0 then blocks in a collective and must be stopped."""
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    torch.distributed.all_reduce(torch.ones(1))
    return rank


def sleeps_on_rank_zero(rank: int, world: int) -> int:
    """Rank 0 never finishes."""
    if rank == 0:
        time.sleep(60)
    return rank


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("world", [2, 4])
def test_dp_collectives_values_and_exact_bytes(world):
    res = run_checks(world, [dp_ops] + ([timeout_turns_hang_into_error] if world == 2 else []))
    n, psi = world, 12 * world
    for rank, r in enumerate(res[0]):
        assert r["sum"] == n * (n + 1) / 2
        # ZeRO §7: a ring all-reduce of Ψ elements sends 2Ψ(N−1)/N elements per rank
        assert r["ar_bytes"] == {"dp": 2 * psi * (n - 1) // n * F32}
        assert r["max"] == [n - 1, 0]
        assert r["avg"] == (n - 1) / 2
        assert r["odd_bytes"] == 2 * (7 - chunk(7, n, rank)) * F32
        inp_sum = [sum(j + q for q in range(n)) for j in range(3 * n)]
        assert r["rs"] == inp_sum[3 * rank:3 * rank + 3]
        assert r["ag"] == [v for q in range(n) for v in (q, 10 + q)]
        assert r["bc"] == [1.0] * 6
        assert r["a2a"] == [rank + 100 * q for q in range(n)]
        assert r["uneven"] == [float(q) for q in range(n) for _ in range(q + 1)]
        rs_b, ag_b = (n - 1) * 3 * F32, (n - 1) * 2 * F32
        bc_b = 0 if rank == 0 else 6 * F32  # chain from rank 1 ends at rank 0
        a2a_b, unev_b = (n - 1) * F32, (n - 1) * ((rank + 1) * F32 + 8)
        assert r["window"] == {"dp": rs_b + ag_b + bc_b + a2a_b + unev_b}
        assert r["window_after_reset"] == {"dp": 0}
        assert r["async_avg"] == (n + 1) / 2
        assert r["async_ag"] == [float(q) for q in range(n) for _ in range(2)]
        assert r["async_rs"] == [float(n)] * 2
        assert r["tp_local"] == (True, [7.0] * 4) and r["tp_gather"] == [0.0, 1, 2, 3]
        assert r["tp_size"] == (1, 0, n, rank)
        assert r["warnings"] == []
        tp = r["stats"]["tp"]
        assert tp["all_reduce"]["calls"] == 1 and tp["all_reduce"]["bytes"] == 0
        assert r["totals"]["tp"] == {"all_reduce": 0, "all_gather": 0}
        dp = r["stats"]["dp"]
        assert dp["all_reduce"]["calls"] == 5 and dp["all_gather"]["calls"] == 4
        assert dp["reduce_scatter"]["seconds"] > 0
        assert r["recent"][0]["op"] == "all_reduce" and r["recent"][0]["shape"] == (psi,)
        assert r["recent"][0]["axis"] == "dp" and r["recent"][0]["step"] == 3
        assert all(rec["axis"] == "dp" for rec in r["recent"])  # local tp ops never reach c10d
    # summed over ranks, the odd-sized all-reduce still moves exactly 2(N−1)·nbytes
    assert sum(r["odd_bytes"] for r in res[0]) == 2 * (n - 1) * 7 * F32
    if world == 2:
        for rank, (changed, result, total, agent) in enumerate(res[1]):
            assert changed == 1 and total == 2.0 and agent == "True"
        elapsed, timed_out = res[1][0][1]
        assert timed_out and elapsed < 10.0


def test_hybrid_axes_and_point_to_point_on_4_ranks():
    res = run_distributed(hybrid_ops, 4)
    for rank, r in enumerate(res):
        for axis in ("tp", "dp_replicate", "dp_shard", "dp", "world"):
            total, ranks = r[axis]
            assert total == sum(ranks) and rank in ranks
        assert r["tp"][1] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["dp_replicate"][1] == [rank % 2, rank % 2 + 2]
        assert r["dp_shard"][1] == [rank]
        size2 = 2 * (4 - 2) * F32  # all-reduce of 4 fp32 over 2 ranks
        assert r["bytes"] == {"tp": size2, "dp_replicate": size2, "dp_shard": 0, "dp": size2,
                              "world": 2 * (4 - 1) * F32}
        peer, got, stats = r["p2p"]
        assert peer == (rank + 2) % 4 and got == [float(peer)] * 3
        assert stats["send"]["bytes"] == 3 * F32 and stats["recv"]["bytes"] == 0
        assert stats["recv"]["bytes_received"] == 3 * F32 and stats["send"]["calls"] == 1
        assert r["p2p_async"] == [2.0 * peer] * 3


def test_world_of_one_needs_no_process_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    env = init_distributed(timeout_s=5, device="cpu")
    assert (env.rank, env.world_size, env.backend, env.is_distributed) == (0, 1, None, False)
    assert env.device == torch.device("cpu") and not torch.distributed.is_initialized()
    dims = Layout.from_parallel(ParallelConfig(), 1)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    t = torch.arange(4.0)
    assert comm.all_reduce(t, "dp", op="avg") is None and t.tolist() == [0, 1, 2, 3]
    assert comm.all_reduce(t, "world", async_op=True).is_completed()
    out = torch.empty(4)
    comm.reduce_scatter(out, t * 2, "dp_shard")
    assert out.tolist() == [0, 2, 4, 6]
    comm.broadcast(t, 0, "tp")
    comm.barrier()
    assert comm.all_gather_uneven(t, "dp").tolist() == [0, 1, 2, 3]
    assert comm.group("dp") is None and comm.groups() == [] and comm.recent() == []
    assert comm.step_counters() == {"dp": 0, "world": 0, "dp_shard": 0, "tp": 0}
    assert comm.size("cp") == 1 and comm.size("dp_cp") == 1
    assert comm.stats()["dp"]["all_reduce"]["calls"] == 1
    with pytest.raises(ValueError, match="bad op"):
        comm.batch_isend_irecv([("send", t, 1)])
    with pytest.raises(ValueError, match="expected 1 × 4"):
        comm.reduce_scatter(out, torch.ones(8), "dp")
    assert comm.size("ep") == comm.size("edp") == 1  # expert axes exist, of one rank here
    with pytest.raises(KeyError, match="unknown mesh axis"):
        comm.size("xp")
    with pytest.raises(ValueError, match="needs a mesh"):
        Comm(Layout.from_parallel(ParallelConfig(), 2))


def test_launcher_reports_the_failing_rank_and_stops_the_rest():
    t0 = time.perf_counter()
    with pytest.raises(AssertionError) as e:
        run_distributed(raises_on_rank_one, 2, timeout=60)
    msg = str(e.value)
    # rank 1 is named first; rank 0 (whose all_reduce lost its peer) may follow it
    assert "raises_on_rank_one, world_size=2):\n--- rank 1 failed first:" in msg
    assert "deliberate failure on rank 1" in msg
    assert time.perf_counter() - t0 < 30  # not the 60 s timeout


def test_launcher_timeout_names_the_hung_rank_with_its_stack():
    with pytest.raises(AssertionError) as e:
        run_distributed(sleeps_on_rank_zero, 2, timeout=4)
    msg = str(e.value)
    assert "timed out after 4 s; ranks [0] did not finish" in msg
    assert "in sleeps_on_rank_zero" in msg  # the hung rank's Python stack
