"""The layout of the world: ``ParallelDims`` (pp × dp_replicate × dp_shard × cp × tp) and its
mesh.

A rank's place in the layout is pure arithmetic on its global rank, so the coordinates, the
groups of every axis and the node-spanning test work without any process group (the planner
and the CLI check a layout before a process starts). ``build_mesh`` turns the same layout into
one ``torch.distributed`` DeviceMesh whose named axes are the only way to reach a process group.

The axis tables (``AXES``, ``FLATTENED``, ``EXPERT_AXES``, ``DERIVED_AXES``) live in
``threefold.axes``, which the accounting reads too; they are re-exported here. Axis order,
outermost to innermost, is ``AXES``: tp innermost so that its ranks are neighbours (same node,
NVLink), then cp (context parallel: every sequence split over its ranks, K/V moved in each
attention), then dp_shard, then dp_replicate and pp outermost, where traffic is lightest
(DESIGN.md, topology rule). ``dp`` is the flattened dp_replicate × dp_shard axis: the ranks
that see different data. Context-parallel ranks hold the same weights and see different
tokens of the same sequences, so gradients are reduced over ``dp_cp`` (dp_replicate ×
dp_shard × cp) and ZeRO shards over ``dp_shard_cp`` (dp_shard × cp), as torchtitan folds cp
into its FSDP axis; with cp = 1 these are dp and dp_shard.

Nothing here is global: every mesh and every rule lives on the objects, so one process can
build many layouts (tests, DPO's two models).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from threefold.axes import AXES, DERIVED_AXES, EXPERT_AXES, FLATTENED, resolve_dp_shard
from threefold.config import ConfigError, ParallelConfig

__all__ = ["AXES", "DERIVED_AXES", "EXPERT_AXES", "FLATTENED", "ParallelDims", "TPSplit",
           "submesh"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(values: list[int]) -> str:
    return ", ".join(map(str, values))


@dataclass(frozen=True)
class TPSplit:
    """How one model's shapes divide over tensor-parallel (and pipeline) ranks.

    ``kv_replicas`` is 1 when key/value heads are sharded over tp ranks, and tp / kv heads when
    there are fewer kv heads than tp ranks, so each kv head is replicated on that many ranks.
    """

    heads_per_rank: int
    kv_heads_per_rank: int
    kv_replicas: int
    intermediate_per_rank: int
    padded_vocab_size: int
    layers_per_chunk: list[int]


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallel dimension, checked against the world size.

    Build it with ``from_config``; constructing it directly skips the checks in ``from_config``
    but ``__post_init__`` still insists that the product equals the world size.
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1
    ep: int = 1
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        sizes = [self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp]
        if any(s < 1 for s in sizes) or math.prod(sizes) != self.world_size:
            raise ConfigError(f"parallel: pp·dp_replicate·dp_shard·cp·tp = "
                              f"{'·'.join(map(str, sizes))} must equal world size "
                              f"{self.world_size} (use ParallelDims.from_config to resolve -1)")
        if self.ep < 1 or self.dp_shard % self.ep:
            raise ConfigError(f"parallel.ep: {self.ep} does not divide parallel.dp_shard="
                              f"{self.dp_shard} (expert-parallel ranks are data-parallel ranks "
                              f"of one shard group); valid ep values: "
                              f"{_fmt(_divisors(self.dp_shard))}")

    # ---------------------------------------------------------------- construction and checks
    @classmethod
    def from_config(cls, pcfg: ParallelConfig, world_size: int) -> "ParallelDims":
        """Resolve ``dp_shard = -1`` to the rest of the world and check every size.

        Raises ``ConfigError`` naming the field and a value that would work.
        """
        if world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {world_size}")
        valid = _fmt(_divisors(world_size))
        for name in ("tp", "pp", "dp_replicate", "cp"):
            v = getattr(pcfg, name)
            if v < 1:
                raise ConfigError(f"parallel.{name}: must be >= 1, got {v}")
            if world_size % v:
                raise ConfigError(f"parallel.{name}: {v} does not divide world size "
                                  f"{world_size}; valid {name} values: {valid}")
        if pcfg.dp_shard != -1 and pcfg.dp_shard < 1:
            raise ConfigError(f"parallel.dp_shard: must be >= 1 or -1 (the rest), got "
                              f"{pcfg.dp_shard}")
        dp_shard = resolve_dp_shard(pcfg, world_size)
        if pcfg.ep < 1:
            raise ConfigError(f"parallel.ep: must be >= 1, got {pcfg.ep}")
        if pcfg.ep > 1 and pcfg.cp > 1:
            raise ConfigError(f"parallel.ep: {pcfg.ep} with parallel.cp={pcfg.cp}: expert "
                              "parallelism with context parallelism is not built (a mixture of "
                              "experts routes whole sequences per rank); set one of them to 1")
        notes = []
        # ZeRO over a one-rank shard group is legal and changes nothing: allow it, but say so.
        if pcfg.zero_stage > 0 and dp_shard * pcfg.cp == 1:
            notes.append(f"parallel.zero_stage={pcfg.zero_stage} with dp_shard=1 shards over "
                         "one rank: no memory saving (raise parallel.dp_shard to shard)")
        elif pcfg.zero_stage > 0 and pcfg.cp > 1:
            notes.append(f"ZeRO-{pcfg.zero_stage} shards over dp_shard·cp = {dp_shard * pcfg.cp}"
                         " ranks (axis dp_shard_cp): context-parallel ranks hold the same "
                         "weights")
        return cls(pcfg.dp_replicate, dp_shard, pcfg.tp, pcfg.pp, world_size, pcfg.cp,
                   pcfg.ep, tuple(notes))

    def validate_model(self, model_cfg: Any, vpp: int = 1) -> TPSplit:
        """Check the model's shapes against tp and pp (× ``vpp`` chunks); return the split.

        Rules: query heads and the SwiGLU width divide by tp; key/value heads either divide by
        tp (sharded) or divide tp (each replicated on tp / kv ranks); every pipeline chunk gets
        at least one layer. The vocabulary is padded up to a multiple of tp, not refused.
        """
        m = model_cfg.resolved() if hasattr(model_cfg, "resolved") else model_cfg
        tp, chunks = self.tp, self.pp * vpp
        heads, kv = m.num_attention_heads, m.num_key_value_heads
        # every tp this model splits over (heads, kv heads, SwiGLU width), named in each refusal
        fits = _fmt([t for t in _divisors(heads) if not (kv % t and t % kv)
                     and m.intermediate_size % t == 0])
        if heads % tp:
            raise ConfigError(f"model.num_attention_heads: {heads} is not divisible by "
                              f"parallel.tp={tp}; this model splits over a tp in {fits} "
                              "(with a world size that tp divides)")
        if kv % tp and tp % kv:
            raise ConfigError(f"model.num_key_value_heads: {kv} neither divides nor is divisible"
                              f" by parallel.tp={tp}; this model splits over a tp in {fits}")
        if kv % tp and getattr(m, "qk_norm", False) \
                and getattr(m, "qk_norm_over", "head") == "projection":
            raise ConfigError(f"model.qk_norm_over: a k norm over the whole projection needs "
                              f"the {kv} KV heads split over parallel.tp={tp}, not replicated; "
                              f"use a tp that divides {kv}")
        dense = getattr(m, "dense_intermediate_size", 0) if getattr(m, "first_k_dense_replace",
                                                                    0) else 0
        if dense % tp:
            raise ConfigError(f"model.dense_intermediate_size: {dense} is not divisible by "
                              f"parallel.tp={tp}")
        if m.intermediate_size % tp:
            raise ConfigError(f"model.intermediate_size: {m.intermediate_size} is not divisible"
                              f" by parallel.tp={tp}; this model splits over a tp in {fits}")
        if m.num_hidden_layers < chunks:
            raise ConfigError(f"model.num_hidden_layers: {m.num_hidden_layers} layers cannot "
                              f"fill pp·vpp = {self.pp}·{vpp} = {chunks} pipeline chunks; lower "
                              f"parallel.pp or parallel.vpp")
        base, extra = divmod(m.num_hidden_layers, chunks)
        vocab = m.vocab_size or 0
        return TPSplit(
            heads_per_rank=heads // tp,
            kv_heads_per_rank=max(kv // tp, 1),
            kv_replicas=1 if kv % tp == 0 else tp // kv,
            intermediate_per_rank=m.intermediate_size // tp,
            padded_vocab_size=-(-vocab // tp) * tp,
            layers_per_chunk=[base + (1 if i < extra else 0) for i in range(chunks)],
        )

    # ---------------------------------------------------------------- arithmetic on ranks
    @property
    def dp(self) -> int:
        """Data-parallel degree: dp_replicate × dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in ``AXES`` order."""
        return tuple(getattr(self, a) for a in AXES)

    def axis_size(self, axis: str) -> int:
        """Number of ranks in one group of ``axis`` (an AXES or DERIVED_AXES name)."""
        if axis in FLATTENED:
            return math.prod(getattr(self, a) for a in FLATTENED[axis])
        if axis == "world":
            return self.world_size
        if axis in EXPERT_AXES:
            return {"ep": self.ep, "edp_shard": self.dp_shard // self.ep,
                    "edp": self.dp_replicate * self.dp_shard // self.ep}[axis]
        if axis not in AXES:
            raise KeyError(f"unknown mesh axis '{axis}'; axes: {', '.join(AXES + DERIVED_AXES)}")
        return getattr(self, axis)

    def _strides(self) -> dict[str, int]:
        strides, s = {}, 1
        for a in reversed(AXES):
            strides[a] = s
            s *= getattr(self, a)
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index on every axis (``dp`` = dp_replicate · dp_shard + dp_shard index)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        out = {a: (rank // st) % getattr(self, a) for a, st in self._strides().items()}
        out = {a: out[a] for a in AXES}
        for name, parts in FLATTENED.items():  # row-major over the parts, outermost first
            idx = 0
            for a in parts:
                idx = idx * getattr(self, a) + out[a]
            out[name] = idx
        out["edp_shard"], out["ep"] = divmod(out["dp_shard"], self.ep)
        out["edp"] = out["dp_replicate"] * (self.dp_shard // self.ep) + out["edp_shard"]
        out["world"] = rank
        return out

    def axis_ranks(self, rank: int, axis: str) -> list[int]:
        """Global ranks in ``rank``'s group on ``axis``, ordered by their index on that axis."""
        n = self.axis_size(axis)
        if axis == "world":
            return list(range(self.world_size))
        c, st = self.coords(rank), self._strides()
        if axis in EXPERT_AXES:  # dp_shard index = edp_shard · ep + ep index
            base = rank - c["dp_shard"] * st["dp_shard"]
            if axis == "ep":
                return [base + (c["edp_shard"] * self.ep + i) * st["dp_shard"] for i in range(n)]
            outer = self.dp_shard // self.ep
            reps = range(self.dp_replicate) if axis == "edp" else [c["dp_replicate"]]
            base -= c["dp_replicate"] * st["dp_replicate"]
            return [base + r * st["dp_replicate"] + (o * self.ep + c["ep"]) * st["dp_shard"]
                    for r in reps for o in range(outer)]
        if axis in FLATTENED:
            parts = FLATTENED[axis]
            base = rank - sum(c[a] * st[a] for a in parts)
            out = []
            for i in range(n):
                r, rest = base, i
                for a in reversed(parts):  # innermost part varies fastest
                    rest, k = divmod(rest, getattr(self, a))
                    r += k * st[a]
                out.append(r)
            return out
        base = rank - c[axis] * st[axis]
        return [base + i * st[axis] for i in range(n)]

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis``, each as its global ranks."""
        seen, groups = set(), []
        for r in range(self.world_size):
            if r not in seen:
                g = self.axis_ranks(r, axis)
                seen.update(g)
                groups.append(g)
        return groups

    def axis_spans_nodes(self, axis: str, gpus_per_node: int) -> bool:
        """Whether some group of ``axis`` holds ranks of two nodes (rank // gpus_per_node)."""
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        return any(len({r // gpus_per_node for r in g}) > 1 for g in self.axis_groups(axis))

    def describe(self) -> str:
        """One line for logs, e.g. 'pp 1 × dp_replicate 1 × dp_shard 4 × tp 2 = 8 ranks' (cp
        named only when it is used)."""
        ep = f" (ep {self.ep})" if self.ep > 1 else ""
        return " × ".join(f"{a} {getattr(self, a)}" + (ep if a == "dp_shard" else "")
                          for a in AXES if a != "cp" or self.cp > 1) + f" = {self.world_size} ranks"

    # ---------------------------------------------------------------- the real mesh
    def build_mesh(self, device_type: str):
        """The DeviceMesh of this layout (all five axes, size-1 ones too, plus the flattened
        axes of ``FLATTENED``).

        Returns None for a world of one with no process group: every caller (``Comm`` first)
        treats None as "one rank, nothing to communicate". The process group must already be
        initialised (``threefold.distributed.init_distributed``) for larger worlds.
        """
        # torch only here: the arithmetic above serves the launcher's checks and the planner,
        # which run before (or without) torch.distributed
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not (dist.is_available() and dist.is_initialized()):
            if self.world_size == 1:
                return None
            raise RuntimeError(f"build_mesh: a world of {self.world_size} ranks needs a process "
                               "group; call threefold.distributed.init_distributed() first")
        if dist.get_world_size() != self.world_size:
            raise ConfigError(f"parallel: layout is for {self.world_size} ranks but the process "
                              f"group has {dist.get_world_size()}")
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=AXES)
        # torch keeps the flattened mesh on the root mesh; _flatten (torch's private API, the
        # one torchtitan uses) creates its groups once and returns the cached mesh afterwards.
        for name, parts in FLATTENED.items():
            mesh[parts]._flatten(name)
        return mesh


def submesh(mesh, axis: str):
    """The one-dimensional DeviceMesh of ``axis`` (an AXES name or a FLATTENED one).

    Reaches a flattened mesh through ``_flatten`` rather than ``mesh["dp"]``, which torch 2.13
    warns is going away for flattened axes.
    """
    if axis in FLATTENED:
        return mesh[FLATTENED[axis]]._flatten(axis)
    if axis not in AXES:
        raise KeyError(f"unknown mesh axis '{axis}'; axes: {', '.join(AXES + tuple(FLATTENED))}")
    return mesh[axis]
