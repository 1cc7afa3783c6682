"""In-memory checkpoints (``checkpoint.memory_interval``): the host memory one rank's copies
take and the bytes its replica sends to the next node, in closed form.

A memory checkpoint holds exactly what a storage checkpoint holds (``states.
checkpoint_shard_bytes``: the rank's owned elements with AdamW's two moments, and its RNG
state). Each node keeps its own part and, on two nodes or more, the previous node's part
(the replica ring, ``threefold.weights.checkpoint_memory``): rank r keeps its own shard and
that of the rank with its local index on the previous node, and sends its own to the next
node once per memory checkpoint. Between saves a node holds one step; while the next step is
written and sent it holds two (the older is removed once the newer and its replica are in
place). The files add their headers and manifests, a few kB, which these figures leave out.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config import Config
from threefold.plan.states import checkpoint_shard_bytes


@dataclass(frozen=True)
class MemoryCheckpoint:
    """One rank's in-memory checkpoint figures (bytes of tensors)."""

    interval: int  # steps between memory checkpoints
    nodes: int
    own: int  # its shard, in its node's memory directory
    peer: int  # the copy of the previous node's peer's shard it keeps (0 on one node)
    sent: int  # bytes it sends to the next node per memory checkpoint (0 on one node)

    @property
    def held(self) -> int:
        """Host memory (tmpfs) between saves: its own shard and its peer's."""
        return self.own + self.peer

    @property
    def peak(self) -> int:
        """Host memory while the next step is written and sent: two steps."""
        return 2 * self.held

    @property
    def sent_per_step(self) -> float:
        """The replica's bytes averaged over the steps between two memory checkpoints."""
        return self.sent / self.interval


def memory_checkpoint(cfg: Config, owned: int, adapters: int, nodes: int,
                      peer_owned: int | None = None, auto_steps: int = 0
                      ) -> MemoryCheckpoint | None:
    """The figures of rank 0 (owning ``owned`` elements, ``adapters`` under LoRA) on
    ``nodes`` nodes; ``peer_owned``: what its peer on the previous node owns (default the
    same: ZeRO's equal shards); ``auto_steps``: the count ``checkpoint.memory_interval auto``
    chose. None when ``checkpoint.memory_interval`` is off (or auto, with no choice)."""
    every = cfg.checkpoint.memory_interval
    every = auto_steps if every == "auto" else every
    if not every:
        return None
    own = checkpoint_shard_bytes(cfg, owned, adapters)
    peer = checkpoint_shard_bytes(cfg, owned if peer_owned is None else peer_owned, adapters)
    many = nodes > 1
    return MemoryCheckpoint(every, nodes, own, peer if many else 0, own if many else 0)
