"""The training loop: build mesh -> data -> model -> parallelise -> optimiser -> steps -> log ->
checkpoint. Everything layout-specific lives behind the engine (threefold.parallel); this file
reads the same for one process and for many.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from threefold import accounting
from threefold.checkpoint import CheckpointError, save_sharded
from threefold.config import Config, ConfigError, ModelConfig
from threefold.data import DataBundle, prepare_data
from threefold.metrics import (MetricsWriter, current_memory_bytes, device_peak_flops,
                               last_logged_step, peak_memory_bytes, reset_peak_memory,
                               truncate_metrics)
from threefold.model import LlamaForCausalLM, causal_lm_loss, fill_tied_head
from threefold.moe import RouterLog
from threefold.parallel.parallelize import apply_activation_checkpointing, apply_compile  # noqa: F401
from threefold.parallel.pipeline.timeline import TraceRecord, write_chrome_trace


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate for optimiser step ``step`` (0-based): linear warmup, then cosine decay to
    ``min_lr_ratio`` of the peak at the last step."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, total - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


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
                split=None) -> LlamaForCausalLM:
    """The whole plain model, built on the meta device then materialised and initialised from
    ``seed`` (for references and benchmarks; a run never builds the whole model, see
    ``threefold.parallel.parallelize``). ``split`` (pipeline parallelism) keeps only some
    stages; initialisation is by parameter name, so they equal the same layers of the whole
    model."""
    with torch.device("meta"):
        model = LlamaForCausalLM(mcfg)
    if split is not None:
        model = split(model)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


@dataclass
class Run:
    """Everything the loop needs, built and checked before the output directory is touched."""

    cfg: Config
    model_cfg: ModelConfig
    data: DataBundle
    sampler: Any
    val_sampler: Any
    device: torch.device
    dtype: torch.dtype
    engine: Any
    layout: Any
    out: Path
    task: Any = None
    router_log: Any = None  # the step's RouterLog of a mixture of experts (train_step)
    # bytes held before the model, and the peaks of start-up, loading and the steps
    memory: dict = dataclasses.field(default_factory=dict)

    def forward(self, micro: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model on a micro-batch dict (positions and document ids when it has them)."""
        with autocast(self):
            return self.engine.model(micro["input_ids"], position_ids=micro.get("position_ids"),
                                     document_ids=micro.get("document_ids"))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token loss: vocab-parallel under tensor parallelism, plain otherwise."""
        fn = getattr(self.engine.model, "loss_function", None) or causal_lm_loss
        return fn(logits, labels, reduction="sum")


def build_run(cfg: Config, layout=None, task=None) -> Run:
    """Check and build a run. Nothing is written to the output directory here, so bad input
    leaves no half-made run behind. The model is never whole on a rank: ``parallelize``
    slices it on the meta device and the engine fills only what the rank keeps, from the
    seed's initial values or from ``checkpoint.init_from`` (only the rank's regions read)."""
    from threefold.parallel.layout import SingleProcess
    from threefold.parallel.materialize import ChainSource, InitSource
    from threefold.parallel.parallelize import parallelize
    from threefold.task import PretrainTask

    layout = layout or SingleProcess()
    task = task or PretrainTask()
    if cfg.train.eval_batches * cfg.train.global_batch_size == 0:
        raise ConfigError("train.eval_batches: must be positive")
    device = pick_device(cfg, layout.local_rank)
    if device.type == "cpu":  # reuse the step's large blocks instead of faulting in new pages
        from threefold.hostmem import reuse_freed_host_memory, threshold_for

        reuse_freed_host_memory(threshold_for(cfg.train.host_mmap_threshold_mb,
                                              layout.world_size))
    dtype = compute_dtype(cfg, device)
    pretrained = _pretrained(cfg) if cfg.checkpoint.init_from else None
    data = layout.first_rank_first(lambda: prepare_data(cfg.data))
    mcfg = pretrained[0] if pretrained else cfg.model.resolved(vocab_size=data.vocab_size)
    if mcfg.vocab_size < data.vocab_size:
        raise ConfigError(f"model.vocab_size: {mcfg.vocab_size} is smaller than the tokenizer's "
                          f"{data.vocab_size}; leave it unset (0) or raise it")
    layout.check(cfg, mcfg)
    torch.manual_seed(cfg.train.seed)
    # what the process holds before the model (interpreter, torch, data; the first meta-device
    # operation loads torch's meta kernels, ~70 MB, as the dry run's baseline counts), then
    # the build's peak
    torch.empty(1, device="meta").add_(1)
    memory = {"baseline_bytes": current_memory_bytes(device)}
    reset_peak_memory(device)
    source = InitSource(mcfg, cfg.train.seed, device)
    if pretrained:  # a task's new weights (a reward model's score head) start from the seed
        source = ChainSource(pretrained[1], source, task.new_weights)
    try:
        engine = parallelize(mcfg, cfg, layout, source, device,
                             adapt=task.adapt_model)
    except KeyError as e:
        raise CheckpointError(f"checkpoint.init_from: '{cfg.checkpoint.init_from}' lacks "
                              f"{e.args[0]}") from None
    memory["startup_peak_bytes"] = peak_memory_bytes(device)
    if pretrained:  # what this rank read of the pretrained files: its regions only
        memory["init_from_bytes_read"] = source.bytes_read
    sampler, val_sampler = task.samplers(cfg, data)
    run = Run(cfg, mcfg, data, sampler, val_sampler, device, dtype, engine, layout,
              Path(cfg.train.output_dir), task, memory=memory)
    if layout.chunks is not None:  # before setup, which may use it
        task_loss = task.pipeline_loss
        layout.build_pipeline(engine, run.loss, lambda: autocast(run), mcfg.hidden_size,
                              task_loss=(lambda out, mb: task_loss(run, out, mb))
                              if task_loss else None,
                              metric_names=task.metric_names if task_loss else (),
                              extra_loss=_pipeline_router_term(run)
                              if mcfg.num_local_experts else None)
    task.setup(run)
    return run


def _pipeline_router_term(run: Run):
    """A pipeline stage's router losses: after each forward of a chunk, the router term of
    that chunk's MoE layers for the micro-batch (``RouterLog.add`` with ``part``), into the
    step's ``run.router_log``."""
    def term(chunk, mb):
        return run.router_log.add(chunk, run.task.count(mb), part=True)
    return term


