"""threefold data parallel vs torch DDP, and threefold ZeRO-3 vs torch FSDP2, on 4 CPU ranks.

    python3 bench/bench_dp_zero.py [--preset small] [--steps 3] [--warmup 1] [--rounds 2]
    python3 bench/bench_dp_zero.py --preset tiny --steps 3          # a quick run

Started without torchrun's environment, the script re-launches itself once under
``python -m torch.distributed.run --standalone --nproc-per-node 4`` (gloo, one thread per rank)
and runs every configuration in that one launch, alternating them round by round (A B A B,
then B A B A) so that noise from the shared machine falls on both sides of each ratio.

Every configuration is built fresh each round from the same seed, so all four start from the
same weights and see the same batches; the first ``--warmup`` steps of each are not timed.
Same model, data, loss normalisation, AdamW (single-tensor kernel) and gradient clipping on
both sides; what differs is only the engine:

- ``tf_dp``:  threefold ``DataParallelEngine`` (bucketed all-reduce from backward hooks);
- ``ddp``:    ``torch.nn.parallel.DistributedDataParallel`` with its defaults;
- ``tf_z3``:  threefold ``ZeroEngine`` stage 3, units = embedding, each block, norm, head
  (as ``threefold train --parallel.zero_stage 3`` builds it);
- ``fsdp2``:  ``torch.distributed.fsdp.fully_shard`` on each transformer block, then the root
  (which takes the embedding, norm and head as one group).

Reported: tokens/s (slowest rank's time over the timed steps) and the ratios
tf_dp/ddp and tf_z3/fsdp2 (goal >= 1.0, issue 3 item 7); the loss of step 1 of every
configuration (they must agree: same weights, same batch); communication bytes per step that
threefold's ``Comm`` counted per axis, against ZeRO's formulas (2Ψ(N−1)/N and 3Ψ(N−1)/N
elements); and memory per rank, measured two ways inside the same launch:

- ``step_peak_MiB``: peak resident memory (RSS) during the steps, minus the process's RSS
  before the configuration was built: what it keeps (parameters, gradients, optimiser state)
  plus its training-time peak (activations, gathered parameters, communication buffers,
  hidden ones such as DDP's reducer buckets included). Peak RSS is monotonic over a process's
  life, so the heap is trimmed (malloc_trim) and Linux's high-water mark reset
  (/proc/self/clear_refs) before the build and again after it; build-time transients (every
  rank builds the full model before sharding it) are in ``build_peak_MiB`` instead. Each is
  the smallest over rounds (the first configuration of a process pays one-time set-up),
  the largest over ranks. Allocator noise: a few MiB.
- ``state_MiB``: model-state bytes read from the tensors the configuration holds once the
  step's gradients are ready (parameters, gradients, optimiser state, engine buffers
  reachable from Python; storages counted once). Deterministic; DDP's reducer buckets are
  C++-side and not in it (they are in the RSS figure).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (peak_rss_bytes, relaunch_with_torchrun, report,  # noqa: E402
                          start_peak_rss_window, under_torchrun)
from threefold import cost  # noqa: E402
from threefold.config import load_config  # noqa: E402
from threefold.data import BatchSampler, prepare_data  # noqa: E402
from threefold.model import causal_lm_loss  # noqa: E402
from threefold.parallel.engine import make_adamw  # noqa: E402
from threefold.train import build_model, lr_at  # noqa: E402

CONFIGS = ("tf_dp", "ddp", "tf_z3", "fsdp2")
PAIRS = (("tf_dp", "ddp"), ("tf_z3", "fsdp2"))
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (the same in the launcher and in every rank)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="model preset (small; tiny to be quick)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration/round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=2, help="A/B rounds (order flips each round)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--nproc", type=int, default=4, help="ranks (gloo CPU processes)")
    return ap.parse_args(argv)


def bench_config(args: argparse.Namespace):
    """The threefold Config every configuration shares."""
    return load_config(None, [
        ("model.preset", args.preset), ("data.corpus", args.corpus),
        ("data.seq_len", str(args.seq_len)),
        ("train.global_batch_size", str(args.global_batch)),
        ("train.micro_batch_size", str(args.micro_batch)),
        ("train.steps", str(args.warmup + args.steps)), ("train.device", "cpu"),
        ("train.progress", "off"), ("parallel.dp_shard", "-1")])


# --------------------------------------------------------------------------------------------
# One configuration: a model, a way to take one step, and what it holds
# --------------------------------------------------------------------------------------------
@dataclass
class Setup:
    """A built configuration. ``step(x, y, n_tokens, lr, probe)`` runs one optimiser step and
    returns this rank's share of the global mean loss; ``probe`` is called once the gradients
    are synchronised, before the optimiser step. ``held()`` lists the tensors it holds."""

    model: torch.nn.Module
    step: Callable
    held: Callable[[], list]
    comm: object = None
    keep: list = field(default_factory=list)  # engine/optimiser, kept alive until teardown


def _micro(x, y, mb):
    return [(x[i:i + mb], y[i:i + mb]) for i in range(0, x.shape[0], mb)]


def _opt_tensors(opt) -> list:
    return [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def build_threefold(name: str, cfg, mcfg, lay):
    """threefold's engine as the trainer builds it (distributed_layout.build_engine), but
    with its own ``Comm`` so that its bytes are counted apart from the other runs."""
    from threefold.comm import Comm
    from threefold.parallel.data import DataParallelEngine
    from threefold.parallel.zero import ZeroEngine

    model = build_model(mcfg, torch.device("cpu"), cfg.train.seed)
    comm = Comm(lay.dims, lay.mesh)
    if name == "tf_dp":
        eng = DataParallelEngine(model, cfg.optim, comm, cfg.parallel.bucket_mb, axis="dp")
        extra = lambda: [b.flat for b in eng.buckets]  # noqa: E731
    else:
        units = [model.model.embed_tokens, *model.model.layers, model.model.norm,
                 model.lm_head]
        eng = ZeroEngine(model, units, cfg.optim, comm, stage=3)
        extra = lambda: [t for u in eng.all_units for t in (u.full, u.shard, u.shard.grad)]  # noqa: E731
    mb = cfg.train.micro_batch_size

    def step(x, y, n_tokens, lr, probe):
        # the shape of threefold.train.train_step, without its logging all-reduces
        micro = _micro(x, y, mb)
        total = 0.0
        for i, (xi, yi) in enumerate(micro):
            with eng.micro_step(last=i == len(micro) - 1):
                loss = causal_lm_loss(eng.model(xi), yi, reduction="sum") / n_tokens
                loss.backward()
            total += float(loss.detach())
        eng.finish_gradients()
        probe()
        eng.clip_grad_norm(cfg.optim.grad_clip)
        eng.step(lr)
        return total

    def held():
        ps = list(model.parameters())
        return ps + [p.grad for p in ps] + _opt_tensors(eng.optimizer) + extra()

    return Setup(model, step, held, comm, [eng])


def build_torch(name: str, cfg, mcfg, lay, world: int):
    """torch's reference: DDP over the dp group, or FSDP2 per block then the root."""
    from threefold.mesh import submesh

    model = build_model(mcfg, torch.device("cpu"), cfg.train.seed)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, process_group=lay.comm.group("dp"))
        no_sync = wrapped.no_sync
    else:
        from torch.distributed.fsdp import fully_shard

        mesh = submesh(lay.mesh, "dp_shard")
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # FSDP2, like ZeRO-3 here, reduce-scatters on every micro-step (its default)
        wrapped, no_sync = model, contextlib.nullcontext
    opt = make_adamw(model.parameters(), cfg.optim)
    mb = cfg.train.micro_batch_size

    def step(x, y, n_tokens, lr, probe):
        micro = _micro(x, y, mb)
        total = 0.0
        for i, (xi, yi) in enumerate(micro):
            with no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                loss = causal_lm_loss(wrapped(xi), yi, reduction="sum") / n_tokens
                # DDP and FSDP2 average gradients over ranks; scale so the average is the
                # gradient of the global token mean, as threefold's SUM of loss/n_tokens is
                (loss * world).backward()
            total += float(loss.detach())
        probe()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    def held():
        ps = list(model.parameters())
        return ps + [p.grad for p in ps] + _opt_tensors(opt)

    return Setup(model, step, held, None, [wrapped, opt])


