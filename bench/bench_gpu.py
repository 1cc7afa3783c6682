"""threefold against transformers' ``LlamaForCausalLM`` on one device, eager and compiled:
tokens/s, MFU, peak memory and where one step's time goes.

    PYTHONPATH=$PWD python3 bench/bench_gpu.py [--out gpu.json]     # on one GPU: < 5 minutes
    python3 bench/bench_gpu.py --shape tiny --device cpu            # what the CPU test runs

Shapes: ``gpu`` (default) is the one measured on an H200 (docs/benchmarks.md): h 2048, FFN 8192, 16
layers, 32/8 heads, vocab 32768 (1.11B), seq 2048, micro-batch 8 (= the batch), bf16 autocast over
fp32 weights. ``tiny``: 2 layers, h 128, seq 64, micro-batch 2, the tokenizer's vocabulary, for
CPUs. ``--dtype auto`` is bfloat16 on CUDA and float32 (threefold's CPU default) on a CPU.

threefold: ``threefold.training.train.build_run`` from a config (``train.compile true`` when
compiled: each block compiled) and ``threefold.training.steps.train_step``, the loop's own step (its
sampler, loss, clipping at ``optim.grad_clip``, its AdamW, learning-rate schedule, one host read).
transformers: ``LlamaForCausalLM`` (SDPA attention, no KV cache) of threefold's config
(``threefold.weights.hf_config.hf_config``) with threefold's initial weights **copied** in by name
(threefold's names are transformers'), fed the same batches from the same sampler, so the
first step's losses agree (printed). Its loop: forward under autocast, fp32 cross-entropy summed
over the tokens / their count, backward, ``clip_grad_norm_``, AdamW (``fused=True`` on CUDA,
torch's default on a CPU) at threefold's schedule, the loss read each step; compiled:
``torch.compile(model)``.

Each round runs every mode (eager, compiled) and in it both sides, the order flipped every round
and mode. A side is built fresh, runs ``--warmup`` untimed steps (compilation), then ``--steps``
timed ones: tokens/s = timed tokens / wall time between device synchronisations. Peak memory:
from the first step to the last timed one (``threefold.hardware.metrics.peak_memory_bytes``:
allocator peak on CUDA, the process's peak RSS on a CPU, reset before each side). MFU = tokens/s ×
``threefold.accounting.flops_per_token`` / ``threefold.hardware.metrics.device_peak_flops`` (CUDA:
the datasheet catalogue; CPU: the matmul probe, raised to the highest rate seen if a side beats it).
Profile: one step after the timed ones in the last round (torch.profiler, CPU and CUDA
activities): shares of self device time (self CPU time on a CPU) of torch ops in matmul
(aten::mm/addmm/bmm/matmul/linear, inductor mm templates), attention (scaled_dot_product /
flash / efficient / cudnn attention, backward included), optimiser (anything under
``Optimizer.step``/``zero_grad``, fused and foreach Adam kernels) and elementwise (the rest:
casts, norms, RoPE, SwiGLU, loss, clipping; on a CPU also the dispatch overhead); on CUDA
``coverage`` says what share of all kernel time an op was found for.
Printed: a table per round and mode (tokens/s of each side, ratio threefold/transformers), a
table per mode and side (medians), and one JSON line (also written to ``--out``).

Further rows (``--rows``, default all: base,fp8,moe), threefold alone, built by the same path
(``make_config`` + ``build_run``) with config overrides, in each round and mode after the two
sides above:

- ``fp8``: ``train.fp8 tensorwise`` and ``train.fp8 rowwise``, each against the threefold bf16
  row of the same round and mode (ratio fp8/bf16 of tokens/s). A row is skipped, with the
  reason printed and kept in the JSON, when the configuration refuses ``train.fp8``, when the
  device has no FP8 matmuls (a CPU, or CUDA compute capability below 8.9), or when the built
  model holds no FP8 layer (``threefold.parallel.transforms.fp8_linear``'s wrappers; e.g. every
  width off ``_scaled_mm``'s rule). Their MFU divides by the device's FP8 peak (catalogue
  ``peak_flops_fp8``);
- ``moe``: the shape as a mixture of experts (``MOE_SHAPES``: gpu 8 layers, 8 experts of
  f 1408, top-2; tiny 4 experts of f 176, top-2) with ``model.moe_impl grouped`` and ``loop``
  (ratio grouped/loop), MFU from the MoE's active FLOPs per token against the dtype's peak;
  and the same grouped MoE under ``train.fp8`` tensorwise, rowwise and blockwise
  (``moe-fp8-*``: projections and routed experts in FP8, ``threefold.parallel.transforms.
  fp8_experts``; rowwise's experts through ``torch._scaled_grouped_mm`` on compute
  capability 9.x/10.x, the others one ``_scaled_mm`` per expert, blockwise the exact
  dequantised reference of ``fp8_blockwise``), each against ``moe-grouped`` (ratio
  fp8/bf16), MFU against the FP8 peak; skipped as the ``fp8`` rows are, and in compiled mode
  (to keep the bench short: the FP8 experts run eagerly inside a compiled block anyway).

    PYTHONPATH=$PWD python3 bench/bench_gpu.py --rows fp8,moe      # only the new rows' parts
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, spread  # noqa: E402
from threefold import accounting as cost  # noqa: E402
from threefold.config import ConfigError, load_config  # noqa: E402
from threefold.data import MixtureSampler, prepare_data  # noqa: E402
from threefold.hardware.metrics import (device_peak_flops, peak_memory_bytes,  # noqa: E402
                               raise_cpu_peak, reset_peak_memory)
from threefold.training.steps import lr_at, train_step  # noqa: E402
from threefold.training.train import build_model, build_run  # noqa: E402

SHAPES = {  # model overrides, seq_len, micro-batch (= global batch)
    "gpu": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                 max_position_embeddings=2048), 2048, 8),
    "tiny": (dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2), 64, 2),
}
MOE_SHAPES = {  # the shape's overrides that make it a mixture of experts (``moe`` rows)
    "gpu": dict(num_hidden_layers=8, num_local_experts=8, num_experts_per_tok=2,
                intermediate_size=1408),
    "tiny": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=176),
}
FP8_RECIPES = ("tensorwise", "rowwise")
MOE_FP8_RECIPES = ("tensorwise", "rowwise", "blockwise")
ROW_GROUPS = ("base", "fp8", "moe")
SIDES = ("threefold", "transformers")
BUCKETS = ("matmul", "attention", "optimiser", "elementwise")
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
              "aten::baddbmm", "aten::_scaled_mm", "aten::addmv", "aten::mv"}
ATTENTION_KEYS = ("scaleddotproduct", "flashattention", "efficientattention",
                  "cudnnattention", "flashattn", "fmha")


def make_config(args, out: str, compile_: bool, extra: list[tuple[str, str]] = ()):
    """The run both sides share (threefold builds from it; transformers copies its shape);
    ``extra``: a further row's overrides (``train.fp8``, the MoE shape), after ``--set``."""
    model, seq, mb = SHAPES[args.shape]
    steps = args.warmup + args.steps + 1
    pairs = [(f"model.{k}", str(v)) for k, v in model.items()]
    pairs += [("data.seq_len", str(seq)), ("train.micro_batch_size", str(mb)),
              ("train.global_batch_size", str(mb)), ("train.steps", str(steps)),
              ("train.device", args.device), ("train.dtype", args.dtype),
              ("train.compile", str(compile_).lower()), ("train.output_dir", out),
              ("train.eval_interval", "0"), ("train.progress", "off"),
              ("train.preemption_grace_s", "0"), ("checkpoint.save_final", "false")]
    return load_config(None, pairs + [tuple(kv.split("=", 1)) for kv in args.set] + list(extra))


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA) so the wall clock sees execution, not queueing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# The two sides: each returns (step(i) -> loss, model config, device, objects to release)
# --------------------------------------------------------------------------------------------
def threefold_side(cfg, check=None):
    """threefold's own run and step; ``check(run)`` may refuse the built run (``SkipRow``)."""
    run = build_run(cfg)
    if check is not None:
        try:
            check(run)
        except SkipRow:
            release([run])
            raise
    return (lambda i: train_step(run, i)[0]), run.model_cfg, run.device, run.dtype, [run]


