"""The hierarchical expert dispatch (``parallel.ep_dispatch hierarchical``): each token crosses
the network once per node that holds one of its experts, then fans out inside that node, as
DeepSeek-V3 trains (arXiv 2412.19437 §3.2.2: "each token ... is first transmitted via IB to
the GPUs with the same in-node index on its target nodes ... then forwarded via NVLink") and
DeepEP's internode kernels run.

The ep ranks are ep_inter × ep_intra (``threefold.layout.axes.EP_LEVELS``): ep index
i = node · ep_intra + local index, so node j holds the experts
[j·E/ep_inter, (j+1)·E/ep_inter). With group-limited routing (``moe_router
sigmoid_grouped``) and n_group a multiple of ep_inter, a node holds whole routing groups and a
token reaches at most ``topk_group`` nodes (``threefold.layout.rules.ep_groups_map_to_nodes``).

One MoE layer's forward on rank (node a, local index b), N tokens, k experts each:

1. pairs: the distinct (destination node, token) pairs, node-major; each of the N·k
   assignments points to its pair and names its expert within the node;
2. network level, over "ep_inter" (to rank (j, b) of every node j): the pair and assignment
   counts per node (2 int64 per node), each pair's token row once (h elements), each
   assignment's (pair, expert in the node) as one int64 and its router weight (fp32);
3. node level, over "ep_intra": the rank (j, b) makes one row per assignment it received,
   sorted by expert within the node, and sends each to the rank of its node holding the
   expert: the flat dispatch (``threefold.parallel.transforms.expert.Dispatcher``) among the
   node's ep_intra ranks and E/ep_inter experts, back by its combine;
4. combine: rank (j, b) weighs each expert output by its router weight and sums the outputs
   of one pair, so every pair returns over "ep_inter" as one row, which the token's rank adds
   to its token.

The weights multiply before the node's sum (where the flat dispatch multiplies on the token's
rank): the same sum, reassociated. Backward runs every differentiable exchange the other way
(a pair's gradient is summed on rank (j, b) before it crosses the network back); the
assignment ids have no gradient. Every all-to-all is ``replayed``: selective recompute sends
nothing twice. The closed form of the bytes per level is ``threefold.accounting``'s
(``traffic._ep_levels``); the counters here are the measured figures it is tested against.
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.parallel.transforms.expert import AllToAll, Dispatcher, ExpertParallelExperts
from threefold.parallel.transforms.recompute import replayed
from threefold.parallel.transforms.wrap import become

NET, NODE = "ep_inter", "ep_intra"


class _Route:
    """One layer's pairs and assignments on the token's rank (steps 1-2 of the module doc)."""

    def __init__(self, experts: torch.Tensor, nodes: int, node_experts: int):
        n, k = experts.shape
        node = experts // node_experts
        tokens = torch.arange(n, device=experts.device)
        key = (node * n + tokens[:, None]).reshape(-1)
        pair_key, pair_of = torch.unique(key, sorted=True, return_inverse=True)
        self.pair_token = pair_key % n
        pairs = torch.bincount(pair_key // n, minlength=nodes)
        self.order = torch.argsort(pair_of, stable=True)  # assignments node-major, by pair
        node_start = torch.cumsum(pairs, 0) - pairs
        flat_node = node.reshape(-1)[self.order]
        local_pair = pair_of[self.order] - node_start[flat_node]
        self.meta = local_pair * node_experts + experts.reshape(-1)[self.order] % node_experts
        assignments = torch.bincount(node.reshape(-1), minlength=nodes)
        self.counts = torch.stack([pairs, assignments], 1)  # (nodes, 2)


class HierarchicalDispatcher:
    """The two-level routing of one MoE layer (see the module doc): tokens in, each token's
    weighted sum over its k experts out. Counts what this rank sends per level."""

    def __init__(self, comm, num_experts: int):
        self.comm, self.ep = comm, comm.size("ep")
        self.nodes = comm.size(NET)
        self.node_experts = num_experts // self.nodes
        self.inner = Dispatcher(comm, self.node_experts, NODE)
        self.local = self.inner.local
        self.rows_sent = 0  # rows to other ranks, both levels, dispatch and combine
        self.pair_rows = 0  # rows to other nodes, dispatch and combine
        self.assignments_sent = self.assignments_received = 0  # to and from other nodes

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                 compute) -> torch.Tensor:
        route = _Route(experts, self.nodes, self.node_experts)
        recv_counts = replayed(self._exchange, route.counts)
        send, recv = route.counts.tolist(), recv_counts.tolist()
        pairs_out, pairs_in = [c[0] for c in send], [c[0] for c in recv]
        got = replayed(self._move, x[route.pair_token], pairs_in, pairs_out)
        meta, w = replayed(self._assign, route.meta, weights.reshape(-1)[route.order],
                           [c[1] for c in recv], [c[1] for c in send])
        # where each received assignment's pair sits in ``got``: its source's block + its index
        starts = torch.cumsum(recv_counts[:, 0], 0) - recv_counts[:, 0]
        source = torch.repeat_interleave(torch.arange(self.nodes, device=meta.device),
                                         recv_counts[:, 1])
        pos = starts[source] + meta // self.node_experts
        expert = meta % self.node_experts
        by_expert = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.node_experts)
        y = self.inner(got[pos[by_expert]], counts, compute)
        y_dtype = y.dtype
        y = y * w[by_expert, None]
        summed = y.new_zeros((got.shape[0], y.shape[1])).index_add_(0, pos[by_expert], y)
        back = replayed(self._move, summed.to(y_dtype), pairs_out, pairs_in)
        return torch.zeros_like(x).index_add_(0, route.pair_token, back.to(x.dtype))

    def _exchange(self, counts: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(counts)
        self.comm.all_to_all_single(out, counts, NET)
        return out

    def _move(self, rows: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        """Pair rows over the network level, ``send`` to each node, ``recv`` from each."""
        n = sum(send) - send[self.comm.rank(NET)]
        self.pair_rows += n
        self.rows_sent += n
        return AllToAll.apply(rows, self.comm, recv, send, NET)

    def _assign(self, meta: torch.Tensor, weights: torch.Tensor, recv: list[int],
                send: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each assignment's (pair, expert in the node) id and its router weight, to the
        pair's node (the ids carry no gradient; the weights do)."""
        me = self.comm.rank(NET)
        self.assignments_sent += sum(send) - send[me]
        self.assignments_received += sum(recv) - recv[me]
        ids = meta.new_empty(sum(recv))
        self.comm.all_to_all_single(ids, meta.contiguous(), NET, recv, send)
        return ids, AllToAll.apply(weights, self.comm, recv, send, NET)

    def take_counts(self) -> dict[str, int]:
        """The step's figures since the last call, per level; restarts them."""
        out = {"ep_rows_sent": self.rows_sent + self.inner.rows_sent,
               "ep_inter_rows_sent": self.pair_rows,
               "ep_inter_assignments_sent": self.assignments_sent,
               "ep_inter_assignments_received": self.assignments_received,
               "ep_intra_rows_sent": self.inner.rows_sent}
        self.rows_sent = self.pair_rows = self.inner.rows_sent = 0
        self.assignments_sent = self.assignments_received = 0
        return out


class HierarchicalExperts(ExpertParallelExperts):
    """An ``ExpertParallelExperts`` whose tokens travel by the hierarchical dispatch
    (``HierarchicalDispatcher``): it routes tokens, not their k copies."""

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """x (N, h), each token's k expert ids and weights (N, k) -> (N, h): Σ_j weights[:, j]
        · expert_{experts[:, j]}(x), the experts on whichever ep rank holds them."""
        return self.dispatcher(x, experts, weights, self.compute)

    def extra_repr(self) -> str:
        d = self.dispatcher
        return (f"experts [{self.first}, {self.first + d.local}) of {d.local * d.ep}, "
                f"ep={d.ep} = {d.nodes} nodes × {d.inner.ep}, hierarchical all-to-all")


def apply_hierarchical_dispatch(model: nn.Module, comm) -> nn.Module:
    """Route every expert-parallel layer of ``model`` (``apply_expert_parallel``'s) through
    the hierarchical dispatch over ``comm``'s "ep_inter" and "ep_intra" axes."""
    for m in model.modules():
        if isinstance(m, ExpertParallelExperts):
            become(m, HierarchicalExperts, dispatcher=HierarchicalDispatcher(
                comm, m.dispatcher.local * m.dispatcher.ep))
    return model
