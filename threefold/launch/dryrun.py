"""`threefold train --dry-run`: check a configuration without running it, and print the
planner's prediction for exactly its layout.

Nothing is allocated: the model is built on the meta device (shapes, no storage), tensor
parallelism is applied to it there as the runtime would on rank 0, and the parameters each
rank holds are counted from it (and checked against the planner's own count). The layout is
checked as the launcher and the trainer check it (the rule book,
``threefold.layout.validate_layout``, which builds its ``Layout``); then ``threefold.accounting``
and ``threefold.plan.memory`` predict memory per rank, step time, tokens/s, MFU and the bytes each
mesh axis carries per step.

The hardware it predicts for (no config field names it):
- ``THREEFOLD_HARDWARE`` = a catalogue name (``h100``, ``a100``, ...) or a JSON file written by
  ``threefold plan --calibrate``; ``THREEFOLD_GPUS_PER_NODE`` sets the ranks per node
  (default: min(world, 8) for GPUs, the whole world for a calibrated machine);
- otherwise, on a CUDA machine (``train.device`` not cpu), the catalogue entry of the local
  GPU's name (unknown names give no step time: the peak is never guessed);
- otherwise this CPU: every rank on this machine, its matmul rate measured now at the threads
  each rank gets (``threefold.hardware.catalogue.cpu_matmul_flops`` through
  ``plan.calibrate.matmul_flops``), ``LOOPBACK_BANDWIDTH`` / ``LOOPBACK_LATENCY_S`` for the
  gloo links (measured: about 1 GB/s and 0.3 ms between two local processes), the
  machine's memory shared by the ranks, memory bandwidth not modelled. Memory figures on a CPU
  add the process's baseline: interpreter, torch, tokenizer, data (``plan.baseline``).

A mixture of experts (``model.num_local_experts``) is predicted as the runtime runs it
(``threefold.parallel.transforms.expert``): rank 0 holds its E/ep experts per block (the meta model
is cut by ``apply_expert_parallel`` too), memory counts them and the MoE activations
(``threefold.plan.memory_per_rank``), FLOPs and MFU the active parameters, and the bytes on
"ep" are the uniform-routing expectation of the all-to-alls (the runtime's measured figure,
``ep_rows_sent`` in metrics.jsonl, varies with the routing).

With ``parallel.offload_optimizer`` the report adds host memory per rank (and per node, the
ranks of a node sharing it) apart from the device's, and the bytes each rank moves between
device and host per step. With ``checkpoint.async_save`` it adds the host copy rank 0 holds
while a save is written in the background (``async_save_copy_bytes``; on a CPU that copy is on
top of the peak of the step it overlaps).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from threefold.layout.axes import COMM_AXES
from threefold.layout import Layout, Workload
from threefold.accounting import (active_parameters, comm_bytes_per_step, microbatches,
    num_parameters, offload_bytes_per_step, owned_parameters, pipeline_layers, stage_parameters)
from threefold.accounting.batches import tp_chunks
from threefold.accounting.lora_counts import lora_units
from threefold.config import Config, ConfigError, LoRAConfig, ModelConfig
from threefold.model.lora import apply_lora, is_adapter
from threefold.model.decoder import CausalLM
from threefold.weights.model_source import resolved_model
from threefold.parallel.transforms.expert import apply_expert_parallel
from threefold.layout import validate_layout
from threefold.schedules.registry import schedule_spec
from threefold.parallel.pipeline.stage import rank_model, split_model
from threefold.parallel.transforms.tensor import apply_tensor_parallel
from threefold.plan.baseline import Baseline, TaskData, heap_note, run_baseline
from threefold.plan.calibrate import hardware_from_calibration, load, machine_ram, matmul_flops
from threefold.hardware.catalogue import GPUS, Hardware, get_hardware, hardware_for_device_name
from threefold.plan.cluster import Cluster
from threefold.plan.compute import fp8_expert_note
from threefold.plan.memory import MemoryBreakdown, memory_per_rank
from threefold.plan.startup import StartupMemory, startup_peaks
from threefold.plan.states import RUNTIME_OVERHEAD_BYTES, async_save_copy_bytes
from threefold.plan.step import StepPrediction, predict_step
from threefold.plan.terms import memory_terms

ENV_HARDWARE = "THREEFOLD_HARDWARE"
ENV_GPUS_PER_NODE = "THREEFOLD_GPUS_PER_NODE"
LOOPBACK_BANDWIDTH = 1e9  # bytes/s, gloo all-reduce between two local processes
LOOPBACK_LATENCY_S = 3e-4


@dataclass
class DryRunResult:
    """Everything ``dry_run`` prints, for callers and tests."""

    model: ModelConfig
    layout: Layout
    work: Workload
    total_parameters: int  # counted on the meta model
    parameters_per_rank: int  # this rank's tensors after tensor parallelism (meta model)
    owned_per_rank: int  # what ZeRO leaves each rank owning (= parameters_per_rank without it)
    cluster: Cluster | None
    hardware_source: str
    memory: MemoryBreakdown
    step: StepPrediction | None
    comm_bytes: dict[str, int]
    notes: list[str]
    startup: StartupMemory  # before the first step: building and loading
    offload_bytes: dict[str, int] | None = None  # {"down", "up"} per rank per step, offload
    baseline: int = 0  # a CPU process's own resident bytes (interpreter, torch, tokenizer, data)
    baseline_parts: Baseline | None = None  # the same by part (plan.baseline), on a CPU
    # checkpoint.async_save: rank 0's host copy of what it writes, held while a save is in
    # flight (``plan.states.async_save_copy_bytes``)
    async_copy: int = 0

    @property
    def peaks(self) -> dict[str, float]:
        """Predicted peak bytes of one rank in each phase, the baseline included: start-up
        (building the model), loading (a resumed checkpoint) and the step."""
        return {"startup": self.baseline + self.startup.startup,
                "loading": self.baseline + self.startup.loading,
                "step": self.baseline + self.memory.total}


class _MetaComm:
    """What ``apply_tensor_parallel`` asks of a communication layer while sharding (sizes and
    this rank's index); it issues no collective until the model runs, which a dry run never
    does."""

    def __init__(self, tp: int, ep: int = 1):
        self.tp, self.ep = tp, ep

    def size(self, axis: str) -> int:
        """Ranks on ``axis`` (only tp and ep split the model here)."""
        return {"tp": self.tp, "ep": self.ep}.get(axis, 1)

    def rank(self, axis: str) -> int:
        """Rank 0's index on every axis."""
        return 0


def meta_parameter_counts(mcfg: ModelConfig, tp: int, sequence_parallel: bool,
                          pp: int = 1, vpp: int = 1, split: str = "params",
                          seq_len: int | None = None, ep: int = 1,
                          vshape: bool = False, lora: LoRAConfig | None = None
                          ) -> tuple[int, int, int]:
    """(whole model's parameters, rank 0's after the pipeline split, tensor and expert
    parallelism, rank 0's LoRA adapters), counted on models built on the meta device: no
    weight is allocated. The first two leave the adapters out (``lora``: applied as a run
    applies it; 0 adapters without)."""
    with torch.device("meta"):
        model = CausalLM(mcfg)
        if lora is not None:
            model = apply_lora(model, lora)
    total, _ = _base_and_adapters(model)  # tied weights once
    if pp > 1:  # rank 0's chunks, as Distributed.split_pipeline cuts them
        model = rank_model(split_model(model, pp, vpp, 0, balance=split, seq_len=seq_len,
                                       vshape=vshape))
    if tp > 1:
        apply_tensor_parallel(model, _MetaComm(tp), sequence_parallel)
    if ep > 1:  # rank 0's E/ep experts of every MoE block
        apply_expert_parallel(model, _MetaComm(tp, ep))
    return (total, *_base_and_adapters(model))


def _base_and_adapters(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters that are not LoRA adapters, adapter parameters) of ``model``."""
    sizes = [(is_adapter(name), p.numel()) for name, p in model.named_parameters()]
    return sum(n for a, n in sizes if not a), sum(n for a, n in sizes if a)


def _ranks_per_node(world: int, default: int) -> int:
    text = os.environ.get(ENV_GPUS_PER_NODE)
    if text is None:
        return max(1, min(world, default))
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{ENV_GPUS_PER_NODE}: '{text}' is not a positive integer")
    return min(int(text), world)


def choose_hardware(cfg: Config, world: int) -> tuple[Cluster, str]:
    """(cluster of ``world`` ranks, where the hardware figures come from); see the module
    docstring for the order of the sources."""
    spec = os.environ.get(ENV_HARDWARE)
    if spec:
        if Path(spec).expanduser().is_file():
            per_node = _ranks_per_node(world, world)
            hw = hardware_from_calibration(load(spec), per_node)
            return Cluster(hw, world, per_node), f"calibration file {spec}"
        try:
            hw = get_hardware(spec)
        except ValueError as e:
            raise ConfigError(f"{ENV_HARDWARE}: {e} (or a --calibrate JSON file)") from None
        return Cluster(hw, world, _ranks_per_node(world, 8)), f"catalogue ({ENV_HARDWARE})"
    if cfg.train.device != "cpu":
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            hw = hardware_for_device_name(name) or Hardware(
                name=name, peak_flops_16bit=None, peak_flops_fp32=None,
                memory_bytes=torch.cuda.get_device_properties(0).total_memory,
                intra_node_bw=LOOPBACK_BANDWIDTH, inter_node_bw=LOOPBACK_BANDWIDTH)
            return Cluster(hw, world, _ranks_per_node(world, 8)), f"local GPU: {name}"
    return _this_cpu(cfg, world)


def _cpu_threads(world: int) -> int:
    """Threads each rank computes on: torchrun gives each of several ranks one
    (OMP_NUM_THREADS=1); one process takes the machine's cores."""
    return 1 if world > 1 else max(1, os.cpu_count() or 1)


def _this_cpu(cfg: Config, world: int) -> tuple[Cluster, str]:
    per_node, threads = _ranks_per_node(world, world), _cpu_threads(world)
    precision = "bf16" if cfg.train.dtype == "bfloat16" else "fp32"
    rate = matmul_flops(precision, threads, seconds=0.2, statistic="best")
    ram = machine_ram()
    hw = Hardware.measured("this cpu", peak_flops=rate, bandwidth=LOOPBACK_BANDWIDTH,
                           latency_s=LOOPBACK_LATENCY_S, memory_bytes=ram / per_node,
                           precision=precision)
    return Cluster(hw, world, per_node), (f"this CPU, {threads} thread(s) per rank: matmul "
                                          f"{rate / 1e9:.1f} GFLOP/s measured, loopback "
                                          f"{LOOPBACK_BANDWIDTH / 1e9:.0f} GB/s assumed")


def predict(cfg: Config, world_size: int, backend_copies: bool | None = None,
            task: TaskData | None = None) -> DryRunResult:
    """Check ``cfg`` on ``world_size`` ranks and predict its step (no printing).
    ``backend_copies``: whether collectives copy through whole-size temporaries (default: on
    a CPU, as gloo does; a test's fake process group does not); ``task``: the data a
    post-training task reads instead of the token stream (the baseline's data share)."""
    mcfg = resolved_model(cfg, said := [])  # what the checkpoint's model says, if any
    layout = validate_layout(cfg, world_size, mcfg)
    notes = said + layout.notes()
    work = Workload.from_config(cfg)
    p = cfg.parallel
    total, local, adapters = meta_parameter_counts(
        mcfg, layout.tp, p.sequence_parallel, layout.pp, p.vpp, p.pipeline_split, cfg.data.seq_len,
        layout.ep, layout.vshape, cfg.lora)
    if total != num_parameters(mcfg) or local != stage_parameters(mcfg, layout, 0):
        raise RuntimeError(f"the planner counts {stage_parameters(mcfg, layout, 0)} parameters "
                           f"on rank 0 but the meta model holds {local}: cost.py has drifted "
                           "from threefold.model.decoder / parallel.tensor / parallel.pipeline")
    owned = owned_parameters(mcfg, layout, 0)
    if layout.pp > 1:
        counts = pipeline_layers(mcfg, layout)
        notes.append("pipeline blocks per virtual stage: " + ", ".join(map(str, counts))
                     + f" (parallel.pipeline_split {p.pipeline_split}); parameters per rank "
                     + ", ".join(_count(stage_parameters(mcfg, layout, st))
                                 for st in range(layout.pp)))
        if schedule_spec(p.schedule).split_backward and cfg.train.recompute_mode != "none":
            notes.append(f"{p.schedule} with activation checkpointing: each W (weight "
                         "gradients) recomputes its blocks once per weight it splits off (up to "
                         "9 per Llama block: a separate autograd call each), not counted in the "
                         "step time below; 1f1b recomputes each block once")
    cluster, source = choose_hardware(cfg, world_size)
    on_cpu = source.startswith(("this CPU", "calibration"))
    work = dataclasses.replace(
        work, backend_copies=on_cpu if backend_copies is None else backend_copies)
    memory = memory_per_rank(mcfg, layout, work,
                             overhead_bytes=0.0 if on_cpu else RUNTIME_OVERHEAD_BYTES)
    if mcfg.num_local_experts:
        notes.append(_moe_note(mcfg, layout, total, p))
    notes += [n for n in (fp8_expert_note(mcfg, work),) if n]  # (a mixture's only)
    step = None
    if _peaks_known(work, cluster.hardware):
        step = predict_step(mcfg, layout, work, cluster, simulate=True)
    comm = comm_bytes_per_step(mcfg, layout, work, stage=0)  # rank 0's
    if cfg.lora.r:
        notes.append(_lora_note(cfg, mcfg, layout, work, adapters))
    if on_cpu and world_size == 1 and cfg.train.host_mmap_threshold_mb > 1:
        notes.append(heap_note(cfg.train.host_mmap_threshold_mb))
    parts = run_baseline(cfg, layout.dp * layout.cp, mcfg.vocab_size, _cpu_threads(world_size),
                         task) if on_cpu else None
    return DryRunResult(mcfg, layout, work, total, local, owned, cluster, source, memory, step,
                        comm, notes, startup_peaks(mcfg, layout, work),
                        offload_bytes_per_step(mcfg, layout, work), parts.total if parts else 0,
                        parts, async_save_copy_bytes(cfg, owned, adapters))


def _moe_note(mcfg: ModelConfig, layout, total: int, p) -> str:
    """The note on a mixture of experts: experts per rank, active parameters, ep's bytes."""
    e, ep = mcfg.num_local_experts, layout.ep
    return (f"mixture of experts: {e} experts per block, top-{mcfg.num_experts_per_tok}"
            f", {_count(active_parameters(mcfg))} of {_count(total)} parameters active "
            f"per token (FLOPs and MFU count these); ep {ep}: {e // ep} experts per "
            "rank" + (", expert gradients over edp (dp/ep)"
                      if ep > 1 and not p.zero_stage else
                      ", each block's experts a ZeRO unit over edp_shard (dp_shard/ep)"
                      if ep > 1 else "")
            + ("; bytes on ep are the uniform-routing expectation (each rank sends "
               "(ep-1)/ep of its token-expert rows each way; real routing varies)"
               if ep > 1 else ""))


def _lora_note(cfg: Config, mcfg: ModelConfig, layout: Layout, work: Workload,
               held: int) -> str:
    """The adapters a LoRA run trains on rank 0, counted in closed form and checked against
    the ``held`` the meta model counts."""
    adapters = sum(map(sum, lora_units(mcfg, layout, work)[0]))
    if adapters != held:
        raise RuntimeError(f"the planner counts {adapters} adapter parameters on rank 0 but "
                           f"the meta model holds {held}: accounting/lora.py has drifted from "
                           "threefold.model.lora / parallel.tensor")
    return (f"LoRA r={cfg.lora.r} on {', '.join(work.lora_targets)}: {_count(adapters)} "
            "adapter parameters train on this rank, the base is frozen")


def _count(n: float) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M"


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f}" if x < 10e9 else f"{x / 1e9:.1f}"


