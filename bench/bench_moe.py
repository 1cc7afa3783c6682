"""Mixture of experts on CPU (gloo): the MoE layer with expert parallelism against the same
layer without it, a training step of an MoE model against a dense one with the same
active parameters per token, and the grouped experts against the loop over experts.

    python3 bench/bench_moe.py                 # the defaults below (about 2 minutes on 2 cores)
    python3 bench/bench_moe.py --quick         # smaller sizes, 2 rounds (well under a minute)
    python3 bench/bench_moe.py --rounds 8 --ffn 1024 --no-model
    python3 bench/bench_moe.py --impl-only     # part 3 alone, one process (no torchrun)

Started without torchrun's environment, the script re-launches itself under
``python -m torch.distributed.run --standalone --nproc-per-node N`` (gloo, one OpenMP thread
per rank; N = ``--ranks``, default 4 = the ep degree, all one ep group; the mesh is
``Layout(dp_shard=N, ep=N)`` with the expert axes added, as tests/test_expert_parallel.py
builds it). Within the launch the sides alternate round by round (A B C, then C B A, ...) so
that noise from the shared machine falls on every side of each ratio; ratios are taken per
round and their median reported, never absolute times across runs.

Part 1, the layer (``threefold.model.moe.SparseMoeBlock``: router, top-k, dropless routing sorted
by expert, a loop over experts), forward + backward of a random output gradient, fp32, all
three sides from the same weights (one seed) on the same tokens (rank r's tokens from seed
``seed + r``), no optimiser step and no gradient reduction (the layer only):

- ``ep``: ``apply_expert_parallel(block, comm)``: each rank keeps E/ep experts, routes its own
  N = batch·seq tokens, exchanges the counts, dispatches rows to the experts' owners and
  combines them back by all-to-all (``threefold.parallel.transforms.expert``);
- ``noep``: the same layer whole on every rank, each rank its own N tokens, no all-to-all
  (every rank holds all E experts: ep× the expert weights, and each expert's matmuls get 1/ep
  of the rows the ep side gives them);
- ``single``: one process (rank 0; the others wait at a barrier) runs the whole layer on all
  ranks' N·ep tokens at once: the plain loop over all experts.

All three do the same matmul FLOPs for the same tokens. Throughput = the tokens of all ranks
(N·ep) over the slowest rank's time of the timed steps; reported are tokens/s of ep over noep
and over single per round (goal ep/noep >= 1.0: with shared-memory communication, holding a
quarter of the experts and running them on ep× the rows should not cost throughput; goal
ep/single >= 1.0: N ranks should beat one process. The goals are this benchmark's own, and
on a machine with fewer cores than ranks the ranks share cores, which bounds ep/single by
cores/1, not by ep). Also:

- equality: ep's output and input gradient against noep's on the same tokens, and each
  rank's expert-weight gradients against the sum over ranks of noep's for the same experts
  (the gradient the expert's owner gets): max abs diff over ranks beside the reference's max
  abs value ("equal" within rtol 1e-5 of it);
- all-to-all bytes per rank per step counted on axis ``ep`` by ``Comm.totals()`` against the
  closed form for the measured routing: the count exchange E·8·(ep−1)/ep, plus the rows the
  rank sends to other ranks in dispatch and returns to them in combine, × h × 4 bytes, the
  rows twice (the backward moves the same rows the other way; the counts are not exchanged
  again), and the expectation under uniform routing, N·k·(ep−1)/ep rows each way.

Part 2, one process (rank 0; the others wait), a whole training step of
``threefold.model.decoder.CausalLM`` (``build_model``, fp32): forward, summed token
cross-entropy over the batch's token count plus the router terms (``RouterLog.add``, as the
trainer adds them), backward, gradient clipping, AdamW (``make_adamw``), zero_grad; the MoE
preset (``--model-preset``, default tiny-moe: 8 experts of width 344, top-2) against the
dense model with the same active parameters per token: the same shape with no experts and
an MLP of width k·f (tiny-moe -> intermediate 688 = the preset ``tiny``). Their parameter
counts (``threefold.accounting.num_parameters`` / ``active_parameters``) differ only by the routers
(E·h per layer). Reported: tokens/s of MoE over dense per round (goal >= 0.8: the same matmul
FLOPs per token plus routing, sorting and the per-expert loop should cost at most a fifth;
again the benchmark's own goal), and beside it the same ratio of forward+backward time alone
and each side's share of the step spent in clip + AdamW + zero_grad, which run over all
parameters (total/active times as many in the MoE: its weights and optimiser state are what
expert parallelism shards).

Part 3, one process (rank 0; the others wait; ``--impl-only``: this part alone, no launch),
the experts' implementation (``model.moe_impl``): the MoE layer of ``--model-preset``
(tiny-moe: h 256, 8 experts of f 344, top-2, softmax routing) forward + backward of a random
output gradient on ``--impl-batch`` x ``--impl-seq-len`` tokens, fp32, ``--impl-threads``
threads, two copies of the same weights, one running its local experts as two
``torch._grouped_mm`` calls (``grouped``), the other one matmul pair per expert (``loop``, the
reference). Reported: their outputs' and gradients' max abs difference, and tokens/s of grouped
over loop per round (goal >= 1.0: one call instead of 2·E should not cost time; the
benchmark's own goal).

The output ends with one JSON line per ratio (``bench.common.report``), after a JSON line of
everything else (``"benchmark": "moe_summary"``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, report, revision, run_ranks  # noqa: E402
from threefold.accounting import active_parameters, num_parameters  # noqa: E402
from threefold.config import ModelConfig, OptimConfig  # noqa: E402

LAYER_SIDES = ("ep", "noep", "single")
MODEL_SIDES = ("moe", "dense")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (the same in the launcher and in every rank)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # not "--nproc": torchrun's parser would take it for an abbreviation of its own option
    ap.add_argument("--ranks", type=int, default=4, help="processes = ep degree")
    ap.add_argument("--rounds", type=int, default=7, help="A/B rounds (order flips each round)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--quick", action="store_true",
                    help="small sizes and 2 rounds (a smoke run, well under a minute)")
    g = ap.add_argument_group("part 1: the layer")
    g.add_argument("--batch", type=int, default=4, help="sequences per rank")
    g.add_argument("--seq-len", type=int, default=256)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--experts", type=int, default=8)
    g.add_argument("--top-k", type=int, default=2)
    g.add_argument("--ffn", type=int, default=512, help="each expert's SwiGLU width f")
    g.add_argument("--steps", type=int, default=5, help="timed forward+backward per side/round")
    g.add_argument("--warmup", type=int, default=1, help="untimed ones before them")
    g = ap.add_argument_group("part 2: MoE vs dense training step (one process)")
    g.add_argument("--no-model", dest="model", action="store_false", help="skip part 2")
    g.add_argument("--model-preset", default="tiny-moe")
    g.add_argument("--vocab", type=int, default=4096)
    g.add_argument("--model-batch", type=int, default=4)
    g.add_argument("--model-seq-len", type=int, default=256)
    g.add_argument("--model-steps", type=int, default=3, help="timed steps per side/round")
    g.add_argument("--model-warmup", type=int, default=1)
    g = ap.add_argument_group("part 3: grouped vs looped experts (one process)")
    g.add_argument("--no-impl", dest="impl", action="store_false", help="skip part 3")
    g.add_argument("--impl-only", action="store_true",
                   help="run part 3 alone in this process (no torchrun, parts 1-2 skipped)")
    g.add_argument("--impl-batch", type=int, default=4)
    g.add_argument("--impl-seq-len", type=int, default=256)
    g.add_argument("--impl-threads", type=int, default=1,
                   help="torch threads (1, as each rank of parts 1-2 has)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = min(args.rounds, 2)
        args.batch, args.seq_len, args.hidden, args.ffn = 2, 128, 128, 256
        args.steps, args.model_steps = 2, 2
        args.model_batch, args.model_seq_len, args.vocab = 2, 128, 1024
        args.impl_batch, args.impl_seq_len = 2, 128
    if args.experts % args.ranks:
        ap.error(f"--experts {args.experts} must divide by --ranks {args.ranks} (the ep degree)")
    if not 1 <= args.top_k <= args.experts:
        ap.error("--top-k must be in 1..--experts")
    return args


# --------------------------------------------------------------------------------------------
# Part 1: the layer
# --------------------------------------------------------------------------------------------
def layer_config(args) -> ModelConfig:
    return ModelConfig(preset="tiny", hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_local_experts=args.experts,
                       num_experts_per_tok=args.top_k).resolved(args.vocab)


def whole_block(cfg: ModelConfig, seed: int):
    """The whole layer, every weight normal(0, 0.02) from ``seed`` (the model's init_std)."""
    from threefold.model.moe import SparseMoeBlock

    block = SparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return block


def rank_tokens(args, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s input (batch, seq, h) and output gradient, from seed + rank."""
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    shape = (args.batch, args.seq_len, args.hidden)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def fwd_bwd(block, x, dy):
    """One forward + backward; (output, input gradient). Gradients are left on the block."""
    for p in block.parameters():
        p.grad = None
    xi = x.detach().requires_grad_()
    y = block(xi)
    (y * dy).sum().backward()
    return y.detach(), xi.grad


def time_steps(block, x, dy, args) -> tuple[float, tuple]:
    """Warm-up + timed forward+backward; (seconds of the timed ones, last (y, dx))."""
    out = None
    for _ in range(args.warmup):
        out = fwd_bwd(block, x, dy)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = fwd_bwd(block, x, dy)
    return time.perf_counter() - t0, out


def run_layer_side(side, blocks, data, args, comm) -> dict:
    """One side on every rank (collective); this rank's figures."""
    from threefold.parallel.transforms.expert import take_rows_sent

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if side == "single":
        seconds = 0.0
        if rank == 0:
            seconds, _ = time_steps(blocks["single"], data["all_x"], data["all_dy"], args)
        dist.barrier()
        return {"seconds": seconds}
    before = comm.totals().get("ep", {}).get("all_to_all", 0)
    take_rows_sent(blocks[side])
    seconds, _ = time_steps(blocks[side], data["x"], data["dy"], args)
    sent = comm.totals().get("ep", {}).get("all_to_all", 0) - before
    rows = take_rows_sent(blocks[side])
    n = args.warmup + args.steps
    dist.barrier()
    return {"seconds": seconds, "a2a_bytes_total": sent, "a2a_steps": n, "rows_sent": rows,
            "world": world}


def check_equal(blocks, data, comm) -> dict:
    """ep vs noep on this rank's tokens: outputs, input gradients, and this rank's experts'
    gradients against noep's summed over ranks; max abs diffs (max over ranks), routing counts
    of every rank, and the ep bytes of exactly one step (collective)."""
    ep, me = comm.size("ep"), comm.rank("ep")
    y0, dx0 = fwd_bwd(blocks["noep"], data["x"], data["dy"])
    counts = blocks["noep"].router_stats.counts.clone()
    gu0 = blocks["noep"].experts.gate_up_proj.grad.clone()
    dn0 = blocks["noep"].experts.down_proj.grad.clone()
    dist.all_reduce(gu0)
    dist.all_reduce(dn0)
    before = comm.totals().get("ep", {}).get("all_to_all", 0)
    y1, dx1 = fwd_bwd(blocks["ep"], data["x"], data["dy"])
    one_step = comm.totals().get("ep", {}).get("all_to_all", 0) - before
    n = gu0.shape[0] // ep
    pairs = {"y": (y1, y0), "dx": (dx1, dx0),
             "d_gate_up": (blocks["ep"].experts.gate_up_proj.grad, gu0[me * n:(me + 1) * n]),
             "d_down": (blocks["ep"].experts.down_proj.grad, dn0[me * n:(me + 1) * n])}
    diffs = torch.tensor([v for got, want in pairs.values()
                          for v in (float((got - want).abs().max()), float(want.abs().max()))],
                         dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    every = [torch.empty_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(every, counts)
    out = {"counts": [c.tolist() for c in every], "one_step_bytes": one_step}
    for i, key in enumerate(pairs):
        out[key] = {"max_abs_diff": float(diffs[2 * i]), "max_abs": float(diffs[2 * i + 1])}
    return out


def closed_form(counts: list[list[int]], rank: int, ep: int, h: int) -> dict:
    """Rank ``rank``'s all-to-all bytes per layer forward+backward for the measured routing
    (``counts[i][e]``: rank i's assignments to expert e): see the module doc."""
    e = len(counts[0])
    n = e // ep
    mine = slice(rank * n, (rank + 1) * n)
    out_rows = sum(counts[rank]) - sum(counts[rank][mine])           # dispatch, to others
    in_rows = sum(sum(c[mine]) for i, c in enumerate(counts) if i != rank)  # combine, back
    count_bytes = e * 8 * (ep - 1) // ep
    return {"out_rows": out_rows, "in_rows": in_rows, "count_bytes": count_bytes,
            "bytes": count_bytes + 2 * (out_rows + in_rows) * h * 4}


def layer_part(args, comm) -> dict:
    """Build the three sides, check them equal, time them round by round (collective)."""
    from threefold.parallel.transforms.expert import apply_expert_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = layer_config(args)
    blocks = {"noep": whole_block(cfg, args.seed), "ep": whole_block(cfg, args.seed)}
    apply_expert_parallel(blocks["ep"], comm)
    x, dy = rank_tokens(args, rank)
    data = {"x": x, "dy": dy}
    if rank == 0:
        blocks["single"] = whole_block(cfg, args.seed)
        every = [rank_tokens(args, r) for r in range(world)]
        data["all_x"] = torch.cat([t[0] for t in every])
        data["all_dy"] = torch.cat([t[1] for t in every])
    equal = check_equal(blocks, data, comm)
    results = []  # (round, side, per-rank dicts)
    for r in range(args.rounds):
        order = LAYER_SIDES if r % 2 == 0 else tuple(reversed(LAYER_SIDES))
        for side in order:
            mine = run_layer_side(side, blocks, data, args, comm)
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
            results.append((r, side, everyone))
    return {"cfg": cfg, "equal": equal, "results": results}


# --------------------------------------------------------------------------------------------
# Part 2: MoE vs dense training step, one process
# --------------------------------------------------------------------------------------------
def model_configs(args) -> tuple[ModelConfig, ModelConfig]:
    """The MoE preset and the dense model with the same active parameters per token (no
    experts, MLP width k·f)."""
    moe = ModelConfig(preset=args.model_preset, vocab_size=args.vocab).resolved()
    if not moe.num_local_experts:
        raise SystemExit(f"--model-preset {args.model_preset} has no experts")
    dense = ModelConfig(preset=args.model_preset, vocab_size=args.vocab, num_local_experts=0,
                        intermediate_size=moe.num_experts_per_tok * moe.intermediate_size
                        ).resolved()
    for c in (moe, dense):
        c.max_position_embeddings = max(c.max_position_embeddings, args.model_seq_len)
    return moe, dense


def train_steps(mcfg: ModelConfig, args, batch) -> dict:
    """Build the model, warm-up + timed full training steps; seconds and losses."""
    from threefold.model.decoder import causal_lm_loss
    from threefold.model.moe import RouterLog
    from threefold.parallel.engines.adamw import make_adamw
    from threefold.training.train import build_model

    ocfg = OptimConfig()
    model = build_model(mcfg, torch.device("cpu"), args.seed)
    opt = make_adamw(model.parameters(), ocfg)
    x, y = batch
    n = y.numel()
    losses, fb, t0 = [], 0.0, time.perf_counter()
    for s in range(args.model_warmup + args.model_steps):
        if s == args.model_warmup:
            fb, t0 = 0.0, time.perf_counter()
        t1 = time.perf_counter()
        loss = causal_lm_loss(model(x), y, reduction="sum")
        if mcfg.num_local_experts:
            loss = loss + RouterLog(mcfg).add(model, n)
        loss = loss / n
        loss.backward()
        fb += time.perf_counter() - t1
        torch.nn.utils.clip_grad_norm_(model.parameters(), ocfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "fwd_bwd_seconds": fb, "optimizer_seconds": seconds - fb,
            "losses": losses}


def model_part(args) -> dict | None:
    """Rank 0 runs both models round by round; the other ranks wait (collective)."""
    out = None
    if dist.get_rank() == 0:
        moe, dense = model_configs(args)
        g = torch.Generator().manual_seed(args.seed)
        tokens = torch.randint(args.vocab, (args.model_batch, args.model_seq_len + 1),
                               generator=g)
        batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        cfgs = {"moe": moe, "dense": dense}
        results = []
        for r in range(args.rounds):
            order = MODEL_SIDES if r % 2 == 0 else tuple(reversed(MODEL_SIDES))
            for side in order:
                results.append((r, side, [train_steps(cfgs[side], args, batch)]))
        out = {"moe": moe, "dense": dense, "results": results}
    dist.barrier()
    return out


# --------------------------------------------------------------------------------------------
# Part 3: grouped vs looped experts, one process
# --------------------------------------------------------------------------------------------
IMPL_SIDES = ("grouped", "loop")


def impl_part(args) -> dict:
    """Both implementations on the same weights and tokens: their difference, then timed
    forward+backward round by round (one process)."""
    from threefold.model.experts import grouped_mm_unfit

    cfg = ModelConfig(preset=args.model_preset, vocab_size=args.vocab).resolved()
    if not cfg.num_local_experts:
        raise SystemExit(f"--model-preset {args.model_preset} has no experts")
    blocks = {side: whole_block(cfg, args.seed) for side in IMPL_SIDES}
    for side, block in blocks.items():
        block.experts.impl = side
    g = torch.Generator().manual_seed(args.seed + 100)
    shape = (args.impl_batch, args.impl_seq_len, cfg.hidden_size)
    x, dy = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    unfit = grouped_mm_unfit(x.device, x.dtype, cfg.hidden_size, cfg.intermediate_size)
    if unfit:
        raise SystemExit(f"grouped would fall back to the loop here: {unfit}")
    outs = {side: fwd_bwd(block, x, dy) for side, block in blocks.items()}
    diff = {"y": float((outs["grouped"][0] - outs["loop"][0]).abs().max()),
            "dx": float((outs["grouped"][1] - outs["loop"][1]).abs().max())}
    for name, p in blocks["grouped"].named_parameters():
        q = dict(blocks["loop"].named_parameters())[name]
        diff["d_" + name] = float((p.grad - q.grad).abs().max())
    results = []
    for r in range(args.rounds):
        order = IMPL_SIDES if r % 2 == 0 else IMPL_SIDES[::-1]
        for side in order:
            seconds, _ = time_steps(blocks[side], x, dy, args)
            results.append((r, side, [{"seconds": seconds}]))
    return {"cfg": cfg, "diff": diff, "results": results}


def summarise_impl(args, impl: dict) -> list[dict]:
    """Part 3's lines; its ratio rows (grouped over loop, tokens/s)."""
    cfg = impl["cfg"]
    tokens = args.impl_batch * args.impl_seq_len
    print(f"\n== part 3: experts grouped (torch._grouped_mm) vs loop, {args.model_preset} layer "
          f"(h {cfg.hidden_size}, {cfg.num_local_experts} experts x f {cfg.intermediate_size}, "
          f"top-{cfg.num_experts_per_tok}), {args.impl_batch}x{args.impl_seq_len} = {tokens} "
          f"tokens, fp32, {torch.get_num_threads()} thread(s), forward+backward, "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds ==")
    print("max abs diff grouped - loop: " + ", ".join(f"{k} {v:.2e}"
                                                      for k, v in impl["diff"].items()))
    rows = _ratio_rows(impl["results"], args.rounds, tokens * args.steps, "grouped", "loop")
    print(f"tokens/s grouped/loop: {_spread([r['ratio'] for r in rows])}")
    print(json.dumps({"benchmark": "moe_impl_summary", "revision": revision(),
                      "preset": args.model_preset, "tokens": tokens,
                      "threads": torch.get_num_threads(), "max_abs_diff": impl["diff"],
                      "ratio": [r["ratio"] for r in rows]}))
    return rows


def run_impl_only(args) -> None:
    """``--impl-only``: part 3 in this process, its report."""
    torch.set_num_threads(args.impl_threads)
    print(f"bench_moe part 3 only: threefold at {revision()}; 1-min load average "
          f"{os.getloadavg()[0]:.1f}")
    rows = summarise_impl(args, impl_part(args))
    print("\ngrouped vs looped experts, one process (tokens/s ratio grouped/loop):")
    report("moe_experts_grouped_vs_loop", rows, "ratio", 1.0)


# --------------------------------------------------------------------------------------------
# One launch
# --------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """One rank: the ep mesh, part 1 on every rank, part 2 on rank 0, rank 0 summarises."""
    from threefold.comm.counted import Comm
    from threefold.comm.distributed import init_distributed, shutdown
    from threefold.layout import Layout
    from threefold.layout.axes import EXPERT_AXES
    from threefold.comm.mesh import build_mesh

    torch.set_num_threads(1)
    env = init_distributed(device="cpu")
    world = env.world_size
    dims = Layout(dp_shard=world, ep=world)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    for axis in EXPERT_AXES:
        comm.add_axis(axis, dims.axis_groups(axis))
    load_start = os.getloadavg()[0]
    layer = layer_part(args, comm)
    model = model_part(args) if args.model else None
    impl = None
    if args.impl:  # rank 0 alone, the others wait
        if env.rank == 0:
            torch.set_num_threads(args.impl_threads)
            impl = impl_part(args)
        dist.barrier()
    if env.rank == 0:
        summarise(args, world, layer, model, (load_start, os.getloadavg()[0]), impl)
    shutdown()


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def _spread(values: list[float]) -> str:
    return (f"median {statistics.median(values):.3f}, min {min(values):.3f}, "
            f"max {max(values):.3f}")


def _ratio_rows(results, rounds: int, tokens: float, a: str, b: str) -> list[dict]:
    """Per round: tokens/s of ``a`` and ``b`` (``tokens`` over the slowest rank's time) and
    their ratio a/b."""
    rows = []
    for r in range(rounds):
        sec = {side: max(p["seconds"] for p in ranks) for rr, side, ranks in results if rr == r}
        rows.append({"round": r, f"{a}_tok_s": tokens / sec[a], f"{b}_tok_s": tokens / sec[b],
                     "ratio": sec[b] / sec[a]})
    return rows


def summarise(args, world, layer, model, load: tuple[float, float], impl=None) -> None:
    """Rank 0: the tables and JSON lines (see the module doc). ``load``: the machine's 1-minute
    load average at the start and the end (other processes share the cores: ratios taken in
    the same run survive that, their spread shows it)."""
    cfg, equal, res = layer["cfg"], layer["equal"], layer["results"]
    h, e, k, ep = cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, world
    n_tok = args.batch * args.seq_len
    cores = len(os.sched_getaffinity(0))
    print(f"\nbench_moe: threefold at {revision()}; {world} ranks (gloo, 1 thread each, "
          f"{cores} cores; 1-min load average {load[0]:.1f} at start, {load[1]:.1f} at end)")
    print(f"\n== part 1: MoE layer forward+backward, h {h}, {e} experts top-{k}, f "
          f"{cfg.intermediate_size}, fp32; {ep} ranks x {args.batch}x{args.seq_len} = "
          f"{n_tok} tokens each; {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.rounds} rounds ==")
    parts = [f"{key} {equal[key]['max_abs_diff']:.2e} (of max |{key}| "
             f"{equal[key]['max_abs']:.3g})" for key in ("y", "dx", "d_gate_up", "d_down")]
    same = all(equal[key]["max_abs_diff"] <= 1e-5 * equal[key]["max_abs"]
               for key in ("y", "dx", "d_gate_up", "d_down"))
    print(f"ep vs noep, max abs diff over ranks (output y, input grad dx, expert-weight "
          f"grads): {', '.join(parts)} -> {'equal' if same else 'DIFFER'} (rtol 1e-5)")

    # bytes: measured per step (timed runs and the one checked step) vs the closed form
    ep_runs = [ranks for rr, side, ranks in res if side == "ep"]
    rows, bytes_ok = [], True
    uniform_rows = n_tok * k * (ep - 1) / ep
    uniform = round(e * 8 * (ep - 1) / ep + 2 * 2 * uniform_rows * h * 4)
    for rank in range(world):
        cf = closed_form(equal["counts"], rank, ep, h)
        per_step = {p[rank]["a2a_bytes_total"] / p[rank]["a2a_steps"] for p in ep_runs}
        rows_per_step = {p[rank]["rows_sent"] / p[rank]["a2a_steps"] for p in ep_runs}
        measured = per_step.pop() if len(per_step) == 1 else float("nan")
        ok = measured == cf["bytes"] and rows_per_step == {cf["out_rows"] + cf["in_rows"]}
        bytes_ok &= ok
        counts = equal["counts"][rank]
        rows.append({"rank": rank, "measured_B": int(measured) if ok else measured,
                     "closed_form_B": cf["bytes"], "rows_out": cf["out_rows"],
                     "rows_in": cf["in_rows"], "uniform_rows": uniform_rows,
                     "uniform_B": uniform, "imbalance": max(counts) / (sum(counts) / e),
                     "equal": ok})
    print(f"\nall-to-all bytes on ep per rank per step (forward + backward; count exchange "
          f"{e}*8*({ep}-1)/{ep} = {e * 8 * (ep - 1) // ep} B + 2 x (rows_out + rows_in) x "
          f"{h} x 4 B; uniform routing: {n_tok}*{k}*({ep}-1)/{ep} = {uniform_rows:g} rows "
          f"each way; imbalance = max/mean of the rank's assignments per expert):")
    print_table(rows, width=13)
    print(f"one checked step, rank 0: {equal['one_step_bytes']} B; every timed step of every "
          f"round equals the closed form on every rank: {bytes_ok}")

    tokens = n_tok * ep * args.steps
    vs_noep = _ratio_rows(res, args.rounds, tokens, "ep", "noep")
    vs_single = _ratio_rows(res, args.rounds, tokens, "ep", "single")
    print(f"\nthroughput (all ranks' tokens over the slowest rank's time): ep{ep}/noep "
          f"{_spread([r['ratio'] for r in vs_noep])}; ep{ep}/single "
          f"{_spread([r['ratio'] for r in vs_single])}")
    summary = {"benchmark": "moe_summary", "revision": revision(), "ranks": world,
               "cores": cores, "load_average": list(load),
               "layer": {"h": h, "experts": e, "top_k": k, "f": cfg.intermediate_size,
                         "tokens_per_rank": n_tok, "equal": same, "check": equal,
                         "bytes": rows, "bytes_ok": bytes_ok, "uniform_bytes": uniform,
                         "ratio_vs_noep": [r["ratio"] for r in vs_noep],
                         "ratio_vs_single": [r["ratio"] for r in vs_single]}}

    model_rows = None
    if model:
        moe, dense = model["moe"], model["dense"]
        print(f"\n== part 2: one process, full training step (forward, loss + router terms, "
              f"backward, clip, AdamW), {args.model_batch}x{args.model_seq_len} tokens, vocab "
              f"{args.vocab}, {args.model_warmup} warm-up + {args.model_steps} timed steps, "
              f"{args.rounds} rounds ==")
        counts = {}
        for name, c in (("moe", moe), ("dense", dense)):
            counts[name] = {"total": num_parameters(c), "active": active_parameters(c)}
            print(f"{name:>6}: {args.model_preset if name == 'moe' else 'dense'} h "
                  f"{c.hidden_size}, {c.num_hidden_layers} layers, "
                  + (f"{c.num_local_experts} experts x f {c.intermediate_size} top-"
                     f"{c.num_experts_per_tok}" if c.num_local_experts
                     else f"MLP width {c.intermediate_size}")
                  + f": {counts[name]['total'] / 1e6:.3f}M parameters, "
                    f"{counts[name]['active'] / 1e6:.3f}M active per token")
        first = {side: ranks[0]["losses"] for rr, side, ranks in model["results"] if rr == 0}
        print("losses, round 0: " + "; ".join(
            f"{s} " + ", ".join(f"{v:.4f}" for v in first[s]) for s in MODEL_SIDES))
        model_rows = _ratio_rows(model["results"], args.rounds,
                                 args.model_batch * args.model_seq_len * args.model_steps,
                                 "moe", "dense")
        res2 = model["results"]
        for r in model_rows:  # where the time goes: forward+backward vs clip + AdamW
            part = {side: ranks[0] for rr, side, ranks in res2 if rr == r["round"]}
            r["fwd_bwd_ratio"] = (part["dense"]["fwd_bwd_seconds"]
                                  / part["moe"]["fwd_bwd_seconds"])
            r["moe_opt_share"] = part["moe"]["optimizer_seconds"] / part["moe"]["seconds"]
            r["dense_opt_share"] = part["dense"]["optimizer_seconds"] / part["dense"]["seconds"]
        print(f"tokens/s moe/dense, whole step: {_spread([r['ratio'] for r in model_rows])}; "
              f"forward+backward only: {_spread([r['fwd_bwd_ratio'] for r in model_rows])} "
              f"(clip + AdamW + zero_grad run over all parameters: "
              f"{counts['moe']['total'] / counts['dense']['total']:.2f}x as many in the MoE)")
        summary["model"] = {"params": counts, "losses_round0": first,
                            "ratio": [r["ratio"] for r in model_rows],
                            "fwd_bwd_ratio": [r["fwd_bwd_ratio"] for r in model_rows]}
    print(json.dumps(summary))
    impl_rows = summarise_impl(args, impl) if impl else None

    print(f"\nep{ep} vs the same layer without ep on {ep} ranks (tokens/s ratio ep/noep):")
    report(f"moe_layer_ep{ep}_vs_noep{ep}", vs_noep, "ratio", 1.0)
    print(f"\nep{ep} vs one process running all ranks' tokens (tokens/s ratio ep/single):")
    report(f"moe_layer_ep{ep}_vs_single_process", vs_single, "ratio", 1.0)
    if model_rows:
        print("\nMoE vs dense with the same active parameters, one process (tokens/s ratio "
              "moe/dense):")
        report("moe_vs_dense_train_step", model_rows, "ratio", 0.8)
    if impl_rows:
        print("\ngrouped vs looped experts, one process (tokens/s ratio grouped/loop):")
        report("moe_experts_grouped_vs_loop", impl_rows, "ratio", 1.0)


def main() -> None:
    """Re-launch under torchrun (4 ranks by default) when started plainly; else be one rank
    (``--impl-only``: part 3 here, no launch)."""
    args = parse_args()
    if args.impl_only:
        run_impl_only(args)
        return
    sys.exit(run_ranks(__file__, worker, args, [args.ranks]))


if __name__ == "__main__":
    main()
