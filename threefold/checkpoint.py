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
the commit.

Loading reads logical tensors from the pieces by name, whatever layout wrote them, so a run
resumes under any other layout: ``threefold.weights.CheckpointSource`` reads any region of a
logical tensor from only the pieces (and the parts of pieces) that hold it, so each rank reads
just the slices it owns. ``load_checkpoint`` reads one directory holding every part (a shared
filesystem, or the parts copied together) as whole tensors; ``load_sharded`` is the collective
form for a run whose nodes each see their own root (``fetch_parts``: every part is verified
where it lies, a part on no node is an error naming that node and its files, before any
tensor is read, and parts a node lacks travel to it over the control channel).
``save_streamed`` writes a checkpoint from one process batch by batch (``threefold convert``).
Loading always verifies the index, the parts, sizes and checksums first and names the damaged
file (and tensor). Version-2 checkpoints (one manifest listing every file) still load.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from threefold import faults

FORMAT_VERSION = 3
READ_VERSIONS = (2, 3)  # version 2: one manifest listing every file, no parts
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged or does not fit the run."""


@dataclass
class Piece:
    """Part of one logical tensor held by this rank."""

    name: str                 # HF parameter name
    kind: str                 # "model", "exp_avg" or "exp_avg_sq"
    data: torch.Tensor        # 1-D: elements [start, end) of the tp slice, flattened
    start: int
    end: int
    shape: tuple              # logical (whole) shape
    tp_dim: int | None = None  # dimension split over tensor parallelism, None = not split
    tp_index: int = 0
    tp_count: int = 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, ascending (temporary dirs ignored)."""
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir()
                  if p.is_dir() and p.name.isdigit() and (p / MANIFEST).is_file())


def _slice_shape(shape: tuple, dim: int | None, index: int, count: int) -> tuple:
    """Shape of tp slice ``index`` of ``count`` (the last may be padding-short: size is
    ceil(n / count) for every slice, padding included)."""
    if dim is None:
        return tuple(shape)
    s = list(shape)
    s[dim] = math.ceil(shape[dim] / count)
    return tuple(s)


# --------------------------------------------------------------------------------------------
# Nodes: who writes where
# --------------------------------------------------------------------------------------------
@dataclass
class NodeGroup:
    """How the ranks of a collective save or load talk, and which node each sits on.

    ``node_of[r]`` is rank r's node (torchrun's GROUP_RANK); a node's first rank is its
    *leader*, which hashes the node's files and writes its manifest part. ``barrier``,
    ``gather`` (to rank 0; None elsewhere), ``all_gather`` and ``broadcast`` (from rank 0) are
    the control channel's. The default is one process on one node."""

    node_of: list = field(default_factory=lambda: [0])
    barrier: Callable[[], None] = lambda: None
    gather: Callable[[Any], Any] = lambda obj: [obj]
    all_gather: Callable[[Any], list] = lambda obj: [obj]
    broadcast: Callable[[Any], Any] = lambda obj: obj

    @property
    def nodes(self) -> list[int]:
        """The nodes, ascending."""
        return sorted(set(self.node_of))

    def ranks_of(self, node: int) -> list[int]:
        """The ranks on ``node``, ascending."""
        return [r for r, n in enumerate(self.node_of) if n == node]

    def is_leader(self, rank: int) -> bool:
        """Whether ``rank`` is its node's first rank."""
        return self.ranks_of(self.node_of[rank])[0] == rank


def part_name(node: int) -> str:
    """File name of node ``node``'s manifest part."""
    return f"manifest.node{node}.json"


def resolve_root(spec: str, output_dir: str | Path, node: int) -> Path:
    """The checkpoint root of ``node``: ``spec`` (``checkpoint.dir``) with ``{node}`` replaced
    by the node rank, or OUTPUT_DIR/checkpoints when ``spec`` is empty."""
    return Path(spec.replace("{node}", str(node))) if spec else Path(output_dir) / "checkpoints"


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
    _fsync(tmp)
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
    node = g.node_of[rank]
    tmp, owner = _prepare(root, step, rank, g)
    # 2. every rank writes its own files
    _write_rank(tmp, rank, pieces, rank_tensors, state)
    faults.during_save(rank, step)
    g.barrier()
    # 3. each node's leader describes its node's files; rank 0 collects the parts' digests
    record = _describe_node(tmp, step, node, g.ranks_of(node)) if g.is_leader(rank) else None
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
    tmp, _ = _prepare(root, step, 0, g)
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


