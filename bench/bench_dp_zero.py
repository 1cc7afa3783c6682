"""threefold data parallel vs torch DDP, and threefold ZeRO-3 vs torch FSDP2, on 4 CPU ranks.

    python3 bench/bench_dp_zero.py [--preset small] [--steps 4] [--warmup 1]
    python3 bench/bench_dp_zero.py --preset tiny --steps 3          # a quick run (~3 min)
    python3 bench/bench_dp_zero.py --pairs dp --ranks 2 --steps 6   # data parallel vs DDP only

The default (small preset) takes about 7 minutes on 2 cores shared with other work: a step of
4 ranks on 2 cores is ~8 s whatever the engine.

Started without torchrun's environment, the script re-launches itself under
``python -m torch.distributed.run --standalone --nproc-per-node 4`` (gloo, one thread per rank)
twice: a memory launch (``--phase memory``: one configuration at a time), then a speed launch
(``--phase speed``) that builds all four configurations side by side and steps them in turn,
step by step, the order flipped every step (A B C D, D C B A, ...): on a machine shared with
other work, load bursts of a few seconds then fall on every configuration alike, which
alternating whole runs did not achieve here (ratios swung 0.6-2.5 between identical runs).

Every configuration starts from the same weights (same seed) and sees the same batches; the
first ``--warmup`` steps are not timed; each step starts at a barrier. Same model, data, loss
normalisation, AdamW (single-tensor kernel) and gradient clipping on both sides; what differs
is only the engine:

- ``tf_dp``:  threefold ``DataParallelEngine`` (bucketed all-reduce from backward hooks, the
  gradients views of the buckets);
- ``ddp``:    ``torch.nn.parallel.DistributedDataParallel`` with its defaults (its gradients
  a copy of its buckets: ``gradient_as_bucket_view`` is off by default);
- ``tf_z3``:  threefold ``ZeroEngine`` stage 3, units = embedding, each block, norm, head
  (as ``threefold train --parallel.zero_stage 3`` builds it);
- ``fsdp2``:  ``torch.distributed.fsdp.fully_shard`` on each transformer block, then the root
  (which takes the embedding, norm and head as one group).

Speed launch: tokens/s per timed step (the slowest rank's time) and the ratios tf_dp/ddp and
tf_z3/fsdp2 per step, their median in the JSON lines and the ratio over all timed steps
(goal >= 1.0 at 2 and 4 ranks), with their spread over the
timed steps (quartiles, min, max); the loss of step 1 of every
configuration (they must agree: same weights, same batch); the bytes threefold's ``Comm``
counted per step, against ZeRO's formulas (2Ψ(N−1)/N and 3Ψ(N−1)/N elements per rank).

Memory launch (``--memory-steps`` steps per configuration, nothing timed), per rank, measured
inside that one launch, largest over ranks:

- ``step_peak_rss``: peak resident memory (RSS) during the steps minus the RSS before the
  configuration was built: what it keeps (parameters, gradients, optimiser state) plus its
  training-time peak (activations, gathered parameters, communication buffers, hidden ones
  such as DDP's reducer buckets). Peak RSS is monotonic over a process's life, so the heap is
  trimmed (malloc_trim) and Linux's high-water mark reset (/proc/self/clear_refs) before the
  build and again after it; the build's own peak (every rank builds the full model before
  sharding it) is ``build_peak_rss``. This launch runs with a fixed glibc mmap threshold
  (MALLOC_MMAP_THRESHOLD_=1 MiB) so that freed tensors go back to the OS and RSS follows live
  memory: with glibc's dynamic threshold the sharded runs' RSS peaks were ~200 MiB higher
  (small preset), memory malloc kept, not memory in use. One warm-up model is built first so
  one-time process set-up is charged to no configuration. Allocator noise: a few MiB.
- ``step_peak ... - ...``: each pair's difference of step peaks (goal for tf_dp: <= DDP).
- ``kept_after_teardown``: RSS still held once the configuration is deleted and garbage
  collected (a leak check; 0 expected).
- ``state``: model-state bytes read from the tensors the configuration holds once the step's
  gradients are ready (parameters, gradients, optimiser state, engine buffers reachable from
  Python; storages counted once). Deterministic; DDP's reducer buckets live in C++ and are
  not in it (they are in the RSS figure).
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
                          spread, start_peak_rss_window, under_torchrun)
from threefold import accounting as cost  # noqa: E402
from threefold.config import load_config  # noqa: E402
from threefold.data import MixtureSampler, prepare_data  # noqa: E402
from threefold.model.decoder import causal_lm_loss  # noqa: E402
from threefold.parallel.engines.adamw import make_adamw
from threefold.training.steps import lr_at  # noqa: E402
from threefold.training.train import build_model  # noqa: E402

CONFIGS = ("tf_dp", "ddp", "tf_z3", "fsdp2")
PAIRS = (("tf_dp", "ddp"), ("tf_z3", "fsdp2"))
PAIR_OF = {"dp": PAIRS[0], "zero3": PAIRS[1]}
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (the same in the launcher and in every rank)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="model preset (small; tiny to be quick)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--ranks", type=int, default=4,
                    help="ranks (gloo CPU processes; not --nproc: torchrun would take it for its own)")
    ap.add_argument("--memory-steps", type=int, default=3,
                    help="steps per configuration in the memory launch (3: from the second on "
                         "optimiser state, gradients and activations coexist; DDP rebuilds its "
                         "buckets after its first step, and only from the third on are the new "
                         "ones resident throughout: at 2 DDP's peak read ~Ψ low)")
    ap.add_argument("--pairs", default="dp,zero3",
                    help="which comparisons to run: dp (tf_dp vs ddp), zero3 (tf_z3 vs fsdp2) "
                         "or both (the default); one pair takes half the time")
    ap.add_argument("--phase", choices=("all", "memory", "speed"), default="all")
    return ap.parse_args(argv)


def chosen(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The configurations and pairs ``--pairs`` selects, in CONFIGS order."""
    names = [x.strip() for x in args.pairs.split(",") if x.strip()]
    bad = [x for x in names if x not in PAIR_OF]
    if bad or not names:
        raise SystemExit(f"--pairs: choose from {', '.join(PAIR_OF)}, got {args.pairs!r}")
    pairs = tuple(PAIR_OF[x] for x in PAIR_OF if x in names)
    return tuple(c for c in CONFIGS if any(c in pr for pr in pairs)), pairs