def hf_model(mcfg, device: torch.device, seed: int):
    """transformers' Llama of ``mcfg`` holding threefold's initial weights of ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from threefold.weights.hf_config import hf_config

    fields = {k: v for k, v in hf_config(mcfg).items() if k not in ("architectures", "model_type")}
    fields["use_cache"] = False
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**fields, attn_implementation="sdpa"))
    ours = build_model(mcfg, device, seed)
    model.load_state_dict(ours.state_dict(), strict=True)
    del ours
    return model.train()


def transformers_side(cfg, compile_: bool):
    """A plain loop on transformers' model, same weights, batches and optimiser settings."""
    from threefold.training.train import compute_dtype, pick_device

    device = pick_device(cfg)
    dtype = compute_dtype(cfg, device)
    data = prepare_data(cfg.data)
    mcfg = cfg.model.resolved(vocab_size=data.vocab_size)
    model = hf_model(mcfg, device, cfg.train.seed)
    fwd = torch.compile(model) if compile_ else model
    o, t = cfg.optim, cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay,
                            **({"fused": True} if device.type == "cuda" else {}))
    sampler = MixtureSampler(data.sources, cfg.data.seq_len, t.global_batch_size, t.seed)
    cast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step(i: int) -> float:
        batch = sampler.local_batch(i, 0, 1)
        x, y = batch["input_ids"].to(device), batch["labels"].to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(i, cfg)
        with cast:
            logits = fwd(x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), y.flatten(),
                                                 reduction="sum") / y.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step, mcfg, device, dtype, [model, fwd, opt]


