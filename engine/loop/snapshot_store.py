"""Where a run's snapshots live, and the only code that creates, renames or deletes them.

    RUN/step_00150/              a published snapshot (in the ledger's index)
    RUN/latest -> step_00150     the newest published snapshot
    RUN/.tmp-step_00200/         being written (never read; removed on resume)
    RUN/.trash-step_00050-PID/   being deleted by rotation (removed on resume)
    RUN/quarantine/step_00200/   found damaged: out of the index, never chosen, never counted by
                                 save_total_limit; kept for a person to look at
    (an index entry, no dir)     missing (deleted by hand?): never counted, rotated or pruned against;
                                 the next resume removes it from the index and the ledger records it

Publishing: manifest written and fsynced, the directory renamed into place, the run directory
fsynced, then indexed in the ledger, then `latest` swapped, then rotation. Rotation unindexes
before it deletes, so a half-deleted snapshot is never offered, and deletes only once the copy of
the journal a recovery would read records the unindexing (``journal.shipping.make_durable``: with
journal.local_dir, once it is shipped), so a node lost at any moment never leaves a run whose
journal names only deleted snapshots. Every rename and delete first checks the writer's claim on
the run (``Ledger.fence``): a writer that was taken over touches nothing. Only rank 0 calls the
writers. A resume never deletes a published snapshot: one the index lacks is adopted when its
manifest, step and fingerprint check out against the journal, and quarantined otherwise; one the
index names that is not on disk leaves the index. What a resume does with each of these is decided
by one function, :meth:`SnapshotStore.plan_leftovers`: `verify` prints its plan, a resume carries it
out (:meth:`SnapshotStore.recover_leftovers`). Rotation and retention count only the snapshots that
:meth:`SnapshotStore.sound` finds on disk and whole. No torch here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3

from verlj.journal.durable import fsync_dir, write_synced
from verlj.journal.failpoints import failpoint

from ..state.manifest import MANIFEST, SnapshotCheck, build_manifest, check_snapshot, snapshot_name
from .ledger import Ledger
from .records import SnapshotEntry, Unindexed

QUARANTINE = "quarantine"
_LEFTOVER = re.compile(r"^(\.tmp-step_\d+|\.trash-step_\d+-\d+|\.latest\.tmp)$")  # never published, or unindexed durably
_SNAPSHOT = re.compile(r"^step_(\d+)$")

# what the next resume does with a leftover (SnapshotStore.plan_leftovers)
REMOVE, ADOPT, QUARANTINE, UNINDEX, KEEP = "remove", "adopt", "quarantine", "unindex", "keep"


@dataclass
class Leftover:
    """One thing in the run directory that is not an indexed snapshot on disk, and what the next
    resume does with it: `plan` is how verify says it beforehand, `done` how the resume says it did it.
    Never stored: `to_dict` is verify's JSON of it, with its plan in words (not a record of the codec's)."""

    name: str  # in the run directory (UNINDEX: the index's path, not on disk)
    action: str  # REMOVE | ADOPT | QUARANTINE | UNINDEX | KEEP
    step: int | None
    reason: str
    entry: SnapshotEntry | None = None  # ADOPT: its index entry
    moved_to: str | None = None  # QUARANTINE, once done: where it went

    @property
    def warning(self) -> bool:
        return self.action == UNINDEX

    @property
    def plan(self) -> str:
        return {
            REMOVE: f"{self.name}: {self.reason}, and the next --resume removes it",
            ADOPT: f"{self.name}: published but not in the index (the run stopped before indexing it); {self.reason}: "
                   "the next --resume adopts it into the index",
            QUARANTINE: f"{self.name}: published but not in the index, and {self.reason}: the next --resume quarantines it "
                        f"(moves it to {QUARANTINE}/)",
            UNINDEX: f"{self.name} is {self.reason}: the next --resume removes it from the index; it is never counted, "
                     "rotated against or pruned against",
            KEEP: f"{self.name}: kept as it is: {self.reason}",
        }[self.action]

    @property
    def done(self) -> str:
        return {
            REMOVE: f"Removed what an interrupted run left behind: {self.name}",
            ADOPT: f"Adopted {self.name}: published but not indexed when the run stopped; {self.reason}",
            QUARANTINE: f"Quarantined {self.name} to {self.moved_to}: published but not indexed, and {self.reason}",
            UNINDEX: f"{self.name} is {self.reason}: removed from the index",
            KEEP: f"Kept {self.name} as it is: {self.reason}",
        }[self.action]

    def to_dict(self) -> dict:
        return {"name": self.name, "action": self.action, "step": self.step, "reason": self.reason, "plan": self.plan}


class SnapshotStore:
    def __init__(self, run_dir: Path, ledger: Ledger | None):
        self.run_dir = Path(run_dir)
        self.ledger = ledger

    @property
    def main_ledger(self) -> Ledger:
        """The run's ledger: rank 0's, the one rank whose store publishes, rotates, adopts and quarantines."""
        assert self.ledger is not None, "the ledger is rank 0's"
        return self.ledger

    def tmp_dir(self, step: int) -> Path:
        return self.run_dir / f".tmp-{snapshot_name(step)}"

    # ------------------------------------------------------------------ publishing (rank 0)

    def publish(self, step: int, fingerprint: str, tmp: Path) -> Path:
        manifest_bytes = json.dumps(build_manifest(tmp), indent=1).encode()
        write_synced(tmp / MANIFEST, manifest_bytes)
        fsync_dir(tmp)
        final = self.run_dir / snapshot_name(step)
        self.main_ledger.fence()
        if final.exists():  # cannot happen after a resume's recover_leftovers; never deleted all the same
            self.quarantine(step, final, "found in the way of a new snapshot of the same step")
        failpoint("snapshot.before_rename")
        os.replace(tmp, final)
        fsync_dir(self.run_dir)
        failpoint("snapshot.before_index")
        self.main_ledger.snapshots.add(step, _index_entry(final.name, fingerprint, manifest_bytes, time.time()))
        self._point_latest()
        return final

    @staticmethod
    def publish_standalone(tmp: Path, out_dir: Path) -> None:
        """A snapshot outside any run (`replay --snapshot`): manifest, rename, fsync; no index."""
        write_synced(tmp / MANIFEST, json.dumps(build_manifest(tmp), indent=1).encode())
        os.replace(tmp, out_dir)
        fsync_dir(out_dir.parent)

    def rotate(self, limit: int) -> None:
        """Keep the newest `limit` sound snapshots. Only what is on disk and whole is counted: a
        quarantined one (out of the index), one missing from disk (deleted by hand) or one that fails
        the cheap check is neither counted nor deleted, so the good older ones stay (the next resume
        unindexes the missing, and its choice of snapshot quarantines the damaged)."""
        if limit <= 0:
            return
        index = self.main_ledger.snapshots.index()
        old = list(self.sound(index))[:-limit]
        for step in old:
            self.main_ledger.snapshots.remove(step)  # unindex first: a half-deleted snapshot is never offered
            failpoint("snapshot.rotate")
        if not old:
            return
        self.main_ledger.make_durable()  # the copy a recovery reads no longer names them: now they may go
        failpoint("snapshot.before_delete")
        for step in old:
            path = self.run_dir / index[step].path
            if path.exists():
                self._delete(path)
        failpoint("snapshot.rotated")

    def sound(self, index: dict[int, SnapshotEntry] | None = None) -> Iterator[int]:
        """The indexed steps whose snapshot is on disk and whole by the check rotation and retention
        make at every snapshot (they count, rotate and prune against these only), oldest first, each
        checked as it is asked for (retention asks for the oldest only).

        The check is the cheap one: the directory exists; its manifest is the one the index recorded
        (BLAKE3 of a few KiB); every file it lists is there with its size, and nothing else; meta and
        anchor parse; step and fingerprint are the journal's. No weight file is hashed: that would read
        every kept snapshot in full at every save. A flipped bit inside a file is left to the full
        check a resume makes of the snapshot it picks (it falls back to an older one, which this keeps)."""
        index = self.main_ledger.snapshots.index() if index is None else index
        for step, entry in sorted(index.items()):
            if check_against_journal(self.main_ledger, step, self.run_dir / entry.path, entry.manifest, hash_files=False)[1] is None:
                yield step

    def quarantine(self, step: int | None, path: Path, reason: str) -> Path:
        """Move a damaged snapshot out of the index and out of the way; say where it went. `step` None:
        it was not in the index."""
        self.main_ledger.fence()
        if step is not None and step in self.main_ledger.snapshots.index():
            self.main_ledger.snapshots.remove(step)
        dest_dir = self.run_dir / QUARANTINE
        dest_dir.mkdir(exist_ok=True)
        dest = dest_dir / path.name
        if dest.exists():
            dest = dest_dir / f"{path.name}-{int(time.time())}"
        if path.exists():
            os.replace(path, dest)
            fsync_dir(self.run_dir)
        self.main_ledger.snapshots.record_quarantine(Unindexed(path.name, step, reason, str(dest.relative_to(self.run_dir))))
        latest = self.run_dir / "latest"
        if latest.is_symlink() and os.readlink(latest) == path.name:
            self._point_latest()
        return dest

    def _delete(self, path: Path) -> None:
        self.main_ledger.fence()
        trash = self.run_dir / f".trash-{path.name}-{os.getpid()}"
        os.replace(path, trash)
        shutil.rmtree(trash)

    # ------------------------------------------------------------------ leftovers of killed runs and of hands

    def temporaries(self) -> list[str]:
        """Names a killed run left that were never a published snapshot (or were unindexed durably
        before deletion began): temporary and trash directories. Reading only."""
        if not self.run_dir.is_dir():
            return []
        return [p.name for p in sorted(self.run_dir.iterdir()) if _LEFTOVER.match(p.name)]

    def unindexed(self, index: dict[int, SnapshotEntry] | None = None) -> list[str]:
        """Published snapshot directories the index does not know (a kill between publishing and
        indexing; with journal.local_dir, a node lost before the index was shipped). Reading only."""
        if not self.run_dir.is_dir():
            return []
        indexed = {entry.path for entry in (self.main_ledger.snapshots.index() if index is None else _entries(index)).values()}
        return [p.name for p in sorted(self.run_dir.iterdir()) if _SNAPSHOT.match(p.name) and p.is_dir() and p.name not in indexed]

    def plan_leftovers(self, index: dict[int, SnapshotEntry] | None = None, refused: str | None = None) -> list[Leftover]:
        """What the next resume does, before it chooses a snapshot, with each thing in the run
        directory that is not an indexed snapshot on disk: the one classification `verify` prints and
        :meth:`recover_leftovers` carries out. Reading only (adoption checks hash the snapshot).

        `refused`: why a resume would refuse this run before touching anything (a damaged or
        unreadable journal); every leftover is then kept as it is. An unreadable index is given as {}:
        every published snapshot is then listed, kept as it is."""
        plan: list[Leftover] = []
        if index is None:
            index = self.ledger.snapshots.index() if self.ledger is not None else {}
        index = _entries(index)
        if refused is not None:
            return [Leftover(name, KEEP, _step_of(name), refused) for name in self.temporaries() + self.unindexed(index)]
        plan += [Leftover(name, REMOVE, None, "left by an interrupted run; never used") for name in self.temporaries()]
        for name in self.unindexed(index):
            step = _step_of(name)
            assert step is not None  # an unindexed snapshot's name is step_N
            res, problem = check_against_journal(self.main_ledger, step, self.run_dir / name)
            if problem is None:
                assert res.snapshot is not None  # it checked out
                when = res.snapshot.time if res.snapshot.time is not None else time.time()
                entry = _index_entry(name, res.snapshot.fingerprint, (self.run_dir / name / MANIFEST).read_bytes(), when)
                plan.append(Leftover(name, ADOPT, step, "its manifest, step and fingerprint agree with the journal", entry))
            else:
                plan.append(Leftover(name, QUARANTINE, step, problem))
        for step, entry in sorted(index.items()):
            if not (self.run_dir / entry.path).exists():
                plan.append(Leftover(entry.path, UNINDEX, step, "in the index but not on disk (deleted by hand?)"))
        return plan

    def recover_leftovers(self) -> list[Leftover]:
        """A resume's first act on the run directory (rank 0, the claim held, the journal checked):
        carry out :meth:`plan_leftovers`. Temporaries removed; each published snapshot the index lacks
        adopted into the index when its manifest verifies and its step and fingerprint are the
        journal's, else quarantined; each indexed one missing from disk unindexed and recorded
        (ledger.snapshots.missing). Returns what was done (Leftover.done says it)."""
        plan = self.plan_leftovers()
        if plan:
            self.main_ledger.fence()
        for item in plan:
            path = self.run_dir / item.name
            if item.action == REMOVE:
                if path.is_symlink() or path.is_file():
                    path.unlink()
                else:
                    shutil.rmtree(path)
            elif item.action == ADOPT:
                assert item.step is not None and item.entry is not None  # an adopted snapshot's
                self.main_ledger.snapshots.add(item.step, item.entry)
            elif item.action == QUARANTINE:
                item.moved_to = str(self.quarantine(None, path, f"published but not indexed, and {item.reason}").relative_to(self.run_dir))
            elif item.action == UNINDEX:
                # recorded before it leaves the index: a kill in between records it twice, never loses it
                assert item.step is not None  # an index entry's
                self.main_ledger.snapshots.record_missing(Unindexed(item.name, item.step, item.reason))
                self.main_ledger.snapshots.remove(item.step)
        if any(item.action == REMOVE for item in plan):
            fsync_dir(self.run_dir)
        if any(item.action in (ADOPT, UNINDEX) for item in plan):
            self._point_latest()
        return plan

    def _point_latest(self) -> None:
        """`latest` -> the newest indexed snapshot (removed when none is left). A run directory copied
        by a copy that follows links (`cp -rL`, some sync tools) holds `latest` (or a leftover
        `.latest.tmp`) as a directory: a second copy of a snapshot that stays in its own step_N
        directory, never read through `latest`; it is removed so that the link can take its place."""
        index = self.main_ledger.snapshots.index()
        latest = self.run_dir / "latest"
        if not latest.is_symlink() and latest.is_dir():
            shutil.rmtree(latest)
        if not index:
            if latest.is_symlink():
                latest.unlink()
            return
        link_tmp = self.run_dir / ".latest.tmp"
        if not link_tmp.is_symlink() and link_tmp.is_dir():
            shutil.rmtree(link_tmp)
        elif link_tmp.is_symlink() or link_tmp.exists():
            link_tmp.unlink()
        os.symlink(index[max(index)].path, link_tmp)
        os.replace(link_tmp, latest)


def check_against_journal(ledger: Ledger, step: int, path: Path, expected_manifest: str | None = None,
                          hash_files: bool = True) -> tuple[SnapshotCheck, str | None]:
    """Whether the snapshot at `path` is the state after `step` as the journal knows it: its manifest
    and files (and the manifest's digest, when the index recorded one), the step its meta names, and
    its fingerprint against the one journaled for that step (a fork's base step, which its journal
    does not hold, against ledger.identity.base_fingerprint). hash_files=False: file sizes only (SnapshotStore.sound).
    Returns (the check, the first problem or None)."""
    res = check_snapshot(path, hash_files=hash_files, expected_manifest=expected_manifest)
    if not res.valid:
        return res, res.problems[0]
    if res.step != step:
        return res, f"its meta says step {res.step}, its name and the index say {step}"
    want = ledger.fingerprint_at(step)
    if want is None and step == ledger.base_step():
        want = ledger.identity.base_fingerprint()
    if want is None:
        return res, f"step {step} is not in the journal (it ends at step {ledger.last_step()})"
    assert res.snapshot is not None  # a valid snapshot's meta parsed
    if res.snapshot.fingerprint != want:
        return res, f"its fingerprint does not match the journal's for step {step}"
    return res, None


def _entries(index: dict[int, SnapshotEntry] | dict[int, dict]) -> dict[int, SnapshotEntry]:
    # the ledger's snapshots() maps, as post-mortem readers not yet on snapshot_index() pass them
    return {step: e if isinstance(e, SnapshotEntry) else SnapshotEntry.from_dict(e) for step, e in index.items()}


def _step_of(name: str) -> int | None:
    m = _SNAPSHOT.match(name)
    return int(m.group(1)) if m else None


def _index_entry(name: str, fingerprint: str | None, manifest_bytes: bytes, when: float) -> SnapshotEntry:
    return SnapshotEntry(name, fingerprint, blake3.blake3(manifest_bytes).hexdigest(), when)
