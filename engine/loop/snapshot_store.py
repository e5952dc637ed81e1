"""Where a run's snapshots live, and the only code that creates, renames or deletes them.

    RUN/step_00150/              a published snapshot (in the ledger's index)
    RUN/latest -> step_00150     the newest published snapshot
    RUN/.tmp-step_00200/         being written (never read; removed on resume)
    RUN/.trash-step_00050-PID/   being deleted by rotation (removed on resume)
    RUN/quarantine/step_00200/   found damaged: out of the index, never chosen, never counted by
                                 save_total_limit; kept for a person to look at

Publishing: manifest written and fsynced, the directory renamed into place, the run directory
fsynced, then indexed in the ledger, then `latest` swapped, then rotation. Rotation unindexes
before it deletes, so a half-deleted snapshot is never offered, and deletes only once the copy of
the journal a recovery would read records the unindexing (``Journal.make_durable``: with
journal.local_dir, once it is shipped), so a node lost at any moment never leaves a run whose
journal names only deleted snapshots. Every rename and delete first checks the writer's claim on
the run (``Ledger.fence``): a writer that was taken over touches nothing. Only rank 0 calls the
writers. A resume never deletes a published snapshot: one the index lacks is adopted when its
manifest, step and fingerprint check out against the journal, and quarantined otherwise
(:meth:`SnapshotStore.recover_leftovers`). No torch here.
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

from ..state.manifest import MANIFEST, SnapshotCheck, build_manifest, check_snapshot, fsync_dir, snapshot_name, write_bytes_durable
from .ledger import Ledger

QUARANTINE = "quarantine"
_LEFTOVER = re.compile(r"^(\.tmp-step_\d+|\.trash-step_\d+-\d+|\.latest\.tmp)$")  # never published, or unindexed durably
_SNAPSHOT = re.compile(r"^step_(\d+)$")


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
        self.ledger.fence()
        if final.exists():  # cannot happen after a resume's recover_leftovers; never deleted all the same
            self.quarantine(step, final, "found in the way of a new snapshot of the same step")
        failpoint("snapshot.before_rename")
        os.replace(tmp, final)
        fsync_dir(self.run_dir)
        failpoint("snapshot.before_index")
        self.ledger.index_snapshot(step, _index_entry(final.name, fingerprint, manifest_bytes, time.time()))
        self._point_latest()
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
        old = sorted(index)[:-limit]
        for step in old:
            self.ledger.unindex_snapshot(step)  # unindex first: a half-deleted snapshot is never offered
            failpoint("snapshot.rotate")
        if not old:
            return
        self.ledger.make_durable()  # the copy a recovery reads no longer names them: now they may go
        failpoint("snapshot.before_delete")
        for step in old:
            path = self.run_dir / index[step]["path"]
            if path.exists():
                self._delete(path)
        failpoint("snapshot.rotated")

    def quarantine(self, step: int | None, path: Path, reason: str) -> Path:
        """Move a damaged snapshot out of the index and out of the way; say where it went. `step` None:
        it was not in the index."""
        self.ledger.fence()
        if step is not None and step in self.ledger.snapshots():
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
            self._point_latest()
        return dest

    def _delete(self, path: Path) -> None:
        self.ledger.fence()
        trash = self.run_dir / f".trash-{path.name}-{os.getpid()}"
        os.replace(path, trash)
        shutil.rmtree(trash)

    # ------------------------------------------------------------------ leftovers of killed runs

    def temporaries(self) -> list[str]:
        """Names a killed run left that were never a published snapshot (or were unindexed durably
        before deletion began): temporary and trash directories. Reading only."""
        if not self.run_dir.is_dir():
            return []
        return [p.name for p in sorted(self.run_dir.iterdir()) if _LEFTOVER.match(p.name)]

    def unindexed(self, index: dict[int, dict] | None = None) -> list[str]:
        """Published snapshot directories the index does not know (a kill between publishing and
        indexing; with journal.local_dir, a node lost before the index was shipped). Reading only."""
        if not self.run_dir.is_dir():
            return []
        indexed = {info["path"] for info in (self.ledger.snapshots() if index is None else index).values()}
        return [p.name for p in sorted(self.run_dir.iterdir()) if _SNAPSHOT.match(p.name) and p.is_dir() and p.name not in indexed]

    def leftovers(self, index: dict[int, dict] | None = None) -> list[str]:
        """Everything the next resume sorts out (verify lists these)."""
        return sorted(self.temporaries() + self.unindexed(index))

    def remove_temporaries(self) -> list[str]:
        """Remove the temporaries (the writer's claim is held: nothing else is writing them)."""
        gone = self.temporaries()
        if gone:
            self.ledger.fence()
        for name in gone:
            p = self.run_dir / name
            if p.is_symlink() or p.is_file():
                p.unlink()
            else:
                shutil.rmtree(p)
        if gone:
            fsync_dir(self.run_dir)
        return gone

    def recover_leftovers(self) -> list[str]:
        """A resume's first act on the run directory (rank 0, the claim held): temporaries removed;
        each published snapshot the index lacks adopted into the index when its manifest verifies and
        its step and fingerprint are the journal's, else quarantined. Returns one line per action."""
        lines = [f"Removed what an interrupted run left behind: {name}" for name in self.remove_temporaries()]
        for name in self.unindexed():
            path = self.run_dir / name
            step = int(_SNAPSHOT.match(name).group(1))
            res, problem = check_against_journal(self.ledger, step, path)
            if problem is None:
                self.ledger.fence()
                manifest = (path / MANIFEST).read_bytes()
                self.ledger.index_snapshot(step, _index_entry(name, res.meta["fingerprint"], manifest, res.meta.get("time", time.time())))
                lines.append(f"Adopted {name}: published but not indexed when the run stopped; its manifest, step and fingerprint "
                             "agree with the journal")
                continue
            dest = self.quarantine(None, path, f"published but not indexed, and {problem}")
            lines.append(f"Quarantined {name} to {dest.relative_to(self.run_dir)}: published but not indexed, and {problem}")
        if any(line.startswith("Adopted") for line in lines):
            self._point_latest()
        return lines

    def _point_latest(self) -> None:
        """`latest` -> the newest indexed snapshot (removed when none is left)."""
        index = self.ledger.snapshots()
        latest = self.run_dir / "latest"
        if not index:
            if latest.is_symlink():
                latest.unlink()
            return
        link_tmp = self.run_dir / ".latest.tmp"
        if link_tmp.is_symlink() or link_tmp.exists():
            link_tmp.unlink()
        os.symlink(index[max(index)]["path"], link_tmp)
        os.replace(link_tmp, latest)


def check_against_journal(ledger: Ledger, step: int, path: Path, expected_manifest: str | None = None) -> tuple[SnapshotCheck, str | None]:
    """Whether the snapshot at `path` is the state after `step` as the journal knows it: its manifest
    and files (and the manifest's digest, when the index recorded one), the step its meta names, and
    its fingerprint against the one journaled for that step (a fork's base step, which its journal
    does not hold, against Ledger.base_fingerprint). Returns (the check, the first problem or None)."""
    res = check_snapshot(path, expected_manifest=expected_manifest)
    if not res.valid:
        return res, res.problems[0]
    if res.step != step:
        return res, f"its meta says step {res.step}, its name and the index say {step}"
    want = ledger.fingerprint_at(step)
    if want is None and step == ledger.base_step():
        want = ledger.base_fingerprint()
    if want is None:
        return res, f"step {step} is not in the journal (it ends at step {ledger.last_step()})"
    if res.meta["fingerprint"] != want:
        return res, f"its fingerprint does not match the journal's for step {step}"
    return res, None


def _index_entry(name: str, fingerprint: str, manifest_bytes: bytes, when: float) -> dict:
    return {"path": name, "fingerprint": fingerprint, "manifest": blake3.blake3(manifest_bytes).hexdigest(), "time": when}
