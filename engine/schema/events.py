"""The journal's step events as types: one frozen dataclass per event type, the codec boundary, and
the one place each type is declared.

Each class here is a journaled event type declared once (:class:`Event`, :func:`declared`): its fields
(each with what it declares of its stored form, ``field(metadata=stored(...))``: :mod:`.record`), its
name in the journal (`TYPE`), its current version (`VERSION`) and how the store keeps it (`SUMMARY`,
`PAYLOAD`), side by side; its upcasters from older versions come from its fields (a field added in v2
says ``stored(since=2, old=...)``), with `UPCASTERS` for a change no field can say. Importing this
module (``verlj.engine`` does) declares them to the journal's registry (``verlj.journal.events``), which
knows their names, versions and storage, nothing of their meaning. Every event a step record holds is
written and read through the class here: ``to_event()`` gives the plain map the journal stores,
``from_event()`` reads one back (already lifted to the current version by the upcasters; a field an
older writer did not write is given the `missing` value its field declares, here and only here).
:class:`StepEvents` is a step record read as these types: the trainer, recovery and every post-mortem
command read records through it, never by key.

``to_event()`` writes the fields in the order they are declared, which is the order the journal has
always held them, and leaves out the optional ones that are unset, so a journal written through these
types is byte-identical to one written before them (tests/unit/test_schema.py reads a journal of the
previous release).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np

from verlj.journal import EventSpec, StepRecord, declare, make_event
from verlj.journal.events import Upcaster

from ..errors import ReplayError
from .record import Record, stored, upcasters_of

_NO_IDS = np.zeros(0, np.int64)


class RolloutMode(str, enum.Enum):
    """How a step's samples relate to its update (`rollout.mode`)."""

    SYNC = "sync"
    ASYNC = "async"


class AsyncOrder(str, enum.Enum):
    """Async rollout's order (`rollout.async_order`): batches planned by step, or taken as they complete."""

    STEP = "step"
    COMPLETION = "completion"


class DropReason(str, enum.Enum):
    ZERO_VARIANCE = "zero_variance"  # dynamic sampling: a group whose scores do not vary
    STALE = "stale"  # async: too many versions behind for any later step
    FAULT = "fault"  # an env or reward function failed it, or its GRPO group kept fewer than two without (rl.faults)


class Stream:
    """The named random streams whose seeds a step draws (the `rng` event's `seeds`)."""

    ROLLOUT = "rollout"  # generation (each sample's own seed derives from it and its place in the step)
    TRAIN = "train"  # the update (dropout, if any)


class ControlKind(str, enum.Enum):
    START = "start"
    RESUME = "resume"
    FORK = "fork"
    WHATIF = "whatif"
    TOPOLOGY = "topology"


# ----------------------------------------------------------------------------- the registry

Upcasters = Mapping[int, Upcaster]


class Event(Record):
    """A journaled event type, declared once: its fields (the dataclass, each with what it declares of
    its stored form: :func:`.record.stored`), its name in the journal (`TYPE`), its current version
    (`VERSION`) and how the store keeps it (`SUMMARY`: small, also kept in the step's summary;
    `PAYLOAD`: fields kept apart, compressed, pruned by retention). Its map (:meth:`to_event`,
    :meth:`from_event`) and its upcasters come from the fields (:mod:`.record`); :func:`declared` hands
    all of it to the journal (``verlj.journal.declare``).

    A new version of a type: raise `VERSION`, declare each field it adds with
    ``stored(since=VERSION, old=...)`` (what an older event is given), or, for a change the fields cannot
    say (a rename), give the upcaster from the old version in `UPCASTERS` ({from version: event -> event
    of the next version}); add a journal of the old version under tests/fixtures
    (tests/unit/test_registry.py fails until each upcaster is exercised by one). `from_event` then only
    ever sees the current shape."""

    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    UPCASTERS: ClassVar[Upcasters] = {}  # the upcasters no field says (declared() adds those the fields do)
    SUMMARY: ClassVar[bool] = False
    PAYLOAD: ClassVar[tuple[str, ...]] = ()

    def to_event(self) -> dict:
        """The plain map the journal stores (current version): its fields' map, stamped with type and version."""
        return make_event(self.TYPE, **self.to_dict())

    @classmethod
    def from_event(cls: type[EV], e: dict) -> EV:
        """The event read back (already upcast to the current version by the journal)."""
        return cls.from_dict(e)


