"""threefold tensor parallelism vs torch DTensor ``parallelize_module``, on 2 and 4 CPU ranks.

    python3 bench/bench_tp.py                       # 2 then 4 ranks, the defaults below
    python3 bench/bench_tp.py --tp 2 --rounds 2     # a quick run

Started without torchrun's environment, the script re-launches itself under
``python -m torch.distributed.run --standalone --nproc-per-node N`` (gloo, one OpenMP thread
per rank) once per N in ``--tp``; every rank of a launch is one tensor-parallel group of N.
Within a launch the two configurations alternate round by round (A B, then B A, ...) so that
noise from the shared machine falls on both sides of each ratio.

Both sides start from the same weights (``build_model`` with one seed, rebuilt every round),
see the same batch (random token ids from a fixed seed; data loading is not compared) and take
the same steps: forward, summed token cross-entropy over the vocabulary shards divided by the
token count, backward, AdamW (``make_adamw``: the same hyper-parameters and single-tensor
kernel). No gradient clipping on either side. What differs is only how the model is split:

- ``threefold``: ``apply_tensor_parallel`` (Megatron's column/row-parallel linears, conjugate
  f/g autograd functions through ``Comm``, vocab-parallel embedding and cross-entropy);
- ``torch``: ``torch.distributed.tensor.parallel.parallelize_module`` with torch's own
  styles, laid out as torchtitan does for Llama: ``ColwiseParallel`` q/k/v and gate/up,
  ``RowwiseParallel`` o and down, ``PrepareModuleInput`` on attention and MLP (so the input is
  made a replicated DTensor once per sub-layer and its gradient all-reduced once, not once
  per projection), ``RowwiseParallel`` for the vocab-parallel embedding, a ``ColwiseParallel``
  LM head whose logits stay sharded on the vocabulary, and ``loss_parallel()`` for the
  cross-entropy (no full logits on any rank).

Reported per launch: the step-1 loss of both (they must agree), collectives per step (threefold
from ``Comm``'s counters, torch from ``CommDebugMode``, both on an untimed step), tokens/s of
each (slowest rank's wall time over the timed steps) and the ratio threefold/torch per round,
goal >= 1.0, as a table and a JSON line (``bench.common.report``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import ab_rows, report, run_ranks, tp_rank  # noqa: E402
from threefold.accounting import num_parameters  # noqa: E402
from threefold.config import OptimConfig  # noqa: E402
from threefold.parallel.engines.adamw import make_adamw
from threefold.training.train import build_model  # noqa: E402

CONFIGS = ("threefold", "torch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (the same in the launcher and in every rank)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # not "--nproc": torchrun's parser would take it for an abbreviation of its own option
    ap.add_argument("--tp", default="2,4", help="comma-separated tp degrees (one launch each)")
    ap.add_argument("--preset", default="tiny", help="model preset (tiny: h 256, 4 layers)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary (a multiple of tp)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration/round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=4, help="A/B rounds (order flips each round)")
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args(argv)


# --------------------------------------------------------------------------------------------
# The two configurations: each returns (model, step function)
# --------------------------------------------------------------------------------------------
def build_threefold(mcfg, ocfg, seed, dims, mesh):
    """threefold's TP: ``apply_tensor_parallel`` and its vocab-parallel loss."""
    from threefold.comm.counted import Comm
    from threefold.parallel.transforms.tensor import apply_tensor_parallel

    comm = Comm(dims, mesh)
    model = apply_tensor_parallel(build_model(mcfg, torch.device("cpu"), seed), comm)
    opt = make_adamw(model.parameters(), ocfg)

    def step(x, y, n_tokens):
        loss = model(x, labels=y).sum() / n_tokens
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def collectives():
        return {op: v["calls"] for op, v in comm.stats().get("tp", {}).items()}

    return step, collectives


