"""The journal's step events as types: one frozen dataclass per event type, the codec boundary, and
the one place each type is declared.

Each class here is a journaled event type declared once (:class:`Event`, :func:`declared`): its fields,
its name in the journal (`TYPE`), its current version (`VERSION`), its upcasters from older versions
(`UPCASTERS`) and how the store keeps it (`SUMMARY`, `PAYLOAD`), side by side. Importing this module
(``verlj.engine`` does) declares them to the journal's registry (``verlj.journal.events``), which knows
their names, versions and storage, nothing of their meaning. Every event a step record holds is
written and read through the class here: ``to_event()`` gives the plain map the journal stores,
``from_event()`` reads one back (already lifted to the current version by the upcasters; a field an
older writer did not write is given its documented default here, and only here). :class:`StepEvents`
is a step record read as these types: the trainer, recovery and every post-mortem command read
records through it, never by key.

``to_event()`` writes the fields in the order the journal has always held them and leaves out the
optional ones that are unset, so a journal written through these types is byte-identical to one
written before them (tests/unit/test_schema.py reads a journal of the previous release).
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


def _ids(value: Any) -> np.ndarray:
    return np.asarray(value if value is not None else _NO_IDS, np.int64)


# ----------------------------------------------------------------------------- the registry

Upcasters = Mapping[int, Upcaster]


class Event:
    """A journaled event type, declared once: its fields (the dataclass), its name in the journal
    (`TYPE`), its current version (`VERSION`), the functions lifting each older version one step
    (`UPCASTERS`, {from version: event -> event of the next version}), and how the store keeps it
    (`SUMMARY`: small, also kept in the step's summary; `PAYLOAD`: fields kept apart, compressed,
    pruned by retention). :func:`declared` hands all of it to the journal (``verlj.journal.declare``).

    A new version of a type: raise `VERSION`, add `UPCASTERS[old]` giving an old event the new
    fields (so `from_event` only ever sees the current shape), and add a journal of the old version
    under tests/fixtures (tests/unit/test_registry.py fails until each upcaster is exercised by one)."""

    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    UPCASTERS: ClassVar[Upcasters]
    SUMMARY: ClassVar[bool] = False
    PAYLOAD: ClassVar[tuple[str, ...]] = ()

    def to_event(self) -> dict:
        """The plain map the journal stores (current version)."""
        raise NotImplementedError

    @classmethod
    def from_event(cls, e: dict) -> Event:
        """The event read back (already upcast to the current version by the journal)."""
        raise NotImplementedError


EVENT_TYPES: dict[str, type[Event]] = {}  # type name -> its class: every declared type
E = TypeVar("E", bound=type[Event])


def declared(cls: E) -> E:
    """Class decorator: declare the event type to the journal and register its class."""
    missing = [name for name in ("TYPE", "VERSION", "UPCASTERS") if name not in vars(cls)]
    if missing:
        raise TypeError(f"event class {cls.__name__} must declare its own {', '.join(missing)}")
    declare(EventSpec(cls.TYPE, cls.VERSION, cls.UPCASTERS, summary=cls.SUMMARY, payload=cls.PAYLOAD))
    EVENT_TYPES[cls.TYPE] = cls
    return cls



@declared
@dataclass(frozen=True)
class Data(Event):
    """The dataset rows drawn this step (all rounds) and where the sampler stands after them."""

    TYPE: ClassVar[str] = "data"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    SUMMARY: ClassVar[bool] = True
    epoch: int
    cursor: int
    indices: np.ndarray
    rounds: int

    def to_event(self) -> dict:
        return make_event(self.TYPE, epoch=self.epoch, cursor=self.cursor, indices=self.indices, rounds=self.rounds)

    @classmethod
    def from_event(cls, e: dict) -> Data:
        return cls(int(e["epoch"]), int(e["cursor"]), np.asarray(e["indices"]), int(e["rounds"]))


@declared
@dataclass(frozen=True)
class Rollout(Event):
    """The engine that generated the step's samples (hf | vllm), its package's version, and the
    rollout mode: `mode`/`max_staleness`/`async_order` are journaled for async steps only (absent: sync;
    a step-order journal from before `async_order` existed reads as step order), `partial` only when true
    (rollout.partial: generations continued across weight updates). A what-if's steps say so."""

    TYPE: ClassVar[str] = "rollout"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    SUMMARY: ClassVar[bool] = True
    engine: str
    version: str | None
    mode: RolloutMode = RolloutMode.SYNC
    max_staleness: int | None = None
    async_order: AsyncOrder | None = None
    whatif: bool = False
    whatif_correction: bool = False
    partial: bool = False

    @property
    def is_async(self) -> bool:
        return self.mode is RolloutMode.ASYNC

    @property
    def completion_order(self) -> bool:
        return self.async_order is AsyncOrder.COMPLETION

    def mode_fields(self) -> dict:
        """The async fields as journaled (empty for sync)."""
        if not self.is_async:
            return {}
        out: dict = {"mode": self.mode.value, "max_staleness": self.max_staleness}
        if self.async_order is not None:
            out["async_order"] = self.async_order.value
        if self.partial:
            out["partial"] = True
        return out

    def to_event(self) -> dict:
        extra = {"whatif": True, "whatif_correction": self.whatif_correction} if self.whatif else {}
        return make_event(self.TYPE, engine=self.engine, version=self.version, **self.mode_fields(), **extra)

    @classmethod
    def from_event(cls, e: dict) -> Rollout:
        mode = RolloutMode(e.get("mode", "sync"))
        order = e.get("async_order")
        return cls(str(e["engine"]), e.get("version"), mode, e.get("max_staleness"), AsyncOrder(order) if order else None,
                   bool(e.get("whatif", False)), bool(e.get("whatif_correction", False)), bool(e.get("partial", False)))