EVENT_TYPES: dict[str, type[Event]] = {}  # type name -> its class: every declared type
E = TypeVar("E", bound=type[Event])
EV = TypeVar("EV", bound=Event)


def declared(cls: E) -> E:
    """Class decorator: declare the event type to the journal (its version, its upcasters: those of its
    fields and its own `UPCASTERS`, its storage) and register its class."""
    missing = [name for name in ("TYPE", "VERSION") if name not in vars(cls)]
    if missing:
        raise TypeError(f"event class {cls.__name__} must declare its own {', '.join(missing)}")
    cls.UPCASTERS = upcasters_of(cls, cls.VERSION, vars(cls).get("UPCASTERS", {}))
    declare(EventSpec(cls.TYPE, cls.VERSION, cls.UPCASTERS, summary=cls.SUMMARY, payload=cls.PAYLOAD))
    EVENT_TYPES[cls.TYPE] = cls
    return cls


IDS = stored(dtype=np.int64, missing=_NO_IDS)  # an int64 id array; an event without it (or with None) reads as empty
INT64 = stored(dtype=np.int64)  # an int64 array the event always has


@declared
@dataclass(frozen=True)
class Data(Event):
    """The dataset rows drawn this step (all rounds) and where the sampler stands after them."""

    TYPE: ClassVar[str] = "data"
    VERSION: ClassVar[int] = 1
    SUMMARY: ClassVar[bool] = True
    epoch: int
    cursor: int
    indices: np.ndarray
    rounds: int


@declared
@dataclass(frozen=True)
class Rollout(Event):
    """The engine that generated the step's samples (hf | vllm), its package's version, and the
    rollout mode: `mode`/`max_staleness`/`async_order` are journaled for async steps only (absent: sync;
    a step-order journal from before `async_order` existed reads as step order), `partial` only when true
    (rollout.partial: generations continued across weight updates). A what-if's steps say so."""

    TYPE: ClassVar[str] = "rollout"
    VERSION: ClassVar[int] = 1
    SUMMARY: ClassVar[bool] = True
    engine: str
    version: str | None
    mode: RolloutMode = field(default=RolloutMode.SYNC, metadata=stored(optional=True))
    max_staleness: int | None = field(default=None, metadata=stored(with_="mode"))
    async_order: AsyncOrder | None = field(default=None, metadata=stored(with_="mode", optional=True))
    partial: bool = field(default=False, metadata=stored(with_="mode", optional=True))  # rollout.partial: only when true
    whatif: bool = field(default=False, metadata=stored(optional=True))
    whatif_correction: bool = field(default=False, metadata=stored(with_="whatif"))

    @property
    def is_async(self) -> bool:
        return self.mode is RolloutMode.ASYNC

    @property
    def completion_order(self) -> bool:
        return self.async_order is AsyncOrder.COMPLETION

    def mode_fields(self) -> dict:
        """The async fields as journaled (empty for sync)."""
        return {k: v for k, v in self.to_dict().items() if k in ("mode", "max_staleness", "async_order", "partial")}


@declared
@dataclass(frozen=True)
class Rng(Event):
    """The seeds drawn for the step ({stream: int}) and digests of the global generators' states."""

    TYPE: ClassVar[str] = "rng"
    VERSION: ClassVar[int] = 1
    SUMMARY: ClassVar[bool] = True
    seeds: dict[str, int]
    digests: dict[str, str] = field(metadata=stored(missing={}))


@declared
@dataclass(frozen=True)
class Added(Event):
    """The samples generated this step: their ids, and their columns (``schema.sample.pack``), which
    retention may have pruned (`samples` None: the ids stay, so every sample's fate is still known)."""

    TYPE: ClassVar[str] = "buffer.add"
    VERSION: ClassVar[int] = 1
    PAYLOAD: ClassVar[tuple[str, ...]] = ("samples",)
    ids: np.ndarray = field(metadata=IDS)
    samples: dict[str, np.ndarray | list[str]] | None = field()  # schema.sample.pack's columns (texts: lists of str)


@declared
@dataclass(frozen=True)
class Consumed(Event):
    TYPE: ClassVar[str] = "buffer.consume"
    VERSION: ClassVar[int] = 1
    ids: np.ndarray = field(metadata=IDS)  # what the step's update trains on, in order


@declared
@dataclass(frozen=True)
class Dropped(Event):
    TYPE: ClassVar[str] = "buffer.drop"
    VERSION: ClassVar[int] = 1
    ids: np.ndarray = field(metadata=IDS)
    reason: DropReason = field(metadata=stored(missing="zero_variance"))  # the first drops had no reason