# --------------------------------------------------------------------------------------------
# The further rows: FP8 recipes and grouped/looped experts (threefold alone)
# --------------------------------------------------------------------------------------------
class SkipRow(Exception):
    """A row that cannot run here; its message says why (printed, kept in the JSON)."""


def extra_rows(args) -> list[tuple[str, list[tuple[str, str]]]]:
    """(row name, config overrides) of the rows ``--rows`` asks for beyond the base sides."""
    rows = []
    if "fp8" in args.rows:
        rows += [(f"fp8-{r}", [("train.fp8", r)]) for r in FP8_RECIPES]
    if "moe" in args.rows:
        shape = [(f"model.{k}", str(v)) for k, v in MOE_SHAPES[args.shape].items()]
        rows += [(f"moe-{impl}", shape + [("model.moe_impl", impl)])
                 for impl in ("grouped", "loop")]
        rows += [(f"moe-fp8-{r}", shape + [("model.moe_impl", "grouped"), ("train.fp8", r)])
                 for r in MOE_FP8_RECIPES]
    return rows


def fp8_unavailable(device: torch.device, capability: tuple[int, int] | None = None
                    ) -> str | None:
    """Why ``device`` runs no FP8 matmuls (None: it does): FP8 tensor cores need CUDA compute
    capability 8.9 (Ada) or above (``capability``: the device's, read when None)."""
    if device.type != "cuda":
        return f"{device.type} has no FP8 matmuls (CUDA compute capability >= 8.9 needed)"
    cc = capability or torch.cuda.get_device_capability(device)
    if tuple(cc) < (8, 9):
        return f"compute capability {cc[0]}.{cc[1]} < 8.9 has no FP8 matmuls"
    return None


def check_fp8_built(run) -> None:
    """Raise ``SkipRow`` when a run asked for ``train.fp8`` holds no FP8 layer (the setting
    accepted but not built): its figures would be bf16's under an FP8 name."""
    from threefold.parallel.transforms.fp8_linear import Float8Linear, Float8LoRALinear

    if not any(isinstance(m, (Float8Linear, Float8LoRALinear)) for m in run.model.modules()):
        raise SkipRow(f"train.fp8={run.cfg.train.fp8} accepted but the built model holds no FP8 "
                      f"layer (threefold.parallel.transforms.fp8_linear's wrappers)")