def held_bytes(tensors: list) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors by their local shard; a
    released storage counts 0)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


# --------------------------------------------------------------------------------------------
# Running one configuration
# --------------------------------------------------------------------------------------------
def run_config(name, cfg, mcfg, lay, batches, args) -> dict:
    """Build ``name`` fresh, take warm-up + timed steps, measure, tear down. Per-rank figures."""
    world = dist.get_world_size()
    rss0 = start_peak_rss_window()
    torch.manual_seed(cfg.train.seed)
    setup = (build_threefold(name, cfg, mcfg, lay) if name.startswith("tf_")
             else build_torch(name, cfg, mcfg, lay, world))
    build_peak = peak_rss_bytes()
    # a second window for the steps: build-time transients (the full model every rank makes
    # before sharding it) are trimmed away, what the configuration keeps is not
    start_peak_rss_window()
    state = {}

    def probe():
        state["bytes"] = held_bytes(setup.held())

    losses, comm_steps = [], []
    dist.barrier()
    for s, (x, y, n) in enumerate(batches):
        if s == args.warmup:
            dist.barrier()  # every rank starts the timed window together
            t0 = time.perf_counter()
        if setup.comm is not None:
            setup.comm.step_counters()  # open this step's accounting window
        losses.append(setup.step(x, y, n, lr_at(s, cfg), probe))
        if setup.comm is not None and s >= args.warmup:
            comm_steps.append(setup.comm.step_counters())
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    known = None not in (rss0, peak, build_peak)
    out = {"seconds": seconds, "loss0": losses[0], "state_bytes": state["bytes"],
           "peak_rss_bytes": (peak - rss0) if known else None,
           "build_peak_rss_bytes": (build_peak - rss0) if known else None,
           "comm": ({a: statistics.mean(c.get(a, 0) for c in comm_steps)
                     for a in comm_steps[0]} if comm_steps else None)}
    del setup, state
    gc.collect()
    return out


