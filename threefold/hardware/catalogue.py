"""The accelerators threefold knows, below both the planner (``threefold.plan``) and the
runtime's MFU (``threefold.hardware.metrics``): the catalogue of datasheet figures, and the measured
matmul rate of this CPU (``cpu_matmul_flops``, the peak a CPU's MFU divides by).

A ``Hardware`` is the triple the cost model needs (peak FLOP/s, link bandwidth, link latency)
plus memory. It comes from the catalogue below (vendor datasheet figures, dense, no sparsity),
from CLI overrides, or from a measurement (``Hardware.measured``) — the cost model never knows
which, so a calibrated machine drops in where a catalogue entry would.

Units inside this module are SI: FLOP/s, bytes, bytes/s *per direction per GPU*, seconds.
Datasheets quote NVLink as both directions summed (A100: 600 GB/s = 300 GB/s each way) and
network cards in bits per second per direction (400 Gb/s = 50 GB/s); the conversions are
written out where the catalogue is built so nobody has to remember which is which.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass


GB = 1e9  # datasheets use decimal gigabytes

# Per-hop latency of a collective step (α in the α–β model). Not datasheet figures: typical
# small-message NCCL latencies over NVLink and over InfiniBand/RoCE. Overridable; a measured α
# from --calibrate replaces them.
NVLINK_LATENCY_S = 2e-6
NETWORK_LATENCY_S = 6e-6
DEFAULT_INTER_NODE_GBITS = 400.0  # per GPU: one 400 Gb/s NIC (InfiniBand NDR, RoCE)
# Host memory bandwidth of one node, for an optimiser step run on the host
# (``parallel.offload_optimizer``). Not a GPU datasheet figure but an assumed host: two
# sockets of 8 DDR5-4800 channels, 4800 MT/s × 8 bytes = 38.4 GB/s per channel (JEDEC
# DDR5), 614 GB/s per node in theory, shared by the node's GPUs. Overridable per Hardware.
DEFAULT_HOST_MEMORY_BW = 2 * 8 * 38.4 * 1e9


@dataclass(frozen=True)
class Hardware:
    """One accelerator as the cost model sees it. ``None`` peak means unknown (MFU unknown)."""

    name: str
    peak_flops_16bit: float | None  # dense bf16 (fp16 on V100) tensor-core FLOP/s
    peak_flops_fp32: float | None  # dense fp32 FLOP/s (no TF32: PyTorch's default for matmul)
    memory_bytes: float
    intra_node_bw: float  # bytes/s per direction per GPU inside a node (NVLink)
    inter_node_bw: float  # bytes/s per direction per GPU across nodes (network card)
    memory_bw: float | None = None  # HBM bytes/s (memory-bound kernels); None = not modelled
    # device <-> host link (PCIe) bytes/s per direction per GPU, what optimiser offload moves
    # gradients and parameters over; None = host and device are one memory (a CPU machine)
    host_link_bw: float | None = None
    host_memory_bw: float | None = None  # host memory bytes/s per node; None = not modelled
    intra_node_latency_s: float = NVLINK_LATENCY_S
    inter_node_latency_s: float = NETWORK_LATENCY_S
    # Achieved fraction of the peak for large matmuls; None = the cost model's calibrated
    # constant (datasheet peaks), 1.0 for a measured peak (it is already achieved FLOP/s).
    matmul_efficiency: float | None = None
    # dense FP8 (e4m3/e5m2) tensor-core FLOP/s; None: no FP8 units (A100, V100) or unknown
    peak_flops_fp8: float | None = None

    def peak_flops(self, precision: str) -> float | None:
        """Peak matmul FLOP/s for ``precision`` ('bf16', 'fp32' or 'fp8'); None if unknown."""
        if precision == "fp8":
            return self.peak_flops_fp8
        if precision == "bf16":
            return self.peak_flops_16bit
        if precision == "fp32":
            return self.peak_flops_fp32
        raise ValueError(f"precision '{precision}' is not bf16, fp32 or fp8")

    def link(self, inter_node: bool) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of the link a collective group uses."""
        if inter_node:
            return self.inter_node_latency_s, self.inter_node_bw
        return self.intra_node_latency_s, self.intra_node_bw

    def with_overrides(self, **changes) -> "Hardware":
        """A copy with the given fields replaced (None values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def measured(cls, name: str, peak_flops: float, bandwidth: float, latency_s: float,
                 memory_bytes: float, precision: str = "bf16") -> "Hardware":
        """Hardware from a measurement (e.g. ``--calibrate``): one achieved matmul FLOP/s and one
        (bandwidth, latency) pair used for every link, as on a single machine."""
        flops = {"peak_flops_16bit": None, "peak_flops_fp32": None}
        flops["peak_flops_16bit" if precision == "bf16" else "peak_flops_fp32"] = peak_flops
        return cls(name=name, memory_bytes=memory_bytes, intra_node_bw=bandwidth,
                   inter_node_bw=bandwidth, intra_node_latency_s=latency_s,
                   inter_node_latency_s=latency_s, matmul_efficiency=1.0, **flops)


def _gpu(name: str, tflops16: float, tflops32: float, memory_gb: float, hbm_gb_s: float,
         nvlink_gb_both_ways: float, pcie_gb_both_ways: float,
         tflops8: float | None = None) -> Hardware:
    return Hardware(name=name, peak_flops_16bit=tflops16 * 1e12, peak_flops_fp32=tflops32 * 1e12,
                    peak_flops_fp8=tflops8 * 1e12 if tflops8 else None,
                    memory_bytes=memory_gb * GB, intra_node_bw=nvlink_gb_both_ways / 2 * GB,
                    inter_node_bw=DEFAULT_INTER_NODE_GBITS / 8 * GB, memory_bw=hbm_gb_s * GB,
                    host_link_bw=pcie_gb_both_ways / 2 * GB,
                    host_memory_bw=DEFAULT_HOST_MEMORY_BW)


# NVIDIA datasheets (SXM parts, dense). V100 has no bf16: its 16-bit figure is fp16 tensor cores.
# FP8 (E4M3/E5M2 tensor cores, dense): H100 SXM 1979 TF/s, twice its bf16; H200 has the same
# compute; V100 and A100 have no FP8 (compute capability 7.0 / 8.0, FP8 needs 8.9+).
# HBM bandwidth: V100 900 GB/s, A100 80GB 2039, A100 40GB 1555, H100 SXM 3350, H200 4800.
# PCIe to the host, both directions summed as the datasheets quote it: V100 Gen3 32 GB/s,
# A100 Gen4 64 GB/s, H100/H200 SXM Gen5 128 GB/s (16 / 32 / 64 GB/s each way).
GPUS: dict[str, Hardware] = {
    "v100": _gpu("v100", tflops16=125, tflops32=15.7, memory_gb=32, hbm_gb_s=900,
                 nvlink_gb_both_ways=300, pcie_gb_both_ways=32),
    "a100": _gpu("a100", tflops16=312, tflops32=19.5, memory_gb=80, hbm_gb_s=2039,
                 nvlink_gb_both_ways=600, pcie_gb_both_ways=64),
    "a100-40gb": _gpu("a100-40gb", tflops16=312, tflops32=19.5, memory_gb=40, hbm_gb_s=1555,
                      nvlink_gb_both_ways=600, pcie_gb_both_ways=64),
    # FP8: the SXM datasheets' 3,958 TF/s is with 2:4 sparsity; dense is half (V100 and A100
    # have no FP8 tensor cores)
    "h100": _gpu("h100", tflops16=989, tflops32=67, memory_gb=80, hbm_gb_s=3350,
                 nvlink_gb_both_ways=900, pcie_gb_both_ways=128, tflops8=1979),
    "h200": _gpu("h200", tflops16=989, tflops32=67, memory_gb=141, hbm_gb_s=4800,
                 nvlink_gb_both_ways=900, pcie_gb_both_ways=128, tflops8=1979),
    # NVIDIA HGX B200 datasheet, for its 8 GPUs: FP8 72 PFLOPS and FP16/BF16 36 PFLOPS with
    # 2:4 sparsity (dense is half: 4.5 and 2.25 PF per GPU), FP32 600 TFLOPS, 1,440 GB of
    # HBM3e at 64 TB/s (180 GB and 8 TB/s per GPU); fifth-generation NVLink 1.8 TB/s per GPU,
    # both directions summed; the host link PCIe Gen5 x16
    "b200": _gpu("b200", tflops16=2250, tflops32=75, memory_gb=180, hbm_gb_s=8000,
                 nvlink_gb_both_ways=1800, pcie_gb_both_ways=128, tflops8=4500),
}


def get_hardware(name: str) -> Hardware:
    """The catalogue entry ``name`` (case-insensitive); ValueError naming the choices."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"--gpu: unknown GPU '{name}'; known: {', '.join(GPUS)}")
    return GPUS[key]


