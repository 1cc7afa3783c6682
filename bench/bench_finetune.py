"""threefold fine-tuning against TRL 1.16 + PEFT 0.21 on the same Hugging Face folder: tokens/s
and peak RSS of SFT and DPO, full and LoRA (r 16, alpha 32, every linear layer of the blocks),
each side in its own process, alternating, at the same thread count.

    python3 bench/bench_finetune.py --quick    # 4 layers, 4 steps: 10 min of CPU on 2 cores
    python3 bench/bench_finetune.py [--layers 30] [--steps 5] [--rounds 1] [--rows ...]

The model is SmolLM2-135M's shape (Llama, 30 layers, hidden 576, FFN 1536, 9 / 3 heads of 64,
vocabulary 49152, tied embeddings, RoPE θ 1e5) with random weights from a seed; there is no
hub here, so ``finetune_setup`` writes the folder (safetensors through transformers, a
byte-level BPE of 8192 tokens trained on Python's sources, ChatML template with
``{% generation %}`` marks) and the data. Rows (``--rows``): sft-full, sft-lora, dpo-full,
dpo-lora. Default shape: global batch 8 (8 packed rows, or 8 pairs: 16 sequences), 256
tokens, fp32, no recomputation, 5 steps; on this (shared) 2-core CPU `--rows sft-lora --steps 3`
alone took 11.5 min wall clock, so all four rows take about an hour.

What each side runs and what is held equal: ``bench/finetune_sides.py`` (the optimiser,
precision, recomputation, loss normalisation, LoRA initial values, DPO reference). SFT
packing: threefold packs the conversations by best-fit decreasing into rows with
``document_ids`` (``data.document_mask``); TRL's ``packing_strategy="bfd"`` is the same
algorithm and turns padding-free on (the rows concatenated into one sequence whose
``position_ids`` restart per conversation, from which transformers builds per-document
attention). The data is one global batch (``finetune_setup``), so both sides see every
conversation / pair at every step and their losses are compared at every step, within 1e-4
(the tolerance of tests/test_sft.py and tests/test_dpo.py's TRL comparisons).

Figures: tokens/s = the step's real tokens (conversation tokens; prompt + response of both
sides of each pair, no padding, the same count for both sides) over the mean step time of the
steps after the first (threefold: each step's own clock from metrics.jsonl; TRL: the time
between consecutive ``on_step_end`` callbacks, so its logging is inside its steps); peak RSS =
the process's own VmHWM over its whole life (start-up, loading, DPO scoring included);
"3f dry run GB" is what ``--dry-run`` predicts for threefold's side (the larger of its
start-up and step peaks, the process's own baseline included), to read against its peak.
Ratios are threefold ÷ TRL (speed: higher is better; memory: lower); a row's ratio is the
median over rounds; ``speed_ratio`` and ``memory_ratio`` are geometric means over the rows
(the worst row beside them). Goal: speed ≥ 1.0 and memory ≤ 1.0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, revision  # noqa: E402
from bench.finetune_setup import Lengths, build  # noqa: E402

ROWS = ("sft-full", "sft-lora", "dpo-full", "dpo-lora")
TOLERANCE = 1e-4
GB = 1e9


def step_tokens(paths: dict[str, Path], task: str, seq_len: int) -> int:
    """Real tokens of one step (= the whole data set): conversation tokens, or prompt +
    response tokens of both sequences of every pair, as threefold tokenizes them (TRL's
    tokenization of the same records gives the same counts: the losses agree)."""
    count = Lengths(paths["hf"])
    recs = [json.loads(x) for x in paths[task].read_text().splitlines()]
    if task == "sft":
        return sum(count(r["messages"]) for r in recs)
    from threefold.data.chat import eot_token
    from threefold.post.dpo import tokenize_pair

    eot = eot_token(count.tok)
    total = 0
    for i, r in enumerate(recs):
        p, c, j = tokenize_pair(r, count.template, count.tok, eot, f"pair {i}")
        if len(p) + max(len(c), len(j)) > seq_len:  # the two sides' cuts are not compared
            raise ValueError(f"pair {i} is longer than {seq_len} tokens")
        total += 2 * len(p) + len(c) + len(j)
    return total


def run_side(side: str, row: str, args, root: Path, out: Path) -> dict:
    """One side of one row in a fresh process; its RESULT line."""
    task, mode = row.split("-")
    cmd = [sys.executable, str(Path(__file__).with_name("finetune_sides.py")), side, task, mode,
           "--root", str(root), "--out", str(out), "--steps", str(args.steps),
           "--batch", str(args.batch), "--seq-len", str(args.seq_len),
           "--threads", str(args.threads), "--lr", str(args.lr),
           "--host-mmap-mb", args.host_mmap_mb]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               PYTHONPATH=str(Path(__file__).resolve().parents[1]), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{side} {row} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def measure(row: str, args, paths: dict, tmp: Path, tokens: int) -> dict:
    """Both sides of ``row``, ``args.rounds`` times, alternating which goes first; the row's
    figures (ratios: medians over rounds; losses: round 0's, checked every round)."""
    per_round, diffs = [], []
    for r in range(args.rounds):
        order = ("threefold", "trl") if (r + ROWS.index(row)) % 2 == 0 else ("trl", "threefold")
        got = {side: run_side(side, row, args, paths["hf"].parent, tmp / f"{row}-{side}-{r}")
               for side in order}
        for side, g in got.items():
            g["tok_s"] = tokens / statistics.mean(g["seconds"][1:] or g["seconds"])
        ours, theirs = got["threefold"]["losses"], got["trl"]["losses"]
        diffs.append(max(abs(a - b) for a, b in zip(ours, theirs)) if len(ours) == len(theirs)
                     else math.inf)
        per_round.append(got)
        print(f"  {row} round {r}: threefold {got['threefold']['tok_s']:.1f} tok/s "
              f"{got['threefold']['peak_rss'] / GB:.2f} GB, TRL {got['trl']['tok_s']:.1f} tok/s "
              f"{got['trl']['peak_rss'] / GB:.2f} GB, max loss difference {diffs[-1]:.2g}",
              flush=True)

    def med(side: str, key: str) -> float:
        return statistics.median(g[side][key] for g in per_round)

    return {"threefold_tok_s": med("threefold", "tok_s"), "trl_tok_s": med("trl", "tok_s"),
            "speed_ratio": statistics.median(g["threefold"]["tok_s"] / g["trl"]["tok_s"]
                                             for g in per_round),
            "threefold_peak_rss_gb": med("threefold", "peak_rss") / GB,
            "threefold_predicted_gb": per_round[0]["threefold"]["predicted_peak"] / GB,
            "trl_peak_rss_gb": med("trl", "peak_rss") / GB,
            "memory_ratio": statistics.median(g["threefold"]["peak_rss"] / g["trl"]["peak_rss"]
                                              for g in per_round),
            "threefold_losses": per_round[0]["threefold"]["losses"],
            "trl_losses": per_round[0]["trl"]["losses"], "max_loss_diff": max(diffs),
            "tokens_per_step": tokens}


def geomean(values: list[float]) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values))


