"""What a checkpoint costs the training loop, saved synchronously and with
``checkpoint.async_save``, in the same process, the order alternated every round.

    python3 bench/bench_async_save.py [--rounds 3] [--steps 13] [--interval 4]
    python3 bench/bench_async_save.py --hidden 256 --layers 4    # a smaller checkpoint

Each run is one process (world size 1), the default data (``--seq-len`` 128, ``--batch`` 4
sequences per step), a Llama of ``--hidden`` × ``--layers``
(fp32 weights and AdamW moments: 12 bytes per parameter in a checkpoint), ``--steps`` steps, a
checkpoint every ``--interval`` steps (no final save), kept
``checkpoint.keep_last 1``, written under ``--dir`` (default: a temporary directory).

Figures per run (from its metrics.jsonl and summary.json):

- ``step_s``: mean step time (the step's own clock: forward, backward, optimiser) of the steps
  that do not follow a save; ``overlap_step_s``: of the steps right after a save (under
  async_save the background writer runs during them, competing for the cores and memory
  bandwidth; synchronously nothing runs then);
- ``stall_per_save_s``: how long each save holds the loop, timed around the loop's calls
  (``threefold.training.train.save`` and, under async_save, ``threefold.training.train._commit``,
  wrapped by this script): synchronously the whole write; under async_save the host copy, the
  directory's preparation, any wait for the writer and the commit;
- ``cost_per_save_s``: the stall plus the slow-down of the step after the save over the run's
  other steps (``overlap_step_s`` - ``step_s``): what a save costs the run in all. Every figure
  comes from within one run, so the machine's load changing between runs does not enter it.

The ratio reported is ``stall_per_save_s`` sync ÷ async for each round (how many times less
long a save holds the loop under async_save; the goal is > 1). The overlapped step's slow-down
``overlap_step_s`` ÷ ``step_s`` under async_save and ``cost_per_save_s`` are printed beside it:
on a shared machine whose load moves step times by more than a save costs they are noise,
which the table shows. The host copy one save
holds (``copy_gb``) is what ``threefold train --dry-run`` predicts for the same run.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import save_bench_args, save_bench_rounds  # noqa: E402
from threefold.config import load_config  # noqa: E402
import threefold.training.train as tt  # noqa: E402

MODES = ("sync", "async")


def config(out: Path, args, mode: str):
    """The run of ``mode``: sync or async saves every ``interval``."""
    over = {"train.steps": args.steps, "train.output_dir": out, "train.eval_batches": 1,
            "train.eval_interval": 0, "train.progress": "off", "train.log_interval": 1000,
            "model.hidden_size": args.hidden, "model.intermediate_size": args.hidden * 4,
            "model.num_hidden_layers": args.layers, "model.num_attention_heads": 8,
            "model.num_key_value_heads": 8, "data.seq_len": args.seq_len,
            "train.global_batch_size": args.batch, "train.micro_batch_size": args.batch,
            "checkpoint.save_final": "false",
            "checkpoint.keep_last": 1,
            "checkpoint.interval": args.interval,
            "checkpoint.async_save": "true" if mode == "async" else "false"}
    return load_config(None, [(k, str(v)) for k, v in over.items()])


def measure(work: Path, args, mode: str) -> dict:
    """Train one run of ``mode``; its step times and the time its saves held the loop."""
    out = work / mode
    shutil.rmtree(out, ignore_errors=True)
    held = []

    def timed(fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                held.append(time.perf_counter() - t0)
        return call
    originals = {name: getattr(tt, name) for name in ("save", "_commit")}
    for name, fn in originals.items():
        setattr(tt, name, timed(fn))
    try:
        summary = tt.train(config(out, args, mode))
    finally:
        for name, fn in originals.items():
            setattr(tt, name, fn)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    tok = summary["tokens_per_step"]
    secs = {r["step"]: tok / r["tokens_per_second"] for r in recs}
    saves = [s for s in secs if s % args.interval == 0]
    after = {s + 1 for s in saves if s + 1 in secs}
    # the first step warms up (allocator, kernels): neither figure counts it
    plain = [t for s, t in secs.items() if s not in after and s > 1]
    shutil.rmtree(out, ignore_errors=True)
    return {"step_s": statistics.mean(plain),
            "overlap_step_s": statistics.mean([secs[s] for s in after]) if after else None,
            "held_s": sum(held), "saves": len(saves),
            "copy_bytes": summary["memory"].get("async_save_copy_bytes")}


def _row(got: dict) -> dict:
    row = {}
    for mode in ("sync", "async"):
        g = got[mode]
        stall = g["held_s"] / g["saves"]
        row[f"{mode}_stall_per_save_s"] = stall
        row[f"{mode}_cost_per_save_s"] = stall + g["overlap_step_s"] - g["step_s"]
    a = got["async"]
    row.update(async_step_s=a["step_s"], async_overlap_step_s=a["overlap_step_s"],
               overlap_slowdown=a["overlap_step_s"] / a["step_s"],
               copy_gb=a["copy_bytes"] / 1e9,
               sync_over_async=row["sync_stall_per_save_s"] / row["async_stall_per_save_s"])
    return row


def main() -> int:
    args = save_bench_args(__doc__.splitlines()[0], "where the checkpoints go")
    return save_bench_rounds("async_save", args, measure, MODES, _row, "sync_over_async")


if __name__ == "__main__":
    sys.exit(main())
