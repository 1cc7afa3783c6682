"""Prove a pipeline schedule before launch, so a bad one fails in milliseconds with a message
instead of hanging a job (torchtitan #775: hangs when microbatches < stages).

``check_schedule`` refuses sizes a schedule cannot run (ValueError naming the fix), then
checks every rank's list: each action sits on the rank that owns its stage and talks to the
right neighbour; every (microbatch, stage) has exactly one F and one backward (BW, or B then
W), F before its backward and B before its W; every message is sent and received once. Then it
replays all ranks together under the executor's rules (simulate.replay): that proves the data
dependencies across ranks hold (F of stage s+1 after F of stage s, B of stage s after B of
stage s+1), that the FIFO pairing of sends and receives matches, and that nothing deadlocks;
if something does, the error shows the first blocked state.
"""

from __future__ import annotations

from collections import Counter

from threefold.schedules.actions import (
    RECEIVES,
    SENDS,
    Action,
    ActionKind,
    completes,
    message_key,
    stage_rank,
)
from threefold.schedules.registry import build_schedule, num_stages, schedule_spec
from threefold.schedules.simulate import (
    Costs,
    ScheduleError,
    SimResult,
    replay,
)

__all__ = ["check_schedule", "check_actions"]

F, B, W, BW = (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT,
               ActionKind.BACKWARD)


def check_schedule(name: str, p: int, m: int, v: int = 1, inflight: int = 0) -> SimResult:
    """Build the named schedule for every rank and prove it (see the module docstring).
    Returns the unit-cost replay; raises ValueError for impossible sizes and ScheduleError
    (or its subclass DeadlockError) for a broken schedule."""
    return check_actions(build_schedule(name, p, m, v, inflight), m, num_stages(name, p, v),
                         vshape=schedule_spec(name).vshape)


def check_actions(lists: list[list[Action]], m: int, n_stages: int,
                  vshape: bool = False) -> SimResult:
    """Prove hand-made or generated per-rank action lists for m microbatches and
    ``n_stages`` virtual stages (stage s on rank s % p, or in a V with ``vshape``). Returns
    the unit-cost replay."""
    p = len(lists)
    for r, acts in enumerate(lists):
        for i, a in enumerate(acts):
            _check_placement(r, i, a, p, m, n_stages, vshape)
    _check_complete(lists, m, n_stages, vshape)
    _check_messages_once(lists)
    result = replay(lists, n_stages, Costs())  # any positive costs prove the same
    _check_cross_stage_order(result, n_stages)
    return result


def _check_placement(r: int, i: int, a: Action, p: int, m: int, n_stages: int,
                     vshape: bool) -> None:
    """One action is on the rank that owns its stage, and a message goes to a neighbour."""
    where = f"rank {r} action #{i} ({a})"
    if not 0 <= a.microbatch < m:
        raise ScheduleError(f"{where}: microbatch outside 0..{m - 1}")
    if not 0 <= a.stage < n_stages or stage_rank(a.stage, p, vshape) != r:
        raise ScheduleError(f"{where}: stage {a.stage} is not one of rank {r}'s stages")
    if a.chunk != a.stage // p:
        raise ScheduleError(f"{where}: stage {a.stage} is chunk {a.stage // p}, not {a.chunk}")
    if a.kind.is_compute:
        if a.peer is not None:
            raise ScheduleError(f"{where}: a compute action has no peer")
        return
    _, _, src, dst = message_key(a)
    other = dst if a.kind in SENDS else src
    if not 0 <= other < n_stages:
        raise ScheduleError(f"{where}: there is no stage {other} to exchange with")
    owner = stage_rank(other, p, vshape)
    if owner == r:
        raise ScheduleError(f"{where}: stage {other} is on this rank; hand over in memory")
    if a.peer != owner:
        raise ScheduleError(f"{where}: stage {other} is on rank {owner}, not rank {a.peer}")


def _check_complete(lists: list[list[Action]], m: int, n_stages: int, vshape: bool) -> None:
    """Exactly one F and one backward (BW, or B and W) per (microbatch, stage), in order."""
    p = len(lists)
    pos: dict[tuple[ActionKind, int, int], list[int]] = {}
    for acts in lists:
        for i, a in enumerate(acts):
            if a.kind.is_compute:
                pos.setdefault((a.kind, a.microbatch, a.stage), []).append(i)
    for s in range(n_stages):
        for mb in range(m):
            at = f"microbatch {mb} stage {s} (rank {stage_rank(s, p, vshape)})"
            n = {k: len(pos.get((k, mb, s), [])) for k in (F, B, W, BW)}
            if n[F] != 1:
                raise ScheduleError(f"{at} has {n[F]} forwards, needs exactly 1")
            if not (n[BW] == 1 and n[B] == n[W] == 0 or n[BW] == 0 and n[B] == n[W] == 1):
                raise ScheduleError(f"{at} has {n[BW]} BW, {n[B]} B and {n[W]} W; needs "
                                    "exactly one BW, or one B and one W")
            f = pos[(F, mb, s)][0]
            back = pos.get((BW, mb, s)) or pos[(B, mb, s)]
            if back[0] < f:
                raise ScheduleError(f"{at}: backward before forward")
            if n[W] and pos[(W, mb, s)][0] < back[0]:
                raise ScheduleError(f"{at}: W (weight grad) before B (input grad)")


def _check_messages_once(lists: list[list[Action]]) -> None:
    """No message is sent, or received, twice."""
    for kinds, what in ((SENDS, "sends"), (RECEIVES, "receives")):
        seen = Counter(message_key(a) for acts in lists for a in acts if a.kind in kinds)
        twice = [k for k, c in seen.items() if c > 1]
        if twice:
            raise ScheduleError(f"message {twice[0]} has {seen[twice[0]]} {what}")


def _check_cross_stage_order(result: SimResult, n_stages: int) -> None:
    """In the replay, F of stage s+1 starts after F of stage s ends, and B of stage s after
    B of stage s+1 (data flow guarantees it; asserted so a replay bug cannot hide a bad list)."""
    start, end = {}, {}
    for rank_spans in result.spans:
        for sp in rank_spans:
            if sp.is_compute:
                key = completes(sp.actions[0])
                start[key], end[key] = sp.start, sp.end
    for (tag, mb, s), t in start.items():
        before = {"F": ("F", mb, s - 1), "B": ("B", mb, s + 1)}.get(tag)
        if before in end and end[before] > t:
            raise ScheduleError(f"{tag} of microbatch {mb} stage {s} starts before stage "
                                f"{before[2]} finished")
