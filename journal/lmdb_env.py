"""A journal's LMDB environment: the process's one environment per path, and :class:`Store`, its
sub-databases and transactions, which every part of an open journal (:mod:`verlj.journal.store`)
reads and writes through.

Layout of the environment (``RUN/journal/``, or journal.local_dir)::

    data.mdb, lock.mdb   LMDB environment with these named sub-databases:
        steps       key: step as 8-byte big-endian; value: a framed step record
        meta        key: utf-8 name;                value: a framed msgpack value
        snapshots   key: step as 8-byte big-endian; value: a framed msgpack map
        summary     key: step as 8-byte big-endian; value: the step's small events (declared `summary`),
                    framed, written in the same transaction: metrics queries skip the samples.
                    Only for v1 records: a v2 record's core is its summary (read without touching
                    the payload's pages), so v2 steps have no entry here
        pending     key: bytes; value: a framed msgpack value written between two commits, outside the
                    step chain (journal.pending)
    writer.lock          OS-level exclusive lock (flock) held by the one writer;
                         its content names the holder (pid, host, command)

Rules from py-lmdb's documentation that this module keeps: one environment per path per process
(shared through ``_ENVS``), opened in the process that uses it (never inherited across fork); every
transaction in a ``with``; commits fsynced (LMDB's default; sync is never turned off); the map grows
here and only here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from . import codec
from .errors import JournalError
from .frames import GENESIS, key_step, step_key, unframe_plain
from .space import files_under, write_failure_cause

SHAPES = "shapes"  # meta: the journal's interned core shapes (codec.Shapes), as the cores declare them

# meta keys of the chain's start (StepWriter.start_after): a fork's journal begins after its parent's step
BASE_STEP, CHAIN_BASE = "base_step", "chain_base"

DB_STEPS = b"steps"
DB_META = b"meta"
DB_SNAPSHOTS = b"snapshots"
DB_SUMMARY = b"summary"
DB_PENDING = b"pending"

DEFAULT_MAP_SIZE = 256 << 20
READ_CHUNK = 64  # records per read transaction when streaming

T = TypeVar("T")

# ----------------------------------------------------------------------------- environments

_ENVS: dict[str, list] = {}  # realpath -> [env, pid, writable, open handles]
_ENVS_LOCK = threading.Lock()


def open_env(path: Path, *, writable: bool, map_size: int) -> lmdb.Environment:
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


def close_env(path: Path) -> None:
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


def is_open_here(path: str | os.PathLike) -> bool:
    """Whether this process has the environment at `path` open (a reader or the writer)."""
    cached = _ENVS.get(os.path.realpath(path))
    return cached is not None and cached[1] == os.getpid()


# ----------------------------------------------------------------------------- one environment


class Store:
    """One journal's environment: its sub-databases, its transactions (a read sees a committed prefix; a
    write is one transaction, the map grown and the write retried when it is full, fenced by the run's
    writer claim), the hooks after each commit, and the journal's interned core shapes. Knows nothing
    of what the records mean: the journal's parts (steps, meta, retention, pending, shipping) do."""

    def __init__(self, path: Path, env: lmdb.Environment, *, writable: bool, claim: Any = None):
        self.path = path
        self.writable = writable
        self._env = env
        self._write_lock = threading.Lock()
        self.steps = env.open_db(DB_STEPS, create=writable)
        self.meta = env.open_db(DB_META, create=writable)
        self.snaps = env.open_db(DB_SNAPSHOTS, create=writable)
        self.summary = env.open_db(DB_SUMMARY, create=writable)
        self.pending = self._open_optional(DB_PENDING)
        self._commit_hooks: list[Callable[[int | None], None]] = []  # fn(step | None) after each committed write (the Shipper)
        self.claim = claim  # a claim.Claim: the run's writer slot, checked before every write (fencing); None: unclaimed
        self.shape_table: codec.Shapes | None = None  # loaded from meta SHAPES on first use

    def _open_optional(self, name: bytes):
        """A sub-database newer than some journals: created by a writer, None for a reader of a journal
        that never had it."""
        try:
            return self._env.open_db(name, create=self.writable)
        except lmdb.NotFoundError:
            return None

    # ------------------------------------------------------------------ transactions

    def read(self):
        """Begin a read transaction, adopting a map grown by the writer process."""
        try:
            return self._env.begin(buffers=True)
        except lmdb.MapResizedError:
            self._env.set_mapsize(0)
            return self._env.begin(buffers=True)

    def fence(self) -> None:
        """Raise claim.FencedError unless this process still holds the run's writer claim (when it has one)."""
        if self.claim is not None:
            self.claim.check()

    def write(self, fn: Callable[[Any], T]) -> T:
        """Run fn(txn) in one write transaction; grow the map and retry on MapFullError. A writer whose
        claim on the run was taken over writes nothing (claim.FencedError)."""
        assert self.writable, "journal opened read-only"
        self.fence()
        with self._write_lock:  # the training loop and a background snapshot thread both write
            return self._write_locked(fn)

    def _write_locked(self, fn: Callable[[Any], T]) -> T:
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

    def add_commit_hook(self, fn: Callable[[int | None], None]) -> None:
        """fn(step) after every committed write transaction: step is the last appended step, None for
        meta and snapshot-index writes. Runs in the writing thread, outside the write lock."""
        self._commit_hooks.append(fn)

    def committed(self, step: int | None) -> None:
        for hook in self._commit_hooks:
            hook(step)

    def copy(self, dest: Path) -> None:
        """LMDB's consistent copy of the environment into the directory `dest`."""
        try:
            self._env.copy(str(dest))
        except lmdb.Error as e:
            raise JournalError(f"cannot copy journal {self.path} to {dest}: {e}") from None

    # ------------------------------------------------------------------ reading within a transaction

    def iter_db(self, db, start: int | None, stop: int | None, chunk: int, take=None) -> Iterator[tuple[int, Any]]:
        """(step, value) for start <= step <= stop, `chunk` entries per read transaction: a reader never
        pins old pages for long, and each chunk sees a committed prefix of an append-only log.
        take(txn, step, value) -> what to keep of a value (default: a copy of it)."""
        next_key = step_key(start if start is not None else 0)
        while True:
            batch = []
            with self.read() as txn:
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

    def base_step_txn(self, txn) -> int:
        raw = txn.get(BASE_STEP.encode(), db=self.meta)
        return 0 if raw is None else int(unframe_plain(raw, f"meta {BASE_STEP!r}"))

    def chain_base_txn(self, txn) -> bytes:
        raw = txn.get(CHAIN_BASE.encode(), db=self.meta)
        return GENESIS if raw is None else bytes.fromhex(unframe_plain(raw, f"meta {CHAIN_BASE!r}"))

    # ------------------------------------------------------------------ the interned core shapes

    def shapes(self, reload: bool = False) -> codec.Shapes:
        """The journal's interned core shapes (from meta SHAPES; reload: read again, for a reader
        behind its writer)."""
        if self.shape_table is None or reload:
            with self.read() as txn:
                raw = txn.get(SHAPES.encode(), db=self.meta)
                self.shape_table = codec.Shapes([] if raw is None else unframe_plain(raw, f"meta {SHAPES!r}"))
        return self.shape_table

    def forget_shapes(self) -> None:
        """The meta the shapes are read from was replaced (a rebuild's restore): read them again at their next use."""
        self.shape_table = None

    def shapes_txn(self, txn) -> codec.Shapes:
        """The shapes as a write transaction sees them (loaded in it on first use)."""
        if self.shape_table is None:
            raw = txn.get(SHAPES.encode(), db=self.meta)
            self.shape_table = codec.Shapes([] if raw is None else unframe_plain(raw, f"meta {SHAPES!r}"))
        return self.shape_table

    def decode_with_shapes(self, fn: Callable[[codec.Shapes], T]) -> T:
        """fn(shapes), read again with the table reloaded once if a core uses a shape it lacks."""
        try:
            return fn(self.shapes())
        except codec.UnknownShapeError:
            if self.writable:
                raise
            return fn(self.shapes(reload=True))

    # ------------------------------------------------------------------ for verify

    def env(self) -> lmdb.Environment:
        return self._env

    def dbs(self) -> dict[str, Any]:
        dbs = {"steps": self.steps, "meta": self.meta, "snapshots": self.snaps, "summary": self.summary}
        return dbs if self.pending is None else {**dbs, "pending": self.pending}
