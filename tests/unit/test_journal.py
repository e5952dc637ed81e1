import math

import numpy as np
import pytest

from journal_helpers import raw_get, raw_put, step_events, tamper
from verlj.journal import (
    CodecError,
    Journal,
    JournalError,
    NotAJournalError,
    SchemaError,
    StepOrderError,
    make_event,
    packb,
    verify_journal,
)
from verlj.journal import events as events_mod
from verlj.journal.frames import STEP_HEADER, step_key


def write_steps(path, n, start=1, **kw):
    with Journal.open_writer(path, **kw) as j:
        for s in range(start, start + n):
            j.writer.append_step(s, step_events(s))


def test_append_and_read_back(tmp_path):
    write_steps(tmp_path / "j", 5)
    with Journal.open_reader(tmp_path / "j") as j:
        assert j.last_step() == 5 and j.first_step() == 1 and j.num_steps() == 5
        rec = j.read_step(3)
        assert rec.step == 3
        want = step_events(3)
        assert [e["type"] for e in rec.events] == [e["type"] for e in want]
        add = rec.events[2]["samples"]
        assert np.array_equal(add["response_ids"], want[2]["samples"]["response_ids"])
        assert add["logprobs"].dtype == np.float32
        assert math.isnan(rec.events[3]["values"]["critic/score/mean"])
        assert [r.step for r in j.iter_steps(2, 4)] == [2, 3, 4]
        assert [s for s, _ in j.iter_events("metrics")] == [1, 2, 3, 4, 5]
        with pytest.raises(JournalError, match="step 9 is not in the journal"):
            j.read_step(9)


def test_streaming_crosses_read_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr("verlj.journal.store.READ_CHUNK", 3)
    write_steps(tmp_path / "j", 10)
    with Journal.open_reader(tmp_path / "j") as j:
        assert [r.step for r in j.iter_steps()] == list(range(1, 11))
        assert [r.step for r in j.iter_steps(4, 9)] == list(range(4, 10))
        assert [r.step for r in j.iter_steps(10, 20)] == [10]


@pytest.mark.parametrize("bad_step", [0, 1, 2, 4, 5])
def test_steps_must_be_consecutive(tmp_path, bad_step):
    with Journal.open_writer(tmp_path / "j") as j:
        j.writer.append_step(1, step_events(1))
        j.writer.append_step(2, step_events(2))
        with pytest.raises(StepOrderError, match="next must be 3"):
            j.writer.append_step(bad_step, step_events(bad_step))
        assert j.last_step() == 2


def test_a_step_that_fails_to_encode_leaves_nothing(tmp_path):
    with Journal.open_writer(tmp_path / "j") as j:
        j.writer.append_step(1, step_events(1))
        with pytest.raises(CodecError):
            j.writer.append_step(2, [make_event("metrics", values={"x": object()})])
        assert j.last_step() == 1
        j.writer.append_step(2, step_events(2))
    with Journal.open_reader(tmp_path / "j") as j:
        assert verify_journal(j).ok


def test_fork_base_step_and_meta(tmp_path):
    with Journal.open_writer(tmp_path / "j") as j:
        j.writer.start_after(40, "ab" * 32, {"config": {"a": 1}})
        assert j.last_step() == 40
        with pytest.raises(StepOrderError):
            j.writer.append_step(1, [])
        j.writer.append_step(41, step_events(41))
        with pytest.raises(JournalError, match="only an empty journal can start after another's step"):
            j.writer.start_after(10, "cd" * 32)
        j.meta.add_snapshot(41, {"path": "step_00041", "fingerprint": "f"})
    with Journal.open_reader(tmp_path / "j") as j:
        assert j.meta.get("config") == {"a": 1}
        assert j.meta.snapshots() == {41: {"path": "step_00041", "fingerprint": "f"}}
        assert verify_journal(j).ok


