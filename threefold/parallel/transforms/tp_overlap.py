"""Overlapped tensor parallelism (``parallel.tp_overlap``, async TP as Megatron's
``--tp-comm-overlap`` and torchtitan's async TP do it), under sequence parallelism.

Without it a sub-layer waits for the whole all-gather of its input before its column-parallel
matmuls (q/k/v, gate/up), and the reduce-scatter after its row-parallel matmul (o, down) waits
for the whole matmul. With C chunks each collective is cut along the sequence into C pieces
issued asynchronously through the communication layer (``Comm.all_gather`` /
``reduce_scatter`` with ``async_op=True``, counted as the synchronous ones):

- all-gather → column matmuls: chunk i+1 is in flight while chunk i's rows are multiplied;
- row matmul → reduce-scatter: chunk i's reduce-scatter is in flight while chunk i+1's rows
  are multiplied;
- backward, mirrored: the column side's input gradient is computed chunk by chunk, each
  chunk's reduce-scatter in flight while the next is computed (and while the weight
  gradients are); the row side's output gradient is all-gathered chunk by chunk, each chunk's
  input gradient computed while the next arrives.

Chunk i of every rank's local tokens [i·c, (i+1)·c) is gathered together, so one chunk is t·c
rows of the global sequence (c from each rank). A matmul's output row depends on its input row
only, and on CPU a row's dot products come out the same whatever other rows share the call, so
the chunked run equals the unoverlapped one bit for bit in fp32 (tests/test_tensor_parallel.py
checks it; a GPU library may pick another kernel for fewer rows, so there it is equal within
rounding). Weight gradients are one matmul over the whole gathered sequence, as without
overlap. Reduce-scatter sums the same t values per element; with t = 2 the order cannot
matter, with more ranks the backend's order per chunk may differ from the whole call's.

The chunk count is the largest divisor of a rank's local tokens not above C
(``overlap_chunks``), decided by shapes only, so every rank issues the same collectives in the
same order. The bytes are those of the unchunked collectives: C calls of 1/C of the size.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from threefold.accounting.batches import overlap_chunks
from threefold.model.kernels import matmul_dtype
from threefold.schedules.timeline import TraceRecord

AXIS = "tp"


class _Trace:
    """Spans of one overlapped collective for a traced step (``train.trace_step``): each async
    collective from launch to the end of its wait (category "tp comm (async)") and each chunk's
    matmul (category "tp matmul"), separate rows so their overlap shows. Does nothing without a
    list."""

    def __init__(self, records: list | None, comm):
        self.records, self.rank = records, comm.rank("world") if records is not None else 0
        self.launched: dict[int, float] = {}

    def launch(self, i: int) -> None:
        if self.records is not None:
            self.launched[i] = time.perf_counter()

    def waited(self, i: int, what: str) -> None:
        if self.records is not None:
            self.records.append(TraceRecord(self.rank, f"{what} chunk {i}", self.launched[i],
                                            time.perf_counter(), "tp comm (async)"))

    def span(self, name: str, t0: float) -> None:
        if self.records is not None:
            self.records.append(TraceRecord(self.rank, name, t0, time.perf_counter(),
                                            "tp matmul"))

    @staticmethod
    def now() -> float:
        return time.perf_counter()


class _Autocast:
    """The autocast state of a forward, restored around its backward (as
    ``torch.amp.custom_bwd`` does), so the chunked matmuls run in the dtype the forward's
    did."""

    def __init__(self, device: torch.device):
        kind = device.type
        self.kind, self.on = kind, torch.is_autocast_enabled(kind)
        self.dtype = torch.get_autocast_dtype(kind)

    def __call__(self):
        return torch.autocast(self.kind, dtype=self.dtype, enabled=self.on)


def _rows(t: torch.Tensor, tp: int, chunks: int, i: int) -> torch.Tensor:
    """Chunk ``i`` of every rank's tokens of ``t`` (b, s, n), (b, tp·c, n), as one tensor."""
    b, s, n = t.shape
    c = s // tp // chunks
    return t.view(b, tp, chunks, c, n)[:, :, i].reshape(b, tp * c, n)


