"""Bytes of the all-reduce across replica groups (torchft's Manager over its gloo group): the
ring figure the communication layer uses for every all-reduce, on the participants of a step.
A step with one participant sends nothing."""

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