@declared
@dataclass(frozen=True)
class Plan(Event):
    """Async step order: the ids each later step will train on (steps, counts, ids flattened)."""

    TYPE: ClassVar[str] = "buffer.plan"
    VERSION: ClassVar[int] = 1
    steps: np.ndarray = field(metadata=INT64)
    counts: np.ndarray = field(metadata=INT64)
    ids: np.ndarray = field(metadata=INT64)

    @classmethod
    def of(cls, plans: dict[int, np.ndarray]) -> Plan:
        steps = sorted(plans)
        return cls(np.asarray(steps, np.int64), np.asarray([len(plans[j]) for j in steps], np.int64),
                   np.concatenate([plans[j] for j in steps]) if steps else np.zeros(0, np.int64))

    def plans(self) -> dict[int, np.ndarray]:
        ends = np.cumsum(self.counts)
        return {int(j): np.asarray(self.ids[e - c : e], np.int64) for j, c, e in zip(self.steps, self.counts, ends)}


@declared
@dataclass(frozen=True)
class Requests(Event):
    """Async completion order: the groups and rows asked this step; `regenerated`: groups asked
    again because they were in flight when the last process stopped; `continued` (rollout.partial;
    journaled only when some): groups asked that went on from their durable tokens instead of their start."""

    TYPE: ClassVar[str] = "buffer.request"
    VERSION: ClassVar[int] = 1
    groups: np.ndarray = field(default_factory=lambda: _NO_IDS, metadata=IDS)
    rows: np.ndarray = field(default_factory=lambda: _NO_IDS, metadata=IDS)
    regenerated: np.ndarray = field(default_factory=lambda: _NO_IDS, metadata=IDS)
    # rollout.partial: stored only when some (a record without keeps its bytes)
    continued: np.ndarray = field(default_factory=lambda: _NO_IDS, metadata=stored(dtype=np.int64, missing=_NO_IDS, optional=True))


@declared
@dataclass(frozen=True)
class Metrics(Event):
    TYPE: ClassVar[str] = "metrics"
    VERSION: ClassVar[int] = 1
    SUMMARY: ClassVar[bool] = True
    values: dict[str, float]


@declared
@dataclass(frozen=True)
class State(Event):
    """The fingerprint of the state after the step's update, and of its parts."""

    TYPE: ClassVar[str] = "state"
    VERSION: ClassVar[int] = 1
    SUMMARY: ClassVar[bool] = True
    fingerprint: str
    parts: dict[str, str] = field(metadata=stored(missing={}))


@declared
@dataclass(frozen=True)
class Stages(Event):
    """Each stage's output in the step, digested (engine.state.stages): {stage: hex} and
    {stage: {n, mean, absmax}}. Empty in journals from before stage digests."""

    TYPE: ClassVar[str] = "stages"
    VERSION: ClassVar[int] = 1
    digests: dict[str, str] = field(default_factory=dict)
    summary: dict[str, dict[str, float]] = field(default_factory=dict)  # {stage: {n, mean, absmax}}


@declared
@dataclass(frozen=True)
class Control(Event):
    """Something that happened to the run at this step: started, resumed, forked, what-if, topology
    changed. `details` is free-form, for people to read (inspect shows it as is)."""

    TYPE: ClassVar[str] = "control"
    VERSION: ClassVar[int] = 1
    SUMMARY: ClassVar[bool] = True
    kind: ControlKind
    details: dict[str, Any] = field(metadata=stored(missing={}))


@declared
@dataclass(frozen=True)
class ConfigChange(Event):
    """The config in force from this step on (a resume that changed keys), its hash, the keys changed."""

    TYPE: ClassVar[str] = "config"
    VERSION: ClassVar[int] = 1
    SUMMARY: ClassVar[bool] = True
    config: dict[str, Any]  # as stored (config.Config.to_stored)
    hash: str
    changed: list[str] = field(metadata=stored(missing=[]))  # the dotted keys