def _prepare(root: Path, step: int, rank: int, g: NodeGroup) -> tuple[Path, bool]:
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
        d.update(key=key, shape=list(p.shape), crc32=_crc(tensors[key]))
        meta.append(d)
    for k, t in rank_tensors.items():
        tensors[f"rank/{k}"] = t.detach().contiguous().cpu()
    save_file(tensors, str(tmp / f"rank{rank}.safetensors"))
    extra = {k: _crc(t) for k, t in tensors.items() if k.startswith("rank/")}
    (tmp / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "pieces": meta,
                                                      "rank_tensors": extra}))
    for name in (f"rank{rank}.safetensors", f"rank{rank}.json"):
        _fsync(tmp / name)
    if rank == 0:
        (tmp / "state.json").write_text(json.dumps(state or {}, indent=1, sort_keys=True))
        _fsync(tmp / "state.json")


def _describe_node(tmp: Path, step: int, node: int, ranks: list[int]) -> dict:
    """Step 3, on a node's leader: hash the files of ``ranks`` into the node's manifest part;
    return the part's record for the index."""
    names = [f"rank{r}{ext}" for r in ranks for ext in (".json", ".safetensors")]
    names += ["state.json"] if 0 in ranks else []
    files = {n: {"bytes": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)}
             for n in sorted(names)}
    _write_json(tmp / part_name(node), {"format_version": FORMAT_VERSION, "step": step,
                                        "node": node, "ranks": ranks, "files": files})
    pf = tmp / part_name(node)
    return {"node": node, "bytes": pf.stat().st_size, "sha256": _sha256(pf),
            "ranks": ranks, "files": sorted(files)}


def _commit(root: Path, step: int, rank: int, world: int, owner: bool, records: list | None,
            keep_last: int, g: NodeGroup) -> Path:
    """Steps 4 and 5: every directory renamed into place; then rank 0 writes the index (the
    commit point); then whatever is not among the newest committed checkpoints is pruned."""
    tmp, final = root / f".tmp-{step}", root / str(step)
    if owner:
        _fsync(tmp)
        if final.exists():  # the same step saved again: swap, then drop the old one
            old = root / f".old-{step}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        _fsync(root)
    g.barrier()
    keep = None
    if rank == 0:
        parts = {part_name(r["node"]): r for r in records if r is not None}
        index = {"format_version": FORMAT_VERSION, "step": step, "world_size": world,
                 "nodes": len(parts), "parts": parts,
                 "files": {f: {"node": r["node"]} for r in parts.values() for f in r["files"]}}
        _write_json(final / MANIFEST, index)
        _fsync(final)
        keep = list_checkpoints(root)[-keep_last:]
    keep = g.broadcast(keep)
    if owner:
        for p in root.iterdir():
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
# Verifying and loading
# --------------------------------------------------------------------------------------------
def _inside(path: Path, name: str) -> Path:
    f = (path / name).resolve()
    if path.resolve() not in f.parents:
        raise CheckpointError(f"{path / MANIFEST}: entry '{name}' escapes the checkpoint")
    return f


def _read_index(path: Path) -> dict[str, Any]:
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST}; not a complete checkpoint")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None
    if manifest.get("format_version") not in READ_VERSIONS:
        raise CheckpointError(f"{mpath}: format version {manifest.get('format_version')} "
                              f"is not one of {', '.join(map(str, READ_VERSIONS))}")
    for name in [*manifest.get("files", {}), *manifest.get("parts", {})]:
        _inside(path, name)
    return manifest


