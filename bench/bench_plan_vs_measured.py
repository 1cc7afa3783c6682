"""Predicted against measured, for real CPU runs of `threefold train`: bytes per mesh axis per
step, peak memory, step time.

    python3 bench/bench_plan_vs_measured.py [--preset tiny] [--seq-len 128] [--steps 5]
        [--runs single,dp2,zero1,zero2,zero3,tp2,tp2_sp,pp2_1f1b,pp2_gpipe]
        [--hardware-file CALIBRATION.json]

Each run is a subprocess, `python -m threefold train [--nproc-per-node 2] ...`, exactly as a
user would start it. The prediction for the same configuration comes from threefold.accounting and
threefold.plan.memory (the functions `threefold plan` and `threefold train --dry-run` use), on the
hardware measured by `threefold.plan.calibrate` (or read from --hardware-file): matmul FLOP/s at
the threads each rank gets (cores // ranks), memory bandwidth, and the α-β fit of gloo
all-reduces between two local processes. A shared machine's load changes from minute to
minute, so right before each run the matmul rate is measured again with as many processes
multiplying at once as the run has ranks, and the memory bandwidth too (`--no-remeasure`
keeps the calibration's).

Goals: bytes exact; peak memory within ±10%; step time within ±25%.

How each measured figure is made:
- bytes: `comm_bytes_per_step` of summary.json (rank 0, training traffic only), against the
  planner's `comm_bytes_per_step` for rank 0;
- peak memory: on a CPU the runtime reports peak RSS (`ru_maxrss`) of rank 0. Two things in
  RSS are not the model's. (1) The process's own footprint — interpreter, torch, the
  modules torch imports the first time the meta device is used (~70 MB), gloo, the tokenizer
  and the memory-mapped tokens. It is measured as the *baseline*: the same command, same
  launcher and data, with a 1-layer 32-wide model, minus that model's own predicted memory
  (about a megabyte). (2) glibc's allocator keeps freed blocks below its mmap threshold
  mapped, and raises that threshold as large blocks are freed, so RSS drifts above the live
  tensors from step to step; every run here (and the baseline) sets
  MALLOC_MMAP_THRESHOLD_=65536, which keeps the threshold fixed so RSS follows the live
  tensors. Measured = peak RSS - baseline, for the same number of processes;
- step time: the median over steps 2..n of tokens per step / tokens per second from
  metrics.jsonl (the first step pays for warm-up). Every rank computes on one thread
  (OMP_NUM_THREADS=1, see RUN_ENV), and is predicted with the one-thread matmul rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from threefold.layout.axes import COMM_AXES
from threefold.layout import Layout, Workload
from threefold.accounting import comm_bytes_per_step
from threefold.config import load_config, parse_overrides  # noqa: E402
from threefold.plan.calibrate import (
    calibrate,
    concurrent_matmul_flops,
    hardware_from_calibration,
    load,
    matmul_flops,
    memory_bandwidth,
)
from threefold.weights.model_source import resolved_model
from threefold.plan.cluster import Cluster  # noqa: E402
from threefold.plan.memory import memory_per_gpu, stage_memory  # noqa: E402
from threefold.plan.step import predict_step

RUNS = {  # name: (processes, extra overrides)
    "single": (1, []),
    "dp2": (2, []),
    "zero1": (2, ["--parallel.zero_stage", "1"]),
    "zero2": (2, ["--parallel.zero_stage", "2"]),
    "zero3": (2, ["--parallel.zero_stage", "3"]),
    "tp2": (2, ["--parallel.tp", "2"]),
    "tp2_sp": (2, ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    # pipelines run the batch as 4 microbatches (see ``overrides``)
    "pp2_1f1b": (2, ["--parallel.pp", "2"]),
    "pp2_gpipe": (2, ["--parallel.pp", "2", "--parallel.schedule", "gpipe"]),
}
MINIMAL = ["--model.hidden_size", "32", "--model.intermediate_size", "64",
           "--model.num_hidden_layers", "1", "--model.num_attention_heads", "4",
           "--model.num_key_value_heads", "2"]
# One thread per rank in every run (torchrun sets it for N > 1; the single-process run gets it
# too): on a machine shared with other jobs, a multi-threaded run's OpenMP regions wait on
# preempted threads at every small op, a slowdown no FLOP/s probe predicts.
RUN_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
THREADS_PER_RANK = 1
MEMORY_GOAL, TIME_GOAL = 0.10, 0.25


def overrides(args, out: Path, extra: list[str]) -> list[str]:
    """The `threefold train` arguments of one run (without --nproc-per-node): the whole batch
    in one micro-batch, except under a pipeline (4 microbatches)."""
    micro = max(1, args.batch // 4) if "--parallel.pp" in extra else args.batch
    return ["--model.preset", args.preset, "--data.seq_len", str(args.seq_len),
            "--train.global_batch_size", str(args.batch), "--train.micro_batch_size",
            str(micro), "--train.steps", str(args.steps), "--train.eval_batches", "1",
            "--train.eval_interval", "0", "--train.log_interval", "1000",
            "--train.progress", "off", "--checkpoint.save_final", "false",
            "--train.output_dir", str(out), *extra]


def launch(argv: list[str], nproc: int, timeout: float) -> float:
    """Run `threefold train` as a user would; returns its wall time. Raises on failure."""
    cmd = [sys.executable, "-m", "threefold", "train", *argv]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=dict(os.environ, **RUN_ENV), capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def measured(out: Path, tokens_per_step: int) -> dict:
    """Peak RSS, median step time (steps 2..n) and bytes per axis of a finished run."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    times = [tokens_per_step / r["tokens_per_second"] for r in recs[1:] or recs]
    return {"peak_rss": max(r["peak_memory_bytes"] for r in recs),
            "step_time_s": statistics.median(times),
            "comm_bytes": {a: int(v) for a, v in summary.get("comm_bytes_per_step", {}).items()}}


