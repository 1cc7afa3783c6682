"""Restart without restarting the survivors (``ft.lighthouse``, torchft): how long the
surviving replica group goes without a step when the other group's process dies.

    python3 bench/bench_ft_restart.py                 # 4 kills (~1 min, 2 cores)
    python3 bench/bench_ft_restart.py --kills 6 --stall-s 0.1
    python3 bench/bench_ft_restart.py --heartbeat-timeout-ms 300

How: a torchft Lighthouse (``python3 -m threefold.parallel.ft_replicas``), two replica groups,
each `threefold train --nproc-per-node 1 --max-restarts K` (the tests' tiny model, one OpenMP
thread), the survivor slowed by ``--stall-s`` per step (``THREEFOLD_FAULT`` stalls) so that the
run outlasts the kills. Each round waits until both groups train together (a record of group
1's current process with 2 participants), SIGKILLs group 1's worker (its pid from its
metrics.jsonl) and notes the time; torchrun restarts that worker alone, it heals from group
0's memory and rejoins. Per kill:

- ``to_next_step_s``: from the kill to the end of the survivor's first step trained without
  the dead group (its records carry the wall clock and the quorum's size): failure detection
  (gloo's error on the dead peer, or the Lighthouse's heartbeat timeout), the failed commit,
  a new quorum without the dead group, and one step;
- ``attempts``: the tries the survivor's interrupted step took;
- ``rejoin_s``: from the kill to the restarted group's first step (torchrun's restart,
  Python + torch import, data, model build, the quorum and the heal from memory);
- ``survivor_pid_same``: the survivor kept its process.
The last JSON line holds the rows and the means.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import print_table  # noqa: E402
from threefold.data.corpus import sample_corpus  # noqa: E402


def _records(out: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    except (OSError, ValueError):
        return []


def _group(args, corpus, cache, out: Path, address: str, group: int, env: dict):
    tiny = {"data.corpus": corpus, "data.cache_dir": cache, "data.vocab_size": 320,
            "data.seq_len": 32, "model.hidden_size": 64, "model.intermediate_size": 128,
            "model.num_hidden_layers": 2, "model.num_attention_heads": 4,
            "model.num_key_value_heads": 2, "train.global_batch_size": 8,
            "train.micro_batch_size": 8, "train.steps": args.steps, "train.output_dir": out,
            "train.eval_batches": 2, "train.eval_interval": 0, "train.log_interval": 1000,
            "train.progress": "off", "checkpoint.save_final": "false",
            "ft.lighthouse": address, "ft.replica_group": group, "ft.replica_groups": 2}
    cmd = [sys.executable, "-m", "threefold", "train", "--nproc-per-node", "1",
           "--max-restarts", str(args.kills + 1),
           *[a for k, v in tiny.items() for a in (f"--{k}", str(v))]]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait(cond, timeout: float, what: str):
    t0 = time.time()
    while time.time() - t0 < timeout:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise SystemExit(f"bench_ft_restart: timed out waiting for {what}")


def _one_kill(g0: Path, g1: Path, done_pids: set) -> dict:
    """Wait until both groups train together under a new group-1 process, kill it."""
    def together():
        recs = _records(g1)
        r = recs[-1] if recs else None
        return r if r and r["pid"] not in done_pids and r["ft_participants"] == 2 else None
    victim = _wait(together, 180, "group 1 to train with group 0")["pid"]
    survivor_pid = _records(g0)[-1]["pid"]
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)
    done_pids.add(victim)
    after = _wait(lambda: [r for r in _records(g0) if r["time"] > t_kill
                           and r["ft_participants"] == 1], 120, "the survivor's next step")
    first = min(after, key=lambda r: r["time"])
    back = _wait(lambda: [r for r in _records(g1) if r["pid"] not in done_pids], 180,
                 "group 1 to rejoin")
    return {"to_next_step_s": first["time"] - t_kill, "attempts": first["ft_attempts"],
            "rejoin_s": back[0]["time"] - t_kill,
            "survivor_pid_same": all(r["pid"] == survivor_pid for r in _records(g0))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--stall-s", type=float, default=0.1)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=1000,
                    help="the Lighthouse's: silence after which a group is taken as gone")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-ft-"))
    corpus, cache = sample_corpus(work / "corpus.txt"), work / "cache"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    lh = subprocess.Popen([sys.executable, "-m", "threefold.parallel.ft_replicas", "--port", "0",
                           "--heartbeat-timeout-ms", str(args.heartbeat_timeout_ms)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          start_new_session=True)
    procs = [lh]
    try:
        address = lh.stdout.readline().split()[-1]
        stalls = ",".join(f"stall:0:{s}:{args.stall_s}" for s in range(1, 2000))
        g0, g1 = work / "g0", work / "g1"
        procs.append(_group(args, corpus, cache, g0, address, 0,
                            {**env, "THREEFOLD_FAULT": stalls}))
        procs.append(_group(args, corpus, cache, g1, address, 1, env))
        done: set = set()
        rows = [_one_kill(g0, g1, done) for _ in range(args.kills)]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    print_table(rows)
    means = {k: statistics.mean(r[k] for r in rows) for k in ("to_next_step_s", "rejoin_s")}
    means["to_next_step_max_s"] = max(r["to_next_step_s"] for r in rows)
    print(json.dumps({"bench": "ft_restart", "rows": rows, **means}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
