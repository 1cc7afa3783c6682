"""Activation memory of threefold's pipeline schedules, 1F1B vs GPipe (and interleaved, ZB-H1),
measured per rank and set against the planner's prediction.

    python3 bench/bench_pipeline_memory.py                  # p = 4, m = 8, all four schedules
    python3 bench/bench_pipeline_memory.py --pp 2,4         # one launch per p
    python3 bench/bench_pipeline_memory.py --schedules gpipe,1f1b

Started without torchrun's environment, the script re-launches itself under
``python -m torch.distributed.run --standalone --nproc-per-node p`` (gloo, one OpenMP thread per
rank, glibc's mmap threshold fixed at 1 MiB so that freed tensors go back to the OS and RSS
follows live memory, as bench_dp_zero.py does). Rank r is pipeline stage r (with
interleaved-1f1b, v = 2: stages r and p + r). Each schedule runs ``--warmup`` untimed steps
(they allocate the gradients, which are then zeroed in place so that the measured step grows
no model state), then one measured step of m microbatches. Per rank:

1. ``saved``: the exact peak, over the step, of the bytes autograd keeps for backward.
   ``saved_tensors_hooks`` are entered around every chunk forward (the executor's
   ``micro_context``) and around the loss (the loss function given to the executor, which
   the executor calls outside ``micro_context``). The pack hook counts each saved tensor's
   storage once (a refcount per storage: views and tensors saved by several nodes share it),
   skips storages of parameters (model state, not activations), and returns a small wrapper
   that holds the tensor; the wrapper lives exactly as long as autograd keeps the saved
   tensor, and its ``__del__`` gives the bytes back. So the count falls as backward frees the
   graph, and under ZB-H1 it stays up from B until W (``split_backward.SplitBackward`` retains the
   graph for the weight gradients), which is real memory of that schedule.
2. ``rss``: the growth of peak RSS over the measured step (``start_peak_rss_window`` before,
   ``peak_rss_bytes`` after): the real figure, which also holds what is not a saved tensor
   (below) and allocator noise of a few MiB.
3. the prediction: in-flight microbatches × this rank's activation bytes per microbatch. The
   in-flight count is the planner's ``activations.inflight_microbatches`` (checked equal to
   ``schedules.peak_in_flight``, computed from the action lists); the bytes per microbatch are
   the planner's: ``activations.model_layer_activation_bytes`` (fp32) × the rank's blocks + the
   RoPE tables (``activations.microbatch_extra_bytes``), and on the last rank the head's and
   loss's tensors per microbatch it holds. ``ratio`` is measured / predicted.

Before the steps every chunk runs one microbatch alone under the same hooks: those measured
bytes per microbatch are printed next to the planner's per stage, and the difference next to
what accounts for it (``stage_extra_bytes``): the first stage's embedding keeps the token
ids (int64, 8·b·s, which the planner leaves out), the last stage the final norm's, the head's
and the loss's tensors (``activations.head_saved_bytes``, which the planner adds per microbatch
the last stage holds, ``activations.head_inflight_microbatches``; the per-rank ``predicted``
below includes them). Under interleaving every chunk makes its own RoPE tables (v per
microbatch, the planner counts one). ``exact`` replays this rank's action list with the
measured per-chunk bytes (``schedules.in_flight_chunks`` with weights: + at F, − at BW/W):
measured / exact must be 1 if the in-flight accounting is right.

Not in ``saved`` (but in ``rss``): each stage's output tensor, which the executor holds until
the microbatch's backward (4·b·s·h per microbatch in flight, not a saved tensor: the last
block's residual sum is saved by no node), the receive buffers, ZB-H1's kept gradients at the
weight-gradient joins, and kernels' transient workspace.

Output, on rank 0: the one-microbatch table and its JSON line; the per-rank table through
``bench.common.report`` on ``exact_ratio`` (measured / exact, goal: median >= 0.99) and a JSON
line with the largest deviations from the exact replay (``exact_within_1pct``) and from the
planner; the last stage's measured peak against the planner's whole figure
(``memory.stage_memory``: in-flight activations + its logits term, which also holds the
working set of the microbatch in backward, not a saved tensor); and last, the headline:
the ratio GPipe / 1F1B of rank 0's measured peak, which Narayanan et al. (arXiv 2104.04473
§2.2.1) put at m / min(p, m) (GPipe keeps all m microbatches in flight, 1F1B at most p on the
first stage), goal >= 0.9·m/min(p, m) (1.8 at m = 8, p = 4). Rank 0 is the stage 1F1B is
designed for (the most in flight) and holds no loss extras, so its ratio is that of the
in-flight counts alone.

Measured on the 2-core development machine (defaults: p 4, m 8, microbatch 2×256, h 256,
8 layers, vocab 2048; ~1.5 min): every rank of every schedule saved exactly the action-list
replay (ratio 1.000000); the planner's per-rank prediction is within 1.3% everywhere (exact
but for the first stage's 4 KiB of token ids and interleaving's per-chunk RoPE tables); the
last stage keeps 5.5 MiB more per microbatch than its blocks (0.3 from the final norm and
head input, 4 from the log-softmax). Rank 0: GPipe 122.7 MiB, 1F1B 61.4 MiB, ratio 2.000
(RSS growth 208 vs 119 MiB: ~40-50 MiB of non-saved memory, the held stage outputs and
backward's transients, on top of either). ZB-H1 holds 4 in flight on every rank, as the
planner says, and its RSS grows most on the later ranks (the kept gradients at the
weight-gradient joins). With ``--pp 2``: GPipe/1F1B 4.000 on rank 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (peak_rss_bytes, report, run_ranks,  # noqa: E402
                          start_peak_rss_window)
from threefold.config import ModelConfig  # noqa: E402
from threefold.model.decoder import CausalLM  # noqa: E402
from threefold.schedules.registry import in_flight_chunks
from threefold.schedules import peak_in_flight
from threefold.plan import activations, memory  # noqa: E402

MIB = 2**20
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-1f1b@min", "zb-h1", "zb-v",
             "dualpipe-v")
# name@N: interleaved 1F1B with at most N chunk activations in flight; @min: the least that
# runs, (v-1)·p + 1


def parse_schedule(entry: str, vpp: int, p: int) -> tuple[str, int, int, bool]:
    """(name, v, in-flight bound, V-shaped) of a ``--schedules`` entry ("name", "name@N" or
    "name@min")."""
    from threefold.schedules.registry import schedule_spec

    name, _, bound = entry.partition("@")
    spec = schedule_spec(name)
    v = 2 if spec.vshape else vpp if spec.chunked else 1
    return name, v, (v - 1) * p + 1 if bound == "min" else int(bound or 0), spec.vshape


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (the same in the launcher and in every rank)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # not "--nproc": torchrun's parser would take it for an abbreviation of its own option
    ap.add_argument("--pp", default="4", help="comma-separated stage counts (one launch each)")
    ap.add_argument("--microbatches", type=int, default=8, help="m per step")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--vpp", type=int, default=2, help="v for interleaved-1f1b (the V-shaped "
                    "schedules run 2)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per microbatch (b)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before the measured")
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args(argv)


# --------------------------------------------------------------------------------------------
# Counting what autograd keeps
# --------------------------------------------------------------------------------------------
class _Saved:
    """What autograd stores instead of a saved tensor: the tensor, and a callback giving its
    bytes back when autograd lets go of this object (graph freed after backward)."""

    __slots__ = ("tensor", "release")

    def __init__(self, tensor: torch.Tensor, release):
        self.tensor, self.release = tensor, release

    def __del__(self):
        if self.release is not None:
            self.release()


class SavedActivations:
    """Live and peak bytes of the distinct non-parameter storages autograd holds for backward,
    over every forward run inside ``context()``. A storage is keyed by its address, which no
    other storage can take while a saved tensor (held by our wrapper) keeps it alive."""

    def __init__(self, params):
        self.skip = {q.untyped_storage().data_ptr() for q in params}
        self.refs: dict[int, list[int]] = {}  # address -> [bytes, saved tensors using it]
        self.live = self.peak = 0

    def reset(self) -> None:
        """Start a new peak window at the current live bytes."""
        self.peak = self.live

    def _pack(self, t: torch.Tensor) -> _Saved:
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        if ptr in self.skip or nbytes == 0:
            return _Saved(t, None)
        ref = self.refs.setdefault(ptr, [nbytes, 0])
        if ref[1] == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        ref[1] += 1
        # detached: a saved output would otherwise point back through its grad_fn to the
        # graph holding this wrapper, a cycle freed only by the garbage collector
        return _Saved(t.detach(), functools.partial(self._release, ptr))

    def _release(self, ptr: int) -> None:
        ref = self.refs[ptr]
        ref[1] -= 1
        if ref[1] == 0:
            self.live -= ref[0]
            del self.refs[ptr]

    def context(self):
        """A fresh hooks context (the executor enters one around every forward)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda w: w.tensor)