def predicted(argv: list[str], nproc: int, record: dict) -> dict:
    """The planner's figures for the same configuration on the calibrated machine."""
    cfg = load_config(None, parse_overrides(argv))
    mcfg = resolved_model(cfg)
    layout, work = Layout.from_config(cfg, nproc), Workload.from_config(cfg)
    hw = hardware_from_calibration(record, nproc, threads_per_rank=THREADS_PER_RANK)
    hw = hw.with_overrides(memory_bw=record.get("rank_memory_bandwidth"))  # one thread's
    cluster = Cluster(hw, nproc, nproc)
    step = predict_step(mcfg, layout, work, cluster)
    # rank 0's peak is measured: under a pipeline that is stage 0's, not the largest stage's
    memory = (stage_memory(mcfg, layout, work, 0, overhead_bytes=0.0) if layout.pp > 1
              else memory_per_gpu(mcfg, layout, work, overhead_bytes=0.0))
    return {"memory": memory.total,
            "step_time_s": step.step_time_s, "compute_s": step.compute_s,
            "comm_s": step.tp_exposed_s + step.dp_exposed_s, "optimizer_s": step.optimizer_s,
            "comm_bytes": comm_bytes_per_step(mcfg, layout, work),
            "tokens_per_step": work.tokens}


def remeasured(record: dict, nproc: int) -> dict:
    """``record`` with, measured again now, the fp32 matmul rate each of ``nproc`` one-thread
    ranks gets (``nproc`` processes multiplying at once) and one thread's copy bandwidth."""
    import torch

    out = json.loads(json.dumps(record))
    if nproc > 1:
        out.setdefault("matmul_flops_concurrent", {}).setdefault("fp32", {})[str(nproc)] = \
            concurrent_matmul_flops("fp32", nproc, THREADS_PER_RANK, seconds=1.0)
    else:
        out["matmul_flops"]["fp32"][str(THREADS_PER_RANK)] = matmul_flops(
            "fp32", THREADS_PER_RANK, seconds=1.0)
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS_PER_RANK)
    try:
        out["rank_memory_bandwidth"] = memory_bandwidth()
    finally:
        torch.set_num_threads(before)
    return out