@declared
@dataclass(frozen=True)
class Eval(Event):
    """The held-out evaluation run after this step: rows, their scores, the responses (flat token ids
    and their lengths). With rollout.env each response is an episode (its actions and observations, as a
    sample's response_ids) and three more fields say how it went: `turns` (per row), `turn_lens` (flat:
    per turn, action length then observation length) and `env_end` (per row: schema.sample.EnvEnd), and for an env with
    state() `env_states` (per row: its states, as a sample's env_states); a single-turn eval leaves them out (None), so its
    event is what it always was. `faults`: each row's fault ("" none), only where one faulted."""

    TYPE: ClassVar[str] = "eval"
    VERSION: ClassVar[int] = 1
    rows: np.ndarray = field(metadata=INT64)
    scores: np.ndarray = field(metadata=stored(dtype=np.float64))
    response_ids: np.ndarray = field()
    response_len: np.ndarray = field(metadata=INT64)
    turns: np.ndarray | None = field(default=None, metadata=stored(dtype=np.int64, optional=True))
    turn_lens: np.ndarray | None = field(default=None, metadata=stored(dtype=np.int64, with_="turns", missing=_NO_IDS))
    env_end: np.ndarray | None = field(default=None, metadata=stored(dtype=np.int64, with_="turns", missing=_NO_IDS))
    env_states: list[str] | None = field(default=None, metadata=stored(optional=True))  # an env with state(): each row's (a sample's env_states)
    faults: list[str] | None = field(default=None, metadata=stored(optional=True))  # each row's fault ("" none), where one faulted

    def responses(self) -> list[np.ndarray]:
        ends = np.cumsum(self.response_len)
        return [self.response_ids[e - n : e] for n, e in zip(self.response_len, ends)]

    def episode_turns(self) -> list[np.ndarray]:
        """Each row's turn_lens (action, observation length per turn); [] without rollout.env."""
        if self.turns is None or self.turn_lens is None:
            return []
        ends = np.cumsum(2 * self.turns)
        return [self.turn_lens[e - 2 * n : e] for n, e in zip(self.turns, ends)]


# The StepEvents field each declared type is read into: a type held once a step, or (STEP_MANY) repeated.
STEP_FIELDS = {"data": "data", "rollout": "rollout", "rng": "rng", "buffer.add": "added", "buffer.consume": "consumed",
               "buffer.plan": "plan", "buffer.request": "requests", "metrics": "metrics", "state": "state", "stages": "stages",
               "eval": "eval"}
STEP_MANY = {"buffer.drop": "drops", "control": "controls", "config": "configs"}


@dataclass(frozen=True)
class StepEvents:
    """A step record read as types. Absent events are None (or empty); a step has each type at most
    once except drops, controls and config changes."""

    step: int
    time: float
    pruned: bool
    data: Data | None = None
    rollout: Rollout | None = None
    rng: Rng | None = None
    added: Added | None = None
    consumed: Consumed | None = None
    drops: tuple[Dropped, ...] = ()
    plan: Plan | None = None
    requests: Requests | None = None
    metrics: Metrics | None = None
    state: State | None = None
    stages: Stages | None = None
    controls: tuple[Control, ...] = ()
    configs: tuple[ConfigChange, ...] = ()
    eval: Eval | None = None

    @classmethod
    def of(cls, record: StepRecord) -> StepEvents:
        single: dict[str, Any] = {}
        many: dict[str, list] = {name: [] for name in STEP_MANY.values()}
        for e in record.events:
            kind = e["type"]  # the envelope's own key (verlj.journal.events)
            typed = EVENT_TYPES[kind].from_event(e)
            if kind in STEP_MANY:
                many[STEP_MANY[kind]].append(typed)
            elif STEP_FIELDS[kind] not in single:
                single[STEP_FIELDS[kind]] = typed
        for k, v in many.items():
            single[k] = tuple(v)
        return cls(record.step, record.time, record.pruned, **single)

    def dropped(self, reason: DropReason) -> np.ndarray:
        """The ids dropped for `reason` (one event per reason at most; empty when none)."""
        found = [d.ids for d in self.drops if d.reason is reason]
        return np.concatenate(found) if found else np.zeros(0, np.int64)

    @property
    def values(self) -> dict[str, float]:
        return self.metrics.values if self.metrics is not None else {}

    @property
    def state_fingerprint(self) -> str | None:
        """The state fingerprint journaled after the step's update (its `state` event), or None."""
        return self.state.fingerprint if self.state is not None else None

    def require_inputs(self) -> tuple[Data, Rng, Added, Consumed]:
        """The events every trained step has (replay needs them all)."""
        if self.data is None or self.rng is None or self.added is None or self.consumed is None:
            raise ReplayError(f"step {self.step}'s journal record lacks its inputs (data, rng, samples, consumed ids)")
        return self.data, self.rng, self.added, self.consumed
