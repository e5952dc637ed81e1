"""What a journal makes durable between two commits, outside the step chain: the `pending`
sub-database (the engine keeps the episodes and agent calls in flight there: loop.ledger). Each
write is its own fsynced transaction; an entry that fails its checksum reads as never written. It is
not shipped with a node-local journal (a resume from the shipped copy makes it again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from . import codec
from .errors import CodecError, JournalError
from .frames import frame_plain, unframe_plain
from .lmdb_env import Store


class Pending:
    """The pending entries of an open journal (``journal.pending``)."""

    def __init__(self, store: Store):
        self._store = store

    def put(self, values: dict[bytes, Any], drop: Iterable[bytes] = (), drop_prefixes: Iterable[bytes] = ()) -> None:
        """Write pending entries (replacing any under the same keys) and delete those under `drop` and every
        one whose key begins with one of `drop_prefixes` (deleted first), in one transaction: durable when
        this returns."""
        frames = {k: frame_plain(codec.packb(v)) for k, v in values.items()}
        db = self._store.pending

        def txn_fn(txn):
            for k in drop:
                txn.delete(k, db=db)
            for prefix in drop_prefixes:
                cur = txn.cursor(db=db)
                found = cur.set_range(prefix)
                while found and bytes(cur.key()).startswith(prefix):
                    found = cur.delete()  # and on to the next entry
            for k, f in frames.items():
                txn.put(k, f, db=db)

        self._store.write(txn_fn)

    def entries(self) -> dict[bytes, Any]:
        """Every pending entry, by key (empty for a journal without the sub-database). An entry that fails
        its checksum is left out: what it held is made again, as if it had never been written."""
        if self._store.pending is None:
            return {}
        out = {}
        with self._store.read() as txn:
            for k, v in txn.cursor(self._store.pending):
                with contextlib.suppress(JournalError, CodecError):
                    out[bytes(k)] = unframe_plain(v, "a pending entry")
        return out