def torch_tp_plan(model, tp_mesh) -> None:
    """torch's styles on the same model, block by block, then the embedding and the head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, parallelize_module)

    for block in model.model.layers:
        parallelize_module(block, tp_mesh, {
            # attention(x, cos, sin, mask): only x becomes a DTensor
            "self_attn": PrepareModuleInput(input_layouts=(Replicate(), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None,
                                                                   None)),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Replicate(),),
                                      desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })


def build_torch(mcfg, ocfg, seed, dims, mesh):
    """torch's TP: ``parallelize_module`` and ``loss_parallel``."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    from threefold.comm.mesh import submesh

    model = build_model(mcfg, torch.device("cpu"), seed)
    torch_tp_plan(model, submesh(mesh, "tp"))
    opt = make_adamw(model.parameters(), ocfg)
    counted: dict[str, int] = {}

    def run(x, y, n_tokens):
        with loss_parallel():
            logits = model(x)  # a DTensor sharded on the vocabulary
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            loss = loss / n_tokens
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.to_local().detach())

    def step(x, y, n_tokens):
        if counted:
            return run(x, y, n_tokens)
        # the first (untimed) step only: the mode costs time. Its module hooks warn that no
        # input of a module needs a gradient (token ids): expected, so silenced.
        with warnings.catch_warnings(), CommDebugMode() as mode:
            warnings.filterwarnings("ignore", message="Full backward hook")
            out = run(x, y, n_tokens)
        counted.update({str(getattr(k, "__name__", k)).split(".")[-1]: v
                        for k, v in mode.get_comm_counts().items()})
        return out

    return step, lambda: dict(counted)


# --------------------------------------------------------------------------------------------
# One launch
# --------------------------------------------------------------------------------------------
def run_config(name, mcfg, ocfg, args, dims, mesh, batch) -> dict:
    """Build ``name`` fresh, take warm-up + timed steps; this rank's figures."""
    build = build_threefold if name == "threefold" else build_torch
    torch.manual_seed(args.seed)
    step, collectives = build(mcfg, ocfg, args.seed, dims, mesh)
    x, y = batch
    losses = []
    dist.barrier()
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            dist.barrier()  # every rank starts the timed window together
            t0 = time.perf_counter()
        losses.append(step(x, y, y.numel()))
        if s == 0:
            calls = collectives()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "loss0": losses[0], "loss_last": losses[-1], "calls": calls}


def worker(args: argparse.Namespace) -> None:
    """One rank: the tp mesh, the batch, every configuration each round, rank 0 summarises."""
    from threefold.comm.distributed import shutdown

    env, dims, mesh, mcfg, batch = tp_rank(args)
    world = env.world_size
    ocfg = OptimConfig()

    results = []  # (round, name, per-rank dicts)
    for r in range(args.rounds):
        for name in (CONFIGS if r % 2 == 0 else tuple(reversed(CONFIGS))):
            mine = run_config(name, mcfg, ocfg, args, dims, mesh, batch)
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
            results.append((r, name, everyone))
    if env.rank == 0:
        summarise(args, mcfg, world, results)
    shutdown()


def summarise(args, mcfg, world, results) -> None:
    """Loss agreement, collectives per step, then the throughput table and JSON line."""
    tok = args.batch * args.seq_len * args.steps
    print(f"\nbench_tp: {num_parameters(mcfg) / 1e6:.2f}M parameters ({args.preset}, vocab "
          f"{mcfg.vocab_size}), tp {world} (gloo, 1 thread per rank), batch "
          f"{args.batch}x{args.seq_len}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.rounds} rounds")
    first = {name: ranks[0] for r, name, ranks in results if r == 0}
    l0 = {n: v["loss0"] for n, v in first.items()}
    rel = abs(l0["threefold"] - l0["torch"]) / abs(l0["torch"])
    last = {n: v["loss_last"] for n, v in first.items()}
    rel_last = abs(last["threefold"] - last["torch"]) / abs(last["torch"])
    print(f"step-1 loss: threefold {l0['threefold']:.6f}, torch {l0['torch']:.6f} (relative "
          f"difference {rel:.1e} -> {'agree' if rel < 1e-5 else 'DIFFER'}); after "
          f"{args.warmup + args.steps} steps: {last['threefold']:.6f} vs {last['torch']:.6f} "
          f"({rel_last:.1e})")
    print(f"collectives per step (first step, rank 0): threefold {first['threefold']['calls']}"
          f"; torch {first['torch']['calls']}")
    print(json.dumps({"benchmark": f"tp{world}_agreement", "loss0": l0, "loss_last": last,
                      "loss0_rel_diff": rel, "agree": rel < 1e-5,
                      "collectives": {n: v["calls"] for n, v in first.items()}}))
    rows = ab_rows(results, args.rounds, tok, tp=world)
    print()
    report(f"tp{world}_threefold_vs_torch_dtensor", rows, "ratio", 1.0)


def main() -> None:
    """Re-launch under torchrun (once per tp degree) when started plainly; else be one rank."""
    args = parse_args()
    sys.exit(run_ranks(__file__, worker, args, [int(v) for v in args.tp.split(",")]))


if __name__ == "__main__":
    main()
