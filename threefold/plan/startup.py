"""Memory of one rank before its first step — while the model is built and while a checkpoint
is loaded — and what a CPU process holds before any model (its baseline).

Start-up (``threefold.parallel.parallelize``): the model is sliced on the meta device and the
engine fills only what the rank keeps, one logical tensor at a time. A fresh run draws each
tensor's initial values whole (one generator per tensor, so a slice equals the same slice of
a model initialised whole: the generator is sequential), keeps the rank's region and drops
the rest. So the start-up peak is what the engine keeps (ZeRO's float32 shards; the whole
local tensors without ZeRO; ZeRO-1/2's gathered parameters, data parallelism's gradient
buckets, offload's host masters, once the engine exists) plus, while filling, the largest
logical tensor and the largest region cut from it.

Loading (``checkpoint.resume``, after start-up): AdamW's moments join the shards, each read
by region (``threefold.weights``: the region, read in blocks of at most 64 MiB).

On a CPU, resident memory also holds the interpreter, torch and the data (the *baseline*,
``plan.calibrate.cpu_baseline_bytes``), and gloo's all-gather and reduce-scatter each copy
through a temporary as large as the gathered tensor (``Workload.backend_copies``), which NCCL
does not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from threefold.layout import Layout, Workload, check_layout
from threefold.accounting.lora_counts import lora_units
from threefold.accounting import tp_shard
from threefold.accounting.stages import distinct_stages, shape_key
from threefold.accounting import rank_layers, stage_expert_units, stage_units
from threefold.config import ModelConfig
from threefold.plan.states import HOST_GRAD_BYTES, HOST_MASTER_BYTES

# threefold.weights.base.BLOCK_BYTES (a file read's temporary, at most two at once); not imported:
# the planner's formulas import no torch (tests/test_weights.py checks the two agree)
READ_BLOCK_BYTES = 64 << 20
# bytes a stored element of ``checkpoint.init_from``'s files takes: threefold's checkpoints
# are fp32; a Hugging Face folder in bf16 maps half as much per element (the count is then
# an upper bound by 2 bytes a region element)
FILE_BYTES = 4


@dataclass(frozen=True)
class StartupMemory:
    """Peak bytes of one rank over each phase before training (baseline not included)."""

    kept: float       # what the engine keeps once built (parameters, shards, buffers)
    filling: float    # peak while the tensors are filled (kept so far + one logical tensor)
    loading: float    # peak while a checkpoint's weights and moments are read (resume)

    @property
    def startup(self) -> float:
        """The start-up peak."""
        return max(self.kept, self.filling)


def largest_logical(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    """Elements of the largest whole (unsliced) tensor a rank of pipeline ``stage`` holds a
    part of: the embedding or head (vocabulary × hidden), else a block's largest weight (the
    fused experts of a mixture of experts)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    sizes = [h]
    if stage in (0, layout.last_stage):
        sizes.append(cfg.vocab_size * h)
    if rank_layers(cfg, layout, stage):
        sizes += [f * h, cfg.num_attention_heads * cfg.head_dim * h]
        if cfg.num_local_experts:
            sizes.append(cfg.num_local_experts * 2 * f * h)
    return max(sizes)