def test_newer_schema_is_refused_and_older_is_upcast(tmp_path, monkeypatch):
    with Journal.open_writer(tmp_path / "j") as j:
        j.writer.append_step(1, [{"type": "metrics", "v": 1, "values": {"a": 1.0}}])
        j.writer.append_step(2, [{"type": "metrics", "v": 7, "values": {"from the future": 1.0}}])
    with Journal.open_reader(tmp_path / "j") as j:
        with pytest.raises(SchemaError, match="newer than this verlj understands"):
            j.read_step(2)
        report = verify_journal(j)
        assert [(p.kind, p.step) for p in report.problems] == [("unknown_schema", 2)]
        # a v2 of "metrics" arrives: v1 records are lifted by its declared upcaster
        v1 = events_mod.declared()["metrics"]
        monkeypatch.setitem(events_mod._DECLARED, "metrics", events_mod.EventSpec(
            "metrics", 2, {1: lambda e: {**e, "v": 2, "source": None}}, summary=v1.summary, payload=v1.payload))
        assert j.read_step(1).events == [{"type": "metrics", "v": 2, "values": {"a": 1.0}, "source": None}]


def test_reader_refuses_a_missing_journal(tmp_path):
    with pytest.raises(NotAJournalError, match="no journal at"):
        Journal.open_reader(tmp_path / "nope")


def test_map_grows_past_a_small_initial_size(tmp_path):
    path = tmp_path / "j"
    with Journal.open_writer(path, map_size=64 << 10) as j:
        for s in range(1, 41):
            j.writer.append_step(s, step_events(s, samples=16, tokens=64))  # ~12 KB each: ~8x the initial map
        assert j.store.env().info()["map_size"] > 64 << 10
    with Journal.open_reader(path) as j:
        assert j.last_step() == 40 and verify_journal(j).ok


# ----------------------------------------------------------------------------- corruption


def _kinds(path):
    with Journal.open_reader(path) as j:
        r = verify_journal(j)
    return [(p.kind, p.step) for p in r.problems]


def test_every_single_byte_flip_of_a_record_is_detected(tmp_path):
    path = tmp_path / "j"
    with Journal.open_writer(path) as j:
        for s in range(1, 4):
            j.writer.append_step(s, [make_event("metrics", values={"loss": s / 7})])
    with Journal.open_reader(path) as j:
        original = j.read_raw(2)
    for pos in range(len(original)):
        for mask in (0x01, 0x80):
            flipped = bytearray(original)
            flipped[pos] ^= mask
            tamper(path, lambda txn, db: raw_put(txn, db, 2, bytes(flipped)))
            problems = _kinds(path)
            assert problems and problems[0][1] == 2, (pos, mask, problems)
    tamper(path, lambda txn, db: raw_put(txn, db, 2, original))
    assert _kinds(path) == []


def test_flipped_bytes_in_the_data_file_are_detected(tmp_path):
    path = tmp_path / "j"
    write_steps(path, 6)
    with Journal.open_reader(path) as j:
        body = j.read_raw(4)[STEP_HEADER:]
    data = bytearray((path / "data.mdb").read_bytes())
    needle = body[100:164]  # inside the record's array payload
    offsets = []
    start = 0
    while (i := data.find(needle, start)) != -1:
        offsets.append(i)
        start = i + 1
    assert offsets
    for i in offsets:
        data[i + 10] ^= 0x20
    (path / "data.mdb").write_bytes(bytes(data))
    assert _kinds(path)[0] == ("bad_checksum", 4)


def test_deleted_step_is_detected(tmp_path):
    path = tmp_path / "j"
    write_steps(path, 6)
    tamper(path, lambda txn, db: txn.delete(step_key(4), db=db))
    assert _kinds(path)[0] == ("missing_step", 4)


def test_swapped_steps_are_detected(tmp_path):
    path = tmp_path / "j"
    write_steps(path, 6)

    def swap(txn, db):
        a, b = raw_get(txn, db, 2), raw_get(txn, db, 5)
        raw_put(txn, db, 2, b)
        raw_put(txn, db, 5, a)

    tamper(path, swap)
    problems = _kinds(path)
    assert problems[0][1] == 2 and ("step_mismatch", 2) in problems and ("step_mismatch", 5) in problems


