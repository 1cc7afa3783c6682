"""What a run reports while it trains: the per-step record (metrics.jsonl), the log lines and
progress bar, the traced step (trace.json) and the summary (summary.json), written by the
writer rank; and, when asked for, the same records to TensorBoard and W&B (``trackers``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from threefold import accounting
from threefold.layout import Workload
from threefold.accounting.lora_counts import lora_flops_per_token
from threefold.weights.checkpoint import fsync_path
from threefold.hardware.metrics import (MetricsWriter, device_peak_flops, last_logged_step,
                                        logged_records, peak_memory_bytes, raise_cpu_peak,
                                        truncate_metrics)
from threefold.parallel.pipeline.executor import idle_fraction
from threefold.parallel.transforms.tp_overlap import chunks_used
from threefold.schedules.simulate import measured_costs, pipeline_records
from threefold.schedules import simulate
from threefold.schedules.timeline import write_chrome_trace
from threefold.training.steps import lr_at
from threefold.training.trackers import flat_scalars, open_trackers

if TYPE_CHECKING:  # annotations only
    from threefold.training.run import Run


class RunLog:
    """The writer rank's outputs of a run from step ``start``: metrics.jsonl (continued on a
    resume, cut back to ``start`` after a restart), tokenizer.json and config.json, the log
    lines (through the progress bar when there is one), and the figures each record needs
    (tokens per step, FLOPs per token, the device's peak for MFU)."""

    def __init__(self, run: Run, start: int):
        cfg, lay = run.cfg, run.world
        self.run, self.start, self.history, self.trace_info = run, start, [], None
        self.writer, self.lost, self.trackers = None, 0, []
        self.prior = Prior()  # the earlier sessions of a resumed run (the writer's)
        if lay.is_writer:
            self._open_outputs()
        self.peak, self.peak_src = device_peak_flops(run.device, run.dtype)
        # a row's positions: data.seq_len, or fewer where the task makes shorter rows (GRPO)
        row = run.task.row_length or cfg.data.seq_len
        work = dataclasses.replace(Workload.from_config(cfg), seq_len=row)
        self.flops_tok = lora_flops_per_token(run.model_cfg, work)  # under LoRA: 4N + 6·A
        self.tokens_per_step = cfg.train.global_batch_size * row
        self.bar = _progress(run, start)
        self.n_params = accounting.num_parameters(run.model_cfg)
        self.n_active = accounting.active_parameters(run.model_cfg)
        active = (f" ({self.n_active / 1e6:.2f}M active per token)"
                  if self.n_active != self.n_params else "")
        self.say(f"threefold: {self.n_params / 1e6:.2f}M parameters{active}, {lay.describe()}, "
                 f"device {run.device}, dtype {cfg.train.dtype}, steps {start}->"
                 f"{cfg.train.steps}")
        for line in lay.topology_lines():  # where the ranks run; tp or cp across nodes
            self.say(line)

    def _open_outputs(self) -> None:
        run, start = self.run, self.start
        run.out.mkdir(parents=True, exist_ok=True)
        metrics = run.out / "metrics.jsonl"
        if start or run.world.restarts:
            self.lost = max(0, last_logged_step(metrics) - start)
            truncate_metrics(metrics, start)
            self.prior = read_prior(run.out, start)
        self.writer = MetricsWriter(metrics, append=start > 0)
        if Path(run.data.tokenizer_path).resolve() != (run.out / "tokenizer.json").resolve():
            shutil.copyfile(run.data.tokenizer_path, run.out / "tokenizer.json")
        (run.out / "config.json").write_text(json.dumps(run.cfg.to_dict(), indent=1))
        for name, text in run.outputs.items():  # the task's (a chat template)
            (run.out / name).write_text(text, encoding="utf-8")
        self.trackers = open_trackers(run.out, run.cfg.to_dict())

    def say(self, line: str) -> None:
        """A log line (the writer rank's; through the progress bar when there is one)."""
        if self.bar:
            self.bar.write(line)
        elif self.run.world.is_writer:
            print(line, flush=True)

    def record(self, step: int, loss: float, norm: float, extras: dict, seconds: float,
               validate: Callable[[], tuple[float, dict]] | None = None) -> dict:
        """Step ``step``'s record: to metrics.jsonl, the progress bar and every
        ``train.log_interval`` steps a line; returned. ``validate`` (when the step evaluates)
        runs after the step's own figures are taken — its traffic and memory are not the
        step's — and its loss joins the record as ``validation_loss`` (each source's as
        ``validation_loss_by_source`` when there are several)."""
        run, t = self.run, self.run.cfg.train
        tps = self.tokens_per_step / seconds
        rec = {"step": step + 1, "loss": loss, "lr": lr_at(step, run.cfg), "grad_norm": norm,
               "tokens_per_second": tps, "mfu": self._mfu(tps),
               "peak_memory_bytes": peak_memory_bytes(run.device)}
        rec.update(extras)
        rec.update(run.world.step_metrics())
        if validate is not None:
            rec["validation_loss"], by_source = validate()
            if by_source:
                rec["validation_loss_by_source"] = by_source
            run.world.step_metrics(count=False)  # evaluation's traffic is not training's
        self.history.append(rec)
        if self.writer:
            self.writer.write(rec)
        for tracker in self.trackers:  # TensorBoard, W&B: the same numbers
            tracker.log(step + 1, flat_scalars(rec))
        if self.bar:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:.0f}")
        if (step + 1) % t.log_interval == 0 or step + 1 == t.steps:
            self.say(f"step {step + 1:>6} loss {loss:.4f} lr {rec['lr']:.2e} norm {norm:.3f} "
                     f"tok/s {tps:,.0f}" + (f" mfu {rec['mfu']:.1%}" if rec["mfu"] else ""))
        if "validation_loss" in rec:
            self.say(f"step {step + 1:>6} validation loss {rec['validation_loss']:.4f}")
        return rec

    def _mfu(self, tokens_per_second: float) -> float | None:
        """Model FLOP/s per device over the peak (None when the peak is unknown). A CPU step
        faster than the probed peak means the probe ran at a busy moment: the peak is raised
        (``metrics.raise_cpu_peak``), so MFU never reads above 1."""
        if not self.peak:
            return None
        achieved = tokens_per_second * self.flops_tok / self.run.world.world_size
        if achieved > self.peak and self.run.device.type == "cpu":
            self.peak, self.peak_src = raise_cpu_peak(self.run.dtype, achieved)
        return achieved / self.peak

    def trace(self, step: int, records: list) -> None:
        """Collective: write the traced step (``write_trace``) and say where it is."""
        info = self.trace_info = write_trace(self.run, step, records)
        if info:
            self.say(f"step {step + 1:>6} trace: {info['path']} (open in "
                     "https://ui.perfetto.dev)"
                     + (f"; pipeline idle fraction {info['pipeline_idle_fraction']:.1%}, "
                        f"simulated {info['pipeline_simulated_bubble']:.1%} with these action "
                        "times" if "pipeline_idle_fraction" in info else ""))

    def summary(self, loss: float, val_loss, initial_val, wall: float,
                preempted: dict | None) -> dict:
        """Collective: the run's summary (every rank's memory phases gathered), written to
        summary.json by the writer, with the closing log line. A resumed run's summary covers
        its whole life (``whole_life``): the earlier sessions' steps, wall time and initial
        validation loss with this session's."""
        run, lay = self.run, self.run.world
        if self.bar:
            self.bar.close()
        out = {
            "final_loss": loss, "validation_loss": val_loss,
            "initial_validation_loss": initial_val, "parameters": self.n_params,
            "active_parameters": self.n_active, "steps": run.cfg.train.steps,
            "resumed_from_step": self.start, "tokens_per_step": self.tokens_per_step}
        out.update(self.whole_life(wall))
        if self.start and initial_val is None:  # evaluated before the first session's step 1
            out["initial_validation_loss"] = self.prior.initial_validation_loss
        out.update({"peak_flops_per_device": self.peak, "peak_flops_source": self.peak_src,
                    "flops_per_token": self.flops_tok, "world_size": lay.world_size,
                    "layout": lay.describe(), "restarts": lay.restarts,
                    "lost_steps": self.lost, "memory": memory_summary(run, self.history)})
        out.update({k: v for k, v in (("trace", self.trace_info), ("preempted", preempted))
                    if v})
        out.update(lay.summary_metrics())
        if run.cfg.parallel.tp_overlap >= 2:  # what the shapes allowed (a divisor of the tokens)
            out["tp_overlap_chunks"] = chunks_used(run.engine.model)
        for tracker in self.trackers:
            tracker.close()
        if self.writer:
            self.writer.close()
            write_summary(run.out / "summary.json", out, did_steps=bool(self.history))
            self.say(done_line(out))
        return out

    def whole_life(self, wall: float) -> dict:
        """The summary's figures over every step the run has logged: its sessions (each one
        start to stop of the command: ``from_step``, ``to_step``, ``wall_time_s``, null where
        an earlier session left no summary), the summed wall time, and the mean tokens/s and
        MFU over the steps in ``throughput_steps`` (each session's first step, which pays
        for warm-up, left out). MFU is against this session's final peak for its own steps
        (a CPU probe may have been raised during the run) and as recorded for earlier ones."""
        prior, lay = self.prior, self.run.world
        sessions = [*prior.sessions, {"from_step": self.start, "wall_time_s": wall,
                                      "to_step": self.start + len(self.history)}]
        mine = self.history[1:] or self.history  # the first step pays for warm-up
        n = prior.steps + len(mine)
        tps = sum(r["tokens_per_second"] for r in mine)
        mfu = None
        if n and self.peak and prior.mfu_sum is not None:
            mfu = (prior.mfu_sum + tps * self.flops_tok / (self.peak * lay.world_size)) / n
        walls = [s["wall_time_s"] for s in sessions if s["wall_time_s"] is not None]
        return {"wall_time_s": sum(walls), "sessions": sessions,
                "tokens_per_second": (prior.tps_sum + tps) / n if n else None, "mfu": mfu,
                "throughput_steps": n}


