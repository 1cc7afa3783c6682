"""The kernel-level choices of the default run's step, each against its alternative at the
default run's shapes (tiny preset: 8 x 256 tokens, hidden 256, SwiGLU 688, 8 query / 4 key-value
heads of 32, vocabulary 4096), forward and backward, fp32, on this machine's CPU threads.

    python3 bench/bench_kernels.py [--rounds 5] [--reps 10] [--threads 2]
    python3 bench/bench_kernels.py --reuse-host-memory   # with threefold's glibc setting

Fused projections, SDPA paths and fewer copies in the loss are the usual levers;
this is what each of them measures here, so that what the model does is a measured choice:

- ``gate_up``: SwiGLU's gate and up projections as two matmuls (threefold, HF's layout) vs
  one matmul of the concatenated weights (the fused kernel layout, split after), both then
  through ``threefold.model.kernels.swiglu``;
- ``qkv``: q, k and v projections as three matmuls vs one of the concatenated weights;
- ``attention``: SDPA's flash kernel for CPU with grouped-query attention (threefold) vs
  SDPA's math path (K/V repeated to every query head);
- ``loss``: the head's matmul and cross-entropy as one chunked function
  (``threefold.model.head_loss``, which recomputes the logits in backward and keeps none) vs the
  whole logits widened to fp32 and ``F.cross_entropy`` (what threefold ran before).

Each round times ``--reps`` forward+backward calls of both sides of every pair, alternating
which goes first; the table gives each pair's ratio (alternative time / threefold time: above
1 means threefold's choice is faster) per round, with its median and spread
(``bench.common.report``). ``--reuse-host-memory`` first applies ``threefold.training.hostmem`` (the
setting ``threefold train`` makes on a CPU), under which the 32 MiB logits buffers are reused
rather than faulted in afresh every call.

Last, the memory side of the same choices (``threefold.model.kernels``, ``model.matmul_input``): the
bytes one tiny block keeps for backward per token, measured from autograd's saved tensors,
fp32 and under bf16 autocast, next to what ``plan.activations.block_activation_bytes`` counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import report  # noqa: E402
from threefold.model.head_loss import linear_cross_entropy  # noqa: E402
from threefold.model.kernels import swiglu  # noqa: E402

B, T, H, FF, HEADS, KV, D, V = 8, 256, 256, 688, 8, 4, 32, 4096


def _pairs():
    """{name: (threefold's callable, the alternative's callable)}, each returning a scalar
    to backpropagate from, on fixed random tensors (which accumulate gradients)."""
    g = torch.Generator().manual_seed(0)

    def param(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    x = torch.randn(B, T, H, generator=g).requires_grad_()
    wg, wu, wd = param(FF, H), param(FF, H), param(H, FF)
    wq, wk, wv = param(HEADS * D, H), param(KV * D, H), param(KV * D, H)
    q = torch.randn(B, HEADS, T, D, generator=g).requires_grad_()
    k = torch.randn(B, KV, T, D, generator=g).requires_grad_()
    v = torch.randn(B, KV, T, D, generator=g).requires_grad_()
    hid = torch.randn(B * T, H, generator=g).requires_grad_()
    head = param(V, H)
    labels = torch.randint(0, V, (B * T,), generator=g)

    def mlp_sep():
        return F.linear(swiglu(F.linear(x, wg), F.linear(x, wu)), wd).sum()

    def mlp_fused():
        gate, up = F.linear(x, torch.cat([wg, wu])).split(FF, dim=-1)
        return F.linear(swiglu(gate, up), wd).sum()

    def qkv_sep():
        return F.linear(x, wq).sum() + F.linear(x, wk).mean() + F.linear(x, wv).std()

    def qkv_fused():
        a, b, c = F.linear(x, torch.cat([wq, wk, wv])).split([HEADS * D, KV * D, KV * D], -1)
        return a.sum() + b.mean() + c.std()

    def attn_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=True).sum()

    def attn_math():
        rep = HEADS // KV
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                                  v.repeat_interleave(rep, 1),
                                                  is_causal=True).sum()

    def loss_chunked():
        return linear_cross_entropy(hid, head, labels).sum()

    def loss_logits():
        return F.cross_entropy(F.linear(hid, head).float(), labels, reduction="sum")

    # the two sides compute the same numbers: check once before timing
    for a, b in ((mlp_sep, mlp_fused), (qkv_sep, qkv_fused), (attn_flash, attn_math),
                 (loss_chunked, loss_logits)):
        va, vb = a().item(), b().item()
        assert abs(va - vb) <= 1e-4 * max(1.0, abs(va)), (a.__name__, va, vb)
    return {"gate_up": (mlp_sep, mlp_fused), "qkv": (qkv_sep, qkv_fused),
            "attention": (attn_flash, attn_math), "loss": (loss_chunked, loss_logits)}


def _saved_bytes_per_token(dtype: torch.dtype) -> tuple[float, float]:
    """(bytes one tiny-preset block keeps for backward per token, measured from autograd's
    saved tensors (distinct storages; weights, their autocast copies and the fp32 RoPE tables
    excluded); what
    ``block_activation_bytes`` counts for it), fp32 or under bf16 autocast with the fp32
    residual stream."""
    import contextlib

    from threefold.accounting import layer_parameters_per_rank
    from threefold.config import ModelConfig
    from threefold.model.decoder import CausalLM
    from threefold.plan.activations import block_activation_bytes

    cfg = ModelConfig(preset="tiny", vocab_size=512).resolved()
    model = CausalLM(cfg)
    x = torch.randn(B, T, H, requires_grad=True)
    cos, sin = model.model.rotary(torch.arange(T).expand(B, T))
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), cos, sin)}
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            storages[st.data_ptr()] = st.nbytes()
        return t

    auto = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 \
        else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), auto:
        model.model.layers[0](x, cos, sin)
    d = 2 if dtype == torch.bfloat16 else 4
    counted = block_activation_bytes(1, H, HEADS, KV, D, FF, act_bytes=d, residual_bytes=4)
    # under autocast the block's weights cast to bf16 are saved too: once per microbatch, not
    # per token (the planner counts them apart, plan.memory.cast_weight_bytes)
    cast = 0 if d == 4 else d * layer_parameters_per_rank(cfg, 1)[0]
    return (sum(storages.values()) - cast) / (B * T), counted


def held_after_forward(block, x, cos, sin, dtype) -> int:
    """Bytes allocated during ``block``'s forward and still held after it, less its output:
    what it keeps for backward, whatever keeps it (autograd or a checkpoint's cache), from the
    profiler's net allocations of the outermost ops."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    auto = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else \
        contextlib.nullcontext()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, auto:
        y = block(x, cos, sin)
    held = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None)
    return held - y.numel() * y.element_size()


