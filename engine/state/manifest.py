"""Snapshot manifests: what a snapshot directory must hold, and checking it holds exactly that.

No torch here: `verify`, `inspect` and the recovery's choice of snapshot read manifests quickly.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path

import blake3

from verlj.journal import unpackb
from verlj.journal.durable import fsync_dir, fsync_file

from ..schema.record import Record
from .topology import Topology

MANIFEST = "manifest.json"
META = "meta.json"
ANCHOR = "dataflow_anchor.msgpack"
SNAPSHOT_VERSION = 1
RESHARDED = "universal"  # a snapshot's converted form for other topologies (state.reshard), checked by its own manifest
HASH_CHUNK = 4 << 20


def snapshot_name(step: int) -> str:
    return f"step_{step:05d}"


# ----------------------------------------------------------------------------- files


def fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            fsync_file(Path(dirpath) / f)
        fsync_dir(Path(dirpath))


_HASH_BUF = memoryview(bytearray(HASH_CHUNK))
_HASH_LOCK = threading.Lock()


def file_digest(path: Path) -> str:
    """The BLAKE3 digest (hex) of a file's bytes: a snapshot's files, an archive's, an export's, a model's."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with _HASH_LOCK, open(path, "rb", buffering=0) as f:
        while n := f.readinto(_HASH_BUF):
            h.update(_HASH_BUF[:n])
    return h.hexdigest()


# ----------------------------------------------------------------------------- manifest.json and meta.json


@dataclass(frozen=True)
class FileEntry(Record):
    """One file a manifest lists: its size and BLAKE3 digest."""

    size: int
    blake3: str

    def well_formed(self) -> bool:
        """An integer size and a 64-hex digest."""
        size, digest = self.size, self.blake3
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return False
        return isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)


@dataclass(frozen=True)
class Manifest(Record):
    """manifest.json: every file of a snapshot (its path relative to the snapshot, sorted) with its entry."""

    version: int
    hash: str = "blake3"
    files: dict[str, FileEntry] = field(default_factory=dict)

    @classmethod
    def of(cls, root: Path) -> Manifest:
        """The manifest of the files under `root` now (manifest.json itself excepted)."""
        files = {}
        for dirpath, _dirs, names in os.walk(root):
            for name in sorted(names):
                p = Path(dirpath) / name
                rel = p.relative_to(root).as_posix()
                if rel == MANIFEST:
                    continue
                files[rel] = FileEntry(p.stat().st_size, file_digest(p))
        return cls(SNAPSHOT_VERSION, files=dict(sorted(files.items())))

    @classmethod
    def parse(cls, data) -> Manifest | None:
        """A parsed manifest.json, or None unless it is well formed: this version, and for every entry a
        safe relative path, an integer size and a 64-hex digest (and nothing else)."""
        if not isinstance(data, dict) or not {"version", "files"} <= data.keys():  # hash: blake3 unless said
            return None
        raw = cls(**{k: v for k, v in data.items() if k in _MANIFEST_KEYS})  # the values as written, none made an int
        if raw.version != SNAPSHOT_VERSION or not isinstance(raw.files, dict):
            return None
        for rel, info in raw.files.items():
            parts = Path(rel).parts
            if not rel or Path(rel).is_absolute() or ".." in parts or rel == MANIFEST:
                return None
            if not isinstance(info, dict) or set(info) != _FILE_KEYS or not FileEntry(**info).well_formed():
                return None
        return cls.from_dict(data)


_MANIFEST_KEYS = {f.name for f in fields(Manifest)}
_FILE_KEYS = {f.name for f in fields(FileEntry)}


@dataclass(frozen=True)
class SnapshotMeta(Record):
    """meta.json: the snapshot's step, fingerprint, config hash, DeepSpeed engines, topology, when it
    was written and the Python that wrote it (snapshots from before a field: its default)."""

    version: int = field(default=SNAPSHOT_VERSION, kw_only=True)
    step: int
    fingerprint: str | None = None
    config_hash: str | None = None
    engines: list[str] = field(default_factory=list)  # the DeepSpeed engines' tags (actor, critic)
    world_size: int = 1
    tensor_parallel_size: int = 1
    zero_stage: int = 0
    time: float | None = None
    python: str | None = None

    @property
    def topology(self) -> Topology:
        return Topology(self.world_size, self.tensor_parallel_size, self.zero_stage)

    @classmethod
    def read(cls, path: Path) -> SnapshotMeta:
        """The meta.json of the snapshot at `path`."""
        return cls.from_dict(json.loads((Path(path) / META).read_text()))

