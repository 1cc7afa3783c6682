"""Replay every rank's action list together, with a cost per action, to get each rank's
timeline, the makespan and the bubble; plus the ``threefold schedule`` command.

The replay follows the executor's rules (schedules.py): compute actions run one after another
on their rank; each maximal run of sends/receives is one batch that is posted when the rank
reaches it and finishes when every message in it has met its partner. A message between two
ranks is matched in FIFO order and is taken to need both sides posted (rendezvous): the
strictest reading, so a list that finishes here also finishes where small sends are buffered.
The same replay is the deadlock proof in check.py (the list runs with any positive costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from typing import Callable

from threefold.parallel.pipeline.schedules import (
    RECEIVES,
    SCHEDULES,
    SENDS,
    Action,
    ActionKind,
    build_schedule,
    carries,
    completes,
    in_flight_chunks,
    message_key,
    needs,
    num_stages,
)
from threefold.parallel.pipeline.timeline import (
    TraceRecord,
    ascii_timeline,
    draw_png,
    write_chrome_trace,
)


class ScheduleError(ValueError):
    """An action list the executor could not run correctly (missing input, mismatched
    message, incomplete or misordered work)."""


class DeadlockError(ScheduleError):
    """Every unfinished rank waits on a message that never comes; ``blocked`` describes the
    first such state, one line per waiting rank."""

    def __init__(self, blocked: list[str]):
        self.blocked = blocked
        super().__init__("pipeline schedule deadlocks; blocked state:\n  " + "\n  ".join(blocked))


@dataclass(frozen=True)
class Costs:
    """Time of one action on one model chunk (any unit). BW costs t_b + t_w; t_comm is the
    time from both sides posting a message to its arrival.

    ``per_stage`` overrides the uniform times for given (kind, virtual stage) pairs, kind as
    in ``ActionKind.value`` ("F", "B", "W", "BW"): real stages are not equal (the first
    holds the embedding, the last the head and the loss), and a replay with the times a run
    measured (``measured_costs``) predicts that run's bubble, not the textbook one."""

    t_f: float = 1.0
    t_b: float = 1.0
    t_w: float = 1.0
    t_comm: float = 0.0
    per_stage: dict = field(default_factory=dict)

    def of(self, kind: ActionKind, stage: int | None = None) -> float:
        """Duration of a compute action of this kind (on this virtual stage)."""
        t = self.per_stage.get((kind.value, stage))
        if t is not None:
            return t
        if kind is ActionKind.BACKWARD:
            b, w = (self.per_stage.get((k, stage)) for k in ("B", "W"))
            return (self.t_b if b is None else b) + (self.t_w if w is None else w)
        return {ActionKind.FORWARD: self.t_f, ActionKind.BACKWARD_INPUT: self.t_b,
                ActionKind.BACKWARD_WEIGHT: self.t_w}[kind]


def measured_costs(steps, stat: Callable[[list[float]], float] = statistics.median) -> Costs:
    """Per-(kind, stage) action times (seconds) from an executor's trace of one pipeline:
    ``steps`` holds one list of records per step (all ranks of the pipeline together),
    summarised by ``stat`` (the median by default, robust to a noisy neighbour).

    ``t_comm`` is the transfer time of one message once both sides have posted it: for each
    message, found in the sender's and in the receiver's batch by what it carries, the time
    from the later of the two batches' posting to the earlier of their completions (a batch
    record also holds the wait for the peer, which the replay makes itself). Time between
    recorded actions (the executor's own Python) is not charged: the measured idle fraction
    counts it as idle, the replay does not have it."""
    times: dict[tuple[str, int], list[float]] = {}
    transfers: list[float] = []
    for records in steps:
        sides: dict[tuple, list] = {}
        for rec in records:
            if rec.category == "comm":
                for part in rec.name.split(" + "):
                    sides.setdefault(message_key(Action.parse(part)), []).append(rec)
            else:
                a = Action.parse(rec.name)
                times.setdefault((a.kind.value, a.stage), []).append(rec.end_s - rec.start_s)
        for key, pair in sides.items():
            if len(pair) > 2:
                raise ValueError(f"measured_costs: message {key} appears {len(pair)} times in "
                                 "one step: the records hold more than one pipeline")
            if len(pair) == 2:
                transfers.append(max(0.0, min(r.end_s for r in pair)
                                     - max(r.start_s for r in pair)))
    t_comm = stat(transfers) if transfers else 0.0
    return Costs(t_comm=t_comm, per_stage={k: stat(v) for k, v in times.items()})


@dataclass(frozen=True)
class Span:
    """One interval on one rank: a compute action, or a communication batch (from posting
    to completion, which includes any wait for the peer)."""

    rank: int
    start: float
    end: float
    actions: tuple[Action, ...]

    @property
    def is_compute(self) -> bool:
        """True for a compute action, False for a communication batch."""
        return self.actions[0].kind.is_compute


