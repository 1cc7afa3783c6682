"""TensorBoard and W&B get metrics.jsonl's scalars and the config, from the writer rank, only
when asked for; a missing extra is a one-line error before anything runs."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest
from tests.conftest import metrics, tiny_overrides
from threefold.commands.main import main
from threefold.config import ConfigError, load_config
from threefold.training.trackers import flat_scalars
from threefold.training.train import train


def test_flat_scalars_flattens_axes_and_drops_unknowns():
    rec = {"step": 3, "loss": 2.5, "mfu": None, "comm_bytes": {"dp": 10, "tp": 4}}
    assert flat_scalars(rec) == {"loss": 2.5, "comm_bytes/dp": 10.0, "comm_bytes/tp": 4.0}


def _tensorboard(logdir: Path) -> tuple[dict, list[str], dict]:
    """TensorBoard's own reader on ``logdir``: {tag: {step: value}}, the tensor tags (text)
    and the hparams of the session."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    start = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(start).session_start_info.hparams
    return scalars, acc.Tags()["tensors"], hparams


def _wandb_records(path: Path):
    """The protobuf records of an offline run's .wandb file (LevelDB log framing: 32 KiB
    blocks of [crc u32, length u16, type u8] chunks; types 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunk = path.read_bytes(), 7, b""  # after the ":W&B" file header
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _wandb_history(run_dir: Path) -> tuple[dict, dict]:
    """{step: {name: value}} logged, and the config's top-level values."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history, config = {}, {}
    for r in _wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in r.history.item}
            history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif r.WhichOneof("record_type") == "run":
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
    return history, config


def test_tensorboard_and_wandb_record_the_metrics(corpus, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    train(load_config(None, tiny_overrides(corpus, cache_dir, out, train__eval_interval=3,
                                           metrics__tensorboard="true",
                                           metrics__wandb="true")))
    want = {r["step"]: flat_scalars(r) for r in metrics(out)}
    assert {"loss", "lr", "grad_norm", "tokens_per_second", "mfu", "peak_memory_bytes"} \
        <= set(want[1])
    assert {s for s, row in want.items() if "validation_loss" in row} == {3, 6}

    scalars, tensors, hparams = _tensorboard(out / "tensorboard")
    by_step = {}
    for tag, points in scalars.items():
        for step, value in points.items():
            by_step.setdefault(step, {})[tag] = value
    assert by_step.keys() == want.keys()
    for step, row in want.items():
        assert by_step[step] == pytest.approx(row, rel=1e-6)  # event files hold float32
    assert "config/text_summary" in tensors
    assert hparams["train.steps"].number_value == 6
    assert hparams["train.progress"].string_value == "off"

    history, config = _wandb_history(tmp_path)
    assert history.keys() == want.keys()
    for step, row in want.items():
        assert history[step] == pytest.approx(row, rel=1e-12)
    assert config["train"]["steps"] == 6 and config["metrics"]["wandb"] is True


def _missing(name: str, find_spec=importlib.util.find_spec):
    return lambda module, *a: None if module == name else find_spec(module, *a)


@pytest.mark.parametrize("extra", ["tensorboard", "wandb"])
def test_missing_extra_is_one_line_before_training(extra, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", _missing(extra))
    msg = f"metrics.{extra} needs the {extra} extra: pip install 'threefold[{extra}]'"
    with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [(f"metrics.{extra}", "true")])
    out = tmp_path / "run"
    assert main(["train", f"--metrics.{extra}", "true", "--train.output_dir", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"threefold: error: {msg}"
    assert not out.exists()


@pytest.mark.slow
def test_only_the_writer_rank_writes_tensorboard(corpus, cache_dir, tmp_path):
    """Two data-parallel ranks: one event file, with the comm bytes per axis flattened."""
    import subprocess
    import sys

    out = tmp_path / "run"
    args = [f"--{k}={v}" for k, v in tiny_overrides(corpus, cache_dir, out, train__steps=3,
                                                       metrics__tensorboard="true")]
    p = subprocess.run([sys.executable, "-m", "threefold", "train", "--nproc-per-node", "2",
                        *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    scalars, _, _ = _tensorboard(out / "tensorboard")
    recs = metrics(out)
    assert recs[0]["comm_bytes"]
    for axis in recs[0]["comm_bytes"]:
        assert scalars[f"comm_bytes/{axis}"] == pytest.approx(
            {r["step"]: r["comm_bytes"][axis] for r in recs}, rel=1e-6)
