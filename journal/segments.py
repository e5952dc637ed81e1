"""Shipped journals: the LMDB environment on node-local disk, sealed segments in the run directory.

LMDB must not live on a network filesystem (its documentation: locking and memory-map coherence
break there), yet the run directory usually does. With ``journal.local_dir`` the one writer keeps
the LMDB environment on local disk and a background :class:`Shipper` copies each commit into the
run directory as an immutable segment (Litestream's model)::

    RUN/journal/
      segments/0000000001-0000000064.seg   shipments 1-64 compacted into one file (see below)
      segments/0000000065.seg     sealed, immutable, one per shipment, numbered without gaps
      segments/.tmp-0000000066    a shipment being written (never read; removed on the next start)
      local.json                  where the live LMDB environment is (host, path): readers on that
                                  host use it; anyone else rebuilds from the segments. The LMDB
                                  environment names the RUN/journal it ships to (meta shipped_to): a
                                  copy of the run directory (cp -a carries local.json along) never
                                  writes into or reads it while its original uses it (local_owner);
                                  a moved one takes it over

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

import atexit
import errno
import json
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from . import codec
from .claim import FencedError, process_start
from .durable import fsync_dir
from .errors import JournalError
from .failpoints import failpoint
from .store import BASE_STEP, CHAIN_BASE, GENESIS, HASH_LEN, STEP_HEADER, Journal, StepFrame, digest, unframe_plain

MAGIC_SEGMENT = b"VJSEG\x01"
_FIXED = struct.Struct(">QQQQ")  # file length, head length, first step + 1 (0: none), last step
SEG_HEADER = len(MAGIC_SEGMENT) + _FIXED.size + HASH_LEN
SEGMENTS = "segments"
POINTER = "local.json"
JOURNAL_ID = "journal_id"  # meta: a random id given to a shipped journal when it is created
OWNER = "shipped_to"  # meta: the journal directory (RUN/journal, its realpath) the writer ships to: whose local journal it is
MAX_SEGMENT_BYTES = 64 << 20  # a shipment larger than this is split over several segments
L0_FANOUT = 64  # compaction: one-shipment segments merged into a level-1 file
FANOUT = 16  # compaction: level-k files merged into a level-k+1 file

# filesystems on which LMDB's locks and shared memory map are not coherent across hosts
NETWORK_FILESYSTEMS = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "cephfs", "glusterfs",
    "fuse.glusterfs", "beegfs", "fuse.sshfs", "9p", "afs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs",
}


# ----------------------------------------------------------------------------- layout


def segment_dir(shipped: Path) -> Path:
    return Path(shipped) / SEGMENTS


def is_shipped(shipped: Path) -> bool:
    """Whether `shipped` (RUN/journal) holds a shipped journal: a segment, or a pointer to a local
    journal that exists (a pointer alone is a start killed before its journal was created)."""
    shipped = Path(shipped)
    if _segment_files(shipped):
        return True
    ptr = read_pointer(shipped)
    return ptr is not None and (Path(ptr["path"]) / "data.mdb").is_file()


def _segment_files(shipped: Path) -> list[tuple[int, int, Path]]:
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


def _segment_path(shipped: Path, seq: int, first_seq: int | None = None) -> Path:
    if first_seq is None or first_seq == seq:
        return segment_dir(shipped) / f"{seq:010d}.seg"
    return segment_dir(shipped) / f"{first_seq:010d}-{seq:010d}.seg"


def write_pointer(shipped: Path, local: Path) -> None:
    shipped.mkdir(parents=True, exist_ok=True)
    tmp = shipped / (POINTER + ".tmp")
    tmp.write_text(json.dumps({"path": str(Path(local).resolve()), "host": socket.gethostname()}))
    os.replace(tmp, shipped / POINTER)
    fsync_dir(shipped)


def read_pointer(shipped: Path) -> dict | None:
    try:
        data = json.loads((Path(shipped) / POINTER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "path" in data else None


def network_filesystem(path: Path, mounts: str | None = None) -> str | None:
    """The network filesystem type `path` lives on (e.g. 'nfs4'), or None for a local one."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return None
    real = Path(os.path.realpath(path))
    best, fstype = "", None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        if (real == Path(mount) or Path(mount) in real.parents) and len(mount) > len(best):
            best, fstype = mount, parts[2]
    return fstype if fstype in NETWORK_FILESYSTEMS else None


