"""Where a rank's predicted step peak goes, term by term (the lines ``threefold train
--dry-run`` prints under its memory summary): the process's own baseline, the weights (a LoRA
run's frozen base apart from its adapters), gradients, optimiser state, the activations of one
block times the blocks and microbatches in flight (the document mask's share and the adapters'
shown inside), the head and loss, ZeRO's working copies and the optimiser's temporaries, and
which of the two transient moments (the start of the last backward, the optimiser step) makes
the peak. Every figure is one the prediction itself uses (``plan.memory``,
``plan.activations``): nothing here is computed a second way.
"""

from __future__ import annotations

import math

from threefold.layout import Layout, Workload
from threefold.accounting import local_seq_len, microbatches
from threefold.accounting.lora_counts import lora_units
from threefold.accounting import tp_shard
from threefold.accounting import rank_layers
from threefold.accounting.stages import rank_dense_layers
from threefold.config import ModelConfig
from threefold.families.shapes import chunk_tokens
from threefold.plan.mtp_bytes import mtp_activation_bytes
from threefold.plan.activations import (adapter_activation_bytes, block_document_mask_bytes,
                                        head_saved_bytes, inflight_microbatches,
                                        microbatch_extra_bytes, model_layer_activation_bytes)
from threefold.plan.memory import MemoryBreakdown
from threefold.plan.sink_bytes import sink_attention_bytes


def count_text(n: float) -> str:
    """A parameter count to three significant digits, in millions or billions (688,800 is
    0.689M: one digit would say 0.7M)."""
    value, unit = (n / 1e9, "B") if n >= 1e9 else (n / 1e6, "M")
    digits = max(0, 2 - math.floor(math.log10(value))) if value > 0 else 0
    return f"{value:.{digits}f}{unit}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f}"


def _mask_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """The document mask's share of one block's kept bytes, where
    ``model_layer_activation_bytes`` adds it (no recompute, threefold's own block)."""
    if layout.recompute != "none" or work.block != "threefold":
        return 0.0
    if cfg.attention_sinks:  # (GPT-OSS: its scores whole, in place of the mask's term)
        return sink_attention_bytes(cfg, layout, work)
    return block_document_mask_bytes(cfg, layout, work)


def activation_line(cfg: ModelConfig, layout: Layout, work: Workload, mem: MemoryBreakdown
                    ) -> str:
    """Blocks × bytes per block (its parts) × microbatches in flight, and RoPE's tables."""
    layers = rank_layers(cfg, layout, mem.stage)
    block = model_layer_activation_bytes(cfg, layout, work)
    mask = _mask_bytes(cfg, layout, work)
    adapters = adapter_activation_bytes(layout, work) if work.lora_r else 0.0
    inflight = inflight_microbatches(layout.pipeline_schedule, layout.pp,
                                     microbatches(layout, work), layout.vpp, mem.stage,
                                     layout.pipeline_inflight)
    parts = [f"block {_gb(block - mask)}"]
    if mask and cfg.attention_sinks:
        parts.append(f"attention with sinks {_gb(mask)} (the probabilities over "
                     f"{work.seq_len} keys and the sink a head, K/V repeated to the query "
                     "heads, the boolean mask)")
    elif mask:
        parts.append(f"document mask's attention {_gb(mask)} (the mask in the matmul dtype, "
                     f"{work.seq_len}² a sequence, and K/V repeated to the query heads)")
    if adapters:
        parts.append(f"adapters {_gb(adapters)}")
    dense = rank_dense_layers(cfg, layout, mem.stage)
    kind = model_layer_activation_bytes(cfg, layout, work, dense=True) - block
    blocks = f"{layers} layers × {_gb(block + adapters)} ({' + '.join(parts)})"
    if dense and kind:  # a mixture of experts' dense first blocks keep another amount
        blocks = (f"({layers - dense} layers × {_gb(block)} + {dense} dense first blocks × "
                  f"{_gb(block + kind)})")
    mtp = mtp_activation_bytes(cfg, layout, work) if mem.stage == layout.last_stage else 0
    if mtp:
        blocks += f" + {cfg.num_nextn_predict_layers} multi-token-prediction module(s) {_gb(mtp)}"
    return (f"  activations {_gb(mem.activations)} = {blocks} × {inflight:g} microbatch(es) "
            f"in flight + RoPE tables {_gb(microbatch_extra_bytes(cfg, layout, work))}"
            + (f"; the block being recomputed {_gb(mem.recompute_working)}"
               if mem.recompute_working else ""))


