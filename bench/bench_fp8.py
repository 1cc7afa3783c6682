"""FP8 training (``train.fp8`` tensorwise and rowwise) against bf16 on this CPU: the final
loss gap and the throughput ratio, the three runs in one invocation.

    python3 bench/bench_fp8.py            # 200 steps of the small preset (docs/benchmarks.md)
    python3 bench/bench_fp8.py --quick    # 20 steps of the tiny preset

Each configuration trains from the same seed on the same data (``data.corpus``: the sample
corpus ``threefold.data.corpus.sample_corpus`` writes) through the ordinary trainer, one
process, ``train.dtype bfloat16``; only ``train.fp8`` differs. Reported per configuration:
the last step's training loss and the final validation loss, the validation gap to bf16
(goal: within 1%), and tokens/s (the median over the steps after the first 10, from
metrics.jsonl) with its ratio to bf16's. The runs follow one another, so a busy moment on
the shared machine falls on one side only: the ratio is a CPU reading, not a GPU one. The
CPU has no FP8 units: ``torch._scaled_mm``'s CPU kernel converts its operands, so a ratio
below 1 here is expected; what FP8 buys is measured by ``bench/bench_gpu.py`` on a GPU.

Every configuration runs on ``--threads`` threads (default 1): ``torch._scaled_mm``'s CPU
kernel spins its threads, and on a shared machine two of them make a small product 100×
slower, which would measure the machine's load, not FP8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table  # noqa: E402
from threefold.config import load_config  # noqa: E402
from threefold.data.corpus import sample_corpus  # noqa: E402
from threefold.training.train import train  # noqa: E402

RECIPES = ("none", "tensorwise", "rowwise")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20 steps of the tiny preset")
    ap.add_argument("--steps", type=int, help="steps (default 200, --quick 20)")
    ap.add_argument("--preset", help="model preset (default small, --quick tiny)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="train.seed: init and data order")
    ap.add_argument("--out", help="folder for the runs (default: a temporary one)")
    return ap.parse_args(argv)


def run(recipe: str, args, root: Path, corpus: Path) -> dict:
    """One training run; its losses and throughput from metrics.jsonl."""
    out = root / recipe
    cfg = load_config(None, [
        ("model.preset", args.preset), ("data.corpus", str(corpus)),
        ("data.cache_dir", str(root / "cache")), ("data.vocab_size", "512"),
        ("data.seq_len", str(args.seq_len)), ("train.global_batch_size", str(args.batch)),
        ("train.micro_batch_size", str(args.batch)), ("train.steps", str(args.steps)),
        ("train.dtype", "bfloat16"), ("train.fp8", recipe), ("train.output_dir", str(out)),
        ("train.eval_interval", "0"), ("train.eval_batches", "4"),
        ("train.log_interval", str(max(1, args.steps // 4))), ("train.progress", "off"),
        ("train.seed", str(args.seed)), ("optim.lr", "1e-3"), ("optim.warmup_steps", str(max(1, args.steps // 10))),
        ("checkpoint.save_final", "false")])
    summary = train(cfg)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "tokens_per_second" in r]
    return {"fp8": recipe, "loss": steps[-1]["loss"], "val_loss": summary["validation_loss"],
            "tok_s": statistics.median(r["tokens_per_second"] for r in steps[10:] or steps)}


def main(argv: list[str] | None = None) -> dict:
    """Run the three configurations; print the table and one JSON line."""
    args = parse_args(argv)
    args.steps = args.steps or (20 if args.quick else 200)
    args.preset = args.preset or ("tiny" if args.quick else "small")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        corpus = sample_corpus(root / "corpus.txt", 400)
        rows = [run(r, args, root, corpus) for r in RECIPES]
    base = rows[0]
    for r in rows:
        r["val_gap"] = r["val_loss"] / base["val_loss"] - 1
        r["tok_s_ratio"] = r["tok_s"] / base["tok_s"]
    print_table(rows)
    worst = max(abs(r["val_gap"]) for r in rows)
    out = {"benchmark": "fp8", "preset": args.preset, "steps": args.steps, "seed": args.seed,
           "threads": args.threads, "rows": rows, "largest_val_gap": worst, "goal": 0.01,
           "meets_goal": worst <= 0.01}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
