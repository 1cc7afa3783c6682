"""threefold context parallelism vs torch's ``context_parallel`` on 4 CPU ranks (gloo), and
the longest sequence one training step fits in a memory budget on 1 rank vs 4 cp ranks.

    python3 bench/bench_cp.py                        # the defaults below (a few minutes)
    python3 bench/bench_cp.py --rounds 2 --no-longest  # throughput and memory only, quicker
    python3 bench/bench_cp.py --algorithms ring,allgather --budget-mib 384
    python3 bench/bench_cp.py --no-torch --no-longest --sweep-lens 1024,4096  # the sweep only

Started without torchrun's environment, the script re-launches itself under
``python -m torch.distributed.run --standalone --nproc-per-node N`` (gloo, one OpenMP thread
per rank; N = ``--ranks``, default 4, all one cp group). Within the launch the two sides
alternate round by round (A B, then B A, ...) so that noise from the shared machine falls on
both sides of each ratio.

Both sides train threefold's ``CausalLM`` from the same weights (``build_model`` with
one seed, rebuilt every round) on the same batch (random token ids from a fixed seed), fp32,
and take the same steps: forward, summed token cross-entropy of the rank's tokens divided by
the whole batch's token count, backward, one all-reduce of the flattened gradients over the
cp group (the same helper on both sides: cp ranks hold the same weights and each saw a part
of every sequence), AdamW (``make_adamw``). What differs is only how attention is spread:

- ``threefold``: ``apply_context_parallel(model, comm, algorithm)`` and ``shard_batch``
  (chunks r and 2N-1-r of 2N per rank; ring = K/V hops, each step's causal or unmasked
  block through aten's CPU flash kernel, merged by log-sum-exp; allgather = one all-gather of
  K/V then SDPA with a mask);
- ``torch``: ``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=[input
  ids, labels, position ids], buffer_seq_dims=[1, 1, 1])`` around forward and backward: it
  shards the buffers in place with its head-tail load balancer (the same chunks r and
  2N-1-r, so both sides see the same tokens on the same rank, and RoPE sees the global
  positions) and monkey-patches ``F.scaled_dot_product_attention`` so that SDPA runs on
  sequence-sharded DTensors through ``_templated_ring_attention``. Ring = rotate method
  ``alltoall`` (K/V passed to the next rank each step), allgather = torch's default rotate
  method ``allgather``.

torch 2.13 wires its ring only to the CUDA SDPA kernels (flash, memory-efficient, cuDNN): on
CPU, SDPA lowers to ``aten._scaled_dot_product_flash_attention_for_cpu``, which has neither a
CP handler nor a sharding rule, so unmodified ``context_parallel`` fails on the first
attention with ``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu
.default does not have a sharding strategy registered`` (the benchmark checks this again at
start and prints what it got). To have a torch reference at all, this benchmark registers two
handlers for the CPU op and its backward in torch's CP op table (``_attention.custom_ops``)
that do exactly what torch's CUDA handlers do: unwrap the DTensors and call torch's own
``_templated_ring_attention`` / ``_templated_ring_attention_backward`` (its rotaters, load
balance and LSE merge) with the CPU flash kernel as the block op. Everything else is torch's
code, unmodified.

Reported:

1. equivalence: per step, the global loss of both sides and of one process running the whole
   sequence, and the first step's gradient norm (they should agree to ~1e-5);
2. peak memory per rank: peak RSS growth (Linux ``VmHWM`` reset at the start of each
   configuration: model, AdamW state, activations, transients) and the bytes autograd saved
   for backward in one forward (non-parameter storages);
3. tokens/s of each side (slowest rank's wall time over the timed steps) and the ratio
   threefold/torch per round with its spread, goal >= 1.0 (``bench.common.report``);
4. longest sequence (batch 1) for which one training step (build, forward, backward, AdamW)
   grows the process's peak RSS by at most ``--budget-mib`` on every rank: on 1 rank (plain
   model, SDPA's CPU flash kernel) and on the N cp ranks (threefold ring, and torch ring
   unless ``--no-longest-torch``). Doubling from ``--longest-start``, then one bisection step
   between the last length that fit and the first that did not. Measured, not modelled: every
   candidate runs a real step. The budget is a measured peak rather than an enforced cap
   (``RLIMIT_AS``) so that a rank over budget does not die in the middle of a ring and leave
   the others waiting. For this phase glibc serves allocations of 128 KiB and more by mmap
   (``mallopt(M_MMAP_THRESHOLD)``), so the peak follows the live tensors (see
   ``exact_malloc``); phase 1 keeps the default allocator, as training runs.
5. the sweep (``bench/cp_sweep.py``): every algorithm in ``CP_ALGORITHMS`` (or
   ``--algorithms``) at each of ``--sweep-lens`` and ``--sweep-heads``, threefold alone:
   tokens/s, peak memory, saved bytes, the cp bytes of a step measured and in closed form;
   and the attention work of packed rows per cp rank before and after the split by documents.
   Phases 1 and 4 compare with torch where torch has the algorithm (ring, allgather).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (ab_rows, peak_rss_bytes, print_table, report,  # noqa: E402
                          revision, run_ranks, start_peak_rss_window)
from threefold.accounting import num_parameters  # noqa: E402
from bench.cp_sweep import packed_work, print_sweep, sweep  # noqa: E402
from threefold.config import CP_ALGORITHMS, ModelConfig, OptimConfig  # noqa: E402
from threefold.parallel.engines.adamw import make_adamw
from threefold.training.train import build_model  # noqa: E402

SIDES = ("threefold", "torch")
TORCH_ROTATE = {"ring": "alltoall", "allgather": "allgather"}  # torch's rotate method for each
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (the same in the launcher and in every rank)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # not "--nproc": torchrun's parser would take it for an abbreviation of its own option
    ap.add_argument("--ranks", type=int, default=4, help="processes = cp degree")
    ap.add_argument("--algorithms", default="",
                    help="comma-separated, of " + ",".join(CP_ALGORITHMS) + " (default: all); "
                    "against torch: ring (torch rotate 'alltoall'), allgather ('allgather')")
    ap.add_argument("--no-torch", dest="torch", action="store_false",
                    help="skip phase 1 (threefold against torch at --seq-len)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false",
                    help="skip the sweep over lengths, heads and algorithms")
    ap.add_argument("--sweep-lens", default="1024,2048,4096", help="sweep: sequence lengths")
    ap.add_argument("--sweep-heads", default="8:8,8:2",
                    help="sweep: query:kv heads pairs (the preset's width)")
    ap.add_argument("--packed-rows", type=int, default=16,
                    help="sweep: packed rows per length and mixture for the work imbalance")
    ap.add_argument("--preset", default="tiny", help="model preset (tiny: h 256, 4 layers, "
                                                    "8 heads, 4 kv heads)")
    ap.add_argument("--kv-heads", type=int, default=0, help="override the preset's kv heads")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=2048, help="whole-sequence length")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per side/round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=4, help="A/B rounds (order flips each round)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-longest", dest="longest", action="store_false",
                    help="skip the longest-sequence search")
    ap.add_argument("--no-longest-torch", dest="longest_torch", action="store_false",
                    help="search threefold's ring only on N ranks, not torch's too")
    ap.add_argument("--budget-mib", type=float, default=256.0,
                    help="peak RSS growth allowed per rank for one training step")
    ap.add_argument("--longest-start", type=int, default=512)
    ap.add_argument("--longest-max", type=int, default=8192, help="stop doubling here")
    return ap.parse_args(argv)


# --------------------------------------------------------------------------------------------
# torch's CP on CPU: the CPU flash kernel wired into torch's own ring (see the docstring)
# --------------------------------------------------------------------------------------------
def _local(x):
    from torch.distributed.tensor import DTensor

    return x._local_tensor if isinstance(x, DTensor) else x


def _as_seq_sharded(local: torch.Tensor, mesh):
    """``local`` as the rank's part of a DTensor sharded on dim 2 (the sequence)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = list(local.shape)
    shape[2] *= mesh.size()
    stride = torch.empty(shape, dtype=local.dtype, device="meta").stride()
    spec = DTensorSpec(mesh, (Shard(2),),
                       tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


TORCH_SEEN: dict[str, tuple] = {}
"""Shapes torch's ring got at its first call (to report the heads it rotates)."""


def _cpu_flash_forward(op_call, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel import _attention as A

    q, k, v = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("CP: attn_mask is not supported (as on CUDA)")
    mesh = q.device_mesh
    TORCH_SEEN.setdefault("q", tuple(_local(q).shape))
    TORCH_SEEN.setdefault("k", tuple(_local(k).shape))
    out, lse = A._templated_ring_attention(
        mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        _local(q), _local(k), _local(v), is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"))
    return _as_seq_sharded(out, mesh), _as_seq_sharded(lse, mesh)


def _cpu_flash_backward(op_call, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel import _attention as A

    names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
    a = dict(zip(names, args), **kwargs)
    mesh = a["query"].device_mesh
    grads = A._templated_ring_attention_backward(
        mesh.get_group(), 2,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=_local(a["grad_out"]), grad_out_name="grad_out", query=_local(a["query"]),
        key=_local(a["key"]), value=_local(a["value"]), out=_local(a["out"]),
        logsumexp=_local(a["logsumexp"]), is_causal=a["is_causal"],
        dropout_p=a["dropout_p"], scale=a.get("scale"))
    return tuple(_as_seq_sharded(g, mesh) for g in grads[:3])


def register_torch_cpu_cp() -> None:
    """Put the two handlers into torch's CP op table (used while ``context_parallel`` is
    active, next to torch's CUDA ones)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as A

    aten = torch.ops.aten
    A.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _cpu_flash_forward
    A.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = \
        _cpu_flash_backward


def unmodified_torch_cp_error(cp_mesh, heads: int, kv_heads: int) -> str | None:
    """Run one causal SDPA under unmodified ``context_parallel``; its error, or None if it
    works (then the handlers above would not be needed)."""
    from torch.distributed.tensor.experimental import context_parallel

    gen = torch.Generator().manual_seed(0)
    t = 4 * cp_mesh.size()
    q = torch.randn(1, heads, t, 8, generator=gen)
    k, v = (torch.randn(1, kv_heads, t, 8, generator=gen) for _ in range(2))
    try:
        with context_parallel(cp_mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                              no_restore_buffers={q, k, v}):
            F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=kv_heads != heads)
    except Exception as e:  # noqa: BLE001 - reported as it is
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def set_torch_rotate(algorithm: str) -> None:
    """torch's rotate method for ``algorithm``: ring = alltoall (hop to the next rank),
    allgather = allgather."""
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(TORCH_ROTATE[algorithm])


# --------------------------------------------------------------------------------------------
# The sides: each builds a model and returns step(ids, labels) -> global loss
# --------------------------------------------------------------------------------------------
def all_reduce_grads(params, group) -> None:
    """One sum all-reduce of every gradient, flattened (the same on both sides)."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def grad_norm(params) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))


class SavedBytes:
    """Bytes of the distinct non-parameter storages autograd saves for backward (DTensors
    counted by their local tensor), while active."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen: dict[int, int] = {}

    def pack(self, t):
        s = _local(t).untyped_storage()
        if s.data_ptr() not in self.skip:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def make_step(side: str, algorithm: str, mcfg, ocfg, seed, ctx):
    """(step, params) for ``side``: ``step(ids, labels, measure)`` trains once and returns the
    global loss and, with ``measure``, the gradient norm and saved bytes. ``side`` is
    threefold, torch, or single (the plain model on this process alone)."""
    model = build_model(mcfg, torch.device("cpu"), seed)
    if side == "threefold":
        from threefold.parallel.transforms.context import apply_context_parallel

        apply_context_parallel(model, ctx["comm"], algorithm, **ctx.get("hybrid", {}))
    elif side == "torch":
        set_torch_rotate(algorithm)
    params = [p for p in model.parameters()]
    opt = make_adamw(params, ocfg)
    group, cp, rank = ctx.get("group"), ctx.get("cp", 1), ctx.get("rank", 0)

    def loss_of(ids, labels, pos, n_tokens):
        logits = model(ids, pos)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") \
            / n_tokens

    def step(ids, labels, measure=False):
        n_tokens = labels.numel()
        saved = SavedBytes(params)
        hooks = saved.hooks() if measure else _null()
        if side == "single":
            with hooks:
                loss = loss_of(ids, labels, None, n_tokens)
            loss.backward()
        elif side == "threefold":
            from threefold.parallel.transforms.context import shard_batch

            # Ulysses' contiguous slices (all cp ranks, or a hybrid's inner ones)
            whole = {"ulysses": cp} if algorithm == "ulysses" else ctx.get("hybrid", {})
            micro = shard_batch({"input_ids": ids, "labels": labels}, cp, rank, **whole)
            with hooks:
                loss = loss_of(micro["input_ids"], micro["labels"], micro["position_ids"],
                               n_tokens)
            loss.backward()
        else:
            from torch.distributed.tensor.experimental import context_parallel

            b, t = ids.shape
            bufs = [ids.clone(), labels.clone(), torch.arange(t).expand(b, t).contiguous()]
            with context_parallel(ctx["cp_mesh"], buffers=bufs, buffer_seq_dims=[1, 1, 1],
                                  no_restore_buffers=set(bufs)):
                with hooks:
                    loss = loss_of(bufs[0], bufs[1], bufs[2], n_tokens)
                loss.backward()
        if side != "single":
            all_reduce_grads(params, group)
        gnorm = grad_norm(params) if measure else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        if side != "single":
            dist.all_reduce(loss, group=group)
        return float(loss), gnorm, saved.total

    return step


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# --------------------------------------------------------------------------------------------
# Phase 1: throughput, losses, memory at one sequence length
# --------------------------------------------------------------------------------------------
def run_side(side, algorithm, mcfg, ocfg, args, ctx, batch) -> dict:
    """Build ``side`` fresh, take warm-up + timed steps; this rank's figures."""
    torch.manual_seed(args.seed)
    dist.barrier()
    rss0 = start_peak_rss_window()
    step = make_step(side, algorithm, mcfg, ocfg, args.seed, ctx)
    ids, labels = batch
    losses, gnorm, saved = [], None, None
    dist.barrier()
    t0 = time.perf_counter()
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            dist.barrier()  # every rank starts the timed window together
            t0 = time.perf_counter()
        loss, g, sv = step(ids, labels, measure=(s == 0))
        losses.append(loss)
        if s == 0:
            gnorm, saved = g, sv
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    growth = (peak - rss0) if peak is not None and rss0 is not None else float("nan")
    return {"seconds": seconds, "losses": losses, "gnorm": gnorm, "saved": saved,
            "peak_growth": growth}


def single_reference(mcfg, ocfg, args, batch) -> dict | None:
    """Rank 0 alone trains the whole sequence (others wait): the reference losses and the
    time of one process on one core."""
    ctx = {}
    out = None
    if dist.get_rank() == 0:
        torch.manual_seed(args.seed)
        rss0 = start_peak_rss_window()
        step = make_step("single", "ring", mcfg, ocfg, args.seed, ctx)
        losses, gnorm, saved = [], None, None
        for s in range(args.warmup + args.steps):
            if s == args.warmup:
                t0 = time.perf_counter()
            loss, g, sv = step(*batch, measure=(s == 0))
            losses.append(loss)
            if s == 0:
                gnorm, saved = g, sv
        out = {"seconds": time.perf_counter() - t0, "losses": losses, "gnorm": gnorm,
               "saved": saved, "peak_growth": peak_rss_bytes() - rss0}
    dist.barrier()
    return out


# --------------------------------------------------------------------------------------------
# Phase 2: the longest sequence within the budget
# --------------------------------------------------------------------------------------------
def trial(side, algorithm, mcfg, ocfg, args, ctx, seq_len, world_size) -> tuple[bool, float, float]:
    """One training step at ``seq_len`` (batch 1) on ``world_size`` ranks (1: rank 0 alone);
    (fits on every rank, max peak RSS growth MiB, seconds). Collective on the world."""
    growth, seconds = 0.0, 0.0
    if world_size > 1 or dist.get_rank() == 0:
        gen = torch.Generator().manual_seed(args.seed)
        tokens = torch.randint(mcfg.vocab_size, (1, seq_len + 1), generator=gen)
        if world_size > 1:
            dist.barrier()
        rss0 = start_peak_rss_window()
        t0 = time.perf_counter()
        step = make_step(side, algorithm, mcfg, ocfg, args.seed, ctx)
        step(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        seconds = time.perf_counter() - t0
        growth = (peak_rss_bytes() - rss0) / MIB
        del step
    peak = torch.tensor([growth, seconds], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return bool(peak[0] <= args.budget_mib), float(peak[0]), float(peak[1])


def exact_malloc() -> None:
    """glibc: serve every allocation of 128 KiB or more by its own mmap (a fixed threshold,
    not the dynamic one that grows to 32 MiB), so freed tensors go back to the OS at once and
    the peak RSS of a step follows the peak of its live tensors instead of the allocator's
    reuse history (with the default, a longer sequence could show a lower peak)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def longest(side, algorithm, mcfg, ocfg, args, ctx, world_size) -> dict:
    """Doubling from ``--longest-start`` while a step fits, then one bisection step."""
    quantum = 2 * args.ranks * 64  # divisible by 2·cp, on a coarse grid
    tried = []
    fit, over = None, None
    t = args.longest_start
    while t <= args.longest_max:
        ok, mib, sec = trial(side, algorithm, mcfg, ocfg, args, ctx, t, world_size)
        tried.append((t, ok, mib, sec))
        if not ok:
            over = t
            break
        fit = t
        t *= 2
    if fit is not None and over is not None:
        mid = (fit + over) // 2 // quantum * quantum
        if fit < mid < over:
            ok, mib, sec = trial(side, algorithm, mcfg, ocfg, args, ctx, mid, world_size)
            tried.append((mid, ok, mib, sec))
            if ok:
                fit = mid
            else:
                over = mid
    return {"longest": fit, "first_over": over, "tried": tried}


# --------------------------------------------------------------------------------------------
# One launch
# --------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """One rank: the cp mesh, the batch, both sides each round, rank 0 summarises."""
    from threefold.comm.counted import Comm
    from threefold.comm.distributed import init_distributed, shutdown
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh, submesh

    torch.set_num_threads(1)
    env = init_distributed(device="cpu")
    world = env.world_size
    dims = Layout(cp=world)
    mesh = build_mesh(dims, "cpu")
    comm = Comm(dims, mesh)
    cp_mesh = submesh(mesh, "cp")
    ctx = {"comm": comm, "cp_mesh": cp_mesh, "group": comm.group("cp"), "cp": world,
           "rank": comm.rank("cp")}
    over = {"num_key_value_heads": args.kv_heads} if args.kv_heads else {}
    mcfg = ModelConfig(preset=args.preset, vocab_size=args.vocab, **over).resolved()
    mcfg.max_position_embeddings = max(mcfg.max_position_embeddings, args.seq_len,
                                       args.longest_max)
    ocfg = OptimConfig()
    args.algorithm_list = [a for a in args.algorithms.split(",") if a] or list(CP_ALGORITHMS)
    algorithms = [a for a in args.algorithm_list if a in TORCH_ROTATE] if args.torch else []

    unmodified = unmodified_torch_cp_error(cp_mesh, mcfg.num_attention_heads,
                                           mcfg.num_key_value_heads)
    register_torch_cpu_cp()

    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(mcfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    single = single_reference(mcfg, ocfg, args, batch) if algorithms else None
    results = {a: [] for a in algorithms}  # algorithm -> [(round, side, per-rank dicts)]
    for r in range(args.rounds):
        for a in algorithms:
            for side in (SIDES if r % 2 == 0 else tuple(reversed(SIDES))):
                mine = run_side(side, a, mcfg, ocfg, args, ctx, batch)
                everyone = [None] * world
                dist.all_gather_object(everyone, mine)
                results[a].append((r, side, everyone))

    searches = {}
    if args.longest:
        exact_malloc()
        searches["1 rank (plain model, SDPA)"] = longest("single", "ring", mcfg, ocfg, args,
                                                        {}, 1)
        searches[f"{world} ranks threefold ring"] = longest("threefold", "ring", mcfg, ocfg,
                                                           args, ctx, world)
        if args.longest_torch:
            searches[f"{world} ranks torch ring"] = longest("torch", "ring", mcfg, ocfg,
                                                           args, ctx, world)
    swept = sweep(make_step, ocfg, args, ctx) if args.sweep else []
    if env.rank == 0:
        if results or searches:
            summarise(args, mcfg, world, unmodified, single, results, searches)
        print_sweep(swept, packed_work(args, world) if args.sweep else [], world)
    shutdown()


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f}, min {min(values):.3f}, max {max(values):.3f}"


def summarise(args, mcfg, world, unmodified, single, results, searches) -> None:
    tok = args.batch * args.seq_len * args.steps
    print(f"\nbench_cp: {num_parameters(mcfg) / 1e6:.2f}M parameters ({args.preset}: h "
          f"{mcfg.hidden_size}, {mcfg.num_hidden_layers} layers, {mcfg.num_attention_heads} "
          f"heads, {mcfg.num_key_value_heads} kv heads, vocab {mcfg.vocab_size}), fp32, cp "
          f"{world} (gloo, 1 thread per rank, {_cores()} cores), batch "
          f"{args.batch}x{args.seq_len}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.rounds} rounds")
    print(f"threefold at {revision()}")
    print(f"unmodified torch context_parallel on CPU: "
          f"{'works' if unmodified is None else 'fails: ' + unmodified}")
    if unmodified is not None:
        print("  -> torch side below = torch's _templated_ring_attention(_backward) with the "
              "CPU flash kernel registered as its block op (see the docstring)")
    print(f"torch's ring got q {TORCH_SEEN.get('q')} k {TORCH_SEEN.get('k')} per rank "
          f"(B, heads, T/N, d)")
    summary = {"benchmark": f"cp{world}_summary", "unmodified_torch_cp_error": unmodified}
    for a, res in results.items():
        first = {side: ranks for r, side, ranks in res if r == 0}
        print(f"\n== {a} (torch rotate method "
              f"{'alltoall' if a == 'ring' else 'allgather'}) ==")
        rows = []
        for s in range(args.warmup + args.steps):
            row = {"step": s + 1, "single_loss": single["losses"][s] if single else float("nan"),
                   "threefold_loss": first["threefold"][0]["losses"][s],
                   "torch_loss": first["torch"][0]["losses"][s]}
            row["tf-single"] = abs(row["threefold_loss"] - row["single_loss"])
            row["torch-single"] = abs(row["torch_loss"] - row["single_loss"])
            rows.append(row)
        print("losses (round 0; single = one process, whole sequence):")
        print_table(rows, width=14)
        g = {"single": single["gnorm"] if single else float("nan"),
             "threefold": first["threefold"][0]["gnorm"], "torch": first["torch"][0]["gnorm"]}
        print("step-1 gradient norm: " + ", ".join(f"{k} {v:.7g}" for k, v in g.items()))
        worst = max(max(r["tf-single"], r["torch-single"],
                        abs(r["threefold_loss"] - r["torch_loss"])) for r in rows)
        agree = worst < 1e-5 * max(1.0, abs(rows[0]["single_loss"]))
        print(f"largest loss difference {worst:.2e} -> {'agree' if agree else 'DIFFER'}")

        mem = []
        for rank in range(world):
            mem.append({"rank": rank,
                        **{f"{side}_peak_MiB": statistics.median(
                            ranks[rank]["peak_growth"] / MIB for rr, sd, ranks in res
                            if sd == side) for side in SIDES},
                        **{f"{side}_saved_MiB": first[side][rank]["saved"] / MIB
                           for side in SIDES}})
        print("\nmemory per rank (peak RSS growth, median over rounds; autograd saved "
              "tensors, one forward):")
        print_table(mem, width=16)
        if single:
            print(f"one process, whole sequence: peak RSS growth "
                  f"{single['peak_growth'] / MIB:.1f} MiB, saved {single['saved'] / MIB:.1f} "
                  f"MiB, {tok / single['seconds']:.0f} tok/s (rank 0 alone, the others "
                  f"waiting at a barrier)")
        ab = ab_rows(res, args.rounds, tok, cp=world, algo=a)
        print(f"\nthroughput ratio threefold/torch: {_spread([r['ratio'] for r in ab])}")
        summary[a] = {"losses": rows, "gnorm": g, "agree": agree,
                      "peak_MiB": {side: [m[f"{side}_peak_MiB"] for m in mem] for side in SIDES},
                      "saved_MiB": {side: [m[f"{side}_saved_MiB"] for m in mem]
                                    for side in SIDES},
                      "ratio_spread": [r["ratio"] for r in ab]}
        if single:
            summary[a]["single_tok_s"] = tok / single["seconds"]
        results[a] = ab

    if searches:
        print(f"\nlongest sequence, batch 1, one training step, peak RSS growth <= "
              f"{args.budget_mib:.0f} MiB on every rank:")
        for name, s in searches.items():
            tried = ", ".join(f"{t}:{'ok' if ok else 'over'}({mib:.0f}MiB,{sec:.1f}s)"
                              for t, ok, mib, sec in s["tried"])
            print(f"  {name:>32}: {s['longest']}  (first over: {s['first_over']}; {tried})")
        names = list(searches)
        base = searches[names[0]]["longest"]
        for n in names[1:]:
            if base and searches[n]["longest"]:
                print(f"  {n} / 1 rank: {searches[n]['longest'] / base:.2f}x")
        summary["longest"] = {n: {"longest": s["longest"], "first_over": s["first_over"],
                                  "tried": s["tried"]} for n, s in searches.items()}
        summary["budget_mib"] = args.budget_mib
    print(json.dumps(summary))
    # one table and JSON line per algorithm, ring (the comparison) last
    for a in sorted(results, key=lambda a: a == "ring"):
        print()
        report(f"cp{world}_{a}_threefold_vs_torch_context_parallel", results[a], "ratio", 1.0)


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def main() -> None:
    """Re-launch under torchrun (4 ranks by default) when started plainly; else be one rank."""
    args = parse_args()
    sys.exit(run_ranks(__file__, worker, args, [args.ranks]))


if __name__ == "__main__":
    main()
