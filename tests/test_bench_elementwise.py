"""bench/bench_elementwise.py at the tiny shape: the CPU proxies of the memory-bound work (non-matmul
kernels per block and their bytes per token) are counted, and they react as they must."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_elementwise import MATMUL, profile_block  # noqa: E402


def test_block_proxies_count_non_matmul_work():
    fp32 = profile_block("tiny", 1, torch.float32)
    bf16 = profile_block("tiny", 1, torch.bfloat16)
    for res in (fp32, bf16):
        assert res["kernels"] == sum(v["calls"] for v in res["by_op"].values()) > 10
        assert res["bytes_per_token"] > 0
        assert not set(res["by_op"]) & MATMUL  # matmuls and attention are not counted
        assert "aten::mul" in res["by_op"]  # RMSNorm, RoPE and SwiGLU multiply
    # autocast's casts are memory-bound work of their own: none in fp32
    assert "aten::to" not in fp32["by_op"] and bf16["by_op"]["aten::to"]["calls"] > 0
    # twice the tokens: the per-token bytes of activations stay, the weights' casts halve
    two = profile_block("tiny", 2, torch.float32)
    assert two["kernels"] == fp32["kernels"]
    assert two["bytes_per_token"] < fp32["bytes_per_token"]


def test_compiled_block_fuses_the_elementwise_work():
    """Through torch.compile the block is one graph (the lean kernels become plain ops there)
    and inductor fuses its norms, RoPE, SwiGLU and residual adds: fewer kernels than eager."""
    eager = profile_block("tiny", 1, torch.float32)
    compiled = profile_block("tiny", 1, torch.float32, compiled=True)
    assert 0 < compiled["fused_kernels"] <= compiled["kernels"] < eager["kernels"] / 2


def test_head_proxies_run_both_paths():
    """``--head``: the whole-logits path and the chunked head loss, each with kernels, bytes
    per token and a measured peak; the planner's count beside the chunked one only."""
    from bench.bench_elementwise import profile_head

    logits = profile_head("tiny", 1, torch.float32, "logits")
    chunked = profile_head("tiny", 1, torch.float32, "chunked")
    assert logits["planned_bytes"] is None and chunked["planned_bytes"] > 0
    for res in (logits, chunked):
        assert res["kernels"] > 0 and res["bytes_per_token"] > 0 and res["peak_bytes"] >= 0
    assert "aten::cross_entropy_loss" in logits["by_op"]
    assert "aten::cross_entropy_loss" not in chunked["by_op"]  # the loss is threefold's own
