"""What an LMDB journal gives the shipped layout and takes back from it (:mod:`verlj.journal.segments`):
its shipping to a run directory (its shipper, made here), a consistent cut of it for a segment, the
frames of another copy restored as that copy stored them (a rebuild), a copy of the LMDB file, and
durability as a recovery would read it (its shipper's).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from . import codec
from .durable import fsync_dir, fsync_file
from .errors import JournalError
from .frames import StepFrame, _summary_frame, step_key
from .segment_file import SegmentScan
from .shipper import Shipper

if TYPE_CHECKING:
    from .store import Journal


class Shipping:
    """An open journal's side of shipping (``journal.shipping``)."""

    def __init__(self, journal: Journal, problem: str | None = None):
        """`journal`: the journal this is the part of; `problem`: damage found in the segments it was rebuilt
        from (segments.open_reader: a reader's copy)."""
        self._journal = journal
        self._store = journal.store
        self.problem = problem
        self.shipper: Shipper | None = None  # made by ship_to, when the journal is shipped to a run directory

    def ship_to(self, shipped: Path, max_lag: int, found: SegmentScan | None, retention: bool, fanout: int) -> Shipper:
        """Ship this writer's commits to `shipped`'s segments from now on (segments.open_writer): its shipper made
        (its thread started), woken by every commit and closed, after its last shipment, when the journal
        closes (before the writer's claim is released). `fanout`: compaction's one-shipment fan-in (0: never
        merged), a quarter of it for the levels above; the rest: Shipper's."""
        assert self.shipper is None, "a journal ships to one place"
        self.shipper = Shipper(self._journal, shipped, max_lag, found, self._store.claim, retention,
                               l0_fanout=fanout, fanout=max(2, fanout // 4))
        self._store.add_commit_hook(self.shipper.on_commit)
        self._journal.on_close(self.shipper.close)
        return self.shipper

    def make_durable(self) -> None:
        """Return once every write so far is in the copy a recovery would read: at once for a journal in
        the run directory (each commit is fsynced), after the shipper has shipped it and sealed it with
        a later segment for a shipped one (a recovery drops a damaged last segment: what it carried
        must not be all that made a deletion safe). Call before deleting anything the previous state
        of the journal still needs."""
        if self.shipper is not None:
            self.shipper.flush(sealed=True)

    def read_cut(self, after: int, max_bytes: int) -> tuple[list[bytes], dict[bytes, bytes], dict[bytes, bytes]]:
        """A consistent cut of the journal, read in one transaction: the stored frames of the steps after
        `after` (up to about `max_bytes`, at least one), and the meta and snapshot sub-databases as they
        were at that moment. What one shipped segment carries: its metadata is never older than its steps."""
        frames, size = [], 0
        store = self._store
        with store.read() as txn:
            cur = txn.cursor(store.steps)
            if cur.set_range(step_key(after + 1)):
                for _key, value in cur:
                    frames.append(bytes(value))
                    size += len(value)
                    if size >= max_bytes:
                        break
            meta = {bytes(k): bytes(v) for k, v in txn.cursor(store.meta)}
            snaps = {bytes(k): bytes(v) for k, v in txn.cursor(store.snaps)}
        return frames, meta, snaps

    def restore(self, frames: list[bytes], first: int | None, meta: dict | None = None, snapshots: dict | None = None,
                pruned_through: int = 0) -> None:
        """Write step frames exactly as another copy of this journal stored them, from step `first` on
        (segments.rebuild; the caller has checked their chain), and replace the meta and snapshot
        index when given. Frames of steps through `pruned_through` are written without their payload,
        as retention left them in that copy. One transaction: all or none."""
        summaries: list[bytes | None] = []
        stored: list[bytes] = []
        base = 0 if first is None else first  # None: no frames, only the meta and the index
        for i, raw in enumerate(frames):
            frame = StepFrame.parse(raw)
            if codec.is_core_v3(frame.body):
                step = codec.core_head(frame.body)[1]
                summaries.append(None)  # a v2 frame's core is its summary
            else:
                record = codec.unpackb(frame.body)
                step = record["step"]
                summaries.append(_summary_frame(step, record["time"], record["events"]) if frame.version == 1 else None)
            if step != base + i:
                raise JournalError(f"record to restore at step {base + i} says it is step {step}")
            stored.append(frame.without_payload() if base + i <= pruned_through and frame.payload_len else raw)
        store = self._store

        def txn_fn(txn):
            for i, raw in enumerate(stored):
                txn.put(step_key(base + i), raw, db=store.steps, append=True)
                if summaries[i] is not None:
                    txn.put(step_key(base + i), summaries[i], db=store.summary, append=True)
            for db, values in ((store.meta, meta), (store.snaps, snapshots)):
                if values is not None:
                    txn.drop(db, delete=False)
                    for k, v in sorted(values.items()):
                        txn.put(bytes(k), bytes(v), db=db)

        store.write(txn_fn)
        store.forget_shapes()  # the meta may have been replaced

    def copy_to(self, dest: str | os.PathLike) -> None:
        """A consistent copy of this journal's LMDB file into the empty directory `dest` (fsynced)."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        self._store.copy(dest)
        fsync_file(dest / "data.mdb")
        fsync_dir(dest)
