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
top of the peak of the step it overlaps). With ``checkpoint.interval`` (auto or a count) it adds
the interval's cost at the predicted step: work lost per failure, save overhead, goodput
(``threefold.plan.checkpoint_interval``). With
``checkpoint.memory_interval`` it adds the host memory rank 0's in-memory checkpoints keep (its
part and, on several nodes, its peer's) and the bytes its replica sends to the next node
(``threefold.plan.memory_copies``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import torch

from threefold.layout import Layout, Workload
from threefold.accounting import (active_parameters, comm_bytes_per_step,
    num_parameters, offload_bytes_per_step, owned_parameters, pipeline_layers, stage_parameters)
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
from threefold.plan.baseline import TaskData, heap_note, run_baseline
from threefold.plan.calibrate import hardware_from_calibration, load, machine_ram, matmul_flops
from threefold.hardware.catalogue import Hardware, get_hardware, hardware_for_device_name
from threefold.plan.checkpoint_interval import planned_intervals
from threefold.plan.cluster import Cluster
from threefold.plan.compute import fp8_expert_note
from threefold.plan.memory import memory_per_rank
from threefold.plan.memory_copies import memory_checkpoint
from threefold.plan.startup import startup_peaks
from threefold.launch.engine_memory import engine_memory, sleeps
from threefold.plan.states import RUNTIME_OVERHEAD_BYTES, async_save_copy_bytes
from threefold.plan.step import predict_step
from threefold.launch.replica_note import replica_note
from threefold.launch.dryrun_report import (ENV_HARDWARE, DryRunResult, format_report, peaks_known,
                                           short_count)

ENV_GPUS_PER_NODE = "THREEFOLD_GPUS_PER_NODE"
LOOPBACK_BANDWIDTH = 1e9  # bytes/s, gloo all-reduce between two local processes
LOOPBACK_LATENCY_S = 3e-4


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
        notes += _pipeline_notes(cfg, mcfg, layout)
    cluster, source = choose_hardware(cfg, world_size)
    on_cpu = source.startswith(("this CPU", "calibration"))
    work = dataclasses.replace(
        work, backend_copies=on_cpu if backend_copies is None else backend_copies)
    memory = memory_per_rank(mcfg, layout, work,
                             overhead_bytes=0.0 if on_cpu else RUNTIME_OVERHEAD_BYTES)
    if mcfg.num_local_experts:
        notes.append(_moe_note(mcfg, layout, total, p))
    notes += [n for n in (fp8_expert_note(mcfg, work),) if n]  # (a mixture's only)
    notes += [n for n in (replica_note(cfg, mcfg, layout),) if n]  # (replica groups' only)
    step = None
    if peaks_known(work, cluster.hardware):
        step = predict_step(mcfg, layout, work, cluster, simulate=True)
    comm = comm_bytes_per_step(mcfg, layout, work, stage=0)  # rank 0's
    if cfg.lora.r:
        notes.append(_lora_note(cfg, mcfg, layout, work, adapters))
    if on_cpu and world_size == 1 and cfg.train.host_mmap_threshold_mb > 1:
        notes.append(heap_note(cfg.train.host_mmap_threshold_mb))
    parts = run_baseline(cfg, layout.dp * layout.cp, mcfg.vocab_size, _cpu_threads(world_size),
                         task) if on_cpu else None
    intervals = planned_intervals(cfg, world_size, adapters if cfg.lora.r else owned,
                                  step.step_time_s) if step else ()
    engine, server = engine_memory(cfg, mcfg, layout, work, task, notes, on_cpu,
                                   _cpu_threads(world_size), parts.process if parts else 0)
    return DryRunResult(mcfg, layout, work, total, local, owned, cluster, source, memory, step,
                        comm, notes, startup_peaks(mcfg, layout, work),
                        offload_bytes_per_step(mcfg, layout, work), parts.total if parts else 0,
                        parts, async_save_copy_bytes(cfg, owned, adapters), engine, server,
                        intervals, memory_checkpoint(
                            cfg, owned, adapters, -(-world_size // cluster.gpus_per_node),
                            auto_steps=next((i.steps for i in intervals
                                             if i.field == "checkpoint.memory_interval"), 0)),
                        engine_sleeps=sleeps(task, on_cpu))


def _pipeline_notes(cfg: Config, mcfg: ModelConfig, layout) -> list[str]:
    """A pipeline's notes: blocks per virtual stage, parameters per rank, and what a
    zero-bubble schedule recomputes under activation checkpointing."""
    p = cfg.parallel
    counts = pipeline_layers(mcfg, layout)
    out = ["pipeline blocks per virtual stage: " + ", ".join(map(str, counts))
           + f" (parallel.pipeline_split {p.pipeline_split}); parameters per rank "
           + ", ".join(short_count(stage_parameters(mcfg, layout, st))
                       for st in range(layout.pp))]
    if schedule_spec(p.schedule).split_backward and cfg.train.recompute_mode != "none":
        out.append(f"{p.schedule} with activation checkpointing: each W (weight "
                   "gradients) recomputes its blocks once per weight it splits off (up to "
                   "9 per Llama block: a separate autograd call each), not counted in the "
                   "step time below; 1f1b recomputes each block once")
    return out


def _moe_note(mcfg: ModelConfig, layout, total: int, p) -> str:
    """The note on a mixture of experts: experts per rank, active parameters, ep's bytes."""
    e, ep = mcfg.num_local_experts, layout.ep
    return (f"mixture of experts: {e} experts per block, top-{mcfg.num_experts_per_tok}"
            f", {short_count(active_parameters(mcfg))} of {short_count(total)} parameters active "
            f"per token (FLOPs and MFU count these); ep {ep}: {e // ep} experts per "
            "rank" + (", expert gradients over edp (dp/ep)"
                      if ep > 1 and not p.zero_stage else
                      ", each block's experts a ZeRO unit over edp_shard (dp_shard/ep)"
                      if ep > 1 else "")
            + ("; bytes on ep are the uniform-routing expectation (each rank sends "
               "(ep-1)/ep of its token-expert rows each way; real routing varies)"
               if ep > 1 and layout.ep_dispatch == "flat" else "")
            + (f"; hierarchical dispatch over {layout.ep_inter} node(s) × {layout.ep_intra}: "
               "bytes on ep_inter (each token once per destination node) and ep_intra are "
               "the uniform-routing expectation (real routing varies)"
               if ep > 1 and layout.ep_dispatch == "hierarchical" else ""))


def _lora_note(cfg: Config, mcfg: ModelConfig, layout: Layout, work: Workload,
               held: int) -> str:
    """The adapters a LoRA run trains on rank 0, counted in closed form and checked against
    the ``held`` the meta model counts."""
    adapters = sum(map(sum, lora_units(mcfg, layout, work)[0]))
    if adapters != held:
        raise RuntimeError(f"the planner counts {adapters} adapter parameters on rank 0 but "
                           f"the meta model holds {held}: accounting/lora.py has drifted from "
                           "threefold.model.lora / parallel.tensor")
    return (f"LoRA r={cfg.lora.r} on {', '.join(work.lora_targets)}: {short_count(adapters)} "
            "adapter parameters train on this rank, the base is frozen")


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
