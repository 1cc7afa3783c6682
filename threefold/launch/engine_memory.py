"""The dry run's GRPO rollout engine (``grpo.rollout_engine vllm``): what it adds to each
rank's step peak when colocated, or what its own processes hold as a server, and the note
that says so (the bytes: ``threefold.plan.rollout_engine``)."""

from __future__ import annotations

from threefold.config import Config, ModelConfig
from threefold.layout import Layout, Workload
from threefold.plan.baseline import TaskData
from threefold.plan.rollout_engine import (EngineBytes, engine_bytes, engine_sleeps,
                                           runtime_bytes, sync_tp_bytes)


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f}"


def engine_memory(cfg: Config, mcfg: ModelConfig, layout: Layout, work: Workload,
                  task: TaskData | None, notes: list[str], on_cpu: bool, threads: int,
                  process: int) -> tuple[int, int]:
    """(bytes in each rank's step peak, bytes of the server's largest process) of GRPO's vLLM
    engine, with a note of each part and the sync's bytes; (0, 0) without one. ``on_cpu``:
    the engine runs on this CPU (vLLM's packed copies and its runtime are counted), with
    ``threads`` per rank; ``process``: a fresh process's own bytes (a server process's
    interpreter and torch). Colocated, the engine is sharded as the trainer's ``layout``
    is over tp."""
    if task is None or task.rollout_engine != "vllm":
        return 0, 0
    dtype = cfg.train.dtype if cfg.train.dtype == "bfloat16" else "float32"
    tp = task.engine_tp if task.engine_mode == "server" else layout.tp
    e = engine_bytes(mcfg, 2 if dtype == "bfloat16" else 4, task.engine_kv_bytes, on_cpu, tp)
    runtime = runtime_bytes(dtype, threads) if on_cpu else 0
    sync = f"each weight sync hands it {e.sync:,} bytes (fp32), once per optimiser step"
    gathered = sync_tp_bytes(mcfg, layout, work)
    if gathered:
        sync += (f", the slices of the trainer's tensor parallelism first gathered a layer at "
                 f"a time: each rank sends {gathered:,} bytes on tp")
    if task.engine_mode == "server":
        return 0, _server(e, task, tp, process, runtime, on_cpu, notes, sync)
    where = f"colocated, tp {tp}: a shard" if tp > 1 else "colocated"
    peak = ("in the step's peak" if not sleeps(task, on_cpu) else
            "asleep while the trainer trains (vLLM's sleep mode, level 2), so the peak is the "
            "larger of the step's and the rollout's (weights, gradients, optimiser state and "
            "this)")
    notes.append(f"rollout engine vllm ({where}): {_gb(e.resident + runtime)} GB per rank, "
                 f"{peak}: {_parts(e, task.engine_kv_bytes, runtime, on_cpu)}; {sync}")
    return e.resident + runtime, 0


def sleeps(task: TaskData | None, on_cpu: bool) -> bool:
    """Whether GRPO's engine sleeps while the trainer trains: colocated, synchronous, on a
    GPU (``threefold.generation.vllm_rollouts``; vLLM has no sleep mode on a CPU)."""
    return (task is not None and task.rollout_engine == "vllm"
            and engine_sleeps(not on_cpu, task.engine_mode, task.engine_async))


def _parts(e: EngineBytes, kv: int, runtime: int, on_cpu: bool) -> str:
    """The engine's bytes by part, as the notes say them."""
    return (f"weights {_gb(e.resident - kv - e.packed)}"
            + (f", the CPU kernels' packed embedding and head {_gb(e.packed)}" if on_cpu
               else "")
            + f", KV cache {_gb(kv)}"
            + (", vLLM's runtime not counted (host memory)" if not on_cpu else
               f", vLLM's runtime {_gb(runtime)} (measured once: a tiny engine in a fresh "
               "process)" if runtime else ", vLLM's runtime not measured (vLLM did not start "
               "here)"))


def _server(e: EngineBytes, task: TaskData, tp: int, process: int, runtime: int,
            on_cpu: bool, notes: list[str], sync: str) -> int:
    """The server's note and its largest process's peak. At tp 1 one process holds the
    engine, the weights of a sync streaming through it. At tp > 1 vLLM's engine core holds no
    weights but receives a sync's whole and sends each worker the whole (each keeps its
    shard): both hold the sync's bytes while it lasts."""
    base = (f"Python and torch {_gb(process)}, " if process else "")
    if tp == 1:
        peak = process + e.resident + runtime
        notes.append(f"rollout engine vllm (server): its own process holds {_gb(peak)} GB, "
                     f"none of it on the training ranks: {base}"
                     f"{_parts(e, task.engine_kv_bytes, runtime, on_cpu)}; {sync}")
        return peak
    core = process + runtime + e.sync
    worker = process + runtime + e.resident + e.sync
    notes.append(f"rollout engine vllm (server, tp {tp}): {tp + 1} processes, none on the "
                 f"training ranks: the engine core {_gb(core)} GB ({base}vLLM's runtime "
                 f"{_gb(runtime)}, a sync's weights whole {_gb(e.sync)}) and each of {tp} "
                 f"workers {_gb(worker)} GB ({base}"
                 f"{_parts(e, task.engine_kv_bytes, runtime, on_cpu)}, a sync's weights "
                 f"whole {_gb(e.sync)}, before it keeps its shard); {sync}")
    return max(core, worker)
