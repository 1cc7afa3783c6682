"""Sharded checkpoints in <root>/<step>/ (root: ``checkpoint.dir``, default
OUTPUT_DIR/checkpoints): safetensors for tensors, JSON for the rest, no pickle anywhere.

Each rank writes only what it holds — its *pieces* — to ``rank<r>.safetensors``, and describes
them in ``rank<r>.json``: for each piece the logical tensor (HF parameter name, and ``model``,
``exp_avg`` or ``exp_avg_sq``), its logical shape, where it sits — the tensor-parallel slice
(dimension, index, count) and the flat element range of that slice (a ZeRO shard covers a range)
— and a CRC-32 of its bytes. Replicated tensors are written once. Rank 0 adds ``state.json``
(step, sampler, scheduler, configs).

Nodes need not share a filesystem (format 3). Each node writes into its own root (its local
disk, or one shared by all); the node's first rank hashes the node's files into its *part*
``manifest.node<k>.json`` (each file's size and SHA-256) and sends the part's digest and file
list to rank 0 over the control channel; rank 0 writes the global index ``manifest.json``
(parts with their digests, every file with its node) into its own root. Nodes that share a
directory are found by probe files, so each directory is prepared and renamed once.

Writes are atomic: every node writes into a temporary sibling directory; after a barrier each
directory is renamed into place, then rank 0 writes the index: that is the commit point. A
step directory without an index (on rank 0's root) is not a checkpoint, and another node's
root alone never holds one (``list_checkpoints`` counts indexed steps only). A crash during a
save leaves the previous checkpoint untouched on every node; old checkpoints are pruned after
the commit. A save is three parts — ``prepare_save`` (collective), ``write_rank`` (no
collective) and ``finish_save`` (collective: parts, rename, index, prune) — so that
``threefold.weights.checkpoint_async`` can run the middle one on a background thread.

Loading reads logical tensors from the pieces by name, whatever layout wrote them, so a run
resumes under any other layout: ``threefold.weights.CheckpointSource`` reads any region of a
logical tensor from only the pieces (and the parts of pieces) that hold it, so each rank reads
just the slices it owns. ``load_checkpoint`` reads one directory holding every part (a shared
filesystem, or the parts copied together) as whole tensors; ``load_sharded`` is the collective
form for a run whose nodes each see their own root (``checkpoint_verify.fetch_parts``: every
part is verified where it lies, a part on no node is an error naming that node and its files,
before any tensor is read, and parts a node lacks travel to it over the control channel).
``save_streamed`` writes a checkpoint from one process batch by batch (``threefold convert``).
Loading always verifies the index, the parts, sizes and checksums first and names the damaged
file (and tensor): ``threefold.weights.checkpoint_verify``. Version-2 checkpoints
(one manifest listing every file) still load.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from safetensors.torch import save_file

from threefold.comm import faults
# The reader's side of the format lives in checkpoint_verify; callers import it from here.
from threefold.weights.checkpoint_verify import (FORMAT_VERSION, MANIFEST, NodeGroup,
                                         Piece, list_checkpoints, part_name,
                                         sha256_file, tensor_crc)
from threefold.weights.checkpoint_source import CheckpointSource, open_checkpoint, open_sharded

__all__ = ["finish_save", "fsync_path", "load_checkpoint", "load_sharded", "prepare_save",
           "rank_digests", "save_checkpoint", "save_sharded", "save_streamed", "unwritable",
           "whole_pieces", "write_rank"]


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file or a directory: its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unwritable(root: Path) -> str | None:
    """Why checkpoints cannot be written under ``root`` (None when they can): the nearest
    existing ancestor must be a directory this process may write into."""
    p = root
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    if not p.is_dir():
        return f"'{p}' is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"'{p}' is not writable"
    return None


def _write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` atomically (a sibling temp file, fsynced, renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    fsync_path(tmp)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------
def save_sharded(root: Path, step: int, rank: int, world: int, pieces: list[Piece],
                 rank_tensors: dict[str, torch.Tensor], state: dict[str, Any] | None,
                 keep_last: int, barrier: Callable[[], None] = lambda: None,
                 group: NodeGroup | None = None) -> Path:
    """Collective save of checkpoint ``step``: every rank calls it with its pieces (and
    per-rank tensors such as RNG state); rank 0 passes the JSON ``state``. ``root`` is this
    node's checkpoint root (its local disk, or a shared one); ``group`` says which node every
    rank is on (default: all on one, talking through ``barrier``).

    Every rank writes its files into ``root/.tmp-<step>``; each node's leader hashes its
    node's files into ``manifest.node<k>.json`` and sends the part's digest to rank 0; the
    temporary directories are renamed into place (once per distinct directory: nodes that
    share a filesystem are detected by probe files); then rank 0 writes the global index
    ``manifest.json`` — the commit point — and old checkpoints are pruned on every node."""
    g = group or NodeGroup(node_of=[0] * world, barrier=barrier)
    tmp, owner = prepare_save(root, step, rank, g)
    # 2. every rank writes its own files
    write_rank(tmp, step, rank, pieces, rank_tensors, state)
    return finish_save(root, step, rank, world, owner, keep_last, g)


def finish_save(root: Path, step: int, rank: int, world: int, owner: bool, keep_last: int,
                g: NodeGroup, digests: dict | None = None) -> Path:
    """Steps 3 to 5 of a collective save, once every rank's files of ``step`` are written
    (``write_rank``; ``owner`` from ``prepare_save``): describe each node's files, rename,
    write the index (the commit) and prune. ``threefold.weights.checkpoint_async`` calls it after
    its background writers are done, with ``digests``: every rank's ``rank_digests``, which the
    writers took, so that the node's leader does not read the files again."""
    node = g.node_of[rank]
    g.barrier()
    # 3. each node's leader describes its node's files; rank 0 collects the parts' digests
    record = _describe_node(root / f".tmp-{step}", step, node, g.ranks_of(node), digests) \
        if g.is_leader(rank) else None
    records = g.gather(record)
    g.barrier()
    return _commit(root, step, rank, world, owner, records, keep_last, g)


