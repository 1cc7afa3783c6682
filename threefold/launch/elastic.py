"""Elastic continuation (``threefold train --nnodes MIN:MAX``): a job that loses a node goes
on with the nodes it has, and grows back when nodes return.

torchrun does the membership: its c10d rendezvous restarts every worker when a peer fails
(``--max-restarts``), re-forming the group from the nodes still alive once the dead one's
keep-alive expires; and when a new node waits at the rendezvous, each agent stops its workers
with SIGTERM and starts them again in the larger world. threefold's part is what a worker does
in a world of another size than the configuration describes:

- the launcher passes the full world (MAX × --nproc-per-node) to every worker as
  ``parallel.elastic_world`` and makes every start continue from the newest checkpoint
  (``checkpoint.resume``: a membership change restarts workers without counting a restart);
- a worker whose WORLD_SIZE differs re-plans the layout with the planner (``replan``): the
  layouts that fit the model and the per-rank memory on the new world, the global batch kept
  (so more gradient-accumulation steps on fewer ranks), the fastest predicted one that the rule
  book accepts; one line when none fits. It is a function of the configuration and the world
  size alone (the hardware figures are a catalogue entry, a calibration file or this CPU's
  nominal ones, never a measurement taken now), so every rank decides the same without
  talking to the others;
- the checkpoint is resharded onto the new layout as any resume is (``CheckpointSource``);
- the SIGTERM of a growing group is the preemption notice (``threefold.training.preempt``):
  every rank stops after the same step and writes a checkpoint, which the larger world
  resumes with the configured layout.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass

from threefold.config import Config, ConfigError, ModelConfig
from threefold.layout import Layout, Workload, validate_layout

# the best layouts scored in full; the first the rule book accepts is taken
KEEP = 16
# predicted step times within this fraction of the fastest count as equally fast
TIE = 0.02
# the choices a re-plan weighs keeping (dp_shard follows from the world)
KNOBS = ("tp", "pp", "vpp", "cp", "ep", "dp_replicate", "zero_stage", "microbatch_size",
         "recompute", "recompute_modules", "offload_optimizer", "schedule", "sequence_parallel")
# this CPU's matmul rate as the re-plan assumes it: a fixed figure (a measurement would differ
# between ranks, which must all choose the same layout); it scales the predicted step time
NOMINAL_CPU_FLOPS = 2e10
NOMINAL_GPU_FLOPS = 4e14  # bf16, for a GPU the catalogue does not know (fp32: an eighth)


@dataclass(frozen=True)
class Replan:
    """The layout a run re-planned for ``world`` ranks, and the one it was configured with."""

    was: Layout
    now: Layout
    global_batch: int
    step_s: float | None  # the planner's predicted step time on the new world
    hardware: str  # where the hardware figures come from

    def line(self) -> str:
        """The log line, e.g. ``elastic: 4 -> 2 ranks: layout dp_shard 2 (was dp_shard 4),
        grad_accum 2 -> 4, predicted 0.41 s/step``."""
        step = "" if self.step_s is None else f", predicted {self.step_s:.3g} s/step"
        return (f"elastic: {self.was.world_size} -> {self.now.world_size} ranks: layout "
                f"{short_layout(self.now)} (was {short_layout(self.was)}), grad_accum "
                f"{grad_accum(self.was, self.global_batch)} -> "
                f"{grad_accum(self.now, self.global_batch)}{step} ({self.hardware})")


def grad_accum(lay: Layout, global_batch: int) -> int:
    """Micro-batches each data-parallel rank accumulates per optimiser step."""
    return max(1, global_batch // (lay.dp * lay.microbatch_size))


def short_layout(lay: Layout) -> str:
    """The knobs of ``lay`` that a re-plan may change, e.g. ``tp 2, dp_shard 2, zero 2, mbs 4``
    (model-parallel degrees only where above 1)."""
    parts = [f"{a} {getattr(lay, a)}" for a in ("pp", "vpp", "tp", "cp", "ep", "dp_replicate")
             if getattr(lay, a) > 1]
    parts += [f"dp_shard {lay.dp_shard}", f"zero {lay.zero_stage}",
              f"mbs {lay.microbatch_size}"]
    if lay.recompute != "none":
        parts.append(f"recompute {lay.recompute_label}")
    return ", ".join(parts)


def elastic_nodes(launcher: list[str]) -> tuple[int, int] | None:
    """(MIN, MAX) of torchrun's ``--nnodes MIN:MAX`` when MIN < MAX; None otherwise."""
    if "--nnodes" not in launcher:
        return None
    text = launcher[launcher.index("--nnodes") + 1]
    if ":" not in text:
        return None
    low, high = (int(x) for x in text.split(":"))
    return (low, high) if low < high else None


