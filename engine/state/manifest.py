"""Snapshot manifests: what a snapshot directory must hold, and checking it holds exactly that.

No torch here: `verify`, `inspect` and the recovery's choice of snapshot read manifests quickly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from verlj.journal import unpackb
from verlj.journal.durable import fsync_dir, fsync_file

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


def file_digest(path: Path) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_bytes_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def build_manifest(root: Path) -> dict:
    files = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in sorted(names):
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if rel == MANIFEST:
                continue
            files[rel] = {"size": p.stat().st_size, "blake3": file_digest(p)}
    return {"version": SNAPSHOT_VERSION, "hash": "blake3", "files": dict(sorted(files.items()))}


def check_files(root: Path, files: dict, hash_files: bool = True, res: SnapshotCheck | None = None) -> list[str]:
    """Problems with a manifest's files under root: missing, wrong size or digest, or not listed.
    A snapshot's converted form (RESHARDED, and its temporary) has its own manifest and is skipped."""
    problems = []
    for rel, info in files.items():
        p = root / rel
        if not p.is_file():
            problems.append(f"{rel} is missing")
            continue
        size = p.stat().st_size
        if size != info["size"]:
            problems.append(f"{rel} has {size} bytes, the manifest says {info['size']}")
            continue
        if not hash_files:
            continue
        if res is not None:
            res.bytes_hashed += size
        if file_digest(p) != info["blake3"]:
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
    meta: dict | None = None
    bytes_hashed: int = 0

    @property
    def valid(self) -> bool:
        return not self.problems


def _well_formed(manifest) -> bool:
    """Version, and for every entry a safe relative path, an integer size and a 64-hex digest."""
    if not isinstance(manifest, dict) or manifest.get("version") != SNAPSHOT_VERSION:
        return False
    files = manifest.get("files")
    if not isinstance(files, dict):
        return False
    for rel, info in files.items():
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts or rel == MANIFEST:
            return False
        if not isinstance(info, dict) or set(info) != {"size", "blake3"}:
            return False
        size, digest = info["size"], info["blake3"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return False
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            return False
    return True


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
        manifest = json.loads(raw.decode())
    except ValueError:  # includes UnicodeDecodeError
        manifest = None
    if not _well_formed(manifest):
        res.problems.append(f"{mpath.name} is not a valid manifest")
        return res
    files = manifest["files"]
    res.problems += check_files(res.path, files, hash_files, res)
    if res.problems:
        return res
    res.ok.append(f"All files present and checksum matched ({len(files)} files)" if hash_files else f"All files present ({len(files)} files)")
    try:
        res.meta = json.loads((res.path / META).read_text())
        res.step = int(res.meta["step"])
    except (OSError, ValueError, KeyError, TypeError):
        res.problems.append(f"{META} does not parse")
        return res
    try:
        anchor = unpackb((res.path / ANCHOR).read_bytes())
        res.ok.append(
            f"Dataflow anchor parsed (dataloader index={anchor['sampler']['cursor']}, epoch={anchor['sampler']['epoch']}, "
            f"buffer has {len(anchor['buffer']['samples']['id'])} pending samples)"
        )
    except Exception:  # noqa: BLE001 - any parse failure is the same finding
        res.problems.append(f"{ANCHOR} does not parse")
    return res
