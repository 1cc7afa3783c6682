"""The collectives ``train.fp8`` adds (``threefold.parallel.transforms.fp8_linear``, ``fp8_gather``), for
``accounting.traffic``: the amaxes agreed over tp, and under ZeRO-3's
``parallel.fp8_all_gather`` a block unit's 8-bit gather."""

from __future__ import annotations

from threefold.layout import Layout
from threefold.accounting.counts import moe_key, tp_shard
from threefold.config import ModelConfig


def fp8_amaxes(add, cfg: ModelConfig, layout: Layout, recipe: str, blocks: tuple[int, int],
               tokens: int, rec: int) -> None:
    """tp, per microbatch: ``train.fp8``'s amaxes agreed over tp (``threefold.parallel.transforms.fp8_linear``),
    fp32, for each projection FP8 runs (local in and out features multiples of 16; k/v
    replicated over tp stay high precision). Tensorwise: 2 (x, W) per layer forward, again
    under recompute, and 1 (dy) backward; rowwise: a row-parallel layer's b·s + h (per token,
    per output row) forward, a column-parallel one's b·s + h (per token, per input column)
    backward; blockwise none (the rule book keeps its tiles inside a shard). ``blocks``:
    (blocks, of which with a dense MLP)."""
    t, h, hd, sh = layout.tp, cfg.hidden_size, cfg.head_dim, tp_shard(cfg, layout.tp)
    layers, dense = blocks
    ok = lambda *dims: all(x % 16 == 0 for x in dims)
    cols = layers * (ok(sh.heads * hd, h) + 2 * (sh.kv_replicas == 1 and ok(sh.kv_heads * hd)))
    rows = layers * ok(sh.heads * hd, h)
    cols, rows = cols + dense * 2 * ok(sh.ffn, h), rows + dense * ok(sh.ffn, h)
    runs = 2 if rec else 1  # a recomputed block's forward agrees its amaxes again
    if recipe == "blockwise":  # every tile lies inside one tp shard: nothing to agree
        return
    if recipe == "tensorwise":
        add("tp", "all_reduce", 2, 4, (rows + cols) * runs, t, True, "none")
        add("tp", "all_reduce", 1, 4, rows + cols, t, True, "none")
        return
    add("tp", "all_reduce", tokens + h, 4, rows * runs, t, True, "none")
    add("tp", "all_reduce", tokens + h, 4, cols, t, True, "none")


def fp8_gathered_numels(cfg: ModelConfig) -> tuple[int, ...]:
    """The sizes of a block's weights ``parallel.fp8_all_gather`` gathers in e4m3 (tp 1,
    ``threefold.parallel.transforms.fp8_linear.fp8_eligible``): q, k, v, o when their widths are
    multiples of 16, and a dense MLP's gate, up and down."""
    h, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    ok = lambda *dims: all(x % 16 == 0 for x in dims)
    out = [q * h] * ok(q, h) + [kv * h] * (2 * ok(kv, h)) + [q * h] * ok(q, h)
    if not moe_key(cfg)[0]:
        out += [f * h] * (3 * ok(f, h))
    return tuple(out)


def fp8_block_unit(add, axis: str, unit: tuple[int, ...], count: int, fp8: tuple[int, ...],
                   ns: int, nr: int, g: int, pb: int) -> None:
    """``count`` stage-3 block units gathered by ``parallel.fp8_all_gather``
    (``threefold.parallel.engines.fp8_gather``), per microbatch, forward and backward: the FP8
    weights' amaxes all-reduced (max, fp32), the whole padded unit all-gathered as bytes,
    the other elements all-reduced in ``pb``; the gradient as any unit's."""
    padded = -(-sum(unit) // ns) * ns
    rest = sum(unit) - sum(fp8)
    add(axis, "reduce_scatter", padded, g, count, ns, True, "backward")
    for phase in ("forward", "backward"):
        add(axis, "all_reduce", len(fp8), 4, count, ns, True, "none")  # the cast waits
        add(axis, "all_gather", padded, 1, count, ns, True, phase)
        if rest:
            add(axis, "all_reduce", rest, pb, count, ns, True, phase)
    add("dp_replicate", "all_reduce", padded // ns, g, count, nr, False, "step")
