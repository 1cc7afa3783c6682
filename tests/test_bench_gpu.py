"""bench/bench_gpu.py (threefold against transformers' Llama: tokens/s, MFU, peak memory, a
profile of one step; FP8 and grouped-expert rows) runs at its tiny shape on a CPU, so the GPU
bench does not rot: the FP8 rows report skipped there, the MoE rows run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("transformers")


def test_bench_gpu_tiny_on_cpu(tmp_path, corpus, cache_dir):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--shape", "tiny",
           "--device", "cpu", "--steps", "2", "--rounds", "1", "--out", str(out),
           "--set", f"data.corpus={corpus}", "--set", f"data.cache_dir={cache_dir}",
           "--set", "data.vocab_size=320"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    last = [x for x in p.stdout.splitlines() if x.startswith("{")][-1]
    summary = json.loads(last)
    assert summary == json.loads(out.read_text())  # --out holds the same JSON
    assert summary["benchmark"] == "gpu" and list(summary["modes"]) == ["eager"]
    eager = summary["modes"]["eager"]
    assert eager["ratio_median"] > 0
    for side in ("threefold", "transformers"):
        s = eager[side]
        assert s["tok_s"] > 0
        assert 0 < s["mfu"] <= 1
        assert s["peak_memory_bytes"] > 0
        shares = s["profile"]
        parts = [shares[k] for k in ("matmul", "attention", "optimiser", "elementwise")]
        assert all(v >= 0 for v in parts) and sum(parts) == pytest.approx(1, abs=1e-6)
        assert shares["matmul"] > 0 and shares["optimiser"] > 0
    # the same weights on both sides: the first step's losses agree
    assert eager["threefold"]["loss0"] == pytest.approx(eager["transformers"]["loss0"],
                                                        rel=1e-4)
    # the further rows (default --rows all): FP8 skipped on a CPU with the reason printed, the
    # MoE shape grouped against looped experts measured (the same weights: the same loss)
    rows = summary["rows"]["eager"]
    moe_fp8 = [f"moe-fp8-{r}" for r in ("tensorwise", "rowwise", "blockwise")]
    assert list(rows) == ["fp8-tensorwise", "fp8-rowwise", "moe-grouped", "moe-loop", *moe_fp8]
    for name in ["fp8-tensorwise", "fp8-rowwise", *moe_fp8]:
        reason = rows[name]["skipped"]
        assert "cpu" in reason or "refused" in reason
        assert f"{name}: skipped: {reason}" in p.stdout
    grouped, loop = rows["moe-grouped"], rows["moe-loop"]
    for r in (grouped, loop):
        assert r["tok_s"] > 0 and 0 < r["mfu"] <= 1 and r["flops_per_token"] > 0
    # active FLOPs: top-2 of 4 experts of f 176 per token, the dense MLP's f 352 plus routers
    assert grouped["flops_per_token"] >= summary["flops_per_token"]
    assert grouped["versus"] == "moe-loop" and grouped["ratio_median"] > 0
    assert grouped["loss0"] == pytest.approx(loop["loss0"], rel=1e-5)


def test_fp8_rows_need_compute_capability_8_9():
    """The device rule behind the FP8 rows' skip, without a GPU (the capability passed in),
    and the catalogue's FP8 peaks (H100/H200 twice their bf16, none on A100)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from bench.bench_gpu import fp8_unavailable
    from threefold.hardware.catalogue import get_hardware

    cuda = torch.device("cuda")
    assert fp8_unavailable(cuda, (9, 0)) is None and fp8_unavailable(cuda, (8, 9)) is None
    assert "8.0 < 8.9" in fp8_unavailable(cuda, (8, 0))
    assert "cpu" in fp8_unavailable(torch.device("cpu"))
    for gpu in ("h100", "h200"):
        hw = get_hardware(gpu)
        assert hw.peak_flops("fp8") == 1979e12 and hw.peak_flops("bf16") == 989e12
    assert get_hardware("a100").peak_flops("fp8") is None
