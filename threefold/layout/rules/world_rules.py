"""The rule book: the world."""

from __future__ import annotations

from threefold.config import ParallelConfig
from threefold.layout.rules.book import LayoutError, divisors, listed, rule


@rule
def divides_world(name: str, value: int, world: int) -> None:
    """Each of tp, pp, dp_replicate and cp divides the world size."""
    if value < 1 or world % value:
        raise LayoutError(f"parallel.{name}: {value} does not divide world size {world}; valid "
                          f"{name} values: {listed(divisors(world))}")


@rule
def fills_world(p: ParallelConfig, world: int) -> int:
    """pp·dp_replicate·dp_shard·cp·tp is the world size; returns dp_shard, -1 resolved to the
    rest of the world: world / (pp·dp_replicate·cp·tp)."""
    if world < 1:
        raise LayoutError(f"world size must be >= 1, got {world}")
    for name in ("tp", "pp", "dp_replicate", "cp"):
        divides_world(name, getattr(p, name), world)
    fixed = p.tp * p.pp * p.dp_replicate * p.cp
    named = f"pp·dp_replicate·cp·tp = {p.pp}·{p.dp_replicate}·{p.cp}·{p.tp} = {fixed}"
    if world % fixed:
        raise LayoutError(f"parallel: {named} does not divide world size {world}; lower one "
                          f"of them or launch a multiple of {fixed} ranks")
    rest = world // fixed
    if p.dp_shard not in (-1, rest):
        raise LayoutError(f"parallel.dp_shard: {named}, times dp_shard={p.dp_shard} is "
                          f"{fixed * p.dp_shard}, not world size {world}; set parallel.dp_shard "
                          f"to {rest} or -1 (the rest)")
    return rest


@rule
def replica_groups_data_parallel(groups: int, tp: int, pp: int, cp: int, ep: int) -> None:
    """Replica groups (``ft.replica_groups`` > 1) sum gradients and heal rank to rank, which
    holds for data parallelism and ZeRO 1-3 inside a group (rank r of every group holds the
    same tensors or shards). tp, pp, cp and ep are refused: their ranks' pieces would match
    too, but the cross-group sum and heal are not checked with them (pipeline stages also
    step on their own schedule, and tied weights are summed across stages)."""
    if groups <= 1:
        return
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if value != 1:
            raise LayoutError(f"parallel.{name}: {value} with ft.replica_groups {groups}; a "
                              "replica group trains by data parallelism or ZeRO (stages 1-3) "
                              f"alone, the cross-group sum and heal are not checked with "
                              f"{name}: set parallel.{name} 1")
