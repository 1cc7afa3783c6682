"""Memory per rank, measured against predicted: start-up (building the model) and the step.

    python3 bench/bench_memory.py [--ranks 4,8] [--rows zero3,zero3_bf16,tp2_zero3,pp2_zero1,
        ep2_moe] [--steps 2] [--keep DIR] [--loading]

A ~256M-parameter Llama (vocabulary 32768, hidden 1024, FFN 2816, 16 layers, 8 heads / 4 KV
heads; seq 128, micro-batch 1, two micro-batches per data-parallel rank) trains for a few
steps under each layout, every rank a process of ``threefold train --nproc-per-node N``, as a
user starts it. The mixture-of-experts row keeps the width (4 experts of FFN 1408, top 2).

Measured: each rank's peaks from summary.json (``memory.per_rank``: the resident set's
high-water mark, reset between phases through /proc/self/clear_refs): ``startup_peak_bytes``
while the engine builds and fills the rank's tensors, ``step_peak_bytes`` over the steps (the
first validation included), the largest over ranks; with ``--loading`` the run is resumed
from its checkpoint for one more step and ``loading_peak_bytes`` (reading the weights and
AdamW's moments) is compared too. With ``--smol`` the rows are fine-tunes instead (``smol_full``,
``smol_lora``): SmolLM2-135M's shape (30 layers, tied vocabulary of 49,152, 9/3 heads of 64; random
weights written once as a Hugging Face folder under the bench's directory) fine-tuned by ``threefold
sft`` from that folder (``checkpoint.init_from``), fully and with LoRA r16 on every linear layer,
fp32, packed conversations of ``--seq`` tokens (default 2048) under the document mask, ``--micro``
sequences per rank (default 1), on 1 and 2 ranks (ZeRO-3 × 2); the configuration is
``tests/test_memory_finetune.finetune_overrides``'s, the test's own at 2 layers.

Predicted: ``threefold.launch.dryrun.predict``
for the same configuration and world size — the worst rank's start-up and step peaks, each
with the baseline (a fresh process's own resident bytes with torch and threefold imported,
measured once) — what ``threefold train --dry-run`` prints. Goal: every ratio within ±10%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import report  # noqa: E402
from threefold.config import load_config, parse_overrides  # noqa: E402

MODEL = ["--model.vocab_size", "32768", "--model.hidden_size", "1024",
         "--model.intermediate_size", "2816", "--model.num_hidden_layers", "16",
         "--model.num_attention_heads", "8", "--model.num_key_value_heads", "4",
         "--data.seq_len", "128", "--train.micro_batch_size", "1"]
MOE = ["--model.num_local_experts", "4", "--model.num_experts_per_tok", "2",
       "--model.intermediate_size", "1408"]
ROWS = {
    "zero3": ["--parallel.zero_stage", "3"],
    "zero3_bf16": ["--parallel.zero_stage", "3", "--train.dtype", "bfloat16"],
    "tp2_zero3": ["--parallel.tp", "2", "--parallel.zero_stage", "3"],
    "pp2_zero1": ["--parallel.pp", "2", "--parallel.zero_stage", "1"],
    "ep2_moe": MOE + ["--parallel.ep", "2", "--parallel.zero_stage", "3"],
}
GIB = 2**30


def _args(row: str, ranks: int, steps: int, out: Path, save: bool = False) -> list[str]:
    extra = ROWS[row]
    tp = int(extra[extra.index("--parallel.tp") + 1]) if "--parallel.tp" in extra else 1
    pp = int(extra[extra.index("--parallel.pp") + 1]) if "--parallel.pp" in extra else 1
    dp = ranks // (tp * pp)
    return MODEL + extra + ["--train.global_batch_size", str(2 * dp), "--train.steps",
                            str(steps), "--train.eval_batches", "1",
                            "--checkpoint.save_final", str(save).lower(),
                            "--train.progress", "off",
                            "--train.log_interval", "1000", "--train.output_dir", str(out)]


def _train(row: str, ranks: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "threefold", "train", "--nproc-per-node", str(ranks), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    if proc.returncode:
        raise RuntimeError(f"{row} on {ranks} ranks failed:\n{proc.stderr[-3000:]}")


def measure(row: str, ranks: int, steps: int, root: Path, loading: bool = False) -> dict:
    """Run the row's training on ``ranks`` processes; each phase's peak, largest over ranks
    (with ``loading``, the run is resumed from its final checkpoint for one more step, and
    the loading phase is measured there)."""
    out = root / f"{row}_{ranks}"
    _train(row, ranks, _args(row, ranks, steps, out, save=loading))
    per_rank = json.loads((out / "summary.json").read_text())["memory"]["per_rank"]
    got = {k: max(r[k] for r in per_rank) for k in ("startup_peak_bytes", "step_peak_bytes")}
    if loading:
        _train(row, ranks, _args(row, ranks, steps + 1, out) + ["--checkpoint.resume", "true"])
        per_rank = json.loads((out / "summary.json").read_text())["memory"]["per_rank"]
        got["loading_peak_bytes"] = max(r["loading_peak_bytes"] for r in per_rank)
    return got


def predicted(row: str, ranks: int, steps: int, root: Path) -> dict:
    """The dry run's prediction for the row on ``ranks`` ranks."""
    from threefold.launch.dryrun import predict

    argv = _args(row, ranks, steps, root / "dry")
    cfg = load_config(None, parse_overrides(argv))
    return predict(cfg, ranks).peaks


