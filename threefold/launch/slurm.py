"""A Slurm allocation read as torchrun's multi-node flags: pure functions, no torch.

Inside an allocation (``SLURM_JOB_ID`` set, one ``srun`` task per node running
``threefold train --nproc-per-node G``), ``slurm_launch_flags`` fills in the flags the user
left out: ``--nnodes`` (``SLURM_NNODES``), ``--node-rank`` (``SLURM_NODEID``, for the static
rendezvous: c10d numbers the nodes itself), ``--rdzv-endpoint`` (the first host of the step's node
list, port ``RDZV_PORT`` or ``$THREEFOLD_RDZV_PORT``) and ``--rdzv-id`` (the job id, which every
node shares). Flags given on the command line win, one by one.

The node list is expanded by ``scontrol show hostnames`` when it is on PATH (Slurm's own
reading), else by ``expand_hostlist``, which reads the compressed form Slurm prints:
comma-separated names, each with any number of bracket groups of numbers and ranges
(``node[01-04,07]``, ``a[1-2],b3``, ``gpu-[001-003]-ib``, ``rack[1-2]-n[01-02]``); a range
keeps the zero padding of its lower bound, and the last group varies fastest, as scontrol
orders them.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
from typing import Callable, Mapping

RDZV_PORT = 29500  # the rendezvous port on the first node; $THREEFOLD_RDZV_PORT overrides it
PORT_ENV = "THREEFOLD_RDZV_PORT"


def _split_top(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside brackets; a bracket left open or closed unopened
    is an error."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f"node list '{text}': unbalanced brackets")
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"node list '{text}': unbalanced brackets")
    parts.append(text[start:])
    return parts


def _expand_group(group: str, where: str) -> list[str]:
    """The numbers of one bracket group's content, e.g. ``01-03,07`` -> 01 02 03 07."""
    out = []
    for item in group.split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"node list '{where}': '[{group}]' is not numbers and ranges")
        if not hi:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"node list '{where}': range {item} runs backwards")
        # Slurm pads a range to the width of its lower bound ("08-10": 08 09 10)
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def _expand_name(name: str) -> list[str]:
    """One name with any number of bracket groups -> its hosts (last group fastest)."""
    pieces: list[list[str]] = []  # alternating literal text and a group's choices
    rest = name
    while "[" in rest:
        head, _, tail = rest.partition("[")
        group, _, rest = tail.partition("]")
        pieces += [[head], _expand_group(group, name)]
    pieces.append([rest])
    return ["".join(p) for p in itertools.product(*pieces)]


def expand_hostlist(text: str) -> list[str]:
    """The hosts of a Slurm node list in its compressed form, in scontrol's order."""
    text = text.strip()
    if not text:
        raise ValueError("node list is empty")
    hosts = []
    for name in _split_top(text):
        if not name:
            raise ValueError(f"node list '{text}': an empty name between commas")
        hosts += _expand_name(name)
    return hosts


def scontrol_hostnames(nodelist: str) -> list[str] | None:
    """``scontrol show hostnames NODELIST`` when scontrol is on PATH and answers, else None."""
    if shutil.which("scontrol") is None:
        return None
    try:
        p = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    hosts = p.stdout.split()
    return hosts if p.returncode == 0 and hosts else None


def slurm_hosts(nodelist: str) -> tuple[list[str], str]:
    """The hosts of ``nodelist`` and what read them ("scontrol" or "parser")."""
    hosts = scontrol_hostnames(nodelist)
    return (hosts, "scontrol") if hosts else (expand_hostlist(nodelist), "parser")


def _env_count(env: Mapping[str, str], name: str, flag: str) -> int:
    """The number in ``env[name]``, which stands for torchrun's ``flag``."""
    value = env.get(name, "")
    if not value.isdigit():
        raise ValueError(f"Slurm allocation: {name}='{value}' is not a number; give {flag} "
                         "on the command line")
    return int(value)


def slurm_launch_flags(env: Mapping[str, str], launcher: list[str],
                       hosts_of: Callable[[str], tuple[list[str], str]] = slurm_hosts
                       ) -> tuple[list[str], str | None]:
    """``launcher`` (torchrun flags as ``[flag, value, ...]``) with the flags a Slurm
    allocation in ``env`` implies added where the user gave none, and the line that says
    what was inferred; outside an allocation ``(launcher, None)``."""
    if not env.get("SLURM_JOB_ID"):
        return launcher, None
    tasks, nodes = env.get("SLURM_STEP_NUM_TASKS"), env.get("SLURM_STEP_NUM_NODES")
    if tasks and nodes and tasks.isdigit() and nodes.isdigit() and int(tasks) > int(nodes):
        raise ValueError(f"Slurm step: {tasks} tasks on {nodes} nodes, but threefold train "
                         "starts every process of its node itself: run one task per node "
                         "(srun --ntasks-per-node=1)")
    given = set(launcher[::2])
    added: list[str] = []
    if "--nnodes" not in given:
        added += ["--nnodes", str(_env_count(env, "SLURM_NNODES", "--nnodes N"))]
    node = env.get("SLURM_NODEID", "?")  # said on the line; a flag only for static
    # torchrun's c10d rendezvous numbers the nodes itself (and warns that a --node-rank is
    # ignored); the static one takes each node's rank from the flag
    if "--node-rank" not in given and _backend(launcher) == "static":
        added += ["--node-rank", str(_env_count(env, "SLURM_NODEID", "--node-rank R"))]
    source = ""
    if "--rdzv-endpoint" not in given:
        # the step's nodes when srun runs on part of the allocation, else the job's
        nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                    or env.get("SLURM_NODELIST"))
        if not nodelist:
            raise ValueError("Slurm allocation without SLURM_JOB_NODELIST: pass "
                             "--rdzv-endpoint HOST:PORT")
        port = env.get(PORT_ENV) or str(RDZV_PORT)
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{PORT_ENV}='{port}' is not a port number (1-65535)")
        hosts, reader = hosts_of(nodelist)
        added += ["--rdzv-endpoint", f"{hosts[0]}:{port}"]
        source = f" (first of {nodelist}, read by {reader})"
    if "--rdzv-id" not in given:
        added += ["--rdzv-id", f"slurm{env['SLURM_JOB_ID']}"]
    if not added:
        return launcher, None
    shown = " ".join(added)
    return launcher + added, (f"threefold: Slurm job {env['SLURM_JOB_ID']}, node {node}: "
                              f"{shown}{source}; flags given on the command line win")


def _backend(launcher: list[str]) -> str:
    """The rendezvous backend torchrun will use: the flag's, else c10d."""
    flags = dict(zip(launcher[::2], launcher[1::2]))
    return flags.get("--rdzv-backend", "c10d")
