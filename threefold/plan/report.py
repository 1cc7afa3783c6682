"""What ``threefold plan`` prints: the table of the best layouts, JSON rows, and why each runner-up
loses to the best (``explain``).
"""

from __future__ import annotations

from threefold.config import ModelConfig
from threefold.layout import Workload
from threefold.plan.candidates import Candidate, PlanResult
from threefold.plan.compute import fp8_expert_note
from threefold.plan.step import OVERLAP_RULES

# --------------------------------------------------------------------------------------------
# Explaining and printing
# --------------------------------------------------------------------------------------------
def _terms(c: Candidate) -> dict[str, float]:
    s = c.step
    return {"compute": s.compute_s, "bubble": s.bubble_s, "tp comm": s.tp_exposed_s,
            "pp comm": s.pp_exposed_s, "cp comm": s.cp_exposed_s, "ep comm": s.ep_exposed_s,
            "dp comm": s.dp_exposed_s, "optimizer": s.optimizer_s + s.offload_s}


def exposed_breakdown(c: Candidate) -> str:
    """Where the step of ``c`` goes: compute, the bubble and the communication each axis
    leaves exposed (seconds per step), each axis with the level its groups run on."""
    s, t = c.step, _terms(c)
    where = dict(s.axis_levels)
    axis_of = {"tp comm": "tp", "pp comm": "pp", "cp comm": "cp", "ep comm": "ep"}
    parts = [f"compute {t['compute']:.3f}" + (f" (slowest stage {s.stage_imbalance:.2f}x "
                                               "the mean)" if c.layout.pp > 1 else ""),
             f"bubble {t['bubble']:.3f}"]
    for k, a in axis_of.items():
        if c.layout.axis_size(a) > 1:
            parts.append(f"{k} {t[k]:.3f} ({where.get(a, '?')})")
    dp_axes = [f"{a} {lvl}" for a, lvl in s.axis_levels if a in ("dp_replicate", "dp_shard")]
    if dp_axes:
        parts.append(f"dp comm {t['dp comm']:.3f} ({', '.join(dp_axes)})")
    if s.optimizer_s or s.offload_s:
        parts.append(f"optimizer {s.optimizer_s + s.offload_s:.3f}")
    return f"step {s.step_time_s:.3f} s = " + " + ".join(parts) + " (exposed, s per step)"


def overlap_lines(c: Candidate) -> list[str]:
    """The overlap model of ``c``'s slowest stage, stated: per axis and collective, what it
    hides behind (``plan.step.OVERLAP_RULES``), its seconds per step and how many of them are
    exposed (biggest first; those under 0.5 ms left out)."""
    rows = sorted(c.step.overlap, key=lambda r: -r[3])
    return [f"{axis} {op}: {total:.3f} s behind {OVERLAP_RULES.get(rule, rule)}"
            f" -> {left:.3f} exposed" for axis, op, rule, total, left in rows if total >= 5e-4]


def peak_parts(m) -> tuple[float, float, float]:
    """The peak (``MemoryBreakdown.total``) split at the moment it happens: model states then
    alive (weights, optimiser state, the gradients held at that moment), activations, and the
    rest (buffers, runtime overhead, logits, gathered ZeRO-3 units, autocast copies,
    recomputation or the optimiser's temporaries); the three add up to the peak."""
    at_backward = m.activation_peak >= m.step_peak
    held = m.step_peak - m.optimizer_working if m.step_peak > m.grads else m.grads
    states = m.params + m.optimizer + (m.grads_in_backward if at_backward else held)
    act = m.activations if at_backward else 0.0
    return states, act, m.total - states - act


def explain(best: Candidate, other: Candidate) -> str:
    """Why ``other`` is slower than ``best``: the terms of its step time that are larger,
    biggest first, with what in the layout makes them so."""
    if other is best:
        return "best: shortest predicted step"
    tb, to = _terms(best), _terms(other)
    deltas = sorted(((to[k] - tb[k], k) for k in tb), reverse=True)
    lost = other.step.step_time_s - best.step.step_time_s
    if lost <= 1e-4 * best.step.step_time_s:
        return "ties with the best (predicted step within 0.01%)"
    parts = [f"{k} +{d * 1e3:.1f} ms" for d, k in deltas if d > 0.1 * max(lost, 1e-9)]
    gains = [f"{k} -{-d * 1e3:.1f} ms" for d, k in sorted(deltas) if d < -0.1 * max(lost, 1e-9)]
    head = f"{lost * 1e3:.1f} ms slower: " + ", ".join(parts[:3])
    if gains:
        head += " (saves " + ", ".join(gains[:2]) + ")"
    why = _cause(best, other, deltas[0][1])
    saved = best.memory.total - other.memory.total
    tail = f"; uses {saved / 1e9:.1f} GB less per GPU" if saved > 1e9 else ""
    return head + (f" ({why})" if why else "") + tail