def check_fp8_experts_built(run) -> None:
    """``check_fp8_built`` for the routed experts: ``SkipRow`` when none is a
    ``Float8Experts`` (e.g. widths off ``_scaled_mm``'s rule of 16)."""
    from threefold.parallel.transforms.fp8_experts import Float8Experts

    check_fp8_built(run)
    if not any(isinstance(m, Float8Experts) for m in run.model.modules()):
        raise SkipRow(f"train.fp8={run.cfg.train.fp8} accepted but no routed expert was built "
                      f"in FP8 (threefold.parallel.transforms.fp8_experts)")


def measure_row(name: str, extra: list[tuple[str, str]], args, out: str, compile_: bool
                ) -> dict:
    """One further row in one round and mode: its figures, or {"skipped": reason}."""
    fp8, moe_fp8 = name.startswith("fp8"), name.startswith("moe-fp8")
    try:
        cfg = make_config(args, out, compile_, extra)
        if fp8 or moe_fp8:
            reason = fp8_unavailable(torch.device(cfg.train.device))
            if reason:
                raise SkipRow(reason)
        if moe_fp8 and compile_:
            raise SkipRow("eager only, to keep the bench short (under train.compile the FP8 "
                          "experts run eagerly inside the compiled blocks anyway)")
        check = check_fp8_experts_built if moe_fp8 else check_fp8_built if fp8 else None
        return measure("threefold", cfg, args, compile_, False, check=check)
    except ConfigError as e:  # the configuration refuses the row's setting
        return {"skipped": f"refused: {e}"}
    except SkipRow as e:
        return {"skipped": str(e)}


# --------------------------------------------------------------------------------------------
# Measuring one side
# --------------------------------------------------------------------------------------------
def bucket(evt) -> str:
    """The share an op's self time goes to: its own name, or an enclosing range's (the
    optimiser's step, an attention op whose inner ops it launched)."""
    chain, e = [], evt
    while e is not None:
        chain.append(e.name.lower().replace("_", ""))
        e = e.cpu_parent
    if any(n.startswith("optimizer.") for n in chain) or "adam" in chain[0]:
        return "optimiser"
    if any(k in n for n in chain for k in ATTENTION_KEYS):
        return "attention"
    name = evt.name.lower()  # inductor's matmul templates: triton_tem_fused_mm_0
    templated = name.startswith("triton") and {"mm", "addmm", "bmm"} & set(name.split("_"))
    if evt.name in MATMUL_OPS or templated:
        return "matmul"
    return "elementwise"


