"""Replay every rank's action list together, with a cost per action, to get each rank's
timeline, the makespan and the bubble (the ``threefold schedule`` command is ``command.py``).

The replay follows the executor's rules (messages.py): compute actions run one after another
on their rank; each maximal run of sends/receives is one batch that is posted when the rank
reaches it and finishes when every message in it has met its partner. A message between two
ranks is matched in FIFO order and is taken to need both sides posted (rendezvous): the
strictest reading, so a list that finishes here also finishes where small sends are buffered.
The same replay is the deadlock proof in check.py (the list runs with any positive costs).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

from threefold.schedules.actions import (
    RECEIVES,
    SENDS,
    Action,
    ActionKind,
    carries,
    completes,
    message_key,
    needs,
)
from threefold.schedules.registry import build_schedule, num_stages
from threefold.schedules.timeline import TraceRecord


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
            elif rec.category == "compute":  # not a send's time in flight (category "send")
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


def simulate(name: str, p: int, m: int, v: int = 1, costs: Costs = Costs(),
             inflight: int = 0) -> SimResult:
    """Build the named schedule for every rank and replay it with ``costs``."""
    return replay(build_schedule(name, p, m, v, inflight), num_stages(name, p, v), costs)


def pipeline_records(records, ranks=None) -> list:
    """The records of pipeline actions (compute actions and message batches, named as
    ``Action.__str__`` writes them; not a step's other phases), of ``ranks`` only if given
    (one pipeline of a run with data or tensor parallelism)."""
    kinds = {k.value for k in ActionKind}
    return [r for r in records if r.name.split(" ", 1)[0] in kinds
            and (ranks is None or r.rank in ranks)]
