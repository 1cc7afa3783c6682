"""What the search works with: the space it searches (``SearchSpace``), one scored layout
(``Candidate``) and the result (``PlanResult``: the ranked layouts, the rejected ones with
their reasons, and notes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from threefold.layout import Layout
from threefold.config import CP_ALGORITHMS
from threefold.plan.memory import MemoryBreakdown
from threefold.plan.step import StepPrediction


@dataclass(frozen=True)
class SearchSpace:
    """Values each knob may take; None = every value that divides the world and the model
    (microbatch sizes: the divisors of each replica's batch up to ``MAX_MICROBATCH``)."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    vpp: tuple[int, ...] | None = None
    dp_replicate: tuple[int, ...] | None = None
    zero_stage: tuple[int, ...] = (0, 1, 2, 3)
    microbatch_size: tuple[int, ...] | None = None
    recompute: tuple[str, ...] | None = None  # None: all, less selective under flash
    # selective recompute's module policies (``Layout.recompute_modules``), for every mode in
    # ``recompute`` when given; None: the default policy, and DeepSeek-V3's for latent attention
    recompute_modules: tuple[tuple[str, ...], ...] | None = None
    # None: cp = 1, and every fitting cp degree when seq_len >= CP_MIN_SEQ_LEN (or when
    # nothing fits without cp; see ``search``)
    cp: tuple[int, ...] | None = None
    cp_algorithm: tuple[str, ...] = CP_ALGORITHMS
    # hybrid context parallelism's all-to-all (Ulysses) degrees inside cp, each with the ring
    # or all-gather over the rest (``parallel.cp_ulysses``); None: every divisor of cp where
    # the runtime has Ulysses ("ulysses" in CP_ALGORITHMS), else none (1)
    cp_ulysses: tuple[int, ...] | None = None
    # optimiser state in host memory (threefold.parallel.engines.offload): (False,) = never, (True,)
    # = every layout offloads, (False, True) = search both
    offload_optimizer: tuple[bool, ...] = (False,)
    # chunks per sequence-parallel collective (parallel.tp_overlap) of every layout; 0 = off
    tp_overlap: int = 0
    # expert-parallel degrees (a mixture of experts only); None: every divisor of the experts
    # that divides dp_shard
    ep: tuple[int, ...] | None = None
    # how the ep all-to-alls travel (parallel.ep_dispatch) and the cluster's ranks per node
    # that the hierarchical dispatch splits ep by
    ep_dispatch: str = "flat"
    gpus_per_node: int = 0
    # the runtime's parallel.pipeline_split values to search (pp > 1): "params" balances the
    # parameters, the embedding and head included (so the first and last stages take fewer
    # blocks), "flops:SEQ" the training FLOPs at SEQ, "uniform" Megatron's even split; None:
    # params, and flops where it lowers the busiest rank's FLOPs (``plan.splits``)
    pipeline_split: tuple[str, ...] | None = None
    # pipeline schedules to search (pp > 1); None: each that runs the layout's vpp — 1f1b and
    # zb-h1 at vpp 1, interleaved-1f1b above, zb-v and dualpipe-v at vpp 2
    schedules: tuple[str, ...] | None = None
    # interleaved 1F1B's bound on chunk activations in flight (parallel.pipeline_inflight);
    # None: Megatron's warm-up (0), and where that does not fit the largest bound that does
    pipeline_inflight: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Candidate:
    """A layout that fits, with its prediction and warnings."""

    layout: Layout
    memory: MemoryBreakdown
    step: StepPrediction
    warnings: tuple[str, ...]
    stage_layers: tuple[int, ...] = ()  # blocks per virtual stage (pp·vpp), the runtime's split


@dataclass
class PlanResult:
    """Ranked candidates (best first), the layouts that do not fit (with why), and counts of
    layouts the model or batch does not divide, by reason. ``fits`` counts every layout that
    fits; with ``search(keep=k)`` only the best k are scored in full (``ranked``), the others
    being provably slower (their communication-free time already exceeds the k-th best)."""

    ranked: list[Candidate]
    too_big: list[tuple[Layout, float, str]] = field(default_factory=list)
    invalid: dict[str, int] = field(default_factory=dict)
    fits: int = 0
    notes: list[str] = field(default_factory=list)
