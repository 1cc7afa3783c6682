"""Tokens/s of `threefold train` (world size 1) against a minimal hand-written PyTorch loop on
the same model, data and settings, in the same run, alternating A/B to share the noise; or,
with ``--compile``, threefold eager against threefold with ``train.compile true``.

    python3 bench/bench_train_overhead.py [--steps 30] [--rounds 3]
    python3 bench/bench_train_overhead.py --compile [--steps 20] [--rounds 3] [--warmup 3]

Goal: ratio threefold / plain >= 0.98.

``--compile``: each round trains the same run eagerly and compiled (the order
flipped every round); throughput is the mean tokens/s of the steps after the first
``--warmup`` (compilation, and any recompilation, happens in the first steps and in the initial
validation pass); the compile time is the compiled run's extra wall time over the eager run's
(process set-up, data and evaluation are common to both), round 0 with an empty inductor cache
(what a first run pays: ``TORCHINDUCTOR_CACHE_DIR`` points at a fresh directory), later rounds
with that cache warm (new model objects, so dynamo traces again; inductor's code is reused).
Each ratio is printed with its spread over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import report  # noqa: E402
from threefold.config import load_config  # noqa: E402
from threefold.data import MixtureSampler, prepare_data  # noqa: E402
from threefold.model.decoder import causal_lm_loss  # noqa: E402
from threefold.training.steps import lr_at  # noqa: E402
from threefold.training.train import build_model, train  # noqa: E402


def plain_loop(cfg, steps: int) -> float:
    """The reference: the shortest correct loop, no logging, no engine. Returns tokens/s
    over steps 2..n (the first pays for warm-up, as in threefold's summary)."""
    data = prepare_data(cfg.data)
    mcfg = cfg.model.resolved(data.vocab_size)
    torch.manual_seed(cfg.train.seed)
    model = build_model(mcfg, torch.device("cpu"), cfg.train.seed)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, foreach=False)
    sampler = MixtureSampler(data.sources, cfg.data.seq_len, cfg.train.global_batch_size,
                             cfg.train.seed)
    tok = cfg.train.global_batch_size * cfg.data.seq_len
    rates = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch = sampler.local_batch(step, 0, 1)
        x, y = batch["input_ids"], batch["labels"]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = causal_lm_loss(model(x), y, reduction="sum") / y.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rates.append(tok / (time.perf_counter() - t0))
    return sum(rates[1:]) / len(rates[1:])


def config(out: Path, steps: int, compile_: bool = False):
    """The benchmark's run: the default model and data, ``steps`` steps, no checkpoint."""
    return load_config(None, [("train.steps", str(steps)), ("train.output_dir", str(out)),
                              ("train.eval_batches", "1"), ("train.eval_interval", "0"),
                              ("train.progress", "off"), ("train.log_interval", "1000"),
                              ("train.compile", "true" if compile_ else "false"),
                              ("checkpoint.save_final", "false")])


def timed_train(out: Path, steps: int, warmup: int, compile_: bool) -> tuple[float, float]:
    """(mean tokens/s over the steps after ``warmup``, wall seconds of the whole run)."""
    t0 = time.perf_counter()
    train(config(out, steps, compile_))
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    after = [r["tokens_per_second"] for r in recs if r["step"] > warmup]
    return sum(after) / len(after), wall


def compare_compile(args: argparse.Namespace, tmp: str) -> None:
    """Eager vs compiled threefold, alternating, one row per round."""
    if args.warmup >= args.steps:
        raise SystemExit("--warmup must be smaller than --steps")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")  # round 0: cold
    rows = []
    for r in range(args.rounds):
        got = {}
        for mode in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            got[mode] = timed_train(Path(tmp) / f"{mode}{r}", args.steps, args.warmup,
                                    mode == "compiled")
        rows.append({"round": r, "eager_tok_s": got["eager"][0],
                     "compiled_tok_s": got["compiled"][0],
                     "ratio": got["compiled"][0] / got["eager"][0],
                     "compile_s": got["compiled"][1] - got["eager"][1],
                     "inductor_cache": "cold" if r == 0 else "warm"})
    print(f"threefold eager vs train.compile true ({torch.__version__}, inductor), "
          f"{args.steps} steps per run, tokens/s after {args.warmup} warm-up steps; "
          "compile_s = compiled wall time - eager wall time:")
    report("train_compile", rows, "ratio", 1.0)  # with the spread over rounds
    print(f"compile time: {rows[0]['compile_s']:.1f} s with a cold inductor cache"
          + (f", median {statistics.median(r['compile_s'] for r in rows[1:]):.1f} s warm"
             if len(rows) > 1 else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (30; 20 compiled)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true",
                    help="compare eager with train.compile true instead of with a plain loop")
    ap.add_argument("--warmup", type=int, default=3,
                    help="--compile: steps not timed (compilation)")
    args = ap.parse_args()
    args.steps = args.steps or (20 if args.compile else 30)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.compile:
            compare_compile(args, tmp)
            return
        from threefold.training.hostmem import reuse_freed_host_memory

        for r in range(args.rounds):
            cfg = config(Path(tmp) / f"run{r}", args.steps)
            # the plain loop gets the host-memory setting `threefold train` makes on a CPU
            # (process-wide once made: from round 0 on, both sides run with it)
            reuse_freed_host_memory(cfg.train.host_mmap_threshold_mb)
            if r % 2 == 0:  # A/B, the order flipped every round
                plain = plain_loop(cfg, args.steps)
                ours = train(cfg)["tokens_per_second"]
            else:
                ours = train(cfg)["tokens_per_second"]
                plain = plain_loop(cfg, args.steps)
            rows.append({"round": r, "threefold_tok_s": ours, "plain_tok_s": plain,
                         "ratio": ours / plain})
    report("train_overhead", rows, "ratio", 0.98)  # with the spread over rounds


if __name__ == "__main__":
    main()
