"""`threefold plan --calibrate`: measure what this machine really does, so the planner can
predict for it instead of for a catalogue GPU.

Three measurements, each a few seconds:
- matmul FLOP/s, fp32 and bf16, at 1 thread and at every thread torch uses: the median rate
  of back-to-back square products (1024², smaller where the dtype is slow), the sustained
  rate a training step sees on a shared machine; and fp32 again with as many processes
  multiplying at once as the all-reduce uses ranks, each on its share of the threads (what
  each rank gets when they all compute: less than one process alone where cores are busy);
- memory bandwidth: the best of several copies of a 64 MB tensor (read + write), which
  bounds the elementwise kernels the cost model counts as memory traffic;
- gloo all-reduce between local processes (started with ``torch.multiprocessing``, joined
  through a TCPStore this process serves on a port the OS picks): the median time of a few
  all-reduces per size, fitted to the α-β model the cost model uses (``Collective.time``):
  t(S) = 2(n-1)·α + 2(n-1)/n · S/β (``fit_alpha_beta``).

The result is a JSON file (``--calibrate-out``, default ``DEFAULT_PATH``) that ``threefold plan
--hardware-file`` and ``threefold train --dry-run`` (``THREEFOLD_HARDWARE=FILE``) turn into a
``Hardware.measured`` entry with ``hardware_from_calibration``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from threefold.hardware.catalogue import Hardware, cpu_matmul_flops

DEFAULT_PATH = Path("~/.cache/threefold/calibration.json")
ALLREDUCE_BYTES = (4, 64 * 1024, 1 << 20, 4 << 20, 16 << 20)
REPEATS = 3


# --------------------------------------------------------------------------------------------
# Compute and memory
# --------------------------------------------------------------------------------------------
def matmul_flops(dtype_name: str, threads: int, seconds: float = 0.3,
                 statistic: str = "median") -> float:
    """Measured matmul FLOP/s at ``dtype_name`` ('fp32' or 'bf16') on ``threads`` threads, over
    ``seconds`` of back-to-back square products. ``statistic`` 'median' is the sustained rate a
    training step sees on a shared machine (what the planner needs); 'best' is the peak
    ``threefold.hardware.catalogue.cpu_matmul_flops`` reports (what MFU divides by). The matrix size
    adapts to the rate: CPUs without bf16 instructions multiply bf16 a hundred times slower
    than fp32, and one 1024² product must not take seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
        a = torch.randn(256, 256, dtype=dtype)
        torch.mm(a, a)
        t0 = time.perf_counter()
        torch.mm(a, a)
        rough = 2 * 256**3 / max(time.perf_counter() - t0, 1e-9)
        n = 1024 if rough * 0.05 >= 2 * 1024**3 else 512 if rough * 0.05 >= 2 * 512**3 else 256
        return cpu_matmul_flops(dtype, n=n, seconds=seconds, statistic=statistic)
    finally:
        torch.set_num_threads(before)


def machine_ram() -> int:
    """Physical memory of this machine in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def memory_bandwidth(nbytes: int = 64 << 20, repeats: int = 8) -> float:
    """Bytes/s of the best of ``repeats`` copies of an ``nbytes`` fp32 tensor (each copy reads
    and writes ``nbytes``: 2·nbytes moved)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _matmul_worker(rank: int, dtype_name: str, threads: int, seconds: float, out) -> None:
    """One of several concurrent probes: its sustained matmul rate."""
    out.put(matmul_flops(dtype_name, threads, seconds))


