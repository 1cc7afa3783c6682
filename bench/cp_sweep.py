"""bench_cp.py's sweep: every context-parallel algorithm threefold has (``CP_ALGORITHMS``; an
algorithm added there is swept too) at several sequence lengths and head counts, on the
launch's N ranks, threefold alone; and the attention work of packed rows per cp rank, split
head-tail over the whole row (``causal``) or by documents (``documents``).

Per (query heads, kv heads, length, algorithm): tokens/s (slowest rank, timed steps), peak
RSS growth (max over ranks: model, AdamW, activations, transients), the bytes autograd saves
in one forward (rank 0), and the bytes a rank sends on the cp axis in one step as the counted
communication layer measured them next to the closed form
(``threefold.accounting.cp_bytes_per_attention`` per attention, forward and backward, times
the layers). An algorithm the layout cannot run (heads that do not split, say) is reported
as refused with its message.

Packed rows: for each length, rows packed from the planner's synthetic length mixtures
(``threefold.plan.packed_rows``: log-normal chat turns, Pareto documents, both) and the
max/mean over cp ranks of the keys their queries see, counted from the very masks the
runtime builds (``cp_order.row_visibility`` over the positions each rank holds) and checked
against the planner's simulator. On a CPU both kernels compute every masked pair of a block,
so the balance shows in this count (what a varlen/block-sparse GPU kernel does), not in the
CPU's time.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from bench.common import peak_rss_bytes, print_table, start_peak_rss_window

MIB = 2**20


def _cp_bytes(comm) -> int:
    """Bytes sent on the cp axes (a hybrid's cp_inner and cp_outer too)."""
    return sum(sum(ops.values()) for axis, ops in comm.totals().items() if axis.startswith("cp"))


def _splits(args, ctx) -> list[tuple[str, int, dict]]:
    """(algorithm, Ulysses degree, ctx) of each split the planner searches at this cp
    (``threefold.plan.search.cp_splits``: each algorithm, and where the runtime has Ulysses
    each hybrid, on a mesh of its own cp_inner × cp_outer axes)."""
    from threefold.comm.counted import Comm
    from threefold.comm.mesh import build_mesh
    from threefold.layout import Layout
    from threefold.plan.candidates import SearchSpace
    from threefold.plan.search import cp_splits

    out = []
    for alg, hybrid in cp_splits(ctx["cp"], SearchSpace(cp_algorithm=tuple(args.algorithm_list))):
        mine = ctx
        if hybrid:
            dims = Layout(cp=ctx["cp"], cp_algorithm=alg, **hybrid)
            comm = Comm(dims, build_mesh(dims, "cpu"))
            for axis in dims.cp_axes:  # the hybrid's two axes (groups are made on every rank)
                comm.add_axis(axis, dims.axis_groups(axis))
            mine = {**ctx, "comm": comm, "hybrid": {"ulysses": hybrid["cp_ulysses"]}}
        out.append((alg, hybrid.get("cp_ulysses", 1), mine))
    return out


def sweep_one(make_step, algorithm, mcfg, ocfg, args, ctx, seq_len) -> dict:
    """One (model shape, length, algorithm): this rank's figures."""
    from threefold.accounting import cp_bytes_per_attention

    world = ctx["cp"]
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(mcfg.vocab_size, (args.batch, seq_len + 1), generator=gen)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    dist.barrier()
    rss0 = start_peak_rss_window()
    step = make_step("threefold", algorithm, mcfg, ocfg, args.seed, ctx)
    before = _cp_bytes(ctx["comm"])
    _, _, saved = step(ids, labels, measure=True)  # also the warm-up
    sent = _cp_bytes(ctx["comm"]) - before
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(ids, labels)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    per_head = args.batch * (seq_len // world) * mcfg.head_dim * 4
    kv_heads, extra = mcfg.num_key_value_heads, {}
    u = world if algorithm == "ulysses" else ctx.get("hybrid", {}).get("ulysses", 1)
    if u > 1:  # the all-to-all also moves q and the output; K/V heads are repeated up to
        kv_heads = max(kv_heads, u)  # the Ulysses ranks where fewer
        extra = {"q_bytes": mcfg.num_attention_heads * per_head,
                 "out_bytes": mcfg.num_attention_heads * per_head,
                 **({"ulysses": u} if algorithm != "ulysses" else {})}
    fwd, bwd = cp_bytes_per_attention(2 * kv_heads * per_head, world, algorithm, **extra)
    return {"seconds": seconds, "saved": saved, "sent": sent,
            "formula": mcfg.num_hidden_layers * (fwd + bwd),
            "peak": (peak - rss0) if peak is not None and rss0 is not None else float("nan")}


def sweep(make_step, ocfg, args, ctx) -> list[dict]:
    """Every (heads, length, algorithm) of ``--sweep-heads`` × ``--sweep-lens`` ×
    ``--algorithms``; rows on rank 0 (None elsewhere)."""
    from threefold.config import ModelConfig

    rows, splits = [], _splits(args, ctx)
    for pair in args.sweep_heads.split(","):
        heads, kv = (int(x) for x in pair.split(":"))
        mcfg = ModelConfig(preset=args.preset, vocab_size=args.vocab, num_attention_heads=heads,
                           num_key_value_heads=kv).resolved()
        for seq_len in (int(x) for x in args.sweep_lens.split(",")):
            mcfg.max_position_embeddings = max(mcfg.max_position_embeddings, seq_len)
            for alg, u, mine_ctx in splits:
                name = alg + (f"x{u}u" if u > 1 else "")  # ring x2u: 2 Ulysses ranks inside
                row = {"heads": heads, "kv_heads": kv, "seq_len": seq_len, "algorithm": name}
                try:
                    mine = sweep_one(make_step, alg, mcfg, ocfg, args, mine_ctx, seq_len)
                except ValueError as e:  # the layout refuses it (the same on every rank)
                    rows.append({**row, "refused": str(e).splitlines()[0]})
                    continue
                slow = torch.tensor([mine["seconds"], mine["peak"]], dtype=torch.float64)
                dist.all_reduce(slow, op=dist.ReduceOp.MAX)
                tok = args.batch * seq_len * args.steps
                rows.append({**row, "tok_s": tok / float(slow[0]),
                             "peak_MiB": float(slow[1]) / MIB, "saved_MiB": mine["saved"] / MIB,
                             "cp_MiB_step": mine["sent"] / MIB,
                             "formula_MiB": mine["formula"] / MIB,
                             "bytes_equal": mine["sent"] == mine["formula"]})
    return rows


def packed_work(args, world: int) -> list[dict]:
    """Per length and mixture: max/mean attention work over the cp ranks, before and after,
    counted from the runtime's masks, and whether the planner's simulator agrees."""
    from threefold.accounting import attention_work, imbalance, row_spans
    from threefold.parallel.transforms.cp_order import rank_positions, row_visibility
    from threefold.plan.packed_rows import MIXTURES, packed_rows

    rows = []
    for seq_len in (int(x) for x in args.sweep_lens.split(",")):
        for mixture in MIXTURES:
            packed = packed_rows(mixture, seq_len, args.packed_rows, seed=args.seed)
            stats = {"causal": [], "documents": []}
            agree = True
            for lengths in packed:
                docs = torch.repeat_interleave(torch.arange(len(lengths)),
                                               torch.tensor(lengths))[None]
                for balance in stats:
                    pos = rank_positions(docs, world, balance)  # (cp, 1, T/cp)
                    every = torch.arange(seq_len)[None]
                    work = [int(row_visibility(pos[r], every, docs).sum()) for r in range(world)]
                    agree &= work == attention_work(lengths, row_spans(lengths, world, balance))
                    stats[balance].append(imbalance(work))
            rows.append({"seq_len": seq_len, "mixture": mixture,
                         "docs_per_row": sum(map(len, packed)) / len(packed),
                         "before_mean": sum(stats["causal"]) / len(packed),
                         "before_worst": max(stats["causal"]),
                         "after_mean": sum(stats["documents"]) / len(packed),
                         "after_worst": max(stats["documents"]), "simulator_agrees": agree})
    return rows


def print_sweep(rows: list[dict], packed: list[dict], world: int) -> None:
    print(f"\n== sweep: threefold, cp {world}, every algorithm (tok/s: slowest rank; peak: "
          "max over ranks; cp bytes: one step, measured and closed form) ==")
    ran = [r for r in rows if "refused" not in r]
    if ran:
        print_table(ran, width=12)
    for r in rows:
        if "refused" in r:
            print(f"  {r['algorithm']} at {r['heads']}:{r['kv_heads']} heads, seq {r['seq_len']}:"
                  f" refused: {r['refused']}")
    if packed:
        print(f"\n== packed rows: max/mean attention work over {world} cp ranks (keys seen "
              "under the document mask, from the runtime's masks) ==")
        print_table(packed, width=14)
