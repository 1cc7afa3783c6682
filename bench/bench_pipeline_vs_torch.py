"""threefold pipeline executor vs torch.distributed.pipelining, 1F1B on --pp CPU ranks (default 4).

    python3 bench/bench_pipeline_vs_torch.py --pp 2               # 2 stages

    python3 bench/bench_pipeline_vs_torch.py                      # the defaults below
    python3 bench/bench_pipeline_vs_torch.py --rounds 2 --steps 2  # a quick run
    python3 bench/bench_pipeline_vs_torch.py --schedule gpipe      # GPipe vs ScheduleGPipe

The defaults (7.9M parameters, 8 x 128 tokens per step) take about 1.5 minutes on 2 shared
cores: a step of the 4 ranks is ~1-1.7 s with either runtime. Rounds vary by +-30% there
when other work runs on the machine; read the median ratio, not one round.

Started without torchrun's environment, the script re-launches itself under
``python -m torch.distributed.run --standalone --nproc-per-node 4`` (gloo, one OpenMP thread
per rank). Every rank is one pipeline stage: the model (threefold ``CausalLM``) is cut
into 4 stages by ``split_model`` (balanced by parameters, or by FLOPs with ``--balance
flops``) and rank r holds stage r.

Both sides build their stage from the same weights (``init_weights(seed)``), see the same
batch (random token ids from a fixed seed, ``--batch`` sequences cut into ``--microbatches``
equal microbatches; data loading is not compared) and take the same steps: forward and
backward of every microbatch under the same schedule, loss = summed token cross-entropy
/ the batch's token count (so gradients are those of the whole batch; threefold's last stage
computes it with its chunked head loss, which recomputes the head's logits in backward, torch's
with ``causal_lm_loss`` on the stage's logits: the same value),
the step's loss made known on every rank (one all-reduce), then AdamW (``make_adamw``: the
same hyper-parameters and single-tensor kernel) and ``zero_grad``. No gradient clipping. What
differs is only the pipeline runtime:

- ``threefold``: ``PipelineExecutor`` (threefold/parallel/pipeline/executor.py) running the
  checked action list of ``schedules.py``; point-to-point messages through ``Comm``;
- ``torch``: ``torch.distributed.pipelining.PipelineStage`` around the same chunk (a wrapper
  supplies the position ids) and ``Schedule1F1B`` (or ``ScheduleGPipe``), with
  ``scale_grads=False`` and a loss function that already divides by the batch's token count
  (torch's default would divide the summed gradients by the number of microbatches again).

First, untimed: one step of each from the same weights, without the optimiser, compares the
loss (must agree to 1e-5 relative) and every gradient tensor of every stage (largest
difference relative to the largest gradient, must be under 1e-5); any disagreement exits
non-zero. Then both sides are built side by side from the same weights and take ``--warmup``
untimed steps (torch infers its stage shapes in the first), and ``--rounds`` rounds of
``--steps`` timed steps each alternate them (A B, then B A, ...) so that load bursts of the
shared machine fall on both sides of each ratio; all ranks start each round at a barrier.
Time = the slowest rank's wall time. Being the same computation, the two sides stay equal
through the AdamW steps: the last step's losses are printed too.

Reported: the agreement figures, per round tokens/s of each and the ratio threefold/torch
(goal >= 1.0, ``bench.common.report``), and per rank the compute seconds per step (forward,
loss and backward; threefold from the executor's trace records, torch by timing its stage's
``forward_one_chunk``/``backward_one_chunk`` and the loss; the rest of a step is waiting for
a peer, messaging and the optimiser) and the peak RSS growth during a round of each side
(activations, gradients, message buffers; the weights and AdamW state predate it).
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (ab_rows, peak_rss_bytes, report, run_ranks,  # noqa: E402
                          start_peak_rss_window)
from threefold.config import ModelConfig, OptimConfig  # noqa: E402
from threefold.accounting import num_parameters  # noqa: E402
from threefold.model.decoder import CausalLM, causal_lm_loss  # noqa: E402
from threefold.parallel.engines.adamw import make_adamw
from threefold.parallel.pipeline.stage import split_model  # noqa: E402

CONFIGS = ("threefold", "torch")
TOLERANCE = 1e-5  # fp32, same kernels in the same order: differences are rounding only


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (the same in the launcher and in every rank)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    ap.add_argument("--pp", type=int, default=4, help="pipeline stages = ranks (2 or more)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8, help="blocks (at least --pp)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=688, help="SwiGLU inner width")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--microbatches", type=int, default=8, help="m (divides --batch)")
    ap.add_argument("--balance", default="params", choices=("params", "flops"),
                    help="how split_model balances the stages (params: the trainer's default)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per side and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=8, help="A/B rounds (order flips each round)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    if args.batch % args.microbatches:
        ap.error(f"--batch {args.batch} is not a multiple of --microbatches "
                 f"{args.microbatches}")
    if args.pp < 2 or args.layers < args.pp:
        ap.error(f"--pp must be at least 2 and --layers at least --pp (one block per stage)")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The benchmarked shape (untied head: torch's pipelining has no tied-weight sync across
    stages, so both sides are compared without one)."""
    return ModelConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       intermediate_size=args.ffn, max_position_embeddings=args.seq_len,
                       tie_word_embeddings=False).resolved(args.vocab)