def format_report(r: DryRunResult, world: int) -> str:
    """The text ``dry_run`` prints."""
    mem, hw = r.memory, r.cluster.hardware
    fits = mem.total <= hw.memory_bytes if hw.memory_bytes else True
    lines = _layout_lines(r, world) + _memory_lines(r, fits) \
        + memory_terms(r.model, r.layout, r.work, mem, r.baseline, r.baseline_parts) \
        + [_step_line(r, world)]
    sent = ", ".join(f"{a} {r.comm_bytes[a]:,}" for a in COMM_AXES if r.comm_bytes.get(a))
    lines.append("bytes sent per step by rank 0: " + (sent or "none (one rank)"))
    lines += [f"note: {n}" for n in r.notes]
    if not fits:
        lines.append(f"warning: predicted peak {_gb(mem.total)} GB exceeds the "
                     f"{_gb(hw.memory_bytes)} GB of {hw.name}")
    return "\n".join(lines)


def _layout_lines(r: DryRunResult, world: int) -> list[str]:
    """The report's model, layout, parameters-per-rank and hardware lines."""
    lay, w, m = r.layout, r.work, r.model
    return [
        f"threefold dry run: {_count(r.total_parameters)} parameters (h {m.hidden_size}, "
        f"{m.num_hidden_layers} layers, vocab {m.vocab_size}), built on the meta device: "
        "nothing allocated",
        f"layout: {world} ranks = pp {lay.pp} × dp_replicate {lay.dp_replicate} × dp_shard "
        f"{lay.dp_shard} × "
        + (f"cp {lay.cp} ({lay.cp_algorithm}, {w.seq_len // lay.cp} tokens of each sequence "
           "per rank) × " if lay.cp > 1 else "")
        + f"tp {lay.tp}" + (f" (ep {lay.ep} inside dp_shard)" if lay.ep > 1 else "")
        + f"; zero {lay.zero_stage}"
        + (" with the optimizer offloaded to the host" if lay.offload_optimizer else "")
        + ", sequence parallel "
        f"{'on' if lay.sp else 'off'}, recompute {lay.recompute}; micro-batch "
        f"{lay.microbatch_size} × {microbatches(lay, w)} per step, seq {w.seq_len}, "
        f"{w.precision} matmuls",
        f"parameters per rank{' (rank 0)' if lay.pp > 1 else ''}: "
        f"{_count(r.parameters_per_rank)} held"
        + (f", {_count(r.owned_per_rank)} owned (ZeRO-{lay.zero_stage})"
           if lay.zero_stage else ""),
        f"hardware: {world} × {r.cluster.hardware.name}, {r.cluster.gpus_per_node} per node "
        f"({r.hardware_source})",
    ]


