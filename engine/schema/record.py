"""The one codec of verlj's records: a dataclass declares its fields once, and its map (the plain
form the journal stores as msgpack), its reading back and its upcasters all come from that declaration.

Step events (:mod:`.events`), the ledger's records (``loop.records``), a group of episodes in flight and
a generation a weight update stopped (rollout.partial; both :mod:`.sample`) and the prompts' identity are
:class:`Record` subclasses. A record's map holds its
fields in the order they are declared, each under its name, its value as the field holds it, except
what a field's type says (an enum is stored as its value, a nested record as its map, in a list or as
a map's values too) and what the field declares itself with ``dataclasses.field(metadata=stored(...))``, where it is::

    @dataclass(frozen=True)
    class Rollout(Event):
        engine: str
        mode: RolloutMode = field(default=RolloutMode.SYNC, metadata=stored(optional=True))   # sync: not stored
        max_staleness: int | None = field(default=None, metadata=stored(with_="mode"))          # only beside mode

Read back (:meth:`Record.from_dict`), each field's value is made its declared type again (an enum from
its value, an array at its declared dtype, a nested record from its map, a copy of a dict or list, the
records in a list or a map's values, a map's int keys as ints);
a key an older writer did not write takes the field's ``missing`` value (stored form), else its
default, else None for a field that may be None; a key no field names is ignored. A field added in a
later version of an event type says so (``stored(since=2, old=value)``), and the upcaster that lifts
the older events is made from that (``upcasters_of``). The maps of every earlier release read back and
write again byte for byte (tests/unit/test_schema.py, test_loop_state.py).
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, ClassVar, TypeVar, Union

import numpy as np

_META = "verlj.stored"  # the key of a field's declaration in dataclasses.field(metadata=...)


class _Nothing:
    """No `missing` value declared (a sentinel: None is a value a field may be given)."""

    def __repr__(self) -> str:
        return "NOTHING"


NOTHING: Any = _Nothing()


@dataclass(frozen=True)
class Stored:
    """What a field declares of its stored form (all optional):

    key       its key in the map, where that is not the field's name (a key that is no Python name)
    optional  left out of the map while it equals its default, or what its default_factory makes (an array:
              in shape and values), so maps from before the field stay as they were
    with_     stored only together with the field of that name: left out when it is, read only when it is there
    dtype     an array's dtype when read back (an array field, or a list of arrays); None: as stored
    missing   the value (stored form) a field takes when the map lacks its key, or holds None for a field
              that may not be None: what an older writer left out
    since     the version of the event type that added the field; older events are lifted to it with `old`
    old       the value (stored form) an event older than `since` is given
    """

    key: str | None = None
    optional: bool = False
    with_: str | None = None
    dtype: Any = None
    missing: Any = NOTHING
    since: int | None = None
    old: Any = None


def stored(*, key: str | None = None, optional: bool = False, with_: str | None = None, dtype: Any = None, missing: Any = NOTHING,
           since: int | None = None, old: Any = None) -> dict[str, Stored]:
    """A field's declaration of its stored form, for ``dataclasses.field(metadata=...)`` (see :class:`Stored`)."""
    return {_META: Stored(key, optional, with_, dtype, missing, since, old)}


@dataclass(frozen=True)
class _Plan:
    """How one field goes to its map and back (computed once per class)."""

    name: str
    key: str
    decl: Stored
    field: Field
    nullable: bool
    encode: Callable[[Any], Any] | None  # None: stored as it is
    decode: Callable[[Any], Any]
    # what the loops ask of each field, flat (they run for every event read or written)
    with_: str | None = None
    optional: bool = False
    none_is_missing: bool = False  # a stored None reads as the `missing` value (a field that may not be None)

    def absent(self) -> Any:
        """The value of a field whose key the map lacks."""
        if self.decl.missing is not NOTHING:
            return self.decode(self.decl.missing)
        if self.field.default is not MISSING:
            return self.field.default
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        if self.nullable:
            return None
        raise KeyError(self.key)

    def is_default(self, value: Any) -> bool:
        default = self.field.default
        if default is MISSING:
            if self.field.default_factory is MISSING:
                return False
            default = self.field.default_factory()
        if isinstance(value, np.ndarray) or isinstance(default, np.ndarray):  # an array: equal in shape and values
            return isinstance(value, np.ndarray) and isinstance(default, np.ndarray) and value.shape == default.shape \
                and bool(np.array_equal(value, default))
        return value is default or value == default


def _nullable(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether it allows None)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True
    return tp, False


def _identity(value: Any) -> Any:
    return value


def _decoder(tp: Any, dtype: Any) -> Callable[[Any], Any]:
    origin = typing.get_origin(tp) or tp
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return origin
    if origin is np.ndarray:
        return lambda v: np.asarray(v, dtype)
    if isinstance(origin, type) and issubclass(origin, Record):
        return lambda v: v if isinstance(v, origin) else origin.from_dict(v)
    if origin in (dict, Mapping):
        args = typing.get_args(tp)
        keys = int if args and args[0] is int else None  # int keys made ints again: JSON keeps a map's keys as text
        values = _decoder(args[1], dtype) if args and _encoder(args[1]) is not None else None  # what to_dict changed
        if keys is None and values is None:
            return dict
        return lambda v: {(k if keys is None else keys(k)): (x if values is None else values(x)) for k, x in v.items()}
    if origin is list:
        args = typing.get_args(tp)
        if not args:
            return list
        item = _decoder(args[0], dtype)
        return lambda v: [item(x) for x in v]
    if origin in (int, float, str, bool):
        return origin
    return _identity