def build_stage(mcfg: ModelConfig, seed: int, pp_rank: int, pp: int,
                balance: str = "params") -> CausalLM:
    """This rank's chunk of the whole model initialised from ``seed`` (the same on both
    sides: initialisation is by parameter name)."""
    model = CausalLM(mcfg)
    model.init_weights(seed)
    (chunk,) = split_model(model, pp, 1, pp_rank, balance, mcfg.max_position_embeddings)
    return chunk


class _Timed:
    """Wraps a callable and adds its wall time to ``self.seconds``."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# The two sides: each returns (step(optimise=True) -> loss, compute seconds so far)
# --------------------------------------------------------------------------------------------
def build_threefold(chunk, args, batch, comm, pp_rank):
    """threefold's ``PipelineExecutor`` over this rank's chunk."""
    from threefold.parallel.pipeline.executor import PipelineExecutor

    ids, labels, n_tokens = batch
    mb = args.batch // args.microbatches
    micro = [(ids[i:i + mb], labels[i:i + mb]) for i in range(0, args.batch, mb)]
    ex = PipelineExecutor([chunk], args.schedule, args.pp, args.microbatches, 1, pp_rank, comm)
    opt = make_adamw(chunk.parameters(), OptimConfig())
    busy = [0.0]

    def step(optimise: bool = True) -> float:
        loss = ex.run(micro, n_tokens)  # already all-reduced over the pipeline
        busy[0] += sum(r.end_s - r.start_s for r in ex.records if r.category == "compute")
        if optimise:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    return step, lambda: busy[0]


class _WithPositions(nn.Module):
    """A chunk whose forward takes only its input (what PipelineStage passes on) and supplies
    the position ids 0..T-1 itself, as the threefold executor does for a plain microbatch."""

    def __init__(self, chunk: CausalLM):
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states -> hidden states or logits (last)."""
        b, t = x.shape[:2]
        return self.chunk(x, position_ids=torch.arange(t, device=x.device).expand(b, t))