# dataflow_anchor.msgpack: {part name: its state_dict()} (loop.checkpointer's registry); the parts it summarises
SAMPLER_PART, BUFFER_PART = "sampler", "buffer"


def anchor_summary(anchor: dict) -> str:
    """What a parsed anchor says of the data flow (KeyError, TypeError: it is not an anchor)."""
    sampler, buffer = anchor[SAMPLER_PART], anchor[BUFFER_PART]
    return (f"Dataflow anchor parsed (dataloader index={sampler['cursor']}, epoch={sampler['epoch']}, "
            f"buffer has {len(buffer['samples']['id'])} pending samples)")


def build_manifest(root: Path) -> dict:
    """manifest.json's map for the files under `root` (Manifest.of)."""
    return Manifest.of(root).to_dict()


def check_files(root: Path, files: dict, hash_files: bool = True, res: SnapshotCheck | None = None) -> list[str]:
    """Problems with a manifest's files under root (`files`: the manifest's, as parsed or as stored):
    missing, wrong size or digest, or not listed. A snapshot's converted form (RESHARDED, and its
    temporary) has its own manifest and is skipped."""
    problems = []
    for rel, info in files.items():
        entry = info if isinstance(info, FileEntry) else FileEntry(**info)
        p = root / rel
        if not p.is_file():
            problems.append(f"{rel} is missing")
            continue
        size = p.stat().st_size
        if size != entry.size:
            problems.append(f"{rel} has {size} bytes, the manifest says {entry.size}")
            continue
        if not hash_files:
            continue
        if res is not None:
            res.bytes_hashed += size
        if file_digest(p) != entry.blake3:
            problems.append(f"{rel} fails its checksum")
    skip = (RESHARDED, f".tmp-{RESHARDED}")
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} - {MANIFEST}
    for extra in sorted(on_disk - set(files)):
        if root.joinpath(extra).relative_to(root).parts[0] not in skip:
            problems.append(f"{extra} is not in the manifest")
    return problems


@dataclass
class SnapshotCheck:
    """The outcome of checking one snapshot: what passed, what did not."""

    path: Path
    step: int | None = None
    ok: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    meta: dict | None = None  # meta.json as it parsed (the post-mortem readers show it)
    snapshot: SnapshotMeta | None = None  # the same, read (None: it does not parse)
    bytes_hashed: int = 0

    @property
    def valid(self) -> bool:
        return not self.problems


def check_snapshot(path: Path, hash_files: bool = True, expected_manifest: str | None = None) -> SnapshotCheck:
    """Manifest present, well formed (and matching the digest the journal recorded for it, when
    given); every file present with its size and digest; meta and anchor parse.
    hash_files=False checks presence and sizes only (for a quick listing)."""
    res = SnapshotCheck(Path(path))
    mpath = res.path / MANIFEST
    if not res.path.is_dir():
        res.problems.append(f"snapshot directory {res.path} does not exist")
        return res
    if not mpath.is_file():
        res.problems.append(f"{mpath.name} is missing")
        return res
    raw = mpath.read_bytes()
    if expected_manifest is not None and blake3.blake3(raw).hexdigest() != expected_manifest:
        res.problems.append(f"{mpath.name} does not match the digest the journal recorded for it")
        return res
    try:
        manifest = Manifest.parse(json.loads(raw.decode()))
    except ValueError:  # includes UnicodeDecodeError
        manifest = None
    if manifest is None:
        res.problems.append(f"{mpath.name} is not a valid manifest")
        return res
    files = manifest.files
    res.problems += check_files(res.path, files, hash_files, res)
    if res.problems:
        return res
    res.ok.append(f"All files present and checksum matched ({len(files)} files)" if hash_files else f"All files present ({len(files)} files)")
    try:
        res.meta = json.loads((res.path / META).read_text())
        res.snapshot = SnapshotMeta.from_dict(res.meta)
        res.step = int(res.snapshot.step)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        res.snapshot = None
        res.problems.append(f"{META} does not parse")
        return res
    try:
        res.ok.append(anchor_summary(unpackb((res.path / ANCHOR).read_bytes())))
    except Exception:  # noqa: BLE001 - any parse failure is the same finding
        res.problems.append(f"{ANCHOR} does not parse")
    return res