def _memory_lines(r: DryRunResult, fits: bool) -> list[str]:
    """The report's memory lines: the step's peak by what holds it, the peak of each phase,
    and the host's share under optimiser offload."""
    mem, hw = r.memory, r.cluster.hardware
    other = mem.total - mem.params - mem.optimizer - mem.buffers - mem.overhead
    lines = [
        f"memory per rank, GB: weights {_gb(mem.params)}, optimizer {_gb(mem.optimizer)}, "
        f"gradients {_gb(mem.grads)}, activations {_gb(mem.activations)}, logits+loss "
        f"{_gb(mem.logits)}, buffers {_gb(mem.buffers)}, overhead {_gb(mem.overhead)} -> peak "
        f"{_gb(mem.total)} (transient part {_gb(other)})"
        + (f" of {_gb(hw.memory_bytes)}: {'fits' if fits else 'DOES NOT FIT'}"
           if hw.memory_bytes else "")]
    pk = r.peaks
    lines.append(
        f"peak per rank by phase, GB: start-up {_gb(pk['startup'])} (building: kept "
        f"{_gb(r.startup.kept)}, filling {_gb(r.startup.filling)}), loading a checkpoint "
        f"{_gb(pk['loading'])}, step {_gb(pk['step'])}"
        + (f"; each includes this CPU process's baseline {_gb(r.baseline)} (below)"
           if r.baseline else ""))
    if r.async_copy:
        lines.append(
            f"checkpoint.async_save: rank 0 copies {_gb(r.async_copy)} GB to host memory at "
            "each save and holds it until written (the next step)"
            + (f": that step's peak is {_gb(pk['step'] + r.async_copy)}" if r.baseline else
               ""))
    if r.layout.offload_optimizer:
        per_node = r.cluster.gpus_per_node
        moved = r.offload_bytes or {"down": 0, "up": 0}
        lines.append(
            f"host memory per rank (optimizer offload), GB: fp32 master + AdamW state + "
            f"gradient buffer {_gb(mem.host)}, step temporaries {_gb(mem.host_working)} -> "
            f"{_gb(mem.host_total)} ({_gb(mem.host_total * per_node)} for the {per_node} "
            f"rank(s) of a node); device <-> host per step: gradients down "
            f"{moved['down']:,} bytes, parameters up {moved['up']:,} bytes")
    return lines


