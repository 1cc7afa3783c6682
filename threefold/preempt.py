"""Preemption: SIGTERM is a notice, not an ending.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some seconds before they kill a
job. Under ``train.preemption_grace_s`` > 0 a rank that receives it only notes the time; after
each step every rank learns (one 1-element max all-reduce over the world, on the logging
channel) whether any rank was signalled, so all of them stop after the same step, write one
checkpoint together and return normally — the process exits 0 and ``--checkpoint.resume
true`` continues exactly where it stopped. A watchdog thread ends the process with exit code
143 (128 + SIGTERM) if that has not happened within the grace period: the save is atomic, so
the previous checkpoint is then still the newest complete one.

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

    def __init__(self, grace_s: float, rank: int = 0):
        self.grace_s, self.rank = grace_s, rank
        self.received_at: float | None = None
        self._done = threading.Event()
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
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self) -> None:
        if not self._done.wait(self.grace_s):
            print(f"threefold: rank {self.rank}: not done {self.grace_s:g} s after SIGTERM; "
                  "exiting (the last complete checkpoint stays the newest)", file=sys.stderr,
                  flush=True)
            os._exit(128 + signal.SIGTERM)

    def requested(self, layout) -> bool:
        """Collective (when active): whether any rank has been signalled. Every rank gets the
        same answer, so they stop after the same step."""
        if not self.active:
            return False
        return layout.any_rank(self.received_at is not None)

    def close(self) -> None:
        """The run has ended (or its checkpoint is written): stop the watchdog, restore the
        previous handler."""
        self._done.set()
        if self.active:
            signal.signal(signal.SIGTERM, self._previous)
            self.active = False
