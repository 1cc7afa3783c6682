"""The mesh of a layout: ``build_mesh`` turns a ``threefold.layout.Layout`` (the one
description of a run's layout, whose rank arithmetic is pure: ``threefold.layout.ranks``) into
one ``torch.distributed`` DeviceMesh whose named axes are the only way to reach a process
group, and ``submesh`` reaches one axis of it.

The axes are ``threefold.layout.axes``'s (``AXES``, outermost to innermost, and the flattened ones):
``dp`` is dp_replicate × dp_shard, the ranks that see different data. Context-parallel ranks
hold the same weights and see different tokens of the same sequences, so gradients are
reduced over ``dp_cp`` (dp_replicate × dp_shard × cp) and ZeRO shards over ``dp_shard_cp``
(dp_shard × cp), as torchtitan folds cp into its FSDP axis; with cp = 1 these are dp and
dp_shard.

Nothing here is global: every mesh lives on the objects, so one process can build many
layouts (tests, DPO's two models).
"""

from __future__ import annotations

from threefold.layout.axes import AXES, FLATTENED
from threefold.config import ConfigError
from threefold.layout import Layout

__all__ = ["build_mesh", "submesh"]


def build_mesh(layout: Layout, device_type: str):
    """The DeviceMesh of ``layout`` (all five axes, size-1 ones too, plus the flattened
    axes of ``FLATTENED``).

    Returns None for a world of one with no process group: every caller (``Comm`` first)
    treats None as "one rank, nothing to communicate". The process group must already be
    initialised (``threefold.comm.distributed.init_distributed``) for larger worlds.
    """
    # torch only here: the arithmetic above serves the launcher's checks and the planner,
    # which run before (or without) torch.distributed
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        if layout.world_size == 1:
            return None
        raise RuntimeError(f"build_mesh: a world of {layout.world_size} ranks needs a process "
                           "group; call threefold.comm.distributed.init_distributed() first")
    if dist.get_world_size() != layout.world_size:
        raise ConfigError(f"parallel: layout is for {layout.world_size} ranks but the process "
                          f"group has {dist.get_world_size()}")
    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=AXES)
    # torch keeps the flattened mesh on the root mesh; _flatten (torch's private API, the
    # one torchtitan uses) creates its groups once and returns the cached mesh afterwards.
    for name, parts in FLATTENED.items():
        mesh[parts]._flatten(name)
    return mesh


def submesh(mesh, axis: str):
    """The one-dimensional DeviceMesh of ``axis`` (an AXES name or a FLATTENED one).

    Reaches a flattened mesh through ``_flatten`` rather than ``mesh["dp"]``, which torch 2.13
    warns is going away for flattened axes.
    """
    if axis in FLATTENED:
        return mesh[FLATTENED[axis]]._flatten(axis)
    if axis not in AXES:
        raise KeyError(f"unknown mesh axis '{axis}'; axes: {', '.join(AXES + tuple(FLATTENED))}")
    return mesh[axis]
