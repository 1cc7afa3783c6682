"""The quantisation error of each ``train.fp8`` recipe (tensorwise, rowwise, DeepSeek-V3's
blockwise) on one projection, forward and both gradients, against the float64 product:
relative error = mean |fp8 − exact| / mean |exact|. Two inputs: Gaussian activations, and
the same with one outlier feature 10⁵× larger (whose weights are zeroed with the rest of its
128-wide tile, so what is left is the precision the other features keep).

    PYTHONPATH=$PWD python3 bench/bench_fp8_error.py        # CPU, a few seconds

Figures in docs/precision.md ("FP8 experts and the blockwise recipe").
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table  # noqa: E402
from threefold.parallel.transforms.fp8_linear import fp8_linear  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "blockwise")


def errors(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, recipe: str) -> dict:
    """Relative errors of y, dx and dW of y = x·Wᵀ under ``recipe``."""
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xl, wl, None, recipe)
    y.backward(dy)
    x64, w64, g64 = x.double(), w.double(), dy.double()
    out = {}
    for name, got, want in (("y", y.detach(), x64 @ w64.T), ("dx", xl.grad, g64 @ w64),
                            ("dW", wl.grad, g64.T @ x64)):
        out[name] = float((got.double() - want).abs().mean() / want.abs().mean())
    return out


def main() -> list[dict]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokens, k, n = 512, 1024, 1024
    x = torch.randn(tokens, k)
    w = torch.randn(n, k) * k ** -0.5
    dy = torch.randn(tokens, n)
    outlier, wo = x.clone(), w.clone()
    outlier[:, 5] *= 1e5
    wo[:, :128] = 0.0
    rows = []
    for data, (a, b) in (("gaussian", (x, w)), ("outlier feature", (outlier, wo))):
        for recipe in RECIPES:
            rows.append({"data": data, "recipe": recipe, **errors(a, b, dy, recipe)})
    print(f"relative error vs float64 (mean |err| / mean |exact|), {tokens} tokens, "
          f"in {k}, out {n}:")
    print_table(rows, width=16)
    return rows


if __name__ == "__main__":
    main()
