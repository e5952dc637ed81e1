"""Retention as the run's journal records it: the last step whose samples were pruned, and the index
of the rollout archive (RUN/rollouts/*.parquet: loop.archive) that keeps them, written with the prune
in one transaction. What may be pruned is loop.pruning's decision.
"""

from __future__ import annotations

from verlj.journal import Journal

from ..records import ArchiveEntry

ARCHIVE = "archive"  # meta key


class RetentionIndex:
    """The pruned steps and the index of the archive that holds their samples (``ledger.retention``)."""

    def __init__(self, journal: Journal):
        self.journal = journal

    def pruned_through(self) -> int:
        """The last step whose samples retention removed from the journal (0: none)."""
        return self.journal.retention.pruned_through()

    def archive_entries(self) -> list[ArchiveEntry]:
        """The archived samples of pruned steps, oldest first."""
        return [ArchiveEntry.from_dict(e) for e in self.journal.meta.get(ARCHIVE) or []]

    def prune(self, through: int, archived: ArchiveEntry | None = None) -> tuple[int, int]:
        """Remove the samples of steps through `through`, indexing their archive file in the same
        transaction. Returns (steps pruned, bytes freed)."""
        meta = {ARCHIVE: [*(self.journal.meta.get(ARCHIVE) or []), archived.to_dict()]} if archived else None
        return self.journal.retention.prune(through, meta)
