"""Optimiser offload on the host: the host AdamW kernels per parameter, and
the offloaded training step against the on-device one, side by side in one run.

    python3 bench/bench_offload.py [--preset small] [--rounds 7]
    python3 bench/bench_offload.py --preset tiny --rounds 2 --seq-len 32 --batch 2   # quick

Part 1, kernels. The same tensors (every parameter of the ``--preset`` model, fp32, with a
fixed random gradient) stepped by each AdamW kernel in turn, the order flipped every round:
torch's single-tensor kernel (what the on-device engines run, for bit-identical layouts),
``foreach``, ``fused`` (the host optimiser's, ``threefold.parallel.engines.adamw.HOST_KERNEL``),
DeepSpeed's ``DeepSpeedCPUAdam`` when ``deepspeed`` imports and its CPU Adam builds (its
JIT build takes about 40 s once; ``--no-deepspeed`` skips it), and threefold's whole
``HostOptimizer.step`` (gradient copied down, fused AdamW, parameter copied up). Per kernel:
nanoseconds per parameter (best round and median) and the bandwidth it reaches at 28 bytes
per parameter (AdamW reads parameter, gradient and two moments, 16 bytes, and writes
parameter and moments, 12), against ``threefold.plan.calibrate.memory_bandwidth`` (a 64 MB
copy, read + write). The ratio in the first JSON line is DeepSpeed's time over fused's per
round (goal >= 1: as fast as DeepSpeed); without DeepSpeed, the single-tensor kernel's.

Part 2, the step. Two ``LocalEngine``s over the same initial weights, one with
``offload=True``: forward, backward, clip, step on the same batches, alternated every round;
the table gives the step and the optimiser step alone, and the ratio offloaded ÷ on-device
(on this CPU host and device are one memory: the copies are real, no PCIe). The second JSON
line's ratio is on-device ÷ offloaded step time (goal >= 1: offloading costs nothing here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, report, revision  # noqa: E402
from threefold.config import ModelConfig, OptimConfig  # noqa: E402
from threefold.model.decoder import CausalLM, causal_lm_loss  # noqa: E402
from threefold.parallel.engines.adamw import KERNELS, make_adamw  # noqa: E402
from threefold.parallel.engines.engine import LocalEngine  # noqa: E402
from threefold.parallel.engines.offload import HostOptimizer  # noqa: E402
from threefold.plan.calibrate import memory_bandwidth  # noqa: E402

BYTES_PER_PARAM = 28  # AdamW: reads p, g, m, v (16 bytes), writes p, m, v (12)
VOCAB = 4096


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="model preset (small; tiny to be quick)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (part 2)")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    return ap.parse_args(argv)


def build(preset: str, seed: int = 0) -> CausalLM:
    """The ``preset`` model, initialised from ``seed``."""
    model = CausalLM(ModelConfig(preset=preset).resolved(VOCAB))
    model.init_weights(seed)
    return model


def deepspeed_adam():
    """DeepSpeedCPUAdam's class, or the reason it is unavailable."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])  # builds/loads its CPU op
        return DeepSpeedCPUAdam, None
    except Exception as e:  # not installed, or its C++ op does not build here
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def kernel_variants(shapes, cfg: OptimConfig, ds_cls) -> dict:
    """name -> (params, step function) over fresh copies of the same values."""
    g = torch.Generator().manual_seed(1)
    values = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=g) * 1e-3 for s in shapes]

    def fresh():
        ps = [torch.nn.Parameter(v.clone()) for v in values]
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        return ps

    out = {}
    for k in KERNELS:
        opt = make_adamw(fresh(), cfg, k)
        out[k] = opt.step
    if ds_cls is not None:
        out["deepspeed"] = ds_cls(fresh(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  eps=cfg.eps, weight_decay=cfg.weight_decay,
                                  adamw_mode=True).step
    device = fresh()  # the "device" tensors of the host optimiser (here: the same memory)
    host = HostOptimizer(device, cfg)

    def host_step():
        for p, gr in zip(device, grads):
            p.grad = gr  # the step releases it
        host.step(cfg.lr)
    out["host_step"] = host_step
    return out


def bench_kernels(model, cfg: OptimConfig, rounds: int, ds_cls) -> dict:
    """Seconds per step of every variant, per round (order flipped every round)."""
    shapes = [p.shape for p in model.parameters()]
    variants = kernel_variants(shapes, cfg, ds_cls)
    times = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds + 1):
        for k in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            variants[k]()
            if r:  # round 0 warms up (state allocated, the first step's lazy work)
                times[k].append(time.perf_counter() - t0)
    return times