def _cause(best: Candidate, other: Candidate, term: str) -> str:
    """A short reason for the largest term difference."""
    b, o = best.layout, other.layout
    if term == "compute":
        if o.recompute_label != b.recompute_label:
            return f"recompute {o.recompute_label} vs {b.recompute_label}"
        if other.step.stage_imbalance > best.step.stage_imbalance + 0.02:
            return (f"the slowest stage computes {other.step.stage_imbalance:.2f}x the mean "
                    f"stage, against {best.step.stage_imbalance:.2f}x (pipeline_split "
                    f"{o.pipeline_split})")
        return "more FLOPs on the slowest stage (padding, replicated kv, head imbalance)"
    if term == "bubble":
        return f"pp={o.pp}, vpp={o.vpp} {schedule_name(o)}, {other.step.bubble_fraction:.0%} bubble"
    if term == "tp comm":
        crosses = "tp" in other.step.inter_node_axes
        return f"tp={o.tp}" + (" across nodes" if crosses else "")
    if term == "pp comm":
        return f"pp={o.pp}, vpp={o.vpp}"
    if term == "cp comm":
        return f"cp={o.cp} {o.cp_algorithm}" + \
            (" across nodes" if "cp" in other.step.inter_node_axes else "")
    if term == "ep comm":
        return f"ep={o.ep} all-to-alls" + \
            (" across nodes" if "ep" in other.step.inter_node_axes else "")
    if term == "dp comm":
        axis = o.data_axis if o.zero_stage == 0 else o.shard_axis
        return f"zero_stage {o.zero_stage} over {axis}={o.axis_size(axis)}" + \
               (" across nodes" if axis in other.step.inter_node_axes else "")
    return ""


def to_json_rows(cands: list[Candidate]) -> list[dict]:
    """The ``--json`` records, keys exactly ``JSON_KEYS``."""
    rows = []
    for c in cands:
        lay, s = c.layout, c.step
        rows.append({"tp": lay.tp, "pp": lay.pp, "dp_replicate": lay.dp_replicate,
                     "dp_shard": lay.dp_shard, "ep": lay.ep, "cp": lay.cp,
                     "cp_algorithm": lay.cp_algorithm,
                     "zero_stage": lay.zero_stage, "vpp": lay.vpp,
                     "schedule": lay.pipeline_schedule if lay.pp > 1 else "",
                     "pipeline_inflight": lay.pipeline_inflight,
                     "pipeline_split": lay.pipeline_split,
                     "stage_layers": list(c.stage_layers),
                     "microbatch_size": lay.microbatch_size, "recompute": lay.recompute_label,
                     "offload_optimizer": lay.offload_optimizer,
                     "memory_bytes_per_gpu": c.memory.total,
                     "host_memory_bytes_per_gpu": c.memory.host_total,
                     "step_time_s": s.step_time_s,
                     "tokens_per_second_per_gpu": s.tokens_per_second_per_gpu,
                     "tflops_per_gpu": s.tflops_per_gpu, "mfu": s.mfu,
                     "bubble_fraction": s.bubble_fraction, "warnings": list(c.warnings)})
    return rows


def schedule_name(lay) -> str:
    """The pipeline schedule of ``lay``, with its in-flight bound when it has one."""
    bound = f" (at most {lay.pipeline_inflight} chunk activations in flight)" \
        if lay.pipeline_inflight else ""
    return lay.pipeline_schedule + bound


CP_TAGS = {"ring": "r", "allgather": "ag", "ulysses": "u"}  # the table's cp column
# the table's "GB sent per step" columns, in order (the header names them from this list)
SENT_AXES = ("tp", "cp", "pp", "ep", "dp_s", "dp_r")
SENT_AXES_DENSE = tuple(a for a in SENT_AXES if a != "ep")


