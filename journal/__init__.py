"""verlj.journal: the append-only, hash-chained LMDB event log of a run.

Knows nothing of torch or RL. Typical use::

    from verlj.journal import Journal, make_event
    with Journal.open_writer("runs/demo/journal") as j:
        j.append_step(1, [make_event("metrics", values={"actor/pg_loss": 0.1})])
    with Journal.open_reader("runs/demo/journal") as j:
        for record in j.iter_steps(1, 10): ...
"""

from .codec import packb, unpackb
from .errors import (
    CodecError,
    JournalError,
    JournalLockedError,
    NotAJournalError,
    SchemaError,
    StepOrderError,
)
from .events import EVENT_VERSIONS, make_event, upcast_event, upcast_record
from .store import Journal
from .verify import JournalReport, Problem, verify_journal

__all__ = [
    "CodecError",
    "EVENT_VERSIONS",
    "Journal",
    "JournalError",
    "JournalLockedError",
    "JournalReport",
    "NotAJournalError",
    "Problem",
    "SchemaError",
    "StepOrderError",
    "make_event",
    "packb",
    "unpackb",
    "upcast_event",
    "upcast_record",
    "verify_journal",
]
