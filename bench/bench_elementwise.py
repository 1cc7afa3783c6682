"""CPU proxies for the memory-bound work of one transformer block: how many
non-matmul kernels one block's forward + backward launches, and how many bytes they read and
write per token, from torch's profiler. On a GPU these kernels are the step's elementwise share
(a third of the H200 step that bench_gpu.py profiled, docs/benchmarks.md); on a CPU their count and
bytes are what a fused kernel or a compiled block removes, so a change is measured here before and
after.

    python3 bench/bench_elementwise.py                    # the 1.11B GPU shape's block, b 1
    python3 bench/bench_elementwise.py --shape tiny       # seconds; what the test runs

Counted: every outermost aten call of the block's forward and of its backward (one the
dispatcher or autograd makes, not one inside another aten call), less matmuls and the attention
kernel (``MATMUL``) and less calls that move no data (views, shape changes, allocation:
``FREE``; a cast to the dtype a tensor has). Bytes per call: its tensor inputs, read once (the
profiler's recorded shapes and dtypes), plus its largest input again as the output it writes, an
estimate (exact for an elementwise op; a reduction writes less, a cat the sum of its inputs). Under
``--dtype bfloat16`` the block runs under CPU autocast with fp32 weights, as threefold trains.
Output: a table by op and one JSON line (kernels per block, bytes per token). ``--compile``
counts the block as ``torch.compile`` runs it: inductor's fused kernels (one each; what they
read and write is not recorded) and the aten calls left outside them.

The LM head and its loss are measured the same way, side by side in one run: the logits path
threefold ran before (the head's whole logits, widened to fp32, then ``F.cross_entropy``) and
the chunked head loss it runs now (``threefold.model.head_loss``), each with its non-matmul kernels,
bytes per token, the peak memory its forward + backward adds (the allocator's peak on a GPU,
the resident high-water mark on a CPU) and the planner's count of the latter
(``activations.logits_bytes``, for the chunked path):

    python3 bench/bench_elementwise.py --head             # vocab 32,768, 2,048 tokens
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
VOCAB = {"gpu": 32768, "tiny": 4096}


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


def _count(events, tokens: int) -> dict:
    """Non-matmul kernels and their bytes per token, by op, from the profiler's events."""
    count: collections.Counter = collections.Counter()
    nbytes: collections.Counter = collections.Counter()
    for e in _outermost(events):
        if e.name in MATMUL or e.name in FREE or _noop_cast(e):
            continue
        count[e.name] += 1
        nbytes[e.name] += _bytes(e)
    return {"kernels": sum(count.values()), "bytes_per_token": sum(nbytes.values()) / tokens,
            "by_op": {k: {"calls": count[k], "bytes_per_token": nbytes[k] / tokens}
                      for k in sorted(count, key=lambda k: -nbytes[k])}}


def _autocast(dtype: torch.dtype):
    return torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 \
        else contextlib.nullcontext()


def profile_head(shape: str, batch: int, dtype: torch.dtype, path: str) -> dict:
    """The head and its loss, forward + backward, as ``path`` runs them: "logits" (whole fp32
    logits, then cross-entropy) or "chunked" (``threefold.model.head_loss``)."""
    import torch.nn.functional as F

    from threefold.layout import Layout, Workload
    from threefold.config import ModelConfig
    from threefold.model.head_loss import LMHead
    from threefold.hardware.metrics import (current_memory_bytes, peak_memory_bytes,
                                            reset_peak_memory)
    from threefold.plan.activations import logits_bytes

    h, vocab, seq = SHAPES[shape]["hidden_size"], VOCAB[shape], SHAPES[shape]["seq"]
    head = LMHead(h, vocab)
    x = torch.randn(batch, seq, h, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq))

    def step():
        with _autocast(dtype):
            if path == "chunked":
                loss = head(x, labels=labels).sum()
            else:
                loss = F.cross_entropy(head(x).float().flatten(0, 1), labels.flatten(),
                                       reduction="sum")
        loss.backward()
        x.grad = head.weight.grad = None

    step()  # first-call work is not the head's
    cpu = torch.device("cpu")
    before = current_memory_bytes(cpu)
    reset_peak_memory(cpu)
    step()
    peak = peak_memory_bytes(cpu) - before
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    d = 2 if dtype != torch.float32 else 4
    cfg = ModelConfig(preset="tiny", hidden_size=h, vocab_size=vocab).resolved()
    work = Workload(seq_len=seq, global_batch=batch, precision="bf16" if d == 2 else "fp32",
                    residual_bytes=4, master_bytes=4)  # fp32 weights, as threefold trains
    return {"path": path, "shape": shape, "batch": batch, "vocab": vocab,
            "dtype": str(dtype).split(".")[-1], "peak_bytes": peak,
            # the loss's working set as the planner counts it, plus the two gradients it
            # makes, which the planner counts with the gradients and the blocks' backward:
            # the weight's (fp32) and the input's (in d, then its fp32 copy)
            "planned_bytes": logits_bytes(cfg, Layout(microbatch_size=batch), work)
            + vocab * h * 4 + batch * seq * h * (d + (4 if d != 4 else 0))
            if path == "chunked" else None,
            **_count(prof.events(), batch * seq)}


