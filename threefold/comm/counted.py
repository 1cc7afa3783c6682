"""The communication layer: the only caller of c10d collectives in threefold.

Every collective names a mesh axis ("tp", "cp", "dp_shard", "dp_replicate", "pp", a flattened
one such as "dp", or "world") instead of a process group, and is counted per axis and per op:
calls, bytes this rank sends, and wall time of synchronous calls. A ring buffer keeps the last
calls so that a hang can be reported by what each rank was doing.

Bytes are those a rank sends in a ring implementation, N = ranks on the axis (ZeRO, arXiv
1910.02054 §7; FSDP, arXiv 2304.11277 §3.2.2):

- all_reduce: reduce-scatter then all-gather, each sending every chunk but one:
  2·(numel − own chunk)·element size, the chunks laid out as ``torch.tensor_split`` does and
  "own" being this rank's index on the axis. When N divides numel this is exactly
  2·(N−1)/N·nbytes; otherwise ranks differ by at most 2 elements, and the sum over ranks is
  still exactly 2·(N−1)·nbytes.
- reduce_scatter: (N−1)/N · input nbytes; all_gather: (N−1)/N · output nbytes (N divides both).
- broadcast: a chain from the source; every rank but the last in the chain forwards nbytes
  once (the last is the rank just before the source), so the sum is (N−1)·nbytes.
- all_to_all_single: the rows sent to other ranks.
- p2p: send counts nbytes; recv sends nothing and its bytes are counted as received.
- all_gather_uneven (gloo has no all-gather of unequal sizes) is built from all_to_all_single
  and counts what it moves: (N−1) · this rank's nbytes, plus the size exchange if any.

These are the ring algorithm's figures, the ones the published formulas use, not a capture of
the wire: gloo and NCCL may pick other algorithms (trees, halving-doubling) for some sizes.

On an axis of size 1 (and everywhere when the mesh is None, a world of one) every op is a
local no-op with the same result, counted as a call with zero bytes; nothing reaches c10d.
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from threefold.layout.axes import AXES, FLATTENED
from threefold.comm.collective_check import Ledger
from threefold.comm.distributed import set_timeout
from threefold.layout import Layout
from threefold.comm.mesh import submesh

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "avg": "SUM"}


@dataclass
class OpStats:
    """Counters for one (axis, op): calls, bytes sent, bytes received (p2p), seconds (sync)."""

    calls: int = 0
    bytes: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


class Handle:
    """Result of an async op: ``wait()`` blocks until done (then runs any finishing step)."""

    def __init__(self, works: list | None = None, after: Callable[[], None] | None = None,
                 done: bool = False):
        self._works, self._after = [w for w in (works or []) if w is not None], after
        self._done = done

    def wait(self) -> None:
        """Block until the op has completed on this rank."""
        if not self._done:
            for w in self._works:
                w.wait()
            self._done = True
            if self._after is not None:
                self._after()

    def is_completed(self) -> bool:
        """True once ``wait`` has returned (or the op was local)."""
        return self._done


def _chunk(numel: int, n: int, i: int) -> int:
    """Size of chunk ``i`` of ``numel`` elements split ``n`` ways as torch.tensor_split does."""
    q, r = divmod(numel, n)
    return q + (1 if i < r else 0)


class Comm:
    """Collectives by mesh axis, with exact per-axis byte accounting.

    Built from the layout and its mesh (None for a world of one). Holds no global state: each
    Comm counts only what went through it. ``ledger`` numbers every call per axis (and, when
    checking, describes it: ``threefold.comm.collective_check``); Comms that reach the same process
    groups share one, since the order that must agree is the groups'.
    """

    def __init__(self, dims: Layout, mesh=None, history: int = 64,
                 ledger: Ledger | None = None):
        if mesh is None and dims.world_size > 1:
            raise ValueError(f"Comm: a world of {dims.world_size} ranks needs a mesh")
        self.dims, self.mesh = dims, mesh
        self.global_rank = dist.get_rank() if mesh is not None else 0
        self._coords = dims.coords(self.global_rank)
        self._groups: dict[str, object] = {}
        self._stats: dict[str, dict[str, OpStats]] = {}
        self._window: dict[str, int] = {}
        self._step: int | None = None
        self._lock = threading.Lock()  # hooks may count from autograd's threads
        self.added: dict[str, tuple] = {}  # axis -> (its group, its ranks) of add_axis
        self.ledger = ledger if ledger is not None else Ledger(self.global_rank, history=history)
        self._recent = self.ledger.recent  # shared with the Comms of the same ledger
        self._counted_as: dict[str, str] = {}  # add_axis axis -> the axis its bytes count under
        # a traced step's records (World.traced; else None), for the callers that time their
        # own async collectives (data parallel's buckets, overlapped tp's chunks) to append to
        self.trace: list | None = None

    # ---------------------------------------------------------------- axes and groups
    def add_axis(self, axis: str, rank_lists: list[list[int]], counted_as: str | None = None
                 ) -> None:
        """A group axis that is not a mesh dimension (e.g. Megatron's embedding group: the
        first and last pipeline stages of each pipeline, for tied embeddings), its traffic
        counted under ``counted_as`` (a mesh axis it belongs to) or its own name. Collective:
        every rank of the world calls it with the same lists (c10d creates each group on
        all ranks). A rank in none of the lists must not use the axis."""
        if self.mesh is None or axis in self.added:
            raise ValueError(f"Comm.add_axis: '{axis}' needs a mesh and a new name")
        if counted_as:
            self._counted_as[axis] = counted_as
        for ranks in rank_lists:
            group = dist.new_group(sorted(ranks))
            if self.global_rank in ranks:
                self.added[axis] = (group, tuple(sorted(ranks)))

    def size(self, axis: str) -> int:
        """Ranks in this rank's group on ``axis``."""
        if axis in self.added:
            return len(self.added[axis][1])
        return self.dims.axis_size(axis)

    def rank(self, axis: str) -> int:
        """This rank's index on ``axis`` (its global rank for ``world``)."""
        if axis in self.added:
            return self.added[axis][1].index(self.global_rank)
        self.dims.axis_size(axis)  # rejects unknown axes
        return self._coords[axis]

    def group(self, axis: str):
        """The process group of ``axis`` (None when there is no mesh)."""
        if axis in self.added:
            return self.added[axis][0]
        self.dims.axis_size(axis)
        if self.mesh is None:
            return None
        if axis not in self._groups:
            self._groups[axis] = (dist.group.WORLD if axis == "world"
                                  else submesh(self.mesh, axis).get_group())
        return self._groups[axis]

    def groups(self) -> list:
        """Every process group this Comm can reach (for ``distributed.set_timeout``). Makes
        the flattened axes' groups it has not made yet: collective, in a fixed order."""
        if self.mesh is None:
            return []
        axes = dict.fromkeys((*AXES, *FLATTENED, "world", *self.added))
        return [self.group(a) for a in axes]

    def members(self, axis: str) -> tuple[int, ...]:
        """The global ranks of this rank's group on ``axis``."""
        return self.added[axis][1] if axis in self.added else \
            tuple(self.dims.axis_ranks(self.global_rank, axis))

    def release_groups(self) -> None:
        """Forget the destroyed groups: no reference may keep a backend's threads alive."""
        self._groups.clear()
        self.added.clear()

    def set_timeout(self, seconds: float) -> int:
        """Collective timeout for every group of this Comm (see distributed.set_timeout)."""
        return set_timeout(seconds, self.groups())

    # ---------------------------------------------------------------- accounting
    def set_step(self, step: int) -> None:
        """Tag later records with the training step (for hang reports)."""
        self._step = step

    def _count(self, op: str, axis: str, sent: int, received: int = 0) -> OpStats:
        axis = self._counted_as.get(axis, axis)
        with self._lock:
            s = self._stats.setdefault(axis, {}).setdefault(op, OpStats())
            s.calls += 1
            s.bytes += sent
            s.bytes_received += received
            self._window[axis] = self._window.get(axis, 0) + sent
        return s

    def step_counters(self) -> dict[str, int]:
        """Bytes sent per axis since the last call (axes used so far, zeros included)."""
        with self._lock:
            out = {a: self._window.get(a, 0) for a in self._stats}
            self._window = {}
        return out

    def totals(self) -> dict[str, dict[str, int]]:
        """Cumulative bytes sent, {axis: {op: bytes}}."""
        with self._lock:
            return {a: {op: s.bytes for op, s in ops.items()} for a, ops in self._stats.items()}

    def stats(self) -> dict[str, dict[str, dict]]:
        """Cumulative counters, {axis: {op: {calls, bytes, bytes_received, seconds}}}."""
        with self._lock:
            return {a: {op: asdict(s) for op, s in ops.items()} for a, ops in self._stats.items()}

    def recent(self) -> list[dict]:
        """The last calls that reached c10d (of every Comm sharing this one's ledger), oldest
        first: op, axis, seq (its number on the axis), phase, shape, dtype, step, time, async,
        seconds (None on a synchronous call: this rank is still inside it)."""
        with self._lock:
            return [dict(r) for r in list(self._recent)]  # a snapshot: another Comm appends

    def _issue(self, op: str, axis: str, t: torch.Tensor, sent: int, call: Callable,
               async_op: bool, after: Callable[[], None] | None = None,
               numel: int | None = None):
        """Count, record and run ``call(group, async_op)``; time it when synchronous.
        ``numel``: the element count every rank of the group passes (None where ranks
        legitimately differ), for the ledger."""
        stats = self._count(op, axis, sent)
        dtype = str(t.dtype).removeprefix("torch.")
        rec = self._remember(op, axis, self.ledger.issue(op, axis, dtype, numel),
                             tuple(t.shape), dtype, async_op)
        t0 = time.perf_counter()
        work = call(self.group(axis), async_op)
        if async_op:
            return Handle(work if isinstance(work, list) else [work], after)
        if after is not None:
            after()
        dt = time.perf_counter() - t0
        rec["seconds"] = dt
        with self._lock:
            stats.seconds += dt
        return None

    def _remember(self, op: str, axis: str, seq: int, shape, dtype: str, async_op: bool,
                  **extra) -> dict:
        """Keep the record of a call among the recent ones (see ``recent``) and return it."""
        rec = {"op": op, "axis": axis, "seq": seq, "phase": self.ledger.phase, "shape": shape,
               "dtype": dtype, "step": self._step, "time": time.time(), "async": async_op,
               "seconds": None, **extra}
        with self._lock:
            self._recent.append(rec)
        return rec

    def _local(self, op: str, axis: str, async_op: bool, fn: Callable[[], None] | None = None):
        self._count(op, axis, 0)
        if fn is not None:
            fn()
        return Handle(done=True) if async_op else None

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, t: torch.Tensor, axis: str, op: str = "sum", async_op: bool = False):
        """Reduce ``t`` in place over ``axis`` with op sum, max, min or avg."""
        if op not in _OPS:
            raise ValueError(f"all_reduce: op must be one of {', '.join(_OPS)}, got '{op}'")
        n = self.size(axis)
        if n == 1:
            return self._local("all_reduce", axis, async_op)
        sent = 2 * (t.numel() - _chunk(t.numel(), n, self.rank(axis))) * t.element_size()
        native_avg = op == "avg" and t.is_cuda  # NCCL has AVG; gloo does not: sum, then divide
        red = dist.ReduceOp.AVG if native_avg else getattr(dist.ReduceOp, _OPS[op])
        after = (lambda: t.div_(n)) if op == "avg" and not native_avg else None
        return self._issue("all_reduce", axis, t, sent,
                           lambda g, a: dist.all_reduce(t, red, group=g, async_op=a),
                           async_op, after, numel=t.numel())

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, axis: str,
                       op: str = "sum", async_op: bool = False):
        """Reduce ``input`` (N equal chunks, concatenated) over ``axis``; chunk i to rank i."""
        n = self.size(axis)
        if input.numel() != output.numel() * n:
            raise ValueError(f"reduce_scatter on '{axis}': input has {input.numel()} elements, "
                             f"expected {n} × {output.numel()}")
        if op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"reduce_scatter: unknown op '{op}'")
        if n == 1:
            return self._local("reduce_scatter", axis, async_op,
                               lambda: output.copy_(input.view_as(output)))
        sent = (n - 1) * input.numel() // n * input.element_size()
        native_avg = op == "avg" and input.is_cuda
        red = dist.ReduceOp.AVG if native_avg else getattr(dist.ReduceOp, _OPS[op])
        after = (lambda: output.div_(n)) if op == "avg" and not native_avg else None
        return self._issue(
            "reduce_scatter", axis, input, sent,
            lambda g, a: dist.reduce_scatter_single(output, input, red, group=g, async_op=a),
            async_op, after, numel=input.numel())

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, axis: str,
                   async_op: bool = False):
        """Gather equal-sized ``input`` from every rank of ``axis`` into flat ``output``."""
        n = self.size(axis)
        if output.numel() != input.numel() * n:
            raise ValueError(f"all_gather on '{axis}': output has {output.numel()} elements, "
                             f"expected {n} × {input.numel()}")
        if n == 1:
            return self._local("all_gather", axis, async_op,
                               lambda: output.copy_(input.view_as(output)))
        sent = (n - 1) * output.numel() // n * output.element_size()
        return self._issue(
            "all_gather", axis, output, sent,
            lambda g, a: dist.all_gather_single(output, input, group=g, async_op=a), async_op,
            numel=output.numel())

    def all_gather_uneven(self, input: torch.Tensor, axis: str,
                          sizes: list[int] | None = None) -> torch.Tensor:
        """Concatenate every rank's 1-D ``input`` (lengths may differ) over ``axis``.

        gloo cannot all-gather unequal tensors, so this is an all_to_all_single that sends this
        rank's data to each peer: it moves exactly (N−1)·nbytes, no padding. Without ``sizes``
        the lengths are exchanged first (one int64 all_gather, also counted).
        """
        n, flat = self.size(axis), input.reshape(-1)
        if n == 1:
            self._count("all_gather", axis, 0)
            return flat.clone()
        if sizes is None:
            got = torch.empty(n, dtype=torch.int64, device=flat.device)
            self.all_gather(got, torch.tensor([flat.numel()], device=flat.device), axis)
            sizes = got.tolist()
        if sizes[self.rank(axis)] != flat.numel():
            raise ValueError(f"all_gather_uneven: sizes[{self.rank(axis)}]="
                             f"{sizes[self.rank(axis)]} but this rank has {flat.numel()}")
        out = flat.new_empty(sum(sizes))
        send = flat.repeat(n)  # all_to_all_single reads one block per destination
        sent = (n - 1) * flat.numel() * flat.element_size()
        self._issue("all_gather", axis, out, sent,
                    lambda g, a: dist.all_to_all_single(out, send, sizes, [flat.numel()] * n,
                                                        group=g, async_op=a), False)
        return out

    def broadcast(self, t: torch.Tensor, src_axis_rank: int, axis: str, async_op: bool = False):
        """Copy ``t`` from the rank with index ``src_axis_rank`` on ``axis`` to its group."""
        n = self.size(axis)
        if not 0 <= src_axis_rank < n:
            raise ValueError(f"broadcast: source {src_axis_rank} outside axis '{axis}' of {n}")
        if n == 1:
            return self._local("broadcast", axis, async_op)
        last = (src_axis_rank - 1) % n  # the end of the chain forwards nothing
        sent = 0 if self.rank(axis) == last else t.numel() * t.element_size()
        return self._issue(
            "broadcast", axis, t, sent,
            lambda g, a: dist.broadcast(t, group=g, group_src=src_axis_rank, async_op=a),
            async_op, numel=t.numel())

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, axis: str,
                          output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None, async_op: bool = False):
        """Rows of ``input`` go to each rank of ``axis`` in order (even split unless given)."""
        n, me = self.size(axis), self.rank(axis)
        if n == 1:
            return self._local("all_to_all", axis, async_op,
                               lambda: output.copy_(input.view_as(output)))
        rows = input.shape[0] if input.dim() else 1
        row_bytes = input.numel() // max(rows, 1) * input.element_size()
        mine = input_split_sizes[me] if input_split_sizes is not None else rows // n
        sent = (rows - mine) * row_bytes
        return self._issue(
            "all_to_all", axis, input, sent,
            lambda g, a: dist.all_to_all_single(output, input, output_split_sizes,
                                                input_split_sizes, group=g, async_op=a),
            async_op)

    def batch_isend_irecv(self, ops: list[tuple[str, torch.Tensor, int]],
                          async_op: bool = False, axis: str = "pp"):
        """Point-to-point over ``axis`` (pipeline stages; cp for ring attention): ops are
        ("send"|"recv", tensor, peer global rank)."""
        peers = set(self.dims.axis_ranks(self.global_rank, axis)) - {self.global_rank}
        p2p, sent, received = [], 0, 0
        for kind, t, peer in ops:
            if kind not in ("send", "recv") or peer not in peers:
                raise ValueError(f"batch_isend_irecv: bad op ({kind!r}, peer {peer}); peers on "
                                 f"{axis} from rank {self.global_rank}: {sorted(peers)}")
            nbytes = t.numel() * t.element_size()
            self._count(kind, axis, nbytes if kind == "send" else 0,
                        nbytes if kind == "recv" else 0)
            sent += nbytes if kind == "send" else 0
            received += nbytes if kind == "recv" else 0
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, t, peer=peer, group=self.group(axis)))
        if not p2p:
            return Handle(done=True) if async_op else None
        # messages between pairs, not a call of the whole group: numbered on their own
        rec = self._remember("p2p", axis, self.ledger.issue("p2p", f"{axis} p2p"),
                             [tuple(o.tensor.shape) for o in p2p], str(p2p[0].tensor.dtype),
                             async_op, sent=sent, received=received)
        t0 = time.perf_counter()
        handle = Handle(dist.batch_isend_irecv(p2p))
        if async_op:
            return handle
        handle.wait()
        rec["seconds"] = time.perf_counter() - t0
        return None

    def barrier(self, axis: str = "world") -> None:
        """Wait until every rank of ``axis`` reaches this point."""
        if self.size(axis) > 1:
            self._untensored("barrier", axis, None, lambda g, root: dist.barrier(group=g))

    def _untensored(self, op: str, axis: str, sent: int | None, call: Callable):
        """Count (unless ``sent`` is None: a barrier moves no data), number, record and time
        a call that is not a tensor collective (pickles differ in size from rank to rank),
        run as ``call(group, global rank of the axis's rank 0)``."""
        if sent is not None:
            self._count(op, axis, sent)
        rec = self._remember(op, axis, self.ledger.issue(op, axis, "object"), (), "object", False)
        t0, group = time.perf_counter(), self.group(axis)
        out = call(group, dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0)
        rec["seconds"] = time.perf_counter() - t0
        return out

    def gather_object(self, obj, axis: str = "world") -> list | None:
        """Every rank's picklable ``obj`` on rank 0 of ``axis`` (a list in axis-rank order);
        None on the others. For small records (traces, reports), not tensors; counted as the
        pickled bytes each non-root rank sends."""
        if self.size(axis) == 1:
            return [obj]
        out = [None] * self.size(axis) if self.rank(axis) == 0 else None
        self._untensored("gather_object", axis, len(pickle.dumps(obj)) if self.rank(axis) else 0,
                         lambda g, root: dist.gather_object(obj, out, dst=root, group=g))
        return out

    def all_gather_object(self, obj, axis: str = "world") -> list:
        """Every rank's picklable ``obj`` on every rank of ``axis`` (a list in axis-rank
        order). For records and, at a checkpoint resume, the files a node lacks; counted as
        the pickled bytes this rank sends."""
        if self.size(axis) == 1:
            return [obj]
        out = [None] * self.size(axis)
        self._untensored("all_gather_object", axis, len(pickle.dumps(obj)),
                         lambda g, root: dist.all_gather_object(out, obj, group=g))
        return out

    def broadcast_object(self, obj, axis: str = "world"):
        """Rank 0 of ``axis``'s picklable ``obj`` on every rank of it (the others pass
        anything); counted as the pickled bytes rank 0 sends."""
        if self.size(axis) == 1:
            return obj
        box = [obj]
        self._untensored("broadcast_object", axis,
                         len(pickle.dumps(obj)) if self.rank(axis) == 0 else 0,
                         lambda g, root: dist.broadcast_object_list(box, src=root, group=g))
        return box[0]
