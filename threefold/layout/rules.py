"""The rule book: every rule that refuses a layout, each one function with its one message
(the field, the value, and the fix), written once.

The launcher (before any process starts), the dry run and the trainer call them through
``threefold.layout.checks.validate_layout``; the planner through ``checks.check_layout`` (a
million layouts a search: each rule is a few comparisons, its message formatted only when it
refuses) and, for the degrees it takes from the command line, directly
(``threefold.commands.planning``); the post-training commands through ``task_layout``. A refusal is
a ``LayoutError``, a ``ConfigError``: one line, exit code 2. ``rule_of`` names the rule that
refused (the planner groups its skipped layouts by it).

Each rule takes plain numbers or the model's shape (a resolved ``ModelConfig``), never a
process group, and imports no torch.
"""

from __future__ import annotations

from typing import Callable

from threefold.config import ConfigError, ModelConfig, ParallelConfig
from threefold.schedules.registry import SCHEDULE_SPECS

RULES: dict[str, Callable] = {}


class LayoutError(ConfigError):
    """A layout the rule book refuses: one line naming the field and the fix."""


def rule(fn: Callable) -> Callable:
    """Register ``fn`` in ``RULES`` (unchanged: the planner calls rules a million times)."""
    RULES[fn.__name__] = fn
    return fn


def rule_of(error: BaseException) -> str:
    """The name of the rule that raised ``error`` (the innermost rule in its traceback), or
    its message when no rule did."""
    name, tb = str(error), error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if RULES.get(code.co_name) is not None and RULES[code.co_name].__code__ is code:
            name = code.co_name
        tb = tb.tb_next
    return name


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(values) -> str:
    return ", ".join(map(str, values))


# --------------------------------------------------------------------------------------------
# The world
# --------------------------------------------------------------------------------------------
@rule
def divides_world(name: str, value: int, world: int) -> None:
    """Each of tp, pp, dp_replicate and cp divides the world size."""
    if value < 1 or world % value:
        raise LayoutError(f"parallel.{name}: {value} does not divide world size {world}; valid "
                          f"{name} values: {_fmt(_divisors(world))}")


@rule
def fills_world(p: ParallelConfig, world: int) -> int:
    """pp·dp_replicate·dp_shard·cp·tp is the world size; returns dp_shard, -1 resolved to the
    rest of the world: world / (pp·dp_replicate·cp·tp)."""
    if world < 1:
        raise LayoutError(f"world size must be >= 1, got {world}")
    for name in ("tp", "pp", "dp_replicate", "cp"):
        divides_world(name, getattr(p, name), world)
    fixed = p.tp * p.pp * p.dp_replicate * p.cp
    named = f"pp·dp_replicate·cp·tp = {p.pp}·{p.dp_replicate}·{p.cp}·{p.tp} = {fixed}"
    if world % fixed:
        raise LayoutError(f"parallel: {named} does not divide world size {world}; lower one "
                          f"of them or launch a multiple of {fixed} ranks")
    rest = world // fixed
    if p.dp_shard not in (-1, rest):
        raise LayoutError(f"parallel.dp_shard: {named}, times dp_shard={p.dp_shard} is "
                          f"{fixed * p.dp_shard}, not world size {world}; set parallel.dp_shard "
                          f"to {rest} or -1 (the rest)")
    return rest


# --------------------------------------------------------------------------------------------
# A mixture of experts
# --------------------------------------------------------------------------------------------
@rule
def ep_needs_experts(ep: int, experts: int) -> None:
    """Expert parallelism needs a mixture of experts."""
    if ep < 1 or (ep > 1 and not experts):
        raise LayoutError(f"parallel.ep: {ep} needs a mixture of experts "
                          "(model.num_local_experts > 0, e.g. --model.preset tiny-moe); set "
                          "parallel.ep 1 for a dense model")


@rule
def ep_divides_experts(ep: int, experts: int, dp_shard: int) -> None:
    """ep divides the experts (each ep rank holds experts / ep of every MoE layer)."""
    if experts and experts % ep:
        valid = [d for d in _divisors(experts) if dp_shard % d == 0]
        raise LayoutError(f"parallel.ep: {ep} does not divide model.num_local_experts="
                          f"{experts}; use an ep in {_fmt(valid)}")