def build_torch(chunk, args, batch, comm, pp_rank):
    """torch's ``PipelineStage`` + ``Schedule1F1B`` (or ``ScheduleGPipe``) over the same chunk,
    on the default process group (the --pp ranks)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    ids, labels, n_tokens = batch
    stage = PipelineStage(_WithPositions(chunk), pp_rank, args.pp, torch.device("cpu"))
    # Per microbatch: summed CE / the whole batch's token count, as threefold's executor
    # computes it; scale_grads=False, or torch would divide the gradients by m once more.
    loss_fn = lambda out, y: causal_lm_loss(out, y) / n_tokens  # noqa: E731
    cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    sched = cls(stage, args.microbatches, loss_fn=loss_fn, scale_grads=False)
    timers = [_Timed(stage.forward_one_chunk), _Timed(stage.backward_one_chunk),
              _Timed(sched._maybe_compute_loss)]
    stage.forward_one_chunk, stage.backward_one_chunk, sched._maybe_compute_loss = timers
    opt = make_adamw(chunk.parameters(), OptimConfig())

    def step(optimise: bool = True) -> float:
        losses = [] if stage.is_last else None
        sched.step(*((ids,) if stage.is_first else ()),
                   target=labels if stage.is_last else None, losses=losses,
                   return_outputs=False)
        # the step's loss on every rank, as threefold's run() returns it
        loss = torch.zeros(1, dtype=torch.float64)
        if losses:
            loss += sum(float(x.detach()) for x in losses)
        dist.all_reduce(loss)
        if optimise:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss)

    return step, lambda: sum(t.seconds for t in timers)


BUILDERS = {"threefold": build_threefold, "torch": build_torch}


# --------------------------------------------------------------------------------------------
# Agreement check and timed rounds
# --------------------------------------------------------------------------------------------
def check_agreement(mcfg, args, batch, comm, pp_rank) -> dict:
    """One step of each side from the same weights, no optimiser: losses and gradients."""
    out, grads = {}, {}
    for name in CONFIGS:
        chunk = build_stage(mcfg, args.seed, pp_rank, args.pp, args.balance)
        step, _ = BUILDERS[name](chunk, args, batch, comm, pp_rank)
        out[name] = step(optimise=False)
        grads[name] = [q.grad for q in chunk.parameters()]
    diff = max(float((a - b).abs().max()) for a, b in zip(grads["threefold"], grads["torch"]))
    scale = max(float(a.abs().max()) for a in grads["threefold"])
    norm = {n: float(torch.stack([g.norm() for g in gs]).norm()) for n, gs in grads.items()}
    mine = torch.tensor([diff / scale], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    norms = [None] * args.pp
    dist.all_gather_object(norms, norm)
    rel_loss = abs(out["threefold"] - out["torch"]) / abs(out["torch"])
    return {"loss": out, "loss_rel_diff": rel_loss, "grad_rel_diff": float(mine),
            "grad_norm_per_rank": norms,
            "agree": rel_loss < TOLERANCE and float(mine) < TOLERANCE}


def timed_steps(step, busy, args) -> dict:
    """``args.steps`` steps of one side, all ranks starting together; this rank's figures."""
    dist.barrier()
    rss0 = start_peak_rss_window()
    dist.barrier()  # every rank starts the timed window together
    t0, busy0 = time.perf_counter(), busy()
    for _ in range(args.steps):
        loss = step()
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    return {"seconds": seconds, "compute_s": busy() - busy0, "loss": loss,
            "rss_growth": (peak - rss0) if peak is not None and rss0 is not None else None}