def _pretrained(cfg: Config):
    """(model config, weight source) of ``checkpoint.init_from`` (a Hugging Face folder, a
    threefold run or checkpoint: ``threefold.weights``; tensors are read by region later, as
    each rank needs them); its tokenizer replaces the default BPE (the weights only make
    sense with the vocabulary they were trained on)."""
    from threefold.weights import open_pretrained

    src = Path(cfg.checkpoint.init_from)
    if not src.exists():
        raise ConfigError(f"checkpoint.init_from: '{src}' does not exist")
    pcfg, source = open_pretrained(src)
    pcfg.init_std = cfg.model.init_std
    if cfg.data.tokenizer == "bpe":
        for cand in (src / "tokenizer.json", src.parent.parent / "tokenizer.json"):
            if cand.is_file():
                cfg.data.tokenizer = str(cand)
                break
    return pcfg, source


def pretrained_source(cfg: Config):
    """A source of ``checkpoint.init_from``'s weights (``threefold.weights``)."""
    return _pretrained(cfg)[1]


def autocast(run: Run):
    """The run's autocast context for a forward (none in float32)."""
    if run.dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(run.device.type, dtype=run.dtype)


def _micro_batches(run: Run, batch: dict[str, torch.Tensor]):
    """Micro-batches of this rank's sequences, each cut to this rank's tokens (context
    parallelism)."""
    n = next(iter(batch.values())).shape[0]
    mb = min(run.cfg.train.micro_batch_size, n)
    for i in range(0, n, mb):
        yield run.layout.split_sequence({k: v[i:i + mb].to(run.device)
                                         for k, v in batch.items()})


class _Tracer:
    """Times the phases of one step as trace records of this rank (``trace`` a list), or does
    nothing (``trace`` None). On a GPU it waits for the device at each phase's end, so the
    trace shows execution, not queueing."""

    def __init__(self, run: Run, trace: list | None):
        self.trace, self.rank = trace, run.layout.rank
        self.cuda = run.device.type == "cuda"

    @contextlib.contextmanager
    def __call__(self, name: str, category: str = "compute"):
        if self.trace is None:
            yield
            return
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.trace.append(TraceRecord(self.rank, name, t0, time.perf_counter(), category))


def pipeline_micro_batches(run: Run, micro: list[dict]) -> list[dict]:
    """Micro-batches as the pipeline executor takes them: the task's ``pipeline_micro``
    (e.g. DPO's chosen and rejected rows as one "input_ids"/"labels" batch, its own fields
    kept for its loss on the last stage) or as they are."""
    return [run.task.pipeline_micro(mb) for mb in micro]