@dataclass
class SimResult:
    """Per-rank timelines of one replay, with the bubble measures."""

    spans: list[list[Span]]
    makespan: float
    busy: list[float] = field(default_factory=list)  # compute time per rank

    @property
    def bubble_fraction(self) -> float:
        """Idle compute time over p · makespan: GPipe's (p-1)/(m+p-1) form."""
        p = len(self.busy)
        return 1.0 - sum(self.busy) / (p * self.makespan) if self.makespan else 0.0

    @property
    def bubble_over_ideal(self) -> float:
        """Mean idle time per rank over mean compute time per rank: Narayanan's
        (p-1)/m form (bubble time / ideal time)."""
        p = len(self.busy)
        ideal = sum(self.busy) / p
        return (self.makespan - ideal) / ideal if ideal else 0.0

    def records(self, unit_s: float = 1.0) -> list[TraceRecord]:
        """Trace records, one simulated time unit = ``unit_s`` seconds: every compute action,
        and every communication batch that took time (waiting for a peer included)."""
        out = []
        for rank_spans in self.spans:
            for s in rank_spans:
                t0, t1 = s.start * unit_s, s.end * unit_s
                if s.is_compute:
                    out.append(TraceRecord(s.rank, str(s.actions[0]), t0, t1, "compute"))
                elif s.end > s.start:
                    name = " + ".join(map(str, s.actions))
                    out.append(TraceRecord(s.rank, name, t0, t1, "comm"))
        return out


