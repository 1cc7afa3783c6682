"""What a user should know before launching a planned layout: the traps the planner sees in
it (too few microbatches for the pipeline, a bubble, memory near the device's, an axis that
leaves its node where its traffic needs NVLink, ZeRO-3's gathers across the network)."""

from __future__ import annotations

from threefold.accounting import microbatches, tp_shard
from threefold.config import ModelConfig
from threefold.layout import Layout, Workload
from threefold.plan.cluster import Cluster
from threefold.plan.memory import MemoryBreakdown
from threefold.plan.step import StepPrediction

BUBBLE_WARN = 0.20
# data-parallel traffic the overlap model hides, as a share of the step, above which a row
# says so: ZeRO-3 over a network can keep the links busy for most of the step
HIDDEN_WARN = 0.50
MEMORY_WARN = 0.95


def layout_warnings(cfg: ModelConfig, lay: Layout, mem: MemoryBreakdown, step: StepPrediction,
                    cluster: Cluster, work: Workload | None = None) -> tuple[str, ...]:
    """What a user should know before launching ``lay`` (with ``work``: batch-size effects)."""
    out = []
    if work is not None:
        m = microbatches(lay, work)
        if lay.pp > 1 and m < lay.pp:
            out.append(f"{m} microbatches for pp={lay.pp} stages: the pipeline never fills "
                       f"(1F1B wants >= {lay.pp}, the bubble is small from about {4 * lay.pp})")
        if work.global_batch // lay.dp == 1:
            out.append(f"dp={lay.dp} leaves one sequence per replica: no accumulation to hide "
                       "the gradient reduction behind, and a larger dp cannot be used")
    if "tp" in step.inter_node_axes:
        out.append(f"tp crosses nodes (tp={lay.tp} > {cluster.gpus_per_node} GPUs per node)")
    if "cp_inner" in step.inter_node_axes:  # a hybrid's ring may cross; its all-to-all not
        out.append(f"cp's all-to-all crosses nodes (cp_ulysses·tp={lay.ulysses * lay.tp} > "
                   f"{cluster.gpus_per_node} GPUs per node): q, K, V move over the network")
    elif "cp" in step.inter_node_axes and lay.cp_ring in (1, lay.cp):
        out.append(f"cp crosses nodes (cp·tp={lay.cp * lay.tp} > {cluster.gpus_per_node} GPUs "
                   "per node): K/V move over the network")
    if "ep" in step.inter_node_axes:
        out.append(f"ep crosses nodes (ep·tp={lay.ep * lay.tp} > {cluster.gpus_per_node} GPUs "
                   "per node): " + ("each token crosses the network once per destination node"
                                    " (hierarchical dispatch)" if lay.ep_dispatch ==
                                    "hierarchical" else "the all-to-alls of every MoE layer "
                                    "go over the network"))
    over = {lv.name: lv.oversubscription for lv in cluster.topology()}
    for axis, level in step.axis_levels:
        if axis in ("dp_replicate", "dp_shard") and over.get(level, 1.0) > 1:
            out.append(f"{axis}={lay.axis_size(axis)} collectives cross the {level} level, "
                       f"oversubscribed 1:{over[level]:g}")
    if step.bubble_fraction > BUBBLE_WARN:
        out.append(f"pipeline bubble {step.bubble_fraction:.0%} > {BUBBLE_WARN:.0%}")
    busy = sum(t for axis, _, _, t, _ in step.overlap if axis not in ("tp", "pp", "cp", "ep"))
    if busy > HIDDEN_WARN * step.step_time_s:
        out.append(f"data-parallel collectives take {busy:.1f} s of the {step.step_time_s:.1f} s "
                   f"step ({busy / step.step_time_s:.0%}): hidden only if they overlap compute "
                   "perfectly")
    if mem.total > MEMORY_WARN * cluster.hardware.memory_bytes:
        out.append(f"within {1 - MEMORY_WARN:.0%} of the memory limit")
    if lay.offload_optimizer:
        out.append(f"optimizer offload: {mem.host_total * cluster.gpus_per_node / 1e9:.0f} GB "
                   f"of host memory per node ({mem.host_total / 1e9:.1f} per GPU), "
                   f"{step.offload_s:.2f} s of PCIe copies per step")
    sh = tp_shard(cfg, lay.tp)
    if sh.kv_replicas > 1:
        out.append(f"{cfg.num_key_value_heads} kv heads replicated {sh.kv_replicas}x over tp")
    if cfg.intermediate_size % lay.tp:
        out.append(f"intermediate size {cfg.intermediate_size} padded to {sh.ffn}·tp")
    return tuple(out)