# --------------------------------------------------------------------------------------------
# Predictions
# --------------------------------------------------------------------------------------------
def planner_shape(args, p: int, v: int = 1, name: str = "1f1b", bound: int = 0):
    """(Layout, Workload) of this bench's run as the planner sees it: fp32 throughout."""
    from threefold.layout import Layout, Workload

    return (Layout(pp=p, vpp=v, microbatch_size=args.micro_batch, schedule=name,
                   pipeline_inflight=bound),
            Workload(seq_len=args.seq_len, global_batch=args.microbatches * args.micro_batch,
                     precision="fp32", residual_bytes=4, master_bytes=4))


def planner_bytes(cfg: ModelConfig, args, blocks: int) -> float:
    """The planner's activation bytes per microbatch for ``blocks`` blocks: its per-block
    bytes and the RoPE tables (``activations.model_layer_activation_bytes``,
    ``activations.microbatch_extra_bytes``)."""
    layout, work = planner_shape(args, 1)
    return (blocks * activations.model_layer_activation_bytes(cfg, layout, work)
            + activations.microbatch_extra_bytes(cfg, layout, work))


def stage_extra_bytes(cfg: ModelConfig, args, first: bool, last: bool) -> float:
    """What a chunk saves per microbatch beyond ``planner_bytes``: the embedding's int64 token
    ids on the first stage (8 per token; the planner leaves them out), and on the last the
    final norm, head and loss tensors the planner counts as ``activations.head_saved_bytes``."""
    layout, work = planner_shape(args, 2)
    return ((8 * args.micro_batch * args.seq_len if first else 0)
            + (activations.head_saved_bytes(cfg, layout, work) if last else 0))


