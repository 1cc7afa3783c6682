"""``threefold plan --max-seq-len``: for every context-parallel split (every cp algorithm the
configuration names), the longest sequence that fits is one at which a layout fits and one
granule more at which none does, found by the memory model alone in a few seconds."""

from __future__ import annotations

import dataclasses
import json

import pytest

from threefold.commands.planning import main as plan
from threefold.config import CP_ALGORITHMS, ModelConfig
from threefold.hardware.catalogue import get_hardware
from threefold.layout import Workload
from threefold.plan.candidates import SearchSpace
from threefold.plan.cluster import Cluster
from threefold.plan.longest import _fits, longest_for

TOKENS = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def setting():
    cfg = ModelConfig(preset="llama3-8b").resolved()
    return cfg, Cluster(get_hardware("h100"), 8, 8), Workload(seq_len=4096, global_batch=1024)


@pytest.mark.parametrize("cp,algorithm", [(1, "ring"), (4, "allgather")])
def test_the_longest_fits_and_one_granule_more_does_not(setting, cp, algorithm):
    cfg, cluster, work = setting
    row = longest_for(cfg, cluster, work, SearchSpace(), cp, algorithm, TOKENS, granule=4096)
    assert row.seq_len > 0 and row.seq_len % 4096 == 0 and row.best is not None
    one = SearchSpace(cp=(cp,), cp_algorithm=(algorithm,), microbatch_size=(1,))
    limit = cluster.hardware.memory_bytes

    def at(n):
        return dataclasses.replace(work, seq_len=n, global_batch=max(1, TOKENS // n))

    assert _fits(cfg, 8, at(row.seq_len), one, limit) is not None
    assert _fits(cfg, 8, at(row.seq_len + 4096), one, limit) is None
    assert row.best.memory.total <= limit and row.best.layout.cp == cp
    assert row.seconds_per_token == pytest.approx(
        row.best.step.step_time_s / (row.batch * row.seq_len))


def test_plan_max_seq_len_reports_every_split(capsys):
    """Every cp degree of the world with every algorithm in CP_ALGORITHMS (an algorithm added
    there is planned too), and the hybrids with Ulysses inside cp; tiling the MLP lengthens
    what fits without recompute."""
    args = ["--model", "llama3-8b", "--gpus", "4", "--gpu", "h100", "--max-seq-len",
            "--json", "--recompute", "none"]
    assert plan(args) == 0
    rows = json.loads(capsys.readouterr().out)
    splits = {(r["cp"], r["cp_algorithm"]) for r in rows}
    assert splits == {(1, None)} | {(cp, a) for cp in (2, 4) for a in CP_ALGORITHMS}
    # the runtime has Ulysses: the hybrids too (Ulysses over 2 ranks, the ring or the
    # all-gather over the other 2), and pure Ulysses over all
    assert "ulysses" in CP_ALGORITHMS
    hybrids = {(r["cp"], r["cp_algorithm"]) for r in rows if r["cp_ulysses"] > 1}
    assert hybrids == {(4, a) for a in CP_ALGORITHMS if a != "ulysses"}
    assert all(r["cp_ulysses"] == 2 for r in rows if r["cp_ulysses"] > 1)
    assert all(r["max_seq_len"] > 0 and r["memory_bytes_per_gpu"] <= 80e9 for r in rows)
    assert plan(args + ["--mlp-tiles", "8", "--cp", "1"]) == 0
    tiled = json.loads(capsys.readouterr().out)
    plain = next(r for r in rows if r["cp"] == 1)
    assert tiled[0]["max_seq_len"] > plain["max_seq_len"]


def test_the_splits_searched_follow_the_runtimes_algorithms(monkeypatch):
    """Each algorithm over all cp ranks; hybrids (Ulysses inside cp, a ring or all-gather over
    the rest) only where the runtime has Ulysses, at every divisor, or those asked for."""
    from threefold.plan import search as searching

    space = SearchSpace(cp_algorithm=("ring", "allgather"))
    monkeypatch.setattr(searching, "CP_ALGORITHMS", ("ring", "allgather"))
    assert searching.cp_splits(8, space) == [("ring", {}), ("allgather", {})]
    assert searching.cp_splits(1, space) == [("ring", {})]
    monkeypatch.setattr(searching, "CP_ALGORITHMS", ("ring", "allgather", "ulysses"))
    with_all = dataclasses.replace(space, cp_algorithm=("ring", "ulysses"))
    assert searching.cp_splits(8, with_all) == [
        ("ring", {}), ("ring", {"cp_ulysses": 2}), ("ring", {"cp_ulysses": 4}), ("ulysses", {})]
    asked = dataclasses.replace(space, cp_ulysses=(2,))
    assert searching.cp_splits(4, asked) == [("ring", {"cp_ulysses": 2}),
                                             ("allgather", {"cp_ulysses": 2})]