def train_step(run: Run, step: int, trace: list | None = None
               ) -> tuple[float, float, dict[str, float]]:
    """One optimiser step over the global batch of ``step``; returns (mean loss, grad norm,
    extra metrics). The loss is the sum over the global batch divided by the true number of
    units (target tokens, pairs) in it, so accumulation and data parallelism give the
    single-process gradient. A mixture of experts also optimises its router losses (added
    per micro-batch, see ``threefold.moe.RouterLog``); they are reported among the extra
    metrics, not in the loss. With a ``trace`` list, this rank's timed phases are appended to
    it (the pipeline's every action, or each micro-batch's forward and backward; gradient
    synchronisation, clipping, the optimiser)."""
    lay, eng = run.layout, run.engine
    timed = _Tracer(run, trace)
    if hasattr(eng, "comm_trace"):  # data parallel: each bucket's all-reduce, launch to wait
        eng.comm_trace = trace
    batch = run.sampler.local_batch(step, lay.dp_rank, lay.dp_size)
    n = lay.global_token_count(run.task.count(batch))
    micro = list(_micro_batches(run, batch))
    loss_sum = torch.zeros((), dtype=torch.float32, device=run.device)
    extras: dict[str, torch.Tensor] = {}
    pipe = lay.pipeline
    # a mixture of experts adds its router losses (threefold.moe.RouterLog: per micro-batch,
    # weighted by its loss units; in a pipeline per chunk, _pipeline_router_term); the
    # logged loss stays the task's own
    router = RouterLog(run.model_cfg) if run.model_cfg.num_local_experts else None
    run.router_log = router
    ep = lay.ep_size > 1
    if ep:  # count this step's rows only (not evaluation's)
        from threefold.parallel.expert import take_rows_sent

        take_rows_sent(eng.model)
    if pipe is not None:  # the schedule runs every micro-batch's forward and backward
        # a traced step waits for the device after each action (execution, not queueing)
        pipe.sync_timing = trace is not None and run.device.type == "cuda"
        loss_sum += pipe.run(pipeline_micro_batches(run, micro), n)
        extras = {k: torch.tensor(v, dtype=torch.float64) for k, v in pipe.metrics.items()}
        if trace is not None:
            trace.extend(pipe.records)
        micro = []
    for i, mb in enumerate(micro):
        with eng.micro_step(last=i == len(micro) - 1):
            with timed(f"F mb{i}"):
                total, more = run.task.loss(run, mb)
                loss = total / n
                if router is not None:
                    objective = (total + router.add(eng.model, run.task.count(mb))) / n
            with timed(f"BW mb{i}"):  # with the gradient reductions it starts
                (loss if router is None else objective).backward()
        loss_sum += loss.detach()
        for k, v in more.items():
            extras[k] = extras.get(k, 0) + v.detach().double()
    with timed("finish gradients", "comm"):
        eng.finish_gradients()
        lay.reduce_tied_gradients(eng)
    with timed("clip gradients", "comm"):
        norm = eng.clip_grad_norm(run.cfg.optim.grad_clip)
    with timed("optimizer step"):
        eng.step(lr_at(step, run.cfg))
    # one read from the device for what the step logs: the loss, the norm and the task's
    # metrics come back together (a single host sync per step; clipping kept the norm on
    # the device), then the sums over data-parallel ranks are one all-reduce on the host
    names = [k for k in run.task.metric_names if k in extras]
    logged = torch.stack([loss_sum.double(), norm.detach().double().to(loss_sum.device)]
                         + [extras[k].reshape(()).to(loss_sum.device) for k in names])
    logged = logged.cpu()
    norm = float(logged[1])
    summed = lay.sum_logged(torch.cat([logged[:1], logged[2:]]))
    metrics = {k: float(v) / n for k, v in zip(names, summed[1:].tolist())}
    if router is not None:  # sums over the data-parallel ranks (and pipeline stages)
        metrics.update(router.metrics(n, lambda v: _sum_router(lay, v, scalar=True),
                                      lambda v: _sum_router(lay, v)))
        if ep:  # this rank's (the log's: rank 0's)
            metrics["ep_rows_sent"] = take_rows_sent(eng.model)
    metrics.update(run.task.step_metrics())  # figures of the step as a whole (GRPO's rewards)
    return float(summed[0]), norm, metrics


