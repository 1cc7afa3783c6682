"""Which pipeline splits the search tries for a layout: the runtime's ``params`` balance
always, and its ``flops`` balance where that lowers the busiest rank's FLOPs.

Balancing parameters is balancing memory. For a dense model that is nearly balancing time
(a block's FLOPs follow its weights; only the embedding, which costs no FLOPs, and the head
weigh differently). A mixture of experts breaks it: a token uses k of E experts, so an MoE
block holds E/k times the weights its FLOPs suggest, and a dense first block counts as a
fraction of an MoE block by parameters while it costs as much time (DeepSeek-V3: 0.6B
parameters against 11.5B per MoE block, the same FLOPs per token). By parameters, DeepSeek-V3's
first of 32 virtual stages takes its 3 dense blocks and an MoE block, and under a V schedule
the last (one block and the head) lands on the same rank: that rank does 1.6x the mean rank's
work. The ``flops`` balance (``threefold.schedules.balance``, the runtime's ``stage_costs``)
is a split the runtime runs, so the search tries it where it helps and reports it
(``parallel.pipeline_split``).
"""

from __future__ import annotations

from functools import lru_cache

from threefold.accounting.stages import _block_flops, _virtual_stage_layers, shape_key
from threefold.config import ModelConfig
from threefold.schedules.actions import rank_stage

# The least share of the busiest rank's FLOPs the flops split must save to be searched too: a
# dense model's two splits differ by the head and the embedding, mostly by 0-2%, within the
# time model's error, and searching both would add a third to the search (Llama 3 70B on
# 1,024 GPUs); a mixture of experts' differ by tens of percent.
FLOPS_SPLIT_GAIN = 0.02


def rank_flops(cfg: ModelConfig, pp: int, vpp: int, split: str, seq_len: int,
               vshape: bool = False) -> tuple[float, ...]:
    """Training FLOPs per token of each pipeline rank's blocks and head (the runtime's
    ``flops`` count: the embedding lookup 0, the head 6·V·h) under ``split``, the rank
    holding its ``vpp`` chunks (a V schedule's ``stage`` and ``2pp - 1 - stage``)."""
    return _rank_flops(shape_key(cfg), pp, vpp, split, seq_len, vshape)


@lru_cache(maxsize=4096)
def _rank_flops(key: tuple, pp: int, vpp: int, split: str, seq_len: int,
                vshape: bool) -> tuple[float, ...]:
    counts = _virtual_stage_layers(key, pp * vpp, split)
    costs = [_block_flops(key, i, seq_len) for i in range(key[5])]
    starts = [sum(counts[:s]) for s in range(len(counts))]
    head = 6.0 * key[4] * key[0]  # vocab · hidden
    per_stage = [sum(costs[starts[s]:starts[s] + counts[s]]) + (head if s == pp * vpp - 1
                                                                    else 0.0)
                 for s in range(pp * vpp)]
    return tuple(sum(per_stage[rank_stage(r, c, pp, vshape)] for c in range(vpp))
                 for r in range(pp))


def searched_splits(cfg: ModelConfig, pp: int, vpp: int, seq_len: int, vshape: bool,
                    given: tuple[str, ...] | None) -> tuple[str, ...]:
    """The ``parallel.pipeline_split`` values to search for one (pp, vpp, V or not):
    ``given`` (``--pipeline-split``) as given; None: "params", and "flops:SEQ" when its
    busiest rank has ``FLOPS_SPLIT_GAIN`` fewer FLOPs than the params split's."""
    if pp == 1:
        return ("params",)
    if given is not None:
        return given
    flops = f"flops:{seq_len}"
    by_params = max(rank_flops(cfg, pp, vpp, "params", seq_len, vshape))
    by_flops = max(rank_flops(cfg, pp, vpp, flops, seq_len, vshape))
    return ("params", flops) if by_flops < by_params * (1 - FLOPS_SPLIT_GAIN) else ("params",)