def save_streamed(root: Path, step: int, batches: Iterable[list[Piece]],
                  rank_tensors: dict[str, torch.Tensor], state: dict[str, Any],
                  keep_last: int) -> Path:
    """One process writes checkpoint ``step`` batch by batch, as if one rank per batch had
    saved it: batch r becomes ``rank<r>.safetensors`` (every rank file also gets
    ``rank_tensors``, so a run resumed on any number of ranks finds its RNG state), so only
    one batch's tensors are in memory at a time (``batches`` may be a generator that reads
    the next batch only when asked). A checkpoint's world size is just its number of rank
    files: loading reassembles tensors by name, so this loads, and resumes, under any layout.
    Atomic and checksummed like ``save_sharded``."""
    g = NodeGroup()
    tmp, _ = prepare_save(root, step, 0, g)
    try:
        world = 0
        for r, pieces in enumerate(batches):
            _write_rank(tmp, r, pieces, rank_tensors, state if r == 0 else None)
            world = r + 1
            del pieces  # before the generator reads the next batch
        if world == 0:  # no batch at all: still a checkpoint (state and RNG only)
            _write_rank(tmp, 0, [], rank_tensors, state)
            world = 1
        record = _describe_node(tmp, step, 0, list(range(world)))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never listed anyway: it has no index
        raise
    return _commit(root, step, 0, world, True, [record], keep_last, g)


