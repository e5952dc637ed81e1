"""The run's snapshots as its journal records them: the snapshot index (step -> SnapshotEntry: where,
the fingerprint of its state, its manifest's digest, when), the snapshots found damaged and moved
aside (quarantine), and those the index named that were gone from disk. What creates, moves and
deletes the directories is loop.snapshot_store.
"""

from __future__ import annotations

import dataclasses

from verlj.journal import Journal

from ..records import SnapshotEntry, Unindexed, now_iso

QUARANTINE, MISSING = "quarantined", "missing_snapshots"  # meta keys


class SnapshotIndex:
    """The run's snapshot index and what was taken out of it (``ledger.snapshots``)."""

    def __init__(self, journal: Journal):
        self.journal = journal

    def index(self) -> dict[int, SnapshotEntry]:
        """step -> its SnapshotEntry, oldest first."""
        return {step: SnapshotEntry.from_dict(info) for step, info in self.journal.meta.snapshots().items()}

    def add(self, step: int, entry: SnapshotEntry) -> None:
        self.journal.meta.add_snapshot(step, entry.to_dict())

    def remove(self, step: int) -> None:
        self.journal.meta.remove_snapshot(step)

    def quarantined(self) -> list[dict]:
        """Snapshots found damaged and moved aside: Unindexed maps, as stored (with their `path`)."""
        return self.journal.meta.get(QUARANTINE) or []

    def record_quarantine(self, entry: Unindexed) -> None:
        """`entry` (its time: now) after those recorded, which are kept as they were stored."""
        self.journal.meta.set(QUARANTINE, [*self.quarantined(), dataclasses.replace(entry, time=now_iso()).to_dict()])

    def missing(self) -> list[dict]:
        """Snapshots the index named that were not on disk (deleted by hand?), which a resume removed
        from the index: Unindexed maps, as stored (without a `path`)."""
        return self.journal.meta.get(MISSING) or []

    def record_missing(self, entry: Unindexed) -> None:
        """`entry` (its time: now) after those recorded, which are kept as they were stored."""
        self.journal.meta.set(MISSING, [*self.missing(), dataclasses.replace(entry, time=now_iso()).to_dict()])
