"""Pipeline parallelism. The pure half (no torch) is re-exported here: schedules as data
(``schedules``), the pre-launch proof (``check``), the simulator (``simulate``) and the
timeline writers (``timeline``). Modules that need torch are imported by their full name."""

from threefold.parallel.pipeline.check import (
    DeadlockError,
    ScheduleError,
    check_actions,
    check_schedule,
)
from threefold.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    build_schedule,
    get_schedule,
    num_stages,
    peak_in_flight,
)
from threefold.parallel.pipeline.simulate import Costs, SimResult, replay, simulate

__all__ = [
    "Action", "ActionKind", "Costs", "DeadlockError", "SCHEDULES", "ScheduleError", "SimResult",
    "build_schedule", "check_actions", "check_schedule", "get_schedule", "num_stages",
    "peak_in_flight", "replay", "simulate",
]
