"""What a run reports: peak FLOP/s of the device (for MFU; the figures come from
``threefold.hardware.catalogue``), peak memory, and the per-step record written to metrics.jsonl.

MFU is "unknown" (None in JSON) when the device's peak is unknown: never a guess. On a CPU the
peak is *measured* by a short matmul probe at the compute dtype, so CPU MFU reads as "share of
what this CPU's matmul reaches", and says so in the summary.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from threefold.hardware.catalogue import cpu_matmul_flops, peak_flops_for_device_name

__all__ = ["MetricsWriter", "current_memory_bytes", "device_peak_flops", "last_logged_step",
           "peak_memory_bytes", "proc_status_kib", "raise_cpu_peak", "reset_peak_memory",
           "truncate_metrics"]

_CPU_PEAKS: dict[tuple[torch.dtype, int], float] = {}


def device_peak_flops(device: torch.device, dtype: torch.dtype, precision: str | None = None
                      ) -> tuple[float | None, str]:
    """(peak FLOP/s, where the figure came from) for matmuls in ``dtype``, or in
    ``precision`` ('fp8': FP8 matmuls) where given. CUDA devices come from the hardware
    catalogue by name; CPUs are probed, once per process for each dtype and thread count
    (half a second each: runs after the first in a process reuse it), and have no FP8 peak;
    anything else is unknown."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        precision = precision or ("bf16" if dtype == torch.bfloat16 else "fp32")
        peak = peak_flops_for_device_name(name, precision)
        where = f"catalogue:{name}" + (" fp8" if precision == "fp8" else "")
        return (peak, where) if peak else (None, "unknown")
    if precision == "fp8":
        return None, "unknown"
    if device.type == "cpu":
        key = (dtype, torch.get_num_threads())
        if key not in _CPU_PEAKS:
            _CPU_PEAKS[key] = cpu_matmul_flops(dtype)
        return _CPU_PEAKS[key], "cpu-matmul-probe"
    return None, "unknown"


def raise_cpu_peak(dtype: torch.dtype, achieved: float) -> tuple[float, str]:
    """A CPU step measured ``achieved`` FLOP/s, above the probed peak: the probe ran at a
    busy moment. Keep the highest rate seen (the probe's or the step's own), so MFU never
    reads above 100%; later runs in this process use it too. Nothing is probed again: a probe
    inside the training loop would take half a second on the ranks whose step beat the peak
    and not on the others, putting them out of step."""
    key = (dtype, torch.get_num_threads())
    peak = max(_CPU_PEAKS.get(key, 0.0), achieved)
    _CPU_PEAKS[key] = peak
    return peak, "cpu-matmul-probe, raised to the highest rate seen"


def proc_status_kib(field: str) -> int | None:
    """A KiB figure of /proc/self/status (VmRSS, VmHWM), None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank since the last ``reset_peak_memory``: allocator peak on CUDA,
    peak resident set size on a CPU (Linux's VmHWM, which can be reset; ru_maxrss elsewhere)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def current_memory_bytes(device: torch.device) -> int:
    """Memory this rank holds now: allocated on CUDA, the resident set on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    rss = proc_status_kib("VmRSS")
    return rss * 1024 if rss is not None else peak_memory_bytes(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak from what is held now (between the phases of a run: start-up,
    loading, steps). On Linux the resident high-water mark is reset through
    /proc/self/clear_refs; where that is not possible the peak stays the process's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class MetricsWriter:
    """Appends one JSON object per step to DIR/metrics.jsonl (flushed every line, so a crash
    loses at most the step in progress)."""

    def __init__(self, path: Path, append: bool):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Write one record."""
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file."""
        self._f.close()


def truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop records written after the checkpoint being resumed from, so the file
    has exactly one record per step."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (ValueError, KeyError):
            continue
    path.write_text("".join(k + "\n" for k in keep))


def logged_records(path: Path):
    """metrics.jsonl's records one at a time (a line cut short by a crash is passed over;
    none when the file does not exist)."""
    if not path.exists():
        return
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "step" in record:
                yield record


def last_logged_step(path: Path) -> int:
    """The highest step recorded in metrics.jsonl (0 if none)."""
    return max((int(r["step"]) for r in logged_records(path)), default=0)
