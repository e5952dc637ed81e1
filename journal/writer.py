"""Appending to a journal: each call one write transaction of consecutive steps, each record framed
(:mod:`verlj.journal.frames`: its core and its compressed payload apart) and chained to the one before;
a fork's journal starts after its parent's step, chained to the parent's record there.
"""

from __future__ import annotations

import time
from typing import Any

from . import codec
from .errors import JournalError, StepOrderError
from .failpoints import failpoint
from .frames import (
    DEFAULT_COMPRESSION_LEVEL,
    HASH_LEN,
    MAGIC_STEP,
    STEP_HEADER,
    frame_plain,
    frame_step2,
    key_step,
    split_payload,
    step_key,
)
from .lmdb_env import BASE_STEP, CHAIN_BASE, SHAPES, Store
from .meta import Meta


class StepWriter:
    """The step log's writer of an open journal (``journal.writer``)."""

    def __init__(self, store: Store, meta: Meta, compression_level: int = DEFAULT_COMPRESSION_LEVEL):
        self._store = store
        self._meta = meta
        self.compression_level = compression_level  # the zstd level of the step payloads it writes

    def start_after(self, step: int, chain: str, meta: dict[str, Any] | None = None) -> None:
        """Make this empty journal continue another's hash chain: its first record will be step + 1,
        chained to `chain` (the other journal's chain hash after `step`; a fork). Written with the
        given meta values in one transaction."""
        with self._store.read() as txn:
            held = txn.stat(self._store.steps)["entries"]
        if held:
            raise JournalError(f"journal {self._store.path} already holds steps; only an empty journal can start after another's step")
        self._meta.update({**(meta or {}), BASE_STEP: step, CHAIN_BASE: chain})

    def append_step(self, step: int, events: list[dict], *, wall_time: float | None = None) -> str:
        """Append one step's events in one transaction. Returns the record's chain hash (hex)."""
        return self.append_steps([(step, events)], wall_time=wall_time)[-1]

    def append_steps(self, steps: list[tuple[int, list[dict]]], *, wall_time: float | None = None) -> list[str]:
        """Append consecutive steps in one transaction (all or none). Returns their chain hashes (hex)."""
        now = time.time() if wall_time is None else wall_time
        level = self.compression_level
        split = [(step, split_payload(ev, level)) for step, ev in steps]  # compression outside the transaction

        def txn_fn(txn):
            shapes = self._store.shapes_txn(txn)
            mark = len(shapes)
            try:
                return self._append_txn(txn, [(step, codec.pack_core(step, now, ev, desc, shapes), payload)
                                              for step, (ev, payload, desc) in split], shapes, mark)
            except BaseException:
                shapes.truncate(mark)  # not committed: the shapes it declared were never declared
                raise

        chains = self._store.write(txn_fn)
        failpoint("journal.after_commit")
        self._store.committed(steps[-1][0] if steps else None)
        return chains

    def _append_txn(self, txn, bodies: list[tuple[int, bytes, bytes]], shapes: codec.Shapes, mark: int) -> list[str]:
        db = self._store.steps
        cur = txn.cursor(db)
        if cur.last():
            last = key_step(cur.key())
            prev_chain = bytes(cur.value()[len(MAGIC_STEP) + HASH_LEN : STEP_HEADER])
        else:
            last = self._store.base_step_txn(txn)
            prev_chain = self._store.chain_base_txn(txn)
        chains = []
        for step, core, payload in bodies:
            if step != last + 1:
                raise StepOrderError(
                    f"cannot append step {step}: the journal's last step is {last}, so the next must be {last + 1}"
                )
            value = frame_step2(core, payload, prev_chain)
            txn.put(step_key(step), value, db=db, append=True)
            prev_chain = value[len(MAGIC_STEP) + HASH_LEN : STEP_HEADER]
            chains.append(prev_chain.hex())
            last = step
        if len(shapes) > mark:  # the table as the committed cores declare it, in the same transaction
            txn.put(SHAPES.encode(), frame_plain(codec.packb([list(e) for e in shapes.entries])), db=self._store.meta)
        failpoint("journal.before_commit")  # inside the transaction: the step must vanish
        return chains
