"""Zero-bubble backward split (Qi et al., arXiv 2401.10241 §2): B computes only the input
gradient, which the previous stage waits for; W computes the weight gradients later, from
the part of the graph B kept."""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge

from threefold.model.kernels import computing_half


class SplitBackward:
    """The deferred half of one chunk's backward for one microbatch.

    Autograd computes, at each node, only the gradients some requested input needs. So B asks
    for the gradient of the chunk's input alone (``autograd.grad``, keeping the graph): every
    node on the path from the output to the input runs, but a matmul skips its weight
    gradient. The nodes where a weight's branch leaves that path (the "joins": the matmul of
    a Linear, the product of a norm weight) receive their output gradient during B; a hook
    keeps it. W then re-enters each join with the kept gradient and asks only for its
    weights, which runs exactly the weight-gradient half (and accumulates into ``.grad``
    through the usual AccumulateGrad nodes, so gradient-sync hooks fire as for backward()).

    A parameter is split this way only when a single join edge leads to it (so no path is
    counted twice); any other parameter (a stage without an input gradient, i.e. the first,
    or a weight used twice) gets its gradient in W from one ordinary backward from the output.
    """

    def __init__(self, root: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor,
                 params: Sequence[torch.Tensor]):
        self.root, self.grad = root, grad
        # Sets of tensors hash by address, so their order differs from process to process:
        # whatever reaches autograd (and through its hooks, gradient collectives) is put back
        # in the chunk's parameter order first.
        self._order = {p: i for i, p in enumerate(params)}
        joins, self.fallback = find_joins(root, x, set(params))
        self.captured: dict = {}
        hooks = [j.register_prehook(functools.partial(self._keep, j)) for j in joins]
        try:
            self.input_grad = None
            if x.requires_grad:
                with computing_half("input"):
                    (self.input_grad,) = torch.autograd.grad(root, [x], grad,
                                                             retain_graph=True)
        finally:
            for h in hooks:
                h.remove()
        self.joins = joins

    def _keep(self, node, grad_outputs):
        self.captured[node] = grad_outputs

    def weight_backward(self) -> None:
        """Accumulate every weight gradient of this microbatch (W)."""
        missed = {p for j, ps in self.joins.items() if j not in self.captured for p in ps}
        fallback = self._ordered(self.fallback | missed)
        if fallback:
            torch.autograd.backward(self.root, self.grad, inputs=fallback, retain_graph=True)
        for j, params in self.joins.items():
            grads = self.captured.get(j)
            if grads is None:
                continue
            edges = [(GradientEdge(j, i), g) for i, g in enumerate(grads) if g is not None]
            if edges:
                with computing_half("weight"):
                    torch.autograd.backward([e for e, _ in edges], [g for _, g in edges],
                                            inputs=self._ordered(params), retain_graph=True)
        self.root = self.grad = self.captured = self.joins = None  # free the graph

    def _ordered(self, params) -> list[torch.Tensor]:
        """``params`` (a set) in the chunk's parameter order."""
        return sorted(params, key=self._order.__getitem__)


def find_joins(root: torch.Tensor, x: torch.Tensor, params: set) -> tuple[dict, set]:
    """Walk the graph below ``root``: returns ({join node: its weights}, weights to leave to
    an ordinary backward). A join is a node that leads to ``x`` with an edge into a sub-graph
    that does not lead to ``x`` but reaches weights."""
    reaches_x: dict = {}
    weights: dict = {}  # node that does not reach x -> the parameters below it
    stack = [(root.grad_fn, False)]
    while stack:  # iterative post-order: graphs of deep stages are deeper than recursion
        node, expanded = stack.pop()
        if node in reaches_x:
            continue
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf
            reaches_x[node] = node.variable is x
            if not reaches_x[node]:
                weights[node] = frozenset([node.variable]) & params
            continue
        children = [n for n, _ in node.next_functions if n is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((n, False) for n in children if n not in reaches_x)
            continue
        reaches_x[node] = any(reaches_x[n] for n in children)
        if not reaches_x[node]:
            weights[node] = frozenset().union(*(weights[n] for n in children))
    joins: dict = {}
    edges_to: dict = {}  # parameter -> number of join edges leading to it
    for node, rx in reaches_x.items():
        if not rx or hasattr(node, "variable"):
            continue
        for n, _ in node.next_functions:
            if n is not None and not reaches_x[n] and weights[n]:
                joins.setdefault(node, set()).update(weights[n])
                for p in weights[n]:
                    edges_to[p] = edges_to.get(p, 0) + 1
    shared = {p for p, k in edges_to.items() if k > 1}
    reachable = set().union(*weights.values()) if weights else set()
    joins = {j: ps - shared for j, ps in joins.items() if ps - shared}
    covered = set().union(*joins.values()) if joins else set()
    return joins, reachable - covered


# --------------------------------------------------------------------------------------------
# The executor
# --------------------------------------------------------------------------------------------
