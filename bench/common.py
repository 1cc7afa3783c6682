"""Helpers shared by the benchmarks: argument parsing, and printing a result table + JSON."""

from __future__ import annotations

import json
import statistics
import sys


def report(name: str, rows: list[dict], ratio_key: str, goal: float) -> None:
    """Print rows as a table and one JSON line (machine-readable) ending the output."""
    keys = list(rows[0])
    print(" | ".join(f"{k:>18}" for k in keys))
    for r in rows:
        print(" | ".join(f"{r[k]:>18.4g}" if isinstance(r[k], float) else f"{r[k]!s:>18}"
                         for k in keys))
    ratios = [r[ratio_key] for r in rows if isinstance(r.get(ratio_key), float)]
    med = statistics.median(ratios) if ratios else float("nan")
    print(json.dumps({"benchmark": name, ratio_key + "_median": med, "goal": goal,
                      "meets_goal": med >= goal}), file=sys.stdout, flush=True)
