"""Every collective one rank issues in a step, as the runtime issues it (``collectives``): its
axis, operation, message size and count per microbatch or per step. The bytes per mesh axis
(``comm_bytes_per_step``, which the runtime's counted communication layer must equal), the
K/V traffic of context parallelism and the optimiser-offload traffic (which link an axis
crosses is ``threefold.accounting.links``'s).

Bytes are those one rank *sends*, counted exactly as ``threefold.comm.counted.Comm`` counts them
(ring algorithms): all-reduce 2·(numel − own chunk), reduce-scatter and all-gather (n−1)·numel/n
elements, point-to-point all of it; for global rank 0.

What each axis carries (``collectives``; x = b·s·h elements of one microbatch's activation,
L = layers on the stage):

tp (``threefold.parallel.transforms.tensor``; Megatron §3, Korthikanti et al. §4.2.2), per
microbatch: without SP each layer all-reduces its two sub-layer outputs forward (matmul dtype) and
its two sub-layer input gradients backward (residual dtype): 8·x·(t-1)/t elements per layer.
With SP each "all-reduce" becomes an all-gather plus a reduce-scatter — the same bytes;
the q/k/v and gate/up linears keep the gathered input for backward, so there is no
re-gather — plus an all-reduce of each RMSNorm weight gradient (h elements, 2 per layer
and the final norm) in every backward. The vocab-parallel embedding all-reduces (SP:
reduce-scatters, all-gathers back) x forward; the LM head input's gather costs x backward
(SP: forward and backward); the vocab-parallel loss all-reduces 3 vectors of b·s fp32.
Replicated k/v projections (kv heads < tp) all-reduce their whole weight gradient over tp
in every backward. Full recompute (torch's non-reentrant checkpoint) re-runs each block's
forward but stops as soon as the last tensor saved for backward is rebuilt
(``torch.utils.checkpoint.set_checkpoint_early_stop``, on by default), so the attention's
closing collective is repeated and the MLP's is not: +1 all-reduce per layer, or under SP
+2 all-gathers and +1 reduce-scatter. The gradient-norm all-reduces one fp32 scalar over tp.
With ``parallel.tp_overlap`` each sub-layer's gathers and scatters (not the embedding's, the
head's or a recompute's) are issued in chunks with the same bytes in all; they are tagged
"tp-chunks" for the planner's overlap model (``threefold.plan.step``).
pp: b·s·h (/t under SP) to the next stage and back per microbatch per chunk boundary, in
the residual dtype; the gradient norm all-reduces 2 fp32 scalars over the stages (these
pipeline figures are the planner's: not yet checked against the pipeline executor).
dp (``threefold.parallel.engines.data_parallel`` / ``zero``; ZeRO arXiv 1910.02054 §7): stage 0
all-reduces the gradient buckets over the flattened "dp" group once per step (no sync while
accumulating), overlapped with the last backward; ZeRO works per unit (embedding, each
block, final norm, head; each padded to a multiple of dp_shard): stages 1 and 2
reduce-scatter every unit once per step (stage 2 from backward hooks) and all-gather it
after the optimiser step; stage 3 all-gathers each unit before its forward and again before
its backward (not the embedding, whose backward reads only the token ids) and
reduce-scatters it, every microbatch (a tied root unit stays gathered from the first
forward to the end of the step: one gather per step). Then, with
dp_replicate > 1, every unit's gradient shard is all-reduced over dp_replicate, and the
gradient norm all-reduces 2 fp32 scalars over dp_shard. Weights and gradients move in
``work.weight_bytes`` unless ``grad_bytes``/``param_bytes`` say otherwise.
Mixture of experts (``threefold.model.moe``, ``threefold.parallel.transforms.expert``): the MoE is
whole on every tp rank, so only the attention has tp collectives (one all-reduce per layer each
way, and the recomputed attention's). With ep > 1, per MoE layer and microbatch, on "ep"
(all-to-alls, on the critical path): the count exchange, E int64 split evenly over the ep
ranks; dispatch, the rank's N·k (token, expert) rows (N = b·s tokens) of h elements in the
residual dtype (the MLP's input) to the experts' ranks, and combine, the rows back in the
matmul dtype (the experts' output); backward, their gradients, the same sizes. Bytes sent
are the uniform-routing expectation, (ep−1)/ep of the rows leaving the rank each way:
4·N·k·(ep−1)/ep·h elements + E·8·(ep−1)/ep bytes per layer, or under full recompute (the
forward's three all-to-alls again) 6·N·k·(ep−1)/ep·h + 2·E·8·(ep−1)/ep (selective recompute
keeps what they returned and runs none again: the bytes of no recompute); real routing
varies around it. The hierarchical dispatch (``parallel.ep_dispatch``) moves them on
"ep_inter" and "ep_intra" instead (``threefold.accounting.ep_levels``). The expert tensors'
gradients: ZeRO-0 all-reduces them over "edp" (dp/ep) in buckets of their own (the dense
ones over "dp" as always) and the gradient norm all-reduces one fp32 over "ep"; ZeRO 1-3
makes each block's experts a unit of its own over "edp_shard" (dp_shard/ep), padded to a
multiple of it, with the dense units' collectives (stage 3 under full recompute gathers it
a third time: the recomputed forward runs before the unit's backward hook) and, with dp_replicate > 1, its shard gradient
all-reduced over dp_replicate.
cp (``threefold.parallel.transforms.context``), per microbatch and layer: the attention's K/V moves,
``cp_bytes_per_attention`` (``threefold.accounting.context_traffic``) of this rank's K and V
(2·b·kv heads per tp rank·s/cp·head_dim in the matmul dtype), its forward twice under
recompute. Ring: point-to-point hops of the
K/V block, posted before the block in hand is computed (each hides behind one block's
attention), and in backward the dK/dV accumulator's hops, which wait right after their
block (exposed). Allgather: an all-gather forward and a reduce-scatter backward, exposed.
Ulysses (``threefold.parallel.transforms.ulysses``): one all-to-all of q, K and V (K/V heads
repeated up to the Ulysses degree when fewer) and one of the output, forward (again under
recompute) and backward, exposed. A hybrid runs Ulysses on "cp_inner" and the ring or
all-gather on "cp_outer" (``cp_attention_widths`` gives the sizes).
With cp > 1, s above is seq_len/cp, the data-parallel all-reduce runs over "dp_cp" (dp·cp
ranks) and ZeRO over "dp_shard_cp" (dp_shard·cp ranks, units padded to a multiple of it).
A mixture of experts under cp pools each chunk's router statistics over cp (one fp32
all-reduce of (2E + 1) per MoE block forward, its gradient's backward:
``threefold.model.moe.pooled``), and its experts' data ranks span cp too ("edp", "edp_shard").
"""

