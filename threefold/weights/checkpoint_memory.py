"""In-memory checkpoints (``checkpoint.memory_interval``): where they live, the replica each
node keeps of the previous node's part, and the recovery ladder that picks what a (re)started
run resumes from.

An in-memory checkpoint is an ordinary sharded checkpoint (``threefold.weights.checkpoint``:
the same rank files, node parts, index, CRCs and SHA-256) written into a host-memory
directory, a tmpfs such as /dev/shm, one per node. It outlives the processes (torchrun
restarting every worker reads it back without touching storage), not the node. So after each
memory checkpoint commits, every rank sends the files it wrote to the rank with the same local
index on the next node of a fixed ring over nodes (node k -> k+1 mod nodes); each node's leader
adds its manifest part, node 0's also the index. Node k+1 then holds node k's part beside its
own, and when node k's memory is gone (a new machine) the checkpoint is still whole: the
part exchange of ``checkpoint_verify.fetch_parts`` finds node k's part on node k+1. The send is
one ``all_to_all_single`` on its own counted axis (``REPLICA_AXIS``), so its bytes are counted
like every other collective's; one node has no replica.

The ladder, decided identically on every rank (every node's leader reports, every rank
decides from the same gathered reports): the newest memory step whose index is on some node
and each of whose parts is intact on some node; a newer step with a part on no node is
skipped (and said). It is compared with storage's newest committed step: at equal steps memory
wins, since reading it costs no storage traffic.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from threefold.weights.checkpoint_verify import (FORMAT_VERSION, MANIFEST, CheckpointError,
                                                 NodeGroup, part_intact, part_name)

REPLICA_AXIS = "replica"  # the counted axis of the replica's sends (Comm.add_axis)
SHM = Path("/dev/shm")

__all__ = ["REPLICA_AXIS", "clear_memory", "memory_ladder", "memory_root", "prune_below",
           "replica_files", "replica_rings", "send_replica"]


def memory_root(spec: str, output_dir: str | Path, node: int) -> Path:
    """Node ``node``'s in-memory checkpoint root: ``spec`` (``checkpoint.memory_dir``) with
    ``{node}`` replaced, or /dev/shm/threefold-<12 hex of the output dir's SHA-256>/node<k>,
    so that two runs never share one and a restarted run finds its own."""
    if spec:
        return Path(spec.replace("{node}", str(node)))
    digest = hashlib.sha256(str(Path(output_dir).resolve()).encode()).hexdigest()[:12]
    return SHM / f"threefold-{digest}" / f"node{node}"


def replica_rings(node_of: list[int]) -> list[list[int]] | None:
    """The replica groups: for each local index, the ranks with that index on every node,
    in node order (the ring). None on one node (no replica). Every node must run as many
    ranks (torchrun's --nproc-per-node is one number)."""
    nodes = sorted(set(node_of))
    if len(nodes) < 2:
        return None
    per = [[r for r, n in enumerate(node_of) if n == k] for k in nodes]
    if len({len(p) for p in per}) != 1:
        raise CheckpointError("checkpoint.memory_interval: the replica ring needs the same "
                              "number of ranks on every node, got "
                              + ", ".join(f"node {k}: {len(p)}" for k, p in zip(nodes, per)))
    return [[p[i] for p in per] for i in range(len(per[0]))]


def replica_files(rank: int, group: NodeGroup) -> list[str]:
    """The files of a checkpoint step that ``rank`` sends to its peer: what it wrote, and
    its node's part on a leader, and the index on rank 0."""
    names = [f"rank{rank}.json", f"rank{rank}.safetensors"]
    if rank == 0:
        names.append("state.json")
    if group.is_leader(rank):
        names.append(part_name(group.node_of[rank]))
    if rank == 0:
        names.append(MANIFEST)
    return names


def send_replica(comm, root: Path, step: int, rank: int, group: NodeGroup
                 ) -> tuple[int, int]:
    """Collective over ``REPLICA_AXIS``: send this rank's files of committed step ``step``
    (``replica_files``) to its peer on the next node, and write the previous node's peer's
    files into this node's ``root/<step>``. Returns (bytes sent, bytes received), both as
    the communication layer counts them on the axis's all-to-all."""
    path = root / str(step)
    names = replica_files(rank, group)
    blobs = [(path / n).read_bytes() for n in names]
    metas = comm.all_gather_object((names, [len(b) for b in blobs]), REPLICA_AXIS)
    members = list(comm.members(REPLICA_AXIS))  # ascending global ranks
    ring = sorted(members, key=lambda r: group.node_of[r])
    me = ring.index(rank)
    to, frm = ring[(me + 1) % len(ring)], ring[(me - 1) % len(ring)]
    payload = b"".join(blobs)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload \
        else torch.empty(0, dtype=torch.uint8)
    send_sizes, recv_sizes = [0] * len(members), [0] * len(members)
    send_sizes[members.index(to)] = len(payload)
    their_names, their_sizes = metas[members.index(frm)]
    recv_sizes[members.index(frm)] = sum(their_sizes)
    got = torch.empty(sum(their_sizes), dtype=torch.uint8)
    comm.all_to_all_single(got, data, REPLICA_AXIS, recv_sizes, send_sizes)
    _write_received(path, their_names, their_sizes, got.numpy().tobytes())
    return len(payload), len(got)


def _write_received(path: Path, names: list[str], sizes: list[int], data: bytes) -> None:
    """The peer's files into ``path``, each atomically; its part after its rank files and the
    index last, so a part or an index on disk means the files it lists are there."""
    offsets, at = {}, 0
    for n, size in zip(names, sizes):
        offsets[n] = (at, at + size)
        at += size
    path.mkdir(parents=True, exist_ok=True)
    order = sorted(names, key=lambda n: (n == MANIFEST, n.startswith("manifest.node"), n))
    for n in order:
        if Path(n).name != n:
            raise CheckpointError(f"{path}: the peer sent a file named '{n}'")
        a, b = offsets[n]
        tmp = path / f".{n}.recv"
        tmp.write_bytes(data[a:b])
        os.replace(tmp, path / n)


def prune_below(root: Path, step: int) -> None:
    """Remove the step directories of ``root`` older than ``step`` (a node's leader, once
    ``step`` and its peer's copy are both in place)."""
    if not root.is_dir():
        return
    for p in sorted(root.iterdir()):
        if p.is_dir() and p.name.isdigit() and int(p.name) < step:
            shutil.rmtree(p, ignore_errors=True)


def clear_memory(root: Path) -> None:
    """Remove every checkpoint (and unfinished one) under ``root``: a fresh run's memory
    holds nothing of an earlier one, and a finished run's gives its host memory back."""
    if not root.is_dir():
        return
    for p in sorted(root.iterdir()):
        if p.is_dir() and (p.name.isdigit() or p.name.startswith((".tmp-", ".old-"))):
            shutil.rmtree(p, ignore_errors=True)
    if not any(root.iterdir()):
        root.rmdir()
        if root.parent.name.startswith("threefold-"):  # the default's run folder, once empty
            with contextlib.suppress(OSError):  # (another node's folder may still be in it)
                root.parent.rmdir()


# --------------------------------------------------------------------------------------------
# The recovery ladder
# --------------------------------------------------------------------------------------------
def _indexes(root: Path) -> dict[int, str]:
    """Step -> the index text of each step directory under ``root`` that holds one."""
    if not root.is_dir():
        return {}
    out = {}
    for p in sorted(root.iterdir()):
        if p.is_dir() and p.name.isdigit() and (p / MANIFEST).is_file():
            try:
                out[int(p.name)] = (p / MANIFEST).read_text()
            except OSError:
                continue
    return out


def _parse(text: str) -> dict | None:
    try:
        index = json.loads(text)
    except ValueError:
        return None
    return index if index.get("format_version") == FORMAT_VERSION else None


def memory_ladder(root: Path, rank: int, group: NodeGroup, storage_step: int
                  ) -> tuple[int, str, list[str]]:
    """Collective: (the step to resume from, "peer memory" | "memory" | "storage", notes on
    memory steps skipped). Memory is this node's ``root``; ``storage_step`` the newest
    committed storage step (0 for none). When the chosen memory step's index is not on node
    0 (whose root ``open_sharded`` reads it from), node 0's leader writes it there from
    the node that kept it."""
    leader = group.is_leader(rank)
    reports = group.all_gather(_indexes(root) if leader else None)
    indexes: dict[int, dict] = {}
    texts: dict[int, str] = {}
    for rep in reports:
        for step, text in (rep or {}).items():
            if step not in indexes and (index := _parse(text)) is not None:
                indexes[step], texts[step] = index, text
    candidates = sorted((s for s in indexes if s >= storage_step), reverse=True)
    held = None
    if leader:
        held = {s: [n for n, rec in indexes[s]["parts"].items()
                    if part_intact(root / str(s), n, rec)] for s in candidates}
    helds = group.all_gather(held)
    notes = []
    for step in candidates:
        parts = indexes[step]["parts"]
        holders = {n: [group.node_of[r] for r, h in enumerate(helds) if h and n in h[step]]
                   for n in parts}
        lost = sorted(n for n, hs in holders.items() if not hs)
        if lost:
            notes.append(f"memory checkpoint {step} skipped: "
                         + ", ".join(f"node {parts[n]['node']}'s part" for n in lost)
                         + " is in no node's memory")
            continue
        own = all(parts[n]["node"] in hs for n, hs in holders.items())
        has_index = bool(reports[0] and step in reports[0])
        if not has_index and rank == 0:
            (root / str(step)).mkdir(parents=True, exist_ok=True)
            tmp = root / str(step) / f".{MANIFEST}.recv"
            tmp.write_text(texts[step])
            os.replace(tmp, root / str(step) / MANIFEST)
        group.barrier()
        return step, "memory" if own and has_index else "peer memory", notes
    return storage_step, "storage", notes
