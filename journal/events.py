"""Journal event types, their schema versions, and the one place old versions are upcast.

A step record is an envelope::

    {"v": ENVELOPE_VERSION, "step": int, "time": float, "events": [event, ...]}

(envelope v2 adds ``"pruned": bool``: whether the step's payload fields, :data:`PAYLOAD_FIELDS`,
were removed by retention; the store keeps those fields compressed apart from the rest. v3 changes
only how the store encodes the rest, the core: over shapes interned once per journal, see
``codec.pack_core``; the record read back is the same.)

and every event is a map with a ``type`` and a schema version ``v``::

    {"type": "metrics", "v": 1, "values": {"actor/pg_loss": 0.12, ...}}

Writers always write the current version. Readers pass every record through
:func:`upcast_record`, which lifts older versions to the current one (one
function per type and version step) and refuses versions newer than this code.
The journal itself knows nothing of RL: these are names and shapes only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import SchemaError

ENVELOPE_VERSION = 3

# type -> current schema version. Field sketch in the comment; the engine owns meaning.
EVENT_VERSIONS: dict[str, int] = {
    "data": 1,  # epoch, cursor, indices (np.int64[]) drawn this step
    "rng": 1,  # seeds {stream: int}, digests {stream: hex}
    "rollout": 1,  # engine (hf|vllm) that generated the step's samples, version (its package's); async: mode, max_staleness[, async_order]
    "buffer.add": 1,  # ids (np.int64[]), samples {field: array}
    "buffer.consume": 1,  # ids consumed by this step's update
    "buffer.drop": 1,  # ids dropped (e.g. zero-variance groups), reason
    "buffer.plan": 1,  # async rollout: steps, counts, ids (np.int64[]): what each later step will train on
    "buffer.request": 1,  # async completion order: groups, rows asked this step; regenerated: groups asked again (in flight at a stop)
    "metrics": 1,  # values {name: float}
    "state": 1,  # fingerprint (hex str), parts {name: hex}
    "control": 1,  # kind (start|resume|fork), details {...}
    "config": 1,  # config (nested map) now in force, hash, changed keys
    "stages": 1,  # digests {stage: hex}, summary {stage: {n, mean, absmax}}: each stage's output in the step (engine.state.stages)
    "eval": 1,  # rows (np.int64[]: held-out rows), scores (np.float64[]), response_ids (flat np.int32[]), response_len (np.int64[])
}

# Small event types also stored per step in the summary sub-database (same transaction), so that
# metrics, find and diff never decode the samples.
SUMMARY_TYPES = frozenset({"data", "rng", "rollout", "metrics", "state", "control", "config"})

# Fields stored in the step's payload, apart from the rest of the record: compressed, and pruned by
# retention (the event keeps its other fields; ids stay, so a sample's fate is known after pruning).
PAYLOAD_FIELDS: dict[str, tuple[str, ...]] = {"buffer.add": ("samples",)}

# (type, from_version) -> function lifting an event from from_version to from_version + 1.
# Example, when "data" v2 adds "sampler": UPCASTERS[("data", 1)] = lambda e: {**e, "v": 2, "sampler": "perm"}
UPCASTERS: dict[tuple[str, int], Callable[[dict], dict]] = {}

# Envelope versions lift the same way: from_version -> function.
ENVELOPE_UPCASTERS: dict[int, Callable[[dict], dict]] = {
    1: lambda r: {**r, "v": 2, "pruned": False},  # v1 records kept everything inline and were never pruned
    2: lambda r: {**r, "v": 3},  # v3 changed the core's encoding only
}


def make_event(type_: str, **fields) -> dict:
    """Build an event of the current schema version for ``type_``."""
    if type_ not in EVENT_VERSIONS:
        raise SchemaError(f"unknown journal event type {type_!r}; known: {', '.join(sorted(EVENT_VERSIONS))}")
    return {"type": type_, "v": EVENT_VERSIONS[type_], **fields}


def upcast_event(event: dict) -> dict:
    if not isinstance(event, dict) or "type" not in event or "v" not in event:
        raise SchemaError("journal event without a type and version")
    type_, v = event["type"], event["v"]
    current = EVENT_VERSIONS.get(type_)
    if current is None:
        raise SchemaError(f"unknown journal event type {type_!r}")
    if not isinstance(v, int) or v < 1:
        raise SchemaError(f"journal event {type_!r} has invalid schema version {v!r}")
    if v > current:
        raise SchemaError(
            f"journal event {type_!r} has schema version {v}, newer than this verlj understands ({current}); "
            "upgrade verlj to read this journal"
        )
    while v < current:
        event = UPCASTERS[(type_, v)](event)
        v = event["v"]
    return event


def upcast_record(record: dict) -> StepRecord:
    """Lift a decoded step record and all its events to the current schemas."""
    if not isinstance(record, dict) or not isinstance(record.get("v"), int):
        raise SchemaError("journal record without an envelope version")
    v = record["v"]
    if v > ENVELOPE_VERSION:
        raise SchemaError(
            f"journal record has envelope version {v}, newer than this verlj understands ({ENVELOPE_VERSION}); "
            "upgrade verlj to read this journal"
        )
    while v < ENVELOPE_VERSION:
        record = ENVELOPE_UPCASTERS[v](record)
        v = record["v"]
    for key in ("step", "time", "events", "pruned"):
        if key not in record:
            raise SchemaError(f"journal record lacks {key!r}")
    return StepRecord(record["step"], record["time"], [upcast_event(e) for e in record["events"]], record["pruned"])


@dataclass(frozen=True)
class StepRecord:
    """One step's record as the journal gives it back (upcast): its events, grouped by type here and
    only here. Most types appear once a step (:meth:`first`); `control` and `config` may repeat."""

    step: int
    time: float
    events: list[dict]
    pruned: bool = False  # retention removed its payload fields (PAYLOAD_FIELDS): the samples
    _by_type: dict[str, list[dict]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for e in self.events:
            self._by_type.setdefault(e["type"], []).append(e)

    def first(self, type_: str) -> dict | None:
        """The step's first event of `type_`, or None."""
        found = self._by_type.get(type_)
        return found[0] if found else None

    def all(self, type_: str) -> list[dict]:
        return list(self._by_type.get(type_, ()))

    @property
    def metrics(self) -> dict[str, float]:
        event = self.first("metrics")
        return event["values"] if event is not None else {}

    @property
    def fingerprint(self) -> str | None:
        event = self.first("state")
        return event["fingerprint"] if event is not None else None

    def to_dict(self) -> dict:
        """The plain form (what crosses ranks: msgpack)."""
        return {"step": self.step, "time": self.time, "events": self.events, "pruned": self.pruned}

    @classmethod
    def from_dict(cls, d: dict) -> StepRecord:
        return cls(d["step"], d["time"], d["events"], d.get("pruned", False))