def _check_file(path: Path, name: str, meta: dict) -> None:
    f = _inside(path, name)
    if not f.is_file():
        raise CheckpointError(f"{path}: missing file {name}")
    if f.stat().st_size != meta["bytes"]:
        raise CheckpointError(f"{f}: {f.stat().st_size} bytes, {meta['bytes']} recorded "
                              "(truncated?)")
    if _sha256(f) != meta["sha256"]:
        raise CheckpointError(f"{f}: checksum mismatch (corrupted){_bad_tensor(path, f)}")


def _missing_part(path: Path, name: str, rec: dict, where: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: node {rec['node']}'s part {name} is missing {where} (ranks "
        f"{', '.join(map(str, rec['ranks']))}: {', '.join(rec['files'])}); node {rec['node']} "
        "wrote it to its own checkpoint directory: restore that node, or copy its files here")


def _check_part(path: Path, name: str, rec: dict) -> dict[str, dict]:
    """Check node part ``name`` against its index record and its files against the part;
    return the part's files. A part that is absent raises naming its node and files."""
    f = _inside(path, name)
    if not f.is_file():
        raise _missing_part(path, name, rec, "here")
    if f.stat().st_size != rec["bytes"] or _sha256(f) != rec["sha256"]:
        raise CheckpointError(f"{f}: does not match the digest in {MANIFEST} (damaged, or from "
                              "another save of this step)")
    part = json.loads(f.read_text())
    files = part.get("files", {})
    absent = [n for n in files if not _inside(path, n).is_file()]
    if absent:
        raise _missing_part(path, name, {**rec, "files": absent}, "in part")
    for n, meta in files.items():
        _check_file(path, n, meta)
    return files


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check the index, every node part and every file's size and SHA-256 in one directory
    (all parts present: a shared filesystem, or the nodes' parts copied together); return
    the index, with ``files`` holding every file's size and digest, or raise CheckpointError
    naming the missing node's part and files, or the damaged file (and tensor)."""
    manifest = _read_index(path)
    if manifest["format_version"] == 2:
        for name, meta in manifest.get("files", {}).items():
            _check_file(path, name, meta)
        return manifest
    files: dict[str, dict] = {}
    for name, rec in sorted(manifest.get("parts", {}).items()):
        for n, meta in _check_part(path, name, rec).items():
            files[n] = {**meta, "node": rec["node"]}
    return {**manifest, "files": files}


def _bad_tensor(path: Path, f: Path) -> str:
    """Name the first tensor whose CRC no longer matches, if the file can still be read."""
    if not f.name.endswith(".safetensors"):
        return ""
    try:
        meta = json.loads((path / f.name.replace(".safetensors", ".json")).read_text())
        with safe_open(str(f), "pt") as sf:
            for p in meta["pieces"]:
                if _crc(sf.get_tensor(p["key"])) != p["crc32"]:
                    return f"; tensor {p['kind']} {p['name']}"
            for key, crc in meta.get("rank_tensors", {}).items():
                if _crc(sf.get_tensor(key)) != crc:
                    return f"; tensor {key}"
    except Exception:  # noqa: BLE001 - header itself damaged: the file name is what we have
        return ""
    return ""


def load_checkpoint(path: Path, rank: int = 0) -> tuple[dict[str, dict[str, torch.Tensor]],
                                                        dict[str, Any]]:
    """Verify, then reassemble whole logical tensors: {"model": {name: t}, "optim":
    {name.exp_avg: t, ...}, "rng": this rank's per-rank tensors (rank 0's if absent)}. Every
    node part must be in ``path``. Whole tensors on every rank: to read only a region, open
    the checkpoint as a ``threefold.weights.CheckpointSource``."""
    from threefold.weights import open_checkpoint  # weights builds on this module's format

    source, state, rng = open_checkpoint(path, rank)
    return _whole(source, rng), state


def _whole(source, rng: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of a checkpoint source, whole, in the dtype it was saved in."""
    optim = {f"{name}.{kind}": source.read(name, kind=kind, dtype=None)
             for kind in ("exp_avg", "exp_avg_sq") for name in source.names(kind)}
    return {"model": source.tensors("model", dtype=None), "optim": optim, "rng": rng}


def committed_steps(root: Path, rank: int, group: NodeGroup) -> list[int]:
    """Collective: the committed checkpoints, as rank 0 sees them (its directory holds the
    global index of each; another node's directory alone holds no commit)."""
    return group.broadcast(list_checkpoints(root) if rank == 0 else None)


def load_sharded(root: Path, step: int, rank: int, group: NodeGroup
                 ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Collective load of checkpoint ``step`` as whole tensors on every rank (see
    ``load_checkpoint``), when each node may see only its own directory ``root/<step>``: the
    parts are verified and exchanged by ``fetch_parts``. To read only the slices a rank owns,
    use ``threefold.weights.open_sharded``."""
    from threefold.weights import open_sharded  # weights builds on this module's format

    source, state, rng = open_sharded(root, step, rank, group)
    return _whole(source, rng), state


def fetch_parts(root: Path, step: int, rank: int, group: NodeGroup
                ) -> tuple[Path, dict[str, Path | bytes]]:
    """Collective: verify checkpoint ``step`` when each node may see only its own directory
    ``root/<step>`` (a node's local disk; a shared one works the same), and return its
    directory and every file of it, as a verified path or, for a file this node lacks, its
    bytes received from a node that holds it.

    Rank 0 sends its index to every rank; each node's leader verifies the parts it holds
    (part digest, every file's size and SHA-256); if a part is on no node, every rank raises
    CheckpointError naming that node's part and files, before any tensor is read. A part
    some nodes lack is sent to them over the control channel (once, checked against its
    digests on arrival). Version-2 checkpoints (one shared directory) are verified whole.
    ``threefold.weights.open_sharded`` reads the result by region."""
    path = root / str(step)
    index, err = None, None
    if rank == 0:
        try:
            index = _read_index(path)
        except CheckpointError as e:
            err = str(e)
    index, err = group.broadcast((index, err))
    if err:
        raise CheckpointError(err)
    if index["format_version"] == 2:  # written before node parts: one shared directory
        return path, {n: path / n for n in verify_checkpoint(path)["files"]}
    parts = index["parts"]
    report = None
    if group.is_leader(rank):
        report = {}
        for name, rec in parts.items():
            try:
                _check_part(path, name, rec)
                report[name] = "ok"
            except CheckpointError as e:
                report[name] = None if not _inside(path, name).is_file() else str(e)
    reports = group.all_gather(report)
    for rep in reports:
        for msg in (rep or {}).values():
            if msg not in (None, "ok"):
                raise CheckpointError(msg)
    holders = {name: sorted({group.node_of[r] for r, rep in enumerate(reports)
                             if rep and rep[name] == "ok"}) for name in parts}
    for name, rec in sorted(parts.items()):
        if not holders[name]:
            raise _missing_part(path, name, rec, "on every node")
    mine, all_nodes = group.node_of[rank], group.nodes
    received: dict[str, bytes] = {}
    if any(holders[n] != all_nodes for n in parts):
        send = {}
        if group.is_leader(rank):
            for name, hs in holders.items():
                if hs != all_nodes and hs[0] == mine:
                    for f in (name, *parts[name]["files"]):
                        send[f] = _inside(path, f).read_bytes()
        for got in group.all_gather(send):
            received.update(got)
        for name, rec in parts.items():
            if mine in holders[name]:
                continue
            if hashlib.sha256(received[name]).hexdigest() != rec["sha256"]:
                raise CheckpointError(f"{path}: {name} from node {holders[name][0]} does not "
                                      f"match the digest in {MANIFEST}")
            for f, meta in json.loads(received[name])["files"].items():
                if hashlib.sha256(received[f]).hexdigest() != meta["sha256"]:
                    raise CheckpointError(f"{path}: {f} from node {holders[name][0]} does "
                                          "not match its part's digest")
    local = {f for name, rec in parts.items() if mine in holders[name] for f in rec["files"]}
    return path, {n: _inside(path, n) if n in local else received[n]
                  for n in sorted(index["files"])}
