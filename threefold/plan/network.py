"""Where each mesh axis runs: the topology level its groups span, by mesh order, and the
bandwidth its collectives get there.

Ranks are laid out as the mesh orders its axes: threefold's runtime (pp, dp_replicate,
dp_shard, cp, tp, outermost first; tp innermost, ``threefold.layout.axes.AXES``), or for
a published system another order (``MESH_ORDERS``: "dp-outer" is Llama 3's [TP, CP, PP, DP],
innermost first, arXiv 2407.21783 §3.3.2). A cluster's levels hold consecutive rank ranges:
the NVLink domain (a node), then e.g. a rack or leaf, a pod, the spine. A group of an axis
covers ``span`` consecutive ranks (its outermost part's stride times its size); it stays
inside the innermost level whose size that span fits in and tiles. Its collectives then run
at that level's per-GPU bandwidth and latency, and with ``per_node`` of its ranks in each
node (> 1: the hierarchical algorithm applies, ``plan.collectives``).

Oversubscription is a property of the uplinks, not of every flow: at 1:o the links leaving
each block of the level below (a pod of C GPUs) carry C/o GPUs' worth of line rate. A group
with neighbours ``stride`` ranks apart has, in a ring (or a pipeline send), one flow per
group leaving each block, and min(stride, C) groups pass through a block, so the flows out
of a block ask for min(stride, C) GPUs' line rate: each gets the line rate divided by
max(1, o·min(stride, C)/C) — 1:o only when every GPU's traffic leaves the block (stride ≥
C), nothing when few groups cross (dp outermost over 128-GPU pipelines: 128·7 < 3072).

Levels come from ``Cluster.levels``: from a ``--hardware-file`` with a ``levels`` list, or
from a catalogue cluster (``CLUSTERS``).
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.layout import Layout
from threefold.accounting import axis_stride_and_span
from threefold.layout.axes import AXES
from threefold.plan.collectives import Link
from threefold.hardware.catalogue import GB
from threefold.plan.cluster import Cluster, Level


MESH_ORDERS: dict[str, tuple[str, ...]] = {
    "threefold": AXES,  # pp, dp_replicate, dp_shard, cp, tp (outermost first)
    "dp-outer": ("dp_replicate", "dp_shard", "pp", "cp", "tp"),  # Llama 3's [TP, CP, PP, DP]
}


@dataclass(frozen=True)
class Placement:
    """The level an axis's groups stay inside, its link, and its ranks per node."""

    level: str
    index: int  # 0: inside the NVLink domain
    link: Link
    intra: Link  # the node's link (for the hierarchical algorithm)
    per_node: int
    contention: float = 1.0  # the level's oversubscription as this axis's flows feel it


def place(layout: Layout, axis: str, cluster: Cluster) -> Placement:
    """Where ``axis``'s groups run on ``cluster`` (see the module docstring)."""
    levels = cluster.topology()
    size = layout.axis_size(axis)
    stride, span = axis_stride_and_span(layout, axis, MESH_ORDERS[cluster.mesh_order])
    node = levels[0]
    intra = Link(node.latency_s, node.effective_bandwidth)
    index = len(levels) - 1
    if size <= 1:
        index = 0
    else:
        for i, lvl in enumerate(levels):
            cap = lvl.gpus or cluster.num_gpus
            if span <= cap and cap % span == 0:
                index = i
                break
    lvl = levels[index]
    contention = 1.0
    if index > 0 and lvl.oversubscription > 1:
        block = levels[index - 1].gpus or cluster.num_gpus
        contention = min(lvl.oversubscription,
                         max(1.0, lvl.oversubscription * min(stride, block) / block))
    per_node = max(1, min(size, node.gpus // stride)) if stride < node.gpus else 1
    return Placement(lvl.name, index, Link(lvl.latency_s, lvl.bandwidth / contention), intra,
                     per_node, contention)


def levels_from_record(record: list[dict], gpus_per_node: int) -> tuple[Level, ...]:
    """Levels from a hardware file's ``levels`` list, innermost first: each {"name", "gpus"
    (ranks inside; 0 or absent on the outermost: all), "gbits_per_gpu" or "gb_s_per_gpu",
    "latency_us", "oversubscription" (default 1)}. The first is the node (its gpus are
    ``gpus_per_node``)."""
    out = []
    for i, r in enumerate(record):
        try:
            bw = (r["gbits_per_gpu"] / 8 if "gbits_per_gpu" in r else r["gb_s_per_gpu"]) * GB
            lvl = Level(str(r["name"]), int(r.get("gpus", 0)), float(bw),
                        float(r["latency_us"]) * 1e-6, float(r.get("oversubscription", 1.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"--hardware-file: levels[{i}]: needs name, gpus, gbits_per_gpu "
                             f"(or gb_s_per_gpu), latency_us ({e})") from None
        if lvl.bandwidth <= 0 or lvl.oversubscription < 1 or lvl.latency_s < 0:
            raise ValueError(f"--hardware-file: levels[{i}] ({lvl.name}): bandwidth must be "
                             "positive, oversubscription >= 1, latency >= 0")
        out.append(lvl)
    if not out or out[0].gpus != gpus_per_node:
        raise ValueError(f"--hardware-file: levels[0] must be the node, gpus = "
                         f"--gpus-per-node ({gpus_per_node})")
    if any(b.gpus and a.gpus and b.gpus % a.gpus for a, b in zip(out, out[1:])):
        raise ValueError("--hardware-file: each level's gpus must be a multiple of the one "
                         "inside it")
    return tuple(out)


# Published clusters, as levels (per GPU, per direction).
# llama3-24k: Meta's Llama 3 training cluster (Llama 3 paper, arXiv 2407.21783, §3.3.1): 8 H100
# per server on NVLink; RoCE at 400 Gb/s per GPU; 16 GPUs per rack under one ToR switch; 192
# racks form a pod of 3,072 GPUs with full bisection bandwidth; 8 pods joined by aggregation
# switches at an oversubscription of 1:7. Latencies: the catalogue's per-hop figures
# (``hardware.NVLINK_LATENCY_S`` / ``NETWORK_LATENCY_S``), one more switch hop per level.
CLUSTERS: dict[str, list[dict]] = {
    "llama3-24k": [
        {"name": "nvlink", "gpus": 8, "gb_s_per_gpu": 450, "latency_us": 2},
        {"name": "rack", "gpus": 16, "gbits_per_gpu": 400, "latency_us": 6},
        {"name": "pod", "gpus": 3072, "gbits_per_gpu": 400, "latency_us": 7},
        {"name": "cluster", "gpus": 0, "gbits_per_gpu": 400, "latency_us": 8,
         "oversubscription": 7},
    ],
}