def make_engines(preset: str, cfg: OptimConfig) -> dict:
    """The two engines, each over its own copy of the same initial model."""
    return {name: LocalEngine(build(preset), cfg, offload=off)
            for name, off in (("device", False), ("offload", True))}


def train_step(engine, ids, labels, lr: float) -> tuple[float, float, float]:
    """(loss, seconds of the whole step, seconds of the optimiser step)."""
    t0 = time.perf_counter()
    loss = causal_lm_loss(engine.model(ids), labels, reduction="mean")
    loss.backward()
    engine.finish_gradients()
    engine.clip_grad_norm(1.0)
    t1 = time.perf_counter()
    engine.step(lr)
    t2 = time.perf_counter()
    return float(loss.detach()), t2 - t0, t2 - t1


def bench_steps(args, cfg: OptimConfig) -> tuple[list[dict], float]:
    """Rows of the step benchmark and the largest relative difference of the losses."""
    engines = make_engines(args.preset, cfg)
    g = torch.Generator().manual_seed(2)
    rows, worst = [], 0.0
    for r in range(args.rounds + 1):
        ids = torch.randint(0, VOCAB, (args.batch, args.seq_len + 1), generator=g)
        x, y = ids[:, :-1], ids[:, 1:]
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        res = {k: train_step(engines[k], x, y, cfg.lr) for k in order}
        worst = max(worst, abs(res["offload"][0] / res["device"][0] - 1))
        if r == 0:
            continue  # warm-up
        d, o = res["device"], res["offload"]
        rows.append({"round": r, "device_step_ms": d[1] * 1e3, "offload_step_ms": o[1] * 1e3,
                     "device_opt_ms": d[2] * 1e3, "offload_opt_ms": o[2] * 1e3,
                     "step_offload_over_device": o[1] / d[1],
                     "opt_offload_over_device": o[2] / d[2], "speed_ratio": d[1] / o[1]})
    return rows, worst


def kernel_table(times: dict, n: int, bw: float) -> list[dict]:
    """One row per kernel: ns per parameter (best, median), GB/s and share of the probe."""
    rows = []
    for k, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        rows.append({"kernel": k, "ns_per_param_best": best / n * 1e9,
                     "ns_per_param_median": med / n * 1e9,
                     "GB_s_best": BYTES_PER_PARAM * n / best / 1e9,
                     "of_copy_bw": BYTES_PER_PARAM * n / best / bw})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run both parts; print their tables and JSON lines."""
    args = parse_args(argv)
    torch.manual_seed(0)
    cfg = OptimConfig()
    print(f"bench_offload: {revision()}, preset {args.preset}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}")
    ds_cls, why = (None, "skipped (--no-deepspeed)") if args.no_deepspeed else deepspeed_adam()
    print("DeepSpeedCPUAdam: " + ("built" if ds_cls else f"unavailable ({why})"))
    model = build(args.preset)
    n = sum(p.numel() for p in model.parameters())
    bw = memory_bandwidth()
    times = bench_kernels(model, cfg, args.rounds, ds_cls)
    bw = max(bw, memory_bandwidth())  # the better of two probes, before and after
    print(f"\n{n:,} parameters; memory copy bandwidth {bw / 1e9:.1f} GB/s; "
          f"{BYTES_PER_PARAM} bytes per parameter per AdamW step")
    print_table(kernel_table(times, n, bw))
    ref = "deepspeed" if ds_cls else "single"
    rows = [{"round": i, "fused_ns": f / n * 1e9, f"{ref}_ns": s / n * 1e9,
             f"{ref}_over_fused": s / f} for i, (f, s) in
            enumerate(zip(times["fused"], times[ref]))]
    print()
    report("offload_host_adamw", rows, f"{ref}_over_fused", goal=1.0)
    print(f"\noffloaded vs on-device step, {args.batch}×{args.seq_len} tokens:")
    rows, worst = bench_steps(args, cfg)
    print(f"largest relative loss difference offloaded vs on-device: {worst:.2e}")
    report("offload_step", rows, "speed_ratio", goal=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
