"""α–β times of collectives, per algorithm, on the link (topology level) a group spans.

A collective over n ranks on a link of per-hop latency α and per-GPU bandwidth β (bytes/s per
direction) costs, for a buffer of S bytes (all-gather: the gathered output, reduce-scatter:
the input):

- ring (Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in
  MPICH", IJHPCA 2005, §4): all-gather and reduce-scatter (n−1)·α + (n−1)/n·S/β; all-reduce,
  a reduce-scatter then an all-gather, 2(n−1)·α + 2(n−1)/n·S/β. Latency grows linearly in n.
- tree all-reduce (the double binary tree NCCL 2.4 introduced, after Sanders, Speck & Träff,
  "Two-tree algorithms for full bandwidth broadcast, reduction and scan", Parallel Computing
  2009): a pipelined reduce up and broadcast down two complementary trees, each carrying half
  the data, so the bandwidth term stays that of the ring while the latency is 2·⌈log2 n⌉·α.
  NCCL picks the faster algorithm per call; so does ``all_reduce_time``.
- hierarchical (two levels): when a group has g > 1 ranks in each node and spans k = n/g
  nodes, the intra-node part runs over NVLink and only the inter-node part pays the network's
  α: all-reduce = reduce-scatter inside the node + all-reduce of S/g across nodes (ring or
  tree) + all-gather inside the node; all-gather and reduce-scatter likewise with one
  inter-node stage of S/g. The network term is that of S/g over k nodes per GPU, as every
  GPU drives its own network card (rail-optimised clusters).
- ring over nodes (all-gather and reduce-scatter of a group with g > 1 ranks in each of
  k = n/g nodes): what NCCL runs for them, one ring through all n ranks (NCCL has no
  hierarchical all-gather; its tree serves all-reduce only, and its PAT algorithm one rank
  per node only). Of the ring's n − 1 steps, k − 1 cross the network and n − k stay on
  NVLink, so the latency is (k−1)·α_net + (n−k)·α_node, as NCCL's own tuning model counts
  it: over 1,024 ranks in 128 nodes that is 127 network and 896 NVLink hops, 2.6 ms at 6
  and 2 µs, against 0.8 ms for a two-level form, and it is paid per call whatever the
  message. The bandwidth term is (n−1)/n·S at min(β_node, g·β_net): the ring's NVLink hops
  run at the node's rate, and its node crossings, spread by NCCL's channels over the g
  GPUs' network cards, at g cards' rate.
- point-to-point: α + S/β.

The planner takes, per call, the fastest of the algorithms that apply (``collective_time``):
flat ring and tree over the slowest link the group crosses, and the hierarchical form when
the group has several ranks per node (all-reduce); an all-gather or reduce-scatter across
nodes with several ranks per node runs the ring over nodes. These are the closed forms only; the constants (α, β
per level) are in ``threefold.plan.cluster`` and may be measured (``--calibrate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A link a group's traffic crosses: per-hop latency (s) and per-GPU bandwidth (bytes/s,
    per direction, after oversubscription)."""

    latency_s: float
    bandwidth: float


def ring_time(op: str, n: int, size: float, link: Link) -> float:
    """Ring all-reduce, all-gather or reduce-scatter (Thakur et al. 2005) over ``n`` ranks."""
    if n <= 1:
        return 0.0
    hops = 2 * (n - 1) if op == "all_reduce" else n - 1
    frac = (2 if op == "all_reduce" else 1) * (n - 1) / n
    return hops * link.latency_s + frac * size / link.bandwidth


def tree_all_reduce_time(n: int, size: float, link: Link) -> float:
    """Double-binary-tree all-reduce: 2·⌈log2 n⌉ hops of latency, the ring's bandwidth term."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.latency_s + 2 * (n - 1) / n * size / link.bandwidth


def all_reduce_time(n: int, size: float, link: Link) -> float:
    """The faster of ring and tree, as NCCL chooses."""
    return min(ring_time("all_reduce", n, size, link), tree_all_reduce_time(n, size, link))


def hierarchical_time(op: str, n: int, size: float, per_node: int, intra: Link,
                      inter: Link) -> float:
    """Two-level collective: ``per_node`` ranks of the group in each node (over ``intra``),
    n/per_node nodes (over ``inter``)."""
    g = max(1, min(per_node, n))
    k = n // g
    inner = ring_time("reduce_scatter", g, size, intra)  # = the all-gather's time
    if op == "all_reduce":
        return 2 * inner + all_reduce_time(k, size / g, inter)
    return inner + ring_time(op, k, size / g, inter)


def ring_over_nodes_time(n: int, size: float, per_node: int, intra: Link,
                         inter: Link) -> float:
    """NCCL's ring all-gather or reduce-scatter over ``n`` ranks, ``per_node`` of them in
    each node (see the module docstring): (k−1)·α_net + (n−k)·α_node + (n−1)/n·S over
    min(β_node, per_node·β_net)."""
    g = max(1, min(per_node, n))
    k = n // g
    rate = min(intra.bandwidth, g * inter.bandwidth)
    return (k - 1) * inter.latency_s + (n - k) * intra.latency_s + (n - 1) / n * size / rate


def collective_time(op: str, n: int, size: float, link: Link, per_node: int = 1,
                    intra: Link | None = None) -> float:
    """Time of one call of ``op`` (all_reduce, all_gather, reduce_scatter, all_to_all, p2p)
    on ``size`` bytes over ``n`` ranks whose slowest link is ``link``; with ``per_node`` > 1
    ranks of the group per node and the node's link ``intra``, the hierarchical algorithm is
    a candidate too. all_to_all: (n−1) messages of S/n each way, pairwise exchange."""
    if op == "p2p":
        return link.latency_s + size / link.bandwidth
    if n <= 1:
        return 0.0
    if op == "all_to_all":
        return (n - 1) * link.latency_s + (n - 1) / n * size / link.bandwidth
    nodes = per_node > 1 and intra is not None and n > per_node and n % per_node == 0
    if op != "all_reduce" and nodes:
        return ring_over_nodes_time(n, size, per_node, intra, link)
    best = all_reduce_time(n, size, link) if op == "all_reduce" else ring_time(op, n, size, link)
    if nodes:
        best = min(best, hierarchical_time(op, n, size, per_node, intra, link))
    return best
