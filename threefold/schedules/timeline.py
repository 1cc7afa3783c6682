"""Timelines of pipeline ranks: a Chrome-trace writer (opens in Perfetto or chrome://tracing)
and a PNG drawer. Both take generic records, so the simulator's predicted timeline and the
executor's measured one are drawn by the same code and can be compared side by side.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, NamedTuple


class TraceRecord(NamedTuple):
    """One interval on one rank. ``name`` starts with the action kind (``F``, ``B``, ``W``,
    ``BW``, ``SEND_F``, ...) followed by details; ``category`` is e.g. compute or comm."""

    rank: int
    name: str
    start_s: float
    end_s: float
    category: str


def chrome_trace(records: Iterable[TraceRecord], metadata: dict | None = None) -> dict:
    """The Chrome trace-event JSON object: one complete ("X") event per record, one process
    per rank (named "rank r") and one thread per category, so overlapping compute and
    communication of a rank sit on separate rows. Times are in microseconds."""
    records = list(records)
    categories = sorted({rec.category for rec in records})
    tid = {c: i for i, c in enumerate(categories)}
    events: list[dict] = []
    for rank in sorted({rec.rank for rec in records}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for c in categories:
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid[c],
                           "args": {"name": c}})
    for rec in records:
        events.append({"name": rec.name, "cat": rec.category, "ph": "X",
                       "ts": rec.start_s * 1e6, "dur": (rec.end_s - rec.start_s) * 1e6,
                       "pid": rec.rank, "tid": tid[rec.category]})
    out = {"traceEvents": events, "displayTimeUnit": "ms"}
    if metadata:
        out["otherData"] = metadata  # the format's place for anything else; viewers ignore it
    return out


def write_chrome_trace(records: Iterable[TraceRecord], path: str | Path,
                       metadata: dict | None = None) -> None:
    """Write ``chrome_trace(records, metadata)`` to ``path``."""
    Path(path).write_text(json.dumps(chrome_trace(records, metadata)))


def read_chrome_trace(path: str | Path) -> tuple[list[TraceRecord], dict]:
    """(records, metadata) of a trace written by ``write_chrome_trace`` (e.g. a run's
    trace.json from ``train.trace_step``; metadata {} if none). Raises ValueError on a file
    that is not such a trace."""
    try:
        data = json.loads(Path(path).read_text())
        records = [TraceRecord(int(e["pid"]), str(e["name"]), e["ts"] / 1e6,
                               (e["ts"] + e["dur"]) / 1e6, str(e.get("cat", "compute")))
                   for e in data["traceEvents"] if e.get("ph") == "X"]
        return records, dict(data.get("otherData") or {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a readable Chrome trace ({e})") from None


def ascii_timeline(records: Iterable[TraceRecord], width: int = 100) -> str:
    """A text picture, one row per rank: each cell shows the kind of compute running at its
    midpoint (F, B, W; a fused backward shows as B) or ``.`` when the rank is idle. One cell
    is one time unit when the step is at most ``width`` units long, else the step is scaled."""
    compute = [rec for rec in records if rec.category == "compute"]
    end = max((rec.end_s for rec in compute), default=0.0)
    if end <= 0:
        return ""
    cells = min(width, max(1, round(end))) if end >= 1 else width
    step = end / cells
    rows = []
    for rank in sorted({rec.rank for rec in compute}):
        row = ["."] * cells
        for rec in compute:
            if rec.rank == rank:
                first = int(rec.start_s / step + 0.5)
                last = int(rec.end_s / step + 0.5)
                for c in range(first, min(last, cells)):
                    row[c] = rec.name[:1]
        rows.append(f"rank {rank:>2} |{''.join(row)}|")
    return "\n".join(rows)


# Colours by action kind: forward blue, input-grad orange, weight-grad green, fused backward
# purple; communication (including waiting for a peer) grey.
_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "BW": "#8172b3"}
_COMM = "#bbbbbb"


def draw_png(records: Iterable[TraceRecord], path: str | Path, title: str = "") -> None:
    """Draw one row per rank (rank 0 on top) with a bar per record, coloured by kind and
    labelled with its microbatch; communication (and waiting in it) in grey. Needs
    matplotlib, imported here so the rest of threefold does not depend on it (ImportError
    if it is missing)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    records = list(records)
    ranks = sorted({rec.rank for rec in records})
    end = max((rec.end_s for rec in records), default=1.0) or 1.0
    busiest = max((sum(rec.rank == r for rec in records) for r in ranks), default=1)
    fig, ax = plt.subplots(figsize=(min(max(6.0, 1.5 + 0.3 * busiest), 30.0),
                                    0.55 * len(ranks) + 1.6))
    kinds = set()
    for rec in records:
        kind, *rest = rec.name.split()
        colour = _COLOURS.get(kind, _COMM) if rec.category == "compute" else _COMM
        kinds.add(kind if kind in _COLOURS and rec.category == "compute" else "comm / wait")
        width = rec.end_s - rec.start_s
        ax.broken_barh([(rec.start_s, width)], (rec.rank - 0.4, 0.8), facecolors=colour,
                       edgecolors="white", linewidth=0.5)
        mb = next((w[2:] for w in rest if w.startswith("mb")), "")
        if rec.category == "compute" and width >= end / 120:
            ax.text(rec.start_s + width / 2, rec.rank, mb, ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks, default=0) + 0.6, -0.6)
    ax.set_xlim(0, end)
    ax.set_xlabel("time (s)")
    ax.set_title(title, fontsize=10)
    legend = {**_COLOURS, "comm / wait": _COMM}
    ax.legend(handles=[Patch(color=legend[k], label=k) for k in legend if k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
