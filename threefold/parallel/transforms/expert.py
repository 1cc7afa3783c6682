"""Expert parallelism: each MoE layer's E experts split over the "ep" ranks, tokens moved to
their experts and back by all-to-all (GShard, Lepikhin et al., arXiv 2006.16668; Switch
Transformer, Fedus et al., arXiv 2101.03961).

The ep ranks are data-parallel ranks (the innermost part of dp_shard, ``threefold.comm.mesh``):
each routes its own tokens, so an all-to-all carries every (token, expert) assignment to the
rank that holds the expert. Rank r of ep holds experts [r·E/ep, (r+1)·E/ep).

One layer's forward on one rank (dropless, as the single-process layer in ``threefold.model.moe``):

1. the assignments are already sorted by expert (``Experts.forward``), so the rows for each
   destination rank are one contiguous run: ``counts`` (E,) cut into ep runs of E/ep;
2. the counts are exchanged first (an all-to-all of E int64 per rank), so every rank knows how
   many rows it gets from each source for each of its experts (uneven splits);
3. dispatch: all-to-all of the rows (sizes from 2); what arrives is grouped by source, then
   by expert; it is permuted to expert-major order, each local expert runs one matmul pair
   on its rows, and the results are permuted back;
4. combine: the reverse all-to-all returns every row to the rank (and position) it came from,
   where the router weights multiply it and it is added to its token.

Backward runs the two all-to-alls the other way (the gradient of a dispatch is a combine).
Bytes per layer per forward, rank r: the count exchange E·8·(ep−1)/ep, the rows r sends to
other ranks in dispatch plus those it returns in combine, times h · element size; backward
the same rows again. Under uniform routing the expectation is N·k·(ep−1)/ep rows each way.

Gradients: the router and every dense weight are the same on all data ranks, reduced over
"dp" as always; an expert is held by the ranks of "edp" (same ep index), so its gradient is
summed over those only (the parameter's placement tells the engines). Tensor
parallelism leaves the experts whole on every tp rank (each computes them: redundant, not
split), and the all-to-alls run between ranks of the same tp index.
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.model.experts import Experts
from threefold.parallel.placement import place
from threefold.parallel.transforms.recompute import replayed
from threefold.parallel.transforms.wrap import become

AXIS = "ep"


class AllToAll(torch.autograd.Function):
    """Rows of ``x`` cut by ``send`` go to the ranks of ``axis`` in order; ``recv`` rows come
    back from each. The gradient takes the reverse trip."""

    @staticmethod
    def forward(ctx, x, comm, recv: list[int], send: list[int], axis: str = AXIS):
        ctx.comm, ctx.recv, ctx.send, ctx.axis = comm, recv, send, axis
        out = x.new_empty((sum(recv), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), axis, recv, send)
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty((sum(ctx.send), *g.shape[1:]))
        ctx.comm.all_to_all_single(out, g.contiguous(), ctx.axis, ctx.send, ctx.recv)
        return out, None, None, None, None


class Dispatcher:
    """The all-to-all routing of one expert-parallel MoE layer (see the module doc): rows
    grouped by global expert in, each row through its expert (on whichever rank holds it)
    out, in the same order. Counts the rows this rank sends to other ranks. ``axis``: the ranks
    the ``num_experts`` experts are spread over ("ep"; the hierarchical dispatch's node level
    "ep_intra" with a node's experts)."""

    def __init__(self, comm, num_experts: int, axis: str = AXIS):
        self.comm, self.axis, self.ep = comm, axis, comm.size(axis)
        self.local = num_experts // self.ep
        self.rows_sent = 0  # rows this rank sent to other ranks, dispatch and combine

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, compute) -> torch.Tensor:
        ep, local = self.ep, self.local
        send_counts = counts.reshape(ep, local).contiguous()
        # each exchange is ``replayed``: a selective block's recompute gets its result back
        recv_counts = replayed(self._exchange, send_counts)  # (source, local expert)
        send = send_counts.sum(1).tolist()
        recv = recv_counts.sum(1).tolist()
        got = replayed(self._move, rows, recv, send)  # grouped by source, then expert
        # source-major -> expert-major: segment (s, e) starts at starts[s, e] in `got`; in
        # expert-major order the segments are (e, s), position i of segment j taking row
        # starts[j] + (i - where segment j begins there)
        flat = recv_counts.reshape(-1)
        starts = (torch.cumsum(flat, 0) - flat).reshape(ep, local).t().reshape(-1)
        lengths = recv_counts.t().reshape(-1)
        begins = torch.cumsum(lengths, 0) - lengths
        total = int(flat.sum())
        perm = (torch.arange(total, device=rows.device)
                + torch.repeat_interleave(starts - begins, lengths).to(rows.device))
        y = compute(got[perm], recv_counts.sum(0).tolist())
        back = torch.empty_like(perm)
        back[perm] = torch.arange(total, device=rows.device)
        return replayed(self._move, y[back], send, recv)

    def _exchange(self, send_counts: torch.Tensor) -> torch.Tensor:
        recv_counts = torch.empty_like(send_counts)
        self.comm.all_to_all_single(recv_counts, send_counts, self.axis)
        return recv_counts

    def _move(self, rows: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        """The all-to-all of ``rows`` (``send`` to each rank, ``recv`` from each), counted."""
        self.rows_sent += sum(send) - send[self.comm.rank(self.axis)]
        return AllToAll.apply(rows, self.comm, recv, send, self.axis)

    def take_counts(self) -> dict[str, int]:
        """The step's figure (``ep_rows_sent``) since the last call; restarts it."""
        rows, self.rows_sent = self.rows_sent, 0
        return {"ep_rows_sent": rows}


class ExpertParallelExperts(Experts):
    """An ``Experts`` holding only this ep rank's E/ep experts (``apply_expert_parallel``
    turns each layer's experts into one, in place), whose ``dispatch`` sends every row to the
    rank that holds its expert and brings the result back (``dispatcher``)."""

    dispatcher: Dispatcher | None = None
    first = 0  # the global index of this rank's first expert

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows grouped by global expert (``counts`` (E,)) -> each through its expert, on
        whichever ep rank holds it, in the same order."""
        return self.dispatcher(rows, counts, self.compute)

    def extra_repr(self) -> str:
        d = self.dispatcher
        return (f"experts [{self.first}, {self.first + d.local}) of {d.local * d.ep}, "
                f"ep={d.ep}, all-to-all")


def apply_expert_parallel(model: nn.Module, comm) -> nn.Module:
    """Keep this rank's E/ep experts of every MoE layer of ``model`` (whole weights in, as
    initialised or loaded) and route through a ``Dispatcher``: each ``Experts`` becomes an
    ``ExpertParallelExperts``. Marks each expert tensor with its slice of dim 0 in its
    placement (``threefold.parallel.placement``)."""
    ep, r = comm.size(AXIS), comm.rank(AXIS)
    for m in model.modules():
        if isinstance(m, Experts):
            e = m.gate_up_proj.shape[0]
            n = e // ep
            for p in (m.gate_up_proj, m.down_proj, m.gate_up_proj_bias, m.down_proj_bias):
                if p is None:  # (biases: GPT-OSS's experts alone have them)
                    continue
                p.data = p.data[r * n:(r + 1) * n].clone()
                place(p, ep_index=r, ep_count=ep)
            become(m, ExpertParallelExperts, dispatcher=Dispatcher(comm, e), first=r * n)
    return model


def take_rows_sent(model: nn.Module) -> int:
    """Rows this rank's MoE layers sent to other ep ranks (dispatch and combine, forwards
    only, full recompute's included; selective's recompute sends none) since the last call;
    the counters restart at 0. Each backward sends the same rows again, so the step's all-to-all bytes on ep are
    (forward rows + backward rows) · h · element size + the count exchanges."""
    return take_rows([m.dispatcher for m in model.modules()
                      if isinstance(m, ExpertParallelExperts)])


def take_counts(dispatchers: list) -> dict[str, int]:
    """Every figure the ``dispatchers`` counted since the last call, summed over them
    (``ep_rows_sent``; the hierarchical dispatch's per level); the counters restart at 0."""
    out: dict[str, int] = {}
    for d in dispatchers:
        for key, n in d.take_counts().items():
            out[key] = out.get(key, 0) + n
    return out


def take_rows(dispatchers: list[Dispatcher]) -> int:
    """``take_rows_sent`` of the layers whose ``dispatchers`` an engine found once."""
    total = 0
    for d in dispatchers:
        total, d.rows_sent = total + d.rows_sent, 0
    return total
