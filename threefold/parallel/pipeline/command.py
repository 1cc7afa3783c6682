"""``threefold schedule``: prove a pipeline schedule free of deadlock (``check``), replay it
(``simulate``) and print, draw or trace the result. Kept apart from the simulator, which the
checker imports, so that no two pipeline modules import each other.
"""

from __future__ import annotations

import argparse
import json
import sys

from threefold.schedules import check_schedule
from threefold.schedules import SCHEDULES, Action, build_schedule, num_stages
from threefold.schedules.actions import SENDS
from threefold.schedules.registry import in_flight_chunks
from threefold.schedules import Costs, SimResult, simulate
from threefold.schedules.simulate import measured_costs, pipeline_records
from threefold.schedules.timeline import ascii_timeline, draw_png, write_chrome_trace

# --------------------------------------------------------------------------------------------
# threefold schedule --pp P --microbatches M --schedule NAME [--vpp V] [--json] [--png F] ...
# --------------------------------------------------------------------------------------------


class _UsageError(Exception):
    """A bad command line; main prints it on one line and exits 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage block and exit itself
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="threefold schedule",
                 description="Prove a pipeline schedule free of deadlock and simulate its bubble.")
    ap.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    ap.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    ap.add_argument("--schedule", required=True, choices=list(SCHEDULES), help="schedule name")
    ap.add_argument("--vpp", type=int, default=1, help="model chunks per rank (interleaved; "
                    "2 for zb-v and dualpipe-v)")
    ap.add_argument("--inflight", type=int, default=0, help="interleaved-1f1b: most chunk "
                    "activations a rank holds (0: Megatron's warm-up)")
    ap.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    ap.add_argument("--png", metavar="FILE", help="draw the timeline (needs matplotlib)")
    ap.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace JSON")
    ap.add_argument("--costs-from", metavar="TRACE",
                    help="action times measured by a run (its trace.json, from "
                         "--train.trace_step) instead of --t-*: per stage, the same pp x vpp; "
                         "a fused backward counts as B and W of half its time each")
    for flag, default, what in (("--t-f", 1.0, "forward of one model chunk"),
                                ("--t-b", 1.0, "input-grad backward of one model chunk"),
                                ("--t-w", 1.0, "weight-grad backward of one model chunk"),
                                ("--t-comm", 0.0, "one message, once both sides posted it")):
        ap.add_argument(flag, type=float, default=default, help=f"time of {what}, ms "
                        f"(default {default:g})")
    return ap


def summary(name: str, p: int, m: int, v: int, costs: Costs, result: SimResult,
            inflight: int = 0) -> dict:
    """The figures ``threefold schedule --json`` prints."""
    lists = build_schedule(name, p, m, v, inflight)
    return {
        "schedule": name, "pp": p, "microbatches": m, "vpp": v, "inflight": inflight,
        "bubble_fraction": result.bubble_fraction,
        "bubble_over_ideal": result.bubble_over_ideal,
        "makespan_ms": result.makespan,
        "compute_ms_per_rank": result.busy,
        "peak_in_flight_microbatches": [in_flight_chunks(acts) / v for acts in lists],
        "messages_per_step": sum(a.kind in SENDS for acts in lists for a in acts),
        "costs_ms": {"t_f": costs.t_f, "t_b": costs.t_b, "t_w": costs.t_w, "t_comm": costs.t_comm,
                     **({"per_stage": {f"{k} s{st}": t for (k, st), t in
                                       sorted(costs.per_stage.items(), key=lambda x: x[0][::-1])}}
                        if costs.per_stage else {})},
    }


def _costs_from_trace(path: str, n_stages: int) -> Costs:
    """Measured per-stage costs (in ms, the command's unit) from a run's trace; the run must
    have cut the model into the same number of stages."""
    from threefold.schedules.timeline import read_chrome_trace

    records, meta = read_chrome_trace(path)
    pipelines = meta.get("pipelines")  # a run with dp or tp > 1 traced every pipeline
    records = pipeline_records(records, set(pipelines[0]) if pipelines else None)
    stages = {Action.parse(r.name).stage for r in records if r.category == "compute"}
    if not stages:
        raise _UsageError(f"--costs-from: {path} holds no pipeline actions (was the run "
                          "pipelined, parallel.pp > 1?)")
    if len(stages) != n_stages:
        raise _UsageError(f"--costs-from: {path} has {len(stages)} pipeline stages, but "
                          f"--pp x --vpp makes {n_stages}; simulate the run's own split")
    ms = [r._replace(start_s=r.start_s * 1e3, end_s=r.end_s * 1e3) for r in records]
    try:
        costs = measured_costs([ms])
    except ValueError as e:
        raise _UsageError(f"--costs-from: {path}: {e}") from None
    # a run with a fused backward (BW) did not time B and W apart: take them as halves, as
    # Qi et al. (arXiv 2401.10241 §2) assume T_B ≈ T_W, for simulating a split schedule
    per = dict(costs.per_stage)
    for (kind, stage), t in costs.per_stage.items():
        if kind == "BW":
            per.setdefault(("B", stage), t / 2)
            per.setdefault(("W", stage), t / 2)
    return Costs(t_comm=costs.t_comm, per_stage=per)


def main(argv: list[str]) -> int:
    """Entry point of ``threefold schedule``; returns the exit code (2 for bad arguments)."""
    try:
        args = _parser().parse_args(argv)
        costs = Costs(args.t_f, args.t_b, args.t_w, args.t_comm)
        if min(costs.t_f, costs.t_b, costs.t_w, costs.t_comm) < 0:
            raise _UsageError("--t-f, --t-b, --t-w and --t-comm must be >= 0")
        if args.png:
            try:
                import matplotlib
            except ImportError:
                raise _UsageError("--png needs matplotlib: pip install matplotlib") from None
        check_schedule(args.schedule, args.pp, args.microbatches, args.vpp, args.inflight)
        if args.costs_from:
            costs = _costs_from_trace(args.costs_from, num_stages(args.schedule, args.pp,
                                                                  args.vpp))
        result = simulate(args.schedule, args.pp, args.microbatches, args.vpp, costs,
                          args.inflight)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (_UsageError, ValueError) as e:
        print(f"threefold schedule: error: {e}", file=sys.stderr)
        return 2
    info = summary(args.schedule, args.pp, args.microbatches, args.vpp, costs, result,
                   args.inflight)
    records = result.records(unit_s=1e-3)  # costs are in ms
    title = f"{args.schedule}  pp={args.pp} microbatches={args.microbatches} vpp={args.vpp}" \
        + (f" inflight={args.inflight}" if args.inflight else "")
    try:
        if args.trace:
            write_chrome_trace(records, args.trace)
        if args.png:
            draw_png(records, args.png, title=f"{title}  bubble {result.bubble_fraction:.1%}")
    except OSError as e:
        print(f"threefold schedule: error: cannot write {e.filename}: {e.strerror}",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info))
        return 0
    peaks = ", ".join(f"{x:g}" for x in info["peak_in_flight_microbatches"])
    print(f"{title}: no deadlock, every (microbatch, stage) forward and backward once")
    print(f"makespan {result.makespan:g} ms; bubble {result.bubble_fraction:.1%} of the step "
          f"(idle / (pp x makespan)), {result.bubble_over_ideal:.1%} of the ideal time")
    print(f"peak microbatches of activations in flight per rank: {peaks}")
    if args.microbatches < args.pp:
        print(f"note: fewer microbatches than stages runs correctly but leaves ranks idle; "
              f"the bubble is small from about {4 * args.pp} (4 x pp, GPipe's rule of thumb)")
    print(ascii_timeline(result.records(), width=100))
    return 0