def sent_per_axis(b: dict[str, float]) -> dict[str, float]:
    """Bytes per step of the table's columns (``SENT_AXES``) from the step's per-axis bytes:
    ``dp_s`` is every data-parallel group's but the replicas' (dp_shard, merged with cp, the
    experts' data axes), ``dp_r`` the replicas' (HSDP); ``ep`` the hierarchical dispatch's
    two levels too."""
    data = b["dp"] + b["dp_shard"] + b["dp_cp"] + b["dp_shard_cp"] + b["edp"] + b["edp_shard"]
    ep = b["ep"] + b.get("ep_inter", 0) + b.get("ep_intra", 0)
    return {"tp": b["tp"], "cp": b["cp"] + b.get("cp_inner", 0) + b.get("cp_outer", 0),
            "pp": b["pp"], "ep": ep, "dp_s": data, "dp_r": b["dp_replicate"]}


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def format_table(cands: list[Candidate], explain_all: bool = False,
                 moe: bool | None = None, interval=None) -> str:
    """The text table of ``cands`` (best first), with warnings and explanations under rows;
    ``moe`` adds the ep column and bytes (None: when some layout has ep > 1); ``interval``
    (a candidate -> ``IntervalChoice``) adds each one's checkpoint interval when explaining."""
    if moe is None:
        moe = any(c.layout.ep > 1 for c in cands)
    head = (f"{'#':>2} {'tp':>3} {'cp':>6} {'pp':>3} {'vpp':>3} {'dp_r':>4} {'dp_s':>4} "
            + (f"{'ep':>3} " if moe else "")
            + f"{'zero':>4} {'mbs':>3} {'recomp':<9} {'mem GB (states+act+other)':<26} "
            f"{'step s':>8} {'tok/s/GPU':>9} {'TF/s':>6} {'MFU':>5} {'bubble':>6}  "
            + "GB sent per step: " + "/".join(SENT_AXES if moe else SENT_AXES_DENSE)
            + (" (ep: uniform routing)" if moe else ""))
    lines = [head]
    for i, c in enumerate(cands, 1):
        lay, s, m = c.layout, c.step, c.memory
        states, act, other = peak_parts(m)
        mem = f"{_gb(m.total)} ({_gb(states)}+{_gb(act)}+{_gb(other)})"
        sent = sent_per_axis(s.comm_bytes)
        comm = "/".join(_gb(sent[a]) for a in (SENT_AXES if moe else SENT_AXES_DENSE))
        cp = f"{lay.cp}{CP_TAGS[lay.cp_algorithm]}" if lay.cp > 1 else "1"
        lines.append(
            f"{i:>2} {lay.tp:>3} {cp:>6} {lay.pp:>3} {lay.vpp:>3} {lay.dp_replicate:>4} "
            f"{lay.dp_shard:>4} " + (f"{lay.ep:>3} " if moe else "")
            + f"{str(lay.zero_stage) + ('o' if lay.offload_optimizer else ''):>4} "
            f"{lay.microbatch_size:>3} "
            f"{lay.recompute_label:<9} {mem:<26} {s.step_time_s:>8.3f} "
            f"{s.tokens_per_second_per_gpu:>9.0f} {s.tflops_per_gpu:>6.0f} {s.mfu:>5.1%} "
            f"{s.bubble_fraction:>6.1%}  {comm}")
        if s.axis_levels:
            lines.append(f"{'':>6}on: " + ", ".join(f"{a} {lvl}" for a, lvl in s.axis_levels))
        if lay.pp > 1:
            # the runtime's value: "flops" balances at data.seq_len, the length planned for
            lines.append(f"{'':>6}schedule {schedule_name(lay)}, parallel.pipeline_split "
                         f"{lay.pipeline_split.split(':')[0]}: blocks per stage "
                         + ",".join(map(str, c.stage_layers)))
        for w in c.warnings:
            lines.append(f"{'':>6}! {w}")
        if explain_all:
            lines.append(f"{'':>6}{exposed_breakdown(c)}")
            lines.extend(f"{'':>8}{x}" for x in overlap_lines(c))
            if interval is not None:
                lines.append(f"{'':>6}{interval(c).line()}")
        if explain_all and i > 1:
            lines.append(f"{'':>6}why not best: {explain(cands[0], c)}")
    return "\n".join(lines)


def summary_lines(result: PlanResult) -> str:
    """What the search left out, one line per reason: layouts that do not fit (the smallest
    of them) and those skipped."""
    lines = []
    if result.too_big:
        lay, total, why = min(result.too_big, key=lambda r: r[1])
        lines.append(f"{len(result.too_big)} layouts do not fit in memory; the smallest "
                     f"(tp={lay.tp} cp={lay.cp} pp={lay.pp} ep={lay.ep} zero={lay.zero_stage} "
                     f"mbs={lay.microbatch_size} recompute={lay.recompute_label}) {why}")
    for reason, n in sorted(result.invalid.items(), key=lambda kv: -kv[1])[:6]:
        lines.append(f"{n} skipped: {reason}")
    return "\n".join(lines)


def moe_notes(cfg: ModelConfig, top: list[Candidate], work: Workload) -> list[str]:
    """What a user of a mixture of experts should know about the planned figures."""
    if not cfg.num_local_experts:
        return []
    notes = ["mixture of experts: ep all-to-all bytes and time are the uniform-routing "
             "expectation (each rank sends (ep-1)/ep of its N·k token-expert rows each way); "
             "real routing is uneven; tp runs without sequence parallelism (the MoE is whole "
             "on every tp rank)"]
    if any(c.layout.ep_dispatch == "hierarchical" and c.layout.ep_inter > 1 for c in top):
        notes.append("hierarchical ep dispatch: ep_inter (the network) carries each token "
                     "once per destination node, the expected distinct nodes under uniform "
                     "routing among the chosen groups (at most topk_group); ep_intra (NVLink) "
                     "fans out inside the node")
    notes += [n for n in (fp8_expert_note(cfg, work),) if n]
    if any(c.layout.pp > 1 for c in top) and cfg.router_aux_loss_coef > 0 \
            and not cfg.router_aux_loss_per_layer:
        notes.append("pp > 1 with a mixture of experts: set model.router_aux_loss_per_layer "
                     "true (the runtime needs the load-balancing loss per layer)")
    return notes
