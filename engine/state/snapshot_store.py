"""Where a run's snapshots live, and the only code that creates, renames or deletes them.

    RUN/step_00150/              a published snapshot (in the ledger's index)
    RUN/latest -> step_00150     the newest published snapshot
    RUN/.tmp-step_00200/         being written (never read; removed on resume)
    RUN/.trash-step_00050-PID/   being deleted by rotation (removed on resume)
    RUN/quarantine/step_00200/   found damaged: out of the index, never chosen, never counted by
                                 save_total_limit; kept for a person to look at

Publishing: manifest written and fsynced, the directory renamed into place, the run directory
fsynced, then indexed in the ledger, then `latest` swapped, then rotation. Rotation unindexes
before it deletes, so a half-deleted snapshot is never offered. Only rank 0 calls the writers.
No torch here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import blake3

from verlj.journal.failpoints import failpoint

from .ledger import Ledger
from .manifest import MANIFEST, build_manifest, fsync_dir, snapshot_name, write_bytes_durable

QUARANTINE = "quarantine"
_LEFTOVER = re.compile(r"^(\.tmp-step_\d+|\.trash-step_\d+-\d+|\.latest\.tmp)$")
_SNAPSHOT = re.compile(r"^step_\d+$")


class SnapshotStore:
    def __init__(self, run_dir: Path, ledger: Ledger | None):
        self.run_dir = Path(run_dir)
        self.ledger = ledger

    def tmp_dir(self, step: int) -> Path:
        return self.run_dir / f".tmp-{snapshot_name(step)}"

    # ------------------------------------------------------------------ publishing (rank 0)

    def publish(self, step: int, fingerprint: str, tmp: Path) -> Path:
        manifest_bytes = json.dumps(build_manifest(tmp), indent=1).encode()
        write_bytes_durable(tmp / MANIFEST, manifest_bytes)
        fsync_dir(tmp)
        final = self.run_dir / snapshot_name(step)
        if final.exists():  # a leftover of an earlier attempt at this step: replace it
            self._delete(final)
        failpoint("snapshot.before_rename")
        os.replace(tmp, final)
        fsync_dir(self.run_dir)
        failpoint("snapshot.before_index")
        self.ledger.index_snapshot(step, {"path": final.name, "fingerprint": fingerprint,
                                          "manifest": blake3.blake3(manifest_bytes).hexdigest(), "time": time.time()})
        link_tmp = self.run_dir / ".latest.tmp"
        if link_tmp.is_symlink() or link_tmp.exists():
            link_tmp.unlink()
        os.symlink(final.name, link_tmp)
        os.replace(link_tmp, self.run_dir / "latest")
        return final

    @staticmethod
    def publish_standalone(tmp: Path, out_dir: Path) -> None:
        """A snapshot outside any run (`replay --snapshot`): manifest, rename, fsync; no index."""
        write_bytes_durable(tmp / MANIFEST, json.dumps(build_manifest(tmp), indent=1).encode())
        os.replace(tmp, out_dir)
        fsync_dir(out_dir.parent)

    def rotate(self, limit: int) -> None:
        """Keep the newest `limit` indexed snapshots (quarantined ones are not indexed: not counted)."""
        if limit <= 0:
            return
        index = self.ledger.snapshots()
        for step in sorted(index)[:-limit]:
            self.ledger.unindex_snapshot(step)  # unindex first: a half-deleted snapshot is never offered
            failpoint("snapshot.rotate")
            path = self.run_dir / index[step]["path"]
            if path.exists():
                self._delete(path)

    def quarantine(self, step: int, path: Path, reason: str) -> Path:
        """Move a damaged snapshot out of the index and out of the way; say where it went."""
        self.ledger.unindex_snapshot(step)
        dest_dir = self.run_dir / QUARANTINE
        dest_dir.mkdir(exist_ok=True)
        dest = dest_dir / path.name
        if dest.exists():
            dest = dest_dir / f"{path.name}-{int(time.time())}"
        if path.exists():
            os.replace(path, dest)
            fsync_dir(self.run_dir)
        self.ledger.record_quarantine({"name": path.name, "step": step, "reason": reason, "path": str(dest.relative_to(self.run_dir))})
        latest = self.run_dir / "latest"
        if latest.is_symlink() and os.readlink(latest) == path.name:
            index = self.ledger.snapshots()
            latest.unlink()
            if index:
                os.symlink(index[max(index)]["path"], latest)
        return dest

    def _delete(self, path: Path) -> None:
        trash = self.run_dir / f".trash-{path.name}-{os.getpid()}"
        os.replace(path, trash)
        shutil.rmtree(trash)

    # ------------------------------------------------------------------ leftovers of killed runs

    def leftovers(self, index: dict[int, dict] | None = None) -> list[str]:
        """Names in the run directory that a killed run left behind: temporary and trash
        directories, and published snapshots the index does not know (killed before indexing, or
        during rotation). Reading only."""
        if not self.run_dir.is_dir():
            return []
        indexed = {info["path"] for info in (self.ledger.snapshots() if index is None else index).values()}
        out = []
        for p in sorted(self.run_dir.iterdir()):
            if _LEFTOVER.match(p.name) or (_SNAPSHOT.match(p.name) and p.is_dir() and p.name not in indexed):
                out.append(p.name)
        return out

    def clean_leftovers(self, index: dict[int, dict] | None = None) -> list[str]:
        """Remove the leftovers (the writer lock is held: nothing else is writing them)."""
        gone = self.leftovers(index)
        for name in gone:
            p = self.run_dir / name
            if p.is_symlink() or p.is_file():
                p.unlink()
            else:
                shutil.rmtree(p)
        if gone:
            fsync_dir(self.run_dir)
        return gone
