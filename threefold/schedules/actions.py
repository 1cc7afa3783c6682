"""The vocabulary of pipeline schedules: ``Action`` (one step of one rank's list: F, B, W or
BW on a microbatch and a stage, or a send or receive), what each compute action makes
(``completes``) and needs (``needs``), and which message a send or receive carries
(``message_key``, ``carries``). Read by the schedules, the message layout, the checker, the
simulator and the executor.

Layout (Megatron's, Narayanan et al. 2021 §2.2.2): there are ``S = v·p`` virtual stages;
stage ``s`` lives on rank ``s % p`` as its model chunk ``s // p`` (``stage_rank``). A V-shaped
schedule (ZB-V, DualPipeV: two chunks per rank) walks the ranks down and back up instead:
chunk 1 of rank r is stage ``2p - 1 - r``, so rank 0 holds the first and the last stage.

Imports no torch and nothing of threefold.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class ActionKind(enum.Enum):
    """What an action does. BACKWARD is the full backward (input and weight grads fused)."""

    FORWARD = "F"
    BACKWARD_INPUT = "B"
    BACKWARD_WEIGHT = "W"
    BACKWARD = "BW"
    SEND_FORWARD = "SEND_F"  # send this stage's output activation to the next stage
    RECV_FORWARD = "RECV_F"  # receive this stage's input activation from the previous stage
    SEND_BACKWARD = "SEND_B"  # send the gradient of this stage's input to the previous stage
    RECV_BACKWARD = "RECV_B"  # receive the gradient of this stage's output from the next stage

    @property
    def is_compute(self) -> bool:
        """True for F, B, W and BW; False for sends and receives."""
        return self in COMPUTE_KINDS


COMPUTE_KINDS = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD_INPUT,
                           ActionKind.BACKWARD_WEIGHT, ActionKind.BACKWARD})
SENDS = frozenset({ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD})
RECEIVES = frozenset({ActionKind.RECV_FORWARD, ActionKind.RECV_BACKWARD})


@dataclass(frozen=True)
class Action:
    """One step of one rank's schedule.

    ``stage`` is the global virtual stage this action belongs to (for a send or receive: the
    local stage whose output is sent or whose input is received), ``chunk`` the model chunk
    index on this rank (``stage // p``), ``peer`` the other rank of a send or receive.
    """

    kind: ActionKind
    microbatch: int
    chunk: int
    stage: int
    peer: int | None = None

    def __str__(self) -> str:
        peer = f"->r{self.peer}" if self.kind in SENDS else f"<-r{self.peer}"
        tail = "" if self.peer is None else peer
        return f"{self.kind.value} mb{self.microbatch} s{self.stage}{tail}"

    @classmethod
    def parse(cls, text: str, p: int | None = None) -> "Action":
        """The action ``str(action)`` wrote (e.g. a trace record's name, "F mb3 s1" or
        "SEND_F mb0 s0->r1"); ``chunk`` is ``stage // p`` when ``p`` is given, else 0.
        Raises ValueError on anything else."""
        try:
            kind, mb, where = text.split()
            if not (mb.startswith("mb") and where.startswith("s")):
                raise ValueError
            stage, _, peer = where[1:].replace("<-", "->").partition("->")
            if peer and not peer.startswith("r"):
                raise ValueError
            a = cls(ActionKind(kind), int(mb[2:]), 0, int(stage),
                     int(peer[1:]) if peer else None)
        except (ValueError, IndexError):
            raise ValueError(f"not a pipeline action: {text!r}") from None
        return dataclasses.replace(a, chunk=a.stage // p) if p else a


def stage_rank(stage: int, p: int, vshape: bool = False) -> int:
    """The rank that holds virtual stage ``stage``: Megatron's interleaved layout (chunk c of
    rank r is stage c·p + r), or with ``vshape`` the V (odd chunks run the ranks backwards)."""
    chunk, i = divmod(stage, p)
    return p - 1 - i if vshape and chunk % 2 else i


def rank_stage(rank: int, chunk: int, p: int, vshape: bool = False) -> int:
    """The virtual stage that ``chunk`` of ``rank`` is (the inverse of ``stage_rank``)."""
    return chunk * p + (p - 1 - rank if vshape and chunk % 2 else rank)


def message_key(action: Action) -> tuple[str, int, int, int]:
    """What a send or receive carries: (direction, microbatch, from stage, to stage).

    A send and the receive it pairs with have equal keys; that is how the checker matches them.
    """
    s, mb = action.stage, action.microbatch
    return {
        ActionKind.SEND_FORWARD: ("activation", mb, s, s + 1),
        ActionKind.RECV_FORWARD: ("activation", mb, s - 1, s),
        ActionKind.SEND_BACKWARD: ("gradient", mb, s, s - 1),
        ActionKind.RECV_BACKWARD: ("gradient", mb, s + 1, s),
    }[action.kind]


def completes(a: Action) -> tuple[str, int, int]:
    """What a compute action makes: ("F" | "B" | "W", microbatch, stage); BW makes B (and W).
    A send carries, and a receive brings, a "F" or "B" of the neighbouring stage."""
    tag = {ActionKind.FORWARD: "F", ActionKind.BACKWARD_WEIGHT: "W"}.get(a.kind, "B")
    return tag, a.microbatch, a.stage


def needs(a: Action, n: int) -> list[tuple[str, int, int]]:
    """What compute action ``a`` needs first (as ``completes`` keys), here or received:
    F the previous stage's F; B or BW its own F and the next stage's B; W its own B."""
    s, mb = a.stage, a.microbatch
    if a.kind is ActionKind.FORWARD:
        return [("F", mb, s - 1)] if s > 0 else []
    if a.kind is ActionKind.BACKWARD_WEIGHT:
        return [("B", mb, s)]
    return [("F", mb, s)] + ([("B", mb, s + 1)] if s < n - 1 else [])


def carries(a: Action) -> tuple[str, int, int]:
    """The ``completes`` key a send or receive moves between ranks."""
    direction, mb, src, _ = message_key(a)
    return ("F" if direction == "activation" else "B"), mb, src
