"""Segment files: their format, their names in RUN/journal/segments, publishing one, and the walk
that checks them in order (:func:`scan`).

A segment is ``MAGIC | fixed | H | head | step frames``: ``fixed`` is the file length, the head's
length, first step + 1 (0: none) and last step, 8 bytes each, big-endian (the step range readable
even when the rest is torn); ``head`` is msgpack::

    seq, prev         its number and the previous segment's H(body) (hex; "" for the first)
    first, last       the steps it carries (first is None when it carries none)
    chain             the journal's chain hash after ``last`` (hex)
    sizes             the length of each step frame that follows: the records byte for byte as
                      LMDB stores them (each carries its own checksum and chain link)
    meta, snapshots   the whole meta and snapshot-index sub-databases as frames, present only
                      when they changed since the previous segment

``H`` covers fixed, head and each frame's header (its record's checksum and chain hash), so a
segment is checked three ways: its own digest, the link to the previous segment, and each record's
checksum and the journal's hash chain through them. :func:`rebuild` turns the segments back into an LMDB
environment; a damaged or torn last segment costs only the steps in it, damage before the last
is refused.
"""


from __future__ import annotations

import errno
import json
import os
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

from . import codec
from .durable import fsync_dir, replace_durably, write_synced
from .errors import JournalError
from .failpoints import failpoint
from .frames import GENESIS, HASH_LEN, STEP_HEADER, StepFrame, digest, unframe_plain
from .lmdb_env import BASE_STEP, CHAIN_BASE

MAGIC_SEGMENT = b"VJSEG\x01"
_FIXED = struct.Struct(">QQQQ")  # file length, head length, first step + 1 (0: none), last step
SEG_HEADER = len(MAGIC_SEGMENT) + _FIXED.size + HASH_LEN
SEGMENTS = "segments"
POINTER = "local.json"
JOURNAL_ID = "journal_id"  # meta: a random id given to a shipped journal when it is created


# ----------------------------------------------------------------------------- layout


def segment_dir(shipped: Path) -> Path:
    return Path(shipped) / SEGMENTS


def is_shipped(shipped: Path) -> bool:
    """Whether `shipped` (RUN/journal) holds a shipped journal: a segment, or a pointer to a local
    journal that exists (a pointer alone is a start killed before its journal was created)."""
    shipped = Path(shipped)
    if segment_files(shipped):
        return True
    ptr = read_pointer(shipped)
    return ptr is not None and (Path(ptr["path"]) / "data.mdb").is_file()


def segment_files(shipped: Path) -> list[tuple[int, int, Path]]:
    """(first seq, last seq, path) of every segment file: ``N.seg`` (one shipment) and ``A-B.seg``
    (shipments A..B compacted into one), by first seq, the widest first."""
    d = segment_dir(shipped)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        if p.suffix != ".seg" or p.name.startswith("."):
            continue
        a, _, b = p.stem.partition("-")
        if a.isdigit() and (b.isdigit() or not b) and (not b or int(b) >= int(a)):
            out.append((int(a), int(b or a), p))
    return sorted(out, key=lambda t: (t[0], -t[1]))


def segment_path(shipped: Path, seq: int, first_seq: int | None = None) -> Path:
    if first_seq is None or first_seq == seq:
        return segment_dir(shipped) / f"{seq:010d}.seg"
    return segment_dir(shipped) / f"{first_seq:010d}-{seq:010d}.seg"


def write_pointer(shipped: Path, local: Path) -> None:
    shipped.mkdir(parents=True, exist_ok=True)
    replace_durably(shipped / POINTER, json.dumps({"path": str(Path(local).resolve()), "host": socket.gethostname()}).encode())


