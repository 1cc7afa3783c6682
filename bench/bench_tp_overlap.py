"""Overlapped tensor parallelism (``parallel.tp_overlap``) vs the same sequence-parallel model
without it, on 2 (and 4) CPU ranks.

    python3 bench/bench_tp_overlap.py                          # tp 2, 4 chunks
    python3 bench/bench_tp_overlap.py --tp 2,4 --chunks 2,4    # more sizes

Started without torchrun's environment, the script re-launches itself under torchrun (gloo,
one OpenMP thread per rank) once per degree in ``--tp``; every rank of a launch is one
tensor-parallel group. Within a launch the configurations alternate round by round (plain
first, then the overlapped ones; reversed the next round) so that noise from the shared
machine falls on both sides of each ratio.

Every side starts from the same weights (``build_model`` with one seed), sees the same batch
and takes the same steps (forward, the vocab-parallel loss, backward, AdamW): only
``apply_tensor_parallel``'s ``tp_overlap`` differs. Reported per launch: the step-1 and last
losses (they must be equal to the bit: the chunked matmuls give the same floats), tp bytes
per step (equal), and per round tokens/s of each side (slowest rank's time) and the ratio
overlapped/plain, as a table and a JSON line (``bench.common.report``; goal >= 1.0).

What it shows and what it cannot: on CPU, gloo runs a collective on its own thread while the
rank's one compute thread multiplies the next chunk, so the overlap is real but both share
the machine's cores and memory bandwidth; what NVLink/NCCL gain (collectives on the GPU's
copy engines and a separate stream) needs two or more GPUs, which one GPU cannot show.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import report, run_ranks, tp_rank  # noqa: E402
from threefold.accounting import num_parameters  # noqa: E402
from threefold.config import OptimConfig  # noqa: E402
from threefold.parallel.engines.adamw import make_adamw
from threefold.training.train import build_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (the same in the launcher and in every rank)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="2", help="comma-separated tp degrees (one launch each)")
    ap.add_argument("--chunks", default="4", help="comma-separated tp_overlap values")
    ap.add_argument("--preset", default="tiny", help="model preset (tiny: h 256, 4 layers)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary (a multiple of tp)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=4, help="rounds (order flips each round)")
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args(argv)


def run_side(chunks: int, mcfg, args, dims, mesh, batch) -> dict:
    """A fresh sequence-parallel model with ``tp_overlap`` = ``chunks`` (0: plain): warm-up
    and timed steps; this rank's seconds, losses and tp bytes per step."""
    from threefold.comm.counted import Comm
    from threefold.parallel.transforms.tensor import apply_tensor_parallel

    comm = Comm(dims, mesh)
    model = apply_tensor_parallel(build_model(mcfg, torch.device("cpu"), args.seed), comm,
                                  sequence_parallel=True, tp_overlap=chunks)
    opt = make_adamw(model.parameters(), OptimConfig())
    x, y = batch
    losses = []
    dist.barrier()
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            dist.barrier()  # every rank starts the timed window together
            t0 = time.perf_counter()
            comm.step_counters()
        loss = model(x, labels=y).sum() / y.numel()  # the vocab-parallel loss per token
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "losses": losses,
            "tp_bytes": comm.step_counters().get("tp", 0) / args.steps}


def worker(args: argparse.Namespace) -> None:
    """One rank: the tp mesh, the batch, every side each round; rank 0 summarises."""
    from threefold.comm.distributed import shutdown

    env, dims, mesh, mcfg, batch = tp_rank(args)
    world = env.world_size
    sides = [0] + [int(c) for c in args.chunks.split(",")]
    results = []  # (round, chunks, per-rank dicts)
    for r in range(args.rounds):
        for chunks in (sides if r % 2 == 0 else sides[::-1]):
            everyone = [None] * world
            dist.all_gather_object(everyone, run_side(chunks, mcfg, args, dims, mesh, batch))
            results.append((r, chunks, everyone))
    if env.rank == 0:
        summarise(args, mcfg, world, sides, results)
    shutdown()


def summarise(args, mcfg, world, sides, results) -> None:
    """Loss and byte agreement, then the throughput table and JSON line."""
    tok = args.batch * args.seq_len * args.steps
    print(f"\nbench_tp_overlap: {num_parameters(mcfg) / 1e6:.2f}M parameters ({args.preset}, "
          f"vocab {mcfg.vocab_size}), tp {world} with sequence parallelism (gloo, 1 thread per "
          f"rank), batch {args.batch}x{args.seq_len}, {args.warmup} warm-up + {args.steps} "
          f"timed steps, {args.rounds} rounds")
    first = {c: ranks[0] for r, c, ranks in results if r == 0}
    same = all(first[c]["losses"] == first[0]["losses"] for c in sides)
    bytes_same = all(first[c]["tp_bytes"] == first[0]["tp_bytes"] for c in sides)
    print(json.dumps({"benchmark": f"tp{world}_overlap_agreement", "losses_bitwise_equal": same,
                      "tp_bytes_equal": bytes_same, "tp_bytes_per_step": first[0]["tp_bytes"],
                      "loss_last": first[0]["losses"][-1]}))
    rows = []
    for r in range(args.rounds):
        sec = {c: max(p["seconds"] for p in ranks) for rr, c, ranks in results if rr == r}
        for c in sides[1:]:
            rows.append({"round": r, "tp": world, "chunks": c, "plain_tok_s": tok / sec[0],
                         "overlap_tok_s": tok / sec[c], "ratio": sec[0] / sec[c]})
    print()
    report(f"tp{world}_overlap_vs_plain_sp", rows, "ratio", 1.0)


def main() -> None:
    """Re-launch under torchrun (once per tp degree) when started plainly; else be one rank."""
    args = parse_args()
    sys.exit(run_ranks(__file__, worker, args, [int(v) for v in args.tp.split(",")]))


if __name__ == "__main__":
    main()