from __future__ import annotations

import functools
from collections import Counter

from threefold.accounting.collective import Collective
from threefold.accounting.context_traffic import cp_collectives
from threefold.accounting.ep_levels import ep_level_collectives
from threefold.accounting.fp8 import fp8_amaxes, fp8_block_unit, fp8_gathered_numels
from threefold.layout import Layout, Workload, check_layout
from threefold.accounting.batches import local_seq_len, microbatches, tp_chunks
from threefold.accounting.lora_counts import lora_collectives, tp_reduced_numel
from threefold.accounting.counts import (latent_replicated_numels, norms_per_block,
                                         tp_shard)
from threefold.accounting.stages import (
    cut_buckets,
    distinct_stages,
    gradient_buckets,
    owned_parameters,
    rank_dense_layers,
    rank_layers,
    rank_moe_chunks,
    stage_expert_units,
    stage_units,
)
from threefold.layout.axes import COMM_AXES
from threefold.config import ModelConfig
from threefold.schedules.actions import rank_stage, stage_rank


# --------------------------------------------------------------------------------------------
# Collectives per step
# --------------------------------------------------------------------------------------------
def collectives(cfg: ModelConfig, layout: Layout, work: Workload, stage: int,
                grad_bytes: int | None = None, param_bytes: int | None = None
                ) -> list[Collective]:
    """Every collective one rank of ``stage`` issues in a step, as threefold's runtime issues
    them: tp, pp, cp and ep per microbatch, then the gradients' (plain data parallelism, or
    ZeRO's units). Weights and gradients move in ``work.weight_bytes`` unless
    ``grad_bytes``/``param_bytes`` say otherwise. The module docstring says what each axis
    carries."""
    g = (work.grad_reduce_bytes if layout.zero_stage else work.weight_bytes) \
        if grad_bytes is None else grad_bytes
    pb = work.weight_bytes if param_bytes is None else param_bytes
    tokens = layout.microbatch_size * local_seq_len(layout, work)  # b·s of one microbatch
    layers = rank_layers(cfg, layout, stage)
    out: list[Collective] = []
    add = functools.partial(_add, out)
    _tp_collectives(add, cfg, layout, work, stage, layers, tokens, g)
    if layout.pp > 1:
        _pp_collectives(add, cfg, layout, stage, tokens * cfg.hidden_size, work.resid_bytes, g,
                        frozen_embedding=bool(work.lora_r))
    if layout.cp > 1:
        cp_collectives(add, cfg, layout, tokens, work.act_bytes, layers)
        for moe in rank_moe_chunks(cfg, layout, stage):  # router statistics pooled over cp
            add("cp", "all_reduce", moe * (2 * cfg.num_local_experts + 1), 4, 2, layout.cp,
                True, "none")
    if cfg.num_local_experts and layout.ep > 1:
        mtp = cfg.num_nextn_predict_layers if stage == layout.last_stage else 0  # routed too
        _ep_collectives(add, cfg, layout, work, tokens,
                        layers - rank_dense_layers(cfg, layout, stage) + mtp)
    if work.lora_r:  # only the adapters' gradients move (no mixture of experts under LoRA)
        lora_collectives(add, cfg, layout, work, stage, g, pb, _zero_unit)
        return out
    experts = stage_expert_units(cfg, layout, stage)
    if layout.zero_stage == 0:
        _data_parallel(add, cfg, layout, stage, experts, g)
    else:
        _zero(add, cfg, layout, stage, experts, g, pb, work)
    return out