def bench_config(args: argparse.Namespace, steps: int):
    """The threefold Config every configuration shares (``steps`` sets the lr schedule)."""
    return load_config(None, [
        ("model.preset", args.preset), ("data.corpus", args.corpus),
        ("data.seq_len", str(args.seq_len)),
        ("train.global_batch_size", str(args.global_batch)),
        ("train.micro_batch_size", str(args.micro_batch)),
        ("train.steps", str(steps)), ("train.device", "cpu"),
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


def build(name: str, cfg, mcfg, lay) -> Setup:
    """Configuration ``name`` (one of CONFIGS) on a freshly built model."""
    if name.startswith("tf_"):
        return build_threefold(name, cfg, mcfg, lay)
    return build_torch(name, cfg, mcfg, lay, dist.get_world_size())


def build_threefold(name: str, cfg, mcfg, lay):
    """threefold's engine as the trainer builds it (distributed_world.build_engine), but
    with its own ``Comm`` so that its bytes are counted apart from the other runs."""
    from threefold.comm.counted import Comm
    from threefold.parallel.engines.data_parallel import DataParallelEngine
    from threefold.parallel.engines.zero import ZeroEngine

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
        # the shape of threefold.training.train.train_step, without its logging all-reduces
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
    from threefold.comm.mesh import submesh

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
def measure_memory(name, cfg, mcfg, lay, batches) -> dict:
    """Build ``name`` fresh, take ``len(batches)`` steps, tear down; this rank's RSS windows
    and held-tensor bytes (see the module docstring)."""
    rss0 = start_peak_rss_window()  # also trims what the previous configuration freed
    torch.manual_seed(cfg.train.seed)
    setup = build(name, cfg, mcfg, lay)
    build_peak = peak_rss_bytes()
    # a second window for the steps: build-time transients (every rank builds the full model
    # before sharding it) are trimmed away, what the configuration keeps is not
    start_peak_rss_window()
    state = {}

    def probe():  # the last step's value counts: by then the optimiser state exists
        state["bytes"] = held_bytes(setup.held())

    for s, (x, y, n) in enumerate(batches):
        setup.step(x, y, n, lr_at(s, cfg), probe)
    peak = peak_rss_bytes()
    held = state["bytes"]
    del setup, state
    after = start_peak_rss_window()  # collects garbage and trims first
    known = None not in (rss0, peak, build_peak, after)
    return {"state_bytes": held, "peak_rss_bytes": (peak - rss0) if known else None,
            "build_peak_rss_bytes": (build_peak - rss0) if known else None,
            # should be ~0: whatever a configuration leaves behind once nothing refers to it
            "kept_rss_bytes": (after - rss0) if known else None}


def measure_speed(cfg, mcfg, lay, batches, warmup: int, configs=CONFIGS) -> dict:
    """All four configurations built side by side and stepped in turn, step by step (order
    flipped every step: A B C D, D C B A, ...), so a burst of load from elsewhere on the
    machine hits every configuration alike. Each step starts at a barrier. Returns this
    rank's seconds per timed step, step-1 losses and threefold's bytes per step."""
    setups = {}
    for name in configs:
        torch.manual_seed(cfg.train.seed)
        setups[name] = build(name, cfg, mcfg, lay)
    seconds = {n: [] for n in configs}
    loss0, comm = {}, {n: [] for n in configs if setups[n].comm is not None}
    for s, (x, y, n_tok) in enumerate(batches):
        for name in (configs if s % 2 == 0 else tuple(reversed(configs))):
            setup = setups[name]
            if setup.comm is not None:
                setup.comm.step_counters()  # open this step's accounting window
            dist.barrier()
            t0 = time.perf_counter()
            loss = setup.step(x, y, n_tok, lr_at(s, cfg), lambda: None)
            dt = time.perf_counter() - t0
            loss0.setdefault(name, loss)
            if s >= warmup:
                seconds[name].append(dt)
                if setup.comm is not None:
                    comm[name].append(setup.comm.step_counters())
    return {"seconds": seconds, "loss0": loss0,
            "comm": {n: {a: statistics.mean(c.get(a, 0) for c in cs) for a in cs[0]}
                     for n, cs in comm.items() if cs}}


def prewarm(cfg, mcfg, batches) -> None:
    """One plain forward/backward before any memory window, so that one-time process set-up
    (lazy imports and kernels, ~70 MiB on the first meta-device model build) is not charged
    to whichever configuration happens to run first."""
    model = build_model(mcfg, torch.device("cpu"), cfg.train.seed)
    x, y, n = batches[0]
    mb = cfg.train.micro_batch_size
    (causal_lm_loss(model(x[:mb]), y[:mb], reduction="sum") / n).backward()
    del model
    gc.collect()


def worker(args: argparse.Namespace) -> None:
    """One rank: build the layout, prepare the batches once, run the phase's configurations,
    gather the figures on rank 0 and print them."""
    from threefold.parallel.distributed_world import Distributed

    torch.set_num_threads(1)
    memory = args.phase == "memory"
    configs, pairs = chosen(args)
    warmup = 0 if memory else args.warmup
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    n_steps = args.memory_steps if memory else args.warmup + args.steps
    cfg = bench_config(args, n_steps)
    lay = Distributed(cfg)
    data = lay.first_rank_first(lambda: prepare_data(cfg.data))
    mcfg = cfg.model.resolved(data.vocab_size)
    lay.check(cfg, mcfg)
    sampler = MixtureSampler(data.sources, cfg.data.seq_len, cfg.train.global_batch_size,
                             cfg.train.seed)
    batches = []  # prepared once, outside every timed window: data loading is not compared
    for s in range(n_steps):
        labels = sampler.global_batch(s)["labels"]
        mine = sampler.local_batch(s, lay.dp_rank, lay.dp_size)
        x, y = mine["input_ids"], mine["labels"]
        batches.append((x, y, int((labels != -100).sum())))

    if memory:
        prewarm(cfg, mcfg, batches)
        mine = {name: measure_memory(name, cfg, mcfg, lay, batches) for name in configs}
    else:
        mine = measure_speed(cfg, mcfg, lay, batches, warmup, configs)
    everyone = [None] * lay.world_size
    dist.all_gather_object(everyone, mine)
    if lay.rank == 0:
        psi = cost.num_parameters(mcfg)
        print(f"\nbench_dp_zero [{args.phase}]: {psi / 1e6:.2f}M parameters ({args.preset}), "
              f"{lay.world_size} ranks gloo, batch {cfg.train.global_batch_size}x"
              f"{cfg.data.seq_len}, micro {args.micro_batch}, " +
              (f"{n_steps} steps each" if memory else
               f"{warmup} warm-up + {args.steps} timed steps each, interleaved"), flush=True)
        if memory:
            memory_table(everyone, configs, pairs)
        else:
            speed_report(cfg, lay.world_size, psi, everyone, configs, pairs)
    lay.close()


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------
def memory_table(ranks: list[dict], configs=CONFIGS, pairs=PAIRS) -> None:
    """Print memory per rank (largest over ranks), each pair's difference, and one JSON
    line."""
    fmt = "{:>7} | {:>15} | {:>16} | {:>10} | {:>20}"
    print("memory per rank (largest over ranks), MiB:")
    print(fmt.format("config", "step_peak_rss", "build_peak_rss", "state",
                     "kept_after_teardown"))
    out = {}
    for name in configs:
        def big(key):
            vals = [r[name][key] for r in ranks]
            return None if None in vals else max(vals) / MIB
        out[name] = {"step_peak_rss_mib": big("peak_rss_bytes"),
                     "build_peak_rss_mib": big("build_peak_rss_bytes"),
                     "state_mib": big("state_bytes"),
                     "kept_after_teardown_mib": big("kept_rss_bytes")}
        print(fmt.format(name, *("n/a" if v is None else f"{v:.1f}" for v in out[name].values())))
    diff = {}
    for a, b in pairs:
        pa, pb = out[a]["step_peak_rss_mib"], out[b]["step_peak_rss_mib"]
        if pa is not None and pb is not None:
            diff[f"{a}_minus_{b}"] = pa - pb
            print(f"step peak {a} - {b}: {pa - pb:+.1f} MiB per rank "
                  f"({'<=' if pa <= pb else '>'} {b}; goal <=)")
    print(json.dumps({"benchmark": "dp_zero_memory", "per_rank_mib": out,
                      "step_peak_difference_mib": diff,
                      "method": "RSS windows (malloc_trim + /proc/self/clear_refs) in one "
                                "launch, fixed mmap threshold; state = held tensor bytes"}),
          flush=True)


def speed_report(cfg, world: int, psi: int, ranks: list[dict], configs=CONFIGS,
                 pairs=PAIRS) -> None:
    """Loss agreement, threefold's bytes per step against ZeRO's formulas, then the two ratio
    reports (a row per timed step; each report a table and a JSON line)."""
    loss0 = {name: sum(r["loss0"][name] for r in ranks) for name in configs}
    ref = loss0[configs[0]]
    worst = max(abs(v - ref) / abs(ref) for v in loss0.values())
    print("step-1 loss (same weights, same batch): " +
          ", ".join(f"{n} {v:.6f}" for n, v in loss0.items()) +
          f"; max relative difference {worst:.1e} -> {'agree' if worst < 1e-5 else 'DIFFER'}")

    # ZeRO §7 (arXiv 1910.02054): DP 2Ψ(N−1)/N, stage 3 3Ψ(N−1)/N elements per rank, fp32.
    # threefold's count also holds each unit's padding to a multiple of N and the clip-norm
    # scalar.
    n = world
    formula = {k: v for k, v in (("tf_dp", 2 * psi * (n - 1) / n * 4),
                                 ("tf_z3", 3 * psi * (n - 1) / n * 4)) if k in configs}
    print("threefold Comm bytes sent per rank per step (largest over ranks) vs ZeRO formula:")
    comm_out = {}
    for name in formula:
        got = max(sum(r["comm"][name].values()) for r in ranks)
        comm_out[name] = {"bytes": got, "formula": formula[name], "axes": ranks[0]["comm"][name]}
        print(f"  {name}: {got:,.0f} B {ranks[0]['comm'][name]}; formula {formula[name]:,.0f} B")
    print(json.dumps({"benchmark": "dp_zero_comm_bytes_per_step", "per_config": comm_out}))

    tok = cfg.train.global_batch_size * cfg.data.seq_len
    # a step ends for everyone with the slowest rank: its time is the largest over ranks
    per_step = {name: [max(r["seconds"][name][i] for r in ranks)
                       for i in range(len(ranks[0]["seconds"][name]))] for name in configs}
    for a, b in pairs:
        rows = [{"step": i + 1, f"{a}_tok_s": tok / ta, f"{b}_tok_s": tok / tb, "ratio": tb / ta}
                for i, (ta, tb) in enumerate(zip(per_step[a], per_step[b]))]
        ta, tb = sum(per_step[a]), sum(per_step[b])
        print(f"\n{a} vs {b} over all timed steps: {tok * len(per_step[a]) / ta:,.0f} vs "
              f"{tok * len(per_step[b]) / tb:,.0f} tokens/s, ratio {tb / ta:.3f}; per step "
              "(the JSON line gives the median ratio):")
        report(f"{a}_vs_{b}", rows, "ratio", 1.0)
        print_spread(f"{a}_vs_{b}", [r["ratio"] for r in rows], tb / ta)


def print_spread(name: str, ratios: list[float], overall: float) -> None:
    """The ratio over all timed steps next to its per-step spread (``bench.common.spread``,
    the quartiles ``report`` printed), one line and one JSON line."""
    sp = spread(ratios)
    print(f"{name} ratio: median {sp['median']:.3f}, over all steps {overall:.3f}")
    print(json.dumps({"benchmark": f"{name}_spread", "overall": overall, **sp}), flush=True)


def main() -> None:
    """Re-launch under torchrun when started plainly (memory launch, then speed launch);
    otherwise be one rank of the phase given."""
    args = parse_args()
    if under_torchrun():
        worker(args)
        return
    script, rc = str(Path(__file__).resolve()), 0
    if args.phase in ("all", "memory"):
        # A fixed mmap threshold (glibc's default is dynamic, rising to 32 MiB after the first
        # large free) returns freed tensors to the OS, so RSS follows live memory instead of
        # what malloc kept; it changes allocation cost, so the speed launch runs without it.
        rc |= relaunch_with_torchrun(script, [*sys.argv[1:], "--phase", "memory"], args.ranks,
                                     {"MALLOC_MMAP_THRESHOLD_": str(2**20)})
    if args.phase in ("all", "speed"):
        rc |= relaunch_with_torchrun(script, [*sys.argv[1:], "--phase", "speed"], args.ranks)
    sys.exit(rc)


if __name__ == "__main__":
    main()