def startup_memory(cfg: ModelConfig, layout: Layout, work: Workload,
                   stage: int) -> StartupMemory:
    """Start-up and loading peaks of one rank of pipeline ``stage`` (see the module doc); the
    compute copies take ``work.weight_bytes`` an element; ``work.backend_copies`` (a CPU
    run) adds gloo's copy of a gather, and offload's host buffers, which share its memory."""
    z, n, ne, pb = layout.zero_stage, layout.shard_size, layout.edp_shard, work.weight_bytes
    dense_units = stage_units(cfg, layout, stage)
    expert_units = stage_expert_units(cfg, layout, stage)
    dense, experts = [sum(u) for u in dense_units], [sum(u) for u in expert_units]
    biggest = max(t for u in (*dense_units, *expert_units) for t in u)
    logical = 4 * largest_logical(cfg, layout, stage)
    if work.lora_r and z != 3:  # LoRA: the frozen base filled whole in the weights' dtype;
        # the adapters alone have fp32 masters (ZeRO 1-2: shards, then gathered), gradient
        # buckets and moments
        adapters = lora_units(cfg, layout, work, stage)[0]
        trained = [sum(u) for u in adapters]
        shards = [-(-u // n) for u in trained] if z else trained
        # loading reads the adapters alone (a LoRA checkpoint holds nothing else)
        owned, buffer = sum(shards), 0
        region = max((t for u in adapters for t in u), default=0)
        kept = pb * sum(dense) + 4 * owned + (pb * n * owned if z else 0)
        filling = _whole_filling(cfg, layout, work, stage, kept, logical, biggest)
        if z == 0 and layout.dp * layout.cp > 1:  # the adapters' gradient buckets
            kept += 4 * owned
    elif z:
        padded = [-(-u // n) * n for u in dense] + [-(-u // ne) * ne for u in experts]
        shards = [-(-u // n) for u in dense] + [-(-u // ne) for u in experts]
        owned, buffer = sum(shards), max(shards)  # loading reads a unit's shard at a time
        region = -(-biggest // min(n, ne))  # the largest tensor's rows a shard covers
        kept = 4 * owned
        # a file read holds the region and the file's pages it maps, while the shards it
        # fills (allocated whole before filling) are resident: FILE_BYTES + 4 a region element
        filling = kept + ((FILE_BYTES + 4) * region if work.init_from else logical + 4 * region)
        if z in (1, 2):  # every unit gathered once the shards are filled
            kept += pb * sum(padded)
            if work.backend_copies:
                filling = max(filling, kept + pb * max(padded))
    else:
        owned, buffer = sum(dense) + sum(experts), biggest  # a tensor at a time
        region = biggest
        kept = 4 * owned + (pb * owned if pb != 4 else 0)  # 16-bit copies beside fp32 masters
        filling = _whole_filling(cfg, layout, work, stage, kept, logical, biggest)
        if layout.dp * layout.cp > 1:  # data parallelism's gradient buckets
            kept += 4 * owned
    if layout.offload_optimizer and work.backend_copies:  # host masters and gradient buffers
        kept += (HOST_MASTER_BYTES + HOST_GRAD_BYTES) * owned
    # AdamW's two moments, plus the two read buffers of the tensor (or unit shard) being
    # loaded; a file read holds the region it returns, in blocks of at most BLOCK_BYTES
    moments = 8 * owned + 8 * buffer
    read = min(2 * READ_BLOCK_BYTES, 4 * region)
    return StartupMemory(kept=kept, filling=filling, loading=kept + moments + read)


def _whole_filling(cfg: ModelConfig, layout: Layout, work: Workload, stage: int, kept: float,
                   logical: float, biggest: int) -> float:
    """The filling peak where each local tensor is allocated as it is filled (no ZeRO, or
    LoRA's frozen base under ZeRO 0-2), ``kept`` what the filled tensors hold at the end.
    From the seed: ``kept``, the largest logical tensor drawn whole and its region's copy.
    From files (``work.init_from``): a tensor's read holds its region (fp32) and the file's
    pages it maps (``FILE_BYTES`` an element), then the region while it is copied into the
    tensor (the weights' dtype): so the first tensor filled — stage 0's embedding, when it
    is the largest: nothing is kept before it — peaks at that alone, every later one at
    most at ``kept`` plus its region."""
    if not work.init_from:
        return kept + logical + 4 * biggest
    emb = tp_shard(cfg, layout.tp).vocab * cfg.hidden_size if stage == 0 else 0
    per = max(4 + FILE_BYTES, 4 + work.weight_bytes)
    later = biggest if emb != biggest else max(
        [t for u in stage_units(cfg, layout, stage) for t in u if t != emb] + [0])
    return max(per * emb, kept + max(4, work.weight_bytes) * later)


def startup_peaks(cfg: ModelConfig, layout: Layout, work: Workload, *,
                  checked: bool = False) -> StartupMemory:
    """Each phase's largest peak over the pipeline stages (``startup_memory``). Cached on what
    start-up depends on: not the micro-batch, recompute, the in-flight bound or the bucket, so
    a search's many layouts that differ only in those are computed once. A layout the rule
    book refuses raises its LayoutError; ``checked``: the caller has run ``check_layout``."""
    if not checked:
        check_layout(cfg, layout, work)
    key = (shape_key(cfg), replace(layout, microbatch_size=1, recompute="none",
                                   recompute_modules=(), pipeline_inflight=0, bucket_mb=0.0, cp_algorithm="ring",
                                   sequence_parallel=True),
           work.weight_bytes, work.backend_copies, work.lora_r, work.lora_targets,
           work.init_from)
    peaks = _PEAKS.get(key)
    if peaks is None:
        per = [startup_memory(cfg, layout, work, st) for st in distinct_stages(cfg, layout)]
        peaks = StartupMemory(kept=max(m.kept for m in per),
                              filling=max(m.filling for m in per),
                              loading=max(m.loading for m in per))
        if len(_PEAKS) >= _PEAKS_MAX:
            _PEAKS.clear()
        _PEAKS[key] = peaks
    return peaks


_PEAKS: dict = {}
_PEAKS_MAX = 16384