def head_line(cfg: ModelConfig, layout: Layout, work: Workload, mem: MemoryBreakdown) -> str:
    """The head and loss: what they keep for backward and the chunked loss's working set."""
    if not mem.logits:
        return "  head and loss: none on this stage"
    tokens = layout.microbatch_size * local_seq_len(layout, work)
    vocab = tp_shard(cfg, layout.tp).vocab
    chunk = chunk_tokens(tokens, vocab)
    saved = head_saved_bytes(cfg, layout, work)
    return (f"  head and loss {_gb(mem.logits)}: kept for backward {_gb(saved)} (final norm, "
            f"head input, labels, log-sum-exp) + a chunk of {chunk} of the {tokens} tokens' "
            f"logits over {vocab} vocabulary rows in fp32 {_gb(mem.logits - saved)}")


def states_lines(cfg: ModelConfig, layout: Layout, work: Workload, mem: MemoryBreakdown
                 ) -> list[str]:
    """Weights (LoRA: the frozen base apart from the adapters), gradients, optimiser state."""
    if work.lora_r:
        trained = sum(map(sum, lora_units(cfg, layout, work, mem.stage)[0]))
        owned = trained / (layout.shard_size if layout.zero_stage else 1)
        adapters = owned * 4 + (trained * work.weight_bytes
                                if layout.zero_stage in (1, 2) else 0)
        weights = (f"  weights {_gb(mem.params)}: frozen base {_gb(mem.params - adapters)} "
                   f"+ LoRA adapters {_gb(adapters)} ({trained:,} parameters train"
                   + (f", {int(owned):,} owned" if layout.zero_stage else "") + ")")
    else:
        weights = f"  weights {_gb(mem.params)}"
    return [weights,
            f"  optimizer state (AdamW's moments{', owned shard' if layout.zero_stage else ''})"
            f" {_gb(mem.optimizer)}",
            f"  gradients at the end of backward {_gb(mem.grads)}"
            + (f" (held from earlier microbatches when the last backward starts "
               f"{_gb(mem.grads_in_backward)})" if mem.grads_in_backward else "")]


def memory_terms(cfg: ModelConfig, layout: Layout, work: Workload, mem: MemoryBreakdown,
                 baseline: float, parts=None) -> list[str]:
    """The step peak's terms, one a line (bytes in GB), summed the way the peak is;
    ``parts``: the baseline by part (``plan.baseline.Baseline``), each a line."""
    lines = [f"step peak per rank, term by term, GB (pipeline stage {mem.stage}):"]
    if parts is not None:
        lines += parts.lines(_gb)
    elif baseline:
        lines.append(f"  baseline {_gb(baseline)}: this process before any model (Python, "
                     "torch, the kernels a step loads)")
    lines += states_lines(cfg, layout, work, mem)
    lines += [activation_line(cfg, layout, work, mem), head_line(cfg, layout, work, mem)]
    extra = [(name, value) for name, value in (
        ("ZeRO-3 gathered units (in use and prefetched)", mem.zero3_working),
        ("ZeRO-3 gradient of the unit being reduced", mem.zero3_grad_working),
        ("autocast's weight copies", mem.cast_weights),
        ("engine buffers (gradient buckets)", mem.buffers),
        ("runtime overhead (allocator, communication)", mem.overhead)) if value]
    lines += [f"  {name} {_gb(value)}" for name, value in extra]
    backward, step = mem.activation_peak, mem.step_peak
    lines.append(
        f"  = always held (weights, optimizer state, buffers, overhead) "
        f"{_gb(mem.params + mem.optimizer + mem.buffers + mem.overhead)} + the larger of the "
        f"last backward's start {_gb(backward)} and the end of backward or the optimizer step "
        f"(gradients, + AdamW's temporaries {_gb(mem.optimizer_working)}) {_gb(step)} -> "
        f"{_gb(mem.total)}"
        + (f", {_gb(mem.total + baseline)} with the baseline" if baseline else ""))
    return lines
