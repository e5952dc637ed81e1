"""Journal event types: the registry every journaled event is declared in, and the one place old
versions are upcast.

A step record is an envelope::

    {"v": ENVELOPE_VERSION, "step": int, "time": float, "events": [event, ...]}

(envelope v2 adds ``"pruned": bool``: whether the step's payload fields (an event type's
``EventSpec.payload``) were removed by retention; the store keeps those fields compressed apart from
the rest. v3 changes only how the store encodes the rest, the core: over shapes interned once per
journal, see ``codec.pack_core``; the record read back is the same.)

and every event is a map with a ``type`` and a schema version ``v``::

    {"type": "metrics", "v": 1, "values": {"actor/pg_loss": 0.12, ...}}

The journal knows nothing of RL and declares no event type itself: each type is declared once, by
the code that owns its meaning, with :func:`declare` and an :class:`EventSpec` (its name, its current
version, the functions lifting each older version one step, and how the store keeps it). verlj's step
events are declared by their classes in ``verlj.engine.schema.events`` (importing ``verlj.engine``
declares them). Writers always write the current version (:func:`make_event`). Readers pass every
record through :func:`upcast_record`, which lifts older versions to the current one and refuses types
nobody declared and versions newer than this code.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .errors import SchemaError

ENVELOPE_VERSION = 3

Upcaster = Callable[[dict], dict]  # lifts an event (or an envelope) from its version v to v + 1


@dataclass(frozen=True)
class EventSpec:
    """What the journal knows of one event type. `upcasters[v]` lifts an event of version v to v + 1:
    there is one for every version before `version`. `summary`: the type is small and also kept in the
    step's summary (same transaction), so that metrics, find and diff never decode the samples.
    `payload`: fields stored apart from the rest of the record, compressed, and pruned by retention
    (the event keeps its other fields: ids stay, so a sample's fate is known after pruning)."""

    type: str
    version: int
    upcasters: Mapping[int, Upcaster] = field(default_factory=dict)
    summary: bool = False
    payload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or self.version < 1:
            raise SchemaError(f"journal event {self.type!r} declared with version {self.version!r}; versions count from 1")
        if set(self.upcasters) != set(range(1, self.version)):
            raise SchemaError(f"journal event {self.type!r} v{self.version} needs an upcaster from each older version "
                              f"({list(range(1, self.version))}), has {sorted(self.upcasters)}")
        object.__setattr__(self, "upcasters", types.MappingProxyType(dict(self.upcasters)))

    def same_shape(self, other: EventSpec) -> bool:
        """Declares the same version and storage (a module imported twice declares its types again)."""
        return (self.version, sorted(self.upcasters), self.summary, self.payload) == \
            (other.version, sorted(other.upcasters), other.summary, other.payload)


_DECLARED: dict[str, EventSpec] = {}
_SUMMARY: frozenset[str] = frozenset()  # the declared summary types (kept as declare() changes them: read per event)


def declare(spec: EventSpec) -> EventSpec:
    """Declare an event type to the journal: from here on it may be written and is read back (upcast).
    Declaring a type again with another version or storage is refused: a type has one owner."""
    known = _DECLARED.get(spec.type)
    if known is not None and not known.same_shape(spec):
        raise SchemaError(f"journal event {spec.type!r} is declared twice, differently (v{known.version} and v{spec.version})")
    _DECLARED[spec.type] = spec
    global _SUMMARY
    _SUMMARY = frozenset(t for t, s in _DECLARED.items() if s.summary)
    return spec


def declared() -> Mapping[str, EventSpec]:
    """Every declared event type's spec, by type (read-only)."""
    return types.MappingProxyType(_DECLARED)


def spec_of(type_: str) -> EventSpec:
    """The declared spec of `type_`; SchemaError when nobody declared it."""
    found = _DECLARED.get(type_)
    if found is None:
        hint = " (no event type is declared: importing verlj.engine declares verlj's)" if not _DECLARED else ""
        raise SchemaError(f"unknown journal event type {type_!r}{hint}; known: {', '.join(sorted(_DECLARED))}")
    return found


def summary_types() -> frozenset[str]:
    """The declared types also kept in each step's summary."""
    return _SUMMARY


def payload_fields(type_: str) -> tuple[str, ...]:
    """The fields of `type_` the store keeps apart (compressed, prunable); () for an undeclared type."""
    found = _DECLARED.get(type_)
    return found.payload if found is not None else ()


# Envelope versions lift the same way: from_version -> function. The envelope is the journal's own.
ENVELOPE_UPCASTERS: dict[int, Upcaster] = {
    1: lambda r: {**r, "v": 2, "pruned": False},  # v1 records kept everything inline and were never pruned
    2: lambda r: {**r, "v": 3},  # v3 changed the core's encoding only
}


def make_event(type_: str, **fields) -> dict:
    """Build an event of the current schema version for ``type_`` (a declared type)."""
    return {"type": type_, "v": spec_of(type_).version, **fields}


def upcast_event(event: dict) -> dict:
    if not isinstance(event, dict) or "type" not in event or "v" not in event:
        raise SchemaError("journal event without a type and version")
    type_, v = event["type"], event["v"]
    spec = spec_of(type_)
    if not isinstance(v, int) or v < 1:
        raise SchemaError(f"journal event {type_!r} has invalid schema version {v!r}")
    if v > spec.version:
        raise SchemaError(
            f"journal event {type_!r} has schema version {v}, newer than this verlj understands ({spec.version}); "
            "upgrade verlj to read this journal"
        )
    while v < spec.version:
        event = spec.upcasters[v](event)
        if event.get("v") != v + 1:
            raise SchemaError(f"the upcaster of journal event {type_!r} from v{v} gave v{event.get('v')!r}, not v{v + 1}")
        v += 1
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
    only here. Most types appear once a step (:meth:`first`); `control` and `config` may repeat. Its map
    (to_dict, what crosses ranks) is written here: the journal stands below engine/schema and its codec,
    which it may not import, and its envelope is its own (versioned by ENVELOPE_UPCASTERS)."""

    step: int
    time: float
    events: list[dict]
    pruned: bool = False  # retention removed its payload fields (EventSpec.payload): the samples
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
    def state_fingerprint(self) -> str | None:
        """The state fingerprint the step journaled (its `state` event's): a digest of the trained state,
        which replay must reproduce. Not the record's own hash (its frame's checksum and chain, `frames`)."""
        event = self.first("state")
        return event["fingerprint"] if event is not None else None

    def to_dict(self) -> dict:
        """The plain form (what crosses ranks: msgpack)."""
        return {"step": self.step, "time": self.time, "events": self.events, "pruned": self.pruned}

    @classmethod
    def from_dict(cls, d: dict) -> StepRecord:
        return cls(d["step"], d["time"], d["events"], d.get("pruned", False))
