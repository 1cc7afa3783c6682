"""bench/common.py's ``report``: a floor on the median ratio, or a tolerance band around 1 (a
prediction checked against a measurement: neither over nor under)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import report  # noqa: E402


def _rows(*ratios):
    return [{"row": i, "ratio": r} for i, r in enumerate(ratios)]


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_floor_mode_compares_the_median(capsys):
    out = report("floor", _rows(0.9, 1.2, 1.3), "ratio", 1.0)
    assert out == _json(capsys) and out["meets_goal"] and out["ratio_median"] == 1.2
    assert "band" not in out and "largest_deviation" not in out


def test_band_mode_bounds_every_ratio_and_records_the_largest_deviation(capsys):
    out = report("band", _rows(1.05, 0.93, 1.0), "ratio", 1.0, band=0.10)
    assert out == _json(capsys) and out["meets_goal"] and out["band"] == 0.10
    assert math.isclose(out["largest_deviation"], 0.07)
    # under by 12%: the median (1.005) would meet a floor of 1.0; the band is missed
    out = report("band", _rows(1.05, 0.88, 1.0, 1.01), "ratio", 1.0, band=0.10)
    assert not out["meets_goal"] and math.isclose(out["largest_deviation"], 0.12)
    assert "largest deviation from 1: 12.0% (goal: within ±10%)" in capsys.readouterr().out
    out = report("band", [{"ratio": None}], "ratio", 1.0, band=0.10)  # nothing measured
    assert not out["meets_goal"] and math.isnan(out["largest_deviation"])
