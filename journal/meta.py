"""A journal's metadata beside its steps: the `meta` sub-database (named values: what the engine's
ledger keeps there, the chain's start, the interned shapes, retention's bound) and the snapshot index
(step -> a map). Both are outside the hash chain; each value is a plain frame (checksummed msgpack),
and each write is one fsynced transaction.
"""

from __future__ import annotations

from typing import Any

from . import codec
from .frames import frame_plain, key_step, step_key, unframe_plain
from .lmdb_env import Store


class Meta:
    """The meta values and the snapshot index of an open journal (``journal.meta``)."""

    def __init__(self, store: Store):
        self._store = store

    def get(self, name: str, default: Any = None) -> Any:
        with self._store.read() as txn:
            raw = txn.get(name.encode(), db=self._store.meta)
            return default if raw is None else unframe_plain(raw, f"meta {name!r}")

    def all(self) -> dict[str, Any]:
        """Every meta value, by name."""
        with self._store.read() as txn:
            return {bytes(k).decode(): unframe_plain(v, f"meta {bytes(k).decode()!r}") for k, v in txn.cursor(self._store.meta)}

    def set(self, name: str, value: Any) -> None:
        self.update({name: value})

    def update(self, values: dict[str, Any]) -> None:
        """Write these values in one transaction."""
        frames = {k.encode(): frame_plain(codec.packb(v)) for k, v in values.items()}

        def txn_fn(txn):
            for k, f in frames.items():
                txn.put(k, f, db=self._store.meta)

        self._store.write(txn_fn)
        self._store.committed(None)

    def snapshots(self) -> dict[int, dict]:
        """The snapshot index: step -> info, oldest first."""
        with self._store.read() as txn:
            return {key_step(k): unframe_plain(v, f"snapshot index entry {key_step(k)}") for k, v in txn.cursor(self._store.snaps)}

    def add_snapshot(self, step: int, info: dict) -> None:
        """Enter a published snapshot in the index (call only once its files are durable)."""
        frame = frame_plain(codec.packb(info))
        self._store.write(lambda txn: txn.put(step_key(step), frame, db=self._store.snaps))
        self._store.committed(None)

    def remove_snapshot(self, step: int) -> None:
        self._store.write(lambda txn: txn.delete(step_key(step), db=self._store.snaps))
        self._store.committed(None)