# ----------------------------------------------------------------------------- one segment


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
        head = codec.packb(head)
        self.size = SEG_HEADER + len(head) + sum(len(f) for f in self.steps)
        fixed = _FIXED.pack(self.size, len(head), 0 if self.first is None else self.first + 1, self.last)
        h = _seal_digest(fixed, head, self.steps)
        self.digest = h.hex()
        return [MAGIC_SEGMENT + fixed + h + head, *self.steps]

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


def _publish(shipped: Path, seg: Segment, claim=None, *, replace: bool = False, point: str = "ship.before_publish") -> Path:
    """Write a sealed segment durably and atomically: tmp file, fsync, then link(2) to its name (which
    never replaces an existing segment), fsync the directory. `claim`: the run's writer claim, checked
    first, so a writer that was taken over publishes nothing. replace=True: the file takes the place
    of the one of the same name (rename(2): either is whole; a compacted segment pruned again)."""
    d = segment_dir(shipped)
    d.mkdir(parents=True, exist_ok=True)
    parts = seg.seal()
    final = _segment_path(shipped, seg.seq, seg.first_seq)
    tmp = d / f".tmp-{final.stem}"
    with open(tmp, "wb") as f:
        f.writelines(parts)
        f.flush()
        os.fsync(f.fileno())
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
        before = _segment_files(shipped)
        out = _walk(shipped)
        if out.problem is None or _segment_files(shipped) == before:
            break
    if out.problem_at_end and out.problem_path is not None:
        out.lost_steps = _lost_range(out.problem_path, out.last_step)
    return out


def _walk(shipped: Path) -> SegmentScan:
    """The segments in order. Shipments 1, 2, ... are each in one file, alone (N.seg) or compacted with
    their neighbours (A-B.seg); where a compacted file and the files it replaced are both there (a
    compaction killed before it removed them), the compacted one is read and the others are
    superseded; if it fails its checks, they are read instead."""
    out = SegmentScan()
    files = _segment_files(shipped)
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
            out.problem = f"journal segment {seq:010d}.seg is missing (the next one is {_segment_path(shipped, later).name})"
            return out
        first_why = None
        for b, path in candidates:  # the widest first
            at_end = b == end
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
        last, start = _chain_start(seg.meta)  # (a fork records its base after its writer shipped a first meta)
        chain = bytes.fromhex(start) if start else GENESIS
    if not seg.steps:
        return chain, last, None
    if chain is None:
        return chain, last, f"journal segment {name} carries steps before any segment carries the run's metadata"
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


def _chain_start(meta: dict[bytes, bytes]) -> tuple[int, str]:
    """Where a journal's chain starts, from its meta frames: (the step before its first record, the
    chain hash it continues, hex; "" for a new run's, which starts at GENESIS)."""
    base, cbase = meta.get(BASE_STEP.encode()), meta.get(CHAIN_BASE.encode())
    return (int(unframe_plain(base, f"meta {BASE_STEP!r}")) if base is not None else 0,
            unframe_plain(cbase, f"meta {CHAIN_BASE!r}") if cbase is not None else "")