def hardware_for_device_name(device_name: str) -> Hardware | None:
    """The catalogue entry for a CUDA device name (``torch.cuda.get_device_name``), or None
    when the name is not one whose datasheet peak we know: PCIe and NVL variants of H100/H200
    and V100 have lower peaks than the SXM parts listed here, and GB200's B200 (the Grace
    board, run at a higher power) a higher one than HGX B200's, so they are not guessed."""
    name = device_name.upper()
    if any(variant in name for variant in ("PCIE", "NVL", "GB200")) and "A100" not in name:
        return None  # (A100 PCIe has the SXM part's 312 TF/s; the others do not)
    for key, marker in (("b200", "B200"), ("h200", "H200"), ("h100", "H100"), ("v100", "V100")):
        if marker in name:
            return GPUS[key]
    if "A100" in name:
        return GPUS["a100-40gb" if "40GB" in name else "a100"]
    return None


def peak_flops_for_device_name(device_name: str, precision: str) -> float | None:
    """Datasheet peak FLOP/s ('bf16', 'fp32' or 'fp8') of a CUDA device by name; None if unknown
    (then MFU is reported as unknown, never guessed)."""
    hw = hardware_for_device_name(device_name)
    return hw.peak_flops(precision) if hw else None


def cpu_matmul_flops(dtype=None, n: int = 1024, seconds: float = 0.5,
                     statistic: str = "best") -> float:
    """Measured FLOP/s of an n×n matmul on this CPU, with the threads torch uses now, over
    ``seconds`` of single multiplies: the best ("best"), so that a busy moment on a shared
    machine does not lower the peak (a low peak would inflate MFU past 100%), or the median
    ("median"), the sustained rate a training step sees. ``dtype``: a torch dtype, float32
    when None."""
    import torch  # here: the catalogue and the planner need no torch

    dtype = dtype or torch.float32
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm-up
    rates, t_end = [], time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        torch.mm(a, b)
        t1 = time.perf_counter()
        rates.append(2.0 * n**3 / (t1 - t0))
        if t1 >= t_end:
            return max(rates) if statistic == "best" else statistics.median(rates)
