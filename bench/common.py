"""Helpers shared by the benchmarks: argument parsing, and printing a result table + JSON."""

from __future__ import annotations

import json
import statistics
import sys

from threefold.hardware.metrics import proc_status_kib


def print_table(rows: list[dict], width: int = 18) -> None:
    """Rows (dicts with the same keys) as a text table, floats to 4 significant digits."""
    keys = list(rows[0])
    print(" | ".join(f"{k:>{width}}" for k in keys))
    for r in rows:
        print(" | ".join(f"{r[k]:>{width}.4g}" if isinstance(r[k], float)
                         else f"{r[k]!s:>{width}}" for k in keys))


def spread(values: list[float]) -> dict:
    """Median, quartiles, min and max of ``values`` (a ratio over rounds)."""
    v = sorted(values)
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return {"median": statistics.median(v), "q1": q[0], "q3": q[2], "min": v[0], "max": v[-1],
            "rounds": len(v)}


def report(name: str, rows: list[dict], ratio_key: str, goal: float,
           band: float | None = None) -> dict:
    """Print rows as a table, the ratio's spread over the rows (rounds), and one JSON line
    (machine-readable, the spread included) ending the output; returns what that line holds.

    The goal is met when the median ratio is at least ``goal``; with ``band`` (a tolerance,
    e.g. 0.10 for ±10%) it is met instead when every ratio lies within ``band`` of 1
    (max |ratio - 1| <= band: a prediction neither over nor under), and the JSON records that
    largest deviation (``largest_deviation``) and the band."""
    print_table(rows)
    ratios = [r[ratio_key] for r in rows if isinstance(r.get(ratio_key), float)]
    med = statistics.median(ratios) if ratios else float("nan")
    out = {"benchmark": name, ratio_key + "_median": med, "goal": goal, "meets_goal": med >= goal}
    if ratios:
        sp = spread(ratios)
        print(f"{name} {ratio_key}: median {med:.3f}, spread over {sp['rounds']} rounds: "
              f"quartiles {sp['q1']:.3f}-{sp['q3']:.3f}, min {sp['min']:.3f}, "
              f"max {sp['max']:.3f}")
        out[ratio_key + "_spread"] = sp
    if band is not None:
        worst = max((abs(r - 1) for r in ratios), default=float("nan"))
        out.update(band=band, largest_deviation=worst, meets_goal=worst <= band)
        print(f"{name} {ratio_key}: largest deviation from 1: {worst:.1%} (goal: within "
              f"±{band:.0%})")
    print(json.dumps(out), file=sys.stdout, flush=True)
    return out


def ab_rows(results: list, rounds: int, tokens: float, **extra) -> list[dict]:
    """One row per round of a threefold-vs-torch benchmark whose ``results`` are (round,
    side, per-rank dicts with "seconds"): tokens/s of each side (``tokens`` over the slowest
    rank's time), ``extra`` columns, and the ratio threefold/torch of throughput."""
    rows = []
    for r in range(rounds):
        sec = {side: max(p["seconds"] for p in ranks) for rr, side, ranks in results if rr == r}
        rows.append({"round": r, **extra, "threefold_tok_s": tokens / sec["threefold"],
                     "torch_tok_s": tokens / sec["torch"], "ratio": sec["torch"] / sec["threefold"]})
    return rows


# --------------------------------------------------------------------------------------------
# Multi-process benchmarks: re-launch under torch's launcher, and peak memory of a phase
# --------------------------------------------------------------------------------------------
def under_torchrun() -> bool:
    """True inside a process started by torchrun (``torch.distributed.run``)."""
    import os

    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch_with_torchrun(script: str, argv: list[str], nproc: int,
                           env_extra: dict[str, str] | None = None) -> int:
    """Run ``script argv`` as ``nproc`` processes under ``python -m torch.distributed.run
    --standalone`` (torch's own launcher) with one OpenMP thread each, plus ``env_extra``;
    returns its exit code. One thread per rank because the ranks share the machine's cores:
    more threads than cores would make every rank wait on the others' thread pools."""
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), script, *argv]
    return subprocess.run(cmd, env=env).returncode