def profile_shares(step, i: int, device: torch.device) -> dict:
    """One step under torch.profiler: each bucket's share of self device time (CUDA: the
    kernels each op launched) or of self CPU time, and the total in ms."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step(i)
        sync(device)
    got, kernels = dict.fromkeys(BUCKETS, 0.0), 0.0
    for evt in prof.events():
        if evt.device_type != DeviceType.CPU:  # a kernel (also counted through its op)
            if not getattr(evt, "is_user_annotation", False):
                kernels += evt.time_range.elapsed_us()
        elif not evt.is_async:
            t = (sum(k.duration for k in evt.kernels) if device.type == "cuda"
                 else evt.self_cpu_time_total)
            if t > 0:
                got[bucket(evt)] += t
    total = sum(got.values())
    shares = {k: (v / total if total else 0.0) for k, v in got.items()}
    basis = "self device time" if device.type == "cuda" else "self CPU time"
    # on CUDA, the share of all kernel time that some op launched (the shares' coverage)
    cover = total / kernels if device.type == "cuda" and kernels else None
    return {**shares, "total_ms": total / 1e3, "basis": basis, "coverage": cover}


def release(objs: list) -> None:
    """Free a side before the next: its objects, compiled code, cached device blocks."""
    objs.clear()
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(name: str, cfg, args, compile_: bool, profile: bool, check=None) -> dict:
    """Build one side, run its warm-up and timed steps (and a profiled one): its figures."""
    t0 = time.perf_counter()
    step, mcfg, device, dtype, objs = (threefold_side(cfg, check) if name == "threefold"
                                       else transformers_side(cfg, compile_))
    reset_peak_memory(device)
    loss0 = step(0)
    for i in range(1, args.warmup):
        step(i)
    sync(device)
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        step(i)
    sync(device)
    seconds = time.perf_counter() - start
    peak = peak_memory_bytes(device)
    shares = profile_shares(step, args.warmup + args.steps, device) if profile else None
    del step  # its closure holds the model: gone before the next side is built
    release(objs)
    tokens = args.steps * cfg.train.global_batch_size * cfg.data.seq_len
    return {"tok_s": tokens / seconds, "peak_memory_bytes": peak, "loss0": loss0,
            "profile": shares, "wall_s": time.perf_counter() - t0, "mcfg": mcfg,
            "device": device, "dtype": dtype}


# --------------------------------------------------------------------------------------------
# Rounds, MFU, the tables and the JSON line
# --------------------------------------------------------------------------------------------
def run_rounds(args, modes: list[str]) -> dict:
    """{(round, mode, side): figures}, sides alternated by round and mode."""
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for m, mode in enumerate(modes):
                cfg = make_config(args, str(Path(tmp) / f"{mode}{r}"), mode == "compiled")
                if r == 0 and m == 0 and cfg.train.device == "cpu":
                    host_memory_setting(cfg)
                order = SIDES if (r + m) % 2 == 0 else SIDES[::-1]
                for side in order:
                    res = measure(side, cfg, args, mode == "compiled", r == args.rounds - 1)
                    got[(r, mode, side)] = res
                    _print_row(r, mode, side, res)
                rows = extra_rows(args)
                for name, extra in (rows if (r + m) % 2 == 0 else rows[::-1]):
                    res = measure_row(name, extra, args, str(Path(tmp) / f"{mode}{r}{name}"),
                                      mode == "compiled")
                    got[(r, mode, name)] = res
                    _print_row(r, mode, name, res)
    return got


def _print_row(r: int, mode: str, side: str, res: dict) -> None:
    if "skipped" in res:
        print(f"round {r} {mode:>8} {side:>14}: skipped: {res['skipped']}", flush=True)
        return
    print(f"round {r} {mode:>8} {side:>14}: {res['tok_s']:,.0f} tok/s, "
          f"peak {res['peak_memory_bytes'] / 1e9:.3f} GB, first loss "
          f"{res['loss0']:.4f}, {res['wall_s']:.1f} s", flush=True)


def host_memory_setting(cfg) -> None:
    """On a CPU, the host-memory setting ``build_run`` makes (process-wide once made) is
    made before either side runs, so both run with it."""
    from threefold.training.hostmem import reuse_freed_host_memory, threshold_for

    reuse_freed_host_memory(threshold_for(cfg.train.host_mmap_threshold_mb, 1))


def peak_flops(got: dict, fpt: float, rates: list[float] = ()) -> tuple[float | None, str]:
    """The device's peak FLOP/s (its dtype's) for MFU; on a CPU never below the best rate a
    base side (or one of ``rates``, FLOP/s the further rows reached) reached."""
    any_res = next(r for (_, _, side), r in got.items() if side in SIDES)
    device, dtype = any_res["device"], any_res["dtype"]
    peak, src = device_peak_flops(device, dtype)
    best = max([r["tok_s"] * fpt for (_, _, side), r in got.items() if side in SIDES]
               + list(rates))
    if device.type == "cpu" and peak is not None and best > peak:
        peak, src = raise_cpu_peak(dtype, best)
    return peak, src


def summarise_rows(args, modes: list[str], got: dict, seq: int) -> tuple[dict, list[float]]:
    """The further rows per mode: median tokens/s, MFU (FP8 rows against the FP8 peak), and the
    ratio per round against their reference (fp8: threefold's bf16 row; moe-grouped:
    moe-loop), or the reason they were skipped; and the FLOP/s they reached (for a CPU's
    peak)."""
    out, rates = {}, []
    for mode in modes:
        entry = {}
        for name, _ in extra_rows(args):
            rs = [got[(r, mode, name)] for r in range(args.rounds)]
            skipped = [x["skipped"] for x in rs if "skipped" in x]
            if skipped:
                entry[name] = {"skipped": skipped[0]}
                continue
            fpt = cost.flops_per_token(rs[0]["mcfg"], seq)
            tok = statistics.median(x["tok_s"] for x in rs)
            rates.append(max(x["tok_s"] for x in rs) * fpt)
            ref = "threefold" if name.startswith("fp8") else \
                ("moe-loop" if name == "moe-grouped" else
                 "moe-grouped" if name.startswith("moe-fp8") else None)
            ratios = [got[(r, mode, name)]["tok_s"] / got[(r, mode, ref)]["tok_s"]
                      for r in range(args.rounds)
                      if ref and "skipped" not in got[(r, mode, ref)]]
            entry[name] = {"tok_s": tok, "tok_s_rounds": [x["tok_s"] for x in rs],
                           "flops_per_token": fpt, "versus": ref, "ratios": ratios,
                           "ratio_median": statistics.median(ratios) if ratios else None,
                           "peak_memory_bytes": max(x["peak_memory_bytes"] for x in rs),
                           "loss0": rs[0]["loss0"]}
        out[mode] = entry
    return out, rates


def rows_mfu(rows: dict, got: dict, peak: float | None, src: str) -> None:
    """MFU of each further row against its dtype's peak: FP8 rows the FP8 peak, the others the
    base run's (``peak``)."""
    device = next(r for (_, _, side), r in got.items() if side in SIDES)["device"]
    for entry in rows.values():
        for name, e in entry.items():
            if "skipped" in e:
                continue
            p, s = device_peak_flops(device, torch.bfloat16, "fp8") if "fp8" in name \
                else (peak, src)
            e["peak_flops"], e["peak_source"] = p, s
            e["mfu"] = e["tok_s"] * e["flops_per_token"] / p if p else None


