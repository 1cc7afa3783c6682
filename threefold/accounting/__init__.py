"""The accounting: closed forms that the runtime logs and the planner predicts, one definition
each. Parameters and FLOPs (``counts``), what a layout and a workload imply (``batches``; the
two themselves are ``threefold.layout``'s, the one description, and so are the rules),
parameters per rank, ZeRO units and gradient buckets (``stages``), and every collective a rank
issues with its bytes per mesh axis (``traffic``), and which link each axis crosses
(``links``). Pure functions of the configuration; no
torch, so the planner evaluates a 1T-parameter layout in microseconds. The runtime, the
benchmarks and the tests import these names from here.

Conventions (every function below follows them):
- A *layout* splits the world into pp × dp_replicate × dp_shard × cp × tp. Mesh axes are
  ordered outermost first as ``threefold.layout.axes.AXES`` (every axis table here is
  ``threefold.layout.axes``'s, the runtime's): tp innermost (NVLink), then cp, then dp_shard, then
  dp_replicate and pp outermost (heaviest traffic on the fastest links). A group that does not fit
  inside one aligned node crosses the network.
- Context parallelism is threefold's (``threefold.parallel.transforms.context``): each cp rank holds
  seq_len/cp tokens of every sequence, so every per-token figure (FLOPs, memory traffic,
  activations, tp and pp messages) is that of seq_len/cp tokens, while attention still looks
  at all seq_len keys. Weights are replicated over cp: plain data parallelism all-reduces over
  dp·cp ranks ("dp_cp"), ZeRO shards over dp_shard·cp ("dp_shard_cp"). Each attention moves
  K/V on "cp" (``cp_bytes_per_attention``).
- Tensor parallelism is threefold's (``threefold.parallel.transforms.tensor``, after Megatron,
  Shoeybi et al. 2019): q/k/v/gate/up column-parallel, o/down row-parallel, vocab-parallel embedding
  and head. RMSNorm weights are *replicated* over tp (under sequence parallelism their gradients
  are all-reduced over tp in every backward). When kv heads < tp, k/v projections stay whole
  on every tp rank, each rank computing the one kv head its query heads use, and their weight
  gradients are all-reduced over tp in every backward. The vocabulary is padded to a multiple
  of tp, as the runtime pads it (Megatron pads further, to 128·t); an intermediate size that
  tp does not divide is padded to ceil(f/tp) per rank (the runtime refuses it; the planner
  allows it, with a warning).
- Pipeline (planned, not yet run by the runtime): virtual stage s of v·p lives on rank s % p
  (Megatron's interleaved layout); rank 0 also holds the embedding, rank p-1 the final norm
  and LM head; with tied embeddings and pp > 1 both ends hold a copy, whose gradients are
  all-reduced between them once per step.
- Bytes are those one rank *sends*, counted exactly as ``threefold.comm.counted.Comm`` counts them
  (ring algorithms): all-reduce 2·(numel − own chunk), reduce-scatter and all-gather (n−1)·numel/n
  elements, point-to-point all of it. For the rank with coordinate 0 on every axis (global
  rank 0, the one that writes summary.json); other ranks differ by at most 2 elements per
  all-reduce whose size the group does not divide. With n dividing every size these are the
  published 2(n−1)/n·S and (n−1)/n·S.
"""

from threefold.accounting.batches import local_seq_len, microbatches
from threefold.accounting.counts import (
    TPShard,
    active_parameters,
    flops_per_token,
    layer_parameters,
    layer_parameters_per_rank,
    matmul_parameters,
    moe_matmul_parameters,
    num_parameters,
    padded_vocab,
    tp_shard,
)
from threefold.accounting.stages import (
    block_parameter_numels,
    gradient_buckets,
    largest_unit_parameters,
    owned_parameters,
    parameter_numels,
    pipeline_layers,
    rank_layers,
    stage_expert_units,
    stage_parameters,
    stage_units,
)
from threefold.accounting.collective import Collective
from threefold.accounting.ep_levels import nodes_per_token
from threefold.accounting.cp_balance import (attention_work, document_spans, headtail_spans,
    imbalance, row_spans)
from threefold.accounting.links import axis_crosses_nodes, axis_stride, axis_stride_and_span
from threefold.accounting.context_traffic import cp_attention_widths, cp_bytes_per_attention
from threefold.accounting.replica_traffic import (replica_gradient_bytes,
                                                  replica_rank_numels, ring_all_reduce_bytes)
from threefold.accounting.traffic import (collectives, comm_bytes_per_step,
                                          offload_bytes_per_step)


__all__ = [
    "replica_gradient_bytes", "replica_rank_numels", "ring_all_reduce_bytes",
    "active_parameters", "axis_crosses_nodes", "axis_stride", "axis_stride_and_span",
    "block_parameter_numels", "Collective", "collectives", "comm_bytes_per_step",
    "cp_attention_widths", "cp_bytes_per_attention", "flops_per_token", "nodes_per_token",
    "gradient_buckets", "largest_unit_parameters",
    "layer_parameters", "layer_parameters_per_rank", "local_seq_len", "matmul_parameters",
    "microbatches", "moe_matmul_parameters", "num_parameters", "offload_bytes_per_step",
    "owned_parameters", "padded_vocab", "parameter_numels", "pipeline_layers", "rank_layers",
    "stage_expert_units", "stage_parameters", "stage_units", "tp_shard", "TPShard",
    "attention_work", "document_spans", "headtail_spans", "imbalance", "row_spans",
]