def _put_rows(dst: torch.Tensor, src: torch.Tensor, tp: int, chunks: int, i: int) -> None:
    """The inverse of ``_rows``: ``src`` (b, tp·c, n) into chunk ``i`` of ``dst`` (b, s, n)."""
    b, s, n = dst.shape
    c = s // tp // chunks
    dst.view(b, tp, chunks, c, n)[:, :, i] = src.view(b, tp, c, n)


def _seq_major(t: torch.Tensor) -> torch.Tensor:
    """(b, r, n) -> (r, b, n) contiguous: the sequence leads, so rank blocks concatenate."""
    return t.transpose(0, 1).contiguous()


class _GatherColumns(torch.autograd.Function):
    """The all-gather of a sub-layer's input on the sequence fused with its column-parallel
    matmuls: returns the gathered input (for shapes only, no gradient) and each projection's
    output over the whole sequence. Backward: the input gradient chunk by chunk, each
    chunk reduce-scattered while the next is computed."""

    @staticmethod
    def forward(ctx, x, comm, chunks, trace, *params):
        tp, log = comm.size(AXIS), _Trace(trace, comm)
        b, s_local, h = x.shape
        c = s_local // chunks
        xs = _seq_major(x)  # (s_local, b, h): chunk i is rows [i·c, (i+1)·c)
        parts = [torch.empty((tp * c, b, h), dtype=x.dtype, device=x.device)
                 for _ in range(chunks)]

        def launch(i):
            log.launch(i)
            return comm.all_gather(parts[i], xs[i * c:(i + 1) * c], AXIS, async_op=True)

        gathered = x.new_empty((b, s_local * tp, h))
        weights, biases = params[0::2], params[1::2]
        outs, handle = [None] * len(weights), launch(0)
        for i in range(chunks):
            nxt = launch(i + 1) if i + 1 < chunks else None  # in flight during this matmul
            handle.wait()
            log.waited(i, "all-gather")
            rows = parts[i].transpose(0, 1).contiguous()  # (b, tp·c, h)
            _put_rows(gathered, rows, tp, chunks, i)
            t0 = log.now()
            for j, (w, bias) in enumerate(zip(weights, biases)):
                y = F.linear(rows, w, bias)
                if outs[j] is None:
                    outs[j] = y.new_empty((b, s_local * tp, y.shape[-1]))
                _put_rows(outs[j], y, tp, chunks, i)
            log.span(f"column matmuls chunk {i}", t0)
            handle = nxt
        ctx.comm, ctx.chunks, ctx.trace, ctx.autocast = comm, chunks, trace, _Autocast(x.device)
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(gathered, *params)
        ctx.mark_non_differentiable(gathered)
        ctx.set_materialize_grads(False)
        return (gathered, *outs)

    @staticmethod
    def backward(ctx, _, *grads):
        comm, chunks, log = ctx.comm, ctx.chunks, _Trace(ctx.trace, ctx.comm)
        tp = comm.size(AXIS)
        gathered, *params = ctx.saved_tensors
        weights, biases = params[0::2], params[1::2]
        b, s, h = gathered.shape
        c = s // tp // chunks
        dx = torch.empty((s // tp, b, h), dtype=ctx.x_dtype, device=gathered.device)
        used = [(g, w) for g, w in zip(grads, weights) if g is not None]
        handles, keep = [], []
        with ctx.autocast():
            for i in range(chunks):
                t0 = log.now()
                part = None
                # summed last projection first: the order autograd accumulates the gathered
                # input's gradient in without overlap (its last consumer's backward runs
                # first), so the sums are the same floats
                for g, w in reversed(used):
                    d = _rows(g, tp, chunks, i).reshape(-1, g.shape[-1]).mm(w)
                    part = d if part is None else part + d
                send = _seq_major(part.view(b, tp * c, h).to(ctx.x_dtype))
                keep.append(send)
                log.span(f"column input grad chunk {i}", t0)
                log.launch(i)
                handles.append(comm.reduce_scatter(dx[i * c:(i + 1) * c], send, AXIS,
                                                   async_op=True))
            # the weight gradients: one matmul over the whole sequence each, as without
            # overlap, computed while the last reduce-scatters are in flight
            x2d = gathered.reshape(-1, h)
            out = []
            for g, w, bias in zip(grads, weights, biases):
                if g is None:
                    out += [None, None]
                    continue
                g2d = g.reshape(-1, g.shape[-1])
                out.append(g2d.t().mm(x2d).to(w.dtype))
                out.append(None if bias is None else g2d.sum(0).to(bias.dtype))
        for i, handle in enumerate(handles):
            handle.wait()
            log.waited(i, "reduce-scatter (grad)")
        return (dx.transpose(0, 1).contiguous(), None, None, None, *out)


class _RowInput(torch.autograd.Function):
    """The saved half of a row-parallel projection: keeps its input for the weight gradient
    and passes it on, with a ``carrier`` (a zero-stride placeholder of the output's whole
    shape) through which ``_RowScatter``'s backward hands back the gathered output gradient.
    Apart so that the input is saved before the first reduce-scatter is issued: under
    recompute torch's checkpoint stops once the last saved tensor is rebuilt, so, as without
    overlap, a block's closing reduce-scatter is not re-run (``threefold.accounting.traffic``
    counts it so)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        dtype = matmul_dtype(x)
        ctx.autocast, ctx.has_bias = _Autocast(x.device), bias is not None
        ctx.save_for_backward(x)
        carrier = torch.zeros((), dtype=dtype, device=x.device).expand(
            *x.shape[:-1], weight.shape[0])
        return x.view_as(x), carrier

    @staticmethod
    def backward(ctx, dx, full):
        (x,) = ctx.saved_tensors
        g2d = full.reshape(-1, full.shape[-1])  # the whole gathered gradient: one matmul
        with ctx.autocast():
            dw = g2d.t().mm(x.reshape(-1, x.shape[-1]))
            db = g2d.sum(0) if ctx.has_bias else None
        return dx, dw, db


class _RowScatter(torch.autograd.Function):
    """A row-parallel matmul fused with the reduce-scatter of its output on the sequence:
    chunk i's reduce-scatter is in flight while chunk i+1 is multiplied. Backward: the output
    gradient all-gathered chunk by chunk, each chunk's input gradient computed while the next
    arrives; the gathered gradient goes back through ``carrier`` to ``_RowInput``, which
    makes the weight's. Saves nothing (see ``_RowInput``): the weight, a parameter that lives
    anyway, is held as it is."""

    @staticmethod
    def forward(ctx, x, carrier, comm, chunks, trace, weight, bias):
        tp, log = comm.size(AXIS), _Trace(trace, comm)
        x = x.contiguous()
        b, s, _ = x.shape
        c = s // tp // chunks
        out, handles, keep = None, [], []
        for i in range(chunks):
            t0 = log.now()
            y = F.linear(_rows(x, tp, chunks, i), weight, bias)  # (b, tp·c, h)
            log.span(f"row matmul chunk {i}", t0)
            if out is None:
                out = y.new_empty((s // tp, b, y.shape[-1]))
            send = _seq_major(y)  # rank r's block: its tokens [i·c, (i+1)·c)
            keep.append(send)
            log.launch(i)
            handles.append(comm.reduce_scatter(out[i * c:(i + 1) * c], send, AXIS,
                                               async_op=True))
        for i, handle in enumerate(handles):
            handle.wait()
            log.waited(i, "reduce-scatter")
        ctx.comm, ctx.chunks, ctx.trace, ctx.autocast = comm, chunks, trace, _Autocast(x.device)
        ctx.weight, ctx.x_shape, ctx.x_dtype = weight, x.shape, x.dtype
        return out.transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        comm, chunks, log = ctx.comm, ctx.chunks, _Trace(ctx.trace, ctx.comm)
        tp, weight = comm.size(AXIS), ctx.weight
        b, s, k = ctx.x_shape
        c = s // tp // chunks
        gs = _seq_major(grad)  # (s/tp, b, h)
        h = gs.shape[-1]
        parts = [torch.empty((tp * c, b, h), dtype=gs.dtype, device=gs.device)
                 for _ in range(chunks)]

        def launch(i):
            log.launch(i)
            return comm.all_gather(parts[i], gs[i * c:(i + 1) * c], AXIS, async_op=True)

        full = gs.new_empty((b, s, h))
        dx, handle = None, launch(0)
        with ctx.autocast():
            for i in range(chunks):
                nxt = launch(i + 1) if i + 1 < chunks else None
                handle.wait()
                log.waited(i, "all-gather (grad)")
                rows = parts[i].transpose(0, 1).contiguous()  # (b, tp·c, h)
                _put_rows(full, rows, tp, chunks, i)
                t0 = log.now()
                d = rows.reshape(-1, h).mm(weight).view(b, tp * c, k)
                if dx is None:
                    dx = d.new_empty((b, s, k))
                _put_rows(dx, d, tp, chunks, i)
                log.span(f"row input grad chunk {i}", t0)
                handle = nxt
        return dx.to(ctx.x_dtype), full, None, None, None, None, None


class OverlappedRowLinear(nn.Linear):
    """A row-parallel projection (o_proj, down_proj) under ``parallel.tp_overlap``: returns
    its output already reduce-scattered on the sequence, each chunk's reduce-scatter
    overlapping the next chunk's matmul (``_RowScatter``); the sub-layer then skips its own."""

    comm = None
    chunks = 0  # the wanted count; ``used`` is what the last call's shapes allowed
    used = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of the reduced output."""
        tp = self.comm.size(AXIS)
        self.used = overlap_chunks(x.shape[1] // tp, self.chunks)
        x, carrier = _RowInput.apply(x, self.weight, self.bias)
        return _RowScatter.apply(x, carrier, self.comm, self.used, self.comm.trace,
                                 self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, reduce-scatter in {self.chunks} overlapped chunks"


class GatheredColumnLinear(nn.Linear):
    """A column-parallel projection (q/k/v, gate/up) under ``parallel.tp_overlap``: its
    sub-layer computed its output chunk by chunk as the input was gathered
    (``_GatherColumns``) and hands it over in ``ready`` just before the sub-layer's own
    forward, which calls this projection once; without a handed output it computes as a plain
    Linear."""

    ready = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The output the sub-layer computed for ``x``, or the plain projection."""
        out, self.ready = self.ready, None
        if out is None:
            return super().forward(x)
        if out.shape[:-1] != x.shape[:-1]:
            raise RuntimeError("GatheredColumnLinear: the handed output is not of this input")
        return out


COLUMNS = {"attention": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
ROWS = {"attention": "o_proj", "mlp": "down_proj"}


def sublayer_kind(sub: nn.Module) -> str:
    """"attention" or "mlp": which projections read the sub-layer's input and write its
    output."""
    return "mlp" if hasattr(sub, "down_proj") else "attention"


def overlappable(sub: nn.Module) -> str | None:
    """Why ``sub``'s projections cannot be overlapped (None when they can): every projection
    reading the gathered input must be a plain column-parallel Linear and the last a plain
    row-parallel one (not a replicated k/v, a LoRA adapter or latent attention's latents)."""
    kind = sublayer_kind(sub)
    for name in (*COLUMNS[kind], ROWS[kind]):
        proj = getattr(sub, name, None)
        if type(proj) is not nn.Linear:
            return f"its {name} is {type(proj).__name__}, not a plain column/row-parallel Linear"
    return None


def fuse_columns(sub: nn.Module, x: torch.Tensor, comm, chunks: int, trace) -> torch.Tensor:
    """Gather ``x`` fused with ``sub``'s column projections (``_GatherColumns``): each one's
    output handed to it (``GatheredColumnLinear.ready``); returns the gathered input."""
    projs = [getattr(sub, n) for n in COLUMNS[sublayer_kind(sub)]]
    params = [p for proj in projs for p in (proj.weight, proj.bias)]
    gathered, *outs = _GatherColumns.apply(x, comm, chunks, trace, *params)
    for proj, out in zip(projs, outs):
        proj.ready = out
    return gathered


def chunks_used(model: nn.Module) -> int:
    """The chunks per collective the overlapped sub-layers used in their last forward (0:
    none overlapped)."""
    return max((m.used for m in model.modules() if isinstance(m, OverlappedRowLinear)),
               default=0)
