"""The rule book: the model's shape over tp and pp."""

from __future__ import annotations

from threefold.config import ModelConfig
from threefold.layout.rules.book import LayoutError, divisors, listed, rule


def _tp_fits(heads: int, kv: int, ffn: int) -> str:
    """Every tp this shape splits over (heads, kv heads, SwiGLU width)."""
    return listed(t for t in divisors(heads) if not (kv % t and t % kv) and ffn % t == 0)


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


def recompute_modules_of(cfg: ModelConfig) -> tuple[str, ...]:
    """The ``train.recompute_modules`` names this model has, in Megatron's order."""
    experts, dense = bool(cfg.num_local_experts), \
        not cfg.num_local_experts or cfg.first_k_dense_replace > 0
    have = {"core_attn": True, "layernorm": True, "mla_up_proj": bool(cfg.kv_lora_rank),
            "moe_act": experts, "mlp": dense, "moe": experts,
            "shared_experts": experts and bool(cfg.shared_expert_intermediate_size)}
    return tuple(name for name, ok in have.items() if ok)


@rule
def recompute_modules_in_model(cfg: ModelConfig, modules: tuple[str, ...]) -> None:
    """A named module must be one of this model's blocks' (latent attention, a dense MLP,
    experts, a shared expert)."""
    valid = recompute_modules_of(cfg)
    missing = [m for m in modules if m not in valid]
    if missing:
        raise LayoutError(f"train.recompute_modules: {','.join(missing)} names no module of "
                          f"this model; use only {','.join(valid)}")


def _blockwise_widths(m: ModelConfig, tp: int) -> dict[str, int]:
    """The widths tp splits in the FP8 projections (kv only when sharded), per rank."""
    hd, kv = m.head_dim, m.num_key_value_heads
    dense = m.dense_intermediate_size if m.first_k_dense_replace else 0
    ffn = dense if m.num_local_experts else m.intermediate_size  # experts are not split
    widths = {"model.num_attention_heads·head_dim": m.num_attention_heads * hd // tp,
              "model.num_key_value_heads·head_dim": kv * hd // tp if kv % tp == 0 else 0,
              "model.intermediate_size": ffn // tp}
    return {k: w for k, w in widths.items() if w and w % 16 == 0}  # FP8 layers only


@rule
def blockwise_tiles_over_tp(m: ModelConfig, tp: int, fp8: str) -> None:
    """Blockwise FP8 under tp: each split width is a multiple of 128 on every rank, so a
    shard's 1×128 tiles and 128×128 blocks are one process's (no amax crosses ranks)."""
    if fp8 != "blockwise" or tp == 1:
        return
    bad = {k: w for k, w in _blockwise_widths(m, tp).items() if w % 128}
    if bad:
        field, width = next(iter(bad.items()))
        fits = listed(t for t in divisors(tp) if t == 1 or not any(
            w % 128 for w in _blockwise_widths(m, t).values()))
        raise LayoutError(f"train.fp8: blockwise with parallel.tp={tp} splits {field} into "
                          f"{width}-wide shards, not multiples of 128 (a shard's 1x128 tiles "
                          f"would not be one process's); use parallel.tp in {fits} or "
                          "train.fp8 rowwise")
