"""The rule book: LoRA and the post-training tasks."""

from __future__ import annotations

from threefold.config import ModelConfig
from threefold.layout.rules.book import LayoutError, rule


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
    """DPO under context parallelism runs without a pipeline (its pipelined rows are formed
    after the sequence split); reward training runs no pipeline."""
    if task == "dpo" and cp > 1 and pp > 1:
        raise LayoutError(f"parallel.pp: DPO under context parallelism (cp={cp}) runs without "
                          f"a pipeline (got pp={pp}); use parallel.pp 1, or parallel.cp 1")
    if task == "reward" and pp > 1:
        raise LayoutError(f"parallel.pp: reward training does not run under pipeline "
                          f"parallelism yet (got pp={pp}); use parallel.pp 1 and shard over "
                          "dp_shard (ZeRO) or tp instead")


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


@rule
def rollout_engine_layout(engine: str, zero_stage: int, lora_r: int) -> None:
    """A vLLM engine takes the policy's weights a ZeRO unit at a time, with each LoRA layer's
    adapters merged into its weight: not under ZeRO-3, whose units keep a layer's adapters
    and its base apart."""
    if engine == "vllm" and zero_stage == 3 and lora_r:
        raise LayoutError("parallel.zero_stage: grpo.rollout_engine vllm with LoRA merges "
                          "each layer's adapters into its weight, which ZeRO-3 keeps in other "
                          "units; use parallel.zero_stage 2 or grpo.rollout_engine builtin")


@rule
def rollout_overlap_tp(engine: str, mode: str, staleness: int, tp: int) -> None:
    """A colocated vLLM engine under the trainer's tensor parallelism generates with
    collectives of its own over the tp group's ranks; generating while the step trains
    (``grpo.max_staleness``) would run them beside the trainer's own collectives, in another
    thread, in an order no rank agrees on (on GPUs, two communicators that can deadlock)."""
    if engine == "vllm" and mode == "colocate" and staleness and tp > 1:
        raise LayoutError(f"grpo.max_staleness: {staleness} with a colocated vLLM engine at "
                          f"parallel.tp={tp} would overlap the engine's tp collectives with "
                          "training's; use grpo.max_staleness 0, grpo.vllm_mode server, or "
                          "parallel.tp 1")


@rule
def rollout_server_tp(tp: int, heads: int, kv_heads: int) -> None:
    """A rollout server's vLLM engine shards the attention heads over its ``tp`` workers, and
    the key-value heads too, or replicates them where there are fewer than workers."""
    def fits(t: int) -> bool:
        return heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)

    if not fits(tp):
        valid = ", ".join(str(t) for t in range(1, heads + 1) if fits(t))
        raise LayoutError(f"grpo.vllm_server_tp: {tp} must divide model.num_attention_heads="
                          f"{heads} and divide or be a multiple of model.num_key_value_heads="
                          f"{kv_heads} (the server's vLLM shards the heads); valid values: "
                          f"{valid}")


@rule
def recompute_modules_need_selective(recompute: str, modules: tuple[str, ...]) -> None:
    """Named modules are a selective policy: full recompute recomputes everything, none
    nothing."""
    if modules and recompute != "selective":
        raise LayoutError(f"train.recompute_modules: {','.join(modules)} applies to selective "
                          f"recompute, not train.recompute {recompute}; set train.recompute "
                          "selective or clear train.recompute_modules")


@rule
def recompute_modules_eager(modules: tuple[str, ...], compiled: bool) -> None:
    """Named modules are found by forward hooks, which a compiled block does not run as the
    eager policy needs."""
    hooked = [m for m in modules if m in ("mla_up_proj", "mlp", "moe", "shared_experts")]
    if hooked and compiled:
        raise LayoutError(f"train.compile: train.recompute_modules {','.join(hooked)} runs "
                          "eagerly only; set train.compile false or name only core_attn, "
                          "layernorm, moe_act")
