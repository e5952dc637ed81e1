"""Helpers shared by journal tests: realistic step events and raw LMDB tampering."""

from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np

import verlj.engine  # noqa: F401  (declares verlj's event types to the journal: these are its events)
from verlj.journal import make_event
from verlj.journal.frames import step_key


def step_events(step: int, samples: int = 4, tokens: int = 8) -> list[dict]:
    rng = np.random.default_rng(step)
    return [
        make_event("data", epoch=0, cursor=step * 2, indices=np.array([2 * step, 2 * step + 1], dtype=np.int64)),
        make_event("rng", seeds={"rollout": step * 7, "train": step * 11}),
        make_event(
            "buffer.add",
            ids=np.arange(samples, dtype=np.int64) + step * samples,
            samples={
                "response_ids": rng.integers(0, 32000, (samples, tokens), dtype=np.int64),
                "logprobs": rng.standard_normal((samples, tokens)).astype(np.float32),
                "rewards": rng.standard_normal(samples).astype(np.float32),
            },
        ),
        make_event("metrics", values={"actor/pg_loss": float(step) / 3, "critic/score/mean": float("nan")}),
        make_event("state", fingerprint=f"{step:064x}"),
    ]


def tamper(path: Path, fn) -> None:
    """Open the journal's LMDB directly (journal closed) and let fn(txn, steps_db) change it."""
    env = lmdb.open(str(path), max_dbs=4, subdir=True)
    try:
        steps = env.open_db(b"steps", create=False)
        with env.begin(write=True) as txn:
            fn(txn, steps)
    finally:
        env.close()


def raw_get(txn, db, step: int) -> bytes:
    return bytes(txn.get(step_key(step), db=db))


def raw_put(txn, db, step: int, value: bytes) -> None:
    txn.put(step_key(step), value, db=db)