def read_pointer(shipped: Path) -> dict | None:
    try:
        data = json.loads((Path(shipped) / POINTER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "path" in data else None


@dataclass
class Segment:
    seq: int
    prev: str
    first: int | None
    last: int
    chain: str
    steps: list[bytes]
    meta: dict[bytes, bytes] | None
    snapshots: dict[bytes, bytes] | None
    digest: str = ""
    size: int = 0
    # a compacted segment (Shipper.compact_once): the shipments first_seq..seq in one file, at `level` (0: one
    # shipment); `link`: the digest the next segment's prev names (the last shipment's); `pruned`:
    # retention's bound when written (its steps through there carry no samples)
    first_seq: int | None = None
    link: str = ""
    level: int = 0
    pruned: int = 0
    path: Path | None = None  # where it was read from (not stored)

    @property
    def span(self) -> tuple[int, int]:
        return (self.seq if self.first_seq is None else self.first_seq), self.seq

    @property
    def empty(self) -> bool:
        """It carries nothing: no steps, no meta, no snapshot index (a seal: Shipper.flush(sealed=True))."""
        return self.first is None and self.meta is None and self.snapshots is None

    @property
    def link_digest(self) -> str:
        """What the next segment's prev must be."""
        return self.link or self.digest

    def seal(self) -> list[bytes]:
        """The file's parts, in order (written with writelines: the step frames are not copied again)."""
        head = {
            "seq": self.seq, "prev": self.prev, "first": self.first, "last": self.last, "chain": self.chain,
            "sizes": [len(f) for f in self.steps], "meta": self.meta, "snapshots": self.snapshots,
        }
        if self.level:
            head.update(first_seq=self.first_seq, link=self.link, level=self.level, pruned=self.pruned)
        packed = codec.packb(head)
        self.size = SEG_HEADER + len(packed) + sum(len(f) for f in self.steps)
        fixed = _FIXED.pack(self.size, len(packed), 0 if self.first is None else self.first + 1, self.last)
        h = _seal_digest(fixed, packed, self.steps)
        self.digest = h.hex()
        return [MAGIC_SEGMENT + fixed + h + packed, *self.steps]

    @classmethod
    def parse(cls, raw: bytes, name: str) -> Segment:
        m = len(MAGIC_SEGMENT)
        if len(raw) < SEG_HEADER or raw[:m] != MAGIC_SEGMENT:
            raise JournalError(f"journal segment {name} has no valid header")
        fixed = raw[m : m + _FIXED.size]
        total, head_len, first1, last = _FIXED.unpack(fixed)
        if len(raw) != total:
            raise JournalError(f"journal segment {name} is truncated ({len(raw)} of {total} bytes)")
        h = raw[m + _FIXED.size : SEG_HEADER]
        try:
            d = codec.unpackb(raw[SEG_HEADER : SEG_HEADER + head_len])
            sizes = [int(n) for n in d["sizes"]]
            steps, at = [], SEG_HEADER + head_len
            for n in sizes:
                steps.append(raw[at : at + n])
                at += n
            seg = cls(int(d["seq"]), d["prev"], d["first"], int(d["last"]), d["chain"], steps,
                      d["meta"], d["snapshots"], h.hex(), len(raw), d.get("first_seq"), d.get("link", ""),
                      int(d.get("level", 0)), int(d.get("pruned", 0)))
        except (KeyError, TypeError, ValueError, JournalError) as e:
            raise JournalError(f"journal segment {name} is undecodable: {e}") from None
        if at != total or _seal_digest(fixed, raw[SEG_HEADER : SEG_HEADER + head_len], steps) != h:
            raise JournalError(f"journal segment {name} fails its checksum")
        if (seg.first, seg.last) != (first1 - 1 if first1 else None, last) or len(steps) != (
                0 if seg.first is None else seg.last - seg.first + 1):
            raise JournalError(f"journal segment {name}'s header does not match its body")
        return seg


def _seal_digest(fixed: bytes, head: bytes, frames: list[bytes]) -> bytes:
    """A segment's digest: its headers and each step frame's own header (magic, checksum of the record,
    chain hash). Each record's bytes are bound by its checksum, which scan() checks, so the segment is
    sealed without hashing the records a second time."""
    return digest(fixed, head, *(f[:STEP_HEADER] for f in frames))


def read_segment(path: Path) -> Segment:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise JournalError(f"cannot read journal segment {path.name}: {e.strerror}") from None
    seg = Segment.parse(raw, path.name)
    seg.path = path
    return seg


def publish(shipped: Path, seg: Segment, claim=None, *, replace: bool = False, point: str = "ship.before_publish") -> Path:
    """Write a sealed segment durably and atomically: tmp file, fsync, then link(2) to its name (which
    never replaces an existing segment), fsync the directory. `claim`: the run's writer claim, checked
    first, so a writer that was taken over publishes nothing. replace=True: the file takes the place
    of the one of the same name (rename(2): either is whole; a compacted segment pruned again)."""
    d = segment_dir(shipped)
    d.mkdir(parents=True, exist_ok=True)
    parts = seg.seal()
    final = segment_path(shipped, seg.seq, seg.first_seq)
    tmp = d / f".tmp-{final.stem}"
    write_synced(tmp, parts)
    failpoint(point)  # written, not yet visible under its name
    if claim is not None:
        claim.check()
    taken = f"journal segment {final.name} already exists: another process ships this run's journal"
    if replace:
        os.replace(tmp, final)
    else:
        try:
            os.link(tmp, final)
        except FileExistsError:
            tmp.unlink(missing_ok=True)
            raise JournalError(taken) from None
        except OSError as e:  # a filesystem without hard links
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            if final.exists():
                raise JournalError(taken) from None
            os.replace(tmp, final)
        else:
            tmp.unlink()
    fsync_dir(d)
    seg.path = final
    return final


# ----------------------------------------------------------------------------- the chain of segments


@dataclass
class SegmentScan:
    """What a walk over RUN/journal/segments found."""

    segments: list[Segment] = field(default_factory=list)  # the good prefix, in order
    problem: str | None = None  # the first problem, one sentence
    problem_at_end: bool = False  # the problem is in the last segment file only (a torn tail)
    problem_path: Path | None = None  # the file with the problem, when it is one file
    lost_steps: tuple[int, int | None] | None = None  # steps in a dropped last segment (last None: unknown)
    leftovers: list[str] = field(default_factory=list)
    superseded: list[Path] = field(default_factory=list)  # shipments a compacted segment holds (a compaction killed before it removed them)

    @property
    def _last_with_steps(self) -> Segment | None:
        return next((seg for seg in reversed(self.segments) if seg.first is not None), None)

    @property
    def last_step(self) -> int | None:
        seg = self._last_with_steps
        return None if seg is None else seg.last

    @property
    def last_seq(self) -> int:
        return self.segments[-1].seq if self.segments else 0

    @property
    def journal_id(self) -> str | None:
        for seg in reversed(self.segments):
            if seg.meta is not None and JOURNAL_ID.encode() in seg.meta:
                return unframe_plain(seg.meta[JOURNAL_ID.encode()], "meta 'journal_id'")
        return None

    @property
    def last_chain(self) -> str | None:
        seg = self._last_with_steps
        return None if seg is None else seg.chain

    @property
    def bytes(self) -> int:
        return sum(s.size for s in self.segments)


def scan(shipped: Path) -> SegmentScan:
    """Read and check every segment: digest, numbering, link to the previous one, step continuity and
    the journal's hash chain through the step records. Stops at the first problem; when that is in
    the last segment file, ``lost_steps`` says which steps it held. A live writer's compaction may
    replace files under the walk: a problem found while the files changed is looked at again."""
    for _ in range(5):
        before = segment_files(shipped)
        out = _walk(shipped)
        if out.problem is None or segment_files(shipped) == before:
            break
    if out.problem_at_end and out.problem_path is not None:
        out.lost_steps = lost_range(out.problem_path, out.last_step)
    return out


def _walk(shipped: Path) -> SegmentScan:
    """The segments in order. Shipments 1, 2, ... are each in one file, alone (N.seg) or compacted with
    their neighbours (A-B.seg); where a compacted file and the files it replaced are both there (a
    compaction killed before it removed them), the compacted one is read and the others are
    superseded; if it fails its checks, they are read instead."""
    out = SegmentScan()
    files = segment_files(shipped)
    d = segment_dir(shipped)
    if d.is_dir():
        out.leftovers = sorted(p.name for p in d.iterdir() if p.name.startswith((".tmp-", ".damaged-")))
    starts: dict[int, list[tuple[int, Path]]] = {}
    for a, b, path in files:
        starts.setdefault(a, []).append((b, path))
    end = max((b for _a, b, _p in files), default=0)
    prev_digest, chain, last, seq, stepped = "", None, None, 1, False
    while seq <= end:
        candidates = starts.get(seq)
        if not candidates:
            later = min(a for a, _b, _p in files if a > seq)
            out.problem = f"journal segment {seq:010d}.seg is missing (the next one is {segment_path(shipped, later).name})"
            return out
        first_why: tuple[str, bool, Path] | None = None
        for b, path in candidates:  # the widest first
            at_end = b == end
            why: str | None
            try:
                seg = read_segment(path)
            except JournalError as e:
                why = str(e)
            else:
                why = None
                if seg.span != (seq, b):
                    why = f"journal segment {path.name} says it holds shipments {seg.span[0]}–{seg.span[1]}"
                elif seg.prev != prev_digest:
                    why = f"journal segment {path.name} does not link to segment {seq - 1}"
                else:
                    new_chain, new_last, why = _check_steps(seg, path.name, chain, last, stepped)
            if why is None:
                break
            first_why = first_why or (why, at_end, path)
        else:
            assert first_why is not None  # every candidate failed, the first one said why
            out.problem, out.problem_at_end, out.problem_path = first_why
            return out
        out.segments.append(seg)
        chain, last, prev_digest, seq = new_chain, new_last, seg.link_digest, b + 1
        stepped = stepped or seg.first is not None
    kept = {seg.path for seg in out.segments}
    out.superseded = [p for _a, b, p in files if p not in kept and b <= out.last_seq]  # held by what was read
    return out


def _check_steps(seg: Segment, name: str, chain: bytes | None, last: int | None, stepped: bool = False):
    """Continue the hash chain through a segment's step records. Returns (chain, last, problem).
    `stepped`: whether an earlier segment carried steps."""
    if not stepped and seg.meta is not None:  # the newest meta before the first step sets where the chain starts
        last, start = chain_start(seg.meta)  # (a fork records its base after its writer shipped a first meta)
        chain = bytes.fromhex(start) if start else GENESIS
    if not seg.steps:
        return chain, last, None
    if chain is None:
        return chain, last, f"journal segment {name} carries steps before any segment carries the run's metadata"
    assert seg.first is not None and last is not None  # it carries steps; the chain's start set `last`
    for i, raw in enumerate(seg.steps):
        step = seg.first + i
        try:
            frame = StepFrame.parse(raw)
        except JournalError:
            return chain, last, f"journal segment {name}: step {step} has no valid frame"
        if step != last + 1:
            return chain, last, f"journal segment {name} starts at step {seg.first}, but the previous one ended at step {last}"
        if not frame.checksum_ok() or frame.chain != digest(chain, frame.checksum):
            return chain, last, f"journal segment {name}: step {step} fails its checksum or hash chain"
        chain, last = frame.chain, step
    if seg.last != last or seg.chain != chain.hex():
        return chain, last, f"journal segment {name}'s header does not match its steps"
    return chain, last, None


def chain_start(meta: dict[bytes, bytes]) -> tuple[int, str]:
    """Where a journal's chain starts, from its meta frames: (the step before its first record, the
    chain hash it continues, hex; "" for a new run's, which starts at GENESIS)."""
    base, cbase = meta.get(BASE_STEP.encode()), meta.get(CHAIN_BASE.encode())
    return (int(unframe_plain(base, f"meta {BASE_STEP!r}")) if base is not None else 0,
            unframe_plain(cbase, f"meta {CHAIN_BASE!r}") if cbase is not None else "")


def lost_range(path: Path, last_good: int | None) -> tuple[int, int | None] | None:
    """The steps a dropped last segment held, from its fixed header: (first, last); last None when the
    header itself is unreadable; None when it carried no steps (only metadata, shipped again next)."""
    raw = path.read_bytes()[:SEG_HEADER]
    m = len(MAGIC_SEGMENT)
    if len(raw) < m + _FIXED.size or raw[:m] != MAGIC_SEGMENT:
        return (last_good or 0) + 1, None
    _total, _head, first1, last = _FIXED.unpack(raw[m : m + _FIXED.size])
    if first1 == 0:
        return None
    if first1 - 1 != (last_good or 0) + 1 or last < first1 - 1:  # a damaged header: trust only what is known
        return (last_good or 0) + 1, None
    return first1 - 1, last


# ----------------------------------------------------------------------------- readers

def pruned_of(meta: dict[bytes, bytes]) -> int:
    raw = meta.get(b"pruned_through")
    return 0 if raw is None else int(unframe_plain(raw, "meta 'pruned_through'"))


def map_digest(frames: dict[bytes, bytes]) -> bytes:
    return digest(codec.packb(sorted(frames.items())))