@rule
def ep_divides_dp_shard(ep: int, dp_shard: int) -> None:
    """Expert-parallel ranks are data-parallel ranks of one shard group: ep divides dp_shard."""
    if dp_shard % ep:
        raise LayoutError(f"parallel.ep: {ep} does not divide parallel.dp_shard={dp_shard} "
                          "(expert-parallel ranks are data-parallel ranks of one shard group); "
                          f"valid ep values: {_fmt(_divisors(dp_shard))}")


@rule
def experts_without_cp(experts: int, cp: int) -> None:
    """A mixture of experts routes whole sequences per rank: no context parallelism yet."""
    if experts and cp > 1:
        raise LayoutError(f"parallel.cp: {cp} with a mixture of experts (model.num_local_experts"
                          f"={experts}) is not built yet (the router and the expert all-to-alls "
                          "take whole sequences per rank); set parallel.cp 1, or "
                          "model.num_local_experts 0 for a dense model")


@rule
def experts_without_sequence_parallel(experts: int, tp: int, sequence_parallel: bool) -> None:
    """A mixture of experts is whole on every tp rank: tp without sequence parallelism."""
    if experts and tp > 1 and sequence_parallel:
        raise LayoutError(f"parallel.sequence_parallel: tp={tp} with a mixture of experts "
                          f"(model.num_local_experts={experts}) runs without sequence "
                          "parallelism; set parallel.sequence_parallel false")


@rule
def experts_balance_per_layer(m: ModelConfig, pp: int) -> None:
    """Under pp a stage cannot pool the balancing loss's f and P over the other stages."""
    if m.num_local_experts and pp > 1 and m.router_aux_loss_coef > 0 \
            and not m.router_aux_loss_per_layer:
        raise LayoutError(f"model.router_aux_loss_per_layer: parallel.pp={pp} with a mixture of "
                          "experts needs the load-balancing loss per layer (a stage cannot pool "
                          "f and P over the other stages' layers): set "
                          "model.router_aux_loss_per_layer true, or model.router_aux_loss_coef 0")


# --------------------------------------------------------------------------------------------
# The sequence and context parallelism
# --------------------------------------------------------------------------------------------
@rule
def seq_len_over_cp(seq_len: int, cp: int) -> None:
    """Each cp rank holds two balanced chunks of every sequence: seq_len divisible by 2·cp."""
    if cp > 1 and seq_len % (2 * cp):
        step = 2 * cp
        raise LayoutError(f"data.seq_len: {seq_len} is not divisible by 2·parallel.cp = {step} "
                          "(each cp rank holds two balanced chunks of every sequence); use a "
                          f"multiple of {step}, e.g. {-(-seq_len // step) * step}")


