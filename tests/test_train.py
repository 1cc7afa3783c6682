"""The single-process loop: outputs, resume, accumulation, bad input."""

from __future__ import annotations

import json
import math

import pytest
from tests.conftest import metrics, tiny_overrides
from threefold.accounting import num_parameters
from threefold.cli import main
from threefold.config import load_config
from threefold.train import lr_at, train

KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_second", "mfu", "peak_memory_bytes"}


def _run(corpus, cache, out, **extra):
    return train(load_config(None, tiny_overrides(corpus, cache, out, **extra)))


def test_run_writes_metrics_summary_and_checkpoints(corpus, cache_dir, tmp_path):
    out = tmp_path / "run"
    summary = _run(corpus, cache_dir, out, train__steps=8, checkpoint__interval=3,
                   checkpoint__keep_last=2, train__trace_step=3)
    recs = metrics(out)
    assert [r["step"] for r in recs] == list(range(1, 9))
    for r in recs:
        assert KEYS <= set(r)
        assert math.isfinite(r["loss"]) and r["tokens_per_second"] > 0
        assert r["peak_memory_bytes"] > 0 and 0 < r["mfu"] < 1
    assert recs[-1]["loss"] < recs[0]["loss"]
    s = json.loads((out / "summary.json").read_text())
    assert s == json.loads(json.dumps(summary))
    mcfg = load_config(None, tiny_overrides(corpus, cache_dir, out)).model.resolved(320)
    assert s["parameters"] == num_parameters(mcfg) == 64 * 320 * 2 + 2 * (
        64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert s["validation_loss"] < s["initial_validation_loss"]
    # keep_last=2 of saves at 3, 6 and the final 8
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["6", "8"]
    assert (out / "tokenizer.json").is_file()
    # train.trace_step=3: that step's phases in a Chrome trace, in order, on one rank
    assert s["trace"] == {"path": str(out / "trace.json"), "step": 3}
    events = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"]
              if e["ph"] == "X"]
    assert [e["name"] for e in events] == ["F mb0", "BW mb0", "finish gradients",
                                           "clip gradients", "optimizer step"]
    assert all(b["ts"] >= a["ts"] + a["dur"] for a, b in zip(events, events[1:]))


def test_resume_is_bit_identical(corpus, cache_dir, tmp_path):
    full = tmp_path / "full"
    _run(corpus, cache_dir, full, train__steps=6)
    part = tmp_path / "part"
    _run(corpus, cache_dir, part, train__steps=6, checkpoint__interval=3,
         checkpoint__save_final="false", train__eval_batches=1)
    # simulate a stop after step 3: drop the later checkpoint and metrics, then resume
    import shutil
    shutil.rmtree(part / "checkpoints" / "6")
    _run(corpus, cache_dir, part, train__steps=6, checkpoint__resume="true",
         train__eval_batches=1)
    a = [r["loss"] for r in metrics(full)]
    b = [r["loss"] for r in metrics(part)]
    assert a == b  # bit-identical, not merely close
    assert [r["grad_norm"] for r in metrics(full)] == [r["grad_norm"] for r in metrics(part)]


def test_accumulation_matches_one_big_batch(corpus, cache_dir, tmp_path):
    a = _run(corpus, cache_dir, tmp_path / "a", train__steps=4)
    b = _run(corpus, cache_dir, tmp_path / "b", train__steps=4, train__micro_batch_size=2)
    la = [r["loss"] for r in metrics(tmp_path / "a")]
    lb = [r["loss"] for r in metrics(tmp_path / "b")]
    assert la == pytest.approx(lb, rel=1e-5)
    assert a["validation_loss"] == pytest.approx(b["validation_loss"], rel=1e-5)


def test_lr_schedule_warmup_then_cosine():
    cfg = load_config(None, [("train.steps", "100"), ("optim.warmup_steps", "10"),
                             ("optim.lr", "1.0"), ("optim.min_lr_ratio", "0.1")])
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(100, cfg) == pytest.approx(0.1)
    lrs = [lr_at(s, cfg) for s in range(10, 100)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))


@pytest.mark.parametrize("extra,needle", [
    (["--train.stpes", "3"], "train.steps"),
    (["--train.steps", "-1"], "train.steps"),
    (["--train.dtype", "float16"], "train.dtype"),
    (["--data.corpus", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    (["--data.tokenizer", "BADTOK"], "tokenizer"),
    (["--model.preset", "llama9"], "model.preset"),
    (["--train.trace_step", "7"], "train.trace_step"),
])
def test_bad_input_exits_2_and_writes_nothing(corpus, cache_dir, tmp_path, capsys, extra, needle):
    bad_tok = tmp_path / "bad_tokenizer.json"
    bad_tok.write_text("{not json")
    extra = [str(bad_tok) if x == "BADTOK" else x for x in extra]
    out = tmp_path / "out"
    args = [a for kv in tiny_overrides(corpus, cache_dir, out) for a in (f"--{kv[0]}", kv[1])]
    rc = main(["train", *args, *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and needle in err
    assert not out.exists()


def test_activation_checkpointing_same_losses(corpus, cache_dir, tmp_path):
    _run(corpus, cache_dir, tmp_path / "a", train__steps=3)
    _run(corpus, cache_dir, tmp_path / "b", train__steps=3,
         train__activation_checkpointing="true")
    la = [r["loss"] for r in metrics(tmp_path / "a")]
    lb = [r["loss"] for r in metrics(tmp_path / "b")]
    assert la == pytest.approx(lb, rel=1e-6)


def test_bf16_autocast_trains_close_to_fp32(corpus, cache_dir, tmp_path):
    _run(corpus, cache_dir, tmp_path / "fp32", train__steps=3)
    s = _run(corpus, cache_dir, tmp_path / "bf16", train__steps=3, train__dtype="bfloat16")
    a = [r["loss"] for r in metrics(tmp_path / "fp32")]
    b = [r["loss"] for r in metrics(tmp_path / "bf16")]
    assert b != a  # really ran in bf16
    assert b == pytest.approx(a, rel=2e-2)  # but computes the same function
    assert s["peak_flops_source"] == "cpu-matmul-probe"