def worker(args: argparse.Namespace) -> None:
    """One rank: build the layout, load the batches once, run every configuration each round,
    gather the figures on rank 0 and print them."""
    from threefold.parallel.distributed_layout import Distributed

    torch.set_num_threads(1)
    cfg = bench_config(args)
    lay = Distributed(cfg)
    data = lay.first_rank_first(lambda: prepare_data(cfg.data))
    mcfg = cfg.model.resolved(data.vocab_size)
    lay.check(cfg, mcfg)
    world = lay.world_size
    sampler = BatchSampler(data.train, cfg.data.seq_len, cfg.train.global_batch_size,
                           cfg.train.seed)
    batches = []  # prepared once, outside every timed window: data loading is not compared
    for s in range(args.warmup + args.steps):
        _, labels = sampler.global_batch(s)
        x, y = sampler.local_batch(s, lay.dp_rank, lay.dp_size)
        batches.append((x, y, int((labels != -100).sum())))

    results = []  # (round, name, per-rank dicts)
    for r in range(args.rounds):
        order = CONFIGS if r % 2 == 0 else tuple(reversed(CONFIGS))
        for name in order:
            mine = run_config(name, cfg, mcfg, lay, batches, args)
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
            results.append((r, name, everyone))
    if lay.rank == 0:
        summarise(args, cfg, mcfg, world, results)
    lay.close()


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------
def _min_over_rounds(results, name: str, key: str, world: int) -> float | None:
    """Max over ranks of each rank's smallest ``key`` over rounds, in MiB. Every round builds
    the same thing, but the first configuration of a process also pays one-time costs (lazy
    library set-up, gloo buffers); the order flips each round, so the minimum skips them."""
    rows = [[ps[k][key] for _, nm, ps in results if nm == name] for k in range(world)]
    if any(v is None for row in rows for v in row):
        return None
    return max(min(row) for row in rows) / MIB


