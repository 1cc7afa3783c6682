"""Tokens/s of `threefold train` (world size 1) against a minimal hand-written PyTorch loop on
the same model, data and settings, in the same run, alternating A/B to share the noise.

    python3 bench/bench_train_overhead.py [--steps 30] [--rounds 3]

Goal (issue 2): ratio threefold / plain >= 0.98.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import report  # noqa: E402
from threefold.config import load_config  # noqa: E402
from threefold.data import BatchSampler, prepare_data  # noqa: E402
from threefold.model import causal_lm_loss  # noqa: E402
from threefold.train import build_model, lr_at, train  # noqa: E402


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
    sampler = BatchSampler(data.train, cfg.data.seq_len, cfg.train.global_batch_size,
                           cfg.train.seed)
    tok = cfg.train.global_batch_size * cfg.data.seq_len
    rates = []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = sampler.local_batch(step, 0, 1)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = causal_lm_loss(model(x), y, reduction="sum") / y.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rates.append(tok / (time.perf_counter() - t0))
    return sum(rates[1:]) / len(rates[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            out = Path(tmp) / f"run{r}"
            cfg = load_config(None, [("train.steps", str(args.steps)),
                                     ("train.output_dir", str(out)), ("train.eval_batches", "1"),
                                     ("train.eval_interval", "0"), ("train.progress", "off"),
                                     ("train.log_interval", "1000"),
                                     ("checkpoint.save_final", "false")])
            plain = plain_loop(cfg, args.steps)
            ours = train(cfg)["tokens_per_second"]
            rows.append({"round": r, "threefold_tok_s": ours, "plain_tok_s": plain,
                         "ratio": ours / plain})
    report("train_overhead", rows, "ratio", 0.98)


if __name__ == "__main__":
    main()