def planner_last_stage(cfg: ModelConfig, args, name: str, p: int, v: int,
                       bound: int = 0) -> tuple[float, float]:
    """The planner's own figures for the last stage (``memory.stage_memory``, fp32): its
    activations (in-flight × per-microbatch bytes) and its logits term (``logits_bytes``,
    the working set of the microbatch in backward, plus ``head_saved_bytes`` for each other
    microbatch in flight)."""
    layout, work = planner_shape(args, p, v, name, bound)
    mb = memory.stage_memory(cfg, layout, work, layout.last_stage)
    return mb.activations, mb.logits


# --------------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------------
def one_microbatch_bytes(chunk, tracker: SavedActivations, mb, cfg) -> int:
    """Saved bytes of one microbatch through ``chunk`` alone (its loss too on the last
    stage); the graph is dropped again without backward."""
    ids, labels = mb
    b, s = ids.shape
    first, last = chunk.model.embed_tokens is not None, chunk.lm_head is not None
    x = ids if first else torch.randn(b, s, cfg.hidden_size, requires_grad=True)
    live0 = tracker.live
    tracker.reset()
    with tracker.context():  # the last stage returns its token losses (the chunked head loss)
        out = chunk(x, position_ids=torch.arange(s).expand(b, s),
                    **({"labels": labels} if last else {}))
    got = tracker.peak - live0
    del out, x
    if tracker.live != live0:
        raise RuntimeError(f"saved tensors outlived their graph: {tracker.live - live0} B")
    return got


def run_schedule(name, chunks, p, m, v, rank, comm, tracker, micro, n_tokens,
                 args, bound: int = 0) -> dict:
    """Warm-up steps, then one measured step of ``name``: peak saved bytes and RSS growth."""
    from threefold.parallel.pipeline.executor import PipelineExecutor

    ex = PipelineExecutor(chunks, name, p, m, v, rank, comm,
                          micro_context=tracker.context, inflight=bound)
    params = [q for c in chunks for q in c.parameters()]

    def zero_grads():  # in place: the measured step then allocates no gradient memory
        for q in params:
            if q.grad is not None:
                q.grad.zero_()

    for _ in range(args.warmup):
        ex.run(micro, n_tokens)
        zero_grads()
    dist.barrier()
    rss0 = start_peak_rss_window()
    tracker.reset()
    t0 = time.perf_counter()
    loss = ex.run(micro, n_tokens)
    seconds = time.perf_counter() - t0
    rss1 = peak_rss_bytes()
    zero_grads()
    return {"saved": tracker.peak, "left": tracker.live, "loss": loss, "seconds": seconds,
            "rss": None if rss0 is None or rss1 is None else rss1 - rss0,
            "actions": ex.actions}


