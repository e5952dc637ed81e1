"""The rollout archive: samples of pruned steps, kept as Parquet where people analyse them.

    RUN/rollouts/steps_0000000001-0000000050.parquet   one file per pruning: every sample of those steps
                                                        (schema.table's rollout table, without the fate columns;
                                                        for a run of episodes, with the episode columns)
    RUN/rollouts/.tmp-steps_...                         being written; a kill leaves it (never read; the
                                                        next archive write removes it, verify lists it)

The index is the journal's meta ``archive`` (through the ledger): file, step range, rows, bytes and
BLAKE3 digest of each file. A file is written, fsynced and renamed into place before the journal
transaction that indexes it and prunes its steps' payloads (:func:`pruning.apply`), so a kill at
any moment leaves either the payloads in the journal or an indexed, complete file, never neither.
This module is the only one that names these paths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verlj.journal.durable import publish_file
from verlj.journal.failpoints import failpoint

from ..config import config_from_stored
from ..errors import RunError
from ..rl.vocab import text_decoder
from ..schema import table as samples
from ..schema.events import DropReason, StepEvents
from ..schema.sample import AGENT_TEXT, FAULT_TEXT, STATES_TEXT
from ..state.manifest import file_digest
from .reader import StepReader
from .records import ArchiveEntry

ARCHIVE_DIR = "rollouts"
ROW_GROUP_BYTES = 64 << 20  # in memory, before encoding: bounds the writer's memory, whatever the interval
_FILE = re.compile(r"^steps_(\d{10})-(\d{10})\.parquet$")
_TMP = re.compile(r"^\.tmp-steps_.*")


@dataclass(frozen=True)
class TableShape:
    """The rollout table's optional columns (schema.table.arrow_schema's) for a run's steps: the episode columns where they
    played episodes (rollout.env, or agent programs: rollout.agent), each token's version where they had partial rollouts
    (rollout.partial), the text columns (schema.table.TEXT_COLUMNS) their samples can carry: why a reward function failed a
    sample where a step left samples out for a fault, each episode's model and tool calls for agent programs (`calls`), the
    env's states for episodes (rollout.env; null where its env has no state())."""

    episodes: bool
    partial: bool
    texts: tuple[str, ...]
    calls: bool

    @classmethod
    def of(cls, ledger, first: int, last: int) -> TableShape:
        """Of steps first..last: from the configs in force (Ledger.configs_in) and the steps' drops (payloads not read)."""
        cfgs = [config_from_stored(c) for c in ledger.configs_in(first, last)]
        agents, envs = any(c.rollout.agent for c in cfgs), any(c.rollout.env for c in cfgs)
        faults = any(d.reason is DropReason.FAULT for r in StepReader(ledger.journal).records(first, last, payload=False) for d in StepEvents.of(r).drops)
        ran = {FAULT_TEXT: faults, AGENT_TEXT: agents, STATES_TEXT: envs}
        return cls(agents or envs, any(c.rollout.partial for c in cfgs), tuple(k for k in samples.TEXT_COLUMNS if ran[k]), agents)


def archive_dir(run_dir: Path) -> Path:
    return Path(run_dir) / ARCHIVE_DIR


def file_name(first: int, last: int) -> str:
    return f"steps_{first:010d}-{last:010d}.parquet"


