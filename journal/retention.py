"""Retention's cut in a journal: the steps' payloads (their samples) removed through a step, each
step's core, checksum and place in the hash chain kept, and the bound (meta ``pruned_through``)
written in the same transaction. What may be pruned, and the archive that keeps it, is the engine's
(loop.pruning); a v1 frame carries no separate payload and stays as it is.
"""

from __future__ import annotations

from typing import Any

from . import codec
from .errors import JournalError
from .failpoints import failpoint
from .frames import StepFrame, frame_plain, key_step, step_key, unframe_plain
from .lmdb_env import Store
from .meta import Meta

PRUNED_THROUGH = "pruned_through"  # meta: the last step whose payload was removed (0 or absent: none)


class Retention:
    """Pruning an open journal's payloads (``journal.retention``)."""

    def __init__(self, store: Store, meta: Meta):
        self._store = store
        self._meta = meta

    def pruned_through(self) -> int:
        """The last step whose payload retention removed (0: none)."""
        return int(self._meta.get(PRUNED_THROUGH, 0))

    def prune(self, through: int, meta: dict[str, Any] | None = None) -> tuple[int, int]:
        """Remove the payloads of the steps after the last pruned one up to `through` (inclusive),
        keeping each step's core, checksum and chain; set meta ``pruned_through`` and the given
        meta values in the same transaction (all or none). Returns (steps pruned, payload bytes
        freed): LMDB reuses the freed pages."""
        meta_frames = {k.encode(): frame_plain(codec.packb(v)) for k, v in {**(meta or {}), PRUNED_THROUGH: through}.items()}
        store = self._store

        def txn_fn(txn):
            raw = txn.get(PRUNED_THROUGH.encode(), db=store.meta)
            start = (0 if raw is None else int(unframe_plain(raw, f"meta {PRUNED_THROUGH!r}"))) + 1
            if through < start - 1:
                raise JournalError(f"cannot prune through step {through}: steps through {start - 1} are pruned already")
            rewrites, freed = [], 0
            cur = txn.cursor(store.steps)
            if cur.set_range(step_key(start)):
                for key, value in cur:
                    if key_step(key) > through:
                        break
                    frame = StepFrame.parse(value, with_payload=False)
                    if frame.payload_len:
                        rewrites.append((bytes(key), frame.without_payload()))
                        freed += frame.payload_len
            for key, value in rewrites:
                txn.put(key, value, db=store.steps)
            for key, value in meta_frames.items():
                txn.put(key, value, db=store.meta)
            failpoint("journal.prune")  # inside the transaction: nothing of it may stay
            return len(rewrites), freed

        out = store.write(txn_fn)
        store.committed(None)
        return out