def run_ranks(script: str, worker, args, world_sizes, env_extra: dict[str, str] | None = None
              ) -> int:
    """The multi-process benchmarks' entry: inside torchrun be one rank (``worker(args)``);
    started plainly, re-launch ``script`` with this command line once per size in
    ``world_sizes``, stopping at the first failure. Returns the exit code."""
    from pathlib import Path

    if under_torchrun():
        worker(args)
        return 0
    for n in world_sizes:
        code = relaunch_with_torchrun(str(Path(script).resolve()), sys.argv[1:], n, env_extra)
        if code:
            return code
    return 0


def start_peak_rss_window() -> int | None:
    """Return freed heap to the OS, reset this process's peak RSS (Linux ``VmHWM``) to its
    current RSS, and return that RSS in bytes (None where /proc is unavailable).

    Peak RSS is monotonic over a process's life; Linux lets a process reset it by writing "5"
    to /proc/self/clear_refs, so one process can measure the peak of each phase in turn.
    ``malloc_trim`` first, so that memory freed by the previous phase is not silently reused
    (which would hide the next phase's growth)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    rss = proc_status_kib("VmRSS")
    return None if rss is None else rss * 1024


def peak_rss_bytes() -> int | None:
    """Peak RSS (``VmHWM``) since the last ``start_peak_rss_window``, in bytes."""
    hwm = proc_status_kib("VmHWM")
    return None if hwm is None else hwm * 1024


def revision() -> str:
    """The checkout's commit, and whether threefold/ has uncommitted changes (what ran)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "threefold"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown revision"
    if not rev:
        return "unknown revision"
    return f"{rev}{' + uncommitted changes in threefold/' if dirty else ''}"


def tp_rank(args):
    """One rank of a tensor-parallel bench under torchrun (bench_tp, bench_tp_overlap): one
    thread, the whole world as the tp axis, ``args.preset``'s model with ``args.vocab``, and
    one batch of ``args.batch`` × ``args.seq_len`` random tokens from ``args.seed`` (inputs,
    targets). Returns (env, dims, mesh, model config, batch)."""
    import torch

    from threefold.config import ModelConfig
    from threefold.comm.distributed import init_distributed
    from threefold.layout import Layout, Workload, check_layout
    from threefold.comm.mesh import build_mesh

    torch.set_num_threads(1)
    env = init_distributed(device="cpu")
    world = env.world_size
    dims = Layout(tp=world)
    mesh = build_mesh(dims, "cpu")
    mcfg = ModelConfig(preset=args.preset, vocab_size=args.vocab).resolved()
    check_layout(mcfg, dims, Workload(seq_len=args.seq_len, global_batch=1))
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(mcfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
    return env, dims, mesh, mcfg, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def save_bench_args(description: str, dir_help: str):
    """The options of the checkpoint-save benchmarks (bench_async_save, bench_memory_save):
    rounds of a ``--steps`` run of a ``--hidden`` x ``--layers`` model saving every
    ``--interval`` steps into ``--dir`` (a temporary directory unless given)."""
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=None, help=dir_help)
    return ap.parse_args()


def save_bench_rounds(name: str, args, measure, modes: tuple, row_of, ratio_key: str) -> int:
    """The save benchmarks' rounds: each measures every mode (``measure(work, args, mode)``),
    the order alternating between rounds so neither mode always runs first; ``row_of`` turns
    one round's results into its table row; the report's ratio is ``ratio_key``."""
    import tempfile
    from pathlib import Path

    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix=f"bench_{name}_")
    work = args.dir or Path(tmp.name)
    rows = []
    for rnd in range(args.rounds):
        order = modes[rnd % 2:] + modes[:rnd % 2]
        got = {mode: measure(work, args, mode) for mode in order}
        rows.append({"round": rnd, **row_of(got)})
        print(json.dumps({"round": rnd, "order": order, **got}), flush=True)
    report(name, rows, ratio_key, goal=1.0)
    if tmp is not None:
        tmp.cleanup()
    return 0
