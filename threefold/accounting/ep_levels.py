"""The hierarchical expert dispatch's bytes per level, in closed form
(``threefold.parallel.transforms.expert_dispatch`` is the runtime; ``parallel.ep_dispatch``).

ep = A nodes × B ranks per node ("ep_inter" × "ep_intra"), E experts contiguous over the ep
ranks, so node j holds experts [j·E/A, (j+1)·E/A). Per MoE layer and microbatch of N tokens,
k experts each, one rank sends (h elements per row; r, a: the residual and matmul dtypes):

- ep_inter (the network): the counts, 2·8·(A−1) bytes; each (token, destination node) pair's
  row once, N·D·(A−1)/A rows, forward in r and back (combine) in a, both again in backward;
  each assignment's id (8 bytes) and router weight (4 bytes, its gradient back in backward),
  N·k·(A−1)/A of them;
- ep_intra (NVLink): the flat dispatch among the B ranks of a node over its E/A experts: the
  counts (B−1)·E/(A·B)·8 bytes, and N·k·(B−1)/B rows each way (rank (j, b) receives N·k
  assignments for node j in expectation, one per token of each of the A sources' N·k/A).

D is the expected number of distinct nodes a token's experts are on, under uniform routing:
the uniform expectation, as the flat dispatch's (ep−1)/ep of N·k rows is, because the
planner predicts a mean step. Its worst case is topk_group (each chosen group on its own
node); DeepSeek's group score (the sum of a group's two best experts) makes every chosen
group likely to get one of the k, so real routing lies between D and topk_group.
With group-limited routing (``sigmoid_grouped``, n_group G > 1, topk_group T, g = E/G
experts per group, m = G/A groups per node): the T groups are a uniform choice of G, the k
experts a uniform choice of those T·g, and a node is missed with probability
q = Σ_i C(m, i)·C(G−m, T−i)/C(G, T) · C((T−i)·g, k)/C(T·g, k); without groups the same
with G = E, T = k, g = 1 (q = C(E−m, k)/C(E, k)). D = A·(1 − q).

Imports no torch.
"""

from __future__ import annotations

from fractions import Fraction
from math import comb

from threefold.config import ModelConfig
from threefold.layout import Layout, Workload


def nodes_per_token(cfg: ModelConfig, nodes: int) -> Fraction:
    """D: the expected distinct nodes of ``nodes`` (each holding E/nodes contiguous experts)
    that one token's k experts are on, under uniform routing (see the module doc)."""
    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    if cfg.moe_router == "sigmoid_grouped" and cfg.n_group > 1:
        groups, chosen = cfg.n_group, cfg.topk_group
    else:
        groups, chosen = e, k
    g, m = e // groups, groups // nodes
    missed = sum(Fraction(comb(m, i) * comb(groups - m, chosen - i), comb(groups, chosen))
                 * Fraction(comb((chosen - i) * g, k), comb(chosen * g, k))
                 for i in range(min(m, chosen) + 1))
    return nodes * (1 - missed)


def ep_level_collectives(add, cfg: ModelConfig, layout: Layout, work: Workload, tokens: int,
                         layers: int, forwards: int, tag: str) -> None:
    """The all-to-alls of the hierarchical dispatch (module doc), per microbatch: ``tokens``
    N, ``layers`` MoE layers, ``forwards`` 2 under full recompute (selective keeps what they
    returned), through ``add`` (``traffic._add``'s signature)."""
    a, b = layout.ep_inter, layout.ep_intra
    e, k, h = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size
    fw, bw = layers * forwards, layers * (forwards + 1)
    pairs = int(tokens * h * nodes_per_token(cfg, a))  # N·D rows of h
    add("ep_inter", "all_to_all", 2 * a, 8, fw, a, True, tag)
    add("ep_inter", "all_to_all", pairs, work.resid_bytes, bw, a, True, tag)
    add("ep_inter", "all_to_all", pairs, work.act_bytes, bw, a, True, tag)
    add("ep_inter", "all_to_all", tokens * k, 8, fw, a, True, tag)  # ids
    add("ep_inter", "all_to_all", tokens * k, 4, bw, a, True, tag)  # weights
    add("ep_intra", "all_to_all", e // a, 8, fw, b, True, tag)
    add("ep_intra", "all_to_all", tokens * k * h, work.resid_bytes, bw, b, True, tag)
    add("ep_intra", "all_to_all", tokens * k * h, work.act_bytes, bw, b, True, tag)