def _add(out: list[Collective], axis: str, op: str, numel: float, elem: int, count: int,
         group: int, per_mb: bool, overlap: str) -> None:
    """Record a collective in ``out`` unless it is a no-op (group of one or no calls)."""
    if group > 1 and count > 0:
        out.append(Collective(axis, op, int(numel), int(elem), int(count), group, per_mb,
                              overlap))


def _tp_collectives(add, cfg: ModelConfig, layout: Layout, work: Workload, stage: int,
                    layers: int, tokens: int, g: int) -> None:
    """tp, per microbatch: the sub-layers' all-reduces (under SP gathers and scatters), the
    embedding's, the head's and the loss's, replicated k/v gradients; the gradient norm."""
    t, h, d, r = layout.tp, cfg.hidden_size, work.act_bytes, work.resid_bytes
    x = tokens * h
    first, last = int(stage == 0), int(stage == layout.last_stage)
    # the last stage's multi-token-prediction modules: a block each (routed in a mixture),
    # and one more call each of the embedding and the head (with its loss)
    mtp = cfg.num_nextn_predict_layers * last
    dense = rank_dense_layers(cfg, layout, stage) if cfg.num_local_experts else layers + mtp
    layers += mtp
    rec = layers if layout.recompute != "none" else 0  # selective re-runs them too
    # sub-layers with tp collectives: attention and a dense MLP (a mixture of experts is
    # whole on every tp rank; DeepSeek's dense first blocks are dense)
    subs_layers = layers + dense
    # LoRA: the frozen embedding's output needs no gradient, so neither does the first
    # block's attention input: the backward collectives of both never run
    skip = first if work.lora_r else 0
    first, last = first + mtp, last + mtp
    if layout.sp:
        # per layer 2 each: the sub-layers' input gathers forward and their gradients'
        # scatters backward, their output scatters forward and the gradients' gathers back
        # (overlapped: the sub-layers' 2 per layer apart, tagged "tp-chunks")
        sub = 2 * layers if tp_chunks(layout, work) > 1 else 0
        add("tp", "all_gather", x, r, sub, t, True, "tp-chunks")
        add("tp", "all_gather", x, r, 2 * layers - sub + 2 * rec + first + last - skip, t,
            True, "none")
        add("tp", "reduce_scatter", x, r, sub, t, True, "tp-chunks")
        add("tp", "reduce_scatter", x, r, 2 * layers - sub + first + last - skip, t, True,
            "none")
        add("tp", "reduce_scatter", x, d, sub, t, True, "tp-chunks")
        add("tp", "reduce_scatter", x, d, 2 * layers - sub + rec, t, True, "none")
        add("tp", "all_gather", x, d, sub, t, True, "tp-chunks")
        add("tp", "all_gather", x, d, 2 * layers - sub, t, True, "none")
        if not work.lora_r:  # frozen norms have no gradient (a module's: 3 more, eh_proj)
            add("tp", "all_reduce", h, g, norms_per_block(cfg) * layers + last + 2 * mtp, t,
                True, "none")
            add("tp", "all_reduce", 2 * h * h, g, mtp, t, True, "none")
    else:
        add("tp", "all_reduce", x, r, subs_layers + first + last - skip, t, True, "none")
        add("tp", "all_reduce", x, d, subs_layers + rec, t, True, "none")
    add("tp", "all_reduce", tokens, 4, 3 * last, t, True, "none")
    _attention_norms(add, cfg, work, layers, tokens, rec, t, g)
    if work.fp8 != "none":
        fp8_amaxes(add, cfg, layout, work.fp8, (layers, dense), tokens, rec)
    if work.lora_r:  # each adapted layer's whole factor, its gradient summed over tp
        add("tp", "all_reduce", tp_reduced_numel(cfg, work), work.weight_bytes, layers, t,
            True, "none")
    elif tp_shard(cfg, t).kv_replicas > 1:
        add("tp", "all_reduce", cfg.num_key_value_heads * cfg.head_dim * h, g, 2 * layers, t,
            True, "none")
    add("tp", "all_reduce", 1, 4, 1, t, False, "step")  # gradient norm