def prepare_save(root: Path, step: int, rank: int, g: NodeGroup) -> tuple[Path, bool]:
    """Step 1 of a save: find which nodes share ``root`` (each leader drops a probe, then
    looks for the others'), and let the first of them empty ``root/.tmp-<step>``. Returns
    (the temporary directory, whether this rank owns it: prepares, renames and prunes)."""
    node, leader = g.node_of[rank], g.is_leader(rank)
    tmp = root / f".tmp-{step}"
    token = g.broadcast(os.urandom(8).hex() if rank == 0 else None)
    probe = root / f".probe-{token}.node{node}"
    if leader:
        root.mkdir(parents=True, exist_ok=True)
        probe.touch()
    g.barrier()
    owner = leader and min(k for k in g.nodes
                           if (root / f".probe-{token}.node{k}").exists()) == node
    g.barrier()
    if leader:
        probe.unlink()
    if owner:  # the one node that prepares, renames and prunes this directory
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    g.barrier()
    return tmp, owner


def write_rank(tmp: Path, step: int, rank: int, pieces: list[Piece],
               rank_tensors: dict[str, torch.Tensor], state: dict[str, Any] | None) -> None:
    """Step 2 of a collective save, no collective in it (``threefold.weights.checkpoint_async`` runs
    it on a background thread): this rank's files of checkpoint ``step`` into ``tmp``, then
    the test-only faults of a save (``threefold.comm.faults``)."""
    faults.before_write(rank, step)
    _write_rank(tmp, rank, pieces, rank_tensors, state)
    faults.during_save(rank, step)


def _write_rank(tmp: Path, rank: int, pieces: list[Piece], rank_tensors: dict[str, torch.Tensor],
                state: dict[str, Any] | None) -> None:
    """Write ``rank<r>.safetensors`` and ``rank<r>.json`` (and, for rank 0, ``state.json``)
    into ``tmp``, each fsynced."""
    tensors, meta = {}, []
    for i, p in enumerate(pieces):
        key = f"{p.kind}/{p.name}/{i}"
        tensors[key] = p.data.detach().contiguous().cpu()
        d = asdict(p)
        d.pop("data")
        d.update(key=key, shape=list(p.shape), crc32=tensor_crc(tensors[key]))
        meta.append(d)
    for k, t in rank_tensors.items():
        tensors[f"rank/{k}"] = t.detach().contiguous().cpu()
    save_file(tensors, str(tmp / f"rank{rank}.safetensors"))
    extra = {k: tensor_crc(t) for k, t in tensors.items() if k.startswith("rank/")}
    (tmp / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "pieces": meta,
                                                      "rank_tensors": extra}))
    for name in (f"rank{rank}.safetensors", f"rank{rank}.json"):
        fsync_path(tmp / name)
    if rank == 0:
        (tmp / "state.json").write_text(json.dumps(state or {}, indent=1, sort_keys=True))
        fsync_path(tmp / "state.json")


def _rank_files(rank: int) -> list[str]:
    """The files rank ``rank`` writes into a checkpoint."""
    return [f"rank{rank}.json", f"rank{rank}.safetensors"] + (["state.json"] if rank == 0
                                                              else [])


def rank_digests(tmp: Path, rank: int) -> dict[str, dict]:
    """Size and SHA-256 of each file rank ``rank`` wrote into ``tmp``, as a part lists them."""
    return {n: {"bytes": (tmp / n).stat().st_size, "sha256": sha256_file(tmp / n)}
            for n in _rank_files(rank)}


def _describe_node(tmp: Path, step: int, node: int, ranks: list[int],
                   digests: dict | None = None) -> dict:
    """Step 3, on a node's leader: hash the files of ``ranks`` (those not in ``digests``
    already) into the node's manifest part; return the part's record for the index."""
    known = digests or {}
    files = {}
    for r in ranks:
        files.update(known.get(r) or rank_digests(tmp, r))
    files = dict(sorted(files.items()))
    _write_json(tmp / part_name(node), {"format_version": FORMAT_VERSION, "step": step,
                                        "node": node, "ranks": ranks, "files": files})
    pf = tmp / part_name(node)
    return {"node": node, "bytes": pf.stat().st_size, "sha256": sha256_file(pf),
            "ranks": ranks, "files": sorted(files)}