@dataclasses.dataclass
class Prior:
    """What a resumed run's earlier sessions left: their sessions, the first one's initial
    validation loss, and the sums of tokens/s and MFU over their timed steps (each
    session's first left out; every step when none is left) from metrics.jsonl. ``mfu_sum``
    is None when a record's MFU is unknown."""

    sessions: list = dataclasses.field(default_factory=list)
    initial_validation_loss: float | None = None
    steps: int = 0
    tps_sum: float = 0.0
    mfu_sum: float | None = 0.0


def read_prior(out: Path, start: int) -> Prior:
    """The earlier sessions of the run in ``out`` resumed at ``start``: from the summary.json
    the last of them wrote, the sessions up to ``start`` (steps no summary accounts for, as
    after a crash, become one session with an unknown, null, wall time); from metrics.jsonl
    (already cut back to ``start``) their throughput sums."""
    old = read_summary(out / "summary.json")
    sessions = old.get("sessions") or ([{  # a summary written before sessions were recorded
        "from_step": old.get("resumed_from_step", 0),
        "to_step": (old.get("preempted") or {}).get("step", old.get("steps", 0)),
        "wall_time_s": old.get("wall_time_s")}] if old else [])
    kept = []
    for s in sessions:
        if s["from_step"] >= start:
            break
        if s["to_step"] > start:  # it ran past the checkpoint resumed from: its time is unknown
            s = {**s, "to_step": start, "wall_time_s": None}
        kept.append(s)
    end = kept[-1]["to_step"] if kept else 0
    if end < start:
        kept.append({"from_step": end, "to_step": start, "wall_time_s": None})
    initial = old.get("initial_validation_loss") if sessions and sessions[0]["from_step"] == 0 \
        else None
    firsts = {s["from_step"] + 1 for s in kept}
    sums = {True: [0, 0.0, 0.0], False: [0, 0.0, 0.0]}  # timed or not: steps, tok/s, MFU
    for r in logged_records(out / "metrics.jsonl"):
        acc = sums[r["step"] not in firsts]
        acc[0], acc[1] = acc[0] + 1, acc[1] + r["tokens_per_second"]
        acc[2] = None if acc[2] is None or r.get("mfu") is None else acc[2] + r["mfu"]
    steps, tps, mfu = sums[True] if sums[True][0] else sums[False]
    return Prior(kept, initial, steps, tps, mfu)


