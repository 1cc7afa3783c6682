"""Pipeline parallelism: the executor that runs a schedule (``executor``), the stage split
(``stage``), the zero-bubble split backward (``split_backward``) and the ``pipeline``
command. The schedules as data (no torch) are ``threefold.schedules``, re-exported here."""

from threefold.schedules import (  # noqa: F401 (re-exported)
    SCHEDULES,
    Action,
    ActionKind,
    Costs,
    DeadlockError,
    ScheduleError,
    SimResult,
    build_schedule,
    check_actions,
    check_schedule,
    get_schedule,
    num_stages,
    peak_in_flight,
    replay,
    simulate,
)

__all__ = [
    "Action", "ActionKind", "Costs", "DeadlockError", "SCHEDULES", "ScheduleError", "SimResult",
    "build_schedule", "check_actions", "check_schedule", "get_schedule", "num_stages",
    "peak_in_flight", "replay", "simulate",
]