def summarise(args, modes: list[str], got: dict) -> dict:
    """Medians per mode and side, the ratio's spread over rounds, the run's facts."""
    first = got[(0, modes[0], SIDES[0])]
    mcfg, seq = first["mcfg"], SHAPES[args.shape][1]
    fpt = cost.flops_per_token(mcfg, seq)
    rows, rates = summarise_rows(args, modes, got, seq)
    peak, src = peak_flops(got, fpt, rates)
    rows_mfu(rows, got, peak, src)
    out = {"benchmark": "gpu", "shape": args.shape, "device": device_name(first["device"]),
           "dtype": str(first["dtype"]).replace("torch.", ""), "torch": torch.__version__,
           "transformers": hf_version(), "weights": "copied from threefold's initial weights",
           "tokens_per_step": SHAPES[args.shape][2] * seq, "flops_per_token": fpt,
           "peak_flops": peak, "peak_source": src, "steps": args.steps,
           "warmup": args.warmup, "rounds": args.rounds, "modes": {}}
    for mode in modes:
        ratios = [got[(r, mode, "threefold")]["tok_s"] / got[(r, mode, "transformers")]["tok_s"]
                  for r in range(args.rounds)]
        entry = {"ratio_median": statistics.median(ratios), "ratio_spread": spread(ratios)}
        for side in SIDES:
            rs = [got[(r, mode, side)] for r in range(args.rounds)]
            tok = statistics.median(x["tok_s"] for x in rs)
            entry[side] = {"tok_s": tok, "tok_s_rounds": [x["tok_s"] for x in rs],
                           "mfu": tok * fpt / peak if peak else None,
                           "peak_memory_bytes": max(x["peak_memory_bytes"] for x in rs),
                           "loss0": rs[0]["loss0"], "profile": rs[-1]["profile"]}
        out["modes"][mode] = entry
    out["rows"] = rows
    comp = out["modes"].get("compiled")
    out["goal"] = 1.05  # the goal: compiled threefold >= 1.05x transformers + torch.compile
    out["meets_goal"] = comp["ratio_median"] >= 1.05 if comp else None
    return out


