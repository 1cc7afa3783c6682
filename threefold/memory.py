"""Memory per rank: model states (ZeRO), activations (Korthikanti et al.), pipeline in-flight
microbatches, and the per-GPU total the planner checks against the device.

Pure formulas, no torch. Bytes throughout; 1 GB = 1e9 bytes as in the papers.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config import ModelConfig
from threefold.cost import (
    Layout,
    Workload,
    largest_unit_parameters,
    microbatches,
    stage_parameters,
    tp_shard,
)

# CUDA context, NCCL buffers, allocator fragmentation and kernels' workspaces: a flat allowance
# per GPU on top of what the formulas count (the planner's fit test includes it).
RUNTIME_OVERHEAD_BYTES = 2e9


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state: the working weights, their gradients and the
    optimiser state (which ZeRO stage 1 already shards)."""

    param: float
    grad: float
    optimizer: float

    @property
    def total(self) -> float:
        """Bytes per parameter when nothing is sharded."""
        return self.param + self.grad + self.optimizer


# ZeRO (arXiv 1910.02054 §3.1): bf16/fp16 weights 2 + gradients 2 + K = 12 for Adam's fp32
# master weights, momentum and variance.
MIXED_ADAM = StateBytes(param=2, grad=2, optimizer=12)
# fp32 training: weights 4 + gradients 4 + Adam's momentum and variance 8 (no master copy).
FP32_ADAM = StateBytes(param=4, grad=4, optimizer=8)
# DeepSpeed's estimators additionally keep an fp32 gradient partition (4 bytes) with the
# optimiser state: 2P + 18P/N for stage 2 (deepspeed/runtime/zero/stage_1_and_2.py).
DEEPSPEED_MIXED_ADAM = StateBytes(param=2, grad=2, optimizer=16)

STATE_BYTES = {"bf16": MIXED_ADAM, "fp32": FP32_ADAM}


def model_state_breakdown(num_params: float, dp_shard: int, zero_stage: int,
                          state: StateBytes = MIXED_ADAM) -> dict[str, float]:
    """{'params', 'grads', 'optimizer'} bytes on one rank holding ``num_params`` parameters,
    sharded over ``dp_shard`` ranks by ZeRO ``zero_stage`` (arXiv 1910.02054 §5.1): stage 1
    shards the optimiser state, 2 also the gradients, 3 also the weights."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage {zero_stage} is not 0-3")
    n = dp_shard
    return {"params": num_params * state.param / (n if zero_stage >= 3 else 1),
            "grads": num_params * state.grad / (n if zero_stage >= 2 else 1),
            "optimizer": num_params * state.optimizer / (n if zero_stage >= 1 else 1)}


def model_state_bytes(num_params: float, dp_shard: int, zero_stage: int,
                      state: StateBytes = MIXED_ADAM) -> float:
    """Model-state bytes on one rank: with MIXED_ADAM, 16Ψ (stage 0), 4Ψ + 12Ψ/N (1),
    2Ψ + 14Ψ/N (2), 16Ψ/N (3), ZeRO's Table 1."""
    return sum(model_state_breakdown(num_params, dp_shard, zero_stage, state).values())