def _peaks_known(work: Workload, hw: Hardware) -> bool:
    """Whether the step can be timed: the matmul dtype's peak, and under ``train.fp8`` the
    FP8 peak (this CPU's is not measured). A catalogue GPU without FP8 refuses FP8."""
    if work.fp8 != "none" and not hw.peak_flops("fp8") and hw.name in GPUS:
        raise ConfigError(f"train.fp8 {work.fp8}: {hw.name} has no FP8 tensor cores (no FP8 "
                          "peak in the catalogue); set train.fp8 none or plan an H100, H200 "
                          "or B200")
    return bool(hw.peak_flops(work.precision)) and (work.fp8 == "none"
                                                    or bool(hw.peak_flops("fp8")))


def _step_line(r: DryRunResult, world: int) -> str:
    """The report's step line: time by part, tokens/s and MFU (unknown without a peak)."""
    s, lay = r.step, r.layout
    if s is None:
        fp8 = " or fp8" if r.work.fp8 != "none" else ""
        return (f"step time: unknown ({r.cluster.hardware.name}: peak {r.work.precision}{fp8} "
                f"FLOP/s unknown; set {ENV_HARDWARE})")
    mfu = f"{s.mfu:.1%}" if s.mfu is not None else "unknown"
    return (
        f"step: {s.step_time_s:.4g} s (compute {s.compute_s:.3g}, tp {s.tp_exposed_s:.3g}"
        + (f" overlapped in {tp_chunks(lay, r.work)} chunks" if tp_chunks(lay, r.work) > 1
           else "") + ", "
        + (f"cp {s.cp_exposed_s:.3g}, " if lay.cp > 1 else "")
        + (f"ep {s.ep_exposed_s:.3g}, " if lay.ep > 1 else "")
        + f"dp {s.dp_exposed_s:.3g}, pp {s.pp_exposed_s:.3g}, bubble {s.bubble_s:.3g}, "
        f"optimizer {s.optimizer_s:.3g}"
        + (f", offload copies {s.offload_s:.3g}" if lay.offload_optimizer else "") + "); "
        f"{s.tokens_per_second_per_gpu * world:,.0f} tokens/s "
        f"({s.tokens_per_second_per_gpu:,.0f} per rank), MFU {mfu}")


def as_rows(cfg: Config, rows_per_item: int) -> Config:
    """``cfg`` with each item of the batch counted as the ``rows_per_item`` sequences its task
    runs through the model (a preference pair's chosen and rejected rows: DPO, reward
    models), which is what the model's memory and FLOPs see."""
    if rows_per_item == 1:
        return cfg
    out = copy.deepcopy(cfg)
    out.train.global_batch_size *= rows_per_item
    out.train.micro_batch_size *= rows_per_item
    return out


def dry_run(cfg: Config, world_size: int, out=print, rows_per_item: int = 1,
            task: TaskData | None = None) -> int:
    """Check ``cfg`` for ``world_size`` ranks on the meta device and print the prediction
    (``rows_per_item``: ``as_rows``). Returns 0; raises ConfigError (or ValueError) for a
    configuration that cannot run."""
    out(format_report(predict(as_rows(cfg, rows_per_item), world_size, task=task), world_size))
    if rows_per_item > 1:
        out(f"note: each of the {cfg.train.global_batch_size} items of a step is "
            f"{rows_per_item} sequences through the model (chosen and rejected), counted above "
            "as sequences")
    return 0