def _sum_router(lay, v: torch.Tensor, scalar: bool = False):
    """A router figure summed over data-parallel ranks and, in a pipeline, over the stages
    (each holds the terms of its layers); a float for ``scalar``."""
    v = lay.sum_logged(v.detach().double().reshape(-1) if scalar else v, over_stages=True)
    return float(v) if scalar else v


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean loss per unit on the fixed validation batches."""
    lay = run.layout
    total = torch.zeros((), dtype=torch.float64, device=run.device)
    count = 0
    for k in range(run.cfg.train.eval_batches):
        batch = run.val_sampler.local_batch(k, lay.dp_rank, lay.dp_size)
        if lay.pipeline is not None:
            total += lay.pipeline.evaluate(pipeline_micro_batches(run, list(_micro_batches(run, batch))))
        else:
            for mb in _micro_batches(run, batch):
                total += run.task.loss(run, mb)[0].double()
        count += lay.global_token_count(run.task.count(batch))
    return lay.sum_over_dp(total) / count


def _memory_summary(run: Run, history: list[dict]) -> dict:
    """Collective: this rank's memory phases (bytes held before the model; peaks of start-up,
    loading and the steps), and every rank's (``per_rank``, on the writer)."""
    mine = {**run.memory, "step_peak_bytes": max((r["peak_memory_bytes"] for r in history),
                                                 default=None)}
    ranks = run.layout.gather_object(mine)
    return {**mine, "per_rank": ranks} if ranks else mine


def _write_trace(run: Run, step: int, records: list) -> dict | None:
    """Collective: every rank's records of the step to the writer, which saves
    OUTPUT_DIR/trace.json (one process per rank in Perfetto) and returns what the summary
    keeps of it: the path, the step and, for a pipeline, the measured idle fraction next to
    the simulator's for the step's measured action times and for unit costs. Times are each
    process's ``time.perf_counter``, one clock on one machine; ranks on several nodes have
    unrelated clocks, so their rows are not aligned (and the pipeline figures, which compare
    ranks, only hold within a node)."""
    lay = run.layout
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
        from threefold.parallel.pipeline.executor import idle_fraction
        from threefold.parallel.pipeline.simulate import measured_costs, pipeline_records, simulate

        ex, p = lay.pipeline, run.cfg.parallel
        # one pipeline: the ranks of dp 0 and tp 0 (the others repeat its timeline)
        first = pipeline_records(allrec, set(meta["pipelines"][0]))
        info["pipeline_idle_fraction"] = idle_fraction(first)
        # the simulator's figure for this step's own action times, and the textbook one
        info["pipeline_simulated_bubble"] = simulate(
            p.schedule, ex.p, ex.m, ex.v, measured_costs([first])).bubble_fraction
        info["pipeline_unit_cost_bubble"] = simulate(p.schedule, ex.p, ex.m, ex.v).bubble_fraction
    return info


# --------------------------------------------------------------------------------------------
# Checkpoint glue: what a step's state is made of
# --------------------------------------------------------------------------------------------
def _save(run: Run, step: int) -> None:
    """Collective: every rank writes what it holds into its node's checkpoint root; rank 0
    adds the run's state and, once every node's part is in place, the global index."""
    from threefold.checkpoint import resolve_root

    lay = run.layout
    group = lay.checkpoint_group()
    ckroot = resolve_root(run.cfg.checkpoint.dir, run.out, group.node_of[lay.rank])
    state = None
    if lay.is_writer:
        state = {"step": step, "optim_step": run.engine.optim_step(),
                 "sampler": run.sampler.state_dict(), "config": run.cfg.to_dict(),
                 "model_config": vars(run.model_cfg), "layout": lay.describe(),
                 "scheduler": {"last_step": step, "lr": lr_at(step - 1, run.cfg) if step else 0.0}}
    save_sharded(ckroot, step, lay.rank, lay.world_size,
                 lay.checkpoint_pieces(run.engine), {"cpu_rng": torch.get_rng_state()}, state,
                 run.cfg.checkpoint.keep_last, lay.barrier, group)