def worker(args: argparse.Namespace) -> None:
    """One rank = one pipeline stage: split the model, measure one microbatch per chunk, then
    every schedule's step; rank 0 prints the tables."""
    from threefold.comm.counted import Comm
    from threefold.comm.distributed import init_distributed, shutdown
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh
    from threefold.parallel.pipeline.stage import split_model

    torch.set_num_threads(1)
    env = init_distributed(device="cpu")
    p, rank, m = env.world_size, env.rank, args.microbatches
    dims = Layout(tp=1, pp=p)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    cfg = ModelConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, tie_word_embeddings=False,
                      max_position_embeddings=max(1024, args.seq_len)).resolved(args.vocab)
    model = CausalLM(cfg)
    model.init_weights(args.seed)
    schedules = {e: parse_schedule(e, args.vpp, p) for e in args.schedules.split(",")}
    shapes = {(v, vshape) for _, v, _, vshape in schedules.values()}  # one split per shape
    chunks = {k: split_model(model, p, k[0], rank, vshape=k[1]) for k in shapes}
    del model  # other ranks' modules go with it
    # this rank's parameters only: the freed storages of the others' may be reused by
    # activations, which would then be skipped
    tracker = SavedActivations({q for cs in chunks.values() for c in cs for q in c.parameters()})

    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(cfg.vocab_size, (m * args.micro_batch, args.seq_len + 1),
                           generator=gen)
    # one storage per microbatch: slices of one batch would share (and count) its storage
    micro = [(tokens[i:i + args.micro_batch, :-1].clone(),
              tokens[i:i + args.micro_batch, 1:].clone())
             for i in range(0, tokens.shape[0], args.micro_batch)]
    n_tokens = m * args.micro_batch * args.seq_len

    per_chunk = {}
    for key, cs in chunks.items():
        per_chunk[key] = [{"stage": c.pipeline_stage, "blocks": len(c.model.layers),
                         "measured": one_microbatch_bytes(c, tracker, micro[0], cfg),
                         "planner": planner_bytes(cfg, args, len(c.model.layers)),
                         "extra_formula": stage_extra_bytes(cfg, args,
                                                            c.model.embed_tokens is not None,
                                                            c.lm_head is not None)}
                        for c in cs]
    results = {}
    for entry, (name, v, bound, vshape) in schedules.items():
        key = (v, vshape)
        r = run_schedule(name, chunks[key], p, m, v, rank, comm, tracker, micro,
                         n_tokens, args, bound)
        blocks = sum(c["blocks"] for c in per_chunk[key])
        r["exact"] = in_flight_chunks(r.pop("actions"),
                                      [c["measured"] for c in per_chunk[key]])
        r["inflight_plan"] = activations.inflight_microbatches(name, p, m, v, rank, bound)
        r["inflight_sched"] = peak_in_flight(name, p, m, v, rank, bound)
        r["predicted"] = r["inflight_plan"] * planner_bytes(cfg, args, blocks)
        layout, work = planner_shape(args, p, v, name, bound)
        if rank == layout.last_stage:  # the head's and loss's tensors, per microbatch held
            r["predicted"] += (activations.head_inflight_microbatches(name, p, m)
                               * activations.head_saved_bytes(cfg, layout, work))
        r["blocks"] = blocks
        results[entry] = r
    everyone = [None] * p
    dist.all_gather_object(everyone, {"chunks": per_chunk, "results": results})
    if rank == 0:
        summarise(args, cfg, p, everyone)
    shutdown()