def _encoder(tp: Any) -> Callable[[Any], Any] | None:
    origin = typing.get_origin(tp) or tp
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return lambda v: v.value
    if isinstance(origin, type) and issubclass(origin, Record):
        return lambda v: v.to_dict()
    if origin is list and (args := typing.get_args(tp)) and (item := _encoder(args[0])) is not None:
        return lambda v: [item(x) for x in v]
    if origin in (dict, Mapping) and (args := typing.get_args(tp)) and (value := _encoder(args[1])) is not None:
        return lambda v: {k: value(x) for k, x in v.items()}
    return None


def _plan_of(cls: type) -> tuple[_Plan, ...]:
    found = cls.__dict__.get("_codec_plan")
    if found is not None:
        return found
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        decl = f.metadata.get(_META, Stored())
        tp, nullable = _nullable(hints[f.name])
        decode, encode = _decoder(tp, decl.dtype), _encoder(tp)
        if nullable:
            decode = (lambda d: lambda v: None if v is None else d(v))(decode)
            encode = None if encode is None else (lambda e: lambda v: None if v is None else e(v))(encode)
        out.append(_Plan(f.name, decl.key or f.name, decl, f, nullable, encode, decode, decl.with_, decl.optional,
                         not nullable and decl.missing is not NOTHING))
    plan = tuple(out)
    names = {p.name for p in plan}
    for p in plan:
        if p.decl.with_ is not None and p.decl.with_ not in names:
            raise TypeError(f"{cls.__name__}.{p.name} is stored with {p.decl.with_!r}, which is not one of its fields")
    setattr(cls, "_codec_plan", plan)  # noqa: B010  (the class's own, never inherited: read from its __dict__)
    return plan


R = TypeVar("R", bound="Record")


class Record:
    """A dataclass whose map form comes from its fields (see the module's doc). Subclasses are
    dataclasses; this base holds no fields, so frozen and mutable records may both derive from it."""

    _codec_plan: ClassVar[tuple[_Plan, ...]]

    def to_dict(self) -> dict:
        """The map the journal stores: the fields in declaration order, under their keys."""
        out: dict = {}
        written: set[str] = set()
        for p in _plan_of(type(self)):
            value = getattr(self, p.name)
            if (p.with_ is not None and p.with_ not in written) or (p.optional and p.is_default(value)):
                continue
            out[p.key] = value if p.encode is None else p.encode(value)
            written.add(p.name)
        return out

    @classmethod
    def from_dict(cls: type[R], data: Mapping) -> R:
        """The record read back from its map (any version's, already lifted to the current one)."""
        values: dict[str, Any] = {}
        present: set[str] = set()
        for p in _plan_of(cls):
            if p.with_ is not None and p.with_ not in present:
                continue  # its leader is not there: the field keeps its default
            if p.key in data:
                present.add(p.name)
                raw = data[p.key]
                values[p.name] = p.absent() if raw is None and p.none_is_missing else p.decode(raw)
            else:
                values[p.name] = p.absent()
        return cls(**values)


def upcasters_of(cls: type, version: int, declared: Mapping[int, Callable[[dict], dict]]) -> dict[int, Callable[[dict], dict]]:
    """The functions lifting each version before `version` one step: `declared[v]` where the class
    gives one (a change its fields cannot say), then the fields added at v + 1 (``stored(since=v + 1,
    old=...)``) put in with their `old` value. Refuses a field added at a version the type does not have,
    and a version that neither adds a field nor has an upcaster (what changed must be said)."""
    added: dict[int, dict[str, Any]] = {}
    for p in _plan_of(cls):
        since = p.decl.since
        if since is None:
            continue
        if not 1 < since <= version:
            raise TypeError(f"{cls.__name__}.{p.name} is declared added in v{since}, but the type's versions are 1..{version}")
        added.setdefault(since - 1, {})[p.key] = p.decl.old
    extra = set(declared) - set(range(1, version))
    if extra:
        raise TypeError(f"{cls.__name__} declares upcasters from v{sorted(extra)}, which are not older than its v{version}")
    out: dict[int, Callable[[dict], dict]] = {}
    for v in range(1, version):
        if v not in added and v not in declared:  # a version that says nothing of what it changed: refused, as before
            raise TypeError(f"{cls.__name__} v{v + 1} adds no field (stored(since={v + 1}, old=...)) and declares no upcaster "
                            f"from v{v} (UPCASTERS[{v}])")
        out[v] = declared[v] if v not in added else _lift(v, declared.get(v), added[v])
    return out


def _lift(v: int, first: Callable[[dict], dict] | None, added: dict[str, Any]) -> Callable[[dict], dict]:
    def lift(event: dict) -> dict:
        event = first(event) if first is not None else {**event, "v": v + 1}
        return {**event, **{k: value for k, value in added.items() if k not in event}}

    return lift
