"""LoRA's parameters per rank (``threefold.model.lora``), as closed forms: what trains (the adapters)
and what is frozen (the base), grouped as the runtime's engines group them, and the FLOPs a
token costs when only the adapters train.

A run with ``Workload.lora_r`` > 0 adapts, in every block, the linear layers
``Workload.lora_targets`` names. An adapted layer of input width i and output width o adds
A (r × i) and B (o × r), registered after the layer's weight (and bias): per block, in
registration order q, k, v, o, gate, up, down, each A then B. Under tensor parallelism the
adapter is split the way its layer is (``threefold.parallel.transforms.tensor``): a column-parallel
layer (q, k, v, gate, up) keeps its rows of B and a whole A, a row-parallel one (o, down) its
columns of A and a whole B; the whole factor's gradient is summed over tp in every backward
(r·h elements per adapted layer, as the whole factor of every target is r × h or h × r).

ZeRO groups each block's adapters into a unit that trains and the rest of the module into a
frozen unit (``threefold.parallel.engines.zero``); the embedding, final norm and head are frozen
units. Without ZeRO (or under stages 1-2) the frozen base is held whole; data parallelism
buckets only the adapters' gradients.
"""

from __future__ import annotations

from threefold.layout import Layout, Workload
from threefold.accounting.counts import flops_per_token, matmul_parameters, tp_shard
from threefold.accounting.stages import cut_buckets, rank_layers, stage_units
from threefold.config import ModelConfig

LORA_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter_numels(cfg: ModelConfig, tp: int, r: int, targets: tuple[str, ...]
                   ) -> tuple[int, ...]:
    """Elements of each adapter matrix one tp rank holds in one block, in registration order
    (each target's A, then its B)."""
    sh, h, hd = tp_shard(cfg, tp), cfg.hidden_size, cfg.head_dim
    q, kv = sh.heads * hd, (sh.kv_heads if sh.kv_replicas == 1 else cfg.num_key_value_heads) * hd
    shape = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
             "gate_proj": (h, sh.ffn), "up_proj": (h, sh.ffn), "down_proj": (sh.ffn, h)}
    out: list[int] = []
    for name in LORA_ORDER:
        if name in targets:
            i, o = shape[name]
            out += [r * i, o * r]
    return tuple(out)


def adapter_parameters(cfg: ModelConfig, work: Workload) -> int:
    """Adapter parameters of the whole model (tp 1)."""
    return cfg.num_hidden_layers * sum(adapter_numels(cfg, 1, work.lora_r, work.lora_targets))


def tp_reduced_numel(cfg: ModelConfig, work: Workload) -> int:
    """Elements of one block's whole adapter factors (each r × h or h × r), whose gradients
    tensor parallelism all-reduces in every backward."""
    return len(work.lora_targets) * work.lora_r * cfg.hidden_size


def lora_units(cfg: ModelConfig, layout: Layout, work: Workload, stage: int = 0
               ) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(the units that train: one per block, its adapters; the frozen units: the base's
    ``stage_units``) of one rank, in forward order."""
    block = adapter_numels(cfg, layout.tp, work.lora_r, work.lora_targets)
    return (block,) * rank_layers(cfg, layout, stage), stage_units(cfg, layout, stage)


def lora_flops_per_token(cfg: ModelConfig, work: Workload) -> float:
    """Training FLOPs per token of ``work`` (the MFU numerator): ``flops_per_token``, or with
    only LoRA's adapters training (``work.lora_r``) the base's matmuls forward and for their
    input gradient (4N, not 6N), attention as always, and each adapter forward, input and
    weight gradient (6 per adapter parameter)."""
    if not work.lora_r:
        return flops_per_token(cfg, work.seq_len)
    return flops_per_token(cfg, work.seq_len) - 2.0 * matmul_parameters(cfg) \
        + 6.0 * adapter_parameters(cfg, work)


def lora_collectives(add, cfg: ModelConfig, layout: Layout, work: Workload, stage: int,
                     g: int, pb: int, zero_unit) -> None:
    """The data-parallel collectives of a LoRA run (``traffic.collectives``' ``add``;
    ``zero_unit`` its ``_zero_unit``): without ZeRO, the adapters' gradient buckets (reverse
    registration order) all-reduced over dp; under ZeRO 1-2 each block's adapter unit is
    reduce-scattered and gathered once per step and the frozen base, held whole, moves
    nothing; under ZeRO-3 the adapter units as any unit, and each frozen unit gathered
    before its forward and again before its backward (the embedding's forward only), never
    reduced."""
    trained, frozen = lora_units(cfg, layout, work, stage)
    ns, nr, z = layout.shard_size, layout.dp_replicate, layout.zero_stage
    if z == 0:
        flat = tuple(n for unit in trained for n in unit)
        for numel in cut_buckets(flat, g, layout.bucket_bytes):
            add(layout.data_axis, "all_reduce", numel, g, 1, ns * nr, False, "last")
        return
    ax = layout.shard_axis
    for unit in trained:
        zero_unit(add, ax, z, -(-sum(unit) // ns) * ns, 1, ns, nr, g, pb,
                  per_step_gathers=False)
    if z == 3:
        units = list(frozen)
        # a tied weight (ZeRO's root unit, listed last) stays gathered for the whole step;
        # an untied embedding is gathered for its forward only (its backward reads ids)
        root = units.pop() if cfg.tie_word_embeddings and layout.pp == 1 else None
        embedding = units.pop(0) if stage == 0 and root is None else None
        for unit in units:
            add(ax, "all_gather", -(-sum(unit) // ns) * ns, pb, 2, ns, True, "forward")
        if embedding is not None:
            add(ax, "all_gather", -(-sum(embedding) // ns) * ns, pb, 1, ns, True, "forward")
        if root is not None:
            add(ax, "all_gather", -(-sum(root) // ns) * ns, pb, 1, ns, False, "step")
    add(ax, "all_reduce", 2, 4, 1, ns, False, "step")  # gradient norm