def write(run_dir: Path, ledger, first: int, last: int) -> ArchiveEntry:
    """Archive the samples of steps first..last (their payloads must still be in the journal).
    Returns the index entry for the ledger; the file is durable when this returns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = archive_dir(run_dir)
    out_dir.mkdir(exist_ok=True)
    clean_leftovers(run_dir, ledger)  # of an attempt killed before indexing (we hold the writer's claim)
    name = file_name(first, last)
    tmp = out_dir / f".tmp-{name}"
    rows = 0
    decoder = text_decoder(ledger.config_at(last))
    shape = TableShape.of(ledger, first, last)
    episodes, partial, texts = shape.episodes, shape.partial, shape.texts
    schema = samples.arrow_schema(False, episodes, partial, texts)
    pending: list = []  # steps' tables, written as one row group per ROW_GROUP_BYTES (a row group per step costs ~15%)

    def flush(w) -> None:
        if pending:
            w.write_table(pa.concat_tables(pending))
            pending.clear()

    with pq.ParquetWriter(tmp, schema, **samples.parquet_options(schema)) as w:
        for record in StepReader(ledger.journal).records(first, last):
            if record.pruned:
                continue  # pruned by an earlier retention policy that did not archive
            added = StepEvents.of(record).added
            if added is not None and added.samples is not None:
                cols = samples.step_columns(record.step, added.samples, decoder)
                pending.append(samples.to_arrow(cols, episodes=episodes, partial=partial, texts=texts))
                rows += samples.num_rows(cols)
                if sum(t.nbytes for t in pending) >= ROW_GROUP_BYTES:
                    flush(w)
            failpoint("archive.mid_write")
        flush(w)
    path = out_dir / name
    publish_file(tmp, path, before=ledger.fence)
    return ArchiveEntry(name, first, last, rows, path.stat().st_size, file_digest(path))


class Reader:
    """Rows of archived steps, each file checked against its digest once before use."""

    def __init__(self, run_dir: Path, ledger):
        self.run_dir = Path(run_dir)
        self.entries = ledger.retention.archive_entries()
        self._table: Any = None  # the pyarrow Table of `_entry`'s file
        self._entry: ArchiveEntry | None = None

    def covers(self, step: int) -> ArchiveEntry | None:
        return next((e for e in self.entries if e.covers(step)), None)

    def step_columns(self, step: int) -> dict | None:
        """The columns of `step`'s samples, or None when no archive file holds the step."""
        entry = self.covers(step)
        if entry is None:
            return None
        samples.require_pyarrow(f"step {step}'s samples are in the rollout archive ({ARCHIVE_DIR}/{entry.file}); reading it")
        import pyarrow.compute as pc

        if self._entry is not entry:
            self._table, self._entry = self._load(entry), entry
        return samples.table_columns(self._table.filter(pc.equal(self._table.column("step"), step)))

    def _load(self, entry: ArchiveEntry):
        import pyarrow.parquet as pq

        problem = check_entry(self.run_dir, entry)
        if problem:
            raise RunError(problem)
        return pq.read_table(archive_dir(self.run_dir) / entry.file)


def check_entry(run_dir: Path, entry: ArchiveEntry) -> str | None:
    """A problem with one indexed archive file, or None."""
    path = archive_dir(run_dir) / entry.file
    if not path.is_file():
        return f"archive file {ARCHIVE_DIR}/{entry.file} (steps {entry.first}–{entry.last}) is missing"
    if path.stat().st_size != entry.bytes or file_digest(path) != entry.digest:
        return f"archive file {ARCHIVE_DIR}/{entry.file} (steps {entry.first}–{entry.last}) fails its digest"
    return None


def leftovers(run_dir: Path, entries: list[ArchiveEntry]) -> list[str]:
    """Files in RUN/rollouts a killed archive write left (temporary files, or a complete file that a
    kill kept from being indexed): never read."""
    d = archive_dir(run_dir)
    if not d.is_dir():
        return []
    indexed = {e.file for e in entries}
    return sorted(f"{ARCHIVE_DIR}/{p.name}" for p in d.iterdir() if _TMP.match(p.name) or (_FILE.match(p.name) and p.name not in indexed))


def clean_leftovers(run_dir: Path, ledger) -> list[str]:
    """Remove them (the writer's claim is held; the journal still holds the samples they carry).
    Returns one line per file removed."""
    gone = leftovers(run_dir, ledger.retention.archive_entries())
    if gone:
        ledger.fence()
    for name in gone:
        (Path(run_dir) / name).unlink(missing_ok=True)
    return [f"Removed what an interrupted run left behind: {name}" for name in gone]
