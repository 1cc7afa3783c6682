"""Pipeline schedules as data, with no torch: the actions each rank runs (``actions``), the
schedules' registry and builders (``registry``, ``vshape``, ``bounded``, ``messages``), the
pre-launch proof that a schedule neither deadlocks nor mismatches its sends (``check``), the
simulator (``simulate``), the stage balance (``balance``) and the timeline writers
(``timeline``). The executor that runs them, the stage split and the zero-bubble split, which
need torch, are ``threefold.parallel.pipeline``'s. The planner and the accounting read these
tables without importing the runtime."""

from threefold.schedules.simulate import DeadlockError, ScheduleError
from threefold.schedules.check import check_actions, check_schedule
from threefold.schedules.registry import (SCHEDULES, build_schedule, get_schedule, num_stages,
    peak_in_flight)
from threefold.schedules.actions import Action, ActionKind
from threefold.schedules.simulate import Costs, SimResult, replay, simulate

__all__ = [
    "Action", "ActionKind", "Costs", "DeadlockError", "SCHEDULES", "ScheduleError", "SimResult",
    "build_schedule", "check_actions", "check_schedule", "get_schedule", "num_stages",
    "peak_in_flight", "replay", "simulate",
]
