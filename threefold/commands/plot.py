"""`threefold plot RUN_DIR [RUN_DIR...] --out FILE.png`: a run's curves from its metrics.jsonl
against step, one panel each (loss with validation loss, lr, grad norm, tokens/s, MFU, peak
memory); several runs are overlaid, labelled by their directory's name. Needs matplotlib (the
``plot`` extra)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from threefold.launch.launcher import fail

# (title, metrics.jsonl key, scale applied to the values)
PANELS = (("loss", "loss", 1.0), ("learning rate", "lr", 1.0), ("grad norm", "grad_norm", 1.0),
          ("tokens/s", "tokens_per_second", 1.0), ("MFU (%)", "mfu", 100.0),
          ("peak memory (GB)", "peak_memory_bytes", 1e-9))


def read_run(run_dir: Path) -> tuple[list[dict], list[tuple[int, float]]]:
    """A run's metrics.jsonl records, and its validation points (step, loss): the initial one
    from summary.json at step 0 where there is one, then each record's ``validation_loss``."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    summary = run_dir / "summary.json"
    first = json.loads(summary.read_text()).get("initial_validation_loss") \
        if summary.is_file() else None
    val = [(0, first)] if first is not None else []
    return records, val + [(r["step"], r["validation_loss"]) for r in records
                           if r.get("validation_loss") is not None]


def figure(runs: list[Path]):
    """The matplotlib figure of ``runs``: six panels against step, one line per run in each
    (and its validation points on the loss panel), labelled by the run directory's name."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for i, run_dir in enumerate(runs):
        records, val = read_run(run_dir)
        color, name = f"C{i}", run_dir.resolve().name
        for ax, (title, key, scale) in zip(axes.flat, PANELS):
            points = [(r["step"], r[key] * scale) for r in records
                      if r.get(key) is not None]  # MFU is None where the peak is unknown
            ax.plot(*zip(*points) if points else ([], []), color=color, lw=1, label=name)
            ax.set_title(title)
            ax.set_xlabel("step")
        if val:
            axes.flat[0].plot(*zip(*val), "o--", color=color, ms=4, label=f"{name} validation")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    return fig


def draw(runs: list[Path], out: Path) -> None:
    """Write the figure of ``runs`` to ``out`` (PNG, or whatever the suffix names)."""
    import matplotlib.pyplot as plt

    fig = figure(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """`threefold plot`: check the runs and matplotlib, then draw."""
    ap = argparse.ArgumentParser(prog="threefold plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    ap.add_argument("--out", type=Path, required=True, metavar="FILE.png")
    args = ap.parse_args(argv)
    for run_dir in args.runs:
        if not (run_dir / "metrics.jsonl").is_file():
            return fail(f"{run_dir}: no metrics.jsonl there; give the output_dir of a run")
    try:
        import matplotlib
    except ImportError:
        return fail("threefold plot needs the plot extra: pip install 'threefold[plot]'")
    draw(args.runs, args.out)
    print(f"wrote {args.out}")
    return 0
