"""Rank arithmetic on a ``Layout`` (``threefold.layout.description``): a rank's place in the
mesh is pure arithmetic on its global rank, so the coordinates, the groups of every axis and
the node-spanning test work without any process group (the launcher and the planner check a
layout before a process starts; ``threefold.comm.mesh.build_mesh`` turns the same layout into the
torch DeviceMesh whose named axes reach the process groups).

Axis order, outermost to innermost, is ``threefold.layout.axes.AXES``: tp innermost so that its
ranks are neighbours (same node, NVLink), then cp, dp_shard, and dp_replicate and pp outermost,
where traffic is lightest. Imports no torch.
"""

from __future__ import annotations

import math

from threefold.layout.axes import AXES, CP_AXES, DERIVED_AXES, EP_LEVELS, EXPERT_AXES, FLATTENED


class Ranks:
    """The rank arithmetic ``Layout`` inherits: it reads the degrees (``pp``, ``dp_replicate``,
    ``dp_shard``, ``cp``, ``tp``, ``ep``, and ``ulysses``: cp's all-to-all part) and nothing
    else."""

    @property
    def world_size(self) -> int:
        """Ranks this layout uses: pp·dp_replicate·dp_shard·cp·tp."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

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
        if axis in EP_LEVELS:
            return self.ep_intra if axis == "ep_intra" else self.ep // self.ep_intra
        if axis in EXPERT_AXES:
            edp_shard = self.dp_shard // self.ep * self.cp  # cp ranks hold the same experts
            return {"ep": self.ep, "edp_shard": edp_shard,
                    "edp": self.dp_replicate * edp_shard}[axis]
        if axis in CP_AXES:
            return self.ulysses if axis == "cp_inner" else self.cp // self.ulysses
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
        # dp_shard index = its outer part · ep + ep index; the experts' data ranks are the
        # outer part × cp (row-major, as dp_shard_cp)
        outer, out["ep"] = divmod(out["dp_shard"], self.ep)
        out["ep_inter"], out["ep_intra"] = divmod(out["ep"], self.ep_intra)
        out["edp_shard"] = outer * self.cp + out["cp"]
        out["edp"] = out["dp_replicate"] * (self.dp_shard // self.ep * self.cp) + out["edp_shard"]
        out["cp_outer"], out["cp_inner"] = divmod(out["cp"], self.ulysses)
        out["world"] = rank
        return out

    def axis_ranks(self, rank: int, axis: str) -> list[int]:
        """Global ranks in ``rank``'s group on ``axis``, ordered by their index on that axis."""
        n = self.axis_size(axis)
        if axis == "world":
            return list(range(self.world_size))
        c, st = self.coords(rank), self._strides()
        if axis in EP_LEVELS:  # ep index = ep_inter · ep_intra + ep_intra index
            ep, b = self.axis_ranks(rank, "ep"), self.ep_intra
            return ep[c["ep_inter"] * b:(c["ep_inter"] + 1) * b] if axis == "ep_intra" \
                else ep[c["ep_intra"]::b]
        if axis in EXPERT_AXES:  # dp_shard index = outer part · ep + ep index
            base = rank - c["dp_shard"] * st["dp_shard"]
            if axis == "ep":
                first = c["dp_shard"] - c["ep"]
                return [base + (first + i) * st["dp_shard"] for i in range(n)]
            outer = self.dp_shard // self.ep
            reps = range(self.dp_replicate) if axis == "edp" else [c["dp_replicate"]]
            base -= c["dp_replicate"] * st["dp_replicate"] + c["cp"] * st["cp"]
            return [base + r * st["dp_replicate"] + (o * self.ep + c["ep"]) * st["dp_shard"]
                    + k * st["cp"] for r in reps for o in range(outer) for k in range(self.cp)]
        if axis in CP_AXES:  # cp index = cp_outer · ulysses + cp_inner
            base, u = rank - c["cp"] * st["cp"], self.ulysses
            if axis == "cp_inner":
                return [base + (c["cp_outer"] * u + i) * st["cp"] for i in range(n)]
            return [base + (o * u + c["cp_inner"]) * st["cp"] for o in range(n)]
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
