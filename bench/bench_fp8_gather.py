"""ZeRO-3's FP8 all-gather (``parallel.fp8_all_gather``) against the param_dtype gather on
this CPU, 2 ranks (gloo), side by side in one invocation: the bytes each rank sends over
dp_shard per step (counted by ``threefold.comm.counted``), tokens/s and the final losses.

    python3 bench/bench_fp8_gather.py            # small preset, 40 steps, 2 rounds
    python3 bench/bench_fp8_gather.py --quick    # tiny preset, 10 steps, 1 round

Both sides train ``train.fp8 tensorwise``, ``train.dtype bfloat16`` (bf16 gathers: the
reference is FSDP2-style 16-bit ZeRO-3), ``parallel.zero_stage 3`` from the same seed on
the same data; only ``parallel.fp8_all_gather`` differs. Each run is its own torchrun
launch (``--side``, ``--round``: the script re-launches itself); the sides alternate within
each round, so a busy moment on the shared machine does not fall on one side only. On a CPU the
gather is a memory copy and the cast to e4m3 costs more than the bytes it saves, so the
tokens/s ratio is a CPU reading; the bytes ratio is what a network sees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, relaunch_with_torchrun, under_torchrun  # noqa: E402
from threefold.config import load_config  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny preset, 10 steps, 1 round")
    ap.add_argument("--preset", help="model preset (default small, --quick tiny)")
    ap.add_argument("--steps", type=int, help="steps per run (default 40, --quick 10)")
    ap.add_argument("--rounds", type=int, help="runs per side (default 2, --quick 1)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (both ranks)")
    ap.add_argument("--out", default="/tmp/threefold_bench_fp8_gather",
                    help="folder for the runs and the corpus (shared by the ranks)")
    ap.add_argument("--side", choices=["param_dtype", "8bit"], help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.preset = args.preset or ("tiny" if args.quick else "small")
    args.steps = args.steps or (10 if args.quick else 40)
    args.rounds = args.rounds or (1 if args.quick else 2)
    return args


def run(args, root: Path, gather8: bool, rnd: int) -> dict:
    """One 2-rank training run; rank 0's bytes, tokens/s and losses."""
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    out = root / f"{'8bit' if gather8 else 'param_dtype'}_{rnd}"
    cfg = load_config(None, [
        ("model.preset", args.preset), ("data.corpus", str(root / "corpus.txt")),
        ("data.cache_dir", str(root / "cache")), ("data.vocab_size", "512"),
        ("data.seq_len", str(args.seq_len)), ("train.global_batch_size", str(args.batch)),
        ("train.micro_batch_size", str(args.batch // 2)), ("train.steps", str(args.steps)),
        ("train.dtype", "bfloat16"), ("train.fp8", "tensorwise"),
        ("parallel.zero_stage", "3"), ("parallel.fp8_all_gather", str(gather8).lower()),
        ("train.output_dir", str(out)), ("train.eval_interval", "0"),
        ("train.eval_batches", "2"), ("train.log_interval", "1000"), ("train.progress", "off"),
        ("optim.lr", "1e-3"), ("checkpoint.save_final", "false")])
    summary = train(cfg, Distributed(cfg))
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "tokens_per_second" in r]
    return {"tok_s": statistics.median(r["tokens_per_second"] for r in steps[2:] or steps),
            "dp_shard_bytes": summary["comm_bytes_per_step"]["dp_shard"],
            "loss": steps[-1]["loss"], "val_loss": summary["validation_loss"]}


def worker(args: argparse.Namespace) -> None:
    """One rank of one run (``--side``, ``--round``); rank 0 writes the run's result."""
    import os

    torch.set_num_threads(1)
    root = Path(args.out)
    res = run(args, root, args.side == "8bit", args.round)
    if os.environ.get("RANK", "0") == "0":
        (root / f"{args.side}_{args.round}" / "result.json").write_text(json.dumps(res))


def summarise(args: argparse.Namespace) -> None:
    """The table and one JSON line from the runs' results."""
    root, rows = Path(args.out), []
    for side in ("param_dtype", "8bit"):
        r = [json.loads((root / f"{side}_{k}" / "result.json").read_text())
             for k in range(args.rounds)]
        rows.append({"gather": "e4m3 (8-bit)" if side == "8bit" else "param_dtype (bf16)",
                     "dp_shard_bytes": r[0]["dp_shard_bytes"],
                     "tok_s": statistics.median(x["tok_s"] for x in r),
                     "loss": r[-1]["loss"], "val_loss": r[-1]["val_loss"]})
    for row in rows:
        row["bytes_ratio"] = row["dp_shard_bytes"] / rows[0]["dp_shard_bytes"]
        row["tok_s_ratio"] = row["tok_s"] / rows[0]["tok_s"]
    print_table(rows)
    print(json.dumps({"benchmark": "fp8_gather", "preset": args.preset, "steps": args.steps,
                      "rounds": args.rounds, "ranks": 2, "rows": rows}), flush=True)


def main() -> None:
    """Write the corpus once, launch every run under torchrun (2 ranks), summarise; inside
    torchrun, be one rank of one run."""
    args = parse_args()
    if under_torchrun():
        worker(args)
        return
    from threefold.data.corpus import sample_corpus

    Path(args.out).mkdir(parents=True, exist_ok=True)
    sample_corpus(Path(args.out) / "corpus.txt", 400)
    for rnd in range(args.rounds):
        for side in ("param_dtype", "8bit"):
            code = relaunch_with_torchrun(str(Path(__file__).resolve()),
                                          sys.argv[1:] + ["--side", side, "--round", str(rnd)], 2)
            if code:
                sys.exit(code)
    summarise(args)


if __name__ == "__main__":
    main()