def rebuilt_summary(out: Path, step: int, steps: int) -> dict:
    """A finished run's summary from its metrics.jsonl, for a session that stopped after its
    last checkpoint but before it wrote summary.json: the last step's loss and the last
    validation loss, the sessions and the throughput means (``read_prior``). Memory, trace
    and layout are not known and left out; ``rebuilt_from`` says so. {} without records."""
    recs = list(logged_records(out / "metrics.jsonl"))
    if not recs:
        return {}
    prior = read_prior(out, step)
    n = prior.steps
    walls = [s["wall_time_s"] for s in prior.sessions if s["wall_time_s"] is not None]
    return {"final_loss": recs[-1]["loss"],
            "validation_loss": next((r["validation_loss"] for r in reversed(recs)
                                     if "validation_loss" in r), None),
            "initial_validation_loss": prior.initial_validation_loss, "steps": steps,
            "sessions": prior.sessions, "wall_time_s": sum(walls),
            "tokens_per_second": prior.tps_sum / n if n else None,
            "mfu": prior.mfu_sum / n if n and prior.mfu_sum is not None else None,
            "throughput_steps": n, "rebuilt_from": "metrics.jsonl"}


def read_summary(path: Path) -> dict:
    """A summary.json's object ({} when there is none or it cannot be read)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) else {}


def write_summary(path: Path, out: dict, did_steps: bool) -> bool:
    """Write summary.json atomically (a sibling temp file, fsynced, renamed: a crash leaves
    the old file or the new one, never half of one). A session that did no step keeps a
    summary that has figures. Returns whether it wrote."""
    if not did_steps and read_summary(path).get("tokens_per_second") is not None:
        return False
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    fsync_path(tmp)
    os.replace(tmp, path)
    return True


def done_line(s: dict) -> str:
    """The closing log line: losses, tokens/s, MFU and wall time, as the summary has them
    (a figure the run does not have is left out)."""
    parts = [f"loss {s['final_loss']:.4f}"] if _known(s["final_loss"]) else []
    if _known(s["validation_loss"]):
        initial = s["initial_validation_loss"]
        parts.append(f"validation {s['validation_loss']:.4f}"
                     + (f" (from {initial:.4f})" if _known(initial) else ""))
    if s["tokens_per_second"] is not None:
        parts.append(f"{s['tokens_per_second']:,.0f} tok/s")
    if s["mfu"] is not None:
        parts.append(f"MFU {s['mfu']:.1%}")
    parts.append(f"{s['wall_time_s']:.1f} s")
    steps = "" if len(s["sessions"]) == 1 else f" (steps 1-{s['sessions'][-1]['to_step']}, " \
        f"{len(s['sessions'])} sessions)"
    return "done: " + ", ".join(parts) + steps


def _known(x) -> bool:
    return x is not None and math.isfinite(x)


def _progress(run: Run, start: int):
    mode = run.cfg.train.progress
    on = mode == "on" or (mode == "auto" and sys.stderr.isatty())
    if not (on and run.world.is_writer):
        return None
    from tqdm import tqdm  # only when a bar is shown

    return tqdm(total=run.cfg.train.steps, initial=start, unit="step", dynamic_ncols=True)


def memory_summary(run: Run, history: list[dict]) -> dict:
    """Collective: this rank's memory phases (bytes held before the model; peaks of start-up,
    loading and the steps), and every rank's (``per_rank``, on the writer)."""
    mine = {**run.memory, "step_peak_bytes": max((r["peak_memory_bytes"] for r in history),
                                                 default=None)}
    ranks = run.world.gather_object(mine)
    return {**mine, "per_rank": ranks} if ranks else mine