def _pair_messages(lists: list[list[Action]]) -> dict[tuple[int, int], tuple[int, int]]:
    """FIFO pairing: the k-th send from r to r' meets the k-th receive on r' from r.
    Raises ScheduleError if a pair carries different messages (silently wrong data)."""
    sends: dict[tuple[int, int], list[tuple[int, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r, acts in enumerate(lists):
        for i, a in enumerate(acts):
            if a.kind in SENDS:
                sends.setdefault((r, a.peer), []).append((r, i))
            elif a.kind in RECEIVES:
                recvs.setdefault((a.peer, r), []).append((r, i))
    partner = {}
    for channel, ss in sends.items():
        for k, (sr, si) in enumerate(ss):
            rr = recvs.get(channel, [])
            if k >= len(rr):
                break  # unmatched send: the replay reports it as a deadlock
            (dr, di) = rr[k]
            send, recv = lists[sr][si], lists[dr][di]
            if message_key(send) != message_key(recv):
                raise ScheduleError(
                    f"message {k} from rank {sr} to rank {dr} is mismatched: rank {sr} action "
                    f"#{si} sends {send} but rank {dr} action #{di} expects {recv}")
            partner[(sr, si)], partner[(dr, di)] = (dr, di), (sr, si)
    return partner


def _run_compute(r: int, i: int, a: Action, have: set, n_stages: int) -> None:
    """Check that what a compute action needs has run on this rank or been received, then
    record what it makes."""
    for tag, mb, s in needs(a, n_stages):
        if (tag, mb, s) not in have:
            raise ScheduleError(f"rank {r} action #{i} ({a}) runs before {tag} of microbatch "
                                f"{mb} stage {s} has run on or reached this rank")
    have.add(completes(a))


def _items(acts: list[Action]) -> list[tuple[int, int]]:
    """A rank's list cut into what the executor runs one at a time: (i, i+1) for a compute
    action, (first, end) for a maximal run of sends/receives (one batch)."""
    out, i = [], 0
    while i < len(acts):
        j = i + 1
        if not acts[i].kind.is_compute:
            while j < len(acts) and not acts[j].kind.is_compute:
                j += 1
        out.append((i, j))
        i = j
    return out


def replay(lists: list[list[Action]], n_stages: int, costs: Costs = Costs()) -> SimResult:
    """Run all ranks' lists together under the executor's rules and return the timelines.
    Raises ScheduleError on a missing input or mismatched message, DeadlockError if the
    ranks block each other forever (with the state they stopped in). Whether a list
    deadlocks does not depend on the costs, only when things happen does."""
    p = len(lists)
    partner = _pair_messages(lists)
    items = [_items(acts) for acts in lists]
    nxt, clock, busy = [0] * p, [0.0] * p, [0.0] * p  # nxt: index into items
    have: list[set] = [set() for _ in range(p)]
    posted: list[tuple[int, int, float] | None] = [None] * p  # the batch a rank waits in
    waiting = [0] * p  # messages of that batch not matched yet
    done: dict[tuple[int, int], float] = {}  # message (rank, index) -> arrival time
    spans: list[list[Span]] = [[] for _ in range(p)]
    ready = list(range(p))  # ranks that may be able to move on
    while ready:
        r = ready.pop()
        acts = lists[r]
        while nxt[r] < len(items[r]):
            lo, hi = items[r][nxt[r]]
            if acts[lo].kind.is_compute:
                _run_compute(r, lo, acts[lo], have[r], n_stages)
                end = clock[r] + costs.of(acts[lo].kind, acts[lo].stage)
                spans[r].append(Span(r, clock[r], end, (acts[lo],)))
                busy[r] += end - clock[r]
                clock[r], nxt[r] = end, nxt[r] + 1
                continue
            if posted[r] is None:  # post the batch; match what the peers already posted
                posted[r], waiting[r] = (lo, hi, clock[r]), hi - lo
                for i in range(lo, hi):
                    _check_send_source(r, i, acts[i], have[r])
                    q = partner.get((r, i))
                    peer = posted[q[0]] if q else None
                    if peer and peer[0] <= q[1] < peer[1]:
                        done[(r, i)] = done[q] = max(clock[r], peer[2]) + costs.t_comm
                        waiting[r] -= 1
                        waiting[q[0]] -= 1
                        if waiting[q[0]] == 0:
                            ready.append(q[0])
            if waiting[r]:
                break  # a peer has not posted its side yet
            end = max([clock[r]] + [done[(r, i)] for i in range(lo, hi)])
            spans[r].append(Span(r, clock[r], end, tuple(acts[lo:hi])))
            have[r].update(carries(x) for x in acts[lo:hi] if x.kind in RECEIVES)
            clock[r], nxt[r], posted[r] = end, nxt[r] + 1, None
    pc = [items[r][nxt[r]][0] if nxt[r] < len(items[r]) else len(lists[r]) for r in range(p)]
    if any(pc[r] < len(lists[r]) for r in range(p)):
        raise DeadlockError(_blocked_state(lists, pc, posted, partner, done))
    return SimResult(spans, max(clock, default=0.0), busy)


def _check_send_source(r: int, i: int, x: Action, have: set) -> None:
    """A send is posted only after the compute that makes what it carries."""
    if x.kind in SENDS and carries(x) not in have:
        raise ScheduleError(f"rank {r} action #{i} ({x}) is posted before the "
                            f"{carries(x)[0]} it sends has run")


def _blocked_state(lists, pc, posted, partner, done) -> list[str]:
    """One line per unfinished rank: where it stopped and which messages it waits for."""
    lines = []
    for r, acts in enumerate(lists):
        if pc[r] >= len(acts):
            continue
        lo, hi, _ = posted[r] or (pc[r], pc[r] + 1, 0.0)
        waits = []
        for i in range(lo, hi):
            if (r, i) in done:
                continue
            q = partner.get((r, i))
            other = (f"rank {q[0]} action #{q[1]} ({lists[q[0]][q[1]]}) not posted" if q
                     else "no matching message on the peer")
            waits.append(f"#{i} {acts[i]} [{other}]")
        lines.append(f"rank {r} at action #{pc[r]}/{len(acts)} waits on " + "; ".join(waits))
    return lines


def simulate(name: str, p: int, m: int, v: int = 1, costs: Costs = Costs()) -> SimResult:
    """Build the named schedule for every rank and replay it with ``costs``."""
    return replay(build_schedule(name, p, m, v), num_stages(name, p, v), costs)


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
    ap.add_argument("--vpp", type=int, default=1, help="model chunks per rank (interleaved)")
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


def summary(name: str, p: int, m: int, v: int, costs: Costs, result: SimResult) -> dict:
    """The figures ``threefold schedule --json`` prints."""
    lists = build_schedule(name, p, m, v)
    return {
        "schedule": name, "pp": p, "microbatches": m, "vpp": v,
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


def pipeline_records(records, ranks=None) -> list:
    """The records of pipeline actions (compute actions and message batches, named as
    ``Action.__str__`` writes them; not a step's other phases), of ``ranks`` only if given
    (one pipeline of a run with data or tensor parallelism)."""
    kinds = {k.value for k in ActionKind}
    return [r for r in records if r.name.split(" ", 1)[0] in kinds
            and (ranks is None or r.rank in ranks)]


def _costs_from_trace(path: str, n_stages: int) -> Costs:
    """Measured per-stage costs (in ms, the command's unit) from a run's trace; the run must
    have cut the model into the same number of stages."""
    from threefold.parallel.pipeline.timeline import read_chrome_trace

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
    # Imported here: check.py imports this module for its replay.
    from threefold.parallel.pipeline.check import check_schedule

    try:
        args = _parser().parse_args(argv)
        costs = Costs(args.t_f, args.t_b, args.t_w, args.t_comm)
        if min(costs.t_f, costs.t_b, costs.t_w, costs.t_comm) < 0:
            raise _UsageError("--t-f, --t-b, --t-w and --t-comm must be >= 0")
        if args.png:
            try:
                import matplotlib  # noqa: F401  (only to fail before any work is done)
            except ImportError:
                raise _UsageError("--png needs matplotlib: pip install matplotlib") from None
        check_schedule(args.schedule, args.pp, args.microbatches, args.vpp)
        if args.costs_from:
            costs = _costs_from_trace(args.costs_from, num_stages(args.schedule, args.pp,
                                                                  args.vpp))
        result = simulate(args.schedule, args.pp, args.microbatches, args.vpp, costs)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (_UsageError, ValueError) as e:
        print(f"threefold schedule: error: {e}", file=sys.stderr)
        return 2
    info = summary(args.schedule, args.pp, args.microbatches, args.vpp, costs, result)
    records = result.records(unit_s=1e-3)  # costs are in ms
    title = f"{args.schedule}  pp={args.pp} microbatches={args.microbatches} vpp={args.vpp}"
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
