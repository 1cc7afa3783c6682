"""Clusters the planner predicts for: ``Level`` (one level of the network) and ``Cluster``
(copies of one accelerator and the network between them). The accelerators themselves
(``Hardware``, the catalogue ``GPUS``) live in ``threefold.hardware.catalogue``, below both the
planner and the runtime's MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.hardware.catalogue import (
    Hardware,
)

__all__ = ["Cluster", "Level"]


@dataclass(frozen=True)
class Level:
    """One level of the network: groups of ``gpus`` consecutive ranks (0: every rank) whose
    traffic stays inside it, at ``bandwidth`` bytes/s per GPU per direction and ``latency_s``
    per hop, divided by ``oversubscription`` (1 = full bisection; 7 = 1:7)."""

    name: str
    gpus: int
    bandwidth: float
    latency_s: float
    oversubscription: float = 1.0

    @property
    def effective_bandwidth(self) -> float:
        """Per-GPU bandwidth a collective spanning this level gets when every GPU sends."""
        return self.bandwidth / self.oversubscription


@dataclass(frozen=True)
class Cluster:
    """``num_gpus`` copies of ``hardware``, ``gpus_per_node`` of them sharing NVLink; the
    network above the node is one level at ``hardware.inter_node_bw`` unless ``levels``
    (innermost first, the node first) say otherwise."""

    hardware: Hardware
    num_gpus: int
    gpus_per_node: int
    levels: tuple[Level, ...] = ()
    # how ranks are laid out on the GPUs, one of ``plan.topology.MESH_ORDERS``: "threefold"
    # (the runtime's mesh, pp outermost) or "dp-outer" (Llama 3's [TP, CP, PP, DP])
    mesh_order: str = "threefold"

    def topology(self) -> tuple[Level, ...]:
        """The levels, innermost first: ``levels`` or (NVLink node, network)."""
        if self.levels:
            return self.levels
        hw = self.hardware
        return (Level("nvlink", self.gpus_per_node, hw.intra_node_bw, hw.intra_node_latency_s),
                Level("network", 0, hw.inter_node_bw, hw.inter_node_latency_s))

    def __post_init__(self):
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("num_gpus and gpus_per_node must be >= 1")