def worker(args: argparse.Namespace) -> None:
    """One rank = one stage: the agreement check, the rounds, rank 0 summarises."""
    from threefold.comm.counted import Comm
    from threefold.comm.distributed import init_distributed, shutdown
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh

    torch.set_num_threads(1)
    env = init_distributed(device="cpu")
    PP = args.pp
    if env.world_size != PP:
        raise SystemExit(f"bench_pipeline_vs_torch: needs {PP} ranks, got {env.world_size}")
    dims = Layout(tp=1, pp=PP)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    pp_rank = comm.rank("pp")
    mcfg = model_config(args)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(mcfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    batch = (ids, labels, int((labels != -100).sum()))

    check = check_agreement(mcfg, args, batch, comm, pp_rank)
    if env.rank == 0:
        print_agreement(args, mcfg, check)
    if not check["agree"]:
        shutdown()
        raise SystemExit(1)  # on every rank: the flag was all-reduced

    # Both sides side by side, from the same weights, then warmed up: they take identical
    # steps, so they stay equal, and a round needs no rebuild (more, shorter rounds).
    sides = {}
    for name in CONFIGS:
        chunk = build_stage(mcfg, args.seed, pp_rank, args.pp, args.balance)
        sides[name] = BUILDERS[name](chunk, args, batch, comm, pp_rank)
        for _ in range(args.warmup):
            sides[name][0]()
    results = []  # (round, name, per-rank dicts)
    for r in range(args.rounds):
        for name in (CONFIGS if r % 2 == 0 else tuple(reversed(CONFIGS))):
            mine = timed_steps(*sides[name], args)
            everyone = [None] * PP
            dist.all_gather_object(everyone, mine)
            results.append((r, name, everyone))
    if env.rank == 0:
        summarise(args, results)
    shutdown()


def print_agreement(args, mcfg, check) -> None:
    """The check's figures, as text and a JSON line."""
    print(f"\nbench_pipeline_vs_torch: {num_parameters(mcfg) / 1e6:.2f}M parameters (h "
          f"{mcfg.hidden_size}, {mcfg.num_hidden_layers} layers, {mcfg.num_attention_heads}/"
          f"{mcfg.num_key_value_heads} heads, ffn {mcfg.intermediate_size}, vocab "
          f"{mcfg.vocab_size}), pp {args.pp} (gloo, 1 thread per rank), schedule {args.schedule}, "
          f"batch {args.batch}x{args.seq_len} in {args.microbatches} microbatches, AdamW, "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds", flush=True)
    lo = check["loss"]
    print(f"untimed step, same weights: loss threefold {lo['threefold']:.7f}, torch "
          f"{lo['torch']:.7f} (relative difference {check['loss_rel_diff']:.1e}); largest "
          f"gradient difference / largest gradient over all stages "
          f"{check['grad_rel_diff']:.1e} -> {'agree' if check['agree'] else 'DIFFER'}")
    print("gradient norm per stage: " + ", ".join(
        f"r{r} {n['threefold']:.6g}/{n['torch']:.6g}"
        for r, n in enumerate(check["grad_norm_per_rank"])))
    print(json.dumps({"benchmark": f"pp{args.pp}_{args.schedule}_agreement", **check}), flush=True)


def summarise(args, results) -> None:
    """Throughput table and JSON line, then where each side's time goes, per rank."""
    tok = args.batch * args.seq_len * args.steps
    rows = ab_rows(results, args.rounds, tok)
    last = {name: ranks[0]["loss"] for rr, name, ranks in results if rr == args.rounds - 1}
    print(f"loss of step {args.warmup + args.rounds * args.steps} (AdamW all along): threefold "
          f"{last['threefold']:.7f}, torch {last['torch']:.7f}")
    print("\nper rank, median over rounds: step seconds / compute seconds per step / peak RSS "
          "growth (MiB)")
    for name in CONFIGS:
        runs = [ranks for _, n, ranks in results if n == name]
        cells = []
        for rank in range(args.pp):
            step = statistics.median(rs[rank]["seconds"] for rs in runs) / args.steps
            busy = statistics.median(rs[rank]["compute_s"] for rs in runs) / args.steps
            rss = [rs[rank]["rss_growth"] for rs in runs if rs[rank]["rss_growth"] is not None]
            mib = f"{statistics.median(rss) / 2**20:.0f}" if rss else "n/a"
            cells.append(f"r{rank} {step:.3f}/{busy:.3f}/{mib}")
        print(f"  {name:>9}: " + "  ".join(cells))
    print()
    report(f"pp{args.pp}_{args.schedule}_threefold_vs_torch_pipelining", rows, "ratio", 1.0)


def main() -> None:
    """Re-launch under torchrun with --pp ranks when started plainly; else be one rank."""
    args = parse_args()
    sys.exit(run_ranks(__file__, worker, args, [args.pp]))


if __name__ == "__main__":
    main()