SMOL_ROWS = {"smol_full": {}, "smol_lora": {"lora.r": "16", "lora.alpha": "32"}}


def smol_args(row: str, ranks: int, steps: int, root: Path, seq: int, micro: int
              ) -> list[str]:
    """The fine-tune's command-line overrides (``finetune_overrides``) for ``ranks``."""
    from tests.test_memory_finetune import finetune_overrides

    extra = dict(SMOL_ROWS[row], **({"parallel.dp_shard": str(ranks),
                                     "parallel.zero_stage": "3"} if ranks > 1 else {}))
    over = finetune_overrides(root / "smol_hf", root / f"{row}_{ranks}", seq=seq,
                              world=ranks, extra=extra, steps=steps, micro=micro)
    return [a for k, v in over for a in (f"--{k}", v)]


def smol_inputs(root: Path) -> Path:
    """The 30-layer SmolLM2-shaped folder (made once) and the conversations: their path."""
    from tests.conftest import write_corpus
    from tests.test_memory_finetune import make_folder, write_conversations
    from threefold.data import prepare_data

    if not (root / "smol_hf" / "config.json").is_file():
        corpus = write_corpus(root / "corpus.txt")
        data = prepare_data(load_config(None, [("data.corpus", str(corpus)),
                                               ("data.cache_dir", str(root / "cache")),
                                               ("data.vocab_size", "320")]).data)
        make_folder(root / "smol_hf", 30, Path(data.tokenizer_path))
    return write_conversations(root / "chats.jsonl", n=64)


def smol_row(row: str, ranks: int, a, root: Path) -> dict:
    """Predicted and measured peaks of one fine-tune row."""
    from threefold.launch.dryrun import predict

    chats = smol_inputs(root)
    args = smol_args(row, ranks, a.steps, root, a.seq, a.micro)
    pred = predict(load_config(None, parse_overrides(args)), ranks)
    cmd = [sys.executable, "-m", "threefold", "sft", "--nproc-per-node", str(ranks), *args,
           "--sft.data", str(chats)]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    if proc.returncode:
        raise RuntimeError(f"{row} on {ranks} ranks failed:\n{proc.stderr[-3000:]}")
    out = Path(dict(zip(args[::2], args[1::2]))["--train.output_dir"])
    per_rank = json.loads((out / "summary.json").read_text())["memory"]["per_rank"]
    return {"pred": pred.peaks, "got": {p: max(r[f"{p}_peak_bytes"] for r in per_rank)
                                        for p in ("startup", "step")}}


def main(argv: list[str] | None = None) -> None:
    """Run the rows, print the table and a JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4,8")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--keep", default="", help="directory for the runs (default: temporary)")
    ap.add_argument("--loading", action="store_true",
                    help="also resume each run from its checkpoint: the loading phase")
    ap.add_argument("--smol", action="store_true",
                    help="the SmolLM2-135M fine-tune rows (smol_full, smol_lora) on 1 and 2 "
                    "ranks instead")
    ap.add_argument("--seq", type=int, default=2048, help="--smol: tokens per sequence")
    ap.add_argument("--micro", type=int, default=1, help="--smol: sequences per rank")
    a = ap.parse_args(argv)
    root = Path(a.keep or tempfile.mkdtemp(prefix="bench_memory_"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    if a.smol:
        for ranks in (1, 2):
            for row in SMOL_ROWS:
                got = smol_row(row, ranks, a, root)
                for phase in ("startup", "step"):
                    rows.append({"layout": row, "ranks": ranks, "phase": phase,
                                 "predicted_GiB": got["pred"][phase] / GIB,
                                 "measured_GiB": got["got"][phase] / GIB,
                                 "measured/predicted": got["got"][phase] / got["pred"][phase]})
                print(json.dumps(rows[-2:]), flush=True)
        report("memory_per_rank_finetune", rows, "measured/predicted", goal=1.0, band=0.10)
        return
    for ranks in map(int, a.ranks.split(",")):
        for row in a.rows.split(","):
            pred = predicted(row, ranks, a.steps, root)
            got = measure(row, ranks, a.steps, root, a.loading)
            phases = [("startup", "startup_peak_bytes"), ("step", "step_peak_bytes")]
            if a.loading:
                phases.append(("loading", "loading_peak_bytes"))
            for phase, key in phases:
                rows.append({"layout": row, "ranks": ranks, "phase": phase,
                             "predicted_GiB": pred[phase] / GIB,
                             "measured_GiB": got[key] / GIB,
                             "measured/predicted": got[key] / pred[phase]})
            print(json.dumps(rows[-len(phases):]), flush=True)
    report("memory_per_rank", rows, "measured/predicted", goal=1.0, band=0.10)


if __name__ == "__main__":
    main()