def write_trace(run: Run, step: int, records: list) -> dict | None:
    """Collective: every rank's records of the step to the writer, which saves
    OUTPUT_DIR/trace.json (one process per rank in Perfetto) and returns what the summary
    keeps of it: the path, the step and, for a pipeline, the measured idle fraction next to
    the simulator's for the step's measured action times and for unit costs. Times are each
    process's ``time.perf_counter``, one clock on one machine; ranks on several nodes have
    unrelated clocks, so their rows are not aligned (and the pipeline figures, which compare
    ranks, only hold within a node)."""
    lay = run.world
    gathered = lay.gather_object(records)
    if not lay.is_writer:
        return None
    allrec = [r for recs in gathered for r in recs]
    t0 = min((r.start_s for r in allrec), default=0.0)
    allrec = [r._replace(start_s=r.start_s - t0, end_s=r.end_s - t0) for r in allrec]
    path = run.out / "trace.json"
    run.out.mkdir(parents=True, exist_ok=True)
    meta = None
    if lay.pipeline is not None:  # which ranks make up each pipeline
        meta = {"pipelines": lay.pipeline_groups()}
    write_chrome_trace(allrec, path, meta)
    info: dict = {"path": str(path), "step": step + 1}
    if lay.pipeline is not None:
        ex, p = lay.pipeline, run.cfg.parallel
        # one pipeline: the ranks of dp 0 and tp 0 (the others repeat its timeline)
        first = pipeline_records(allrec, set(meta["pipelines"][0]))
        info["pipeline_idle_fraction"] = idle_fraction(first)
        # the simulator's figure for this step's own action times, and the textbook one
        info["pipeline_simulated_bubble"] = simulate(
            p.schedule, ex.p, ex.m, ex.v, measured_costs([first])).bubble_fraction
        info["pipeline_unit_cost_bubble"] = simulate(p.schedule, ex.p, ex.m, ex.v).bubble_fraction
    return info
