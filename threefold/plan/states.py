"""Model-state memory: bytes per parameter of the numerics (mixed-precision Adam, fp32, DeepSpeed's
estimator), the ZeRO accounting of Rajbhandari et al. (arXiv 1910.02054 Table 1), ZeRO-3's
working set, and the runtime constants (in-flight reduce-scatters, host copies, overhead).
Bytes; 1 GB = 1e9 bytes as in the papers.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.layout import Workload
from threefold.config import Config

# threefold.parallel.engines.zero (stages 2 and 3) starts each unit's reduce-scatter from a backward
# hook; its input, a full flat copy of the unit's gradient, lives until the reduce-scatter is
# finished, and the engine lets at most this many wait (ZeroEngine.MAX_INFLIGHT), so
# MAX_INFLIGHT + 1 full unit gradients exist at once at most.
ZERO_REDUCES_IN_FLIGHT = 2
# Optimiser offload (threefold.parallel.engines.offload) keeps, per parameter the rank updates, an
# fp32 master copy and an fp32 gradient buffer in host memory beside AdamW's state.
HOST_MASTER_BYTES = 4
HOST_GRAD_BYTES = 4
# CUDA context, NCCL buffers, allocator fragmentation and kernels' workspaces: a flat allowance
# per GPU on top of what the formulas count (the planner's fit test includes it).
RUNTIME_OVERHEAD_BYTES = 2e9
# A checkpoint holds, per trained element, the fp32 weight (or its fp32 master) and AdamW's two
# fp32 moments; each rank adds its CPU RNG state (torch's generator: mt19937 and its extras).
CHECKPOINT_BYTES_PER_PARAMETER = 12
CPU_RNG_STATE_BYTES = 5056


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state: the working weights, their gradients and the
    optimiser state (which ZeRO stage 1 already shards)."""

    param: float
    grad: float
    optimizer: float
    # True when the optimiser state holds the fp32 master weights (mixed precision); False when
    # the optimiser updates the working weights themselves (fp32), so that a ZeRO shard the
    # optimiser owns is a copy beside the full weights (threefold's stages 1 and 2).
    master_in_optimizer: bool = True

    @property
    def total(self) -> float:
        """Bytes per parameter when nothing is sharded."""
        return self.param + self.grad + self.optimizer


# ZeRO (arXiv 1910.02054 §3.1): bf16/fp16 weights 2 + gradients 2 + K = 12 for Adam's fp32
# master weights, momentum and variance.
MIXED_ADAM = StateBytes(param=2, grad=2, optimizer=12)
# fp32 training: weights 4 + gradients 4 + Adam's momentum and variance 8 (no master copy).
FP32_ADAM = StateBytes(param=4, grad=4, optimizer=8, master_in_optimizer=False)
# DeepSpeed's estimators additionally keep an fp32 gradient partition (4 bytes) with the
# optimiser state: 2P + 18P/N for stage 2 (deepspeed/runtime/zero/stage_1_and_2.py).
DEEPSPEED_MIXED_ADAM = StateBytes(param=2, grad=2, optimizer=16)
STATE_BYTES = {"bf16": MIXED_ADAM, "fp32": FP32_ADAM}


def state_bytes_for(work: Workload) -> StateBytes:
    """The model-state bytes of ``work``: fp32 weights and gradients (threefold's runtime,
    ``work.master_bytes == 4``, or fp32 training) hold 16 bytes/param as FP32_ADAM; 16-bit
    weights hold MIXED_ADAM's."""
    return FP32_ADAM if work.weight_bytes == 4 else STATE_BYTES[work.precision]


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


def async_save_copy_bytes(cfg: Config, owned: int, adapters: int) -> int:
    """The host copy rank 0 holds while a ``checkpoint.async_save`` save is in flight (0
    without it; ``threefold.weights.checkpoint_async.snapshot``): what it writes — every element it
    owns (``owned``; replicated tensors are written by the first replica, which it is), or
    under LoRA its ``adapters`` only — and its RNG state. Persistent buffers (DeepSeek's
    routing bias) are not counted."""
    return checkpoint_shard_bytes(cfg, owned, adapters) if cfg.checkpoint.async_save else 0


def checkpoint_shard_bytes(cfg: Config, owned: int, adapters: int) -> int:
    """The tensor bytes one rank writes into a checkpoint: every element it owns, or under
    LoRA its adapters only, with AdamW's moments, and its RNG state."""
    trained = adapters if cfg.lora.r else owned
    return trained * CHECKPOINT_BYTES_PER_PARAMETER + CPU_RNG_STATE_BYTES
