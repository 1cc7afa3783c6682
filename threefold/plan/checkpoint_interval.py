"""How often to checkpoint: the interval that loses the least time to saves and failures
together (``checkpoint.interval auto``), from the cost of one save and the job's mean time
between failures.

The optimum is Daly's higher-order one (J. T. Daly, "A higher order estimate of the optimum
checkpoint interval for restart dumps", FGCS 22(3), 2006): with a save costing C seconds and a
mean time between failures M,

    tau = sqrt(2CM) · [1 + (1/3)·sqrt(C/(2M)) + (1/9)·(C/(2M))] − C    for C < 2M, else M,

tau being the compute time between two saves. Young's first-order optimum sqrt(2CM) is its
leading term; the two differ only where C is not small beside M. The restart cost R (failure to
the next step) does not move the optimum: every failure pays it whatever the interval. It enters
the work lost per failure (about tau/2 + R: on average half an interval is redone) and the
goodput, the fraction of time spent on steps that are kept:

    goodput = 1 − C/tau − (tau/2 + R)/M    (first order; 0 at worst).

Without a given MTBF the job's is Llama 3's measured rate per GPU over its ranks (arXiv
2407.21783 §3.3.4: 419 unexpected interruptions in 54 days on 16,384 GPUs; the other 47 of the
466 were planned maintenance, which a checkpoint schedule can wait for). A save's cost before
one is timed is the bytes a rank writes over the storage bandwidth it gets (default: Llama 3's
storage, 2 TB/s sustained, shared by its 16,384 GPUs, §3.3.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from threefold.accounting import owned_parameters
from threefold.config import Config, ModelConfig
from threefold.layout import Layout
from threefold.plan.states import CHECKPOINT_BYTES_PER_PARAMETER, CPU_RNG_STATE_BYTES

# Llama 3's 54-day snapshot of pre-training (arXiv 2407.21783 §3.3.4, Table 5).
LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
# GPU-hours between two unexpected interruptions: about 50,677 (one GPU fails every 5.8 years).
GPU_HOURS_PER_FAILURE = LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_UNEXPECTED_INTERRUPTIONS
# Llama 3's checkpoint storage (Tectonic): 2 TB/s sustained over its 16,384 GPUs, per GPU.
LLAMA3_WRITE_GBPS = 2e12 / LLAMA3_GPUS / 1e9
METHOD = "Daly's higher-order optimum"
# A save into host memory (checkpoint.memory_interval): a copy at about this rate, GB/s (a CPU's
# memcpy; a pinned device-to-host copy over PCIe 4.0 x16 runs at about twice it).
HOST_COPY_GBPS = 10.0


def job_mtbf_hours(ranks: int, mtbf_hours: float = 0.0) -> float:
    """The job's mean time between failures, hours: ``mtbf_hours`` when given (> 0), else
    Llama 3's per-GPU rate over ``ranks`` GPUs (one rank a GPU)."""
    if mtbf_hours > 0:
        return mtbf_hours
    return GPU_HOURS_PER_FAILURE / max(1, ranks)


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum, sqrt(2CM) seconds of compute between saves."""
    return math.sqrt(2 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (module docstring), seconds of compute between saves;
    ``mtbf_s`` itself when a save costs at least twice the MTBF."""
    c, m = save_s, mtbf_s
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def predicted_save_s(write_bytes: float, write_gbps: float) -> float:
    """A save's cost before one is timed: the bytes a rank writes over its storage bandwidth
    (all ranks write at once, each at its share)."""
    return write_bytes / (write_gbps * 1e9)


@dataclass(frozen=True)
class IntervalChoice:
    """The interval ``checkpoint.interval auto`` chooses, and what it costs."""

    steps: int  # steps between saves: round(tau / step time), at least 1
    step_s: float  # one step
    save_s: float  # C: one save
    mtbf_s: float  # M: the job's
    restart_s: float  # R: from a failure to the next step
    optimum_s: float  # tau, Daly's
    auto: bool = True  # False: ``steps`` was set (checkpoint.interval N), not chosen
    field: str = "checkpoint.interval"  # or checkpoint.memory_interval (saves to host memory)

    @property
    def interval_s(self) -> float:
        """Compute time between two saves at the chosen step count."""
        return self.steps * self.step_s

    @property
    def lost_s(self) -> float:
        """Expected time lost per failure: half an interval redone, plus the restart."""
        return self.interval_s / 2 + self.restart_s

    @property
    def overhead(self) -> float:
        """Share of the time spent saving, C/tau."""
        return self.save_s / self.interval_s

    @property
    def goodput(self) -> float:
        """Share of the time spent on steps that are kept (first order, at least 0)."""
        return max(0.0, 1 - self.overhead - self.lost_s / self.mtbf_s)

    def line(self, source: str = "") -> str:
        """One line: the interval, how it was chosen and what it costs (``source``: where C
        and the step time come from)."""
        best = max(1, round(self.optimum_s / self.step_s))
        how = (f"{self.field} auto, {METHOD}" if self.auto else
               f"set; auto would choose {best}, by {METHOD}")
        what = "memory checkpoint" if self.field.endswith("memory_interval") else "checkpoint"
        return (f"{what} interval: {self.steps} steps = {_dur(self.interval_s)} ({how} "
                f"{_dur(self.optimum_s)} for a save of {_dur(self.save_s)} and a job MTBF of "
                f"{_dur(self.mtbf_s)}{'; ' + source if source else ''}): {_dur(self.lost_s)} "
                f"lost per failure (half an interval + restart {_dur(self.restart_s)}), save "
                f"overhead {_pct(self.overhead)}, goodput {_pct(self.goodput)}")