# --------------------------------------------------------------------------------------------
# Rank 0's report
# --------------------------------------------------------------------------------------------
def summarise(args, cfg: ModelConfig, p: int, ranks: list[dict]) -> None:
    """The per-stage one-microbatch table, the per-rank table and the two JSON lines."""
    m, b, s = args.microbatches, args.micro_batch, args.seq_len
    print(f"\nbench_pipeline_memory: p {p}, m {m}, microbatch {b}x{s}, h {cfg.hidden_size}, "
          f"ffn {cfg.intermediate_size}, {cfg.num_hidden_layers} layers, heads "
          f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} kv, vocab {cfg.vocab_size}, "
          f"fp32, gloo, 1 thread per rank")
    print("\none microbatch through each chunk alone (bytes autograd saves):")
    print(f"{'v':>2} {'stage':>5} {'blocks':>6} {'measured':>12} {'planner':>12} "
          f"{'extra':>10} {'extra_formula':>13}")
    stage_rows = sorted(((k, c) for r in ranks for k, cs in r["chunks"].items() for c in cs),
                        key=lambda kc: (kc[0], kc[1]["stage"]))
    for (v, vshape), c in stage_rows:
        extra = c["measured"] - c["planner"]
        print(f"{v:>1}{'V' if vshape else ' '} {c['stage']:>5} {c['blocks']:>6} "
              f"{c['measured']:>12,} "
              f"{c['planner']:>12,.0f} {extra:>10,.0f} {c['extra_formula']:>13,}")
    print(json.dumps({"benchmark": f"pp{p}_per_microbatch_bytes",
                      "stages": [{"v": k[0], "vshape": k[1], **c} for k, c in stage_rows],
                      "extras_explained": all(c["measured"] - c["planner"] == c["extra_formula"]
                                              for _, c in stage_rows)}))

    rows, exact_dev, plan_dev, leftovers = [], 0.0, 0.0, []
    for name in ranks[0]["results"]:
        for rank, rr in enumerate(ranks):
            r = rr["results"][name]
            infl = r["inflight_plan"]
            if infl != r["inflight_sched"]:
                infl = f"{infl:g}/{r['inflight_sched']:g}(!)"
            rows.append({"schedule": name, "rank": rank, "inflight": infl,
                         "saved_MiB": r["saved"] / MIB, "predicted_MiB": r["predicted"] / MIB,
                         "ratio": r["saved"] / r["predicted"],
                         "exact_ratio": r["saved"] / r["exact"],
                         "rss_MiB": float("nan") if r["rss"] is None else r["rss"] / MIB})
            exact_dev = max(exact_dev, abs(r["saved"] / r["exact"] - 1))
            plan_dev = max(plan_dev, abs(r["saved"] / r["predicted"] - 1))
            if r["left"]:
                leftovers.append((name, rank, r["left"]))
    secs = {n: max(rr["results"][n]["seconds"] for rr in ranks) for n in ranks[0]["results"]}
    print("\nmeasured step per schedule (one step, slowest rank; s): "
          + ", ".join(f"{n} {t:.2f}" for n, t in secs.items()))
    print("saved = peak bytes kept for backward over the step; predicted = planner in-flight x "
          "planner bytes/microbatch; exact = action-list replay of the measured per-chunk "
          "bytes; rss = peak RSS growth over the step\n")
    report(f"pp{p}_m{m}_saved_vs_exact_replay", rows, "exact_ratio", 0.99)
    print(json.dumps({"benchmark": f"pp{p}_m{m}_prediction_checks",
                      "max_abs_dev_exact": exact_dev, "exact_within_1pct": exact_dev <= 0.01,
                      "max_abs_dev_planner": plan_dev,
                      "saved_left_after_step": leftovers}))

    print("\nlast stage, measured saved peak vs the planner's activations + logits term "
          "(stage_memory; the logits term also holds the working set of the microbatch in "
          "backward, which autograd does not save):")
    last = {}
    for entry in ranks[0]["results"]:
        name, v, bound, vshape = parse_schedule(entry, args.vpp, p)
        r = ranks[0 if vshape else -1]["results"][entry]  # the rank of the last stage
        act, logits = planner_last_stage(cfg, args, name, p, v, bound)
        last[entry] = {"saved": r["saved"], "planner_activations": act,
                       "planner_logits": logits, "ratio": r["saved"] / (act + logits)}
        print(f"  {entry:>18}: saved {r['saved'] / MIB:7.1f} MiB; planner {act / MIB:7.1f} + "
              f"{logits / MIB:.1f} = {(act + logits) / MIB:7.1f} MiB (ratio "
              f"{last[entry]['ratio']:.3f})")
    print(json.dumps({"benchmark": f"pp{p}_m{m}_last_stage_vs_planner", "per_schedule": last}))

    res0 = ranks[0]["results"]
    if "gpipe" in res0 and "1f1b" in res0:
        g, o = res0["gpipe"]["saved"], res0["1f1b"]["saved"]
        print(f"\nrank 0 peak saved activations: GPipe {g / MIB:.1f} MiB, 1F1B {o / MIB:.1f} "
              f"MiB; expected ratio m/min(p, m) = {m / min(p, m):g}")
        report(f"pp{p}_m{m}_gpipe_over_1f1b_rank0_activations",
               [{"pp": p, "m": m, "gpipe_MiB": g / MIB, "1f1b_MiB": o / MIB,
                 "gpipe_over_1f1b": g / o}], "gpipe_over_1f1b", 0.9 * m / min(p, m))


def main() -> None:
    """Re-launch under torchrun once per p when started plainly; else be one rank."""
    args = parse_args()
    # fixed mmap threshold: freed tensors go back to the OS, so RSS follows live memory
    sys.exit(run_ranks(__file__, worker, args, [int(x) for x in args.pp.split(",")],
                       {"MALLOC_MMAP_THRESHOLD_": str(2**20)}))


if __name__ == "__main__":
    main()