def _run_processes(target, processes: int, args: tuple, results: int,
                   timeout_s: float) -> list:
    """Start ``processes`` spawned processes ``target(rank, *args, queue)`` and return the
    first ``results`` items they put on the queue; every process is joined (killed if it
    hangs) whatever happens."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out), daemon=True)
             for r in range(processes)]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=timeout_s) for _ in range(results)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def concurrent_matmul_flops(dtype_name: str, processes: int, threads: int = 1,
                            seconds: float = 1.0, timeout_s: float = 120.0) -> float:
    """The matmul FLOP/s *each* of ``processes`` processes gets while all of them multiply at
    once (the slowest one's median), as ``processes`` ranks on this machine would: on a
    machine with fewer free cores than ranks, one process alone measures too much."""
    return min(_run_processes(_matmul_worker, processes, (dtype_name, threads, seconds),
                              processes, timeout_s))


# --------------------------------------------------------------------------------------------
# gloo all-reduce between local processes
# --------------------------------------------------------------------------------------------
def _allreduce_worker(rank: int, world: int, port: int, sizes: tuple[int, ...], repeats: int,
                      out) -> None:
    """One rank: join the group through the launcher's store, time all-reduces per size."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        times = {}
        for size in sizes:
            t = torch.ones(max(1, size // 4))
            dist.all_reduce(t)  # warm-up: connections, buffers
            samples = []
            # small messages are cheap and their time is all scheduling noise and latency:
            # take more of them
            for _ in range(repeats if size >= 1 << 20 else 3 * repeats):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                samples.append(time.perf_counter() - t0)
            times[size] = statistics.median(samples)
        if rank == 0:
            out.put(times)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def allreduce_times(world: int = 2, sizes: tuple[int, ...] = ALLREDUCE_BYTES,
                    repeats: int = REPEATS, timeout_s: float = 120.0) -> dict[int, float]:
    """{bytes: median seconds} of gloo all-reduces among ``world`` local processes."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    result, = _run_processes(_allreduce_worker, world, (world, store.port, sizes, repeats), 1,
                             timeout_s)  # rank 0 reports
    return {int(k): v for k, v in result.items()}


def fit_alpha_beta(times: dict[int, float], world: int) -> tuple[float, float]:
    """(latency α seconds per ring step, bandwidth β bytes/s) of the cost model's ring
    all-reduce, t = 2(n-1)·α + 2(n-1)/n·S/β. α comes from the smallest message, which is all
    latency; β from a least-squares line through the origin of the larger messages' remaining
    time against the bytes each rank moves (a free intercept is at the mercy of one noisy
    large message)."""
    steps, frac = 2 * (world - 1), 2 * (world - 1) / world
    smallest = min(times)
    latency = times[smallest] / steps
    pts = [(frac * s, t - steps * latency) for s, t in times.items() if s != smallest]
    sxx = sum(x * x for x, _ in pts)
    slope = sum(x * y for x, y in pts) / sxx if sxx else 0.0
    bandwidth = 1.0 / slope if slope > 0 else float("inf")
    return latency, bandwidth


# --------------------------------------------------------------------------------------------
# The whole calibration and its use
# --------------------------------------------------------------------------------------------
def calibrate(world: int = 2, log=print) -> dict:
    """Run every measurement; return the record ``hardware_from_calibration`` reads."""
    threads = torch.get_num_threads()
    counts = sorted({1, threads})
    t0 = time.perf_counter()
    flops = {dt: {str(n): matmul_flops(dt, n) for n in counts} for dt in ("fp32", "bf16")}
    for dt, per in flops.items():
        log(f"matmul {dt}: " + ", ".join(f"{float(v) / 1e9:.1f} GFLOP/s on {n} thread(s)"
                                        for n, v in per.items()))
    per_rank = max(1, threads // world)
    concurrent = concurrent_matmul_flops("fp32", world, per_rank, seconds=0.5)
    log(f"matmul fp32, {world} processes at once: {concurrent / 1e9:.1f} GFLOP/s each on "
        f"{per_rank} thread(s)")
    mem_bw = memory_bandwidth()
    log(f"memory bandwidth (copy): {mem_bw / 1e9:.2f} GB/s")
    times = allreduce_times(world)
    latency, bandwidth = fit_alpha_beta(times, world)
    log(f"gloo all-reduce, {world} local processes: latency {latency * 1e6:.0f} us per ring "
        f"step, bandwidth {bandwidth / 1e9:.2f} GB/s (" + ", ".join(
            f"{s} B: {t * 1e3:.2f} ms" for s, t in times.items()) + ")")
    log(f"calibration took {time.perf_counter() - t0:.1f} s")
    return {"name": f"cpu-{platform.node() or 'local'}", "cores": os.cpu_count() or 1,
            "threads": threads, "matmul_flops": flops,
            "matmul_flops_concurrent": {"fp32": {str(world): concurrent}},
            "memory_bandwidth": mem_bw,
            "allreduce": {"ranks": world, "latency_s": latency, "bandwidth": bandwidth,
                          "times": {str(k): v for k, v in times.items()}},
            "memory_bytes": machine_ram(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def save(record: dict, path: str | Path) -> Path:
    """Write ``record`` as JSON to ``path`` (directories made); return the path."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return path


def load(path: str | Path) -> dict:
    """Read a calibration record; ValueError naming the file if it is not one."""
    path = Path(path).expanduser()
    try:
        record = json.loads(path.read_text())
        record["matmul_flops"]["fp32"], record["allreduce"]["bandwidth"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a calibration file from `threefold plan --calibrate` "
                         f"({e})") from None
    return record


def hardware_from_calibration(record: dict, ranks_on_machine: int = 1,
                              threads_per_rank: int | None = None):
    """A ``Hardware`` for one rank of ``ranks_on_machine`` sharing this machine: the matmul
    rate measured at the threads each rank gets (``threads_per_rank``, by default the
    machine's threads // ranks; the nearest measured count not above it), the measured copy
    bandwidth shared among the ranks, the fitted all-reduce latency and bandwidth for every
    link, and the machine's memory shared among the ranks."""
    ranks = max(1, ranks_on_machine)
    per_rank = threads_per_rank or max(1, record.get("threads", record.get("cores", 1)) // ranks)

    def rate(dtype: str) -> float | None:
        """The measured rate of ``dtype`` for one of ``ranks`` ranks: measured with that many
        processes at once if it was, else at the thread count nearest ``per_rank``."""
        both = record.get("matmul_flops_concurrent", {}).get(dtype, {})
        if ranks > 1 and str(ranks) in both:
            return both[str(ranks)]
        table = {int(k): v for k, v in record["matmul_flops"].get(dtype, {}).items()}
        if not table:
            return None
        usable = [n for n in table if n <= per_rank] or [min(table)]
        return table[max(usable)]

    ar = record["allreduce"]
    mem_bw = record.get("memory_bandwidth")
    hw = Hardware.measured(record.get("name", "cpu"), peak_flops=rate("bf16") or 0.0,
                           bandwidth=ar["bandwidth"], latency_s=ar["latency_s"],
                           memory_bytes=record.get("memory_bytes", 0) / ranks,
                           precision="bf16")
    return hw.with_overrides(peak_flops_fp32=rate("fp32"),
                             memory_bw=mem_bw / ranks if mem_bw else None)


# two steps of a one-block model of width 64 (the second under a document mask), then dropped
_TINY_STEP = (
    "from threefold.config import ModelConfig\n"
    "from threefold.model.decoder import CausalLM\n"
    "cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,\n"
    "                  num_hidden_layers=1, num_attention_heads=4,\n"
    "                  num_key_value_heads=2).resolved()\n"
    "model = CausalLM(cfg)\n"
    "model.init_weights(0)\n"
    "opt = torch.optim.AdamW(model.parameters())\n"
    "ids = torch.randint(0, 256, (1, 32))\n"
    "for doc in (None, torch.zeros(1, 32, dtype=torch.long)):\n"
    "    model(ids, document_ids=doc, labels=ids).sum().backward()\n"
    "    opt.step()\n"
    "    opt.zero_grad()\n"
    "del model, opt\n")


def cpu_baseline_bytes(threads: int = 1, path: str | Path = DEFAULT_PATH) -> int:
    """Resident bytes of a fresh Python process that has imported torch and threefold's
    training modules, used the meta device and run a matmul on ``threads`` threads, then
    trained a model of a few thousand weights for two steps (plain and under a document
    mask) and dropped it: what every rank holds besides its model (torchrun gives each of
    several ranks one thread) — the code a step runs (autograd, the kernels) is loaded once
    and stays, ~14 MB on torch 2.13, whatever the model.
    Measured once per machine, Python, installed packages and threefold source
    (``measured_once``); 0 where it cannot be
    measured."""
    code = ("import torch, threefold.training.train, threefold.parallel.distributed_world\n"
            "from threefold.hardware.metrics import current_memory_bytes\n"
            f"torch.set_num_threads({int(threads)})\n"
            "torch.empty(1, device='meta') + 1\n"
            "torch.ones(64, 64) @ torch.ones(64, 64)\n" + _TINY_STEP +
            "print(current_memory_bytes(torch.device('cpu')))\n")
    key = f"step|{sys.executable}|{torch.__version__}|{int(threads)}"  # step: with _TINY_STEP
    root = str(Path(__file__).resolve().parents[2])  # threefold importable from any directory
    env = {**os.environ, "OMP_NUM_THREADS": str(int(threads)), "PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    got = measured_once(key, [sys.executable, "-c", code], env, path)
    return got[-1] if got else 0


def environment_digest() -> str:
    """A short digest of what a fresh process imports: every installed distribution's name
    and version, and threefold's own source files (their paths and sizes: an editable
    install changes without a new version). A probe's resident bytes depend on all of it:
    installing vLLM's CPU engine beside torch makes torch import Triton, +85 MB a process,
    under the same Python and torch. Computed once per process."""
    global _DIGEST
    if _DIGEST is None:
        from importlib import metadata

        h = hashlib.sha256()
        for name in sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                           if d.metadata['Name']):
            h.update(name.encode() + b"\n")
        root = Path(__file__).resolve().parents[1]
        for f in sorted(root.rglob("*.py")):
            h.update(f"{f.relative_to(root)}:{f.stat().st_size}\n".encode())
        _DIGEST = h.hexdigest()[:16]
    return _DIGEST


_DIGEST: str | None = None


def measured_once(key: str, argv: list[str], env: dict, path: str | Path = DEFAULT_PATH
                  ) -> list[int] | None:
    """The integers a fresh process (``argv``, ``env``) prints, measured once and kept by
    ``key`` and the ``environment_digest`` in the calibration file's directory
    (``baseline.json``: the process's own bytes, each tokenizer's); None where the process
    fails. A measurement under another environment is replaced, never reused. A read-only
    home measures again next time."""
    cache = Path(path).expanduser().with_name("baseline.json")
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    full = f"{key}|env={environment_digest()}"
    if full not in known:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                                 check=True, env=env).stdout
            value = [int(x) for x in out.strip().splitlines()[-1].split()]
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None
        known = {k: v for k, v in known.items() if k.split("|env=")[0] != key}
        known[full] = value
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(known))
        except OSError:
            pass
    value = known[full]
    return value if isinstance(value, list) else [value]
