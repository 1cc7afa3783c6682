"""The single-process loop: outputs, resume, accumulation, bad input."""

from __future__ import annotations

import json
import math

import pytest
from tests.conftest import metrics, tiny_overrides
from threefold.accounting import num_parameters
from threefold.commands.main import main
from threefold.config import load_config
from threefold.training.steps import lr_at
from threefold.training.train import train

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
    (["--train.recompute", "some"], "train.recompute"),
    (["--train.recompute", "selective", "--train.activation_checkpointing", "true"],
     "train.activation_checkpointing"),
    (["--train.recompute", "selective", "--parallel.cp", "2", "--nproc-per-node", "2"],
     "train.recompute"),  # refused before any process starts
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
    """Full and selective recompute train to the losses of no recompute (selective: the same
    ops re-run on the same inputs, bit for bit)."""
    _run(corpus, cache_dir, tmp_path / "a", train__steps=3)
    _run(corpus, cache_dir, tmp_path / "b", train__steps=3,
         train__activation_checkpointing="true")
    _run(corpus, cache_dir, tmp_path / "c", train__steps=3, train__recompute="selective")
    la = [r["loss"] for r in metrics(tmp_path / "a")]
    lb = [r["loss"] for r in metrics(tmp_path / "b")]
    assert la == pytest.approx(lb, rel=1e-6)
    assert [r["loss"] for r in metrics(tmp_path / "c")] == la


def test_bf16_autocast_trains_close_to_fp32(corpus, cache_dir, tmp_path):
    _run(corpus, cache_dir, tmp_path / "fp32", train__steps=3)
    s = _run(corpus, cache_dir, tmp_path / "bf16", train__steps=3, train__dtype="bfloat16")
    a = [r["loss"] for r in metrics(tmp_path / "fp32")]
    b = [r["loss"] for r in metrics(tmp_path / "bf16")]
    assert b != a  # really ran in bf16
    assert b == pytest.approx(a, rel=2e-2)  # but computes the same function
    assert s["peak_flops_source"] == "cpu-matmul-probe"


def _host_reads_in_step(run, step: int) -> list[tuple[int, str]]:
    """(op index, phase) of every read of a tensor's value by the host (``.item()``,
    ``float()``, ``int()``, ``bool()`` all dispatch ``aten._local_scalar_dense``) during one
    ``train_step``, AdamW's step counters excepted (torch keeps them on the host by design,
    so reading them never waits for a device). The phase says whether the read came before
    the step's first forward matmul, between it and the optimiser's last update, or after."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from threefold.training.steps import train_step

    counters = {id(st["step"]) for st in run.engine.optimizer.state.values()}
    ops: list[tuple[str, bool]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            counter = any(id(a) in counters for a in args if isinstance(a, torch.Tensor))
            ops.append((name, counter))
            return func(*args, **(kwargs or {}))

    with Record():
        train_step(run, step)
    first_mm = next(i for i, (n, _) in enumerate(ops) if n in ("mm", "bmm", "addmm"))
    # the optimiser's last in-place update of a parameter: AdamW ends with addcdiv_
    last_update = max(i for i, (n, _) in enumerate(ops) if n == "addcdiv_")
    reads = [i for i, (n, c) in enumerate(ops) if n == "_local_scalar_dense" and not c]
    return [(i, "before" if i < first_mm else "after" if i > last_update else "during")
            for i in reads]


@pytest.mark.parametrize("clip", [1.0, 1e-4, 0.0])
def test_one_host_read_per_step_after_the_optimizer(corpus, cache_dir, tmp_path, clip):
    """Nothing in forward, backward, clipping or the optimiser waits for the device: the
    token count is read from the host batch before the forward, and the loss, the gradient
    norm and the task's metrics come back in one read after the optimiser step, whether
    clipping scales the gradients (1e-4), may leave them (1.0) or is off (0)."""
    from threefold.training.train import build_run
    from threefold.training.steps import train_step

    cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "r",
                                           optim__grad_clip=clip))
    run = build_run(cfg)
    for s in range(2):  # AdamW's state exists after the first step
        train_step(run, s)
    reads = _host_reads_in_step(run, 2)
    assert [p for _, p in reads if p == "during"] == []
    assert len([p for _, p in reads if p == "before"]) <= 1  # the batch's token count
    assert 1 <= len([p for _, p in reads if p == "after"]) <= 3  # loss, norm (one copy)
    # and the step still logs what it did: the norm is the gradient's, clipped or not
    loss, norm, _ = train_step(run, 3)
    assert math.isfinite(loss) and norm > 0


def test_host_allocator_setting(monkeypatch):
    """CPU runs ask glibc to keep freed blocks below the threshold for reuse; 0 leaves glibc
    alone, a user's MALLOC_MMAP_THRESHOLD_ wins, and a negative value is refused by name."""
    import sys

    from threefold.config import ConfigError
    from threefold.training.hostmem import reuse_freed_host_memory

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert reuse_freed_host_memory(0) is False
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6").mallopt
        except (OSError, AttributeError):
            pytest.skip("not glibc")
        assert reuse_freed_host_memory(256) is True
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert reuse_freed_host_memory(256) is False
    with pytest.raises(ConfigError, match="train.host_mmap_threshold_mb"):
        load_config(None, [("train.host_mmap_threshold_mb", "-1")])