def memory_table(results, world: int, psi: int) -> dict:
    """Print memory per rank and threefold's bytes per step; return them by configuration."""
    n = world
    # ZeRO §7: DP 2Ψ(N−1)/N, stage 3 3Ψ(N−1)/N elements per rank, fp32 here. threefold's
    # figure also holds each unit's padding to a multiple of N and the clip-norm scalar.
    formula = {"tf_dp": 2 * psi * (n - 1) / n * 4, "tf_z3": 3 * psi * (n - 1) / n * 4}
    print("\nmemory per rank (max over ranks; RSS: min over rounds), threefold Comm bytes "
          "per step and rank (max over ranks):")
    fmt = "{:>7} | {:>15} | {:>15} | {:>10} | {:>22} | {:>14}"
    print(fmt.format("config", "step_peak_MiB", "build_peak_MiB", "state_MiB",
                     "comm_bytes/step/rank", "formula"))
    out = {}
    for name in CONFIGS:
        last = [ps for _, nm, ps in results if nm == name][-1]
        step_peak = _min_over_rounds(results, name, "peak_rss_bytes", world)
        build_peak = _min_over_rounds(results, name, "build_peak_rss_bytes", world)
        state = max(p["state_bytes"] for p in last) / MIB
        comm = last[0]["comm"]
        comm_max = max(sum(p["comm"].values()) for p in last) if comm else None
        out[name] = {"step_peak_rss_mib": step_peak, "build_peak_rss_mib": build_peak,
                     "state_mib": state, "comm_bytes_per_step_rank0": comm,
                     "comm_bytes_per_step_max": comm_max, "formula_bytes": formula.get(name)}
        mib = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
        print(fmt.format(name, mib(step_peak), mib(build_peak), f"{state:.1f}",
                         f"{comm_max:,.0f}" if comm else "-",
                         f"{formula[name]:,.0f}" if name in formula else "-"))
    return out


def summarise(args, cfg, mcfg, world, results) -> None:
    """Loss agreement, memory and bytes table, then the two ratio reports (JSON lines)."""
    tok = cfg.train.global_batch_size * cfg.data.seq_len * args.steps
    psi = cost.num_parameters(mcfg)
    print(f"\nbench_dp_zero: {psi / 1e6:.2f}M parameters ({args.preset}), {world} ranks gloo, "
          f"batch {cfg.train.global_batch_size}x{cfg.data.seq_len}, micro {args.micro_batch}, "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds")

    # step-1 loss: global mean = sum over ranks of each rank's share
    loss0 = {name: sum(p["loss0"] for p in ranks) for r, name, ranks in results if r == 0}
    ref = loss0["tf_dp"]
    print("step-1 loss (same weights, same batch): " +
          ", ".join(f"{n} {v:.6f}" for n, v in loss0.items()))
    worst = max(abs(v - ref) / abs(ref) for v in loss0.values())
    print(f"  max relative difference {worst:.1e} -> {'agree' if worst < 1e-5 else 'DIFFER'}")

    memory = memory_table(results, world, psi)
    print(json.dumps({"benchmark": "dp_zero_memory",
                      "memory": "peak RSS a configuration adds per rank, measured in one "
                                "process with /proc/self/clear_refs windows; state = bytes of "
                                "the tensors it holds", "per_config": memory}))

    for a, b in PAIRS:
        rows = []
        for r in range(args.rounds):
            ta = max(p["seconds"] for rr, nm, ps in results if rr == r and nm == a for p in ps)
            tb = max(p["seconds"] for rr, nm, ps in results if rr == r and nm == b for p in ps)
            rows.append({"round": r, f"{a}_tok_s": tok / ta, f"{b}_tok_s": tok / tb,
                         "ratio": (tok / ta) / (tok / tb)})
        print()
        report(f"{a}_vs_{b}", rows, "ratio", 1.0)


def main() -> None:
    """Re-launch under torchrun when started plainly; otherwise be one rank."""
    args = parse_args()
    if not under_torchrun():
        sys.exit(relaunch_with_torchrun(str(Path(__file__).resolve()), sys.argv[1:],
                                        args.nproc))
    worker(args)


if __name__ == "__main__":
    main()
