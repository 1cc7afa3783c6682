"""Host memory: keep freed large blocks for reuse instead of mapping fresh pages every step.

glibc serves an allocation above its mmap threshold (at most 32 MiB when it adjusts the
threshold itself) with a fresh ``mmap`` and returns it with ``munmap`` when freed. A training
step on a CPU allocates and frees the same large tensors every step (the logits of a batch,
their log-softmax and gradients: 2048 tokens × 4096 vocabulary × 4 bytes = 32 MiB each in the
default run), so every step pays a page fault and a zeroed page per 4 KiB of them again.
Raising the threshold makes glibc keep such blocks in its heap and hand them out again; the
price is a resident set that stays near its high-water mark. ``python3 bench/bench_mfu.py
--with train.host_mmap_threshold_mb=0`` A/Bs it on the default step (2026-12-04: MFU 75.5%
with it, 67.6% without; peak RSS 786 against 738 MiB). This is what tcmalloc or jemalloc,
preloaded, would do for the whole process; ``mallopt`` needs no preload.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
# With several ranks on one machine the opposite holds: a heap that keeps freed blocks
# fragments around the long-lived ones (AdamW's state, shard gradients, ZeRO's gathered units,
# gloo's copies made on its own threads) until a rank holds far more than its live tensors:
# a 256M model on 4 ranks peaked at 5.1 GiB per rank under ZeRO-3 (2.0 with 1 MiB), 3.4 under
# pp 2 × ZeRO-1 (2.3 with 1 MiB). Blocks of 1 MiB and more are then mapped and unmapped, so
# the resident set follows the live tensors (what the dry run predicts), below glibc's own
# default. A single process keeps the setting: its gain is the one measured above.
MULTI_RANK_THRESHOLD_MB = 1.0


def threshold_for(threshold_mb: float, world_size: int) -> float:
    """The setting a run applies: ``train.host_mmap_threshold_mb`` in one process, capped at
    ``MULTI_RANK_THRESHOLD_MB`` with several ranks (0 stays 0: glibc's default)."""
    if threshold_mb and world_size > 1:
        return min(threshold_mb, MULTI_RANK_THRESHOLD_MB)
    return threshold_mb


def _glibc(name: str, argtypes: list):
    """glibc's function ``name`` (int result), or None off Linux or without glibc (musl has
    no mallopt or malloc_trim)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def reuse_freed_host_memory(threshold_mb: float) -> bool:
    """Serve allocations below ``threshold_mb`` MiB from glibc's heap (``mallopt``
    M_MMAP_THRESHOLD) and keep up to twice that free at the heap's top before returning it to
    the system (M_TRIM_THRESHOLD, the ratio glibc's own adjustment uses); whether the setting
    took. Nothing is done for 0, off Linux/glibc, or
    when the environment already sets ``MALLOC_MMAP_THRESHOLD_`` (the user's choice wins)."""
    mallopt = _glibc("mallopt", [ctypes.c_int, ctypes.c_int])
    if threshold_mb <= 0 or mallopt is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    size = int(threshold_mb * 2**20)
    return bool(mallopt(M_MMAP_THRESHOLD, size)) and bool(mallopt(M_TRIM_THRESHOLD, 2 * size))


def release_free_heap() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``): what start-up
    or loading freed (a region read from a file, a tensor drawn whole) would otherwise stay
    resident under ``reuse_freed_host_memory``'s trim threshold for the whole run, above
    what the run holds (a LoRA run's steps never reuse it: its step is smaller than its
    start-up). Whether glibc did it; nothing off Linux/glibc."""
    trim = _glibc("malloc_trim", [ctypes.c_size_t])
    return bool(trim(0)) if trim is not None else False
