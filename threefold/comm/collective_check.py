"""Checked, not trusted: every rank of a group must issue the same collectives in the same
order. The communication layer tells a ``Ledger`` about each collective it issues; with
``parallel.check_collectives`` the ledger keeps what each rank issued since the last check,
and ``Ledger.check`` compares it across every group at start-up's end and at each step's end.

Why compare through the rendezvous store and not with a collective: a group whose ranks
disagree would pair the check's own collective with a stray one (or hang in it). The store is
a separate channel: each rank writes one record (every axis it belongs to, the calls it issued
there since the last check) and reads the records of the ranks it shares a group with. A
mismatch stops every rank of that group with one message naming the axis, its ranks and the
first call where they differ; a rank that never writes its record (stuck in a collective, or
dead) is named after the collective timeout, with where every rank stood (``position``).

What a call is, for the comparison: its op, axis, dtype, element count (where every rank of
the group must pass the same count: not all-to-all, whose splits differ, nor the object
collectives, whose pickles differ) and the phase it was issued in ("start-up", "step 3",
"evaluation", "save 4", ...). Point-to-point messages are not group calls and are left out.

``THREEFOLD_CHECK_COLLECTIVES=1`` in the environment turns the check on too (the test suite
runs with it). Without either, the ledger only counts calls per axis (the sequence numbers a
hang report names): no record, no store traffic.
"""

from __future__ import annotations

import json
import zlib
from collections import deque
from datetime import timedelta

from threefold.layout.axes import AXES, CP_AXES, DERIVED_AXES, EP_LEVELS, EXPERT_AXES


CHECK_ENV = "THREEFOLD_CHECK_COLLECTIVES"
"""Set to 1, it turns the check on in every run of the process and its children, whatever
the configuration says (the test suite does this)."""


class CollectiveMismatch(RuntimeError):
    """Ranks of one group issued different collectives (or a different number of them)."""


class CollectiveHang(RuntimeError):
    """A rank of a group did not reach a check within the collective timeout."""


class Ledger:
    """This rank's collectives, counted per axis; with ``enabled`` also described one by one,
    in issue order, since the last check. Shared by every ``Comm`` of a process (the training
    channel and the logging channel reach the same process groups)."""

    def __init__(self, rank: int = 0, enabled: bool = False, history: int = 64,
                 keep_stream: bool = False):
        self.rank, self.enabled = rank, enabled
        # every described call, kept across checks: for a rank alone on a fake process group,
        # which has no peers to compare with, compared instead with itself under another hash
        # seed (the layout fuzzer)
        self.stream: list[tuple[str, str]] | None = [] if keep_stream else None
        self.recent: deque = deque(maxlen=history)  # the Comms' records of their last calls
        self.phase = "start-up"
        self.counts: dict[str, int] = {}   # calls issued on each axis, ever
        self.window: list[tuple[str, str]] = []  # (axis, described call) since the last check
        self.window_base: dict[str, int] = {}  # counts at the last check
        self.checks = 0

    def issue(self, op: str, axis: str, dtype: str = "", numel: int | None = None) -> int:
        """Count one call on ``axis``; returns its 1-based sequence number there."""
        n = self.counts.get(axis, 0) + 1
        self.counts[axis] = n
        if self.enabled:
            size = "" if numel is None else f" × {numel}"
            self.window.append((axis, f"{op} {dtype}{size} ({self.phase})"))
        return n

    def position(self) -> dict:
        """Where this rank stands: its phase and (checking) its calls since the last check."""
        return {"phase": self.phase,
                "window": [list(c) for c in self.window], "base": dict(self.window_base)}

    def _roll(self) -> None:
        if self.stream is not None:
            self.stream += self.window
        self.window = []
        self.window_base = dict(self.counts)


def check_groups(comm) -> list[tuple[str, tuple[int, ...]]]:
    """(axis, its ranks) for every axis of more than one rank that ``comm``'s rank belongs
    to, in the configuration's order: what the check compares. The expert axes (their levels
    under the hierarchical dispatch) and the hybrid cp axes exist as axes the layout added
    (ep > 1; hybrid cp) only."""
    if comm.mesh is None:
        return []
    out = []
    for axis in dict.fromkeys((*AXES, *DERIVED_AXES, *comm.added)):
        if axis in (*EXPERT_AXES, *EP_LEVELS, *CP_AXES) and axis not in comm.added:
            continue
        ranks = comm.members(axis)
        if len(ranks) > 1:
            out.append((axis, ranks))
    return out