def profile_block(shape: str, batch: int, dtype: torch.dtype, compiled: bool = False) -> dict:
    """One block's forward + backward under the profiler: kernels and bytes by op. With
    ``compiled`` the block goes through ``torch.compile`` (inductor) first; its fused kernels
    (inductor's kernel profiling names them) count one each, their bytes are not known."""
    from threefold.config import ModelConfig
    from threefold.model.decoder import CausalLM

    dims = dict(SHAPES[shape])
    seq = dims.pop("seq")
    cfg = ModelConfig(preset="tiny", vocab_size=256, num_hidden_layers=1, **dims).resolved()
    model = CausalLM(cfg)
    block = model.model.layers[0]
    if compiled:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # a named event per fused kernel
        block.compile()
    x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)
    cos, sin = model.model.rotary(torch.arange(seq).expand(batch, seq))
    auto = _autocast(dtype)
    for _ in range(2 if compiled else 1):  # outside the profiler: first-call work
        with auto:
            block(x, cos, sin).sum().backward()
        for t in (x, *block.parameters()):  # a step's first micro-batch: no gradient to add
            t.grad = None
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with auto:
            out = block(x, cos, sin)
        out.backward(torch.ones_like(out))
    fused = sum(1 for e in prof.events() if e.name.startswith("graph_") and "cpp_fused" in e.name)
    res = {"shape": shape, "batch": batch, "dtype": str(dtype).split(".")[-1],
           "compiled": compiled, **_count(prof.events(), batch * seq)}
    res["kernels"] += fused
    res["fused_kernels"] = fused
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--compile", action="store_true",
                    help="the block through torch.compile (inductor): its fused kernels")
    ap.add_argument("--head", action="store_true",
                    help="the LM head and loss, logits path against chunked, not the block")
    args = ap.parse_args(argv)
    if args.head:
        return head_main(args)
    res = profile_block(args.shape, args.batch, getattr(torch, args.dtype), args.compile)
    fused = f" ({res['fused_kernels']} fused by inductor, bytes not counted)" \
        if args.compile else ""
    print(f"one block, forward + backward, shape {res['shape']}, batch {res['batch']}, "
          f"{res['dtype']}{', compiled' if args.compile else ''}: {res['kernels']} non-matmul "
          f"kernels{fused}, {res['bytes_per_token']:,.0f} bytes per token read + written "
          "outside them")
    print(f"{'op':<32} {'calls':>6} {'bytes/token':>12}")
    for op, v in res["by_op"].items():
        print(f"{op:<32} {v['calls']:>6} {v['bytes_per_token']:>12,.0f}")
    print(json.dumps({"benchmark": "elementwise_per_block", **{k: v for k, v in res.items()
                                                               if k != "by_op"}}))
    return res


def head_main(args) -> list[dict]:
    """The head and loss, both paths side by side: a table and one JSON line each."""
    rows = [profile_head(args.shape, args.batch, getattr(torch, args.dtype), path)
            for path in ("logits", "chunked")]
    r = rows[0]
    print(f"LM head + loss, forward + backward, shape {r['shape']} (vocab {r['vocab']:,}), "
          f"{args.batch * SHAPES[args.shape]['seq']:,} tokens, {r['dtype']}")
    print(f"{'path':<8} {'kernels':>8} {'bytes/token':>12} {'peak MB':>9} {'planned MB':>11}")
    for r in rows:
        planned = f"{r['planned_bytes'] / 1e6:,.1f}" if r["planned_bytes"] else "-"
        print(f"{r['path']:<8} {r['kernels']:>8} {r['bytes_per_token']:>12,.0f} "
              f"{r['peak_bytes'] / 1e6:>9,.1f} {planned:>11}")
    for r in rows:
        print(json.dumps({"benchmark": "head_loss", **{k: v for k, v in r.items()
                                                       if k != "by_op"}}))
    return rows


if __name__ == "__main__":
    main()
