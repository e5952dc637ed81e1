"""Which segment files to merge next (:func:`plan_compaction`) and the merge itself; the shipper
(:mod:`verlj.journal.shipper`) runs them.
"""


from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import JournalError
from .frames import StepFrame, digest
from .segment_file import Segment

L0_FANOUT = 64  # compaction: one-shipment segments merged into a level-1 file
FANOUT = 16  # compaction: level-k files merged into a level-k+1 file


@dataclass
class IndexEntry:
    """What the shipper keeps of a segment file to plan compactions (not its bytes)."""

    span: tuple[int, int]
    level: int
    first: int | None
    last: int
    pruned: int
    path: Path

    @classmethod
    def of(cls, seg: Segment) -> IndexEntry:
        assert seg.path is not None  # read from its file or published to it
        return cls(seg.span, seg.level, seg.first, seg.last, seg.pruned, seg.path)


def plan_compaction(index: list, pruned: int, retention: bool, l0_fanout: int = L0_FANOUT,
                    fanout: int = FANOUT) -> tuple[int, int, int, bool] | None:
    """The next compaction of the segment files `index` (oldest first; entries with span, level,
    first, last, pruned): ``(i, j, level, rewrite)``, files i..j-1 replaced by one at `level`.

    The rule, first match wins:
      1. a compacted file holding samples of steps retention has since pruned (through `pruned`) is
         written again without them (rewrite);
      2. the oldest `l0_fanout` consecutive one-shipment files become one level-1 file (never the
         newest file: the last file is always the last shipment itself, as a torn tail expects);
      3. the oldest `fanout` consecutive settled level-k files (k >= 1) become one level-k+1 file;
         settled: pruned whole, or any file when the run keeps its samples (retention off).
    So a run leaves at most l0_fanout - 1 one-shipment files, fanout - 1 settled files per level
    (the files of commit n at level k hold l0_fanout * fanout**(k-1) shipments), and the level-1
    files of its retention window: for 100,000 shipments and the defaults, under 100 + window / 64.
    """
    for i, e in enumerate(index):
        if e.level >= 1 and e.first is not None and max(e.pruned, e.first - 1) < min(e.last, pruned):
            return i, i + 1, e.level, True

    def settled(e) -> bool:
        return not retention or e.first is None or e.last <= pruned

    i, n = 0, len(index)
    while i < n:
        level, j = index[i].level, i
        while j < n and index[j].level == level and (level == 0 and j < n - 1 or level and settled(index[j])):
            j += 1
        need = l0_fanout if level == 0 else fanout
        if j - i >= need:
            return i, i + need, level + 1, False
        i = max(j, i + 1)
    return None


def merge(segs: list[Segment], level: int, pruned: int) -> Segment:
    """One segment holding what `segs` (consecutive, checked) hold, the samples of steps through
    `pruned` removed (each record keeps its checksum and place in the chain: StepFrame.without_payload)."""
    frames, prev_chain = [], None
    for seg in segs:
        for k, raw in enumerate(seg.steps):
            assert seg.first is not None and seg.path is not None  # read from its file, it carries steps
            frame = StepFrame.parse(raw)
            step = seg.first + k
            if not frame.checksum_ok() or (prev_chain is not None and frame.chain != digest(prev_chain, frame.checksum)):
                raise JournalError(f"journal segment {seg.path.name}: step {step} fails its checksum or hash chain")
            prev_chain = frame.chain
            frames.append(frame.without_payload() if step <= pruned and frame.payload_len else raw)
    meta = next((s.meta for s in reversed(segs) if s.meta is not None), None)
    snaps = next((s.snapshots for s in reversed(segs) if s.snapshots is not None), None)
    first = next((s.first for s in segs if s.first is not None), None)
    return Segment(segs[-1].seq, segs[0].prev, first, segs[-1].last, segs[-1].chain, frames, meta, snaps,
                   first_seq=segs[0].span[0], link=segs[-1].link_digest, level=level, pruned=pruned)
