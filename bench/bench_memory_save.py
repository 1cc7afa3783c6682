"""What a checkpoint costs the training loop, written to storage (synchronously, fsynced) and
as an in-memory checkpoint (``checkpoint.memory_interval``: a host copy written to tmpfs in
the background, committed at the next step), in the same process, the order alternated
every round.

    python3 bench/bench_memory_save.py                      # 3 rounds, Llama 512 × 8
    python3 bench/bench_memory_save.py --hidden 64 --layers 2 --rounds 5   # the tests' size

Each run is one process (so no replica: one node), a Llama of ``--hidden`` × ``--layers``
(12 bytes per parameter in a checkpoint: fp32 weights and AdamW's two moments), ``--steps``
steps, a save every ``--interval`` steps, no final save. Storage goes to ``--dir`` (default: a
temporary directory on this machine's disk); memory to /dev/shm (removed afterwards).

Per run: ``stall_per_save_s``, how long each save holds the loop, timed around the loop's call
(``threefold.training.train.save`` for storage; ``MemorySaves.after_step`` for memory, which
holds the host copy at the save and, at the next step, the wait for the writer, the commit
and, on several nodes, the replica's send); ``bytes_per_save``, the rank's files. The ratio
reported is storage's stall ÷ memory's (the goal is > 1).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import save_bench_args, save_bench_rounds  # noqa: E402
from threefold.config import load_config  # noqa: E402
import threefold.training.train as tt  # noqa: E402
from threefold.training.memory_saves import MemorySaves  # noqa: E402

MODES = ("storage", "memory")


def config(out: Path, mem: Path, args, mode: str):
    """The run of ``mode``: a storage or a memory checkpoint every ``interval`` steps."""
    every = str(args.interval)
    over = {"train.steps": args.steps, "train.output_dir": out, "train.eval_batches": 1,
            "train.eval_interval": 0, "train.progress": "off", "train.log_interval": 1000,
            "model.hidden_size": args.hidden, "model.intermediate_size": args.hidden * 4,
            "model.num_hidden_layers": args.layers, "model.num_attention_heads": 8,
            "model.num_key_value_heads": 8, "data.seq_len": args.seq_len,
            "train.global_batch_size": args.batch, "train.micro_batch_size": args.batch,
            "checkpoint.save_final": "false", "checkpoint.keep_last": 1,
            "checkpoint.interval": every if mode == "storage" else "0",
            "checkpoint.memory_interval": every if mode == "memory" else "0",
            "checkpoint.memory_dir": mem}
    return load_config(None, [(k, str(v)) for k, v in over.items()])


def _timed(held: list, fn):
    def call(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            held.append(time.perf_counter() - t0)
    return call


def measure(work: Path, args, mode: str) -> dict:
    """Train one run of ``mode``; the time its saves held the loop, and their bytes."""
    out, mem = work / mode, Path("/dev/shm") / f"{work.name}-bench-memory"
    shutil.rmtree(out, ignore_errors=True)
    held: list[float] = []
    owner, name = (tt, "save") if mode == "storage" else (MemorySaves, "after_step")
    original = getattr(owner, name)
    setattr(owner, name, _timed(held, original))
    try:
        summary = tt.train(config(out, mem, args, mode))
    finally:
        setattr(owner, name, original)
    saves = args.steps // args.interval
    if mode == "storage":
        step_dir = out / "checkpoints" / str(saves * args.interval)
        nbytes = sum(f.stat().st_size for f in step_dir.iterdir()
                     if f.name.startswith(("rank", "state")))
    else:
        nbytes = summary["memory"]["memory_checkpoint_bytes"]
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(mem, ignore_errors=True)
    return {"held_s": sum(held), "saves": saves, "bytes_per_save": nbytes}


def _row(got: dict) -> dict:
    row = {"mb_per_save": got["memory"]["bytes_per_save"] / 1e6}
    for mode in MODES:
        row[f"{mode}_stall_per_save_s"] = got[mode]["held_s"] / got[mode]["saves"]
    row["storage_over_memory"] = row["storage_stall_per_save_s"] / \
        row["memory_stall_per_save_s"]
    return row


def main() -> int:
    args = save_bench_args(__doc__.splitlines()[0], "where storage checkpoints go")
    return save_bench_rounds("memory_save", args, measure, MODES, _row, "storage_over_memory")


if __name__ == "__main__":
    sys.exit(main())
