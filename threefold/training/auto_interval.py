"""``checkpoint.interval auto`` during a run: the step count between saves, decided from what
the run measures (``threefold.plan.checkpoint_interval`` holds the formula).

Two decisions, at points fixed by the step count so that every rank issues the same
collective at the same step, each from rank 0's figures broadcast over the control channel
(clocks differ between ranks; the interval must not). The step time is the mean of the
session's steps so far but its first (which carries the warm-up):
- after the session's second step (its first, when only one is left): that step's time and a
  save's predicted cost, the bytes rank 0 writes over ``checkpoint.write_gbps``;
- after the first save: the same with the save's measured cost (what the step that saved spent
  on it: the blocking write, or under ``checkpoint.async_save`` the host copy, its write going
  on behind the next step).
Until the first decision no save is due. The count is put in ``checkpoint.interval``, which the
loop and the checkpoints' copy of the configuration then hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from threefold.plan.checkpoint_interval import (HOST_COPY_GBPS, choose_interval, job_mtbf_hours,
    predicted_save_s)
from threefold.plan.states import CPU_RNG_STATE_BYTES

if TYPE_CHECKING:  # annotations only
    from threefold.training.run import Run


class AutoInterval:
    """The decisions of the module docstring for one session of a run starting at ``start``."""

    def __init__(self, run: Run, start: int):
        self.run, self.decide_at = run, min(start + 1, run.cfg.train.steps - 1)
        self.retuned, self.start, self.timed = False, start, []
        self.storage = run.cfg.checkpoint.interval == "auto"  # else only memory_interval is
        if self.storage:
            run.cfg.checkpoint.interval = 0  # no save is due before the first decision

    def after_step(self, step: int, step_s: float, checkpoint_s: float, say) -> None:
        """After step ``step`` (0-based) took ``step_s`` and its checkpoint work
        ``checkpoint_s``: decide, or re-decide from the first save's cost; ``say`` logs."""
        c = self.run.cfg.checkpoint
        if step > self.start or step == self.decide_at:  # (the first carries the warm-up)
            self.timed.append(step_s)
        step_s = sum(self.timed) / len(self.timed) if self.timed else step_s
        if step == self.decide_at:
            step_s, written = self._rank0((step_s, self._written()))
            save_s = predicted_save_s(written, c.write_gbps)
            how = f"a save predicted at checkpoint.write_gbps {c.write_gbps:g}"
            self._memory_interval(step, step_s, written, say)
            if not self.storage:
                return
        elif not self.storage:
            return
        elif not self.retuned and c.interval and (step + 1) % c.interval == 0 \
                and step > self.decide_at:
            step_s, save_s = self._rank0((step_s, checkpoint_s))
            self.retuned, how = True, f"the save of step {step + 1} measured"
        else:
            return
        choice = choose_interval(save_s, step_s, self._mtbf_hours(), c.restart_s)
        c.interval = choice.steps
        say(f"step {step + 1:>6} {choice.line(f'step {step + 1} measured, {how}')}")

    def _memory_interval(self, step: int, step_s: float, written: int, say) -> None:
        """``checkpoint.memory_interval auto``: the same
        optimum for a save into host memory, its cost predicted at ``HOST_COPY_GBPS``."""
        c = self.run.cfg.checkpoint
        if c.memory_interval != "auto":
            return
        choice = choose_interval(predicted_save_s(written, HOST_COPY_GBPS), step_s,
                                 self._mtbf_hours(), c.restart_s,
                                 field="checkpoint.memory_interval")
        c.memory_interval = choice.steps
        say(f"step {step + 1:>6} {choice.line(f'a copy predicted at {HOST_COPY_GBPS:g} GB/s')}")

    def _mtbf_hours(self) -> float:
        return job_mtbf_hours(self.run.world.world_size, self.run.cfg.checkpoint.mtbf_hours)

    def _written(self) -> int:
        """The bytes this rank writes to a checkpoint: its pieces and its RNG state."""
        pieces = self.run.world.checkpoint_pieces(self.run.engine)
        return sum(p.data.numel() * p.data.element_size() for p in pieces) + CPU_RNG_STATE_BYTES

    def _rank0(self, figures: tuple) -> tuple:
        """Rank 0's ``figures`` on every rank (collective on the control channel)."""
        control = self.run.world.control
        return figures if control is None else control.broadcast_object(figures)


def auto_interval(run: Run, start: int) -> AutoInterval | None:
    """Called once at start-up: the decisions of ``checkpoint.interval auto`` for a session
    starting at step ``start`` (and of ``checkpoint.memory_interval auto``); None where
    neither is auto (or no step is left)."""
    c = run.cfg.checkpoint
    if "auto" not in (c.interval, c.memory_interval) or start >= run.cfg.train.steps:
        return None
    return AutoInterval(run, start)