def _selective_bytes_per_token(dtype: torch.dtype) -> tuple[float, float]:
    """(bytes one tiny-preset block keeps per token under selective recompute, measured as
    what its forward leaves allocated, per token between two lengths; what
    ``selective_block_bytes`` counts for it, less the block's input, made outside)."""
    from threefold.config import ModelConfig
    from threefold.model.decoder import CausalLM
    from threefold.parallel.transforms.recompute import apply_recompute
    from threefold.plan.selective import selective_block_bytes

    cfg = ModelConfig(preset="tiny", vocab_size=512, num_hidden_layers=1).resolved()
    model = CausalLM(cfg)
    apply_recompute(model, "selective")
    held = []
    for t in (T, 2 * T):
        x = torch.randn(B, t, H, requires_grad=True)
        cos, sin = model.model.rotary(torch.arange(t).expand(B, t))
        held.append(held_after_forward(model.model.layers[0], x, cos, sin, dtype))
    d = 2 if dtype == torch.bfloat16 else 4
    counted = selective_block_bytes(1, H, HEADS, KV, D, FF, act_bytes=d, residual_bytes=4)
    return (held[1] - held[0]) / (B * T), counted - 4 * H


def _counted_per_token() -> dict:
    """What the planner counts per token per layer (bf16 autocast, fp32 residual) for the
    1.11B GPU shape and Llama 3 8B: no recompute, selective, full."""
    from threefold.config import ModelConfig
    from threefold.plan.activations import block_activation_bytes
    from threefold.plan.selective import selective_block_bytes

    shapes = {"1.11B": ModelConfig(preset="tiny", vocab_size=32768, hidden_size=2048,
                                   intermediate_size=8192, num_attention_heads=32,
                                   num_key_value_heads=8).resolved(),
              "llama3-8b": ModelConfig(preset="llama3-8b").resolved()}
    out = {}
    for name, c in shapes.items():
        args = (1, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                c.intermediate_size)
        out[name] = {"none": block_activation_bytes(*args, act_bytes=2, residual_bytes=4),
                     "selective": selective_block_bytes(*args, act_bytes=2, residual_bytes=4),
                     "full": 4 * c.hidden_size}
    return out


