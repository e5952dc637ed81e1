"""Shipped journals: the LMDB environment on node-local disk, sealed segments in the run directory.

LMDB must not live on a network filesystem (its documentation: locking and memory-map coherence
break there), yet the run directory usually does. With ``journal.local_dir`` the one writer keeps
the LMDB environment on local disk and a background :class:`Shipper` copies each commit into the
run directory as an immutable segment (Litestream's model)::

    RUN/journal/
      segments/0000000001-0000000064.seg   shipments 1-64 compacted into one file (verlj.journal.shipper)
      segments/0000000065.seg     sealed, immutable, one per shipment, numbered without gaps
      segments/.tmp-0000000066    a shipment being written (never read; removed on the next start)
      local.json                  where the live LMDB environment is (host, path): readers on that
                                  host use it; anyone else rebuilds from the segments. The LMDB
                                  environment names the RUN/journal it ships to (meta shipped_to): a
                                  copy of the run directory (cp -a carries local.json along) never
                                  writes into or reads it while its original uses it (local_owner);
                                  a moved one takes it over

The segment files (their format, names, publishing and the walk that checks them) are
:mod:`verlj.journal.segment_file`'s, the background copier :mod:`verlj.journal.shipper`'s, the rule
that merges them :mod:`verlj.journal.compaction`'s; this module rebuilds LMDB environments from
them for readers and writers and decides whose local environment is whose.
"""


from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from .claim import process_start
from .compaction import L0_FANOUT, plan_compaction  # noqa: F401
from .durable import fsync_dir, publish_file
from .errors import JournalError
from .frames import DEFAULT_COMPRESSION_LEVEL, unframe_plain
from .lmdb_env import is_open_here
from .segment_file import (  # noqa: F401  (segments.X: the shipped journal's names in one place)
    JOURNAL_ID,
    Segment,
    SegmentScan,
    is_shipped,
    pruned_of,
    read_pointer,
    read_segment,
    scan,
    segment_dir,
    segment_files,
    write_pointer,
)
from .store import Journal

OWNER = "shipped_to"  # meta: the journal directory (RUN/journal, its realpath) the writer ships to: whose local journal it is

# filesystems on which LMDB's locks and shared memory map are not coherent across hosts
NETWORK_FILESYSTEMS = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "cephfs", "glusterfs",
    "fuse.glusterfs", "beegfs", "fuse.sshfs", "9p", "afs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs",
}


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
    pruned_through = pruned_of(meta) if meta else 0
    try:
        with Journal.open_writer(work) as j:
            for seg in found.segments:
                j.shipping.restore(seg.steps, seg.first, None, None, pruned_through=pruned_through)
            j.shipping.restore([], None, meta or {}, snaps or {})
        (work / "writer.lock").unlink(missing_ok=True)
        if dest.exists():
            dest.rmdir()  # only an empty directory (checked above that it holds no journal)
        os.replace(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return found


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
    ``journal.shipping.problem`` then names any damage found.
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
    return Journal.open_reader(rebuilt.path, problem=rebuilt.found.problem)


def _files_state(shipped: Path) -> tuple:
    """The segment files as they are now (name, size, mtime_ns): a rebuilt copy is current while this is unchanged."""
    out = []
    for _a, _b, path in segment_files(shipped):
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
    if (shipped / "data.mdb").is_file() or not segment_files(shipped) or (local / "data.mdb").is_file():
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
    for _a, _b, path in sorted(segment_files(shipped), key=lambda t: t[1], reverse=True):
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
            elif j.meta.get(JOURNAL_ID) != found.journal_id:
                return False
            else:
                last = found.last_step
                same = last is None or (j.last_step() >= last and j.chain_hash(last) == found.last_chain)
            owner = j.meta.get(OWNER)
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
            owner, jid = j.meta.get(OWNER), j.meta.get(JOURNAL_ID)
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
                fanout: int = L0_FANOUT, compression_level: int = DEFAULT_COMPRESSION_LEVEL) -> tuple[Journal, list[str]]:
    """The run's journal writer at `local`, shipping to `shipped`. Returns (journal, notes): notes are
    one-line messages for the user (steps lost with a damaged last segment, a rebuild, a warning).

    When `local` holds no journal, it is rebuilt from the segments first (a resume on another host);
    when it holds one, it must hold every shipped step (same hash chain) or it is refused. `claim`:
    the run's writer claim (claim.Claim), held already, checked before every shipment;
    `compression_level`: the zstd level of the step payloads it writes.
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
            j.shipping.copy_to(local)
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
    journal = Journal.open_writer(local, claim=claim, compression_level=compression_level)
    try:
        mine = {OWNER: os.path.realpath(shipped)}  # a moved run's writer takes it over (local_owner)
        if journal.meta.get(JOURNAL_ID) is None:
            mine[JOURNAL_ID] = uuid.uuid4().hex
        if any(journal.meta.get(k) != v for k, v in mine.items()):
            journal.meta.update(mine)
        journal.shipping.ship_to(shipped, max_lag, found, retention, fanout)
    except BaseException:
        journal.close()
        raise
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
    publish_file(tmp, local / "data.mdb")
    return found


def _adopt(staged: _Rebuilt, local: Path) -> bool:
    """Rename the staged rebuild to `local` (absent or an empty directory); False when it cannot be
    (a reader still has it open, `local` is a mount point or not empty): the caller copies it."""
    if is_open_here(staged.path):
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
