"""CPU proxies for the memory-bound work of one transformer block (issue 27, item 2): how many
non-matmul kernels one block's forward + backward launches, and how many bytes they read and
write per token, from torch's profiler. On a GPU these kernels are the step's elementwise share
(a third of the H200 step in GPU-NOTES); on a CPU their count and bytes are what a fused kernel
or a compiled block removes, so a change is measured here before and after.

    python3 bench/bench_elementwise.py                    # the 1.11B GPU shape's block, b 1
    python3 bench/bench_elementwise.py --shape tiny       # seconds; what the test runs

Counted: every outermost aten call of the block's forward and of its backward (one the
dispatcher or autograd makes, not one inside another aten call), less matmuls and the attention
kernel (``MATMUL``) and less calls that move no data (views, shape changes, allocation:
``FREE``; a cast to the dtype a tensor has). Bytes per call: its tensor inputs, read once (the profiler's recorded shapes and
dtypes), plus its largest input again as the output it writes, an estimate (exact for an
elementwise op; a reduction writes less, a cat the sum of its inputs). Under ``--dtype
bfloat16`` the block runs under CPU autocast with fp32 weights, as threefold trains.
Output: a table by op and one JSON line (kernels per block, bytes per token).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MATMUL = {"aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::linear",
          "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
          "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
          "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention"}
FREE = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::transpose", "aten::t",
        "aten::permute", "aten::expand", "aten::as_strided", "aten::unsqueeze", "aten::squeeze",
        "aten::select", "aten::slice", "aten::detach", "aten::empty", "aten::empty_like",
        "aten::empty_strided", "aten::zeros", "aten::resolve_conj", "aten::resolve_neg",
        "aten::alias", "aten::unflatten", "aten::flatten", "aten::split", "aten::chunk",
        "aten::narrow", "aten::contiguous", "aten::lift_fresh", "aten::result_type",
        "aten::_unsafe_view", "aten::split_with_sizes", "aten::unbind", "aten::new_empty",
        "aten::new_empty_strided", "aten::zero_", "aten::fill_", "aten::ones_like",
        "aten::expand_as"}
SHAPES = {"gpu": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                      num_key_value_heads=8, seq=2048),
          "tiny": dict(hidden_size=128, intermediate_size=344, num_attention_heads=4,
                       num_key_value_heads=2, seq=64)}


def _itemsize(dtype: str) -> int:
    """Bytes per element of a profiler dtype name ("float", "c10::BFloat16", "long int")."""
    d = dtype.lower()
    return 2 if ("half" in d or "bfloat16" in d) else 8 if ("double" in d or "long" in d) \
        else 1 if ("bool" in d or "char" in d) else 4


def _bytes(event) -> int:
    """Bytes an op reads (its tensor inputs) and writes (its largest input again)."""
    sizes = [_itemsize(dt) * _numel(shape) for shape, dt in zip(event.input_shapes,
                                                                 event.input_dtypes)
             if shape and dt]
    return sum(sizes) + max(sizes, default=0)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _noop_cast(event) -> bool:
    """A ``to`` that returned its input (same dtype and device): no copy, no kernel."""
    return event.name == "aten::to" and not any(c.name == "aten::_to_copy"
                                                 for c in event.cpu_children)


def _outermost(events):
    """Aten calls whose ancestors hold no aten call (the dispatcher's or autograd's own)."""
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            yield e


def profile_block(shape: str, batch: int, dtype: torch.dtype) -> dict:
    """One block's forward + backward under the profiler: kernels and bytes by op."""
    from threefold.config import ModelConfig
    from threefold.model import LlamaForCausalLM

    dims = dict(SHAPES[shape])
    seq = dims.pop("seq")
    cfg = ModelConfig(preset="tiny", vocab_size=256, num_hidden_layers=1, **dims).resolved()
    model = LlamaForCausalLM(cfg)
    block = model.model.layers[0]
    x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)
    cos, sin = model.model.rotary(torch.arange(seq).expand(batch, seq))
    auto = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 \
        else contextlib.nullcontext()
    with auto:  # once outside the profiler: first-call work is not the block's
        block(x, cos, sin).sum().backward()
    for t in (x, *block.parameters()):  # a step's first micro-batch: no gradient to add to
        t.grad = None
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with auto:
            out = block(x, cos, sin)
        out.backward(torch.ones_like(out))
    count: collections.Counter = collections.Counter()
    nbytes: collections.Counter = collections.Counter()
    for e in _outermost(prof.events()):
        if e.name in MATMUL or e.name in FREE or _noop_cast(e):
            continue
        count[e.name] += 1
        nbytes[e.name] += _bytes(e)
    tokens = batch * seq
    return {"shape": shape, "batch": batch, "dtype": str(dtype).split(".")[-1],
            "kernels": sum(count.values()), "bytes_per_token": sum(nbytes.values()) / tokens,
            "by_op": {k: {"calls": count[k], "bytes_per_token": nbytes[k] / tokens}
                      for k in sorted(count, key=lambda k: -nbytes[k])}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    args = ap.parse_args(argv)
    res = profile_block(args.shape, args.batch, getattr(torch, args.dtype))
    print(f"one block, forward + backward, shape {res['shape']}, batch {res['batch']}, "
          f"{res['dtype']}: {res['kernels']} non-matmul kernels, "
          f"{res['bytes_per_token']:,.0f} bytes per token read + written")
    print(f"{'op':<32} {'calls':>6} {'bytes/token':>12}")
    for op, v in res["by_op"].items():
        print(f"{op:<32} {v['calls']:>6} {v['bytes_per_token']:>12,.0f}")
    print(json.dumps({"benchmark": "elementwise_per_block", **{k: v for k, v in res.items()
                                                               if k != "by_op"}}))
    return res


if __name__ == "__main__":
    main()
