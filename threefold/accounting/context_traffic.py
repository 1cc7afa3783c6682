"""The collectives of context parallelism's attention, as ``threefold.parallel.transforms.context``
and ``threefold.parallel.transforms.ulysses`` issue them: the closed form of the bytes one rank
sends per attention call (``cp_bytes_per_attention``, which the planner and the tests use) and
the collectives per microbatch (``cp_collectives``, for ``traffic.collectives``)."""

from __future__ import annotations

from threefold.accounting.counts import tp_shard
from threefold.config import ModelConfig
from threefold.layout import Layout


def cp_bytes_per_attention(kv_bytes: int, cp: int, algorithm: str, forwards: int = 1,
                           ulysses: int = 1, q_bytes: int = 0, out_bytes: int = 0
                           ) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends on its cp axes for one attention call;
    ``forwards`` 2 under activation checkpointing (the forward runs again in backward, with
    its communication). ``kv_bytes`` is its local K and V together (under Ulysses with K/V
    heads repeated up to ``ulysses``: ``cp_attention_widths``), ``q_bytes`` its queries and
    ``out_bytes`` its attention output (Ulysses moves them).

    - ring over N ranks: N−1 hops of K/V forward; backward N−1 K/V hops and N dK/dV hops;
    - allgather: (N−1)·kv forward (all-gather), (N−1)·kv backward (reduce-scatter);
    - ulysses (``algorithm`` "ulysses": all of cp, ``ulysses`` = cp): the all-to-all sends
      (u−1)/u of q, K, V and of the output each way, forward and backward alike;
    - hybrid (ring or allgather with 1 < ``ulysses`` < cp): Ulysses over ``ulysses`` ranks,
      then the ring or all-gather over cp/ulysses ranks of a block of kv_bytes (the all-to-all
      keeps its size)."""
    if cp == 1:
        return 0, 0
    if algorithm not in ("ring", "allgather", "ulysses"):
        raise ValueError(f"unknown cp algorithm {algorithm!r}; use ring, allgather or ulysses")
    u = cp if algorithm == "ulysses" else ulysses
    n = cp // u
    a2a = (u - 1) * (q_bytes + kv_bytes) // u + (u - 1) * out_bytes // u
    if n == 1:
        return forwards * a2a, a2a
    if algorithm == "ring":
        return forwards * (a2a + (n - 1) * kv_bytes), a2a + (n - 1) * kv_bytes + n * kv_bytes
    return forwards * (a2a + (n - 1) * kv_bytes), a2a + (n - 1) * kv_bytes


def cp_attention_widths(cfg: ModelConfig, tp: int, ulysses: int = 1
                        ) -> tuple[int, int, int]:
    """(q, K and V, output) features per token of one attention on one tp rank, as context
    parallelism moves them: heads·qk width, kv heads·(qk + v width), heads·v width. Latent
    attention's K and V are per head (expanded from the latent). Under Ulysses K/V heads fewer
    than ``ulysses`` are repeated up to it (each all-to-all destination needs one)."""
    sh = tp_shard(cfg, tp)
    if cfg.kv_lora_rank:
        qk, v, kv_heads = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, sh.heads
    else:
        qk, v, kv_heads = cfg.head_dim, cfg.head_dim, sh.kv_heads
    kv_heads = max(kv_heads, ulysses)
    return sh.heads * qk, kv_heads * (qk + v), sh.heads * v


def cp_collectives(add, cfg: ModelConfig, layout: Layout, tokens: int, d: int,
                  layers: int) -> None:
    """The cp collectives of ``layers`` attentions per microbatch (see ``collectives``):
    ``tokens`` = b·s/cp, ``d`` the element size of q, K, V and the output. Bytes per call
    from ``cp_bytes_per_attention``; a hybrid's all-to-alls on "cp_inner", its ring or
    all-gather on "cp_outer" (``Layout.cp_axes``)."""
    u, ring = layout.ulysses, layout.cp_ring
    a2a_axis, ring_axis = layout.cp_axes
    q, kv, out = (tokens * w for w in cp_attention_widths(cfg, layout.tp, u))
    forwards = 1 if layout.recompute == "none" else 2  # recompute repeats the attention
    if u > 1:  # q, K, V in one all-to-all, the output back in another; backward the same
        add(a2a_axis, "all_to_all", q + kv, d, layers * (forwards + 1), u, True, "none")
        add(a2a_axis, "all_to_all", out, d, layers * (forwards + 1), u, True, "none")
    if ring == 1:
        return
    # after the all-to-all a rank holds the K/V of its heads for its ring rank's share: as
    # many elements as it sent
    if layout.cp_algorithm == "allgather":
        add(ring_axis, "all_gather", ring * kv, d, layers * forwards, ring, True, "none")
        add(ring_axis, "reduce_scatter", ring * kv, d, layers, ring, True, "none")
        return
    # hops of one K/V block forward (each behind one block's attention), the same hops in
    # backward, and the dK/dV accumulator's ring hops plus the hop home (exposed)
    add(ring_axis, "p2p", kv, d, layers * forwards * (ring - 1), ring, True,
        "attention-forward")
    add(ring_axis, "p2p", kv, d, layers * (ring - 1), ring, True, "attention-backward")
    add(ring_axis, "p2p", kv, d, layers * ring, ring, True, "none")