@declared
@dataclass(frozen=True)
class Rng(Event):
    """The seeds drawn for the step ({stream: int}) and digests of the global generators' states."""

    TYPE: ClassVar[str] = "rng"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    SUMMARY: ClassVar[bool] = True
    seeds: dict[str, int]
    digests: dict[str, str]

    def to_event(self) -> dict:
        return make_event(self.TYPE, seeds=self.seeds, digests=self.digests)

    @classmethod
    def from_event(cls, e: dict) -> Rng:
        return cls(dict(e["seeds"]), dict(e.get("digests", {})))


@declared
@dataclass(frozen=True)
class Added(Event):
    """The samples generated this step: their ids, and their columns (``schema.sample.pack``), which
    retention may have pruned (`samples` None: the ids stay, so every sample's fate is still known)."""

    TYPE: ClassVar[str] = "buffer.add"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    PAYLOAD: ClassVar[tuple[str, ...]] = ("samples",)
    ids: np.ndarray
    samples: dict | None

    def to_event(self) -> dict:
        return make_event(self.TYPE, ids=self.ids, samples=self.samples)

    @classmethod
    def from_event(cls, e: dict) -> Added:
        return cls(_ids(e.get("ids")), e.get("samples"))


@declared
@dataclass(frozen=True)
class Consumed(Event):
    TYPE: ClassVar[str] = "buffer.consume"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    ids: np.ndarray  # what the step's update trains on, in order

    def to_event(self) -> dict:
        return make_event(self.TYPE, ids=self.ids)

    @classmethod
    def from_event(cls, e: dict) -> Consumed:
        return cls(_ids(e.get("ids")))


@declared
@dataclass(frozen=True)
class Dropped(Event):
    TYPE: ClassVar[str] = "buffer.drop"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    ids: np.ndarray
    reason: DropReason

    def to_event(self) -> dict:
        return make_event(self.TYPE, ids=self.ids, reason=self.reason.value)

    @classmethod
    def from_event(cls, e: dict) -> Dropped:
        return cls(_ids(e.get("ids")), DropReason(e.get("reason", "zero_variance")))  # the first drops had no reason


@declared
@dataclass(frozen=True)
class Plan(Event):
    """Async step order: the ids each later step will train on (steps, counts, ids flattened)."""

    TYPE: ClassVar[str] = "buffer.plan"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    steps: np.ndarray
    counts: np.ndarray
    ids: np.ndarray

    @classmethod
    def of(cls, plans: dict[int, np.ndarray]) -> Plan:
        steps = sorted(plans)
        return cls(np.asarray(steps, np.int64), np.asarray([len(plans[j]) for j in steps], np.int64),
                   np.concatenate([plans[j] for j in steps]) if steps else np.zeros(0, np.int64))

    def plans(self) -> dict[int, np.ndarray]:
        ends = np.cumsum(self.counts)
        return {int(j): np.asarray(self.ids[e - c : e], np.int64) for j, c, e in zip(self.steps, self.counts, ends)}

    def to_event(self) -> dict:
        return make_event(self.TYPE, steps=self.steps, counts=self.counts, ids=self.ids)

    @classmethod
    def from_event(cls, e: dict) -> Plan:
        return cls(_ids(e["steps"]), _ids(e["counts"]), _ids(e["ids"]))


@declared
@dataclass(frozen=True)
class Requests(Event):
    """Async completion order: the groups and rows asked this step; `regenerated`: groups asked
    again because they were in flight when the last process stopped; `continued` (rollout.partial;
    journaled only when some): groups asked that went on from their durable tokens instead of their start."""

    TYPE: ClassVar[str] = "buffer.request"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    groups: np.ndarray = field(default_factory=lambda: _NO_IDS)
    rows: np.ndarray = field(default_factory=lambda: _NO_IDS)
    regenerated: np.ndarray = field(default_factory=lambda: _NO_IDS)
    continued: np.ndarray = field(default_factory=lambda: _NO_IDS)

    def to_event(self) -> dict:
        extra = {"continued": self.continued} if len(self.continued) else {}  # only then: a record without keeps its bytes
        return make_event(self.TYPE, groups=self.groups, rows=self.rows, regenerated=self.regenerated, **extra)

    @classmethod
    def from_event(cls, e: dict) -> Requests:
        return cls(_ids(e.get("groups")), _ids(e.get("rows")), _ids(e.get("regenerated")), _ids(e.get("continued")))


