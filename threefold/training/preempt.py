"""Preemption: SIGTERM is a notice, not an ending.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some seconds before they kill a
job. Under ``train.preemption_grace_s`` > 0 a rank that receives it only notes the time; after
each step every rank learns (one 1-element max all-reduce over the world, on the logging
channel) whether any rank was signalled, so all of them stop after the same step, write one
checkpoint together and return normally — the process exits 0 and ``--checkpoint.resume
true`` continues exactly where it stopped. A watchdog thread ends the process with exit code
143 (128 + SIGTERM) if that has not happened within the grace period: the save is atomic, so
the previous checkpoint is then still the newest complete one. It ends it sooner when the
training step in progress is plainly stuck — still running ``3 × the slowest step so far + 5
s`` after the notice (or after the step began, if later): torchrun also sends SIGTERM when it
tears a group down after a peer died or hung, and a rank waiting on that peer would otherwise
hold the restart back for the whole grace period.

torchrun forwards SIGTERM to its workers and SIGKILLs them after its ``--shutdown-timeout``;
``threefold train --nproc-per-node`` sets that timeout above the grace period (cli.launch).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


class Preemption:
    """The SIGTERM handler of one training run (installed from the main thread only: signal
    handlers can be set nowhere else; elsewhere, e.g. a test's worker thread, it is inert)."""

    STUCK_FACTOR, STUCK_EXTRA_S = 3.0, 5.0

    def __init__(self, grace_s: float, rank: int = 0):
        self.grace_s, self.rank = grace_s, rank
        self.received_at: float | None = None
        self._step_began: float | None = None  # a training step is running since then
        self._slowest: float | None = None  # the slowest finished step, s
        self._done = threading.Event()
        self._watch: threading.Thread | None = None
        self._previous = None
        self.active = grace_s > 0 and threading.current_thread() is threading.main_thread()
        if self.active:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.received_at is not None:
            return  # torchrun forwards the scheduler's signal: the second one changes nothing
        self.received_at = time.monotonic()
        print(f"threefold: rank {self.rank}: SIGTERM received; finishing the step, then a "
              f"checkpoint (grace {self.grace_s:g} s)", file=sys.stderr, flush=True)
        self._watch = threading.Thread(target=self._watchdog, name="threefold-preemption",
                                       daemon=True)
        self._watch.start()

    def step_started(self) -> None:
        """A training step begins (before its first collective)."""
        self._step_began = time.monotonic()

    def step_finished(self) -> None:
        """The training step has finished (its time counts towards the stuck limit)."""
        if self._step_began is not None:
            dt = time.monotonic() - self._step_began
            self._slowest = dt if self._slowest is None else max(self._slowest, dt)
        self._step_began = None

    def stuck_limit_s(self) -> float | None:
        """How long a step may run past the notice before the rank counts as stuck; None
        before any step has finished (nothing to go by: the grace period alone applies)."""
        if self._slowest is None:
            return None
        return self.STUCK_FACTOR * self._slowest + self.STUCK_EXTRA_S

    def _exit(self, why: str) -> None:
        print(f"threefold: rank {self.rank}: {why}; exiting (the last complete checkpoint "
              "stays the newest)", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)

    def _watchdog(self) -> None:
        deadline = self.received_at + self.grace_s
        while not self._done.wait(0.05):
            now, began, limit = time.monotonic(), self._step_began, self.stuck_limit_s()
            if now >= deadline:
                self._exit(f"not done {self.grace_s:g} s after SIGTERM")
            if began is not None and limit is not None and \
                    now - max(began, self.received_at) > limit:
                self._exit(f"the step in progress has not finished {limit:.3g} s after SIGTERM "
                           "(3 × the slowest step + 5 s): a peer is dead or stuck")

    def requested(self, layout) -> bool:
        """Collective (when active): whether any rank has been signalled. Every rank gets the
        same answer, so they stop after the same step."""
        if not self.active:
            return False
        return layout.any_rank(self.received_at is not None)

    def close(self) -> None:
        """The run has ended (or its checkpoint is written): stop the watchdog and wait for
        it (it wakes every 50 ms), so no thread of the run outlives it into interpreter
        exit; restore the previous handler."""
        self._done.set()
        if self._watch is not None:
            self._watch.join(timeout=5.0)
        if self.active:
            signal.signal(signal.SIGTERM, self._previous)
            self.active = False
