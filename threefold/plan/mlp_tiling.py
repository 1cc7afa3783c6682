"""What the tiled MLP (``train.mlp_tiles``, ``threefold.parallel.transforms.mlp_tiles``) changes
in the planner's counts: a dense block's MLP keeps its input alone (the tiles are views of
it, r bytes a value: the norm's output as the residual stream holds it) instead of the input
as its linears see it and SwiGLU's gate, up and product (GeGLU's tanh-GeLU too; tensorwise
FP8's scales of gate, up and down); backward holds one tile's share of those while it runs,
and re-runs the MLP's forward (2·3·h·ffn FLOPs per token). Measured to the byte against
autograd in tests/test_mlp_tiles.py."""

from __future__ import annotations

from threefold.accounting import local_seq_len, tp_shard
from threefold.config import ModelConfig
from threefold.layout import Layout, Workload


def _tiled(cfg: ModelConfig, work: Workload) -> bool:
    return work.mlp_tiles > 1 and not cfg.num_local_experts and work.block == "threefold"


def _untiled_per_token(cfg: ModelConfig, work: Workload, ffn: int) -> float:
    """What an untiled MLP keeps per token (of the tokens its linears see)."""
    d = work.act_bytes
    return d * cfg.hidden_size + d * ffn * (4 if cfg.hidden_act == "gelu_tanh" else 3)


def tiled_mlp_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """The change to one block's kept bytes per microbatch (<= 0) that tiling makes, without
    recompute."""
    if not _tiled(cfg, work):
        return 0.0
    sh = tp_shard(cfg, layout.tp)
    tokens = layout.microbatch_size * local_seq_len(layout, work)
    r = work.resid_bytes or work.act_bytes
    fp8_scales = 2 * 4 * 3 if work.fp8 == "tensorwise" else 0
    return tokens * (r * cfg.hidden_size - _untiled_per_token(cfg, work, sh.ffn)) - fp8_scales


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def kept_lora_targets(work: Workload) -> int:
    """LoRA targets whose adapters keep their x·Aᵀ for backward: all of them, less the MLP's
    under a tiled MLP (recomputed with it; LoRA is for dense models only)."""
    if work.mlp_tiles > 1 and work.block == "threefold":
        return sum(t not in MLP_PROJECTIONS for t in work.lora_targets)
    return len(work.lora_targets)


def tiled_mlp_weights(cfg: ModelConfig, layout: Layout, work: Workload) -> int:
    """Weights per block (per rank) whose autocast copies a tiled MLP does not keep: its
    gate, up and down projections (cast again in each tile's recompute)."""
    return 3 * cfg.hidden_size * tp_shard(cfg, layout.tp).ffn if _tiled(cfg, work) else 0


def tile_working_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """What one tile's backward holds while it runs: its share of the untiled MLP's tensors,
    and its weights cast again under autocast with wider weights."""
    if not _tiled(cfg, work):
        return 0.0
    sh = tp_shard(cfg, layout.tp)
    tokens = layout.microbatch_size * local_seq_len(layout, work)
    casts = work.act_bytes * tiled_mlp_weights(cfg, layout, work) \
        if work.weight_bytes > work.act_bytes else 0
    return -(-tokens // work.mlp_tiles) * _untiled_per_token(cfg, work, sh.ffn) + casts


def tile_recompute_flops(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """FLOPs per block per microbatch the tiles' recompute adds to backward."""
    if not _tiled(cfg, work):
        return 0.0
    tokens = layout.microbatch_size * local_seq_len(layout, work)
    return tokens * 2 * 3 * cfg.hidden_size * tp_shard(cfg, layout.tp).ffn