def zero3_working_bytes(largest_unit_params: float, state: StateBytes = MIXED_ADAM) -> float:
    """ZeRO-3's transient full-size buffers: the gathered weights and the not yet
    reduce-scattered gradients of the largest unit (DeepSpeed: 4·largest_layer in 16-bit)."""
    return largest_unit_params * (state.param + state.grad)


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------
def layer_activation_bytes(s: int, b: int, h: int, heads: int, kv_heads: int, ffn: int,
                           tp: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", dtype_bytes: int = 2,
                           mlp_tensors: int = 4, dropout: bool = False,
                           flash_attention: bool = True, kv_replicas: int = 1) -> float:
    """Activation bytes one transformer block keeps for backward, per rank, one microbatch.

    Korthikanti et al. (arXiv 2205.05198 §4) count, for a GPT block in 16-bit with 1-byte
    dropout masks, s·b·h·(34 + 5·a·s/h): attention 11·sbh + 5·a·s²·b, MLP 19·sbh, layer norms
    4·sbh. The same count, term by term, for this project's block (d = bytes per element,
    k = kv heads, f = SwiGLU width, no dropout, RMSNorm):

        replicated over tp unless sequence parallel, per s·b·h:
            2 norm inputs 2d  +  attention input d  +  MLP input d         (GPT: 4+2+2, +2 masks)
        split over tp:
            Q d·sbh  +  K and V 2d·sbh·k/a  +  attention output d·sbh      (GPT: 2+4+2)
            MLP: 4 tensors d·sbf (gate, silu(gate), up, their product)    (GPT: 2 tensors of 4h)
            attention core: flash attention keeps only the log-sum-exp, 4 bytes·a·s·b;
            materialised attention keeps the probabilities, d·a·s²·b     (GPT: 5·a·s²·b)

    i.e.  sbh·(4d)/(t if SP) + [sbh·(3d + 2d·k/a) + 4d·sbf + core]/t  bytes.
    With ``mlp_tensors=2, ffn=4h, kv_heads=heads, dropout=True, flash_attention=False`` this
    is Korthikanti's formula exactly: 34 + 5as/h; tp: 10 + 24/t + 5as/(ht); +SP: 34/t + ...
    Selective recompute drops the materialised attention core (no change under flash
    attention, which already recomputes it); full recompute keeps only the block input,
    d·sbh (/t with SP). When kv heads are replicated (k < t), K and V are not split.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute '{recompute}' is not none, selective or full")
    sbh = s * b * h
    rep_div = tp if sequence_parallel else 1
    if recompute == "full":
        return dtype_bytes * sbh / rep_div
    mask = 1 if dropout else 0
    replicated = sbh * (4 * dtype_bytes + 2 * mask)
    kv_share = kv_heads / heads * kv_replicas  # a replicated kv head is not split by tp
    split = sbh * (2 * dtype_bytes + 2 * dtype_bytes * kv_share)
    split += mlp_tensors * dtype_bytes * s * b * ffn
    if flash_attention:
        core = 4 * heads * s * b
    else:
        core = (2 * dtype_bytes + mask) * heads * s * s * b if dropout else \
            dtype_bytes * heads * s * s * b
        if recompute == "selective":
            core = 0
    return replicated / rep_div + (split + core) / tp


def model_layer_activation_bytes(cfg: ModelConfig, layout: Layout, work: Workload,
                                 recompute: str | None = None) -> float:
    """``layer_activation_bytes`` for this project's block under ``layout``."""
    sh = tp_shard(cfg, layout.tp)
    return layer_activation_bytes(
        work.seq_len, layout.microbatch_size, cfg.hidden_size, cfg.num_attention_heads,
        cfg.num_key_value_heads, sh.ffn * layout.tp, layout.tp, layout.sp,
        recompute or layout.recompute, work.act_bytes, flash_attention=work.flash_attention,
        kv_replicas=sh.kv_replicas)


