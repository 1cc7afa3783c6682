"""Fault injection for the failure tests and the fault benchmark, driven by one environment
variable so that no test-only code path changes what a normal run does.

``THREEFOLD_FAULT`` holds one fault, or several separated by commas:

- ``kill:RANK:STEP`` — that rank sends itself SIGKILL just before (1-based) step STEP;
- ``stall:RANK:STEP:SECONDS`` — that rank sleeps SECONDS before step STEP;
- ``killsave:RANK:STEP`` — that rank sends itself SIGKILL in the middle of writing the
  checkpoint of step STEP (its own files written, the checkpoint not yet renamed into place);
- ``slowsave:RANK:STEP:SECONDS`` — that rank sleeps SECONDS before writing its files of the
  checkpoint of step STEP (a slow disk; under ``checkpoint.async_save`` the background writer
  sleeps, and the save is still in flight when the next one is due);
- ``term:RANK:STEP`` — that rank's process gets SIGTERM (a preemption notice) before step STEP;
- ``hold:RANK:STEP:PATH`` — that rank waits before step STEP until the file PATH exists (at
  most ``HOLD_S``): a test holds a run at a step until something outside it has happened;
- ``extra:RANK:AXIS`` — at the end of start-up that rank issues one all-reduce on AXIS that its
  peers do not (a desynchronised group, which the collective check and the hang report name).

Kills, terms and extras fire on the first attempt only (TORCHELASTIC_RESTART_COUNT 0), so a run
restarted by torchrun goes on; stalls, holds and slow saves fire on every attempt.
"""

from __future__ import annotations

import os
import signal
import time

import torch

ENV = "THREEFOLD_FAULT"
HOLD_S = 120.0


def _faults() -> list[tuple[str, list[str]]]:
    spec = os.environ.get(ENV, "")
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, *args = item.split(":")
        out.append((kind, args))
    return out


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def at_step(rank: int, step: int) -> None:
    """Called by every rank before 0-based ``step``: fire the faults named for it."""
    for kind, args in _faults():
        if kind not in ("kill", "stall", "term", "hold") or int(args[0]) != rank \
                or int(args[1]) != step + 1:
            continue
        if kind == "stall":
            time.sleep(float(args[2]))
        elif kind == "hold":
            deadline = time.monotonic() + HOLD_S
            while not os.path.exists(":".join(args[2:])) and time.monotonic() < deadline:
                time.sleep(0.05)
        elif kind == "kill" and _first_attempt():
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "term" and _first_attempt():
            os.kill(os.getpid(), signal.SIGTERM)


def before_write(rank: int, step: int) -> None:
    """Called by every rank before it writes its files of checkpoint ``step`` (on the
    background writer under ``checkpoint.async_save``): fire ``slowsave`` faults."""
    for kind, args in _faults():
        if kind == "slowsave" and int(args[0]) == rank and int(args[1]) == step:
            time.sleep(float(args[2]))


def during_save(rank: int, step: int) -> None:
    """Called by every rank once its files of checkpoint ``step`` are written, before the
    checkpoint is committed: fire ``killsave`` faults."""
    for kind, args in _faults():
        if kind == "killsave" and int(args[0]) == rank and int(args[1]) == step \
                and _first_attempt():
            os.kill(os.getpid(), signal.SIGKILL)


def at_startup(layout) -> None:
    """Called by every rank at the end of start-up: fire ``extra`` faults."""
    for kind, args in _faults():
        if kind == "extra" and int(args[0]) == layout.rank and _first_attempt():
            layout.comm.all_reduce(torch.zeros(1), args[1])
