"""Liveness: each rank leaves a heartbeat (the step it reached) in the rendezvous store, and
after a failed or timed-out collective (in any phase: start-up, loading, a step, evaluation,
a checkpoint) leaves its position there and reads everyone's back, to say which ranks are
dead or stuck, where each stood (phase, the collective it was inside with its axis and number
there), the first differing call when the run checks its collectives, and this rank's last
collectives."""

from __future__ import annotations

import json
import os
import sys
import time
import zlib

from threefold.comm.collective_check import check_groups, first_difference
from threefold.comm.distributed import c10d_store


class Heartbeats:
    """The heartbeats of one run (``key`` tells runs sharing a process group apart) of
    ``world`` ranks, seen from ``rank``; ``comm`` names the last collectives."""

    def __init__(self, rank: int, world: int, key: str, comm):
        self.rank, self.world, self.comm = rank, world, comm
        self.run_id = f"{zlib.crc32(key.encode()):08x}"

    def _store(self):
        return c10d_store()

    def _key(self, what: str, rank: int) -> str:
        return f"threefold/{self.run_id}/{what}/{rank}"

    def beat(self, step: int) -> None:
        """This rank reached ``step``."""
        self._store().set(self._key("step", self.rank), str(step))

    def report_failure(self, exc: BaseException, step: int, grace_s: float = 3.0) -> str:
        """After a failed or timed-out collective (or a collective check that a peer never
        reached): say which ranks did not report the failure (dead or stuck), where every
        rank stood (its phase, the collective it was inside or last issued, with its axis and
        number there), the first call where a group's ranks differ when that is known, and
        this rank's last collectives. Printed to stderr and returned. ``grace_s``: how long to
        give the other live ranks to report first (0 when torchrun is already tearing the
        group down)."""
        phase = self.comm.ledger.phase
        lines = [f"threefold: rank {self.rank}: collective failed in {phase}: "
                 f"{str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}"]
        try:
            lines += self._who_failed(step, grace_s)
        except Exception as e:
            lines.append(f"threefold: (rendezvous store unreachable: {e})")
        lines.append("threefold: last collectives on rank {}: {}".format(self.rank, "; ".join(
            f"{r['op']} on {r['axis']} (#{r['seq']} there, {r['phase']}) {list(r['shape'])}"
            for r in self.comm.recent()[-5:])))
        if self.comm.mesh is not None and torch_cuda_flight_recorder():
            lines.append("threefold: NCCL's flight recorder dumps each rank's last collectives "
                         f"on a timeout to {torch_cuda_flight_recorder()}<rank> (read them with "
                         "`python -m torch.distributed.flight_recorder.fr_trace`)")
        report = "\n".join(lines)
        print(report, file=sys.stderr, flush=True)
        return report

    def _position(self) -> dict:
        """Where this rank stands, for the others' reports."""
        recent = self.comm.recent()
        inside = next((r for r in reversed(recent) if not r["async"] and r["seconds"] is None),
                      None)
        last = recent[-1] if recent else None
        brief = (lambda r: None if r is None else
                 {"op": r["op"], "axis": r["axis"], "seq": r.get("seq"),
                  "phase": r.get("phase")})
        return {**self.comm.ledger.position(), "inside": brief(inside), "last": brief(last)}

    def _who_failed(self, step: int, grace_s: float) -> list[str]:
        store = self._store()
        store.set(self._key("where", self.rank), json.dumps(self._position()))
        store.set(self._key("failed", self.rank), str(step))
        time.sleep(grace_s)  # let the other live ranks reach their own failure
        silent = [r for r in range(self.world) if not store.check([self._key("failed", r)])]
        beats, where = {}, {}
        for r in range(self.world):
            k = self._key("step", r)
            beats[r] = int(store.get(k)) + 1 if store.check([k]) else 0
            k = self._key("where", r)
            if store.check([k]):
                where[r] = json.loads(store.get(k))
        lines = []
        if silent:
            lines.append("threefold: ranks that did not report (dead or stuck): "
                         + ", ".join(f"rank {r} (last reached step {beats[r]})" for r in silent))
        lines.append("threefold: steps reached: " + ", ".join(
            f"rank {r}: {b}" for r, b in beats.items()))
        lines.append("threefold: where each rank stood: " + "; ".join(
            f"rank {r}: {_stood(where.get(r))}" for r in range(self.world)))
        groups = check_groups(self.comm)
        diff = first_difference(groups, where) if self.comm.ledger.enabled else None
        if diff:
            lines.append(f"threefold: first difference: {diff}")
        return lines


def _stood(pos: dict | None) -> str:
    """One rank's position, in words."""
    if pos is None:
        return "no report (dead, or stuck past the grace period)"
    def call(c):
        return f"{c['op']} on {c['axis']} (#{c['seq']} there, {c['phase']})"
    if pos["inside"]:
        return f"{pos['phase']}, inside {call(pos['inside'])}"
    if pos["last"]:
        return f"{pos['phase']}, last issued {call(pos['last'])}"
    return f"{pos['phase']}, no collective issued yet"


def torch_cuda_flight_recorder() -> str | None:
    """The path prefix NCCL's flight recorder dumps to, when it is on (see
    ``threefold.comm.distributed.flight_recorder_env``)."""
    if os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") in ("", "0"):
        return None
    return os.environ.get("TORCH_FR_DUMP_TEMP_FILE") \
        or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
