"""The journal store: one LMDB environment per run, one write transaction per step.

Layout of ``RUN/journal/``::

    data.mdb, lock.mdb   LMDB environment with three named sub-databases:
        steps       key: step as 8-byte big-endian; value: a framed step record
        meta        key: utf-8 name;                value: a framed msgpack value
        snapshots   key: step as 8-byte big-endian; value: a framed msgpack map
        summary     key: step as 8-byte big-endian; value: the step's small events (declared `summary`),
                    framed, written in the same transaction: metrics queries skip the samples.
                    Only for v1 records: a v2 record's core is its summary (read without touching
                    the payload's pages), so v2 steps have no entry here
    writer.lock          OS-level exclusive lock (flock) held by the one writer;
                         its content names the holder (pid, host, command)

The records' bytes (step frames, meta and snapshot frames, step keys) are :mod:`verlj.journal.frames`'s;
this module holds the environment, its transactions and the one writer's lock.

Rules from py-lmdb's documentation that this module keeps: one environment
per path per process (shared through ``_ENVS``), opened in the process that
uses it (never inherited across fork); every transaction in a ``with``;
commits fsynced (LMDB's default; sync is never turned off); the map grows here and
only here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb

from . import codec
from .durable import fsync_dir, fsync_file
from .errors import CodecError, JournalError, JournalLockedError, NotAJournalError, StepOrderError
from .events import StepRecord, summary_types, upcast_event
from .failpoints import failpoint
from .frames import (
    DEFAULT_COMPRESSION_LEVEL,
    GENESIS,
    HASH_LEN,
    MAGIC_STEP,
    MAGIC_STEP2,
    STEP_HEADER,
    STEP_HEADER2,
    StepFrame,
    _summary_frame,
    decode_core,
    decode_frame,
    frame_plain,
    frame_step2,
    key_step,
    split_payload,
    step_key,
    unframe_plain,
)
from .space import files_under, write_failure_cause

if TYPE_CHECKING:
    from .shipper import Shipper

SHAPES = "shapes"  # meta: the journal's interned core shapes (codec.Shapes), as the cores declare them

# meta keys of the chain's start (Journal.start_after): a fork's journal begins after its parent's step
BASE_STEP, CHAIN_BASE = "base_step", "chain_base"

DB_STEPS = b"steps"
DB_META = b"meta"
DB_SNAPSHOTS = b"snapshots"
DB_SUMMARY = b"summary"
DB_PENDING = b"pending"

DEFAULT_MAP_SIZE = 256 << 20
READ_CHUNK = 64  # records per read transaction when streaming

# ----------------------------------------------------------------------------- environments

_ENVS: dict[str, list] = {}  # realpath -> [env, pid, writable, open handles]
_ENVS_LOCK = threading.Lock()


def _open_env(path: Path, *, writable: bool, map_size: int) -> lmdb.Environment:
    """The process's one environment for `path` (shared by every Journal handle on it)."""
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        cached = _ENVS.get(key)
        if cached is not None:
            env, pid, cached_writable, _refs = cached
            if pid == os.getpid() and (cached_writable or not writable):
                cached[3] += 1
                return env
            if pid == os.getpid():
                raise JournalError(f"journal {path} is already open read-only in this process; close it first")
            # inherited across fork: never touch the parent's environment
            del _ENVS[key]
        env = lmdb.open(
            str(path),
            map_size=map_size,
            max_dbs=8,
            subdir=True,
            readonly=not writable,
            create=writable,
            lock=True,
            readahead=False,
            meminit=False,
        )
        env.reader_check()  # clear reader slots left by dead processes
        _check_not_truncated(env, path)
        _ENVS[key] = [env, os.getpid(), writable, 1]
        return env