def test_truncated_tail_record_is_detected(tmp_path):
    path = tmp_path / "j"
    write_steps(path, 3)
    tamper(path, lambda txn, db: raw_put(txn, db, 3, raw_get(txn, db, 3)[:50]))
    assert _kinds(path)[0] == ("undecodable", 3)


def test_damaged_record_is_refused_on_read(tmp_path):
    path = tmp_path / "j"
    write_steps(path, 3)

    def flip(txn, db):
        v = bytearray(raw_get(txn, db, 2))
        v[-1] ^= 1
        raw_put(txn, db, 2, bytes(v))

    tamper(path, flip)
    with Journal.open_reader(path) as j:
        with pytest.raises(JournalError, match="step 2 is damaged"):
            j.read_step(2)
        with pytest.raises(JournalError, match="step 2 is damaged"):
            list(j.iter_steps())


def test_damaged_meta_is_reported(tmp_path):
    path = tmp_path / "j"
    with Journal.open_writer(path) as j:
        j.meta.set("config", {"lr": 1e-6})
        j.writer.append_step(1, [])

    def flip_meta(txn, _steps):
        env_meta = txn.get(b"config", db=_meta_db[0])
        v = bytearray(env_meta)
        v[-1] ^= 4
        txn.put(b"config", bytes(v), db=_meta_db[0])

    import lmdb

    env = lmdb.open(str(path), max_dbs=4)
    _meta_db = [env.open_db(b"meta", create=False)]
    with env.begin(write=True) as txn:
        flip_meta(txn, None)
    env.close()
    assert ("bad_meta", None) in _kinds(path)


def test_packb_is_deterministic():
    ev = step_events(3)
    assert packb(ev) == packb(step_events(3))


def test_pending_entries_are_durable_apart_from_the_chain_and_a_damaged_one_is_left_out(tmp_path):
    path = tmp_path / "j"
    write_steps(path, 2)
    with Journal.open_reader(path) as r:  # a journal written before the sub-database existed, read only
        assert r.pending.entries() == {}
    with Journal.open_writer(path) as j:
        j.pending.put({b"a": {"x": np.arange(3)}, b"b": [1, 2]})
        j.pending.put({b"c": "three"}, drop=[b"a", b"nothing"])  # one transaction: writes and deletions
        chain = j.chain_hash(2)
    with Journal.open_reader(path) as r:
        assert r.pending.entries() == {b"b": [1, 2], b"c": "three"} and r.chain_hash(2) == chain and r.last_step() == 2
        assert verify_journal(r).ok
    with Journal.open_writer(path) as j:
        with j.store.env().begin(write=True) as txn:
            raw = bytearray(txn.get(b"b", db=j.store.dbs()["pending"]))
            raw[-1] ^= 1
            txn.put(b"b", bytes(raw), db=j.store.dbs()["pending"])
    with Journal.open_reader(path) as r:
        assert r.pending.entries() == {b"c": "three"}  # what it held is made again, as if never written


def test_a_durable_replace_shows_the_old_file_or_the_new_one_and_syncs_the_file_then_its_directory(tmp_path, monkeypatch):
    import os
    import stat

    from verlj.journal.durable import publish_file, replace_durably

    synced = []  # what was fsynced, in order: "file" or "dir"
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"), real(fd)))
    path = tmp_path / "m.json"
    path.write_bytes(b"old")
    replace_durably(path, b"new")
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["m.json"] and synced == ["file", "dir"]
    replace_durably(path, [b"ne", b"wer"], tmp=tmp_path / ".tmp-m")  # its parts in order, through a temporary of the caller's
    assert path.read_bytes() == b"newer" and not (tmp_path / ".tmp-m").exists()

    def fenced():
        raise RuntimeError("the claim was taken over")

    (tmp_path / ".tmp-n").write_bytes(b"newest")
    with pytest.raises(RuntimeError):
        publish_file(tmp_path / ".tmp-n", path, before=fenced)  # checked after the fsync, before the rename
    assert path.read_bytes() == b"newer" and (tmp_path / ".tmp-n").read_bytes() == b"newest"
    synced.clear()
    publish_file(tmp_path / ".tmp-n", path)
    assert path.read_bytes() == b"newest" and synced == ["file", "dir"]