def _attention_norms(add, cfg: ModelConfig, work: Workload, layers: int, tokens: int,
                     rec: int, t: int, g: int) -> None:
    """tp: what attention's own weights add. Latent attention's latents are whole on every
    rank (each rank's heads use them): their projections' and norms' gradients are summed
    over tp; so are per-head q/k norms' (Qwen3, Gemma 3: each rank sees its heads). OLMo 2's
    q/k norms sum each token's squares over the whole projection, forward (again when
    recomputed) and backward. Frozen (LoRA) weights have no gradients to sum."""
    if cfg.kv_lora_rank and not work.lora_r:
        for numel in latent_replicated_numels(cfg):
            add("tp", "all_reduce", numel, g, layers, t, True, "none")
    if cfg.qk_norm and cfg.qk_norm_over == "head" and not work.lora_r:
        add("tp", "all_reduce", cfg.head_dim, g, 2 * layers, t, True, "none")
    if cfg.qk_norm and cfg.qk_norm_over == "projection":
        add("tp", "all_reduce", tokens, 4, 4 * layers + 2 * rec, t, True, "none")


def _pp_collectives(add, cfg: ModelConfig, layout: Layout, stage: int, x: int, r: int,
                    g: int, frozen_embedding: bool = False) -> None:
    """pp: the activation (x elements, /t under SP) out of each chunk boundary and its
    gradient back, per microbatch; a copied embedding's gradient between the two ends; the
    gradient norm over the stages."""
    p = layout.pp
    sends = _p2p_sends_per_microbatch(p, layout.vpp, stage, layout.vshape)
    add("pp", "p2p", x // layout.tp if layout.sp else x, r, sends, p, True, _paired(layout))
    copied = cfg.tie_word_embeddings or cfg.num_nextn_predict_layers
    if copied and stage in (0, p - 1) and not layout.vshape and not frozen_embedding:
        # the embedding and the last stage's copy of it (a tied head, or the one the
        # multi-token-prediction modules embed with): their gradients (this rank's ZeRO
        # shard of them) summed between the two ends (runtime axis "pp_ends")
        tied = tp_shard(cfg, layout.tp).vocab * cfg.hidden_size
        if layout.zero_stage:
            tied = -(-tied // layout.shard_size)
        add("pp", "all_reduce", tied, g, 1, 2, False, "step")
    add("pp", "all_reduce", 2, 4, 1, p, False, "step")  # gradient norm over stages


def _ep_collectives(add, cfg: ModelConfig, layout: Layout, work: Workload, tokens: int,
                    layers: int) -> None:
    """ep, per MoE layer and microbatch of ``tokens``: the count exchange, then dispatch and
    combine of the N·k (token, expert) rows, forward (again under full recompute; selective
    keeps what they returned) and backward; the hierarchical dispatch's per level
    (``ep_levels``)."""
    ep, forwards, tag = layout.ep, 2 if layout.recompute == "full" else 1, _paired(layout)
    if layout.ep_dispatch == "hierarchical":
        ep_level_collectives(add, cfg, layout, work, tokens, layers, forwards, tag)
        return
    experts, rows = cfg.num_local_experts, tokens * cfg.num_experts_per_tok * cfg.hidden_size
    add("ep", "all_to_all", experts, 8, layers * forwards, ep, True, tag)  # counts
    add("ep", "all_to_all", rows, work.resid_bytes, layers * (forwards + 1), ep, True, tag)
    add("ep", "all_to_all", rows, work.act_bytes, layers * (forwards + 1), ep, True, tag)


def _paired(layout: Layout) -> str:
    """The overlap tag of pipeline sends and expert all-to-alls: "paired" under DualPipeV,
    whose forward of one microbatch runs beside another's backward so that each hides the
    other's communication (DeepSeek-V3, arXiv 2412.19437 §3.2.1: "both all-to-all and PP
    communication can be fully hidden"), else "none" (on the critical path)."""
    return "paired" if layout.pp > 1 and layout.pipeline_schedule == "dualpipe-v" else "none"


def _data_parallel(add, cfg: ModelConfig, layout: Layout, stage: int,
                   experts: list, g: int) -> None:
    """ZeRO-0: the gradient buckets all-reduced over dp (dp·cp), the experts' over edp, and
    the experts' share of the gradient norm over ep."""
    for numel, count in Counter(gradient_buckets(cfg, layout, g, stage)).items():
        add(layout.data_axis, "all_reduce", numel, g, count,
            layout.shard_size * layout.dp_replicate, False, "last")
    flat = tuple(n for unit in experts for n in unit)
    for numel, count in Counter(cut_buckets(flat, g, layout.bucket_bytes)).items():
        add("edp", "all_reduce", numel, g, count, layout.edp, False, "last")
    if experts:
        add("ep", "all_reduce", 1, 4, 1, layout.ep, False, "step")  # experts' share of the norm


def _zero(add, cfg: ModelConfig, layout: Layout, stage: int, experts: list, g: int,
          pb: int, work: Workload) -> None:
    """ZeRO 1-3: every unit's collectives over the shard axis (``_zero_unit``; a block's
    under ``parallel.fp8_all_gather``: ``fp8_block_unit``), the experts' over edp_shard,
    and the gradient norm."""
    ns, nr, z = layout.shard_size, layout.dp_replicate, layout.zero_stage
    units = list(stage_units(cfg, layout, stage))
    # a tied root unit (``ZeroEngine``'s last) stays gathered from the step's first forward
    # to its end under stage 3: one gather per step instead of two per microbatch
    root = units.pop() if cfg.tie_word_embeddings and layout.pp == 1 else None
    # the embedding's backward reads token ids, not its weight: stage 3 gathers it for the
    # forward only (``ZeroEngine``)
    embedding = units.pop(0) if stage == 0 and root is None else None
    # multi-token prediction: the D modules embed again (with the embedding, or a pipeline's
    # last-stage copy of it) and call the head again, each call gathering under stage 3
    d = cfg.num_nextn_predict_layers
    last = stage == (0 if layout.vshape else layout.pp - 1)
    head = units.pop() if d and last and root is None else None
    copy = units.pop(-2) if head is not None and layout.pp > 1 else None
    ax = layout.shard_axis
    fp8 = fp8_gathered_numels(cfg) if work.fp8_gathers(layout) else ()
    if fp8:
        n = rank_layers(cfg, layout, stage)
        blocks, units = units[:n], units[n:]
        for unit, count in Counter(blocks).items():
            fp8_block_unit(add, ax, unit, count, fp8, ns, nr, g, pb)
    for unit, count in Counter(-(-sum(u) // ns) * ns for u in units).items():
        _zero_unit(add, ax, z, unit, count, ns, nr, g, pb, per_step_gathers=False)
    if embedding is not None:
        _zero_unit(add, ax, z, -(-sum(embedding) // ns) * ns, 1, ns, nr, g, pb,
                   per_step_gathers=False, backward_gathers=0,
                   forward_gathers=1 + (d if layout.pp == 1 else 0))
    for unit, calls, back in ((head, 1 + d, 1), (copy, d, 0)):
        if unit is not None:
            _zero_unit(add, ax, z, -(-sum(unit) // ns) * ns, 1, ns, nr, g, pb,
                       per_step_gathers=False, backward_gathers=back, forward_gathers=calls)
    if root is not None:
        _zero_unit(add, ax, z, -(-sum(root) // ns) * ns, 1, ns, nr, g, pb,
                   per_step_gathers=True)
    ne = layout.edp_shard
    for unit, count in Counter(-(-sum(u) // ne) * ne for u in experts).items():
        _zero_unit(add, "edp_shard", z, unit, count, ne, nr, g, pb, per_step_gathers=False,
                   extra_gathers=int(layout.recompute == "full"))
    add(ax, "all_reduce", 2, 4, 1, ns, False, "step")  # gradient norm



def _zero_unit(add, axis: str, z: int, padded: int, count: int, ns: int, nr: int, g: int,
               pb: int, per_step_gathers: bool, extra_gathers: int = 0,
               backward_gathers: int = 1, forward_gathers: int = 1) -> None:
    """The collectives of ``count`` ZeRO units of ``padded`` elements over ``axis`` (see
    ``collectives``); ``extra_gathers`` more stage-3 gathers per microbatch (an expert unit's
    in a recomputed forward); ``backward_gathers`` 0 for a unit whose backward does not read
    its weights (the embedding); ``forward_gathers`` the calls of its module per forward
    (the head's and the embedding's 1 + D under multi-token prediction)."""
    if z in (1, 2):
        add(axis, "reduce_scatter", padded, g, count, ns, False,
            "step" if z == 1 else "last")
        add(axis, "all_gather", padded, pb, count, ns, False, "step")
    elif per_step_gathers:
        add(axis, "reduce_scatter", padded, g, count, ns, True, "backward")
        add(axis, "all_gather", padded, pb, count, ns, False, "step")
    else:
        add(axis, "reduce_scatter", padded, g, count, ns, True, "backward")
        add(axis, "all_gather", padded, pb, count * forward_gathers, ns, True, "forward")
        add(axis, "all_gather", padded, pb, count * (backward_gathers + extra_gathers), ns,
            True, "backward")
    add("dp_replicate", "all_reduce", padded // ns, g, count, nr, False, "step")


def _p2p_sends_per_microbatch(p: int, v: int, rank: int, vshape: bool = False) -> int:
    """Point-to-point sends per microbatch on ``rank``: forward out of every chunk but the
    model's last, backward out of every chunk but the model's first, unless the neighbouring
    stage is on this rank (the bottom of a V hands over in memory)."""
    n = p * v
    chunks = [rank_stage(rank, c, p, vshape) for c in range(v)]
    return sum(s < n - 1 and stage_rank(s + 1, p, vshape) != rank for s in chunks) \
        + sum(s > 0 and stage_rank(s - 1, p, vshape) != rank for s in chunks)


def comm_bytes_per_step(cfg: ModelConfig, layout: Layout, work: Workload,
                        stage: int | None = None, grad_bytes: int | None = None,
                        param_bytes: int | None = None) -> dict[str, int]:
    """Bytes global rank 0 (of pipeline stage ``stage``; when None, the largest over stages
    per axis) sends per step on each axis (keys ``COMM_AXES``): with ``Workload.from_config``
    exactly what threefold's runtime reports as ``comm_bytes_per_step`` in summary.json
    (tests/test_dryrun.py checks it for DP, ZeRO 1/2/3 and TP). Gradients and gathered
    parameters move in ``work.weight_bytes`` unless ``grad_bytes``/``param_bytes`` say
    otherwise. See ``collectives`` for what each axis carries. A layout the rule book refuses
    raises its LayoutError."""
    check_layout(cfg, layout, work)
    stages = distinct_stages(cfg, layout) if stage is None else [stage]
    lists = [collectives(cfg, layout, work, st, grad_bytes, param_bytes) for st in stages]
    return bytes_per_axis(lists, microbatches(layout, work))


def bytes_per_axis(lists: list[list[Collective]], m: int) -> dict[str, int]:
    """Per axis, the largest over the given stages' collective lists of bytes sent per step."""
    out = {axis: 0 for axis in COMM_AXES}
    for colls in lists:
        per = {axis: 0 for axis in COMM_AXES}
        for c in colls:
            per[c.axis] += c.bytes_sent() * c.count * (m if c.per_microbatch else 1)
        for axis in COMM_AXES:
            out[axis] = max(out[axis], per[axis])
    return out


def offload_bytes_per_step(cfg: ModelConfig, layout: Layout, work: Workload) -> dict[str, int]:
    """Bytes one rank of the busiest stage moves between device and host per step under
    optimiser offload (threefold.parallel.engines.offload): its owned parameters' gradients down and
    their updated values up, each ``work.weight_bytes`` per element (fp32 in threefold's
    runtime: 4 + 4 bytes per owned parameter; 2 + 2 with 16-bit weights, ZeRO-Offload's
    2Ψ + 2Ψ, Ren et al. arXiv 2101.06840). Owned = Ψ of the stage, Ψ/N under ZeRO (padded
    shards). threefold's ZeRO with 16-bit parameters (a runtime workload, ``reduce_bytes``
    set) keeps float32 shards: gradients go down as reduced, the fp32 shard comes up.
    {"down": 0, "up": 0} without offload."""
    if not layout.offload_optimizer:
        return {"down": 0, "up": 0}
    owned = max(owned_parameters(cfg, layout, st) for st in distinct_stages(cfg, layout))
    if layout.zero_stage and work.reduce_bytes:
        return {"down": owned * work.reduce_bytes, "up": owned * 4}
    return {"down": owned * work.weight_bytes, "up": owned * work.weight_bytes}