@declared
@dataclass(frozen=True)
class Metrics(Event):
    TYPE: ClassVar[str] = "metrics"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    SUMMARY: ClassVar[bool] = True
    values: dict[str, float]

    def to_event(self) -> dict:
        return make_event(self.TYPE, values=self.values)

    @classmethod
    def from_event(cls, e: dict) -> Metrics:
        return cls(dict(e["values"]))


@declared
@dataclass(frozen=True)
class State(Event):
    """The fingerprint of the state after the step's update, and of its parts."""

    TYPE: ClassVar[str] = "state"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    SUMMARY: ClassVar[bool] = True
    fingerprint: str
    parts: dict[str, str]

    def to_event(self) -> dict:
        return make_event(self.TYPE, fingerprint=self.fingerprint, parts=self.parts)

    @classmethod
    def from_event(cls, e: dict) -> State:
        return cls(str(e["fingerprint"]), dict(e.get("parts", {})))


@declared
@dataclass(frozen=True)
class Stages(Event):
    """Each stage's output in the step, digested (engine.state.stages): {stage: hex} and
    {stage: {n, mean, absmax}}. Empty in journals from before stage digests."""

    TYPE: ClassVar[str] = "stages"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    digests: dict[str, str] = field(default_factory=dict)
    summary: dict[str, dict] = field(default_factory=dict)

    def to_event(self) -> dict:
        return make_event(self.TYPE, digests=self.digests, summary=self.summary)

    @classmethod
    def from_event(cls, e: dict) -> Stages:
        return cls(dict(e.get("digests", {})), dict(e.get("summary", {})))

    def as_dict(self) -> dict:
        return {"digests": self.digests, "summary": self.summary}


@declared
@dataclass(frozen=True)
class Control(Event):
    """Something that happened to the run at this step: started, resumed, forked, what-if, topology
    changed. `details` is free-form, for people to read (inspect shows it as is)."""

    TYPE: ClassVar[str] = "control"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    SUMMARY: ClassVar[bool] = True
    kind: ControlKind
    details: dict

    def to_event(self) -> dict:
        return make_event(self.TYPE, kind=self.kind.value, details=self.details)

    @classmethod
    def from_event(cls, e: dict) -> Control:
        return cls(ControlKind(e["kind"]), dict(e.get("details") or {}))


@declared
@dataclass(frozen=True)
class ConfigChange(Event):
    """The config in force from this step on (a resume that changed keys), its hash, the keys changed."""

    TYPE: ClassVar[str] = "config"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    SUMMARY: ClassVar[bool] = True
    config: dict
    hash: str
    changed: list

    def to_event(self) -> dict:
        return make_event(self.TYPE, config=self.config, hash=self.hash, changed=self.changed)

    @classmethod
    def from_event(cls, e: dict) -> ConfigChange:
        return cls(dict(e["config"]), str(e["hash"]), list(e.get("changed") or []))


@declared
@dataclass(frozen=True)
class Eval(Event):
    """The held-out evaluation run after this step: rows, their scores, the responses (flat token ids
    and their lengths). With rollout.env each response is an episode (its actions and observations, as a
    sample's response_ids) and three more fields say how it went: `turns` (per row), `turn_lens` (flat:
    per turn, action length then observation length) and `env_end` (per row: schema.sample.EnvEnd); a
    single-turn eval leaves them out (None), so its event is what it always was."""

    TYPE: ClassVar[str] = "eval"
    VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[Upcasters] = {}
    rows: np.ndarray
    scores: np.ndarray
    response_ids: np.ndarray
    response_len: np.ndarray
    turns: np.ndarray | None = None
    turn_lens: np.ndarray | None = None
    env_end: np.ndarray | None = None

    def responses(self) -> list[np.ndarray]:
        ends = np.cumsum(self.response_len)
        return [self.response_ids[e - n : e] for n, e in zip(self.response_len, ends)]

    def episode_turns(self) -> list[np.ndarray]:
        """Each row's turn_lens (action, observation length per turn); [] without rollout.env."""
        if self.turns is None or self.turn_lens is None:
            return []
        ends = np.cumsum(2 * self.turns)
        return [self.turn_lens[e - 2 * n : e] for n, e in zip(self.turns, ends)]

    def to_event(self) -> dict:
        episode = {} if self.turns is None else {"turns": self.turns, "turn_lens": self.turn_lens, "env_end": self.env_end}
        return make_event(self.TYPE, rows=self.rows, scores=self.scores, response_ids=self.response_ids, response_len=self.response_len,
                          **episode)

    @classmethod
    def from_event(cls, e: dict) -> Eval:
        episode = {} if e.get("turns") is None else {"turns": _ids(e["turns"]), "turn_lens": _ids(e.get("turn_lens")),
                                                     "env_end": _ids(e.get("env_end"))}
        return cls(_ids(e["rows"]), np.asarray(e["scores"], np.float64), np.asarray(e["response_ids"]), _ids(e["response_len"]), **episode)


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