def _commit(root: Path, step: int, rank: int, world: int, owner: bool, records: list | None,
            keep_last: int, g: NodeGroup) -> Path:
    """Steps 4 and 5: every directory renamed into place; then rank 0 writes the index (the
    commit point); then whatever is not among the newest committed checkpoints is pruned."""
    tmp, final = root / f".tmp-{step}", root / str(step)
    if owner:
        fsync_path(tmp)
        if final.exists():  # the same step saved again: swap, then drop the old one
            old = root / f".old-{step}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        fsync_path(root)
    g.barrier()
    keep = None
    if rank == 0:
        parts = {part_name(r["node"]): r for r in records if r is not None}
        index = {"format_version": FORMAT_VERSION, "step": step, "world_size": world,
                 "nodes": len(parts), "parts": parts,
                 "files": {f: {"node": r["node"]} for r in parts.values() for f in r["files"]}}
        _write_json(final / MANIFEST, index)
        fsync_path(final)
        keep = list_checkpoints(root)[-keep_last:]
    keep = g.broadcast(keep)
    if owner:
        for p in sorted(root.iterdir()):
            if p.is_dir() and p.name.isdigit() and int(p.name) not in keep \
                    and int(p.name) < max(keep):
                shutil.rmtree(p, ignore_errors=True)
    g.barrier()
    return final


def whole_pieces(tensors: dict[str, dict[str, torch.Tensor]]) -> list[Piece]:
    """Pieces for whole tensors: {"model": {name: t}, "optim": {name.exp_avg: t, ...}}."""
    out = []
    for name, t in tensors.get("model", {}).items():
        out.append(Piece(name, "model", t.reshape(-1), 0, t.numel(), tuple(t.shape)))
    for key, t in tensors.get("optim", {}).items():
        name, kind = key.rsplit(".", 1)
        out.append(Piece(name, kind, t.reshape(-1), 0, t.numel(), tuple(t.shape)))
    return out


def save_checkpoint(root: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                    state: dict[str, Any], keep_last: int) -> Path:
    """One-process save of whole tensors ({"model": ..., "optim": ..., "rng": ...})."""
    return save_sharded(root, step, 0, 1, whole_pieces(tensors), tensors.get("rng", {}), state,
                        keep_last)

# --------------------------------------------------------------------------------------------
# Loading whole tensors (threefold.weights reads by region)
# --------------------------------------------------------------------------------------------
def load_checkpoint(path: Path, rank: int = 0) -> tuple[dict[str, dict[str, torch.Tensor]],
                                                        dict[str, Any]]:
    """Verify, then reassemble whole logical tensors: {"model": {name: t}, "optim":
    {name.exp_avg: t, ...}, "rng": this rank's per-rank tensors (rank 0's if absent)}. Every
    node part must be in ``path``. Whole tensors on every rank: to read only a region, open
    the checkpoint as a ``threefold.weights.CheckpointSource``."""
    source, state, rng = open_checkpoint(path, rank)
    return _whole(source, rng), state


def load_sharded(root: Path, step: int, rank: int, group: NodeGroup
                 ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Collective load of checkpoint ``step`` as whole tensors on every rank (see
    ``load_checkpoint``), when each node may see only its own directory ``root/<step>``: the
    parts are verified and exchanged by ``checkpoint_verify.fetch_parts``. To read only the
    slices a rank owns, use ``threefold.weights.open_sharded``."""
    source, state, rng = open_sharded(root, step, rank, group)
    return _whole(source, rng), state


def _whole(source: CheckpointSource, rng: dict[str, torch.Tensor]
           ) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of a checkpoint source, whole, in the dtype it was saved in."""
    optim = {f"{name}.{kind}": source.read(name, kind=kind, dtype=None)
             for kind in ("exp_avg", "exp_avg_sq") for name in source.names(kind)}
    return {"model": source.tensors("model", dtype=None), "optim": optim, "rng": rng}