def summarise(rows: dict[str, dict], args) -> dict:
    """Print the table and the losses; the JSON line's content."""
    print_table([{"row": k, "3f tok/s": v["threefold_tok_s"], "TRL tok/s": v["trl_tok_s"],
                  "speed ratio": v["speed_ratio"], "3f peak GB": v["threefold_peak_rss_gb"],
                  "3f dry run GB": v["threefold_predicted_gb"],
                  "TRL peak GB": v["trl_peak_rss_gb"], "memory ratio": v["memory_ratio"],
                  "max loss diff": v["max_loss_diff"]} for k, v in rows.items()], width=13)
    for k, v in rows.items():
        print(f"{k} losses: threefold {', '.join(f'{x:.6f}' for x in v['threefold_losses'])}"
              f" | TRL {', '.join(f'{x:.6f}' for x in v['trl_losses'])}")
    speed = [v["speed_ratio"] for v in rows.values()]
    memory = [v["memory_ratio"] for v in rows.values()]
    agree = all(v["max_loss_diff"] <= TOLERANCE for v in rows.values())
    out = {"bench": "finetune", "rows": rows, "speed_ratio": geomean(speed),
           "memory_ratio": geomean(memory), "speed_ratio_min": min(speed),
           "memory_ratio_max": max(memory), "ratios": "threefold / TRL; geometric mean over rows",
           "losses_agree": agree, "tolerance": TOLERANCE,
           "meets_goal": agree and geomean(speed) >= 1.0 and geomean(memory) <= 1.0,
           "shape": {"layers": args.layers, "steps": args.steps, "batch": args.batch,
                     "seq_len": args.seq_len, "threads": args.threads, "rounds": args.rounds},
           "revision": revision()}
    print(f"speed ratio (geometric mean) {out['speed_ratio']:.3f}, worst row {min(speed):.3f};"
          f" memory ratio {out['memory_ratio']:.3f}, worst row {max(memory):.3f}; losses "
          f"{'agree' if agree else 'DISAGREE'} within {TOLERANCE:g}")
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, 4 steps, one round")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="global batch: packed rows / pairs")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--keep", default="", help="write the folder, data and runs here")
    ap.add_argument("--host-mmap-mb", default="",
                    help="threefold's --train.host_mmap_threshold_mb (default: the command's, "
                    "1 for fine-tuning: the resident set follows the live tensors; 256 keeps "
                    "freed blocks for reuse, faster, beyond the dry run's prediction)")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.steps, args.rounds = 4, 4, 1
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is not timed)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep or scratch)
        paths = build(tmp / "inputs", args.layers, args.batch, args.seq_len)
        print(f"finetune bench: {args.layers} layers of SmolLM2-135M's shape, batch "
              f"{args.batch} x {args.seq_len} tokens, {args.steps} steps, {args.threads} "
              f"threads, {args.rounds} round(s), {revision()}", flush=True)
        rows = {}
        for row in args.rows.split(","):
            tokens = step_tokens(paths, row.split("-")[0], args.seq_len)
            rows[row] = measure(row, args, paths, tmp, tokens)
        out = summarise(rows, args)
    print(json.dumps(out), flush=True)
    return 0 if out["losses_agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