def rebuild(shipped: Path, dest: Path, *, tolerate: str = "tail", found: SegmentScan | None = None) -> SegmentScan:
    """Rebuild the LMDB journal at `dest` (which must not hold one) from the segments in `shipped`.

    tolerate='tail': a damaged last segment is dropped (its steps are lost; said in scan.problem),
    damage before it raises JournalError. tolerate='any': rebuild the good prefix whatever follows
    (post-mortem reading; the problem is reported, never hidden). The rebuild is written beside
    `dest` and renamed into place, so a killed rebuild leaves nothing that looks like a journal.
    `found`: the caller's scan of `shipped`, when it has one.
    """
    found = found or scan(shipped)
    if found.problem and not found.problem_at_end and tolerate != "any":
        raise JournalError(f"{found.problem}; the journal cannot be rebuilt past segment {found.last_seq} "
                           f"(step {found.last_step or 0})")
    if not found.segments:
        raise JournalError(f"no intact journal segment in {segment_dir(shipped)}"
                           + (f": {found.problem}" if found.problem else ""))
    dest = Path(dest)
    if (dest / "data.mdb").exists():
        raise JournalError(f"{dest} already holds a journal; rebuild into an empty directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".rebuild-{dest.name}-", dir=dest.parent))
    meta = snaps = None
    for seg in found.segments:
        meta = seg.meta if seg.meta is not None else meta
        snaps = seg.snapshots if seg.snapshots is not None else snaps
    # segments keep each step as it was committed; retention pruned the writer's copy since: so is this one
    pruned_through = _pruned_of(meta) if meta else 0
    try:
        with Journal.open_writer(work) as j:
            for seg in found.segments:
                j.restore(seg.steps, seg.first, None, None, pruned_through=pruned_through)
            j.restore([], None, meta or {}, snaps or {})
        (work / "writer.lock").unlink(missing_ok=True)
        if dest.exists():
            dest.rmdir()  # only an empty directory (checked above that it holds no journal)
        os.replace(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return found


def _lost_range(path: Path, last_good: int | None) -> tuple[int, int | None] | None:
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


@dataclass
class _Rebuilt:
    """A copy of a shipped journal rebuilt by this process, reused while the segment files stay as they were."""

    path: Path  # the rebuilt LMDB environment
    found: SegmentScan  # the scan it was rebuilt from
    files: tuple  # the segment files then: (name, size, mtime_ns) each
    staged_for: Path | None = None  # the writer's local_dir it was rebuilt beside (stage_for_writer), or None: a temporary


_REBUILT: dict[str, _Rebuilt] = {}  # the segments directory (realpath) -> this process's rebuilt copy of it


def open_reader(shipped: Path) -> Journal:
    """A reader for the journal of RUN/journal, whatever its layout.

    Today's layout (data.mdb in RUN/journal) opens directly. A shipped journal opens the live LMDB
    environment named by local.json when this host has it and it agrees with the segments (it may
    hold steps not yet shipped; only the last segments are read to decide). Otherwise the segments
    are checked and rebuilt once per process (into a temporary directory removed when it exits, or
    where :func:`stage_for_writer` put them), and read again only when the files change;
    ``journal.shipped_problem`` then names any damage found.
    """
    shipped = Path(shipped)
    if (shipped / "data.mdb").is_file():
        return Journal.open_reader(shipped)
    if not is_shipped(shipped):
        return Journal.open_reader(shipped)  # raises NotAJournalError with the usual sentence
    local = _usable_local(shipped, _tail(shipped))
    if local is not None:
        return Journal.open_reader(local)
    rebuilt = _current_rebuild(shipped) or _rebuild_for_readers(shipped)
    j = Journal.open_reader(rebuilt.path)
    j.shipped_problem = rebuilt.found.problem
    return j


def _files_state(shipped: Path) -> tuple:
    """The segment files as they are now (name, size, mtime_ns): a rebuilt copy is current while this is unchanged."""
    out = []
    for _a, _b, path in _segment_files(shipped):
        try:
            st = path.stat()
        except FileNotFoundError:  # removed by a live writer's compaction under the listing
            return ("changing",)
        out.append((path.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _current_rebuild(shipped: Path) -> _Rebuilt | None:
    """This process's rebuilt copy of `shipped`, when the segment files are still those it was rebuilt from."""
    entry = _REBUILT.get(os.path.realpath(segment_dir(shipped)))
    if entry is None or not (entry.path / "data.mdb").is_file() or entry.files != _files_state(shipped):
        return None
    return entry


def _remember(shipped: Path, entry: _Rebuilt) -> _Rebuilt:
    if not _REBUILT:
        atexit.register(_remove_rebuilt)
    old = _REBUILT.pop(os.path.realpath(segment_dir(shipped)), None)
    if old is not None:
        shutil.rmtree(old.path.parent, ignore_errors=True)
    _REBUILT[os.path.realpath(segment_dir(shipped))] = entry
    return entry


def _remove_rebuilt() -> None:
    """At exit: the rebuilt copies nobody adopted (open_writer forgets the staged copy it renames)."""
    for entry in _REBUILT.values():
        shutil.rmtree(entry.path.parent, ignore_errors=True)
    _REBUILT.clear()


def _rebuild_for_readers(shipped: Path) -> _Rebuilt:
    """The segments' good prefix rebuilt in a temporary directory, named by this process (removed at
    exit, or by the next reader when this process was killed)."""
    files = _files_state(shipped)
    found = scan(shipped)
    _remove_dead_reader_copies()
    me = f"{_READER_PREFIX}{_pid_namespace_id()}-{os.getpid()}-{process_start(os.getpid())}-"
    return _rebuild_in(shipped, Path(tempfile.mkdtemp(prefix=me)), "any", found, files)


_READER_PREFIX = "verlj-journal-"


def _pid_namespace_id() -> str:
    """This process's pid namespace, as digits ('' when unknown): a pid names a process only within it."""
    try:
        return "".join(c for c in os.readlink("/proc/self/ns/pid") if c.isdigit())
    except OSError:
        return ""


def _remove_dead_reader_copies() -> None:
    """The rebuilt copies in the temporary directory of readers that were killed (SIGKILL skips the
    removal at exit): those named by a process of this pid namespace that is gone."""
    ns = _pid_namespace_id()
    if not ns:
        return
    for p in Path(tempfile.gettempdir()).glob(f"{_READER_PREFIX}{ns}-*-*-*"):
        pid, start = p.name[len(_READER_PREFIX) + len(ns) + 1 :].split("-")[:2]
        if pid.isdigit() and start.isdigit() and process_start(int(pid)) != start:
            shutil.rmtree(p, ignore_errors=True)


def _rebuild_in(shipped: Path, where: Path, tolerate: str, found: SegmentScan, files: tuple,
                staged_for: Path | None = None) -> _Rebuilt:
    """Rebuild into where/journal (`where`: a fresh directory of its own, removed if that fails) and
    remember it for this process's readers."""
    try:
        rebuild(shipped, where / "journal", tolerate=tolerate, found=found)
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise
    return _remember(shipped, _Rebuilt(where / "journal", found, files, staged_for))


def stage_for_writer(shipped: Path, local: Path) -> bool:
    """Before a resume reads its run: when this node has no usable local journal and the writer will
    rebuild one at `local` (journal.local_dir), rebuild it now, once, beside `local` (the same
    filesystem): this process's readers open that copy and :func:`open_writer` renames it into place,
    so a resume from segments reads them once and copies nothing. Returns whether it staged one;
    when it does not (a usable local journal, `local` already holds one, damage before the last
    segment), everything goes as without it. Removed at exit unless adopted."""
    shipped, local = Path(shipped), Path(local)
    if (shipped / "data.mdb").is_file() or not _segment_files(shipped) or (local / "data.mdb").is_file():
        return False
    if _usable_local(shipped, _tail(shipped)) is not None or _current_rebuild(shipped) is not None:
        return False
    files = _files_state(shipped)
    found = scan(shipped)
    if not found.segments or (found.problem and not found.problem_at_end):
        return False
    local.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_stages(local)
    stage = Path(tempfile.mkdtemp(prefix=f"{_STAGE_PREFIX}{local.name}-{os.getpid()}-", dir=local.parent))
    _rebuild_in(shipped, stage, "tail", found, files, staged_for=local)
    return True


_STAGE_PREFIX = ".verlj-rebuild-"


def _remove_dead_stages(local: Path) -> None:
    """Staged rebuilds beside `local` left by resumes that were killed (their process is gone)."""
    for p in local.parent.glob(f"{_STAGE_PREFIX}{local.name}-*-*"):
        pid = p.name[len(_STAGE_PREFIX) + len(local.name) + 1 :].split("-")[0]
        if pid.isdigit() and not process_start(int(pid)):  # node-local: a pid here is a process here
            shutil.rmtree(p, ignore_errors=True)


def shipped_meta(shipped: Path) -> tuple[dict, int | None]:
    """The journal's metadata as last shipped, and the last shipped step, read from the newest
    segments only (nothing rebuilt; each meta frame's checksum checked): what a resume needs before it
    reads the run (the config in force, hence journal.local_dir). ({}, None) when none was shipped."""
    found = _tail(shipped)
    raw = next((seg.meta for seg in reversed(found.segments) if seg.meta is not None), None) or {}
    return {bytes(k).decode(): unframe_plain(v, f"meta {bytes(k).decode()!r}") for k, v in raw.items()}, found.last_step


def _tail(shipped: Path) -> SegmentScan:
    """The last segments only, newest first until one with steps and one with the journal id are
    found: enough to decide whether a local journal is this one's live copy. Checks nothing."""
    out = SegmentScan()
    have_steps = have_id = False
    for _a, _b, path in sorted(_segment_files(shipped), key=lambda t: t[1], reverse=True):
        try:
            seg = read_segment(path)
        except JournalError:
            continue
        out.segments.insert(0, seg)
        have_steps = have_steps or seg.first is not None
        have_id = have_id or (seg.meta is not None and JOURNAL_ID.encode() in seg.meta)
        if have_steps and have_id:
            break
    return out


def _usable_local(shipped: Path, found: SegmentScan) -> Path | None:
    ptr = read_pointer(shipped)
    if ptr is None or ptr.get("host") != socket.gethostname():
        return None
    local = Path(ptr["path"])
    if not (local / "data.mdb").is_file():
        return None
    return local if matches(local, shipped, found) else None


def matches(local: Path, shipped: Path, found: SegmentScan) -> bool:
    """Whether the LMDB journal at `local` is this shipped journal's live copy: the same journal id,
    every shipped step in it (the same chain hash at the last one), and not another run directory's
    (:func:`local_owner`). Before anything carrying the id was shipped, only the run's own pointer
    can vouch for it."""
    try:
        with Journal.open_reader(local) as j:
            if found.journal_id is None:
                ptr = read_pointer(shipped)
                same = ptr is not None and os.path.realpath(ptr["path"]) == os.path.realpath(local)
            elif j.get_meta(JOURNAL_ID) != found.journal_id:
                return False
            else:
                last = found.last_step
                same = last is None or (j.last_step() >= last and j.chain_hash(last) == found.last_chain)
            owner = j.get_meta(OWNER)
    except JournalError:
        return False
    return same and _in_use_by_another(owner, local, shipped) is None


def local_owner(local: Path, shipped: Path) -> tuple[Path, str | None] | None:
    """(the journal directory, RUN/journal, of the run whose local journal `local` is, and the journal's
    id) when that is not `shipped` and that run still uses it (its pointer names `local`, on this host):
    `shipped` must then neither write into `local` nor read it as its own; with the same journal id, it
    is a copy of that run (cp -a carries the pointer along). None when `local` ships to `shipped`, says
    nowhere (written before this was recorded: the first writer to open it takes it), or ships to a
    directory that is gone or uses another local journal now: `shipped` is that run moved, and
    resumes as itself."""
    try:
        with Journal.open_reader(local) as j:
            owner, jid = j.get_meta(OWNER), j.get_meta(JOURNAL_ID)
    except JournalError:
        return None
    other = _in_use_by_another(owner, local, shipped)
    return None if other is None else (other, jid)


def _in_use_by_another(owner: str | None, local: Path, shipped: Path) -> Path | None:
    if owner is None or _same_dir(owner, shipped):
        return None
    ptr = read_pointer(Path(owner))
    if ptr is None or ptr.get("host") != socket.gethostname() or not _same_dir(ptr["path"], local):
        return None
    return Path(owner)


def _same_dir(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is gone
        return os.path.realpath(a) == os.path.realpath(b)


def _older_local_copy(shipped: Path, local: Path, found: SegmentScan) -> tuple[Path, int] | None:
    """The local journal the run last wrote, when it is another directory on this host that still
    holds the shipped steps (same hash chain) and more: (its path, its last step); else None."""
    ptr = read_pointer(shipped)
    if ptr is None or ptr.get("host") != socket.gethostname():
        return None
    old = Path(ptr["path"])
    if os.path.realpath(old) == os.path.realpath(local) or not (old / "data.mdb").is_file() or not matches(old, shipped, found):
        return None
    try:
        with Journal.open_reader(old) as j:
            last = j.last_step()
    except JournalError:
        return None
    return (old, last) if last > (found.last_step or 0) else None


# ----------------------------------------------------------------------------- the writer


class CopiedJournalError(JournalError):
    """journal.local_dir holds the journal of the run this one was copied from (local_owner)."""

    def __init__(self, message: str, owner: Path, local: Path):
        super().__init__(message)
        self.owner, self.local = owner, local


def open_writer(local: Path, shipped: Path, max_lag: int, claim=None, retention: bool = False,
                fanout: int = L0_FANOUT) -> tuple[Journal, list[str]]:
    """The run's journal writer at `local`, shipping to `shipped`. Returns (journal, notes): notes are
    one-line messages for the user (steps lost with a damaged last segment, a rebuild, a warning).

    When `local` holds no journal, it is rebuilt from the segments first (a resume on another host);
    when it holds one, it must hold every shipped step (same hash chain) or it is refused. `claim`:
    the run's writer claim (claim.Claim), held already, checked before every shipment.
    """
    local, shipped = Path(local), Path(shipped)
    if os.path.realpath(local) == os.path.realpath(shipped):
        raise JournalError(f"journal.local_dir {local} is the run's own journal directory; choose a node-local directory")
    notes: list[str] = []
    cached = _current_rebuild(shipped)  # this process's readers had them rebuilt: the same files, read once
    found = cached.found if cached is not None else scan(shipped)
    if found.problem and not found.problem_at_end:
        raise JournalError(f"{found.problem}; the shipped journal is damaged before its last segment "
                           f"(intact through step {found.last_step or 0})")
    other = local_owner(local, shipped) if (local / "data.mdb").is_file() else None
    if other is not None and found.journal_id is not None and other[1] == found.journal_id:
        raise CopiedJournalError(f"journal.local_dir {local} holds the journal of {other[0]}, which still uses it: "
                                 f"{shipped} is a copy of that one, and a copy never writes into its files", other[0], local)
    if not (local / "data.mdb").is_file() and (older := _older_local_copy(shipped, local, found)) is not None:
        old, last = older  # this host still has the previous local journal, ahead of what was shipped: keep its steps
        with Journal.open_reader(old) as j:
            j.copy_to(local)
        notes.append(f"Copied the journal from the previous local directory {old} (steps through {last}, "
                     f"{last - (found.last_step or 0)} not shipped) to {local}")
    if (local / "data.mdb").is_file():
        if not matches(local, shipped, found):
            raise JournalError(f"journal.local_dir {local} holds a journal that does not match the segments in "
                               f"{segment_dir(shipped)} (another run's, or an older copy); empty it or choose another directory")
        if found.problem:  # the local journal still holds what the damaged segment carried: ship it again
            _set_aside(shipped, found.problem_path, claim)
            notes.append(f"{found.problem}; shipping its steps again from {local}")
            found = SegmentScan(segments=found.segments, leftovers=found.leftovers, superseded=found.superseded)
    elif found.segments:
        rebuilt = _rebuild_for_writer(shipped, local, found, cached)
        notes.append(f"Rebuilt the journal in {local} from {len(rebuilt.segments)} segment(s) in {segment_dir(shipped)} "
                     f"(steps through {rebuilt.last_step or 0}, every checksum and the hash chain verified)")
        if rebuilt.problem:
            _set_aside(shipped, rebuilt.problem_path, claim)
            if rebuilt.lost_steps is None:
                notes.append(f"{rebuilt.problem}: it carried no steps; set it aside")
            else:
                a, b = rebuilt.lost_steps
                lost = (f"the steps from {a} on were" if b is None else (f"step {a} was" if a == b else f"steps {a}–{b} were"))
                notes.append(f"{rebuilt.problem}: {lost} lost with it and will be run again")
            found = SegmentScan(segments=found.segments, leftovers=found.leftovers, superseded=found.superseded)
    warning = lmdb_location_warning(local)
    if warning:
        notes.append(warning)
    if claim is not None:
        claim.check()
    write_pointer(shipped, local)  # before the journal exists: a kill in between leaves a run that never started
    journal = Journal.open_writer(local, claim=claim)
    try:
        mine = {OWNER: os.path.realpath(shipped)}  # a moved run's writer takes it over (local_owner)
        if journal.get_meta(JOURNAL_ID) is None:
            mine[JOURNAL_ID] = uuid.uuid4().hex
        if any(journal.get_meta(k) != v for k, v in mine.items()):
            journal.update_meta(mine)
        shipper = Shipper(journal, shipped, max_lag, found, claim, retention)
        shipper.l0_fanout, shipper.fanout = fanout, max(2, fanout // 4)  # fanout 0: never merged
    except BaseException:
        journal.close()
        raise
    journal.add_commit_hook(shipper.on_commit)
    journal.on_close(shipper.close)
    journal.shipper = shipper
    return journal, notes


def _rebuild_for_writer(shipped: Path, local: Path, found: SegmentScan, cached: _Rebuilt | None) -> SegmentScan:
    """Rebuild into `local`. `cached`: this process's current rebuilt copy of these segments, if any.
    The copy stage_for_writer rebuilt beside `local` is renamed into place; one a reader of this
    process rebuilt elsewhere is copied (a resume reads the run's config before it opens the
    writer); else the segments are read."""
    if cached is None:
        return rebuild(shipped, local, tolerate="tail", found=found)
    if cached.staged_for is not None and os.path.realpath(cached.staged_for) == os.path.realpath(local) and _adopt(cached, local):
        _REBUILT.pop(os.path.realpath(segment_dir(shipped)), None)
        return found
    local.mkdir(parents=True, exist_ok=True)
    tmp = local / "data.mdb.tmp"
    shutil.copyfile(cached.path / "data.mdb", tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, local / "data.mdb")
    return found


def _adopt(staged: _Rebuilt, local: Path) -> bool:
    """Rename the staged rebuild to `local` (absent or an empty directory); False when it cannot be
    (a reader still has it open, `local` is a mount point or not empty): the caller copies it."""
    if Journal.is_open_here(staged.path):
        return False
    try:
        if local.is_dir():
            local.rmdir()
        os.replace(staged.path, local)
    except OSError:
        return False
    fsync_dir(local.parent)
    shutil.rmtree(staged.path.parent, ignore_errors=True)
    return True


def _set_aside(shipped: Path, path: Path | None, claim=None) -> None:
    """Move a damaged last segment out of the numbering (kept for inspection as .damaged-NAME)."""
    if claim is not None:
        claim.check()
    if path is not None and path.exists():
        os.replace(path, segment_dir(shipped) / f".damaged-{path.name}")
        fsync_dir(segment_dir(shipped))


def lmdb_location_warning(path: Path) -> str | None:
    """One line when an LMDB journal is about to be written on a network filesystem."""
    fs = network_filesystem(path)
    if fs is None:
        return None
    return (f"warning: the LMDB journal at {path} is on a network filesystem ({fs}), where LMDB's locks and memory map "
            "are not safe; point journal.local_dir to a node-local disk (the run directory then receives shipped segments)")


# ----------------------------------------------------------------------------- the shipper


class Shipper:
    """Ships a writer's commits to RUN/journal/segments from a background thread.

    ``wait(step)`` blocks the training loop until no more than ``max_lag`` committed steps are
    unshipped (``max_lag=0``: every commit is shipped before the next step starts); a node lost at
    any moment then costs at most ``max_lag`` steps plus the one being committed.
    """

    l0_fanout = L0_FANOUT  # compaction's fan-ins (journal.segment_fanout; 0: no compaction)
    fanout = FANOUT

    def __init__(self, journal: Journal, shipped: Path, max_lag: int, found: SegmentScan | None = None, claim=None,
                 retention: bool = False):
        """`found`: the caller's scan of `shipped` (the segments as they are now), when it has one;
        `claim`: the run's writer claim, checked before each segment is published; `retention`:
        whether the run prunes samples (then compacted segments merge further only once pruned)."""
        self.journal = journal
        self.shipped = Path(shipped)
        self.max_lag = max_lag
        self.claim = claim
        self.retention = retention
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
        self._index = [_Entry.of(seg) for seg in found.segments]  # the segment files, in order (no step bytes)
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
                self._meta_digest = _map_digest(seg.meta)
                self._pruned_last = _pruned_of(seg.meta)
            if seg.snapshots is not None:
                self._snap_digest = _map_digest(seg.snapshots)
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

    def close(self, flush: bool = True) -> None:
        """Ship what is left (flush=True), then stop the thread."""
        if flush and self._error is None:
            self.notify()
            try:
                self.wait(self.journal.last_step() + self.max_lag)
                self._wait_idle()
            except JournalError:
                pass
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def _wait_idle(self) -> None:
        with self._cond:
            while self._dirty and self._error is None:
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
            steps, meta, snaps = self.journal.read_cut(self._shipped, MAX_SEGMENT_BYTES)
            if not self._stepped:  # no step shipped yet: the chain starts where this cut's meta says (a fork
                with self._cond:  # records its parent's step and chain after its writer opened)
                    self._shipped, self._chain = _chain_start(meta)
            meta_digest, snap_digest = _map_digest(meta), _map_digest(snaps)
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
                    self._pruned_last = _pruned_of(meta)
                self._meta_digest, self._snap_digest = meta_digest, snap_digest
            wrote = True
        self.seconds_shipping += time.perf_counter() - t0
        self.cpu_seconds += time.thread_time() - c0
        return wrote

    def _publish_next(self, seg: Segment) -> None:
        """Publish the next segment and take it into the shipper's state."""
        _publish(self.shipped, seg, self.claim)
        with self._cond:
            self._index.append(_Entry.of(seg))
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
            merged = _merge([read_segment(e.path) for e in self._index[i:j]], level, self._pruned)
            _publish(self.shipped, merged, self.claim, replace=rewrite,
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
        self._index[i:j] = [_Entry.of(merged)]
        self.compactions += 1
        return True


@dataclass
class _Entry:
    """What the shipper keeps of a segment file to plan compactions (not its bytes)."""

    span: tuple[int, int]
    level: int
    first: int | None
    last: int
    pruned: int
    path: Path

    @classmethod
    def of(cls, seg: Segment) -> _Entry:
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


def _merge(segs: list[Segment], level: int, pruned: int) -> Segment:
    """One segment holding what `segs` (consecutive, checked) hold, the samples of steps through
    `pruned` removed (each record keeps its checksum and place in the chain: StepFrame.without_payload)."""
    frames, prev_chain = [], None
    for seg in segs:
        for k, raw in enumerate(seg.steps):
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


def _pruned_of(meta: dict[bytes, bytes]) -> int:
    raw = meta.get(b"pruned_through")
    return 0 if raw is None else int(unframe_plain(raw, "meta 'pruned_through'"))


def _map_digest(frames: dict[bytes, bytes]) -> bytes:
    return digest(codec.packb(sorted(frames.items())))
