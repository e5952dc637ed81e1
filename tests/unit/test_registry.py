"""The event registry: each journaled event type declared once, on its class (engine/schema/events.py),
and every version it names held by a journal under tests/fixtures, every upcaster exercised by one.

A new version of an event type (or of the envelope) fails `test_every_version_and_upcaster_is_exercised_by_a_fixture`
until a journal written at the old version is added to FIXTURES (tests/fixtures/envelope/make.py shows how one
was made with an older release's journal)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from verlj.engine.schema import events as ev
from verlj.engine.schema.record import stored
from verlj.journal import EventSpec, Journal, SchemaError, declare, declared, make_event, open_journal_reader, packb, verify_journal
from verlj.journal import events as registry

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
# Journals of every version verlj has written: v0/* are runs of the release before the typed schema (envelope
# v3, every event type at v1); envelope/v1 and envelope/v2 are v0/sync's records written by the releases that
# wrote those envelopes.
JOURNALS = ("v0/sync", "v0/stepo", "v0/compl", "envelope/v1", "envelope/v2")


def test_each_event_type_is_declared_once_by_its_class():
    assert set(ev.EVENT_TYPES) == set(declared())
    for type_, spec in declared().items():
        cls = ev.EVENT_TYPES[type_]
        assert cls.TYPE == type_ and spec.version == cls.VERSION and dict(spec.upcasters) == dict(cls.UPCASTERS)
        assert (spec.summary, spec.payload) == (cls.SUMMARY, cls.PAYLOAD)
        assert {"TYPE", "VERSION", "UPCASTERS"} <= set(vars(cls)), cls  # its own, not inherited
        assert make_event(type_)["v"] == cls.VERSION
    # every declared type is read into a field of StepEvents, once or repeated
    assert set(ev.STEP_FIELDS) | set(ev.STEP_MANY) == set(declared()) and not set(ev.STEP_FIELDS) & set(ev.STEP_MANY)
    assert set(ev.STEP_FIELDS.values()) | set(ev.STEP_MANY.values()) <= {f.name for f in fields(ev.StepEvents)}
    # what the store keeps apart and in the summary, as it always was (a journal's bytes depend on it)
    assert {t for t, s in declared().items() if s.summary} == {"data", "rng", "rollout", "metrics", "state", "control", "config"}
    assert {t: s.payload for t, s in declared().items() if s.payload} == {"buffer.add": ("samples",)}


def test_the_registry_refuses_what_it_cannot_honour():
    with pytest.raises(SchemaError, match="needs an upcaster from each older version"):
        EventSpec("metrics", 3, {1: lambda e: {**e, "v": 2}})
    with pytest.raises(SchemaError, match="versions count from 1"):
        EventSpec("metrics", 0)
    with pytest.raises(SchemaError, match="declared twice, differently"):
        declare(EventSpec("metrics", 1, summary=False))
    declare(EventSpec("metrics", 1, summary=True))  # the same declaration again (a module imported twice): fine
    with pytest.raises(SchemaError, match="unknown journal event type 'nope'"):
        make_event("nope")


def test_an_upcaster_that_does_not_lift_one_version_is_refused(monkeypatch):
    monkeypatch.setitem(registry._DECLARED, "metrics", EventSpec("metrics", 2, {1: lambda e: e}, summary=True))
    with pytest.raises(SchemaError, match="from v1 gave v1, not v2"):
        registry.upcast_event({"type": "metrics", "v": 1, "values": {}})


def test_a_new_event_type_declares_itself_and_round_trips(tmp_path, monkeypatch):
    """What a new event (the agent gateway's, say) needs: a frozen dataclass with its TYPE and VERSION, its
    fields, and @declared; its map comes from the fields. Its next version declares the field it adds
    (`stored(since=2, old=...)`), and its v1 journal reads back as v2 through the upcaster made from that."""
    monkeypatch.setattr(registry, "_DECLARED", dict(registry._DECLARED))
    monkeypatch.setattr(registry, "_SUMMARY", registry._SUMMARY)
    monkeypatch.setattr(ev, "EVENT_TYPES", dict(ev.EVENT_TYPES))

    @ev.declared
    @dataclass(frozen=True)
    class Call(ev.Event):
        TYPE: ClassVar[str] = "probe.call"
        VERSION: ClassVar[int] = 1
        tokens: np.ndarray = field(metadata=stored(dtype=np.int64))

    call = Call(np.arange(3, dtype=np.int32))
    assert list(call.to_event()) == ["type", "v", "tokens"] and Call.UPCASTERS == {}
    with Journal.open_writer(tmp_path / "j") as j:
        j.writer.append_step(1, [call.to_event()])

    del registry._DECLARED["probe.call"]  # the next release of the same code: its class says v2 instead

    @ev.declared
    @dataclass(frozen=True)
    class Call2(ev.Event):  # its v2 adds `model`; a v1 call was the policy's
        TYPE: ClassVar[str] = "probe.call"
        VERSION: ClassVar[int] = 2
        tokens: np.ndarray = field(metadata=stored(dtype=np.int64))
        model: str = field(metadata=stored(since=2, old="policy"))

    assert set(declared()["probe.call"].upcasters) == {1}
    with Journal.open_reader(tmp_path / "j") as j:
        (e,) = j.read_step(1).events
    assert e["v"] == 2 and e["model"] == "policy" and e["tokens"].tolist() == [0, 1, 2]
    typed = Call2.from_event(e)
    assert typed.model == "policy" and typed.tokens.dtype == np.int64 and typed.tokens.tolist() == [0, 1, 2]
    assert list(typed.to_event()) == ["type", "v", "tokens", "model"] and typed.to_event()["v"] == 2
    with pytest.raises(TypeError, match="must declare its own VERSION"):
        @ev.declared
        @dataclass(frozen=True)
        class Inherits(Call):
            TYPE: ClassVar[str] = "probe.other"
    with pytest.raises(TypeError, match="v2 adds no field .* and declares no upcaster from v1"):
        @ev.declared
        @dataclass(frozen=True)
        class Silent(ev.Event):  # a new version that says nothing of what changed
            TYPE: ClassVar[str] = "probe.silent"
            VERSION: ClassVar[int] = 2
            tokens: np.ndarray
    with pytest.raises(TypeError, match="added in v3, but the type's versions are 1..2"):
        @ev.declared
        @dataclass(frozen=True)
        class Ahead(ev.Event):
            TYPE: ClassVar[str] = "probe.ahead"
            VERSION: ClassVar[int] = 2
            model: str = field(metadata=stored(since=3, old="policy"))


def test_an_upcaster_the_fields_cannot_say_is_declared_beside_them(monkeypatch):
    """A change that is no added field (a rename) gives its own upcaster in UPCASTERS; the fields added in
    the same version are put in after it."""
    monkeypatch.setattr(registry, "_DECLARED", dict(registry._DECLARED))
    monkeypatch.setattr(registry, "_SUMMARY", registry._SUMMARY)
    monkeypatch.setattr(ev, "EVENT_TYPES", dict(ev.EVENT_TYPES))

    def renamed(e: dict) -> dict:
        out = {k: v for k, v in e.items() if k != "ids"}
        return {**out, "v": 2, "tokens": e["ids"]}

    @ev.declared
    @dataclass(frozen=True)
    class Renamed(ev.Event):
        TYPE: ClassVar[str] = "probe.renamed"
        VERSION: ClassVar[int] = 2
        UPCASTERS: ClassVar[ev.Upcasters] = {1: renamed}
        tokens: list
        model: str = field(metadata=stored(since=2, old="policy"))

    lifted = registry.upcast_event({"type": "probe.renamed", "v": 1, "ids": [4, 5]})
    assert lifted == {"type": "probe.renamed", "v": 2, "tokens": [4, 5], "model": "policy"}
    assert Renamed.from_event(lifted) == Renamed([4, 5], "policy")


def _read_all(journals: list[Path]) -> tuple[set[tuple[str, int]], set[int]]:
    """(type, version) of every event as stored, and every envelope version, over the journals' records."""
    events, envelopes = set(), set()
    real_event, real_record = registry.upcast_event, registry.upcast_record

    def seen_event(e: dict) -> dict:
        events.add((e["type"], e["v"]))
        return real_event(e)

    def seen_record(r: dict):
        envelopes.add(r["v"])
        return real_record(r)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "upcast_event", seen_event)
        mp.setattr("verlj.journal.frames.upcast_record", seen_record)
        for path in journals:
            with open_journal_reader(path) as j:
                assert sum(1 for _ in j.iter_steps()) >= 3, path
    return events, envelopes


