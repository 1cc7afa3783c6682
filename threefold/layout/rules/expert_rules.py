"""The rule book: a mixture of experts."""

from __future__ import annotations

from threefold.config import ModelConfig
from threefold.layout.rules.book import LayoutError, divisors, listed, rule


@rule
def ep_needs_experts(ep: int, experts: int) -> None:
    """Expert parallelism needs a mixture of experts."""
    if ep < 1 or (ep > 1 and not experts):
        raise LayoutError(f"parallel.ep: {ep} needs a mixture of experts "
                          "(model.num_local_experts > 0, e.g. --model.preset tiny-moe); set "
                          "parallel.ep 1 for a dense model")


@rule
def ep_divides_experts(ep: int, experts: int, dp_shard: int) -> None:
    """ep divides the experts (each ep rank holds experts / ep of every MoE layer)."""
    if experts and experts % ep:
        valid = [d for d in divisors(experts) if dp_shard % d == 0]
        raise LayoutError(f"parallel.ep: {ep} does not divide model.num_local_experts="
                          f"{experts}; use an ep in {listed(valid)}")


@rule
def ep_divides_dp_shard(ep: int, dp_shard: int) -> None:
    """Expert-parallel ranks are data-parallel ranks of one shard group: ep divides dp_shard."""
    if dp_shard % ep:
        raise LayoutError(f"parallel.ep: {ep} does not divide parallel.dp_shard={dp_shard} "
                          "(expert-parallel ranks are data-parallel ranks of one shard group); "
                          f"valid ep values: {listed(divisors(dp_shard))}")


@rule
def experts_without_sequence_parallel(experts: int, tp: int, sequence_parallel: bool) -> None:
    """A mixture of experts is whole on every tp rank: tp without sequence parallelism."""
    if experts and tp > 1 and sequence_parallel:
        raise LayoutError(f"parallel.sequence_parallel: tp={tp} with a mixture of experts "
                          f"(model.num_local_experts={experts}) runs without sequence "
                          "parallelism; set parallel.sequence_parallel false")


@rule
def experts_balance_per_layer(m: ModelConfig, pp: int) -> None:
    """Under pp a stage cannot pool the balancing loss's f and P over the other stages."""
    if m.num_local_experts and pp > 1 and m.router_aux_loss_coef > 0 \
            and not m.router_aux_loss_per_layer:
        raise LayoutError(f"model.router_aux_loss_per_layer: parallel.pp={pp} with a mixture of "
                          "experts needs the load-balancing loss per layer (a stage cannot pool "
                          "f and P over the other stages' layers): set "
                          "model.router_aux_loss_per_layer true, or model.router_aux_loss_coef 0")
