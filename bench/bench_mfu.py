"""Model FLOP/s of the default run's training step as a share of the CPU matmul probe (the
MFU that ``threefold train`` reports on a CPU), and a torch.profiler table of one step.

    python3 bench/bench_mfu.py [--steps 12] [--rounds 3] [--profile]
    python3 bench/bench_mfu.py --src /path/to/older/checkout --src .   # A/B two trees
    python3 bench/bench_mfu.py --with train.host_mmap_threshold_mb=0     # A/B an option

Each round runs one fresh process per source tree (``--src``; default this checkout), the
order flipped every round so that load on a shared machine falls on both alike. A process
builds the default run (``tiny`` preset, data.seq_len 256, batch 8, AdamW; no evaluation),
runs two untimed steps, then ``--steps`` timed calls of ``threefold.training.train.train_step`` (the
loop's step: forward, backward, clipping, optimiser, the logged metrics). MFU = tokens/s ×
``cost.flops_per_token`` ÷ the probe's FLOP/s, the probe (``metrics.cpu_matmul_flops``, best of
0.5 s of 1024² fp32 matmuls, as train.py uses) run in the same process right after the steps.
``--with KEY=VALUE`` (repeatable) adds a side: the last tree with those overrides (e.g. the
host-memory setting off), so one tree's option is A/B'd the same way.
Printed: MFU and peak RSS (the process's, build included) per round and side, the MFU's spread
over rounds, and with two sides the ratio (last / first) per round with its spread. ``--profile``:
the top ops of one step (self CPU time) of each tree, after the timed steps. ``--cpu-time``: one
thread, and the steps and the probe (best single 1024² matmul) timed by the process's CPU time
rather than the wall clock, so that other work on a shared machine, which takes cores away, does not
enter the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time, tempfile
sys.path.insert(0, sys.argv[1])
import torch
from threefold import accounting as cost
from threefold.config import load_config
from threefold.hardware.metrics import cpu_matmul_flops
from threefold.training.train import build_run, train_step
steps, profile, cpu = int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
overrides = [tuple(kv) for kv in json.loads(sys.argv[5])]
clock = time.process_time if cpu else time.perf_counter
if cpu:
    torch.set_num_threads(1)
with tempfile.TemporaryDirectory() as out:
    cfg = load_config(None, [("train.steps", "1000"), ("train.output_dir", out),
                             ("train.eval_interval", "0"), ("train.progress", "off")]
                      + overrides)
    run = build_run(cfg)
    for s in range(2):
        train_step(run, s)
    t0 = clock()
    for s in range(2, 2 + steps):
        train_step(run, s)
    dt = (clock() - t0) / steps
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if cpu:  # the probe's matmul on the same clock: best of 0.5 s of CPU time
        a, b, rates = torch.randn(1024, 1024), torch.randn(1024, 1024), []
        while sum(rates) < 0.5 or len(rates) < 5:
            c0 = clock()
            torch.mm(a, b)
            rates.append(clock() - c0)
        peak = 2.0 * 1024**3 / min(rates)
    else:
        peak = cpu_matmul_flops(torch.float32)
    tps = cfg.train.global_batch_size * cfg.data.seq_len / dt
    flops = tps * cost.flops_per_token(run.model_cfg, cfg.data.seq_len)
    table = None
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof
        with prof(activities=[ProfilerActivity.CPU]) as p:
            train_step(run, 2 + steps)
        table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
    print("RESULT " + json.dumps({"step_s": dt, "tok_s": tps, "model_flops": flops,
                                  "probe_flops": peak, "mfu": flops / peak, "table": table,
                                  "threads": torch.get_num_threads(), "peak_rss": rss}))
"""


def one(src: str, steps: int, profile: bool, cpu: bool = False,
        overrides: list[tuple[str, str]] = ()) -> dict:
    """One process on tree ``src`` with config ``overrides``: its result dict."""
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, "-c", CHILD, src, str(steps), "1" if profile else "0",
                          "1" if cpu else "0", json.dumps(list(overrides))],
                         capture_output=True, text=True, env=env, cwd=src)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{src}: no result\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="timed steps per process")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--src", action="append", help="source tree (repeat to A/B; default: here)")
    ap.add_argument("--profile", action="store_true", help="print one step's top ops per tree")
    ap.add_argument("--cpu-time", action="store_true",
                    help="one thread, steps and probe timed in process CPU time (robust to "
                         "other work on a shared machine)")
    ap.add_argument("--with", dest="with_", action="append", default=[], metavar="KEY=VALUE",
                    help="add a side: the last tree with this config override (repeatable)")
    args = ap.parse_args()
    srcs = [str(Path(s).resolve()) for s in (args.src or [str(ROOT)])]
    sides = [(s, []) for s in srcs]
    if args.with_:
        sides.append((srcs[-1], [tuple(kv.split("=", 1)) for kv in args.with_]))
    names = [s + "".join(f" --{k} {v}" for k, v in o) for s, o in sides]
    rows, tables = [], {}
    for r in range(args.rounds):
        got = {}
        for i in (range(len(sides)) if r % 2 == 0 else reversed(range(len(sides)))):
            res = one(sides[i][0], args.steps, args.profile and r == args.rounds - 1,
                      args.cpu_time, sides[i][1])
            got[i] = res
            if res["table"]:
                tables[names[i]] = res["table"]
        row = {"round": r}
        for i in range(len(sides)):
            row[f"mfu_{i}"] = got[i]["mfu"]
            row[f"tok_s_{i}"] = got[i]["tok_s"]
            row[f"probe_gflops_{i}"] = got[i]["probe_flops"] / 1e9
            row[f"peak_rss_mib_{i}"] = got[i]["peak_rss"] / 2**20
        if len(sides) > 1:
            row["ratio"] = got[len(sides) - 1]["mfu"] / got[0]["mfu"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    for i, name in enumerate(names):
        v = [row[f"mfu_{i}"] for row in rows]
        rss = statistics.median(row[f"peak_rss_mib_{i}"] for row in rows)
        print(f"side {i} {name}: MFU (model FLOP/s / probe) median {statistics.median(v):.1%}, "
              f"spread over {len(v)} rounds {min(v):.1%}-{max(v):.1%}; peak RSS median "
              f"{rss:.0f} MiB")
    if len(sides) > 1:
        v = [row["ratio"] for row in rows]
        print(f"MFU ratio side {len(sides) - 1} / side 0: median {statistics.median(v):.3f}, "
              f"spread {min(v):.3f}-{max(v):.3f}")
    print(json.dumps({"benchmark": "mfu", "median": {i: statistics.median(
        row[f"mfu_{i}"] for row in rows) for i in range(len(sides))}}), flush=True)
    for s, t in tables.items():
        print(f"\nprofile of one step, {s}:\n{t}")


if __name__ == "__main__":
    main()
