"""An open journal: :class:`Journal`, one per run's writer (exclusive) or any number of readers.

What a journal holds is read here: its steps in order (each checksum-checked and upcast), and their
summaries (what metrics, find and diff read without the samples). Its other concerns are parts, one
object each, made when it opens::

    journal.store      the LMDB environment (journal.lmdb_env): transactions, map growth, the writer's
                       claim (fencing), the hooks after each commit, the interned core shapes
    journal.writer     appending steps to the hash chain, and where a fork's chain starts (journal.writer)
    journal.meta       the meta values and the snapshot index (journal.meta)
    journal.retention  pruning the steps' payloads (journal.retention)
    journal.pending    what is made durable between two commits, outside the chain (journal.pending)
    journal.shipping   what the shipped layout takes from and gives back to it (journal.shipping)

The records' bytes (step frames, meta and snapshot frames, step keys) are :mod:`verlj.journal.frames`'s,
the environment's layout and its rules :mod:`verlj.journal.lmdb_env`'s. A run directory's journal is
opened through ``verlj.journal.open_journal_reader`` (either layout: :mod:`verlj.journal.segments`).
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import lmdb

from .errors import JournalError, JournalLockedError, NotAJournalError
from .events import StepRecord, summary_types, upcast_event
from .frames import (
    DEFAULT_COMPRESSION_LEVEL,
    MAGIC_STEP2,
    STEP_HEADER2,
    StepFrame,
    decode_core,
    decode_frame,
    key_step,
    step_key,
    unframe_plain,
)
from .lmdb_env import BASE_STEP, DEFAULT_MAP_SIZE, READ_CHUNK, Store, close_env, is_open_here, open_env
from .meta import Meta
from .pending import Pending
from .retention import Retention
from .shipping import Shipping
from .writer import StepWriter


def _describe_holder(lock_path: Path) -> str:
    try:
        text = lock_path.read_text().strip()
    except OSError:
        text = ""
    return text or "another process"


class Journal:
    """An open journal. Use :meth:`open_writer` (one per run, exclusive) or :meth:`open_reader`. Reads
    its steps; its parts (see the module's doc) do the rest."""

    def __init__(self, path: Path, env: lmdb.Environment, *, writable: bool, lock_fd: int | None, claim=None,
                 compression_level: int = DEFAULT_COMPRESSION_LEVEL, problem: str | None = None):
        """`claim`: the run's writer claim (journal.claim), checked before every write; `compression_level`: the
        zstd level of the step payloads written; `problem`: damage found in the segments a reader's copy was
        rebuilt from (segments.open_reader)."""
        self.path = path
        self.writable = writable
        self._lock_fd = lock_fd
        self._closed = False
        self._close_hooks: list = []
        self.store = Store(path, env, writable=writable, claim=claim)
        self.meta = Meta(self.store)
        self.writer = StepWriter(self.store, self.meta, compression_level)
        self.retention = Retention(self.store, self.meta)
        self.pending = Pending(self.store)
        self.shipping = Shipping(self, problem)

    # ------------------------------------------------------------------ opening

    @classmethod
    def open_writer(cls, path: str | os.PathLike, *, map_size: int = DEFAULT_MAP_SIZE, claim=None,
                    compression_level: int = DEFAULT_COMPRESSION_LEVEL) -> Journal:
        """Open (creating if needed) the journal for appending. Refuses at once if another process writes it.
        `claim`: the run's writer claim (journal.claim), checked before every write and released on close;
        `compression_level`: the zstd level of the step payloads it writes (journal.compression_level)."""
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
            env = open_env(path, writable=True, map_size=map_size)
            journal = cls(path, env, writable=True, lock_fd=fd, claim=claim, compression_level=compression_level)
        except lmdb.Error as e:
            os.close(fd)
            raise JournalError(f"cannot open journal {path}: {e}") from None
        if claim is not None:
            journal.on_close(claim.release)  # registered first, so it runs after every later close hook (a last shipment)
        return journal

    @staticmethod
    def is_open_here(path: str | os.PathLike) -> bool:
        """Whether this process has the journal at `path` open (a reader or the writer)."""
        return is_open_here(path)

    @classmethod
    def open_reader(cls, path: str | os.PathLike, problem: str | None = None) -> Journal:
        """Open an existing journal read-only. Works while a writer appends; each read sees a committed prefix.
        `problem`: damage found in the segments it was rebuilt from (``journal.shipping.problem``)."""
        path = Path(path)
        if not (path / "data.mdb").is_file():
            raise NotAJournalError(f"no journal at {path} (expected {path / 'data.mdb'})")
        try:
            env = open_env(path, writable=False, map_size=0)
            return cls(path, env, writable=False, lock_fd=None, problem=problem)
        except lmdb.NotFoundError:
            close_env(path)
            raise JournalError(f"{path} lacks the journal's sub-databases: not a verlj journal, or one from an incompatible version") from None
        except lmdb.Error as e:
            raise JournalError(f"cannot open journal {path}: {e}") from None

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
            close_env(self.path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ reading

    def base_step(self) -> int:
        """The step before the journal's first record (0 for a new run, N for a fork at step N)."""
        return int(self.meta.get(BASE_STEP, 0))

    def last_step(self) -> int:
        """The last committed step (``base_step()`` when no step is committed yet)."""
        with self.store.read() as txn:
            cur = txn.cursor(self.store.steps)
            return key_step(cur.key()) if cur.last() else self.store.base_step_txn(txn)

    def first_step(self) -> int | None:
        with self.store.read() as txn:
            cur = txn.cursor(self.store.steps)
            return key_step(cur.key()) if cur.first() else None

    def num_steps(self) -> int:
        with self.store.read() as txn:
            return txn.stat(self.store.steps)["entries"]

    def read_raw(self, step: int) -> bytes | None:
        with self.store.read() as txn:
            raw = txn.get(step_key(step), db=self.store.steps)
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
        record = self.store.decode_with_shapes(lambda shapes: decode_frame(frame, payload, shapes))
        if record.step != step:
            raise JournalError(f"journal record stored at step {step} says it is step {record.step}; run `verlj verify`")
        return record

    def iter_raw(self, start: int | None = None, stop: int | None = None) -> Iterator[tuple[int, bytes]]:
        """Stream (step, raw frame) for start <= step <= stop in short read transactions (constant memory)."""
        return self.store.iter_db(self.store.steps, start, stop, READ_CHUNK)

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
        with self.store.read() as txn:
            value = txn.get(step_key(step), db=self.store.steps)
            source = None if value is None else self._summary_source(txn, step, value)
        return None if source is None else self._summary_decode(step, source)

    def iter_summaries(self, start: int | None = None, stop: int | None = None) -> Iterator[StepRecord]:
        """Stream summaries for start <= step <= stop: what metrics, find and diff read."""
        for step, source in self.store.iter_db(self.store.steps, start, stop, READ_CHUNK * 4, self._summary_source):
            summary = self._summary_decode(step, source)
            if summary is not None:
                yield summary

    def _summary_source(self, txn, step: int, value) -> tuple[int, bytes | None]:
        """(1, the v1 record's summary entry) or (2, the v2 record's core, checksum checked): copies
        the core's bytes only, never the payload's."""
        if len(value) < STEP_HEADER2 or bytes(value[: len(MAGIC_STEP2)]) != MAGIC_STEP2:
            raw = txn.get(step_key(step), db=self.store.summary)
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
        d = unframe_plain(raw, f"summary of step {step}") if version == 1 else self.store.decode_with_shapes(lambda shapes: decode_core(raw, shapes))
        return StepRecord(d["step"], d["time"], [upcast_event(e) for e in d["events"] if e["type"] in summary_types()])

