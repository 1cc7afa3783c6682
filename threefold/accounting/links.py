"""Which link each mesh axis crosses: the rank distance between an axis's neighbours and the
consecutive ranks one of its groups covers, in the runtime's mesh order (tp innermost) or a
published system's, and whether a group leaves its node."""

from __future__ import annotations

import math

from threefold.layout import Layout
from threefold.layout.axes import AXES, CP_AXES, EP_LEVELS, EXPERT_AXES, FLATTENED

def axis_stride_and_span(layout: Layout, axis: str, order: tuple[str, ...] = AXES
                         ) -> tuple[int, int]:
    """(rank distance between neighbours of ``axis``, consecutive ranks one of its groups
    covers) when ranks are laid out in ``order`` (outermost first; the runtime's is ``AXES``,
    a planner may compare with a published system's). A flattened axis ("dp", "dp_cp",
    "dp_shard_cp") takes its innermost part's stride and its outermost part's reach;
    the expert axes divide dp_shard as ``threefold.comm.mesh`` does: "ep" is its innermost ep ranks
    (dp_shard's stride), "edp_shard" the rest of dp_shard, "edp" edp_shard then dp_replicate;
    the hierarchical dispatch's levels divide ep: "ep_intra" its innermost ep_intra ranks,
    "ep_inter" the rest; the hybrid cp axes divide cp alike: "cp_inner" its innermost
    ``ulysses`` ranks (the all-to-all stays among neighbours), "cp_outer" the rest (the ring
    may cross nodes)."""
    def stride(a: str) -> int:
        return math.prod(layout.axis_size(x) for x in order[order.index(a) + 1:])

    if axis in EP_LEVELS:
        base = stride("dp_shard")
        if axis == "ep_intra":
            return base, base * layout.ep_intra
        return base * layout.ep_intra, base * layout.ep
    if axis in EXPERT_AXES:
        base = stride("dp_shard")
        if axis == "ep":
            return base, base * layout.ep
        # the outer part of dp_shard, and cp (whose stride is smaller) when above 1
        near = stride("cp") if layout.cp > 1 else base * layout.ep
        if axis == "edp_shard":
            return near, base * layout.dp_shard
        return near, max(base * layout.dp_shard, stride("dp_replicate") * layout.dp_replicate)
    if axis in CP_AXES:
        base, u = stride("cp"), layout.ulysses
        if axis == "cp_inner":
            return base, base * u
        return base * u, base * layout.cp
    parts = [a for a in FLATTENED.get(axis, (axis,)) if layout.axis_size(a) > 1] \
        or [FLATTENED.get(axis, (axis,))[-1]]
    return min(stride(a) for a in parts), max(stride(a) * layout.axis_size(a) for a in parts)


def axis_stride(layout: Layout, axis: str, order: tuple[str, ...] = AXES) -> int:
    """Rank distance between neighbours of ``axis`` (``axis_stride_and_span``'s first)."""
    return axis_stride_and_span(layout, axis, order)[0]


def axis_crosses_nodes(layout: Layout, axis: str, gpus_per_node: int) -> bool:
    """True when a group of ``axis`` is not contained in one node (it then runs at the
    network's bandwidth): its ranks span stride·size consecutive ranks, which must fit in and
    tile a node."""
    span = axis_stride(layout, axis) * layout.axis_size(axis)
    return layout.axis_size(axis) > 1 and (span > gpus_per_node or gpus_per_node % span != 0)
