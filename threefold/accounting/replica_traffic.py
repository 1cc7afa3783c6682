"""Bytes of the all-reduce across replica groups (torchft's Manager over its gloo group): the
ring figure the communication layer uses for every all-reduce, on the participants of a step.
A step with one participant sends nothing. Each rank sums what it holds with the same rank of
the other groups: whole tensors, or under ZeRO its shard of each flat unit."""

from __future__ import annotations


def ring_all_reduce_bytes(numel: int, element_size: int, participants: int, index: int) -> int:
    """What participant ``index`` of ``participants`` sends in a ring all-reduce of ``numel``
    elements: reduce-scatter then all-gather, every chunk but its own (chunks laid out as
    ``torch.tensor_split`` does), twice."""
    if participants <= 1:
        return 0
    q, r = divmod(numel, participants)
    own = q + (1 if index < r else 0)
    return 2 * (numel - own) * element_size


def replica_gradient_bytes(numels: list[int], element_size: int, participants: int,
                           index: int) -> int:
    """A step's gradient all-reduce across replica groups: one all-reduce per trained tensor
    (each reduced in place, no flat copy), ``numels`` their sizes."""
    return sum(ring_all_reduce_bytes(n, element_size, participants, index) for n in numels)


def replica_rank_numels(unit_numels: list[int], shards: int) -> list[int]:
    """The tensors one rank sums across the groups under ZeRO (stages 1-3 alike): its shard
    of each flat unit of ``unit_numels`` elements, padded to a multiple of ``shards``, the
    ranks a ZeRO shard group holds. The heal serves the same elements three times (weights
    and AdamW's two moments)."""
    return [-(-n // shards) for n in unit_numels]
