"""ZeRO-3's FP8 all-gather (``parallel.fp8_all_gather``): a unit holding the weights of
tensorwise FP8 layers (``threefold.parallel.transforms.fp8_linear``) gathers those weights in 8
bits, as torchao's ``enable_fsdp_float8_all_gather`` does for FSDP2.

Each rank takes the amax of its shard's part of every FP8 weight (of the shard rounded to
``param_dtype`` first, the values the layer would otherwise cast); one all-reduce (max) over
the shard axis gives every weight's global amax, in the unit's parameter order; every rank
then derives the same scale (448 / amax, ``fp8._scale``) and casts its shard to e4m3 with it.
The scales need not travel: every rank computes them from the same amaxes. So a gather is
three collectives, issued in this order by every rank:

1. all-reduce (max) of the unit's k FP8-weight amaxes, k fp32;
2. all-gather of the whole padded flat unit as bytes (uint8): the FP8 weights' elements in
   e4m3, every other element (norms, biases) a zero byte, so the shards stay equal;
3. all-reduce (sum) of the unit's other elements in ``param_dtype``, each rank contributing
   its own and zeros elsewhere (x + 0 is x: exact), where the unit has any.

The gathered unit then holds one byte per FP8-weight element plus the others in
``param_dtype``; the FP8 layer multiplies the gathered e4m3 weight with its scale as they are
(forward and grad input), which are the values it would have cast itself: the same result
bit for bit. The weight parameters keep their shape and dtype (autograd and the gradient's
flat buffer need both) on a zero-stride view of one element: nothing reads their values.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from threefold.comm.counted import Handle
from threefold.parallel.engines.flat import FlatUnit
from threefold.parallel.transforms.fp8_cast import E4M3, _cast, _scale


class GatheredWeight:
    """What a ``Float8Linear`` reads under the 8-bit gather (its ``weight8``): its weight's
    e4m3 values and scale in the unit's gathered buffer."""

    def __init__(self, unit: "Fp8FlatUnit", index: int):
        self.unit, self.index = unit, index

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the e4m3 weight, its scale), valid while the unit is gathered."""
        return self.unit.fp8_weight(self.index)


class Fp8FlatUnit(FlatUnit):
    """A ZeRO-3 unit whose parameters ``fp8`` (ids) are FP8 weights gathered in 8 bits
    (module doc); everything else is ``FlatUnit``'s."""

    def __init__(self, name: str, named: list[tuple[str, nn.Parameter]], comm, axis: str,
                 stage: int, fp8: set[int], **kw):
        super().__init__(name, named, comm, axis, stage, **kw)
        self.fp8_index = [j for j, p in enumerate(self.params) if id(p) in fp8]
        self.rest_index = [j for j, p in enumerate(self.params) if id(p) not in fp8]
        self.rest_offsets, n = {}, 0
        for j in self.rest_index:
            self.rest_offsets[j] = n
            n += self.params[j].numel()
        dev = self.shard.device
        # the gathered unit: bytes for the FP8 weights, param_dtype for the rest
        self.full = torch.empty(self.padded, dtype=torch.uint8, device=dev)
        self.rest_full = torch.empty(n, dtype=self.param_dtype, device=dev)
        self.scales = torch.ones(len(self.fp8_index), dtype=torch.float32, device=dev)
        dummy = torch.zeros((), dtype=self.param_dtype, device=dev)
        for j, (p, shape) in enumerate(zip(self.params, self.shapes)):
            if j in self.rest_offsets:
                o = self.rest_offsets[j]
                p.data = self.rest_full.data[o:o + math.prod(shape)].view(shape)
            else:
                p.data = dummy.expand(shape)
        self.full.untyped_storage().resize_(0)
        self.rest_full.untyped_storage().resize_(0)

    def _segments(self, indices: list[int]):
        """(j, a, b): the part [a, b) of parameter j's flat range this rank's shard holds
        (offsets within the shard)."""
        lo = self.comm.rank(self.axis) * self.shard_numel
        for j in indices:
            off, n = self.offsets[j], self.params[j].numel()
            a, b = max(off, lo), min(off + n, lo + self.shard_numel)
            if b > a:
                yield j, a - lo, b - lo

    def fp8_weight(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(parameter ``index``'s gathered e4m3 values, its scale)."""
        if not self.gathered:
            raise RuntimeError(f"{self.name}: an FP8 weight read while the unit is not gathered")
        off, shape = self.offsets[index], self.shapes[index]
        w8 = self.full[off:off + math.prod(shape)].view(E4M3).view(shape)
        return w8, self.scales[self.fp8_index.index(index)]

    def release(self) -> None:
        """Free the gathered bytes and the other parameters (module doc)."""
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.rest_full.untyped_storage().resize_(0)
            self.gathered = False

    @torch.no_grad()
    def start_gather(self) -> None:
        """The amax all-reduce (synchronous: the cast needs it), then the byte all-gather
        and the others' all-reduce, asynchronous (module doc)."""
        if self.gathered or self.gather_handle is not None:
            return
        src = self.shard.data.to(self.param_dtype)  # the values the layer would cast
        amax = torch.zeros(len(self.fp8_index), dtype=torch.float32, device=src.device)
        slot = {j: k for k, j in enumerate(self.fp8_index)}
        fp8_parts = list(self._segments(self.fp8_index))
        for j, a, b in fp8_parts:
            amax[slot[j]] = src[a:b].abs().amax().float()
        self.comm.all_reduce(amax, self.axis, op="max")
        self.scales = _scale(amax, E4M3, False)
        mine = torch.zeros(self.shard_numel, dtype=torch.uint8, device=src.device)
        for j, a, b in fp8_parts:
            mine[a:b] = _cast(src[a:b], self.scales[slot[j]], E4M3).view(torch.uint8)
        self.full.untyped_storage().resize_(self.padded)
        handles = [self.comm.all_gather(self.full.data, mine, self.axis, async_op=True)]
        if self.rest_full.numel():
            self.rest_full.untyped_storage().resize_(
                self.rest_full.numel() * self.rest_full.element_size())
            rest = self.rest_full.data
            rest.zero_()
            lo = self.comm.rank(self.axis) * self.shard_numel
            for j, a, b in self._segments(self.rest_index):
                o = self.rest_offsets[j] + (a + lo - self.offsets[j])
                rest[o:o + b - a].copy_(src[a:b])
            handles.append(self.comm.all_reduce(rest, self.axis, async_op=True))
        self.gather_handle = Handle(handles)  # both collectives, waited as one