def main() -> None:
    """Calibrate, measure baselines, run every configuration, print the table and JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="global batch, sequences")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma list of " + ", ".join(RUNS))
    ap.add_argument("--hardware-file", help="a `threefold plan --calibrate` JSON (else measure)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--no-remeasure", action="store_true",
                    help="use the calibration's matmul rate and memory bandwidth for every run")
    args = ap.parse_args()
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")

    record = load(args.hardware_file) if args.hardware_file else calibrate(2)
    root = Path(tempfile.mkdtemp(prefix="threefold-plan-bench-"))
    baselines = {}
    for n in sorted({RUNS[name][0] for name in names}):
        argv = overrides(args, root / f"baseline{n}", MINIMAL)
        launch(argv, n, args.timeout)  # the first one also fills the tokenizer cache
        got = measured(root / f"baseline{n}", args.batch * args.seq_len)
        baselines[n] = got["peak_rss"] - predicted(argv, n, record)["memory"]
        print(f"baseline, {n} process(es): {baselines[n] / 1e6:.1f} MB RSS besides the model",
              flush=True)

    rows = []
    for name in names:
        nproc, extra = RUNS[name]
        if not args.no_remeasure:
            record = remeasured(record, nproc)
        argv = overrides(args, root / name, extra)
        wall = launch(argv, nproc, args.timeout)
        pred = predicted(argv, nproc, record)
        got = measured(root / name, pred["tokens_per_step"])
        axes = [a for a in COMM_AXES if pred["comm_bytes"][a] or got["comm_bytes"].get(a)]
        mem = got["peak_rss"] - baselines[nproc]
        rows.append({
            "run": name, "ranks": nproc, "wall_s": round(wall, 1),
            "bytes_predicted": {a: pred["comm_bytes"][a] for a in axes},
            "bytes_measured": {a: got["comm_bytes"].get(a, 0) for a in axes},
            "bytes_exact": all(pred["comm_bytes"][a] == got["comm_bytes"].get(a, 0)
                               for a in axes),
            "memory_predicted": pred["memory"], "memory_measured": mem,
            "memory_error": pred["memory"] / mem - 1,
            "step_time_predicted": pred["step_time_s"],
            "predicted_parts_s": {k: pred[k] for k in ("compute_s", "comm_s", "optimizer_s")},
            "step_time_measured": got["step_time_s"],
            "step_time_error": pred["step_time_s"] / got["step_time_s"] - 1})
        print(f"{name}: done in {wall:.0f} s", flush=True)

    print(f"\n{'run':<8} {'bytes/step per axis: predicted = measured?':<46} "
          f"{'memory MB pred/meas':>22} {'err':>6} {'step s pred/meas':>18} {'err':>6}")
    for r in rows:
        axes = ", ".join(f"{a} {r['bytes_predicted'][a]:,}"
                         + ("" if r["bytes_predicted"][a] == r["bytes_measured"][a]
                            else f" (measured {r['bytes_measured'][a]:,})")
                         for a in r["bytes_predicted"]) or "none"
        print(f"{r['run']:<8} {('EXACT ' if r['bytes_exact'] else 'DIFF ') + axes:<46} "
              f"{r['memory_predicted'] / 1e6:>10.1f}/{r['memory_measured'] / 1e6:<10.1f} "
              f"{r['memory_error']:>+6.1%} {r['step_time_predicted']:>8.3f}/"
              f"{r['step_time_measured']:<8.3f} {r['step_time_error']:>+6.1%}")
    summary = {
        "benchmark": "plan_vs_measured", "preset": args.preset, "seq_len": args.seq_len,
        "batch": args.batch, "steps": args.steps,
        "hardware": {"matmul_flops": record["matmul_flops"],
                     "memory_bandwidth": record.get("memory_bandwidth"),
                     "allreduce": {k: record["allreduce"][k] for k in ("latency_s",
                                                                       "bandwidth")}},
        "baseline_bytes": baselines, "runs": rows,
        "bytes_exact": all(r["bytes_exact"] for r in rows),
        "memory_within_goal": sum(abs(r["memory_error"]) <= MEMORY_GOAL for r in rows),
        "step_time_within_goal": sum(abs(r["step_time_error"]) <= TIME_GOAL for r in rows),
        "of": len(rows)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
