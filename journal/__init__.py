"""verlj.journal: the append-only, hash-chained LMDB event log of a run.

Knows nothing of torch or RL: the event types a journal holds are declared to it (``declare``) by
the code that owns them; verlj's step events by ``verlj.engine.schema.events``, which importing
``verlj.engine`` loads. Typical use::

    import verlj.engine  # declares verlj's event types
    from verlj.journal import Journal, make_event
    with Journal.open_writer("runs/demo/journal") as j:
        j.writer.append_step(1, [make_event("metrics", values={"actor/pg_loss": 0.1})])
    with Journal.open_reader("runs/demo/journal") as j:
        for record in j.iter_steps(1, 10): ...

A run directory's journal is read with ``open_journal_reader(RUN / "journal")``, whichever layout it
has (the LMDB environment in place, or segments shipped from a node-local one: see ``segments``).
"""

from . import claim, segments
from .claim import Claim, FencedError, WriterClaimedError
from .codec import packb, unpackb
from .errors import (
    CodecError,
    JournalError,
    JournalLockedError,
    NotAJournalError,
    SchemaError,
    StepOrderError,
    VerljError,
)
from .events import EventSpec, StepRecord, declare, declared, make_event, upcast_event, upcast_record
from .segments import open_reader as open_journal_reader
from .store import Journal
from .verify import JournalReport, Problem, verify_journal

__all__ = [
    "Claim",
    "CodecError",
    "EventSpec",
    "FencedError",
    "Journal",
    "JournalError",
    "JournalLockedError",
    "JournalReport",
    "NotAJournalError",
    "Problem",
    "SchemaError",
    "StepOrderError",
    "StepRecord",
    "declare",
    "declared",
    "VerljError",
    "make_event",
    "open_journal_reader",
    "segments",
    "packb",
    "unpackb",
    "upcast_event",
    "upcast_record",
    "verify_journal",
    "WriterClaimedError",
    "claim",
]