@rule
def sequence_parallel_tokens(seq_len: int, cp: int, tp: int, sequence_parallel: bool) -> None:
    """Sequence parallelism splits each cp rank's tokens over tp."""
    if sequence_parallel and tp > 1 and (seq_len // cp) % tp:
        where = f"data.seq_len / parallel.cp = {seq_len // cp}" if cp > 1 else \
            f"data.seq_len: {seq_len}"
        raise LayoutError(f"{where} is not divisible by parallel.tp={tp}, which sequence "
                          "parallelism needs; use a data.seq_len that is a multiple of "
                          f"{tp * cp * (2 if cp > 1 else 1)}")


@rule
def selective_without_cp(recompute: str, cp: int) -> None:
    """Selective recompute would keep every per-hop result of ring attention."""
    if recompute == "selective" and cp > 1:
        raise LayoutError("train.recompute: selective is not available with parallel.cp > 1 "
                          "(ring attention's per-hop results would all be kept); use full or "
                          "none")


@rule
def cp_attention(m: ModelConfig, cp: int) -> None:
    """Context parallelism's attention computes neither a sliding window, another score scale
    nor latent attention."""
    for field in ("sliding_window", "query_pre_attn_scalar", "kv_lora_rank"):
        if cp > 1 and getattr(m, field):
            raise LayoutError(f"model.{field}: {getattr(m, field)}: context parallelism "
                              f"(parallel.cp={cp}) does not compute this attention yet; set "
                              "parallel.cp 1")


# --------------------------------------------------------------------------------------------
# The model's shape over tp and pp
# --------------------------------------------------------------------------------------------
def _tp_fits(heads: int, kv: int, ffn: int) -> str:
    """Every tp this shape splits over (heads, kv heads, SwiGLU width)."""
    return _fmt(t for t in _divisors(heads) if not (kv % t and t % kv) and ffn % t == 0)


@rule
def heads_over_tp(heads: int, kv: int, ffn: int, tp: int) -> None:
    """The query heads divide by tp."""
    if heads % tp:
        raise LayoutError(f"model.num_attention_heads: {heads} is not divisible by parallel.tp="
                          f"{tp}; this model splits over a tp in {_tp_fits(heads, kv, ffn)} "
                          "(with a world size that tp divides)")


@rule
def kv_heads_over_tp(heads: int, kv: int, ffn: int, tp: int) -> None:
    """Key/value heads divide by tp (sharded) or divide tp (each on tp / kv ranks)."""
    if kv % tp and tp % kv:
        raise LayoutError(f"model.num_key_value_heads: {kv} neither divides nor is divisible by "
                          f"parallel.tp={tp}; this model splits over a tp in "
                          f"{_tp_fits(heads, kv, ffn)}")


@rule
def k_norm_needs_split_kv(m: ModelConfig, tp: int) -> None:
    """A k norm over the whole projection (OLMo 2) needs the kv heads sharded, not
    replicated."""
    kv = m.num_key_value_heads
    if kv % tp and m.qk_norm and m.qk_norm_over == "projection":
        raise LayoutError(f"model.qk_norm_over: a k norm over the whole projection needs the "
                          f"{kv} KV heads split over parallel.tp={tp}, not replicated; use a tp "
                          f"that divides {kv}")


@rule
def ffn_over_tp(m: ModelConfig, tp: int) -> None:
    """The SwiGLU widths (and the dense first blocks') divide by tp. The planner pads them
    instead, as published Megatron runs do."""
    dense = m.dense_intermediate_size if m.first_k_dense_replace else 0
    ffn = m.intermediate_size
    if dense % tp:
        raise LayoutError(f"model.dense_intermediate_size: {dense} is not divisible by "
                          f"parallel.tp={tp}")
    if ffn % tp:
        raise LayoutError(f"model.intermediate_size: {ffn} is not divisible by "
                          f"parallel.tp={tp}; this model splits over a tp in "
                          f"{_tp_fits(m.num_attention_heads, m.num_key_value_heads, ffn)}")


@rule
def layers_fill_chunks(layers: int, pp: int, vpp: int) -> None:
    """Every pipeline chunk (pp·vpp of them) gets at least one layer."""
    if layers < pp * vpp:
        raise LayoutError(f"model.num_hidden_layers: {layers} layers cannot fill pp·vpp = "
                          f"{pp}·{vpp} = {pp * vpp} pipeline chunks; lower parallel.pp or "
                          "parallel.vpp")


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------
@rule
def vpp_needs_pp(pp: int, vpp: int) -> None:
    """Model chunks per stage need pipeline stages."""
    if pp == 1 and vpp > 1:
        raise LayoutError(f"parallel.vpp: {vpp} model chunks per stage need pipeline stages; "
                          "set parallel.pp > 1 or parallel.vpp 1")


@rule
def block_counts_need_pp(pp: int, split: str) -> None:
    """Block counts per stage (parallel.pipeline_split 7,9,9,7) need pipeline stages."""
    if pp == 1 and split not in ("params", "flops", "uniform") and not split.startswith("flops:"):
        raise LayoutError(f"parallel.pipeline_split: block counts '{split}' need pipeline "
                          "stages; set parallel.pp > 1 or leave pipeline_split params")


@rule
def schedule_chunks(schedule: str, pp: int, vpp: int) -> None:
    """A V schedule runs two chunks per rank, interleaved 1F1B any number, the others one."""
    spec = SCHEDULE_SPECS[schedule]
    if pp > 1 and spec.vshape and vpp != 2:
        raise LayoutError(f"parallel.schedule: {schedule} runs two model chunks per rank in a V: "
                          f"set parallel.vpp 2 (got vpp={vpp})")
    if pp > 1 and vpp > 1 and not (spec.chunked or spec.vshape):
        raise LayoutError(f"parallel.schedule: {schedule} runs one model chunk per rank: set "
                          f"parallel.vpp 1, or parallel.schedule interleaved-1f1b for vpp={vpp}")


@rule
def interleaved_microbatches(schedule: str, pp: int, microbatches: int) -> None:
    """Interleaved 1F1B takes its microbatches in rounds of pp."""
    if pp > 1 and SCHEDULE_SPECS[schedule].chunked and microbatches % pp:
        raise LayoutError(f"parallel.schedule: {schedule} needs microbatches a multiple of "
                          f"parallel.pp={pp} (got {microbatches}: global batch / (dp · micro "
                          "batch)); change train.global_batch_size or train.micro_batch_size, "
                          "or use schedule 1f1b")


@rule
def pipeline_inflight(schedule: str, pp: int, vpp: int, inflight: int) -> None:
    """The bound on chunk activations in flight is interleaved 1F1B's, and lets the first
    backward start."""
    if pp == 1 or not inflight:
        return
    if not SCHEDULE_SPECS[schedule].chunked:
        raise LayoutError(f"parallel.pipeline_inflight: {inflight} bounds interleaved-1f1b "
                          f"only, not {schedule}; set it to 0")
    low = (vpp - 1) * pp + 1
    if inflight < low:
        raise LayoutError(f"parallel.pipeline_inflight: {inflight} is below (vpp-1)·pp + 1 = "
                          f"{low}: the first backward could never start; raise it, or 0 for "
                          "Megatron's warm-up")


# --------------------------------------------------------------------------------------------
# The batch and the numerics
# --------------------------------------------------------------------------------------------
@rule
def batch_over_dp(global_batch: int, dp: int) -> None:
    """The global batch splits evenly over the data-parallel ranks."""
    if global_batch % dp or not global_batch:
        raise LayoutError(f"train.global_batch_size: {global_batch} does not split over {dp} "
                          f"data-parallel ranks; use a multiple of {dp}")


@rule
def micro_batch_divides(global_batch: int, dp: int, micro: int) -> None:
    """Each rank's share of the batch splits into micro-batches (a micro-batch larger than
    the share is the share)."""
    local = global_batch // dp
    if local % min(micro, local):
        raise LayoutError(f"train.micro_batch_size: {micro} does not divide the {local} "
                          f"sequences each rank gets; use a divisor of {local}")


@rule
def microbatches_agree(asked: int, micro: int, local: int) -> None:
    """``parallel.microbatches``, when set, is what the batch makes: local / micro."""
    made = local // min(micro, local)
    if asked and asked != made:
        raise LayoutError(f"parallel.microbatches: {asked}, but train.micro_batch_size={micro} "
                          f"makes {made} per step; set train.micro_batch_size to "
                          f"{max(1, local // asked)} or parallel.microbatches 0")


@rule
def bf16_params_need_zero(dtype: str, zero_stage: int, data_ranks: int) -> None:
    """16-bit parameters under data parallelism are what ZeRO gathers: they need ZeRO."""
    if dtype == "bfloat16" and zero_stage == 0 and data_ranks > 1:
        raise LayoutError("parallel.param_dtype: bfloat16 parameters under data parallelism "
                          "need ZeRO (the 16-bit copies are what ZeRO gathers); set "
                          "parallel.zero_stage 1, 2 or 3, or parallel.param_dtype float32")


# --------------------------------------------------------------------------------------------
# LoRA and the post-training tasks
# --------------------------------------------------------------------------------------------
@rule
def lora_without_experts(lora_r: int, experts: int) -> None:
    """LoRA adapts dense layers only."""
    if lora_r and experts:
        raise LayoutError("lora.r: LoRA does not adapt a mixture of experts "
                          f"(model.num_local_experts={experts}); use lora.r 0")


@rule
def lora_kv_needs_split_kv(targets: tuple[str, ...], kv: int, tp: int) -> None:
    """Adapters on k/v need the kv heads sharded over tp, not replicated."""
    if kv % tp and {"k_proj", "v_proj"} & set(targets):
        raise LayoutError(f"lora.target_modules: k_proj/v_proj stay whole when parallel.tp={tp} "
                          f"exceeds the {kv} KV heads; leave them out or lower parallel.tp")


@rule
def task_layout(task: str, pp: int, cp: int) -> None:
    """DPO and reward models score whole sequences per rank (no cp); reward training runs
    no pipeline."""
    if task == "dpo" and cp > 1:  # its sequence log-probs would be partial sums per cp rank
        raise LayoutError(f"parallel.cp: DPO does not run under context parallelism yet (got "
                          f"cp={cp}); use parallel.cp 1 and shard over dp_shard or tp instead")
    if task == "reward" and pp > 1:
        raise LayoutError(f"parallel.pp: reward training does not run under pipeline "
                          f"parallelism yet (got pp={pp}); use parallel.pp 1 and shard over "
                          "dp_shard (ZeRO) or tp instead")
    if task == "reward" and cp > 1:
        raise LayoutError(f"parallel.cp: reward training does not run under context "
                          f"parallelism yet (got cp={cp}); use parallel.cp 1")


@rule
def generation_layout(pp: int, cp: int, ep: int, tp: int, sequence_parallel: bool) -> None:
    """GRPO generates with the training model: each rank decodes whole sequences of its own
    prompts, one token a step, so no pipeline, context or expert parallelism, and no sequence
    parallelism."""
    for name, value, why in (("pp", pp, "generation runs the whole model on each rank"),
                             ("cp", cp, "generation decodes whole sequences"),
                             ("ep", ep, "a rank decodes as many steps as its prompts need, so "
                                        "the ep all-to-alls would not match")):
        if value > 1:
            raise LayoutError(f"parallel.{name}: GRPO does not run with {name}={value} ({why}); "
                              f"use parallel.{name} 1")
    if tp > 1 and sequence_parallel:
        raise LayoutError("parallel.sequence_parallel: GRPO's generation decodes one token a "
                          "step, which cannot be split over tp ranks; set it false")


@rule
def tp_overlap_needs_sequence_parallel(chunks: int, tp: int, sequence_parallel: bool) -> None:
    """Overlapped tensor parallelism (``parallel.tp_overlap``) cuts sequence parallelism's
    all-gathers and reduce-scatters into chunks: it needs tp > 1 with sequence parallelism."""
    if chunks >= 2 and not (sequence_parallel and tp > 1):
        raise LayoutError(f"parallel.tp_overlap: {chunks} chunks overlap sequence parallelism's "
                          f"all-gathers and reduce-scatters, which parallel.tp={tp} with "
                          f"sequence_parallel={str(sequence_parallel).lower()} does not have; "
                          "set parallel.tp > 1 and parallel.sequence_parallel true, or "
                          "parallel.tp_overlap 0")


@rule
def tp_overlap_plain_projections(chunks: int, lora_r: int, m: ModelConfig, tp: int) -> None:
    """The overlapped sub-layers fuse plain column and row projections with their
    collectives: not LoRA adapters, latent attention or k/v kept whole over tp."""
    if chunks < 2:
        return
    kv = m.num_key_value_heads
    plain = [why for cond, why in ((lora_r > 0, "LoRA adapters (lora.r > 0)"),
                                   (m.kv_lora_rank, "latent attention (model.kv_lora_rank)"),
                                   (tp > 1 and kv % tp,
                                    f"k/v kept whole ({kv} KV heads < parallel.tp={tp})"))
             if cond]
    if plain:
        raise LayoutError(f"parallel.tp_overlap: {chunks} cannot overlap the projections of "
                          f"{', '.join(plain)}; set parallel.tp_overlap 0")


@rule
def selective_experts_eager(recompute: str, experts: int, ep: int, compiled: bool) -> None:
    """Selective recompute hands a mixture of experts' all-to-alls their kept outputs back in
    eager mode; a compiled block could send them again, which no test covers yet."""
    if recompute == "selective" and experts and ep > 1 and compiled:
        raise LayoutError(f"train.compile: selective recompute of a mixture of experts under "
                          f"expert parallelism (parallel.ep={ep}) runs eagerly only (a compiled "
                          "block could send its all-to-alls again); set train.compile false or "
                          "train.recompute full")
