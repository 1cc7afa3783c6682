"""`threefold plot`: a PNG of a run's curves; several runs overlaid; bad input named."""

from __future__ import annotations

import sys

import pytest
from tests.conftest import tiny_overrides
from threefold.commands.main import main
from threefold.config import load_config
from threefold.commands.plot import PANELS, figure
from threefold.training.train import train


@pytest.fixture(scope="module")
def two_runs(corpus, cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("plot")
    for name, lr in (("base", "3e-3"), ("higher_lr", "6e-3")):
        train(load_config(None, tiny_overrides(corpus, cache_dir, root / name, optim__lr=lr,
                                               train__eval_interval=3)))
    return root / "base", root / "higher_lr"


def test_plot_writes_a_png(two_runs, tmp_path):
    out = tmp_path / "figs" / "run.png"
    assert main(["plot", str(two_runs[0]), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the trackers are off unless asked for
    assert not (two_runs[0] / "tensorboard").exists() and not (two_runs[0] / "wandb").exists()


def test_two_runs_overlay(two_runs):
    fig = figure(list(two_runs))
    axes = fig.axes[:len(PANELS)]
    for ax in axes[1:]:
        assert [line.get_label() for line in ax.get_lines()] == ["base", "higher_lr"]
        assert all(len(line.get_xdata()) == 6 for line in ax.get_lines())
    # the loss panel: training per run, and validation at steps 0 (initial), 3 and 6
    loss = {line.get_label(): list(line.get_xdata()) for line in axes[0].get_lines()}
    assert loss == {"base": [1, 2, 3, 4, 5, 6], "higher_lr": [1, 2, 3, 4, 5, 6],
                    "base validation": [0, 3, 6], "higher_lr validation": [0, 3, 6]}


def test_bad_input_is_named(two_runs, tmp_path, capsys, monkeypatch):
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    out = tmp_path / "x.png"
    assert main(["plot", str(two_runs[0]), str(empty), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("threefold: error: ") and str(empty) in err and "metrics.jsonl" in err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["plot", str(two_runs[0]), "--out", str(out)]) == 2
    assert "pip install 'threefold[plot]'" in capsys.readouterr().err
    assert not out.exists()