def device_name(device: torch.device) -> str:
    """The GPU's name, or "cpu (N threads)"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def hf_version() -> str:
    """The installed transformers' version."""
    import transformers

    return transformers.__version__


def print_report(summary: dict, got: dict, modes: list[str], rounds: int) -> None:
    """The per-round table, the per-side table, and the JSON line."""
    print_table([{"round": r, "mode": m,
                  "threefold_tok_s": got[(r, m, "threefold")]["tok_s"],
                  "transformers_tok_s": got[(r, m, "transformers")]["tok_s"],
                  "ratio": got[(r, m, "threefold")]["tok_s"]
                  / got[(r, m, "transformers")]["tok_s"]}
                 for r in range(rounds) for m in modes])
    rows = []
    for m in modes:
        e = summary["modes"][m]
        for side in SIDES:
            s, p = e[side], e[side]["profile"] or {}
            rows.append({"mode": m, "side": side, "tok_s": s["tok_s"],
                         "mfu": s["mfu"] if s["mfu"] is not None else "-",
                         "peak_GB": s["peak_memory_bytes"] / 1e9, "loss0": s["loss0"],
                         **{k: p.get(k, "-") for k in BUCKETS}})
        sp = e["ratio_spread"]
        print(f"{m}: ratio threefold/transformers median {e['ratio_median']:.3f}, spread over "
              f"{sp['rounds']} rounds {sp['min']:.3f}-{sp['max']:.3f}")
    print(f"MFU against {summary['peak_flops'] or 0:.4g} FLOP/s ({summary['peak_source']}); "
          f"profile shares of {summary['modes'][modes[0]]['threefold']['profile']['basis']}:")
    print_table(rows, width=12)
    further = [{"mode": m, "row": name, "tok_s": e.get("tok_s", "-"),
                "mfu": e["mfu"] if e.get("mfu") is not None else "-",
                "versus": e.get("versus") or "-",
                "ratio": e["ratio_median"] if e.get("ratio_median") is not None else "-",
                "skipped": e.get("skipped", "")[:60] or "-"}
               for m in modes for name, e in summary["rows"].get(m, {}).items()]
    if further:
        print("further rows (threefold; FP8 MFU against the FP8 peak, ratio median over rounds "
              "against 'versus'):")
        print_table(further, width=14)
    print(json.dumps(summary), flush=True)


def parse(argv=None) -> argparse.Namespace:
    """The command line; defaults by shape and device."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpu")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (gpu 10, tiny 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (gpu 3, tiny 1)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="also run compiled (default: on CUDA yes, on a CPU no)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for both sides (e.g. data.cache_dir=DIR)")
    ap.add_argument("--out", help="also write the JSON to this file")
    ap.add_argument("--rows", default=",".join(ROW_GROUPS),
                    help="comma-separated row groups: base (threefold vs transformers, always "
                         "run: the reference), fp8 (train.fp8 tensorwise/rowwise vs bf16), moe "
                         "(grouped vs looped experts; the MoE in FP8 vs bf16)")
    args = ap.parse_args(argv)
    args.rows = set(args.rows.split(",")) | {"base"}
    if args.rows - set(ROW_GROUPS):
        ap.error(f"--rows: unknown {sorted(args.rows - set(ROW_GROUPS))}; "
                 f"choose from {','.join(ROW_GROUPS)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    tiny = args.shape == "tiny"
    args.steps = args.steps or (20 if tiny else 10)
    args.warmup = max(1, args.warmup if args.warmup is not None else (1 if tiny else 3))
    if args.compile is None:
        args.compile = args.device == "cuda"
    return args


def main(argv=None) -> dict:
    """Run the benchmark; returns the summary (the JSON line's content)."""
    args = parse(argv)
    t0 = time.perf_counter()
    modes = ["eager", "compiled"] if args.compile else ["eager"]
    got = run_rounds(args, modes)
    summary = summarise(args, modes, got)
    summary["wall_s"] = time.perf_counter() - t0
    print_report(summary, got, modes, args.rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
