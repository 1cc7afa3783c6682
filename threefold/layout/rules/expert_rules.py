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


@rule
def ep_nodes_tile(ep: int, dispatch: str, gpus_per_node: int, cp_tp: int) -> None:
    """The hierarchical dispatch splits ep into whole nodes: the ep ranks are cp·tp apart, so
    cp·tp divides a node's ranks and the node's ep ranks divide ep (or hold it all)."""
    if dispatch != "hierarchical" or ep == 1:
        return
    per = gpus_per_node // cp_tp if gpus_per_node % cp_tp == 0 else 0
    if not per or (ep % per and per % ep):
        raise LayoutError(f"parallel.gpus_per_node: nodes of {gpus_per_node} ranks do not tile "
                          f"the ep={ep} ranks (cp·tp={cp_tp} apart) for parallel.ep_dispatch "
                          f"hierarchical; use ranks per node a multiple of {cp_tp} whose "
                          f"quotient divides {ep} or is a multiple of it, or "
                          "parallel.ep_dispatch flat")


@rule
def ep_groups_map_to_nodes(m: ModelConfig, ep_inter: int) -> None:
    """Group-limited routing maps groups to nodes: each of the ep_inter nodes an ep group
    spans holds whole routing groups (experts are contiguous over the ep ranks), so a token
    reaches at most topk_group nodes."""
    grouped = m.num_local_experts and m.moe_router == "sigmoid_grouped" and m.n_group > 1
    if grouped and ep_inter > 1 and m.n_group % ep_inter:
        raise LayoutError(f"model.n_group: {m.n_group} routing groups do not map to the "
                          f"{ep_inter} nodes an ep group spans under parallel.ep_dispatch "
                          "hierarchical (a node must hold whole groups, so that a token "
                          f"reaches at most topk_group={m.topk_group} nodes); choose "
                          f"parallel.ep or the ranks per node so that the nodes divide "
                          f"{m.n_group}, or parallel.ep_dispatch flat")
