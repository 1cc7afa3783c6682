"""V-shaped schedules: two model chunks per rank, the model walking the ranks down and back up
(chunk 0 of rank r is stage r, chunk 1 is stage 2p - 1 - r; ``actions.stage_rank``). Rank 0
holds the first and the last stage (a tied head's gradient is summed with the embedding's
there, without a message), and the microbatch that rank p - 1 sends back reaches rank 0's
loss after 2p chunk times.

- **ZB-V** (Qi et al., "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362;
  also §6 of arXiv 2401.10241): backward split into B and W as in ZB-H1. Rank r warms up with
  2(p - r) - 1 forwards of chunk 0, then r pairs (F chunk 1, F chunk 0), then p - r rounds of
  (F, B, W) on chunk 1; the steady state repeats (F, B, W) on chunk 0 then on chunk 1; the
  cool-down runs the remaining Bs, each followed by a W while gradients trickle in, and the
  leftover Ws last. Every rank holds at most 2p chunk activations (p microbatches of its
  layers, 1F1B's peak on rank 0). With T_F = T_B = T_W and m >= 2p - 2 the only idle time is
  the start of rank r, r chunk forwards late: (p - 1) chunk times, (p - 1)/(6m) of the ideal
  (the paper's "≈ 0"; ZB-H1's is twice that).
- **DualPipeV** (DeepSeek-V3, arXiv 2412.19437 §3.2.1, and the V form in DeepSeek's DualPipe
  repository): pairs one microbatch's forward of one chunk with another's backward of the
  other chunk (on a GPU the two overlap, hiding each other's communication; on a CPU here the
  pair is an ordering, run one after the other). Eight phases per rank r: 2(p - r - 1)
  forwards of chunk 0; r + 1 pairs (F0, F1); p - r - 1 rounds (B1 split, W, F1); the main
  phase of m - 2p + r + 1 rounds (F0 & B1, F1 & B0) with full backwards; p - r - 1 rounds
  (B1, F1 & B0); r + 1 pairs (B1, B0) whose Ws wait; p - r - 1 (W, B0 split); the remaining
  Ws. A whole backward is written B then its W at once. With T_F = T_B = T_W, no overlap
  (F&B = F + B + W) the simulated idle time is (p - 1) chunk times, DeepSeek's
  (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages; 2p + 1 chunk activations in flight, its PP + 1.

Each builder returns one rank's compute order; ``messages.place_by_gap`` lays out the sends and
receives, and ``check.py`` proves the result before launch. Imports no torch.
"""

from __future__ import annotations

from threefold.schedules.actions import Action, ActionKind, rank_stage
from threefold.schedules.messages import Steps

F, B, W, BW = (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT,
               ActionKind.BACKWARD)


class _Order:
    """One rank's compute order under construction, with per-chunk counters. Each call emits
    its action only when it can run in order on this rank (a forward of chunk 1 after the
    same microbatch's chunk 0, a backward after its forward and, on chunk 0, after chunk 1's
    backward, a W after its B), so the phase recipes stay valid when m is small."""

    def __init__(self, p: int, m: int, rank: int):
        self.p, self.m, self.rank = p, m, rank
        self.f, self.b, self.w = [0, 0], [0, 0], [0, 0]
        self.pending: list[list[tuple[int, int]]] = [[], []]  # (position, microbatch): B
        # done, W not yet
        self.acts: list[Action] = []

    def _act(self, kind: ActionKind, mb: int, chunk: int) -> bool:
        self.acts.append(Action(kind, mb, chunk, rank_stage(self.rank, chunk, self.p, True)))
        return True

    def forward(self, c: int) -> bool:
        ready = self.f[c] < (self.m if c == 0 else self.f[0])
        if ready:
            self.f[c] += 1
            return self._act(F, self.f[c] - 1, c)
        return False

    def backward(self, c: int, split: bool = True) -> bool:
        """B of chunk ``c``'s next microbatch (its W left pending), or with ``split`` False
        the whole backward: B then at once its W (one unit each, like every other action,
        which keeps ``place_by_gap``'s message layout exact)."""
        if not split:
            return self.backward(c) and self.weight(c, newest=True)
        ready = self.b[c] < self.f[c] and (c == 1 or self.b[0] < self.b[1])
        if ready:
            self.b[c] += 1
            self.pending[c].append((len(self.acts), self.b[c] - 1))
            return self._act(B, self.b[c] - 1, c)
        return False

    def weight(self, c: int | None = None, newest: bool = False) -> bool:
        """The oldest pending W of chunk ``c`` (None: of whichever chunk's B came first), or
        the ``newest``."""
        if c is None:
            heads = [(q[0][0], k) for k, q in enumerate(self.pending) if q]
            c = min(heads)[1] if heads else 0
        if self.pending[c]:
            self.w[c] += 1
            return self._act(W, self.pending[c].pop(-1 if newest else 0)[1], c)
        return False

    def finish(self) -> Steps:
        """Whatever is left, in dependency order, then each action as its own step."""
        while self.backward(1) or self.backward(0) or self.forward(1) or self.forward(0):
            pass
        while self.weight():
            pass
        return [[a] for a in self.acts]


def _run(o: _Order, phases) -> Steps:
    """Play ``phases``, each (times, ops) with ops as (kind, chunk): "F", "B" (W left
    pending), "BW" (B then its W at once) or "W" (the oldest pending; chunk None: of either
    chunk); ``times`` a count, or a test of the order repeated while true. Then ``finish``."""
    do = {"F": o.forward, "B": o.backward, "BW": lambda c: o.backward(c, split=False),
          "W": o.weight}
    for times, ops in phases:
        test = times if callable(times) else None
        left = 0 if test else max(0, times)
        while test(o) if test else left > 0:
            left -= 1
            for kind, chunk in ops:
                do[kind](chunk)
    return o.finish()


def zb_v_steps(p: int, m: int, v: int, rank: int) -> Steps:
    """ZB-V's compute order on ``rank`` (see the module doc); the steady phase runs until
    every forward is placed."""
    r = rank
    return _run(_Order(p, m, rank), [
        (2 * (p - r) - 1, [("F", 0)]),
        (r, [("F", 1), ("F", 0)]),
        (p - r, [("F", 1), ("B", 1), ("W", 1)]),
        (lambda o: o.f[0] < m or o.f[1] < o.f[0],
         [("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)]),
        (r, [("B", 0), ("B", 1)]),
        (p - r, [("B", 0), ("W", 0)]),
        (m, [("W", 1)]),
    ])


def dualpipe_v_steps(p: int, m: int, v: int, rank: int) -> Steps:
    """DualPipeV's compute order on ``rank`` (see the module doc)."""
    r = rank
    return _run(_Order(p, m, rank), [
        (2 * (p - r - 1), [("F", 0)]),
        (r + 1, [("F", 0), ("F", 1)]),
        (p - r - 1, [("B", 1), ("W", None), ("F", 1)]),
        (m - 2 * p + r + 1, [("F", 0), ("BW", 1), ("F", 1), ("BW", 0)]),
        (p - r - 1, [("BW", 1), ("F", 1), ("BW", 0)]),
        (r + 1, [("B", 1), ("B", 0)]),
        (p - r - 1, [("W", None), ("B", 0)]),
    ])
