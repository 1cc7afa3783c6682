"""Which node each rank runs on, learnt once at start-up, and the mesh checked against it.

Every rank sends (hostname, local rank) to every other through the communication layer's
object all-gather on the world (``gather_topology``: one call, the same on every rank, in
rank order). A rank's node is its hostname. The planner warns when a layout's tp group would
leave a node (``plan.traps.layout_warnings``, from GPUs per node); here the same trap is seen
in the running job, from where the ranks really are: tp's collectives (every layer's) or
cp's K/V exchange across the network.

``THREEFOLD_TEST_HOSTNAME`` replaces the hostname where it is read: test-only, so that two
launcher agents on one machine look like two nodes.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from threefold.comm.counted import Comm
    from threefold.layout import Layout

TEST_HOSTNAME_ENV = "THREEFOLD_TEST_HOSTNAME"  # test-only: this process's node name
CHECKED_AXES = ("tp", "cp")  # axes whose traffic is meant to stay inside a node


def checked_axes(dims: Layout) -> tuple[str, ...]:
    """The axes of ``dims`` whose traffic is meant to stay inside a node: tp, and cp, or of
    a hybrid cp only its all-to-all part (cp_inner); its ring (cp_outer) may cross nodes,
    which is what the hybrid is for."""
    return ("tp", "cp_inner") if dims.cp_axes == ("cp_inner", "cp_outer") else CHECKED_AXES


def hostname() -> str:
    """This process's node: its hostname, or ``$THREEFOLD_TEST_HOSTNAME`` (test-only)."""
    return os.environ.get(TEST_HOSTNAME_ENV) or socket.gethostname()


@dataclass(frozen=True)
class Topology:
    """The node (hostname) and local rank of every global rank, in rank order."""

    hosts: tuple[str, ...]
    local_ranks: tuple[int, ...]

    @property
    def nodes(self) -> list[str]:
        """The nodes, in the order of their first rank."""
        return list(dict.fromkeys(self.hosts))

    @property
    def ranks_per_node(self) -> list[int]:
        """How many ranks each node of ``nodes`` runs."""
        return [self.hosts.count(h) for h in self.nodes]

    def describe(self) -> str:
        """E.g. '2 nodes × 4 ranks', or '2 nodes (4+2 ranks)' when they differ."""
        n, per = len(self.nodes), self.ranks_per_node
        nodes = f"{n} node{'s' if n > 1 else ''}"
        if len(set(per)) == 1:
            return f"{nodes} × {per[0]} rank{'s' if per[0] > 1 else ''}"
        return f"{nodes} ({'+'.join(map(str, per))} ranks)"

    def spanning_groups(self, dims: Layout, axis: str) -> list[list[int]]:
        """The groups of ``axis`` whose ranks sit on more than one node."""
        if dims.axis_size(axis) == 1:
            return []
        return [g for g in dims.axis_groups(axis) if len({self.hosts[r] for r in g}) > 1]

    def warnings(self, dims: Layout) -> list[str]:
        """One line per axis of ``checked_axes`` that has a group across nodes (and the
        hierarchical ep dispatch's node level, whose nodes ``parallel.gpus_per_node`` says)."""
        out, per_node = [], min(self.ranks_per_node)
        # tp is the mesh's innermost axis and cp the next (a hybrid's Ulysses ranks
        # innermost in it): torchrun numbers ranks node by node, so tp (cp·tp,
        # cp_ulysses·tp) dividing a node's ranks keeps every group inside one
        fix = {"tp": "parallel.tp", "cp": "parallel.cp × parallel.tp",
               "cp_inner": "parallel.cp_ulysses × parallel.tp",
               "ep_intra": "parallel.gpus_per_node"}
        hierarchical = dims.ep > 1 and dims.ep_dispatch == "hierarchical"
        for axis in checked_axes(dims) + (("ep_intra",) if hierarchical else ()):
            groups = self.spanning_groups(dims, axis)
            if groups:
                where = ", ".join(f"{r} on {self.hosts[r]}" for r in groups[0])
                out.append(f"threefold: warning: {axis}={dims.axis_size(axis)} spans nodes "
                           f"(ranks {where}; {len(groups)} of {len(dims.axis_groups(axis))} "
                           f"{axis} groups): its traffic goes over the network; choose "
                           f"{fix[axis]} dividing the {per_node} ranks of a node")
        return out

    def summary(self, dims: Layout) -> dict:
        """What summary.json records: nodes × ranks per node, the axes across nodes."""
        return {"nodes": len(self.nodes), "ranks_per_node": self.ranks_per_node,
                "node_names": self.nodes,
                "axes_across_nodes": [a for a in (*checked_axes(dims), "cp_outer")
                                      if self.spanning_groups(dims, a)]}


def gather_topology(comm: Comm, local_rank: int) -> Topology:
    """Collective over the world: every rank's (hostname, local rank), in rank order."""
    pairs = comm.all_gather_object((hostname(), local_rank), "world")
    return Topology(tuple(h for h, _ in pairs), tuple(int(lr) for _, lr in pairs))
