"""The shipper: a background thread that copies each commit of a node-local LMDB journal into the run
directory as a sealed segment (see :mod:`verlj.journal.segments`), and compacts the segments.

Compaction (:meth:`Shipper.compact_once`, in the shipper's thread: one job after each segment it
ships, the rest while it has nothing to ship) keeps the file count bounded (the rule: :func:`plan_compaction`): runs of segments are merged into
one file named by the shipments it holds, whose head adds ``first_seq``, ``level``, ``link`` (the
digest the next segment's ``prev`` names) and ``pruned``; with retention, the records of steps
pruned in the shipped meta are written without their samples (each keeps its checksum and place in
the chain; only through the bound of a meta in a file that is not the last, since a rebuild drops a
damaged last file), and a compacted file is written again when retention passes it. The new file is sealed,
fsynced and published before what it replaces is removed; a scan reads the widest file that checks
and ignores what it holds (``SegmentScan.superseded``, removed by the next writer).
"""


from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .claim import FencedError
from .compaction import FANOUT, L0_FANOUT, IndexEntry, merge, plan_compaction
from .durable import fsync_dir
from .errors import JournalError
from .failpoints import failpoint
from .frames import StepFrame
from .segment_file import Segment, SegmentScan, chain_start, map_digest, pruned_of, publish, read_segment, scan, segment_dir

if TYPE_CHECKING:
    from .store import Journal

MAX_SEGMENT_BYTES = 64 << 20  # a shipment larger than this is split over several segments
CLOSE_TIMEOUT_S = 600.0  # how long closing waits for the shipping left before it gives up (in one line)

# ----------------------------------------------------------------------------- the shipper


