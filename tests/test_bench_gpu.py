"""bench/bench_gpu.py (threefold against transformers' Llama: tokens/s, MFU, peak memory, a
profile of one step) runs at its tiny shape on a CPU, so the GPU bench does not rot."""

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
