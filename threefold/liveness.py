"""Liveness: each rank leaves a heartbeat (the step it reached) in the rendezvous store, and
after a failed or timed-out collective reads everyone's back to say which ranks are dead or
stuck, where each stood, and this rank's last collectives."""

from __future__ import annotations

import sys
import time
import zlib

from torch.distributed import distributed_c10d as c10d


class Heartbeats:
    """The heartbeats of one run (``key`` tells runs sharing a process group apart) of
    ``world`` ranks, seen from ``rank``; ``comm`` names the last collectives."""

    def __init__(self, rank: int, world: int, key: str, comm):
        self.rank, self.world, self.comm = rank, world, comm
        self.run_id = f"{zlib.crc32(key.encode()):08x}"

    def _store(self):
        return c10d._get_default_store()

    def _key(self, what: str, rank: int) -> str:
        return f"threefold/{self.run_id}/{what}/{rank}"

    def beat(self, step: int) -> None:
        """This rank reached ``step``."""
        self._store().set(self._key("step", self.rank), str(step))

    def report_failure(self, exc: BaseException, step: int, grace_s: float = 3.0) -> str:
        """After a failed or timed-out collective: say which ranks did not report the
        failure (dead or stuck), where every rank's heartbeat stands, and this rank's last
        collectives. Printed to stderr and returned. ``grace_s``: how long to give the other
        live ranks to report first (0 when torchrun is already tearing the group down)."""
        lines = [f"threefold: rank {self.rank}: collective failed at step {step + 1}: "
                 f"{str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}"]
        try:
            lines += self._who_failed(step, grace_s)
        except Exception as e:  # noqa: BLE001 - the store may be gone with its host
            lines.append(f"threefold: (rendezvous store unreachable: {e})")
        lines.append("threefold: last collectives on rank {}: {}".format(self.rank, "; ".join(
            f"{r['op']} on {r['axis']} {list(r['shape'])} step "
            f"{None if r['step'] is None else r['step'] + 1}" for r in self.comm.recent()[-5:])))
        report = "\n".join(lines)
        print(report, file=sys.stderr, flush=True)
        return report

    def _who_failed(self, step: int, grace_s: float) -> list[str]:
        store = self._store()
        store.set(self._key("failed", self.rank), str(step))
        time.sleep(grace_s)  # let the other live ranks reach their own failure
        silent = [r for r in range(self.world) if not store.check([self._key("failed", r)])]
        beats = {}
        for r in range(self.world):
            k = self._key("step", r)
            beats[r] = int(store.get(k)) + 1 if store.check([k]) else 0
        lines = []
        if silent:
            lines.append("threefold: ranks that did not report (dead or stuck): "
                         + ", ".join(f"rank {r} (last reached step {beats[r]})" for r in silent))
        lines.append("threefold: steps reached: " + ", ".join(
            f"rank {r}: {b}" for r, b in beats.items()))
        return lines
