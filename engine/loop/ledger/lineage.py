"""The run's lineage in the journal's meta: its start (or fork, or what-if) and each resume since,
with what each ran on (the library versions, the user modules its config imports, the hardware:
loop.provenance), and what was in force when a step was trained.
"""

from __future__ import annotations

import dataclasses

from verlj.journal import Journal

from ...schema.events import ControlKind
from ..records import LineageEntry, ParentRun, ProducedOn, now_iso, versions_in_force_at
from .identity import VERSIONS, RunIdentity

LINEAGE = "lineage"  # meta key


class Lineage:
    """The run's start, forks and resumes (``ledger.lineage``)."""

    def __init__(self, journal: Journal, identity: RunIdentity):
        self.journal = journal
        self.identity = identity

    def started(self, kind: ControlKind, base_step: int) -> dict:
        """The meta values that begin a new run's lineage (written with its identity: RunIdentity.record_start)."""
        return {LINEAGE: [LineageEntry(kind, base_step, time=now_iso()).to_dict()]}

    def entries(self) -> list[LineageEntry]:
        """start / fork / what-if / resume entries, oldest first (runs from before this entry existed
        start with a resume); a fork's names its parent."""
        entries = [LineageEntry.from_dict(e) for e in self.journal.meta.get(LINEAGE) or []]
        parent = self.identity.parent()
        if parent is not None and not any(e.forked for e in entries):
            entries.insert(0, LineageEntry(ControlKind.FORK, ParentRun.from_dict(parent).step))
        return [dataclasses.replace(e, parent=parent) if e.forked and e.parent is None else e for e in entries]

    def record_resume(self, at_step: int, snapshot_step: int, config_changes: list[str], world_size: int,
                      now: dict[str, str], resume_from: str | None = None) -> list[str]:
        """Record a resume (and the trainer.resume_from it was asked for: one resume's choice, never the
        run's config) with what it runs on, `now` (loop.provenance.produced_on: the library versions, the
        user modules its config imports, the hardware). Returns the versions that changed since the run
        last started, as 'name old → new'."""
        before = self.versions_in_force()
        moved = [f"{k} {before[k]} → {v}" for k, v in now.items() if k in before and before[k] != v]
        entry = LineageEntry(ControlKind.RESUME, at_step, snapshot_step, config_changes, world_size, now_iso(), now,
                             resume_from if resume_from not in (None, "auto") else None, moved or None)
        self.journal.meta.set(LINEAGE, [*(self.journal.meta.get(LINEAGE) or []), entry.to_dict()])
        return moved

    def produced_on(self) -> list[ProducedOn]:
        """What the run's start (after step -1) and each start or resume since ran on (History.produced_on)."""
        return [ProducedOn(-1, self.identity.get(VERSIONS) or {}), *(ProducedOn(e.at_step, e.versions) for e in self.entries() if e.versions)]

    def versions_at(self, step: int) -> dict[str, str]:
        """The versions (and hardware) in force when `step` was trained: those of the last start or resume before it."""
        return versions_in_force_at(self.produced_on(), step)

    def versions_in_force(self) -> dict[str, str]:
        """The library versions of the run's latest start or resume (its identity's, before any resume recorded them)."""
        for entry in reversed(self.entries()):
            if entry.versions:
                return entry.versions
        return self.identity.get(VERSIONS) or {}

    def resume_steps(self) -> list[int]:
        return [e.at_step for e in self.entries() if e.kind is ControlKind.RESUME]