class Shipper:
    """Ships a writer's commits to RUN/journal/segments from a background thread.

    ``wait(step)`` blocks the training loop until no more than ``max_lag`` committed steps are
    unshipped (``max_lag=0``: every commit is shipped before the next step starts); a node lost at
    any moment then costs at most ``max_lag`` steps plus the one being committed.
    """

    def __init__(self, journal: Journal, shipped: Path, max_lag: int, found: SegmentScan | None = None, claim=None,
                 retention: bool = False, *, l0_fanout: int = L0_FANOUT, fanout: int = FANOUT):
        """`found`: the caller's scan of `shipped` (the segments as they are now), when it has one;
        `claim`: the run's writer claim, checked before each segment is published; `retention`:
        whether the run prunes samples (then compacted segments merge further only once pruned);
        `l0_fanout`, `fanout`: compaction's fan-ins (journal.segment_fanout; 0: no compaction)."""
        self.journal = journal
        self.shipped = Path(shipped)
        self.max_lag = max_lag
        self.claim = claim
        self.retention = retention
        self.l0_fanout, self.fanout = l0_fanout, fanout
        found = found or scan(self.shipped)
        if found.problem:
            raise JournalError(f"cannot ship to {segment_dir(self.shipped)}: {found.problem}")
        for name in found.leftovers:  # a shipment interrupted by a kill: never published, never read
            if name.startswith(".tmp-"):
                (segment_dir(self.shipped) / name).unlink(missing_ok=True)
        if found.superseded:  # a compaction killed after it published: finish it
            if claim is not None:
                claim.check()
            for path in found.superseded:
                path.unlink(missing_ok=True)
            fsync_dir(segment_dir(self.shipped))
        self._seq = found.last_seq
        self._prev = found.segments[-1].link_digest if found.segments else ""
        self._shipped = found.last_step if found.last_step is not None else journal.base_step()
        self._chain = found.segments[-1].chain if found.segments else (journal.chain_hash(self._shipped) or "")  # after _shipped
        self._stepped = found.last_step is not None  # a shipped segment carries steps: from here on, where the chain starts is known
        self._meta_digest = self._snap_digest = None
        # retention's bound as compaction may use it: from the newest meta shipped in a segment that is
        # not the last file. A damaged last file is dropped by a rebuild (a torn tail); one before it
        # is refused. So the meta that says steps through _pruned were pruned (and archived) is never
        # lost while a compacted file holds them without samples. _pruned_last: the last file's.
        self._pruned = self._pruned_last = 0
        self._index = [IndexEntry.of(seg) for seg in found.segments]  # the segment files, in order (no step bytes)
        self.compaction_problem: str | None = None  # set when a compaction failed (it is not tried again)
        self.compactions = 0
        self._compact_lock = threading.Lock()
        # flush(sealed=True) asks for what is shipped to be followed by a segment: requests are counted,
        # and a pass seals only the requests made before it read its cut (one made after may be about
        # a commit that cut does not hold)
        self._seals_asked = self._seals_done = 0
        self._last_empty = bool(found.segments) and found.segments[-1].empty
        for seg in found.segments:
            self._pruned = self._pruned_last
            if seg.meta is not None:
                self._meta_digest = map_digest(seg.meta)
                self._pruned_last = pruned_of(seg.meta)
            if seg.snapshots is not None:
                self._snap_digest = map_digest(seg.snapshots)
        self.bytes_shipped = 0
        self.seconds_shipping = 0.0  # wall time in ship_once (mostly fsync)
        self.cpu_seconds = 0.0  # the shipper thread's CPU time: what it takes from training
        self._cond = threading.Condition()
        self._dirty = True
        self._written = 1  # commits notified so far (the journal's state at start counts as one)
        self._shipped_written = 0  # of those, how many are in the segments
        self._stop = False
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="verlj-journal-shipper", daemon=True)
        self._thread.start()

    def on_commit(self, step: int | None) -> None:
        """The journal's commit hook: wake the thread; after a step, hold the loop to the lag bound."""
        self.notify()
        if step is not None:
            self.wait(step)

    @property
    def shipped_step(self) -> int:
        return self._shipped

    def lag(self) -> int:
        return max(0, self.journal.last_step() - self._shipped)

    def notify(self) -> None:
        with self._cond:
            self._dirty = True
            self._written += 1
            self._cond.notify_all()

    def flush(self, timeout: float = 600.0, sealed: bool = False) -> None:
        """Block until everything committed so far (steps, metadata, the snapshot index) is shipped.
        sealed: and followed by another segment (an empty one if nothing else comes), so that it is not
        in the last file, which a rebuild drops if it is damaged: what is about to be deleted on the
        strength of it stays unneeded whatever happens to that file. Raises JournalError if shipping
        fails or stalls past `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if sealed:  # and wait for a pass that begins after this request
                self._seals_asked += 1
                self._written += 1
            want = self._written
            self._dirty = True
            self._cond.notify_all()
            while self._shipped_written < want:
                if self._error is not None:
                    raise JournalError(self._error)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise JournalError(f"journal shipping to {segment_dir(self.shipped)} did not catch up in {timeout:.0f} s")
                self._cond.wait(min(left, 1.0))

    def wait(self, step: int, timeout: float = 600.0) -> None:
        """Block until every step up to `step - max_lag` is shipped. Raises JournalError if shipping fails."""
        want = step - self.max_lag
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._shipped < want:
                if self._error is not None:
                    raise JournalError(self._error)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise JournalError(f"journal shipping to {segment_dir(self.shipped)} is {step - self._shipped} "
                                       f"steps behind after {timeout:.0f} s")
                self._cond.wait(min(left, 1.0))

    def close(self, flush: bool = True, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Ship what is left (flush=True), then stop the thread. Shipping that fails or stalls past
        `timeout` is given up, in one line on stderr naming the steps not shipped (still in the local
        journal: the next writer opened on it ships them)."""
        if self._stop:
            return
        reason = self._error
        if flush and reason is None:
            self.notify()
            deadline = time.monotonic() + timeout
            try:
                self.wait(self.journal.last_step() + self.max_lag, timeout)
                self._wait_idle(deadline)
            except JournalError as e:
                reason = str(e)
        if flush and reason is not None:
            sys.stderr.write(f"[WARNING] {self.unshipped(reason)}\n")
            sys.stderr.flush()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def unshipped(self, reason: str) -> str:
        """The line that says shipping was given up: what is not in the segments, and why."""
        a, b = self._shipped + 1, self.journal.last_step()
        what = "the journal's last metadata" if b < a else (f"step {a}" if a == b else f"steps {a}–{b}")
        return (f"journal shipping gave up on close: {what} not shipped to {segment_dir(self.shipped)} ({reason}); "
                f"they are in the local journal {self.journal.path}, and the next run opened on it ships them")

    def _wait_idle(self, deadline: float) -> None:
        with self._cond:
            while self._dirty and self._error is None:
                if time.monotonic() > deadline:
                    raise JournalError(f"journal shipping to {segment_dir(self.shipped)} did not finish")
                self._cond.wait(0.05)

    def _run(self) -> None:
        backoff = 0.1
        while True:
            with self._cond:
                while not self._dirty and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                self._dirty = False
                written = self._written
            try:
                self.ship_once(compact=True)
                with self._cond:
                    self._shipped_written = max(self._shipped_written, written)
                    self._cond.notify_all()
                backoff = 0.1
                while not self._dirty and self.compact_once():  # the rest while nothing waits to be shipped
                    pass
            except FencedError as e:  # another writer owns the run now: never retry
                with self._cond:
                    self._error = str(e)
                    self._cond.notify_all()
                return
            except Exception as e:  # noqa: BLE001 - reported to the training loop by wait()
                with self._cond:
                    self._dirty = True
                    if backoff > 5:  # several tries failed: tell the loop, keep trying
                        self._error = f"journal shipping to {segment_dir(self.shipped)} failed: {e}"
                    self._cond.notify_all()
                time.sleep(backoff)
                backoff *= 2

    def ship_once(self, compact: bool = False) -> bool:
        """Ship everything committed and not yet shipped. Returns whether a segment was written.
        compact: one compaction job after each segment (so compaction keeps up with a loop that
        commits faster than this ships, which never leaves the shipper idle)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        wrote = False
        while True:
            if wrote and compact:
                self.compact_once()
            # one consistent cut per segment: a segment whose steps outlive it never lacks the metadata
            # committed before them (the run's identity written before step 1, say)
            with self._cond:
                seals_asked = self._seals_asked  # before the cut: these requests are about commits it holds
            steps, meta, snaps = self.journal.shipping.read_cut(self._shipped, MAX_SEGMENT_BYTES)
            if not self._stepped:  # no step shipped yet: the chain starts where this cut's meta says (a fork
                with self._cond:  # records its parent's step and chain after its writer opened)
                    self._shipped, self._chain = chain_start(meta)
            meta_digest, snap_digest = map_digest(meta), map_digest(snaps)
            new_meta = meta_digest != self._meta_digest
            new_snaps = snap_digest != self._snap_digest
            if not steps and not new_meta and not new_snaps:
                with self._cond:
                    seal, self._seals_done = seals_asked > self._seals_done, max(self._seals_done, seals_asked)
                if seal and not self._last_empty:  # nothing more to ship: seal what was with an empty segment
                    self._publish_next(Segment(self._seq + 1, self._prev, None, self._shipped, self._chain, [], None, None))
                    wrote = True
                break
            first = self._shipped + 1 if steps else None
            last = self._shipped + len(steps)
            chain = StepFrame.parse(steps[-1]).chain.hex() if steps else self._chain
            seg = Segment(self._seq + 1, self._prev, first, last, chain, steps,
                          meta if new_meta else None, snaps if new_snaps else None)
            self._publish_next(seg)
            with self._cond:
                if new_meta:
                    self._pruned_last = pruned_of(meta)
                self._meta_digest, self._snap_digest = meta_digest, snap_digest
            wrote = True
        self.seconds_shipping += time.perf_counter() - t0
        self.cpu_seconds += time.thread_time() - c0
        return wrote

    def _publish_next(self, seg: Segment) -> None:
        """Publish the next segment and take it into the shipper's state."""
        publish(self.shipped, seg, self.claim)
        with self._cond:
            self._index.append(IndexEntry.of(seg))
            self._pruned = self._pruned_last  # the file that carried it is no longer the last
            self._last_empty = seg.empty
            self._seq, self._prev, self._shipped, self._chain = seg.seq, seg.digest, seg.last, seg.chain
            self._stepped = self._stepped or seg.first is not None
            self.bytes_shipped += seg.size
            self._error = None
            self._cond.notify_all()

    def compact_once(self) -> bool:
        """Do the next compaction the rule asks for (plan_compaction), if any: merge segment files into
        one, or write a compacted one again without the samples retention has pruned since. The new
        file is sealed, fsynced and published before the ones it replaces are removed, so a kill at
        any moment leaves a complete set (scan reads the compacted file and ignores what it holds).
        Returns whether it did one. A failure is kept in compaction_problem; compaction stops there."""
        with self._compact_lock:  # the shipper thread, or a caller that wants it done now
            return self._compact_locked()

    def _compact_locked(self) -> bool:
        if self.compaction_problem is not None or not self.l0_fanout:
            return False
        job = plan_compaction(self._index, self._pruned, self.retention, self.l0_fanout, self.fanout)
        if job is None:
            return False
        i, j, level, rewrite = job
        try:
            merged = merge([read_segment(e.path) for e in self._index[i:j]], level, self._pruned)
            publish(self.shipped, merged, self.claim, replace=rewrite,
                     point="compact.rewrite" if rewrite else "compact.before_publish")
            if not rewrite:
                failpoint("compact.after_publish")
                if self.claim is not None:
                    self.claim.check()
                for k, e in enumerate(self._index[i:j]):
                    e.path.unlink()
                    if k == 0:
                        failpoint("compact.delete")
                fsync_dir(segment_dir(self.shipped))
        except FencedError:
            raise
        except (OSError, JournalError) as e:
            self.compaction_problem = f"journal segment compaction stopped: {e}"
            return False
        self._index[i:j] = [IndexEntry.of(merged)]
        self.compactions += 1
        return True