def elastic_argv(cfg: Config, nproc: int, launcher: list[str], argv: list[str]) -> list[str]:
    """``argv`` for the workers of an elastic launch: the full world (``parallel.elastic_world``)
    and ``checkpoint.resume`` true, said in one line; unchanged when the launch is not
    elastic or the user set the world."""
    nodes = elastic_nodes(launcher)
    if nodes is None or cfg.parallel.elastic_world:
        return argv
    world = nodes[1] * nproc
    print(f"threefold: elastic launch (--nnodes {nodes[0]}:{nodes[1]}): the layout is "
          f"configured for {world} ranks and re-planned when fewer start; every start resumes "
          "from the newest checkpoint (checkpoint.resume true)", flush=True)
    if cfg.train.preemption_grace_s <= 0:
        print("threefold: warning: train.preemption_grace_s is 0: a node that returns stops "
              "the workers without a checkpoint (the steps since the last one are lost)",
              flush=True)
    return [*argv, "--parallel.elastic_world", str(world), "--checkpoint.resume", "true"]


def elastic_env(launcher: list[str]) -> dict[str, str] | None:
    """torchrun's environment for an elastic launch (None: this process's, unchanged).

    With its default, the rendezvous shares the agent's TCP store with the workers, and an
    agent that stays rank 0 keeps the store's address from the first round without writing it
    again for the next: a node that joins later waits for that address for good (measured:
    torch 2.13, two agents; the workers of both wait 60 s, then fail). Without sharing
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) every round publishes a fresh address and the
    workers' rank 0 hosts their store (``threefold.comm.distributed``)."""
    if elastic_nodes(launcher) is None or "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in os.environ:
        return None
    return {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def set_layout(cfg: Config, lay: Layout) -> None:
    """Write ``lay`` into ``cfg``'s parallel section and the loop's micro-batch and recompute
    (the inverse of ``Layout.from_config``)."""
    p, t = cfg.parallel, cfg.train
    for axis in ("tp", "pp", "vpp", "dp_replicate", "dp_shard", "cp", "cp_ulysses", "ep",
                 "zero_stage", "pipeline_inflight", "cp_algorithm", "offload_optimizer"):
        setattr(p, axis, getattr(lay, axis))
    p.schedule = lay.pipeline_schedule
    p.pipeline_split = lay.pipeline_split.split(":")[0]  # "flops:SEQ" is parallel's "flops"
    p.sequence_parallel = lay.sequence_parallel if lay.tp > 1 else p.sequence_parallel
    p.microbatches = 0  # from the batch
    t.micro_batch_size = lay.microbatch_size
    t.activation_checkpointing = False
    t.recompute, t.recompute_modules = lay.recompute, ",".join(lay.recompute_modules)


def replan(cfg: Config, mcfg: ModelConfig, world: int, cluster, hardware: str = "") -> Replan:
    """The fastest predicted layout of ``mcfg`` on ``world`` ranks of ``cluster`` that fits
    the per-rank memory, keeps ``train.global_batch_size`` and passes the rule book; written
    into ``cfg`` (``set_layout``). A ConfigError (one line) when none does."""
    from threefold.plan.candidates import SearchSpace
    from threefold.plan.search import search

    was = Layout.from_config(cfg, cfg.parallel.elastic_world)
    p = cfg.parallel
    work = dataclasses.replace(Workload.from_config(cfg),  # gloo's copies on a CPU, as dry-run
                               backend_copies=hardware.startswith(("this CPU", "calibration")))
    space = SearchSpace(cp_algorithm=(p.cp_algorithm,), offload_optimizer=(p.offload_optimizer,),
                        tp_overlap=p.tp_overlap, ep_dispatch=p.ep_dispatch,
                        gpus_per_node=cluster.gpus_per_node)
    result = search(mcfg, cluster, work, space, keep=KEEP)
    accepted = []
    for cand in result.ranked:
        trial = copy.deepcopy(cfg)
        set_layout(trial, cand.layout)
        try:
            accepted.append((cand, validate_layout(trial, world, mcfg)))
        except ConfigError:
            continue  # a layout the planner counts but this run's task or options refuse
    if not accepted:
        raise ConfigError(_nothing_fits(result, world, cluster, cfg.parallel.elastic_world))
    fastest = accepted[0][0].step.step_time_s
    # among the layouts as fast as the fastest (within TIE), the one that changes the fewest
    # of the configured choices; then the planner's order (min keeps the first)
    cand, now = min((a for a in accepted if a[0].step.step_time_s <= fastest * (1 + TIE)),
                    key=lambda a: changes(was, a[0].layout))
    set_layout(cfg, cand.layout)
    return Replan(was, now, cfg.train.global_batch_size, cand.step.step_time_s, hardware)


def changes(was: Layout, now: Layout) -> int:
    """How many of ``was``'s choices ``now`` changes (dp_shard aside: the world sets it)."""
    return sum(getattr(was, k) != getattr(now, k) for k in KNOBS)


def _nothing_fits(result, world: int, cluster, full: int) -> str:
    """The one line of a re-plan that finds no layout."""
    limit = cluster.hardware.memory_bytes
    if result.too_big:
        why = (f"fits in {limit / 1e9:.3g} GB per rank (the smallest needs "
               f"{min(r[1] for r in result.too_big) / 1e9:.3g} GB)")
    else:  # the world divides neither the batch nor the model
        why = "divides the model and the global batch: " + "; ".join(sorted(result.invalid))
    return (f"parallel.elastic_world: no layout on {world} of the {full} ranks the run was "
            f"configured for {why}; bring the nodes back, or raise --nnodes MIN so that the "
            "job waits for them")


def planning_cluster(cfg: Config, world: int):
    """(cluster of ``world`` ranks, where its figures come from) for a re-plan: the dry run's
    hardware (``THREEFOLD_HARDWARE``, or the local GPU's catalogue entry), but on a CPU this
    machine's memory shared by its ranks and ``NOMINAL_CPU_FLOPS``, never a rate measured now."""
    from threefold.hardware.catalogue import Hardware
    from threefold.launch.dryrun import LOOPBACK_BANDWIDTH, LOOPBACK_LATENCY_S, choose_hardware
    from threefold.launch.dryrun_report import ENV_HARDWARE
    from threefold.plan.calibrate import machine_ram
    from threefold.plan.cluster import Cluster

    import torch

    precision = "bf16" if cfg.train.dtype == "bfloat16" else "fp32"
    if os.environ.get(ENV_HARDWARE) or (cfg.train.device != "cpu" and torch.cuda.is_available()):
        cluster, source = choose_hardware(cfg, world)
        if cluster.hardware.peak_flops(precision):
            return cluster, source
        # a GPU the catalogue lacks: its memory is known, its rate only ranks the layouts
        hw = cluster.hardware.with_overrides(peak_flops_16bit=NOMINAL_GPU_FLOPS,
                                             peak_flops_fp32=NOMINAL_GPU_FLOPS / 8)
        return (Cluster(hw, world, cluster.gpus_per_node),
                f"{source}, {NOMINAL_GPU_FLOPS / 1e12:.0f} TFLOP/s assumed")
    per_node = max(1, min(world, int(os.environ.get("LOCAL_WORLD_SIZE") or world)))
    hw = Hardware.measured("this cpu", peak_flops=NOMINAL_CPU_FLOPS, bandwidth=LOOPBACK_BANDWIDTH,
                           latency_s=LOOPBACK_LATENCY_S, memory_bytes=machine_ram() / per_node,
                           precision=precision)
    return Cluster(hw, world, per_node), (f"this CPU: its memory over {per_node} rank(s), "
                                          f"{NOMINAL_CPU_FLOPS / 1e9:.0f} GFLOP/s assumed")


def replan_for_world(cfg: Config, world: int) -> str | None:
    """In a worker: when ``parallel.elastic_world`` is set and ``world`` differs from it,
    re-plan ``cfg``'s layout for ``world`` ranks (``replan``) and return the log line; else
    None (the configured layout, as in the full world)."""
    full = cfg.parallel.elastic_world
    if not full or world == full:
        return None
    from threefold.weights.model_source import resolved_model

    cluster, source = planning_cluster(cfg, world)
    return replan(cfg, resolved_model(cfg), world, cluster, source).line()
