"""The training loop: build mesh -> data -> model -> parallelise -> optimiser -> steps -> log ->
checkpoint. Everything layout-specific lives behind the engine (threefold.parallel); this file
reads the same for one process and for many. It only orchestrates: the ``Run`` it builds and
the engine interface are ``threefold.training.run``, the step itself ``threefold.training.steps``,
what a run reports ``threefold.training.runlog``, its checkpoints ``threefold.training.resume``;
none of them imports this module.
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path

import torch

from threefold.comm import faults
from threefold.weights.checkpoint_verify import CheckpointError
from threefold.weights.checkpoint_async import AsyncSaver
from threefold.config import Config, ConfigError, ModelConfig
from threefold.data import prepare_data
from threefold.training.hostmem import release_free_heap, reuse_freed_host_memory, threshold_for
from threefold.hardware.metrics import current_memory_bytes, peak_memory_bytes, reset_peak_memory
from threefold.model.decoder import CausalLM
from threefold.weights.model_source import choose_tokenizer, init_from_model, locate_init_from
from threefold.parallel.world import SingleProcess
from threefold.parallel.parallelize import parallelize
from threefold.training.auto_interval import auto_interval
from threefold.training.memory_saves import MemorySaves
from threefold.training.preempt import Preemption
from threefold.training.resume import finished_step, resume, save
from threefold.training.run import Run, autocast, weights_source
from threefold.training.runlog import RunLog, read_summary, rebuilt_summary, write_summary
from threefold.training.steps import evaluate, train_step
from threefold.training.task import PretrainTask
from threefold.weights import MissingTensor, open_pretrained


def pick_device(cfg: Config, local_rank: int = 0) -> torch.device:
    """cuda when asked for (or auto and available), else cpu."""
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: cuda was asked for but no CUDA device is available; "
                          "use --train.device cpu")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """The autocast dtype; bf16 is refused where the device cannot run it."""
    if cfg.train.dtype == "float32":
        return torch.float32
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.dtype: this GPU does not support bfloat16; use float32")
    return torch.bfloat16


def build_model(mcfg: ModelConfig, device: torch.device, seed: int,
                split=None) -> CausalLM:
    """The whole plain model, built on the meta device then materialised and initialised from
    ``seed`` (for references and benchmarks; a run never builds the whole model, see
    ``threefold.parallel.parallelize``). ``split`` (pipeline parallelism) keeps only some
    stages; initialisation is by parameter name, so they equal the same layers of the whole
    model."""
    with torch.device("meta"):
        model = CausalLM(mcfg)
    if split is not None:
        model = split(model)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def build_run(cfg: Config, world=None, task=None) -> Run:
    """Check and build a run. Nothing is written to the output directory here, so bad input
    leaves no half-made run behind. The model is never whole on a rank: ``parallelize``
    slices it on the meta device and the engine fills only what the rank keeps, from the
    seed's initial values or from ``checkpoint.init_from`` (only the rank's regions read)."""
    world = world or SingleProcess()
    task = task or PretrainTask()
    if cfg.train.eval_batches * cfg.train.global_batch_size == 0:
        raise ConfigError("train.eval_batches: must be positive")
    device = pick_device(cfg, world.local_rank)
    if device.type == "cpu":  # reuse the step's large blocks instead of faulting in new pages
        reuse_freed_host_memory(threshold_for(cfg.train.host_mmap_threshold_mb,
                                              world.world_size))
    dtype = compute_dtype(cfg, device)
    pretrained = _pretrained(cfg, world) if cfg.checkpoint.init_from else None
    data = world.first_rank_first(lambda: prepare_data(cfg.data, task.token_stream))
    mcfg = pretrained[0] if pretrained else cfg.model.resolved(vocab_size=data.vocab_size)
    if mcfg.vocab_size < data.vocab_size:
        raise ConfigError(f"model.vocab_size: {mcfg.vocab_size} is smaller than the tokenizer's "
                          f"{data.vocab_size}; leave it unset (0) or raise it")
    world.check(cfg, mcfg)
    torch.manual_seed(cfg.train.seed)
    # what the process holds before the model (interpreter, torch, data; the first meta-device
    # operation loads torch's meta kernels, ~70 MB, as the dry run's baseline counts), then
    # the build's peak
    torch.empty(1, device="meta").add_(1)
    # the task's rows (its records tokenized, packed, indexed) before the baseline, which the
    # dry run's baseline counts them in
    sampler, val_sampler = task.samplers(cfg, data)
    if device.type == "cpu":  # tokenizing a corpus the first time leaves its freed text
        release_free_heap()   # and encodings resident: the run does not hold them
    memory = {"baseline_bytes": current_memory_bytes(device)}
    reset_peak_memory(device)
    source = weights_source(cfg, mcfg, device, pretrained[1] if pretrained else None,
                            task.new_weights)
    try:
        engine = parallelize(mcfg, cfg, world, source, device,
                             adapt=task.adapt_model, trainable=task.new_weights)
    except MissingTensor as e:
        raise CheckpointError(f"checkpoint.init_from: '{cfg.checkpoint.init_from}' lacks "
                              f"{e.args[0]}") from None
    memory["startup_peak_bytes"] = peak_memory_bytes(device)
    if device.type == "cpu":  # what start-up freed is not held for the run
        release_free_heap()
    if pretrained:  # what this rank read of the pretrained files: its regions only
        memory["init_from_bytes_read"] = source.bytes_read
    run = Run(cfg, mcfg, data, sampler, val_sampler, device, dtype, engine, world,
              Path(cfg.train.output_dir), task, memory=memory,
              pretrained=pretrained[1] if pretrained else None)
    if world.chunks is not None:  # before setup, which may use it
        task_loss = task.pipeline_loss
        world.build_pipeline(engine, lambda: autocast(run), mcfg.hidden_size,
                              task_loss=(lambda out, mb: task_loss(run, out, mb))
                              if task_loss else None,
                              metric_names=task.metric_names if task_loss else (),
                              micro_input=task.pipeline_micro,
                              extra_loss=_pipeline_router_term(run))
    task.setup(run)
    return run


def _pipeline_router_term(run: Run):
    """A pipeline stage's router losses: after each forward of a chunk, the router term of
    that chunk's MoE layers for the micro-batch (``RouterLog.add`` with ``part``), into the
    step's ``run.router_log`` (with multi-token prediction, the modules' losses too); None
    for a model that adds no term."""
    if not (run.model_cfg.num_local_experts or run.model_cfg.num_nextn_predict_layers):
        return None

    def term(chunk, mb):
        return run.router_log.add(chunk, run.task.count(mb), part=True)
    return term


def _pretrained(cfg: Config, world):
    """(model config, weight source) of ``checkpoint.init_from`` (a Hugging Face folder or
    hub id, a threefold run or checkpoint: ``threefold.weights.model_source``; tensors are read by
    region later, as each rank needs them). The checkpoint defines the model (``--model.*``
    shape fields that contradict it are refused); its tokenizer replaces the default BPE."""
    located = locate_init_from(cfg)
    mcfg, notes, _ = init_from_model(cfg, located)
    choose_tokenizer(cfg, located)
    if world.rank == 0:
        for note in notes:
            print(f"threefold: {note}", flush=True)
    return mcfg, open_pretrained(located.path)[1]


def train(cfg: Config, world=None, return_run: bool = False, task=None):
    """Run training as configured; returns the summary (also written to summary.json), and
    the ``Run`` (engine, world) too when ``return_run``. On SIGTERM (``train.preemption_grace_s``
    > 0) every rank stops after the same step, saves a checkpoint and returns; the summary
    then says ``preempted``."""
    world = world or SingleProcess()
    with world.phase("start-up"):
        done = finished_step(cfg, world)
        if done is not None:  # before anything is built or read: a finished run stays so
            return _finished(cfg, world, done, return_run)
        run = build_run(cfg, world, task)
        faults.at_startup(world)  # test-only: a rank that issues one collective too many
    world.check_collectives("start-up")
    preempt = Preemption(cfg.train.preemption_grace_s, run.world.rank)
    try:
        return _loop(run, preempt, return_run)
    except BaseException:
        with contextlib.suppress(Exception):  # (the run's own error is the one to see)
            run.task.close()  # what the task started stops when the run fails, too
        raise
    finally:
        preempt.close()


def _loop(run: Run, preempt, return_run: bool):
    """Resume if asked, then the steps with their logging, validation, checkpoints and
    preemption; then the final validation, checkpoint and summary."""
    t, lay = run.cfg.train, run.world
    with lay.phase("loading"):
        start = _load(run)
        log = RunLog(run, start)
    lay.check_collectives("loading")
    initial_val = evaluate(run)[0] if start == 0 else None
    val_loss, loss, preempted = initial_val, float("nan"), None
    saver = AsyncSaver() if run.cfg.checkpoint.async_save else None
    auto = auto_interval(run, start)  # checkpoint.interval auto: decided as the run goes
    mem = MemorySaves(run, start) if run.cfg.checkpoint.memory_interval else None
    wall0 = time.perf_counter()
    for step in range(start, t.steps):
        trace = [] if step + 1 == t.trace_step else None
        loss, norm, extras, seconds = _step(run, preempt, step, trace)
        if trace is not None:  # after the step's clock: writing it is not training
            log.trace(step, trace)
        # every eval_interval steps and after the last, in the step's record (validation_loss)
        due = step + 1 == t.steps or (t.eval_interval and (step + 1) % t.eval_interval == 0)
        with lay.phase(f"step {step + 1}"):  # its logging, validation and checkpoint
            rec = log.record(step, loss, norm, extras, seconds,
                             validate=functools.partial(evaluate, run) if due else None)
            val_loss = rec.get("validation_loss", val_loss)
            if mem is not None:  # first: a failure in the storage save finds it committed
                mem.after_step(step)
            saving = time.perf_counter()  # the storage save's own cost, for auto's re-tune
            stop = _checkpoint_or_stop(run, preempt, step, log, saver)
            if auto is not None:
                auto.after_step(step, seconds, time.perf_counter() - saving, log.say)
        lay.check_collectives(f"step {step + 1}")
        if stop:
            preempted = {"step": step + 1}
            break
    if saver is not None and saver.pending_step is not None:  # the last save: the run ends
        with lay.phase(f"commit {saver.pending_step}"):
            _commit(run, saver, log)
    wall = time.perf_counter() - wall0
    if not preempted and t.steps > start:  # a preemption's grace period is for the checkpoint
        c = run.cfg.checkpoint
        if c.save_final and not (c.interval and t.steps % c.interval == 0):
            with lay.phase(f"save {t.steps}"):
                save(run, t.steps)
    if mem is not None:  # its host memory given back once storage holds the final step
        mem.close(release=not preempted and t.steps > start and run.cfg.checkpoint.save_final)
    with lay.phase("summary"):
        summary = log.summary(loss, val_loss, initial_val, wall, preempted)
    run.task.close()
    lay.close()
    return (summary, run) if return_run else summary


def _finished(cfg: Config, world, step: int, return_run: bool):
    """The newest checkpoint is at or past ``train.steps``: no step, one line, nothing built,
    read or written (summary.json, metrics.jsonl and the checkpoints stay the finished
    run's; a summary the finishing session never wrote is rebuilt from metrics.jsonl).
    Returns the stored summary with ``already_finished`` (the step) added, and no ``Run``
    when ``return_run``."""
    if world.is_writer:
        past = "" if step == cfg.train.steps else f" (past --train.steps {cfg.train.steps})"
        print(f"threefold: run already finished at step {step}{past}; raise --train.steps "
              f"above {step} to continue", flush=True)
    path = Path(cfg.train.output_dir) / "summary.json"
    summary = read_summary(path)
    if world.is_writer and summary.get("tokens_per_second") is None:  # stopped before it
        rebuilt = rebuilt_summary(path.parent, step, cfg.train.steps)  # wrote its summary
        if rebuilt and write_summary(path, rebuilt, did_steps=False):
            print("threefold: summary.json rebuilt from metrics.jsonl (the session that "
                  "finished the run stopped before writing it)", flush=True)
            summary = rebuilt
    summary = {**summary, "already_finished": step}
    world.close()
    return (summary, None) if return_run else summary


def _load(run: Run) -> int:
    """``resume``, between fresh peaks of memory: the loading phase's own, then the steps'
    (metrics.jsonl's peaks are the steps' own)."""
    reset_peak_memory(run.device)
    start = run.world.join(run, resume(run))
    if start:
        run.memory["loading_peak_bytes"] = peak_memory_bytes(run.device)
    if run.device.type == "cpu":  # what loading freed is not held for the steps
        release_free_heap()
    reset_peak_memory(run.device)
    return start


def _step(run: Run, preempt, step: int, trace: list | None):
    """``train_step`` timed (on a GPU, to the device's end); a failed collective is
    reported with who and where before it propagates."""
    preempt.step_started()
    run.world.before_step(step)
    t0 = time.perf_counter()
    # A failed collective is reported with who and where; after SIGTERM (torchrun stopping
    # the group, or a preemption) without the wait for the others' reports, which would only
    # hold the restart back.
    with run.world.phase(f"step {step + 1}",
                          grace_s=lambda: 0.0 if preempt.received_at else 3.0):
        loss, norm, extras = run.world.run_step(step, lambda: train_step(run, step, trace))
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    preempt.step_finished()
    return loss, norm, extras, time.perf_counter() - t0


def _checkpoint_or_stop(run: Run, preempt, step: int, log: RunLog,
                        saver: AsyncSaver | None = None) -> bool:
    """Save every ``checkpoint.interval`` steps; after SIGTERM (the same answer on every
    rank) save and say to stop. Under ``checkpoint.async_save`` (``saver``) a save started
    after one step is committed after the next (or before the next save, the preemption's
    save or the end of the run, whichever comes first): a point fixed by the step count, so
    every rank commits together, however long its own writer takes."""
    c, t = run.cfg.checkpoint, run.cfg.train
    saved = bool(c.interval and (step + 1) % c.interval == 0)
    if saver is not None and saver.pending_step is not None:
        _commit(run, saver, log, f"checkpoint {step + 1} is due" if saved
                else f"its commit after step {step + 1}")
    if saved:
        save(run, step + 1, saver)
    if preempt.requested(run.world) and step + 1 < t.steps:
        if saved and saver is not None:  # the notice's checkpoint must be whole before exit
            _commit(run, saver, log)
        elif not saved:
            save(run, step + 1)
        log.say(f"step {step + 1:>6} preempted (SIGTERM): checkpoint {step + 1} saved; resume "
                "with --checkpoint.resume true")
        return True
    return False


def _commit(run: Run, saver: AsyncSaver, log: RunLog, why: str | None = None) -> None:
    """Collective: wait for the save in flight and commit it; one log line when this rank's
    writer was still running at a commit point in the middle of the run (``why``: what
    could not go on without it). The end of the run and a preemption wait for the save they
    have just started: no line."""
    done = saver.finish()
    if done is None:
        return
    step, waited = done
    if waited is not None and why is not None:
        log.say(f"checkpoint {step}: still being written when {why}; waited {waited:.2f} s "
                "for it (checkpoint.async_save)")
