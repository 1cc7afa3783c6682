"""Measured pipeline idle fraction of real runs vs the simulator, for every schedule.

    python3 bench/bench_pipeline_idle.py                 # pp 2, the defaults below
    python3 bench/bench_pipeline_idle.py --pp 4          # 4 ranks (on a 2-core machine the
                                                         # ranks share cores: see below)

Started without torchrun's environment, the script re-launches itself under
``python -m torch.distributed.run --standalone --nproc-per-node P`` (gloo, one OpenMP thread
per rank). Every rank is one pipeline stage of a Llama model cut by ``split_model``; each
schedule (GPipe, 1F1B, interleaved 1F1B with v = 2 and Megatron's warm-up or bounded to the
fewest chunk activations in flight that run, ZB-H1, ZB-V, DualPipeV) trains ``--steps`` steps of
``--microbatches`` microbatches through ``PipelineExecutor`` after one warm-up step.

Per step, every rank's trace records (``executor.records``: each compute action, each
communication batch with its wait, on the machine's one monotonic clock) are gathered and:

- ``measured``: ``idle_fraction`` of the step: 1 − compute time / (ranks × makespan), the
  makespan from the first compute start to the last compute end;
- ``simulated``: the simulator's ``bubble_fraction`` for the same action lists replayed with
  the per-(kind, stage) action times and transfer time measured in this run
  (``simulate.measured_costs``: medians over the steps) — what ``threefold schedule`` predicts
  when given this machine's costs;
- ``unit``: the textbook bubble (every action one unit, free messages), for reference.

The goal: measured within 10% of simulated (``|measured − simulated| / simulated``),
reported per schedule with the median of the steps. Caveat: with more ranks than cores
(``--pp 4`` on 2 cores) a waiting rank hands its core to a computing one, so action times
depend on what the neighbours do and no per-action cost model can be exact; use pp ≤ cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, run_ranks  # noqa: E402
from threefold.config import ModelConfig  # noqa: E402
from threefold.model.decoder import CausalLM  # noqa: E402
from threefold.parallel.pipeline.executor import PipelineExecutor, idle_fraction  # noqa: E402
from threefold.schedules.simulate import measured_costs
from threefold.schedules import simulate

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b@min", 2),
             ("zb-h1", 1), ("zb-v", 2), ("dualpipe-v", 2))
# name@N: at most N chunk activations in flight; @min: the least that runs, (v-1)·p + 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (the same in the launcher and in every rank)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4, help="measured steps per schedule")
    ap.add_argument("--schedules", default=",".join(n for n, _ in SCHEDULES),
                    help="comma-separated subset of " + ",".join(n for n, _ in SCHEDULES))
    ap.add_argument("--goal", type=float, default=0.10,
                    help="largest |measured - simulated| / simulated that meets the goal")
    return ap.parse_args(argv)


def run_schedule(args, entry: str, v: int, comm) -> dict:
    """Train ``args.steps`` (+1 warm-up) steps under one schedule ("name" or "name@bound")
    on this rank; returns, on rank 0, the figures of the table (None elsewhere)."""
    from threefold.schedules.registry import schedule_spec

    p, m, rank = args.pp, args.microbatches, dist.get_rank()
    name, _, bound = entry.partition("@")
    bound = (v - 1) * p + 1 if bound == "min" else int(bound or 0)
    cfg = ModelConfig(hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 8 * 8,
                      num_hidden_layers=args.layers, num_attention_heads=4,
                      num_key_value_heads=2).resolved(args.vocab)
    from threefold.parallel.pipeline.stage import split_model

    model = CausalLM(cfg)
    model.init_weights(0)
    chunks = split_model(model, p, v, rank, vshape=schedule_spec(name).vshape)
    del model
    ex = PipelineExecutor(chunks, name, p, m, v, rank, comm, inflight=bound)
    g = torch.Generator().manual_seed(0)
    b, s = args.micro_batch_size, args.seq_len
    micro = [(torch.randint(0, args.vocab, (b, s), generator=g),
              torch.randint(0, args.vocab, (b, s), generator=g)) for _ in range(m)]
    steps = []
    for step in range(args.steps + 1):
        dist.barrier()
        ex.run(micro, m * b * s)
        for c in chunks:
            for q in c.parameters():
                q.grad = None
        if step == 0:
            continue  # warm-up: allocator, first-call costs
        gathered = [None] * p
        dist.all_gather_object(gathered, ex.records)
        steps.append([r for recs in gathered for r in recs])
    if rank != 0:
        return None
    measured = [idle_fraction(recs) for recs in steps]
    costs = measured_costs(steps)
    sim = simulate(name, p, m, v, costs, bound)
    unit = simulate(name, p, m, v, inflight=bound).bubble_fraction
    spans = [max(r.end_s for r in recs if r.category == "compute")
             - min(r.start_s for r in recs if r.category == "compute") for recs in steps]
    med = statistics.median(measured)
    gaps, comm_t = [], []
    for recs in steps:  # time between recorded actions, and in comm batches, per rank
        for r in range(p):
            mine = sorted((x for x in recs if x.rank == r), key=lambda x: x.start_s)
            gaps.append(sum(max(0.0, b.start_s - a.end_s) for a, b in zip(mine, mine[1:])))
            comm_t.append(sum(x.end_s - x.start_s for x in mine if x.category == "comm"))
    return {"schedule": entry + (f" v={v}" if v > 1 else ""), "measured": med,
            "measured_min": min(measured), "measured_max": max(measured),
            "simulated": sim.bubble_fraction, "unit_cost": unit,
            "rel_error": abs(med - sim.bubble_fraction) / sim.bubble_fraction
            if sim.bubble_fraction else float("nan"),
            "step_ms": 1e3 * statistics.median(spans), "sim_step_ms": 1e3 * sim.makespan,
            "t_comm_ms": 1e3 * costs.t_comm,
            "gap_ms": 1e3 * statistics.median(gaps), "comm_ms": 1e3 * statistics.median(comm_t)}


def worker(args) -> None:
    """One rank: every schedule in turn; rank 0 prints the table and a JSON line."""
    from threefold.comm.counted import Comm
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    p = dist.get_world_size()
    dims = Layout(tp=1, pp=p)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    wanted = args.schedules.split(",")
    rows = [run_schedule(args, name, v, comm) for name, v in SCHEDULES if name in wanted]
    if dist.get_rank() == 0:
        print(f"pp={p} microbatches={args.microbatches} micro-batch {args.micro_batch_size}x"
              f"{args.seq_len} hidden {args.hidden} layers {args.layers}; idle fraction per "
              f"step, median of {args.steps} steps")
        print_table(rows, width=14)
        worst = max(r["rel_error"] for r in rows)
        print(json.dumps({"benchmark": "pipeline_idle_vs_simulator", "pp": p,
                          "rel_error": {r["schedule"]: round(r["rel_error"], 4) for r in rows},
                          "worst_rel_error": worst, "goal": args.goal,
                          "meets_goal": worst <= args.goal}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    """Re-launch under torchrun with ``--pp`` ranks, or run as one rank."""
    args = parse_args()
    return run_ranks(__file__, worker, args, [args.pp])


if __name__ == "__main__":
    sys.exit(main())