def inflight_microbatches(schedule: str, p: int, m: int, v: int = 1, rank: int = 0) -> float:
    """Microbatches whose activations ``rank`` holds at its peak, in units of the rank's whole
    share of layers (v chunks). GPipe m; 1F1B min(p - rank, m) (Narayanan et al. §2.2.1);
    ZB-H1 min(p, m) on every rank (its weight gradients, which free the activations, run up to
    `rank` steps late; Qi et al. §3). Interleaved 1F1B: rank r runs 2(p-r-1) + (v-1)·p
    warm-up chunk-forwards (as Megatron schedules them) plus one, each 1/v of its layers
    (at most m·v in all); for rank 0 with m >= p that is
    p·(1 + (p-1)/(p·v)) — Korthikanti's interleaving factor, whose 'm' is the number of
    interleaved stages (our v). tests/test_cost.py checks all of these against the schedules'
    action lists."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "zb-h1":
        return float(min(p, m))
    if schedule == "interleaved-1f1b":
        chunk_mbs = min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
        return chunk_mbs / v
    return float(min(p - rank, m))


def logits_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """The last stage's loss working set for one microbatch: logits in the compute dtype, the
    fp32 copy the loss reads, and the fp32 gradient of the logits, over the vocab shard."""
    rows = layout.microbatch_size * work.seq_len * tp_shard(cfg, layout.tp).vocab
    upcast = 4 if work.act_bytes < 4 else 0
    return rows * (work.act_bytes + upcast + 4)


# --------------------------------------------------------------------------------------------
# Per GPU
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on one GPU of the worst pipeline stage, by what holds them."""

    stage: int
    params: float
    grads: float
    optimizer: float
    activations: float
    recompute_working: float  # one block's activations while it is recomputed
    logits: float
    zero3_working: float
    overhead: float

    @property
    def model_states(self) -> float:
        """Weights, gradients and optimiser state."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """Everything."""
        return (self.model_states + self.activations + self.recompute_working + self.logits
                + self.zero3_working + self.overhead)


def stage_memory(cfg: ModelConfig, layout: Layout, work: Workload, stage: int,
                 state: StateBytes | None = None,
                 overhead_bytes: float = RUNTIME_OVERHEAD_BYTES) -> MemoryBreakdown:
    """Peak memory of one rank of pipeline ``stage``: its model states (ZeRO over dp_shard;
    replication over dp_replicate costs nothing extra per rank; stage 2 with more than one
    microbatch keeps full gradients while accumulating, as threefold's engine does), the
    activations of the
    microbatches its schedule keeps in flight, the logits on the last stage, ZeRO-3 buffers."""
    return _stage_memories(cfg, layout, work, [stage], state, overhead_bytes)[0]


def memory_per_gpu(cfg: ModelConfig, layout: Layout, work: Workload,
                   state: StateBytes | None = None,
                   overhead_bytes: float = RUNTIME_OVERHEAD_BYTES) -> MemoryBreakdown:
    """The breakdown of the pipeline stage with the largest peak (stage 0 holds the most
    activations, the last stage the logits and head)."""
    p = layout.pp
    stages = sorted({0, min(1, p - 1), p - 1})
    return max(_stage_memories(cfg, layout, work, stages, state, overhead_bytes),
               key=lambda mb: mb.total)


def _stage_memories(cfg: ModelConfig, layout: Layout, work: Workload, stages: list[int],
                    state: StateBytes | None, overhead_bytes: float) -> list[MemoryBreakdown]:
    state = state or STATE_BYTES[work.precision]
    m = microbatches(layout, work)
    zero = layout.zero_stage if layout.dp_shard > 1 else 0
    per_layer = model_layer_activation_bytes(cfg, layout, work)
    layers = cfg.num_hidden_layers // layout.pp
    working = 0.0
    if layout.recompute == "full":  # the block being recomputed holds everything at once
        working = model_layer_activation_bytes(cfg, layout, work, recompute="none")
    zero3 = 0.0
    if zero == 3:
        zero3 = zero3_working_bytes(largest_unit_parameters(cfg, layout.tp), state)
    out = []
    for stage in stages:
        psi = stage_parameters(cfg, layout, stage)
        states = model_state_breakdown(psi, layout.dp_shard, zero, state)
        if zero == 2 and m > 1:
            # threefold's stage 2 accumulates full gradients over the microbatches (FSDP's
            # no-sync) and reduce-scatters on the last: stage 1's full gradients plus the shard
            states["grads"] = psi * state.grad * (1 + 1 / layout.dp_shard)
        inflight = inflight_microbatches(layout.pipeline_schedule, layout.pp, m, layout.vpp,
                                         stage)
        out.append(MemoryBreakdown(
            stage=stage, params=states["params"], grads=states["grads"],
            optimizer=states["optimizer"], activations=per_layer * layers * inflight,
            recompute_working=working,
            logits=logits_bytes(cfg, layout, work) if stage == layout.pp - 1 else 0.0,
            zero3_working=zero3, overhead=overhead_bytes))
    return out
