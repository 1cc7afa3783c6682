"""The dry run's report: the layout, each rank's memory by phase against the device, and the
predicted step, as lines a user scans before launch."""

from __future__ import annotations

from dataclasses import dataclass

from threefold.accounting import microbatches
from threefold.accounting.batches import tp_chunks
from threefold.config import ConfigError, ModelConfig
from threefold.hardware.catalogue import GPUS, Hardware
from threefold.layout import Layout, Workload
from threefold.layout.axes import COMM_AXES
from threefold.plan.baseline import Baseline
from threefold.plan.checkpoint_interval import IntervalChoice
from threefold.plan.cluster import Cluster
from threefold.plan.memory import MemoryBreakdown
from threefold.plan.memory_copies import MemoryCheckpoint
from threefold.plan.startup import StartupMemory
from threefold.plan.step import StepPrediction
from threefold.plan.terms import memory_terms

ENV_HARDWARE = "THREEFOLD_HARDWARE"


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
    # a colocated rollout engine's weights, KV cache and (on a CPU) vLLM's runtime, in each
    # rank's step peak (plan.rollout_engine)
    engine: int = 0
    server: int = 0  # a rollout server's process (grpo.vllm_mode server), not on the ranks
    # the checkpoint intervals' costs (auto's choices) at the predicted step
    # (plan.checkpoint_interval): storage's, and host memory's where the run has one
    intervals: tuple[IntervalChoice, ...] = ()
    memory_copy: MemoryCheckpoint | None = None  # checkpoint.memory_interval's figures
    engine_sleeps: bool = False  # the rollout engine, on a GPU, sleeps while training runs

    @property
    def peaks(self) -> dict[str, float]:
        """Predicted peak bytes of one rank in each phase, the baseline included: start-up
        (building the model), loading (a resumed checkpoint) and the step."""
        return {"startup": self.baseline + self.startup.startup,
                "loading": self.baseline + self.startup.loading,
                "step": self.baseline + self._with_engine()}

    def _with_engine(self) -> float:
        """The step's peak with the rollout engine: beside it, or, where it sleeps while the
        trainer trains, the larger of the step's and the rollout's, when the engine is awake
        beside the weights, optimiser state and gradients (whether or not they are freed)."""
        m = self.memory
        if not self.engine_sleeps:
            return m.total + self.engine
        return max(m.total, m.model_states + m.buffers + m.overhead + self.engine)


def short_count(n: float) -> str:
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
    lines += [i.line("save: rank 0's bytes at " + ("checkpoint.write_gbps" if i.field ==
                                                   "checkpoint.interval" else "a host copy's rate")
                     + "; step: predicted above") for i in r.intervals]
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
        f"threefold dry run: {short_count(r.total_parameters)} parameters (h {m.hidden_size}, "
        f"{m.num_hidden_layers} layers, vocab {m.vocab_size}), built on the meta device: "
        "nothing allocated",
        f"layout: {world} ranks = pp {lay.pp} × dp_replicate {lay.dp_replicate} × dp_shard "
        f"{lay.dp_shard} × "
        + (f"cp {lay.cp} ({_cp_algorithm(lay)}, {w.seq_len // lay.cp} tokens of each "
           "sequence per rank) × " if lay.cp > 1 else "")
        + f"tp {lay.tp}" + (f" (ep {lay.ep} inside dp_shard)" if lay.ep > 1 else "")
        + f"; zero {lay.zero_stage}"
        + (" with the optimizer offloaded to the host" if lay.offload_optimizer else "")
        + ", sequence parallel "
        f"{'on' if lay.sp else 'off'}, recompute {lay.recompute_label}"
        + (f", MLP in {w.mlp_tiles} tiles" if w.mlp_tiles > 1 else "") + "; micro-batch "
        f"{lay.microbatch_size} × {microbatches(lay, w)} per step, seq {w.seq_len}, "
        f"{w.precision} matmuls",
        f"parameters per rank{' (rank 0)' if lay.pp > 1 else ''}: "
        f"{short_count(r.parameters_per_rank)} held"
        + (f", {short_count(r.owned_per_rank)} owned (ZeRO-{lay.zero_stage})"
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
    if r.memory_copy:
        lines.append(memory_copy_line(r.memory_copy))
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


def memory_copy_line(m: MemoryCheckpoint) -> str:
    """The in-memory checkpoints' line: host memory kept and replica bytes sent."""
    def size(x: float) -> str:  # a small model's copies would read 0.000 GB
        return f"{_gb(x)} GB" if x >= 1e8 else f"{x / 1e6:.2f} MB"
    every = f"every {m.interval} step{'s' if m.interval > 1 else ''}"
    head = f"checkpoint.memory_interval {m.interval}: rank 0 keeps {size(m.held)} in host memory"
    if m.nodes < 2:
        return (f"{head} (tmpfs: its own part; {size(m.peak)} while the next is written), one "
                "node: no replica")
    return (f"{head} (tmpfs: its own part + its peer's; {size(m.peak)} while the next is "
            f"written and sent), sends {size(m.sent)} ({m.sent:,} bytes of tensors) to node 1 "
            f"{every} ({size(m.sent_per_step)} per step)")


def peaks_known(work: Workload, hw: Hardware) -> bool:
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


def _cp_algorithm(lay: Layout) -> str:
    """The cp algorithm as the layout line names it: a hybrid's two parts, e.g. "ring 2 ×
    ulysses 4" (the all-to-all inside)."""
    if 1 < lay.ulysses < lay.cp:
        return f"{lay.cp_algorithm} {lay.cp_ring} × ulysses {lay.ulysses}"
    return lay.cp_algorithm