class GroupCheck:
    """The comparison of ``Ledger`` windows over the rendezvous store, for one run.

    ``groups``: (axis, its ranks) for every axis of more than one rank this rank belongs to,
    in an order every rank shares (the configuration's). ``key`` tells apart runs sharing a
    store (several runs in one process group, restarts). Each rank compares itself with every
    rank it shares a group with, on the calls of the groups they share, in issue order: the
    same calls per group, and the same interleaving across groups (two ranks that call
    all-reduce on "dp" then "edp" against "edp" then "dp" deadlock)."""

    def __init__(self, ledger: Ledger, store, key: str, groups: list[tuple[str, tuple]]):
        self.ledger, self.store, self.key = ledger, store, key
        self.groups = [(a, tuple(r)) for a, r in groups]
        self.peers = sorted({r for _, ranks in self.groups for r in ranks} - {ledger.rank})

    def _record_key(self, n: int, rank: int) -> str:
        return f"threefold/{self.key}/check/{n}/{rank}"

    def check(self, where: str, timeout_s: float) -> None:
        """Compare this rank's calls since the last check with its group peers'; raise
        CollectiveMismatch naming the first difference, or CollectiveHang when a peer's record
        does not come within ``timeout_s``."""
        led = self.ledger
        n = led.checks
        record = led.position()
        self.store.set(self._record_key(n, led.rank), zlib.compress(json.dumps(record).encode()))
        keys = [self._record_key(n, r) for r in self.peers]
        if keys:
            try:
                self.store.wait(keys, timedelta(seconds=timeout_s))
            except RuntimeError:
                late = [r for r, k in zip(self.peers, keys) if not self.store.check([k])]
                raise CollectiveHang(
                    f"collective check at the end of {where}: rank(s) "
                    f"{', '.join(map(str, late))} did not reach it within {timeout_s:.0f} s "
                    f"(stuck in a collective, or dead)") from None
            got = self.store.multi_get(keys)
            records = {r: json.loads(zlib.decompress(v)) for r, v in zip(self.peers, got)}
        else:
            records = {}
        records[led.rank] = record
        problem = first_difference(self.groups, records, led.rank)
        if problem:
            raise CollectiveMismatch(f"collectives differ at the end of {where}: {problem}")
        if n > 0:  # every peer wrote record n, so it has read record n - 1: drop ours
            self.store.delete_key(self._record_key(n - 1, led.rank))
        led.checks += 1
        led._roll()


def first_difference(groups: list[tuple[str, tuple]], records: dict[int, dict],
                     me: int | None = None) -> str | None:
    """The first pair of ranks (``me`` against each peer, or every pair of a group's ranks
    when ``me`` is None; in ``groups`` order) whose calls on the groups they share differ,
    described: the ranks, those groups, and the first differing call on each side.
    ``records``: rank -> ``Ledger.position()``; ranks without a record are skipped."""
    for axis, ranks in groups:
        have = [r for r in ranks if r in records]
        pairs = [(me, r) for r in have if r != me] if me is not None and me in have else \
            [(have[0], r) for r in have[1:]] if have else []
        for a, b in pairs:
            shared = [g for g, rs in groups if a in rs and b in rs]
            problem = _compare(a, b, records[a], records[b], shared, dict(groups))
            if problem:
                return problem
    return None


def _compare(a: int, b: int, ra: dict, rb: dict, shared: list[str],
             ranks: dict[str, tuple]) -> str | None:
    """Ranks ``a`` and ``b``'s calls on the ``shared`` axes, in issue order: None when equal,
    else the first difference in words."""
    ca = [c for c in ra["window"] if c[0] in shared]
    cb = [c for c in rb["window"] if c[0] in shared]
    if ca == cb:
        return None
    i = next((k for k, (x, y) in enumerate(zip(ca, cb)) if x != y), min(len(ca), len(cb)))

    def call(calls: list, rec: dict) -> str:
        if i >= len(calls):
            return f"nothing (it issued {len(calls)} calls on them)"
        axis, what = calls[i]
        seq = rec["base"].get(axis, 0) + sum(1 for c in calls[:i + 1] if c[0] == axis)
        return f"{what.split(' ', 1)[0]} on '{axis}' (#{seq} there) {what.split(' ', 1)[1]}"

    groups = ", ".join(f"{g} [{', '.join(map(str, ranks[g]))}]" for g in shared)
    return (f"ranks {a} and {b} (groups {groups}): their call {i + 1} on these groups is, on "
            f"rank {a}, {call(ca, ra)}; on rank {b}, {call(cb, rb)}")