def test_mfu_never_reads_above_one_when_the_cpu_probe_ran_busy(corpus, cache_dir, tmp_path,
                                                               monkeypatch):
    """A CPU probe taken at a busy moment (here: a peak of 1 FLOP/s, far below any step) is
    raised to the highest rate seen as soon as a step beats it, without probing again inside
    the loop: no record, and not the summary, reads MFU above 1, and the summary says where
    its peak came from."""
    import torch

    from threefold.hardware import metrics as m

    def no_probe(*args, **kwargs):
        raise AssertionError("the CPU was probed again inside the training loop")

    key = (torch.float32, torch.get_num_threads())
    monkeypatch.setattr(m, "_CPU_PEAKS", {key: 1.0})
    monkeypatch.setattr(m, "cpu_matmul_flops", no_probe)
    assert m.raise_cpu_peak(torch.float32, 5.0)[0] == 5.0  # the step's rate, not a probe's
    assert m.raise_cpu_peak(torch.float32, 3.0)[0] == 5.0  # never lowered
    m._CPU_PEAKS[key] = 1.0
    summary = _run(corpus, cache_dir, tmp_path / "busy", train__steps=3)
    recs = metrics(tmp_path / "busy")
    assert all(0 < r["mfu"] <= 1 for r in recs), [r["mfu"] for r in recs]
    assert 0 < summary["mfu"] <= 1
    assert summary["peak_flops_per_device"] > 1.0
    assert "raised" in summary["peak_flops_source"]


def test_launcher_passes_only_flags_torchrun_knows():
    """torch 2.11's torchrun has no --shutdown-timeout: the launcher reads the installed
    torchrun's own source (without importing torch) before passing a flag."""
    from threefold.launch.launcher import torchrun_accepts

    assert torchrun_accepts("--nproc-per-node") and torchrun_accepts("--standalone")
    assert not torchrun_accepts("--no-such-flag-in-torchrun")


def test_reference_engine_is_frozen_and_holds_no_optimiser_buffers(corpus, cache_dir,
                                                                   tmp_path):
    """A reference model (GRPO's) is the run's initial model in the compute dtype, with no
    gradients, no float32 masters and no checkpointing wrappers: only what it computes with."""
    import torch

    from threefold.training.run import reference_engine
    from threefold.training.train import build_run

    cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "ref",
                                           train__dtype="bfloat16",
                                           parallel__param_dtype="bfloat16",
                                           train__activation_checkpointing="true"))
    run = build_run(cfg)
    ref = reference_engine(run)
    params = list(ref.model.parameters())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in params)
    assert not ref._master and not type(ref.model.model.layers[0]).__name__.startswith("Chec")
    # the same values as the run's own model at start (its bf16 compute copies)
    for (n, a), b in zip(run.engine.model.named_parameters(), params):
        assert torch.equal(a.detach(), b), n