def _time(fn, reps: int) -> float:
    """Median seconds of one forward+backward of ``fn`` over ``reps`` calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn().backward()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    """Time every pair over the rounds and print one table (and JSON line) per pair."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="timed calls per side and round")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--reuse-host-memory", action="store_true",
                    help="apply threefold.training.hostmem first, as threefold train does on a CPU")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.reuse_host_memory:
        from threefold.training.hostmem import reuse_freed_host_memory

        print("host memory reuse:", reuse_freed_host_memory(256.0))
    pairs = _pairs()
    for ours, alt in pairs.values():  # warm-up
        _time(ours, 2), _time(alt, 2)
    rows: dict[str, list[dict]] = {name: [] for name in pairs}
    for r in range(args.rounds):
        for name, (ours, alt) in pairs.items():
            first, second = (ours, alt) if r % 2 == 0 else (alt, ours)
            t = {first: _time(first, args.reps), second: _time(second, args.reps)}
            rows[name].append({"round": r, "threefold_ms": 1e3 * t[ours],
                               "alternative_ms": 1e3 * t[alt], "ratio": t[alt] / t[ours]})
    print(f"bench_kernels: {args.threads} threads, {args.rounds} rounds of {args.reps} calls; "
          "ratio = alternative / threefold (above 1: threefold's choice is faster)")
    for name in pairs:
        print(f"\n{name}: threefold = {pairs[name][0].__name__}, alternative = "
              f"{pairs[name][1].__name__}")
        report(f"kernels_{name}", rows[name], "ratio", 1.0)
    for bench, fn, how in (
            ("kernels_saved_bytes_per_token", _saved_bytes_per_token,
             "activations one tiny block keeps per token, {}: {:,.0f} bytes measured "
             "(autograd's saved tensors), {:,.0f} counted (plan.activations."
             "block_activation_bytes)"),
            ("kernels_selective_bytes_per_token", _selective_bytes_per_token,
             "selective recompute, one tiny block per token, {}: {:,.0f} bytes held after its "
             "forward (less its input), {:,.0f} counted (plan.activations."
             "selective_block_bytes less the input)")):
        figures = {}
        for name, dt in (("fp32", torch.float32), ("bf16 autocast", torch.bfloat16)):
            measured, counted = fn(dt)
            figures[name] = {"measured": measured, "counted": counted}
            print("\n" + how.format(name, measured, counted))
        print(json.dumps({"benchmark": bench, **figures}))
    counts = _counted_per_token()
    for name, c in counts.items():
        print(f"counted per token per layer, {name}, bf16 autocast: none {c['none']:,.0f}, "
              f"selective {c['selective']:,.0f}, full {c['full']:,.0f}")
    print(json.dumps({"benchmark": "kernels_counted_bytes_per_token", **counts}))
    print(json.dumps({"benchmark": "kernels", "threads": args.threads,
                      "reuse_host_memory": args.reuse_host_memory}))


if __name__ == "__main__":
    main()
