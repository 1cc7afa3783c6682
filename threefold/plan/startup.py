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
by region (``threefold.weights``: at most two 64 MiB blocks beside the region).

On a CPU, resident memory also holds the interpreter, torch and the data (the *baseline*,
measured once per machine by ``cpu_baseline_bytes``), and gloo's all-gather and
reduce-scatter each copy through a temporary as large as the gathered tensor
(``backend_copies``), which NCCL does not.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass

from threefold.accounting.layout import Layout, Workload
from threefold.accounting.stages import (distinct_stages, rank_layers, stage_expert_units,
                                         stage_units)
from threefold.config import ModelConfig

READ_BLOCK_BYTES = 64 << 20  # threefold.weights.BLOCK_BYTES: a file read's temporary, twice


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
    if stage == 0 or stage == layout.pp - 1:
        sizes.append(cfg.vocab_size * h)
    if rank_layers(cfg, layout, stage):
        sizes += [f * h, cfg.num_attention_heads * cfg.head_dim * h]
        if cfg.num_local_experts:
            sizes.append(cfg.num_local_experts * 2 * f * h)
    return max(sizes)


def startup_memory(cfg: ModelConfig, layout: Layout, work: Workload, stage: int,
                   param_bytes: int = 4, backend_copies: bool = False) -> StartupMemory:
    """Start-up and loading peaks of one rank of pipeline ``stage`` (see the module doc);
    ``param_bytes``: the compute copies' element size (2 with bf16 parameters);
    ``backend_copies``: a CPU run (gloo's copies; the host is the device, so offload's host
    buffers count too)."""
    z, n, ne = layout.zero_stage, layout.shard_size, layout.edp_shard
    dense = [sum(u) for u in stage_units(cfg, layout, stage)]
    experts = [sum(u) for u in stage_expert_units(cfg, layout, stage)]
    tensors = [t for u in stage_units(cfg, layout, stage) for t in u] + \
        [t for u in stage_expert_units(cfg, layout, stage) for t in u]
    biggest_local = max(tensors)
    logical = 4 * largest_logical(cfg, layout, stage)
    if z:
        padded = [-(-u // n) * n for u in dense] + [-(-u // ne) * ne for u in experts]
        shards = [-(-u // n) for u in dense] + [-(-u // ne) for u in experts]
        owned = 4 * sum(shards)
        region = 4 * (-(-biggest_local // min(n, ne)) + cfg.hidden_size * 8)
        kept = owned
        filling = owned + logical + region
        if z in (1, 2):  # every unit gathered once the shards are filled
            kept += param_bytes * sum(padded)
            filling = max(filling, kept + (param_bytes * max(padded) if backend_copies else 0))
        moments = 8 * sum(shards) + 16 * max(shards)  # AdamW's, and one unit's being read
    else:
        local = sum(dense) + sum(experts)
        kept = 4 * local
        filling = kept + logical + 4 * biggest_local
        if param_bytes != 4:  # float32 masters beside the 16-bit compute copies
            kept += param_bytes * local
        if layout.dp * layout.cp > 1:  # data parallelism's gradient buckets
            kept += 4 * local
        moments = 8 * local + 8 * biggest_local
    if layout.offload_optimizer and backend_copies:  # host masters and gradient buffers
        kept += 8 * (sum(shards) if z else local)
    # a file read holds the region it returns, in blocks of at most READ_BLOCK_BYTES
    region = 4 * (-(-biggest_local // min(n, ne)) if z else biggest_local)
    read = min(2 * READ_BLOCK_BYTES, region)
    return StartupMemory(kept=kept, filling=filling, loading=kept + moments + read)


def startup_peak(cfg: ModelConfig, layout: Layout, work: Workload,
                 backend_copies: bool = False) -> float:
    """The largest start-up peak over the pipeline stages (``startup_memory``)."""
    return max(startup_memory(cfg, layout, work, st, work.weight_bytes, backend_copies).startup
               for st in distinct_stages(cfg, layout))


@functools.lru_cache(maxsize=4)
def cpu_baseline_bytes(threads: int = 1) -> int:
    """Resident bytes of a fresh Python process that has imported torch and threefold's
    training modules, used the meta device and run a matmul on ``threads`` threads (what
    every rank holds before its model: torchrun gives each of several ranks one), measured
    once in a subprocess; 0 where it cannot be measured (no /proc)."""
    code = ("import torch, threefold.train, threefold.parallel.distributed_layout\n"
            "from threefold.metrics import current_memory_bytes\n"
            f"torch.set_num_threads({int(threads)})\n"
            "torch.empty(1, device='meta') + 1\n"
            "torch.ones(64, 64) @ torch.ones(64, 64)\n"
            "print(current_memory_bytes(torch.device('cpu')))\n")
    env = {**os.environ, "OMP_NUM_THREADS": str(int(threads))}
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, check=True, env=env).stdout
        return int(json.loads(out.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0
