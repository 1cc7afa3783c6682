"""bench/bench_data.py at a tiny size: every side runs, its row is sane, the prepared output
verifies, the sides tokenize the same text to the same count, and the loader line is filled."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

from threefold.data.prepare import verify

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import bench_data  # noqa: E402


def test_corpus_is_deterministic(tmp_path):
    a = bench_data.generate_corpus(tmp_path / "a", 0.2, 2, seed=3)
    b = bench_data.generate_corpus(tmp_path / "b", 0.2, 2, seed=3)
    assert a == b >= 0.2 * bench_data.MB
    for name in ("part-000.jsonl", "part-001.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    first = (tmp_path / "a" / "part-000.jsonl").read_text().splitlines()[0]
    assert json.loads(first)["text"]


def test_bench_at_a_tiny_size(tmp_path, capsys):
    has_datasets = importlib.util.find_spec("datasets") is not None
    args = bench_data.parse_args(["--mb", "2", "--workers", "1", "--files", "2",
                                  "--vocab-size", "1024", "--sample-mb", "0.5",
                                  *([] if has_datasets else ["--no-datasets"])])
    res = bench_data.run_all(args, tmp_path)
    sides = [r["side"] for r in res["rows"]]
    assert sides == ["threefold", "tokenizers"] + (["datasets"] if has_datasets else [])
    index = verify(tmp_path / "out")
    assert index["complete"] and index["tokens"] > 0
    for r in res["rows"]:
        assert r["seconds"] > 0 and r["MB_s"] > 0 and math.isfinite(r["MB_s"])
        assert 0 < r["parent_rss_MB"] <= r["max_rss_MB"] <= r["sum_rss_MB"] < 4096
        assert r["processes"] >= 1
        assert r["tokens"] == index["tokens"] - index["documents"]  # the same text, same ids
        assert r["documents"] == index["documents"]
    v = res["verdicts"]
    assert v["ratio_vs_tokenizers"] > 0 and v["same_tokens"] and v["max_rss_met"]
    lo = res["loader"]
    assert (lo["batch"], lo["seq_len"]) == (8, 256)
    assert 0 < lo["draw_ms_median"] <= lo["draw_ms_max"] and 0 < lo["share_of_step"] < 1
    assert math.isclose(lo["step_s"], 8 * 256 / bench_data.README_TOKENS_PER_S)
    bench_data.print_results(args, res)
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["benchmark"] for x in lines] == ["data_prepare"] * len(sides) + [
        "data_prepare_summary", "data_loader"]