def _resume(run: Run) -> int:
    """Load the newest committed checkpoint if asked; return the step to start from.
    Collective: every node's checkpoint root is checked (writable, when the run will save),
    rank 0's index decides the step, and each node's part must be on some node."""
    from threefold.checkpoint import committed_steps, resolve_root, unwritable

    lay, c = run.layout, run.cfg.checkpoint
    group = lay.checkpoint_group()
    ckroot = resolve_root(c.dir, run.out, group.node_of[lay.rank])
    field = "checkpoint.dir" if c.dir else "train.output_dir"
    why = unwritable(ckroot) if (c.interval or c.save_final) and group.is_leader(lay.rank) \
        else None
    for node, bad in zip(group.node_of, group.all_gather(why)):
        if bad:
            raise ConfigError(f"{field}: checkpoints of node {node} cannot be written: {bad}")
    steps = committed_steps(ckroot, lay.rank, group)
    # after a restart by torchrun (--max-restarts) the run always continues from its checkpoint
    if not (c.resume or lay.restarts):
        if steps:
            raise ConfigError(f"{field}: '{ckroot if c.dir else run.out}' already holds "
                              f"checkpoints (step {steps[-1]}); pass --checkpoint.resume true "
                              "to continue, or choose another --train.output_dir")
        return 0
    if not steps:
        return 0
    from threefold.weights import open_sharded

    source, state, rng = open_sharded(ckroot, steps[-1], lay.rank, group)
    saved = state["model_config"]
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
        if saved[key] != getattr(run.model_cfg, key):
            raise CheckpointError(f"checkpoint {steps[-1]}: model.{key}={saved[key]} but this "
                                  f"run has {getattr(run.model_cfg, key)}")
    # each rank reads the regions it holds, whatever layout wrote them
    run.engine.load_from(source, state["optim_step"])
    run.memory["resume_bytes_read"] = source.bytes_read
    run.sampler.load_state_dict(state["sampler"])
    torch.set_rng_state(rng["cpu_rng"])
    return int(state["step"])


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------
def _progress(run: Run, start: int):
    mode = run.cfg.train.progress
    on = mode == "on" or (mode == "auto" and sys.stderr.isatty())
    if not (on and run.layout.is_writer):
        return None
    from tqdm import tqdm

    return tqdm(total=run.cfg.train.steps, initial=start, unit="step", dynamic_ncols=True)


def train(cfg: Config, layout=None, return_run: bool = False, task=None):
    """Run training as configured; returns the summary (also written to summary.json), and
    the ``Run`` (engine, layout) too when ``return_run``. On SIGTERM (``train.preemption_grace_s``
    > 0) every rank stops after the same step, saves a checkpoint and returns; the summary
    then says ``preempted``."""
    from threefold.preempt import Preemption

    run = build_run(cfg, layout, task)
    preempt = Preemption(cfg.train.preemption_grace_s, run.layout.rank)
    try:
        return _loop(run, preempt, return_run)
    finally:
        preempt.close()