def unexercised(journals: list[Path]) -> list[str]:
    """The versions no journal holds among those the registry names: every version an upcaster lifts
    (each event type's 1..VERSION-1; v1 of a type without upcasters: the type itself) and every envelope
    version. Each is an upcaster (or a type) that reading old journals never tests."""
    events, envelopes = _read_all(journals)
    missing = [f"{t} v{v}" for t, spec in sorted(declared().items()) for v in range(1, max(spec.version, 2)) if (t, v) not in events]
    missing += [f"envelope v{v}" for v in range(1, registry.ENVELOPE_VERSION + 1) if v not in envelopes]
    assert set(registry.ENVELOPE_UPCASTERS) == set(range(1, registry.ENVELOPE_VERSION))
    return missing


@pytest.fixture(scope="module")
def journals(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("fixtures")
    out = []
    for name in JOURNALS:  # copies: a reader leaves a lock file beside data.mdb
        shutil.copytree(FIXTURES / name / "journal", root / name / "journal")
        out.append(root / name / "journal")
    return out


def test_every_version_and_upcaster_is_exercised_by_a_fixture(journals, monkeypatch):
    assert unexercised(journals) == []
    # and the check can fail: a v2 of "metrics" is exercised (the fixtures hold v1), a v3's upcaster from v2 is not
    spec = declared()["metrics"]
    lift = {1: lambda e: {**e, "v": 2}, 2: lambda e: {**e, "v": 3}}
    monkeypatch.setitem(registry._DECLARED, "metrics", EventSpec("metrics", 2, {1: lift[1]}, summary=spec.summary))
    assert unexercised(journals) == []
    monkeypatch.setitem(registry._DECLARED, "metrics", EventSpec("metrics", 3, lift, summary=spec.summary))
    assert unexercised(journals) == ["metrics v2"]


def test_older_envelopes_read_as_the_current_one(journals):
    """envelope/v1 and v2 hold v0/sync's records: read back, each event is the same bytes (v1's writer knew
    fewer types: it holds those it knew), never pruned, and verify finds the chain whole."""
    by_name = dict(zip(JOURNALS, journals))
    with open_journal_reader(by_name["v0/sync"]) as j:
        want = {r.step: r for r in j.iter_steps()}
    for name, types in (("envelope/v1", {"data", "rng", "buffer.add", "buffer.consume", "buffer.drop", "metrics", "state", "control",
                                         "config"}), ("envelope/v2", set(declared()))):
        with Journal.open_reader(by_name[name]) as j:
            got = list(j.iter_steps())
            assert [r.step for r in got] == sorted(want)
            for r in got:
                w = want[r.step]
                assert r.time == w.time and r.pruned is False and r.state_fingerprint == w.state_fingerprint
                assert packb(r.events) == packb([e for e in w.events if e["type"] in types]), (name, r.step)
                assert packb(j.read_summary(r.step).events) == packb([e for e in r.events if declared()[e["type"]].summary])
            report = verify_journal(j)
        assert report.ok, (name, report.problems)
