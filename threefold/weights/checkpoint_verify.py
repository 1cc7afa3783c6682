"""The reader's side of the checkpoint format (``threefold.weights.checkpoint`` describes it): where a
node's root lies, which steps are committed, and verifying a checkpoint before any tensor is
read: the index ``manifest.json``, every node part ``manifest.node<k>.json``, every file's size
and SHA-256. ``verify_checkpoint`` checks one directory holding every part; ``fetch_parts`` is
the collective form for nodes that each see only their own root, exchanging the parts a node
lacks over the control channel. Any failure is a ``CheckpointError`` naming the missing node
part and its files, or the damaged file (and tensor).

``NodeGroup`` (who talks to whom, which node each rank is on) lives here because both the
collective save and the collective load speak through it.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

FORMAT_VERSION = 3
READ_VERSIONS = (2, 3)  # version 2: one manifest listing every file, no parts
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged or does not fit the run."""


def sha256_file(path: Path) -> str:
    """The SHA-256 of the file ``path``, hex, read a MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tensor_crc(t: torch.Tensor) -> int:
    """The CRC-32 of a tensor's bytes (0 for an empty one), as piece records hold it."""
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def list_checkpoints(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, ascending (temporary dirs ignored)."""
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir()
                  if p.is_dir() and p.name.isdigit() and (p / MANIFEST).is_file())


def resolve_root(spec: str, output_dir: str | Path, node: int) -> Path:
    """The checkpoint root of ``node``: ``spec`` (``checkpoint.dir``) with ``{node}`` replaced
    by the node rank, or OUTPUT_DIR/checkpoints when ``spec`` is empty."""
    return Path(spec.replace("{node}", str(node))) if spec else Path(output_dir) / "checkpoints"


def part_name(node: int) -> str:
    """File name of node ``node``'s manifest part."""
    return f"manifest.node{node}.json"


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


def committed_steps(root: Path, rank: int, group: NodeGroup) -> list[int]:
    """Collective: the committed checkpoints, as rank 0 sees them (its directory holds the
    global index of each; another node's directory alone holds no commit)."""
    return group.broadcast(list_checkpoints(root) if rank == 0 else None)


# --------------------------------------------------------------------------------------------
# One directory
# --------------------------------------------------------------------------------------------
def _inside(path: Path, name: str) -> Path:
    f = (path / name).resolve()
    if path.resolve() not in f.parents:
        raise CheckpointError(f"{path / MANIFEST}: entry '{name}' escapes the checkpoint")
    return f


def read_json(path: Path, error: type[Exception], absent: str, invalid: str) -> Any:
    """The JSON document in file ``path``, or ``error`` saying that its folder has no such
    file (``absent``: what the folder is not, then) or that it does not parse (``invalid``)."""
    if not path.is_file():
        raise error(f"{path.parent}: no {path.name}; {absent}")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise error(f"{path}: {invalid} ({e})") from None


def _read_index(path: Path) -> dict[str, Any]:
    mpath = path / MANIFEST
    manifest = read_json(mpath, CheckpointError, "not a complete checkpoint",
                         "unreadable manifest")
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
    if sha256_file(f) != meta["sha256"]:
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
    if f.stat().st_size != rec["bytes"] or sha256_file(f) != rec["sha256"]:
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


def part_intact(path: Path, name: str, rec: dict) -> bool:
    """Whether node part ``name`` (its index record ``rec``) and all its files are in ``path``
    and match their digests (the in-memory checkpoints' recovery ladder asks each node)."""
    try:
        _check_part(path, name, rec)
    except (CheckpointError, OSError, ValueError):
        return False
    return True


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
                if tensor_crc(sf.get_tensor(p["key"])) != p["crc32"]:
                    return f"; tensor {p['kind']} {p['name']}"
            for key, crc in meta.get("rank_tensors", {}).items():
                if tensor_crc(sf.get_tensor(key)) != crc:
                    return f"; tensor {key}"
    except Exception:
        return ""
    return ""


# --------------------------------------------------------------------------------------------
# Every node its own directory
# --------------------------------------------------------------------------------------------
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
    index = _shared_index(path, rank, group)
    if index["format_version"] == 2:  # written before node parts: one shared directory
        return path, {n: path / n for n in verify_checkpoint(path)["files"]}
    parts = index["parts"]
    holders = _holders(path, parts, rank, group)
    received = _exchange(path, parts, holders, rank, group)
    mine = group.node_of[rank]
    local = {f for name, rec in parts.items() if mine in holders[name] for f in rec["files"]}
    return path, {n: _inside(path, n) if n in local else received[n]
                  for n in sorted(index["files"])}


def _shared_index(path: Path, rank: int, group: NodeGroup) -> dict[str, Any]:
    """Rank 0's index of ``path``, on every rank; every rank raises rank 0's error."""
    index, err = None, None
    if rank == 0:
        try:
            index = _read_index(path)
        except CheckpointError as e:
            err = str(e)
    index, err = group.broadcast((index, err))
    if err:
        raise CheckpointError(err)
    return index


def _holders(path: Path, parts: dict[str, dict], rank: int, group: NodeGroup
             ) -> dict[str, list[int]]:
    """Part name -> the nodes holding it intact, ascending, the same on every rank. A damaged
    part raises (its leader's message), and so does a part that no node holds."""
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
    return holders


def _exchange(path: Path, parts: dict[str, dict], holders: dict[str, list[int]], rank: int,
              group: NodeGroup) -> dict[str, bytes]:
    """The bytes of every part (and its files) this rank's node lacks, sent by the first node
    holding it and checked against the digests on arrival; {} when every node holds all."""
    mine, all_nodes = group.node_of[rank], group.nodes
    received: dict[str, bytes] = {}
    if all(holders[n] == all_nodes for n in parts):
        return received
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
    return received


@dataclass
class Piece:
    """Part of one logical tensor held by a rank, as a checkpoint stores it
    (``threefold.weights.checkpoint``): a run of elements of its tensor-parallel slice. The engines
    make them (``threefold.parallel``); they sit here, below both."""

    name: str                 # HF parameter name
    kind: str                 # "model", "exp_avg" or "exp_avg_sq"
    data: torch.Tensor        # 1-D: elements [start, end) of the tp slice, flattened
    start: int
    end: int
    shape: tuple              # logical (whole) shape
    tp_dim: int | None = None  # dimension split over tensor parallelism, None = not split
    tp_index: int = 0
    tp_count: int = 1