def _check_not_truncated(env: lmdb.Environment, path: Path) -> None:
    """LMDB maps the file; touching a page past its end kills the process with SIGBUS. Opening reads
    only the meta pages, so compare the last page they name with the file's length first."""
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    have = os.path.getsize(Path(path) / "data.mdb")
    if have < need:
        env.close()
        raise JournalError(
            f"journal {path} is truncated: data.mdb has {have} bytes but its last committed page ends at byte {need}"
        )


def _close_env(path: Path) -> None:
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        cached = _ENVS.get(key)
        if cached is None or cached[1] != os.getpid():
            return
        cached[3] -= 1
        if cached[3] > 0:
            return
        del _ENVS[key]
    cached[0].close()


def _describe_holder(lock_path: Path) -> str:
    try:
        text = lock_path.read_text().strip()
    except OSError:
        text = ""
    return text or "another process"


class Journal:
    """An open journal. Use :meth:`open_writer` (one per run, exclusive) or :meth:`open_reader`."""

    def __init__(self, path: Path, env: lmdb.Environment, *, writable: bool, lock_fd: int | None):
        self.path = path
        self._env = env
        self.writable = writable
        self._lock_fd = lock_fd
        self._closed = False
        self._write_lock = threading.Lock()
        self._steps = env.open_db(DB_STEPS, create=writable)
        self._meta = env.open_db(DB_META, create=writable)
        self._snaps = env.open_db(DB_SNAPSHOTS, create=writable)
        self._summary = env.open_db(DB_SUMMARY, create=writable)
        self._pending = self._open_optional(DB_PENDING)
        self._commit_hooks: list = []  # fn(step | None) after each committed write (segments.Shipper)
        self._close_hooks: list = []
        self.shipper: Shipper | None = None  # a segments.Shipper when the journal is shipped to a run directory
        self.claim = None  # a claim.Claim: the run's writer slot, checked before every write (fencing)
        self.shipped_problem: str | None = None  # set by segments.open_reader: damage found in the segments
        self.compression_level = DEFAULT_COMPRESSION_LEVEL  # zstd level of step payloads written from now on
        self._shape_table: codec.Shapes | None = None  # loaded from meta SHAPES on first use

    def _open_optional(self, name: bytes):
        """A sub-database newer than some journals: created by a writer, None for a reader of a journal
        that never had it."""
        try:
            return self._env.open_db(name, create=self.writable)
        except lmdb.NotFoundError:
            return None

    # ------------------------------------------------------------------ opening

    @classmethod
    def open_writer(cls, path: str | os.PathLike, *, map_size: int = DEFAULT_MAP_SIZE, claim=None) -> Journal:
        """Open (creating if needed) the journal for appending. Refuses at once if another process writes it.
        `claim`: the run's writer claim (journal.claim), checked before every write and released on close."""
        path = Path(path)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JournalError(f"cannot create journal directory {path}: {e.strerror}") from None
        lock_path = path / "writer.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JournalLockedError(
                f"journal {path} is being written by {_describe_holder(lock_path)}; "
                "stop that process first (only one writer per run)"
            ) from None
        holder = f"pid {os.getpid()} on {socket.gethostname()} ({' '.join(sys.argv)[:200]})"
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        try:
            env = _open_env(path, writable=True, map_size=map_size)
            journal = cls(path, env, writable=True, lock_fd=fd)
        except lmdb.Error as e:
            os.close(fd)
            raise JournalError(f"cannot open journal {path}: {e}") from None
        if claim is not None:
            journal.claim = claim
            journal.on_close(claim.release)  # registered first, so it runs after every later close hook (a last shipment)
        return journal

    @staticmethod
    def is_open_here(path: str | os.PathLike) -> bool:
        """Whether this process has the journal at `path` open (a reader or the writer)."""
        cached = _ENVS.get(os.path.realpath(path))
        return cached is not None and cached[1] == os.getpid()

    @classmethod
    def open_reader(cls, path: str | os.PathLike) -> Journal:
        """Open an existing journal read-only. Works while a writer appends; each read sees a committed prefix."""
        path = Path(path)
        if not (path / "data.mdb").is_file():
            raise NotAJournalError(f"no journal at {path} (expected {path / 'data.mdb'})")
        try:
            env = _open_env(path, writable=False, map_size=0)
            return cls(path, env, writable=False, lock_fd=None)
        except lmdb.NotFoundError:
            _close_env(path)
            raise JournalError(f"{path} lacks the journal's sub-databases: not a verlj journal, or one from an incompatible version") from None
        except lmdb.Error as e:
            raise JournalError(f"cannot open journal {path}: {e}") from None

    def copy_to(self, dest: str | os.PathLike) -> None:
        """A consistent copy of this journal's LMDB file into the empty directory `dest` (fsynced)."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        try:
            self._env.copy(str(dest))
        except lmdb.Error as e:
            raise JournalError(f"cannot copy journal {self.path} to {dest}: {e}") from None
        fsync_file(dest / "data.mdb")
        fsync_dir(dest)

    def add_commit_hook(self, fn) -> None:
        """fn(step) after every committed write transaction: step is the last appended step, None for
        meta and snapshot-index writes. Runs in the writing thread, outside the write lock."""
        self._commit_hooks.append(fn)

    def on_close(self, fn) -> None:
        """fn() when the journal closes, before its environment does (last registered runs first)."""
        self._close_hooks.append(fn)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            while self._close_hooks:
                self._close_hooks.pop()()
        finally:
            _close_env(self.path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ transactions

    def _read(self):
        """Begin a read transaction, adopting a map grown by the writer process."""
        try:
            return self._env.begin(buffers=True)
        except lmdb.MapResizedError:
            self._env.set_mapsize(0)
            return self._env.begin(buffers=True)

    def _write(self, fn):
        """Run fn(txn) in one write transaction; grow the map and retry on MapFullError. A writer whose
        claim on the run was taken over writes nothing (claim.FencedError)."""
        assert self.writable, "journal opened read-only"
        if self.claim is not None:
            self.claim.check()
        with self._write_lock:  # the training loop and a background snapshot thread both write
            return self._write_locked(fn)

    def _committed(self, step: int | None) -> None:
        for hook in self._commit_hooks:
            hook(step)

    def _write_locked(self, fn):
        while True:
            try:
                # buffers=True: reading the previous record's chain hash must not copy the whole record
                with self._env.begin(write=True, buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
            except lmdb.Error as e:  # LMDB reports a full disk as EIO or ENOSPC, depending on where it hits
                raise JournalError(self._write_failure(e)) from None

    def _write_failure(self, e: lmdb.Error) -> str:
        cause = write_failure_cause(e, self.path, files_under(self.path))
        if cause is not None:
            return f"journal write failed under {self.path}: {cause}; nothing committed was lost, make room and resume"
        return f"journal write failed: {e}"

    # ------------------------------------------------------------------ writing

    def base_step(self) -> int:
        """The step before the journal's first record (0 for a new run, N for a fork at step N)."""
        return int(self.get_meta(BASE_STEP, 0))

    def start_after(self, step: int, chain: str, meta: dict[str, Any] | None = None) -> None:
        """Make this empty journal continue another's hash chain: its first record will be step + 1,
        chained to `chain` (the other journal's chain hash after `step`; a fork). Written with the
        given meta values in one transaction."""
        if self.num_steps():
            raise JournalError(f"journal {self.path} already holds steps; only an empty journal can start after another's step")
        self.update_meta({**(meta or {}), BASE_STEP: step, CHAIN_BASE: chain})

    def append_step(self, step: int, events: list[dict], *, wall_time: float | None = None) -> str:
        """Append one step's events in one transaction. Returns the record's chain hash (hex)."""
        return self.append_steps([(step, events)], wall_time=wall_time)[-1]

    def append_steps(self, steps: list[tuple[int, list[dict]]], *, wall_time: float | None = None) -> list[str]:
        """Append consecutive steps in one transaction (all or none). Returns their chain hashes (hex)."""
        now = time.time() if wall_time is None else wall_time
        level = self.compression_level
        split = [(step, split_payload(ev, level)) for step, ev in steps]  # compression outside the transaction

        def txn_fn(txn):
            if self._shape_table is None:
                raw = txn.get(SHAPES.encode(), db=self._meta)
                self._shape_table = codec.Shapes([] if raw is None else unframe_plain(raw, f"meta {SHAPES!r}"))
            shapes = self._shape_table
            mark = len(shapes)
            try:
                return self._append_txn(txn, [(step, codec.pack_core(step, now, ev, desc, shapes), payload)
                                              for step, (ev, payload, desc) in split], shapes, mark)
            except BaseException:
                shapes.truncate(mark)  # not committed: the shapes it declared were never declared
                raise

        chains = self._write(txn_fn)
        failpoint("journal.after_commit")
        self._committed(steps[-1][0] if steps else None)
        return chains

    def _append_txn(self, txn, bodies: list[tuple[int, bytes, bytes]], shapes: codec.Shapes, mark: int) -> list[str]:
        cur = txn.cursor(self._steps)
        if cur.last():
            last = key_step(cur.key())
            prev_chain = bytes(cur.value()[len(MAGIC_STEP) + HASH_LEN : STEP_HEADER])
        else:
            last = self._base_step_txn(txn)
            prev_chain = self._chain_base_txn(txn)
        chains = []
        for step, core, payload in bodies:
            if step != last + 1:
                raise StepOrderError(
                    f"cannot append step {step}: the journal's last step is {last}, so the next must be {last + 1}"
                )
            value = frame_step2(core, payload, prev_chain)
            txn.put(step_key(step), value, db=self._steps, append=True)
            prev_chain = value[len(MAGIC_STEP) + HASH_LEN : STEP_HEADER]
            chains.append(prev_chain.hex())
            last = step
        if len(shapes) > mark:  # the table as the committed cores declare it, in the same transaction
            txn.put(SHAPES.encode(), frame_plain(codec.packb([list(e) for e in shapes.entries])), db=self._meta)
        failpoint("journal.before_commit")  # inside the transaction: the step must vanish
        return chains

    def _shapes(self, reload: bool = False) -> codec.Shapes:
        """The journal's interned core shapes (from meta SHAPES; reload: read again, for a reader
        behind its writer)."""
        if self._shape_table is None or reload:
            self._shape_table = codec.Shapes(self.get_meta(SHAPES, []))
        return self._shape_table

    def _decode_with_shapes(self, fn):
        """fn(shapes), read again with the table reloaded once if a core uses a shape it lacks."""
        try:
            return fn(self._shapes())
        except codec.UnknownShapeError:
            if self.writable:
                raise
            return fn(self._shapes(reload=True))

    def prune(self, through: int, meta: dict[str, Any] | None = None) -> tuple[int, int]:
        """Remove the payloads of the steps after the last pruned one up to `through` (inclusive),
        keeping each step's core, checksum and chain; set meta ``pruned_through`` and the given
        meta values in the same transaction (all or none). v1 frames carry no separate payload and
        stay as they are. Returns (steps pruned, payload bytes freed): LMDB reuses the freed pages."""
        meta_frames = {k.encode(): frame_plain(codec.packb(v)) for k, v in {**(meta or {}), "pruned_through": through}.items()}

        def txn_fn(txn):
            raw = txn.get(b"pruned_through", db=self._meta)
            start = (0 if raw is None else int(unframe_plain(raw, "meta 'pruned_through'"))) + 1
            if through < start - 1:
                raise JournalError(f"cannot prune through step {through}: steps through {start - 1} are pruned already")
            rewrites, freed = [], 0
            cur = txn.cursor(self._steps)
            if cur.set_range(step_key(start)):
                for key, value in cur:
                    if key_step(key) > through:
                        break
                    frame = StepFrame.parse(value, with_payload=False)
                    if frame.payload_len:
                        rewrites.append((bytes(key), frame.without_payload()))
                        freed += frame.payload_len
            for key, value in rewrites:
                txn.put(key, value, db=self._steps)
            for key, value in meta_frames.items():
                txn.put(key, value, db=self._meta)
            failpoint("journal.prune")  # inside the transaction: nothing of it may stay
            return len(rewrites), freed

        out = self._write(txn_fn)
        self._committed(None)
        return out

    def pruned_through(self) -> int:
        """The last step whose payload retention removed (0: none)."""
        return int(self.get_meta("pruned_through", 0))

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

        def txn_fn(txn):
            for i, raw in enumerate(stored):
                txn.put(step_key(base + i), raw, db=self._steps, append=True)
                if summaries[i] is not None:
                    txn.put(step_key(base + i), summaries[i], db=self._summary, append=True)
            for db, values in ((self._meta, meta), (self._snaps, snapshots)):
                if values is not None:
                    txn.drop(db, delete=False)
                    for k, v in sorted(values.items()):
                        txn.put(bytes(k), bytes(v), db=db)

        self._write(txn_fn)
        self._shape_table = None  # the meta may have been replaced

    def _base_step_txn(self, txn) -> int:
        raw = txn.get(BASE_STEP.encode(), db=self._meta)
        return 0 if raw is None else int(unframe_plain(raw, f"meta {BASE_STEP!r}"))

    def _chain_base_txn(self, txn) -> bytes:
        raw = txn.get(CHAIN_BASE.encode(), db=self._meta)
        return GENESIS if raw is None else bytes.fromhex(unframe_plain(raw, f"meta {CHAIN_BASE!r}"))

    def set_meta(self, name: str, value: Any) -> None:
        frame = frame_plain(codec.packb(value))
        self._write(lambda txn: txn.put(name.encode(), frame, db=self._meta))
        self._committed(None)

    def update_meta(self, values: dict[str, Any]) -> None:
        frames = {k.encode(): frame_plain(codec.packb(v)) for k, v in values.items()}

        def txn_fn(txn):
            for k, f in frames.items():
                txn.put(k, f, db=self._meta)

        self._write(txn_fn)
        self._committed(None)

    def add_snapshot(self, step: int, info: dict) -> None:
        """Enter a published snapshot in the index (call only once its files are durable)."""
        frame = frame_plain(codec.packb(info))
        self._write(lambda txn: txn.put(step_key(step), frame, db=self._snaps))
        self._committed(None)

    def remove_snapshot(self, step: int) -> None:
        self._write(lambda txn: txn.delete(step_key(step), db=self._snaps))
        self._committed(None)

    def put_pending(self, values: dict[bytes, Any], drop=(), drop_prefixes=()) -> None:
        """Write pending entries (replacing any under the same keys) and delete those under `drop` and every
        one whose key begins with one of `drop_prefixes` (deleted first), in one transaction: durable when
        this returns. Outside the step chain (see the module's doc)."""
        frames = {k: frame_plain(codec.packb(v)) for k, v in values.items()}

        def txn_fn(txn):
            for k in drop:
                txn.delete(k, db=self._pending)
            for prefix in drop_prefixes:
                cur = txn.cursor(db=self._pending)
                found = cur.set_range(prefix)
                while found and bytes(cur.key()).startswith(prefix):
                    found = cur.delete()  # and on to the next entry
            for k, f in frames.items():
                txn.put(k, f, db=self._pending)

        self._write(txn_fn)

    def pending(self) -> dict[bytes, Any]:
        """Every pending entry, by key (empty for a journal without the sub-database). An entry that fails
        its checksum is left out: what it held is made again, as if it had never been written."""
        if self._pending is None:
            return {}
        out = {}
        with self._read() as txn:
            for k, v in txn.cursor(self._pending):
                with contextlib.suppress(JournalError, CodecError):
                    out[bytes(k)] = unframe_plain(v, "a pending entry")
        return out

    def make_durable(self) -> None:
        """Return once every write so far is in the copy a recovery would read: at once for a journal in
        the run directory (each commit is fsynced), after the shipper has shipped it and sealed it with
        a later segment for a shipped one (a recovery drops a damaged last segment: what it carried
        must not be all that made a deletion safe). Call before deleting anything the previous state
        of the journal still needs."""
        if self.shipper is not None:
            self.shipper.flush(sealed=True)

    # ------------------------------------------------------------------ reading

    def last_step(self) -> int:
        """The last committed step (``base_step()`` when no step is committed yet)."""
        with self._read() as txn:
            cur = txn.cursor(self._steps)
            return key_step(cur.key()) if cur.last() else self._base_step_txn(txn)

    def first_step(self) -> int | None:
        with self._read() as txn:
            cur = txn.cursor(self._steps)
            return key_step(cur.key()) if cur.first() else None

    def num_steps(self) -> int:
        with self._read() as txn:
            return txn.stat(self._steps)["entries"]

    def read_raw(self, step: int) -> bytes | None:
        with self._read() as txn:
            raw = txn.get(step_key(step), db=self._steps)
            return None if raw is None else bytes(raw)

    def read_step(self, step: int) -> StepRecord:
        """One step's record, checksum-checked and upcast. Raises JournalError if absent or damaged."""
        raw = self.read_raw(step)
        if raw is None:
            raise JournalError(f"step {step} is not in the journal {self.path} (last committed step: {self.last_step()})")
        return self._decode(step, raw)

    def chain_hash(self, step: int) -> str | None:
        raw = self.read_raw(step)
        return None if raw is None else StepFrame.parse(raw).chain.hex()

    def _decode(self, step: int, raw: bytes, payload: bool = True) -> StepRecord:
        frame = StepFrame.parse(raw)
        if not frame.checksum_ok():
            raise JournalError(f"journal record for step {step} is damaged (checksum mismatch); run `verlj verify`")
        record = self._decode_with_shapes(lambda shapes: decode_frame(frame, payload, shapes))
        if record.step != step:
            raise JournalError(f"journal record stored at step {step} says it is step {record.step}; run `verlj verify`")
        return record

    def iter_raw(self, start: int | None = None, stop: int | None = None) -> Iterator[tuple[int, bytes]]:
        """Stream (step, raw frame) for start <= step <= stop in short read transactions (constant memory)."""
        return self._iter_db(self._steps, start, stop, READ_CHUNK)

    def _iter_db(self, db, start: int | None, stop: int | None, chunk: int, take=None) -> Iterator[tuple[int, Any]]:
        """(step, value) for start <= step <= stop, `chunk` entries per read transaction: a reader never
        pins old pages for long, and each chunk sees a committed prefix of an append-only log.
        take(txn, step, value) -> what to keep of a value (default: a copy of it)."""
        next_key = step_key(start if start is not None else 0)
        while True:
            batch = []
            with self._read() as txn:
                cur = txn.cursor(db)
                if not cur.set_range(next_key):
                    return
                for key, value in cur:
                    s = key_step(key)
                    if stop is not None and s > stop:
                        break
                    batch.append((s, bytes(value) if take is None else take(txn, s, value)))
                    if len(batch) >= chunk:
                        break
            yield from batch
            if len(batch) < chunk or (stop is not None and batch[-1][0] >= stop):
                return
            next_key = step_key(batch[-1][0] + 1)

    def iter_steps(self, start: int | None = None, stop: int | None = None, payload: bool = True) -> Iterator[StepRecord]:
        """Stream decoded, upcast records for start <= step <= stop (payload=False: without the payload
        fields, which are then not even decompressed)."""
        for step, raw in self.iter_raw(start, stop):
            yield self._decode(step, raw, payload)

    def iter_events(self, type_: str, start: int | None = None, stop: int | None = None) -> Iterator[tuple[int, dict]]:
        """Stream (step, event) for every event of one type in a range."""
        for record in self.iter_steps(start, stop):
            for event in record.all(type_):
                yield record.step, event

    def read_summary(self, step: int) -> StepRecord | None:
        """A step's small events (metrics, state, data, rng, control, config) without its samples."""
        with self._read() as txn:
            value = txn.get(step_key(step), db=self._steps)
            source = None if value is None else self._summary_source(txn, step, value)
        return None if source is None else self._summary_decode(step, source)

    def iter_summaries(self, start: int | None = None, stop: int | None = None) -> Iterator[StepRecord]:
        """Stream summaries for start <= step <= stop: what metrics, find and diff read."""
        for step, source in self._iter_db(self._steps, start, stop, READ_CHUNK * 4, self._summary_source):
            summary = self._summary_decode(step, source)
            if summary is not None:
                yield summary

    def _summary_source(self, txn, step: int, value) -> tuple[int, bytes | None]:
        """(1, the v1 record's summary entry) or (2, the v2 record's core, checksum checked): copies
        the core's bytes only, never the payload's."""
        if len(value) < STEP_HEADER2 or bytes(value[: len(MAGIC_STEP2)]) != MAGIC_STEP2:
            raw = txn.get(step_key(step), db=self._summary)
            return 1, None if raw is None else bytes(raw)
        frame = StepFrame.parse(value, with_payload=False)
        if not frame.core_ok():
            raise JournalError(f"journal record for step {step} is damaged (checksum mismatch); run `verlj verify`")
        return 2, frame.body

    def _summary_decode(self, step: int, source: tuple[int, bytes | None]) -> StepRecord | None:
        """A step's summary: its record with only its small events (declared `summary`), upcast."""
        version, raw = source
        if raw is None:
            return None
        d = unframe_plain(raw, f"summary of step {step}") if version == 1 else self._decode_with_shapes(lambda shapes: decode_core(raw, shapes))
        return StepRecord(d["step"], d["time"], [upcast_event(e) for e in d["events"] if e["type"] in summary_types()])

    def get_meta(self, name: str, default: Any = None) -> Any:
        with self._read() as txn:
            raw = txn.get(name.encode(), db=self._meta)
            return default if raw is None else unframe_plain(raw, f"meta {name!r}")

    def meta(self) -> dict[str, Any]:
        with self._read() as txn:
            return {bytes(k).decode(): unframe_plain(v, f"meta {bytes(k).decode()!r}") for k, v in txn.cursor(self._meta)}

    def read_cut(self, after: int, max_bytes: int) -> tuple[list[bytes], dict[bytes, bytes], dict[bytes, bytes]]:
        """A consistent cut of the journal, read in one transaction: the stored frames of the steps after
        `after` (up to about `max_bytes`, at least one), and the meta and snapshot sub-databases as they
        were at that moment. What one shipped segment carries: its metadata is never older than its steps."""
        frames, size = [], 0
        with self._read() as txn:
            cur = txn.cursor(self._steps)
            if cur.set_range(step_key(after + 1)):
                for _key, value in cur:
                    frames.append(bytes(value))
                    size += len(value)
                    if size >= max_bytes:
                        break
            meta = {bytes(k): bytes(v) for k, v in txn.cursor(self._meta)}
            snaps = {bytes(k): bytes(v) for k, v in txn.cursor(self._snaps)}
        return frames, meta, snaps

    def snapshots(self) -> dict[int, dict]:
        """The snapshot index: step -> info, oldest first."""
        with self._read() as txn:
            return {key_step(k): unframe_plain(v, f"snapshot index entry {key_step(k)}") for k, v in txn.cursor(self._snaps)}

    # ------------------------------------------------------------------ for verify

    def env(self) -> lmdb.Environment:
        return self._env

    def dbs(self) -> dict[str, Any]:
        dbs = {"steps": self._steps, "meta": self._meta, "snapshots": self._snaps, "summary": self._summary}
        return dbs if self._pending is None else {**dbs, "pending": self._pending}
