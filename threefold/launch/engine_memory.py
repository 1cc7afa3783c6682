"""The dry run's GRPO rollout engine (``grpo.rollout_engine vllm``): what it adds to each
rank's step peak when colocated, or what its own process holds as a server, and the note
that says so (the bytes: ``threefold.plan.rollout_engine``)."""

from __future__ import annotations

from threefold.config import Config, ModelConfig
from threefold.plan.baseline import TaskData
from threefold.plan.rollout_engine import engine_bytes, runtime_bytes


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f}"


def engine_memory(cfg: Config, mcfg: ModelConfig, task: TaskData | None, notes: list[str],
                  on_cpu: bool, threads: int, process: int) -> tuple[int, int]:
    """(bytes in each rank's step peak, bytes of the server's process) of GRPO's vLLM engine,
    with a note of each part and the sync's bytes; (0, 0) without one. ``on_cpu``: the
    engine runs on this CPU (vLLM's packed copies and its runtime are counted), with
    ``threads`` per rank; ``process``: a fresh process's own bytes (the server's
    interpreter and torch)."""
    if task is None or task.rollout_engine != "vllm":
        return 0, 0
    dtype = cfg.train.dtype if cfg.train.dtype == "bfloat16" else "float32"
    e = engine_bytes(mcfg, 2 if dtype == "bfloat16" else 4, task.engine_kv_bytes, on_cpu)
    runtime = runtime_bytes(dtype, threads) if on_cpu else 0
    kv = task.engine_kv_bytes
    parts = (f"weights {_gb(e.resident - kv - e.packed)}"
             + (f", the CPU kernels' packed embedding and head {_gb(e.packed)}" if on_cpu
                else "")
             + f", KV cache {_gb(kv)}"
             + (f", vLLM's runtime {_gb(runtime)} (measured once: a tiny engine in a fresh "
                "process)" if on_cpu else ", vLLM's runtime not counted (host memory)"))
    sync = f"each weight sync hands it {e.sync:,} bytes (fp32), once per optimiser step"
    if task.engine_mode == "server":
        server = process + e.resident + runtime
        notes.append(f"rollout engine vllm (server): its own process holds "
                     f"{_gb(server)} GB, none of it on the training ranks: "
                     + (f"Python and torch {_gb(process)}, " if process else "") + parts
                     + f"; {sync}")
        return 0, server
    notes.append(f"rollout engine vllm (colocated): {_gb(e.resident + runtime)} GB per rank, "
                 f"in the step's peak: {parts}; {sync}")
    return e.resident + runtime, 0