def _loop(run: Run, preempt, return_run: bool):
    cfg = run.cfg
    t, lay = cfg.train, run.layout
    reset_peak_memory(run.device)
    start = _resume(run)
    if start:
        run.memory["loading_peak_bytes"] = peak_memory_bytes(run.device)
    reset_peak_memory(run.device)  # metrics.jsonl's peaks are the steps' own
    writer, lost = None, 0
    if lay.is_writer:
        run.out.mkdir(parents=True, exist_ok=True)
        if start or lay.restarts:
            lost = max(0, last_logged_step(run.out / "metrics.jsonl") - start)
            truncate_metrics(run.out / "metrics.jsonl", start)
        writer = MetricsWriter(run.out / "metrics.jsonl", append=start > 0)
        if Path(run.data.tokenizer_path).resolve() != (run.out / "tokenizer.json").resolve():
            shutil.copyfile(run.data.tokenizer_path, run.out / "tokenizer.json")
        (run.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    peak, peak_src = device_peak_flops(run.device, run.dtype)
    # a row's positions: data.seq_len, or fewer where the task makes shorter rows (GRPO)
    row = run.task.row_length or cfg.data.seq_len
    flops_tok = accounting.flops_per_token(run.model_cfg, row)
    tokens_per_step = t.global_batch_size * row
    bar = _progress(run, start)
    log = (lambda s: bar.write(s)) if bar else (lambda s: print(s, flush=True) if lay.is_writer else None)
    n_params = accounting.num_parameters(run.model_cfg)
    n_active = accounting.active_parameters(run.model_cfg)
    active = f" ({n_active / 1e6:.2f}M active per token)" if n_active != n_params else ""
    log(f"threefold: {n_params / 1e6:.2f}M parameters{active}, {lay.describe()}, "
        f"device {run.device}, dtype {t.dtype}, steps {start}->{t.steps}")
    initial_val = evaluate(run) if start == 0 else None
    val_loss, loss, history = initial_val, float("nan"), []
    wall0 = time.perf_counter()
    trace_info: dict | None = None
    preempted: dict | None = None
    for step in range(start, t.steps):
        preempt.step_started()
        lay.before_step(step)
        t0 = time.perf_counter()
        trace = [] if step + 1 == t.trace_step else None
        try:
            loss, norm, extras = train_step(run, step, trace)
        except Exception as e:  # a collective failed or timed out: say who and where
            # after SIGTERM (torchrun stopping the group, or a preemption) without the wait
            # for the others' reports, which would only hold the restart back
            lay.report_failure(e, step, **({"grace_s": 0.0} if preempt.received_at else {}))
            raise
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        preempt.step_finished()
        dt = time.perf_counter() - t0
        if trace is not None:  # after the step's clock: writing it is not training
            trace_info = _write_trace(run, step, trace)
            if trace_info:
                log(f"step {step + 1:>6} trace: {trace_info['path']} (open in "
                    "https://ui.perfetto.dev)"
                    + (f"; pipeline idle fraction {trace_info['pipeline_idle_fraction']:.1%}, "
                       f"simulated {trace_info['pipeline_simulated_bubble']:.1%} with these "
                       "action times" if "pipeline_idle_fraction" in trace_info else ""))
        tps = tokens_per_step / dt
        rec = {"step": step + 1, "loss": loss, "lr": lr_at(step, cfg), "grad_norm": norm,
               "tokens_per_second": tps,
               "mfu": (tps * flops_tok / (peak * lay.world_size)) if peak else None,
               "peak_memory_bytes": peak_memory_bytes(run.device)}
        rec.update(extras)
        rec.update(lay.step_metrics())
        history.append(rec)
        if writer:
            writer.write(rec)
        if bar:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:.0f}")
        if (step + 1) % t.log_interval == 0 or step + 1 == t.steps:
            log(f"step {step + 1:>6} loss {loss:.4f} lr {rec['lr']:.2e} norm {norm:.3f} "
                f"tok/s {tps:,.0f}" + (f" mfu {rec['mfu']:.1%}" if rec["mfu"] else ""))
        if t.eval_interval and (step + 1) % t.eval_interval == 0 and step + 1 < t.steps:
            val_loss = evaluate(run)
            log(f"step {step + 1:>6} validation loss {val_loss:.4f}")
        saved = bool(cfg.checkpoint.interval and (step + 1) % cfg.checkpoint.interval == 0)
        if saved:
            _save(run, step + 1)
        if preempt.requested(lay) and step + 1 < t.steps:  # same answer on every rank
            if not saved:
                _save(run, step + 1)
            preempted = {"step": step + 1}
            log(f"step {step + 1:>6} preempted (SIGTERM): checkpoint {step + 1} saved; "
                "resume with --checkpoint.resume true")
            break
    wall = time.perf_counter() - wall0
    if preempted:
        pass  # no validation: the grace period is for the checkpoint
    elif t.steps > start:
        val_loss = evaluate(run)
        if cfg.checkpoint.save_final and not (cfg.checkpoint.interval and
                                               t.steps % cfg.checkpoint.interval == 0):
            _save(run, t.steps)
    if bar:
        bar.close()
    timed = history[1:] or history  # the first step pays for warm-up
    summary = {
        "final_loss": loss, "validation_loss": val_loss, "initial_validation_loss": initial_val,
        "parameters": n_params, "active_parameters": n_active, "steps": t.steps,
        "resumed_from_step": start,
        "tokens_per_step": tokens_per_step, "wall_time_s": wall,
        "tokens_per_second": (sum(r["tokens_per_second"] for r in timed) / len(timed)
                              if timed else None),
        "mfu": (sum(r["mfu"] for r in timed) / len(timed)) if timed and peak else None,
        "peak_flops_per_device": peak, "peak_flops_source": peak_src,
        "flops_per_token": flops_tok, "world_size": lay.world_size, "layout": lay.describe(),
        "restarts": lay.restarts, "lost_steps": lost,
        "memory": _memory_summary(run, history),
    }
    if trace_info:
        summary["trace"] = trace_info
    if preempted:
        summary["preempted"] = preempted
    summary.update(lay.summary_metrics())
    if writer:
        writer.close()
        (run.out / "summary.json").write_text(json.dumps(summary, indent=1))
        log(f"done: loss {loss:.4f}, validation {val_loss:.4f}"
            + (f" (from {initial_val:.4f})" if initial_val is not None else "")
            + f", {wall:.1f}s")
    lay.close()
    return (summary, run) if return_run else summary