def choose_interval(save_s: float, step_s: float, mtbf_hours: float, restart_s: float = 0.0,
                    steps: int | None = None,
                    field: str = "checkpoint.interval") -> IntervalChoice:
    """The step count between saves that loses the least time, for saves of ``save_s``, steps
    of ``step_s`` and the job's ``mtbf_hours`` (or the cost of a set ``steps``);
    ``restart_s`` 0 counts the restart as one save's cost (the checkpoint read back at the
    bandwidth it was written at)."""
    if step_s <= 0 or mtbf_hours <= 0:
        raise ValueError(f"step time {step_s} s and MTBF {mtbf_hours} h must be > 0")
    mtbf_s, save_s = mtbf_hours * 3600, max(save_s, 0.0)
    tau = daly_interval(save_s, mtbf_s)
    chosen = steps if steps else max(1, round(tau / step_s))
    return IntervalChoice(chosen, step_s, save_s, mtbf_s, restart_s if restart_s > 0 else save_s,
                          tau, auto=not steps, field=field)


def rank_write_bytes(trained: int) -> int:
    """Bytes a rank writes to a checkpoint that owns ``trained`` elements: each one's fp32
    weight and AdamW's two moments, and its RNG state (``plan.states``)."""
    return trained * CHECKPOINT_BYTES_PER_PARAMETER + CPU_RNG_STATE_BYTES


def planned_intervals(cfg: Config, ranks: int, trained: int,
                      step_s: float) -> tuple[IntervalChoice, ...]:
    """What ``cfg``'s checkpoint intervals cost on ``ranks`` ranks, rank 0 owning ``trained``
    elements and a step taking ``step_s`` (the planner's): auto's choice or the set count of
    ``checkpoint.interval`` (a save's cost from ``checkpoint.write_gbps``) and, where the run
    has it, of ``checkpoint.memory_interval`` (a copy at ``HOST_COPY_GBPS``); none for 0."""
    c, out = cfg.checkpoint, []
    mtbf = job_mtbf_hours(ranks, c.mtbf_hours)
    for field, gbps in (("interval", c.write_gbps), ("memory_interval", HOST_COPY_GBPS)):
        every = getattr(c, field, 0)
        if every:
            save_s = predicted_save_s(rank_write_bytes(trained), gbps)
            out.append(choose_interval(save_s, step_s, mtbf, c.restart_s,
                                       None if every == "auto" else every, f"checkpoint.{field}"))
    return tuple(out)


def layout_interval(mcfg: ModelConfig, layout: Layout, step_s: float, gpus: int,
                    mtbf_hours: float = 0.0, write_gbps: float = LLAMA3_WRITE_GBPS,
                    restart_s: float = 0.0) -> IntervalChoice:
    """``checkpoint.interval auto``'s choice for a planned layout (``threefold plan``): rank 0
    writes every element it owns (``owned_parameters``) at ``write_gbps``."""
    save_s = predicted_save_s(rank_write_bytes(owned_parameters(mcfg, layout, 0)), write_gbps)
    return choose_interval(save_s, step_s, job_mtbf_hours(gpus, mtbf_hours), restart_s)


def _dur(s: float) -> str:
    """Seconds as a short duration: 850 ms, 42.0 s, 12.5 min, 3.09 h."""
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    return f"{s / 3600:.3g} h" if s < 3.6e6 else f"{s / 3600:,.0f} h"


def _pct(x: float) -> str:
    """A share as a percentage, small ones to two significant figures."""
    return f"{x:.2%}" if x >= 1e-3 or x == 0 else f"{x * 100:.2g}%"
