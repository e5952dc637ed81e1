"""Compact step records (payload apart, zstd, narrow integers) and pruning, on a real LMDB journal."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import lmdb
import numpy as np
import pytest

from journal_helpers import raw_get, raw_put, step_events, tamper
from verlj.journal import Journal, make_event, packb, verify_journal
from verlj.journal.frames import NO_PAYLOAD, StepFrame, _summary_frame, frame_step, step_key


def rollout_events(step: int, samples: int = 32, tokens: int = 64, vocab: int = 32000) -> list[dict]:
    """Samples as the engine journals them: padded int32 token ids (pad -1), float32 log-probs."""
    rng = np.random.default_rng(step)
    lens = rng.integers(1, tokens + 1, samples).astype(np.int32)
    ids = np.full((samples, tokens), -1, np.int32)
    lp = np.zeros((samples, tokens), np.float32)
    for i, n in enumerate(lens):
        ids[i, :n] = rng.integers(0, vocab, n)
        lp[i, :n] = -rng.exponential(2.0, n)
    lp[0, 0], lp[0, 1] = np.float32("nan"), np.float32(-0.0)
    return [
        make_event("data", epoch=0, cursor=step, indices=np.arange(4, dtype=np.int64) + step),
        make_event("buffer.add", ids=np.arange(samples, dtype=np.int64) + step * samples,
                   samples={"id": np.arange(samples, dtype=np.int64) + step * samples, "response_ids": ids,
                            "response_ids_len": lens, "gen_logprobs": lp, "score": rng.standard_normal(samples)}),
        make_event("buffer.consume", ids=np.arange(samples, dtype=np.int64) + step * samples),
        make_event("metrics", values={"actor/pg_loss": step / 7}),
        make_event("state", fingerprint=f"{step:064x}"),
    ]


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))


def test_compact_records_read_back_bit_for_bit_and_are_smaller(tmp_path):
    events = {s: rollout_events(s) for s in range(1, 6)}
    with Journal.open_writer(tmp_path / "j") as j:
        for s, ev in events.items():
            j.writer.append_step(s, ev)
    with Journal.open_reader(tmp_path / "j") as j:
        for s, ev in events.items():
            record = j.read_step(s)
            assert record.pruned is False
            assert same(record.events, ev), s  # dtypes, shapes, NaN and -0.0 bits included
            frame = StepFrame.parse(j.read_raw(s))
            assert frame.version == 2 and frame.payload and frame.payload_digest != NO_PAYLOAD
            inline = frame_step(packb({"v": 1, "step": s, "time": 0.0, "events": events[s]}), bytes(32))
            assert len(j.read_raw(s)) < 0.6 * len(inline), (len(j.read_raw(s)), len(inline))
        assert verify_journal(j).ok


def test_uncompressed_level_zero_reads_back_the_same(tmp_path):
    with Journal.open_writer(tmp_path / "j", compression_level=0) as j:
        j.writer.append_step(1, rollout_events(1))
        record = j.read_step(1)
    assert same(record.events, rollout_events(1))


def test_a_v1_journal_stays_readable_and_continues(tmp_path):
    """Old frames (everything inline) are read and upcast; new steps chain on from them."""
    path = tmp_path / "j"
    old = step_events(1)
    with Journal.open_writer(path) as j:
        j.writer.append_step(1, old)  # creates the sub-databases; replaced below by a v1 frame
        summary_1 = j.read_summary(1)
    v1 = frame_step(packb({"v": 1, "step": 1, "time": summary_1.time, "events": old}), bytes(32))
    v1_summary = _summary_frame(1, summary_1.time, old)  # v1 journals kept a summary entry per step

    env = lmdb.open(str(path), max_dbs=8, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(step_key(1), v1, db=env.open_db(b"steps", txn=txn))
        txn.put(step_key(1), v1_summary, db=env.open_db(b"summary", txn=txn))
        txn.delete(b"shapes", db=env.open_db(b"meta", txn=txn))  # a v1 journal had no interned shapes
    env.close()
    with Journal.open_writer(path) as j:
        j.writer.append_step(2, step_events(2))
        r1, r2 = j.read_step(1), j.read_step(2)
        assert r1.pruned is False and same(r1.events, old)
        assert same(r2.events, step_events(2))
        pruned, _ = j.retention.prune(2)
        assert pruned == 1  # step 2 only: a v1 frame has no separate payload and stays as it is
        assert j.read_step(1).pruned is False and j.read_step(2).pruned is True
        report = verify_journal(j)
    assert report.ok, report.problems


def test_pruning_keeps_the_chain_summaries_and_ids_and_drops_only_samples(tmp_path):
    path = tmp_path / "j"
    with Journal.open_writer(path) as j:
        for s in range(1, 7):
            j.writer.append_step(s, rollout_events(s))
        before = {s: j.read_raw(s) for s in range(1, 7)}
        summaries = [j.read_summary(s) for s in range(1, 7)]
        pruned, freed = j.retention.prune(4, meta={"note": "x"})
        assert pruned == 4 and freed == sum(len(StepFrame.parse(before[s]).payload) for s in range(1, 5))
        assert j.retention.pruned_through() == 4 and j.meta.get("note") == "x"
        for s in range(1, 7):
            record, frame = j.read_step(s), StepFrame.parse(j.read_raw(s))
            old = StepFrame.parse(before[s])
            assert (frame.checksum, frame.chain, frame.payload_digest, frame.body) == (old.checksum, old.chain, old.payload_digest, old.body)
            add = next(e for e in record.events if e["type"] == "buffer.add")
            assert same(add["ids"], rollout_events(s)[1]["ids"])
            assert record.pruned is (s <= 4) and ("samples" in add) is (s > 4)
        assert same([j.read_summary(s).to_dict() for s in range(1, 7)], [x.to_dict() for x in summaries])
        report = verify_journal(j)
        assert report.ok and report.pruned == 4 and report.pruned_through == 4
        assert j.retention.prune(4) == (0, 0)  # nothing more to do
        with pytest.raises(Exception, match="pruned already"):
            j.retention.prune(3)


def test_damage_to_a_pruned_step_or_a_payload_missing_beyond_pruning_is_detected(tmp_path):
    path = tmp_path / "j"
    with Journal.open_writer(path) as j:
        for s in range(1, 6):
            j.writer.append_step(s, rollout_events(s))
        j.retention.prune(2)
    flipped = bytearray(raw_read(path, 2))
    flipped[-5] ^= 0x01  # inside the pruned step's core
    tamper(path, lambda txn, db: raw_put(txn, db, 2, bytes(flipped)))
    gone = StepFrame.parse(raw_read(path, 4)).without_payload()  # step 4 loses its samples, unasked
    tamper(path, lambda txn, db: raw_put(txn, db, 4, gone))
    with Journal.open_reader(path) as j:
        problems = [(p.kind, p.step) for p in verify_journal(j).problems]
    assert ("bad_checksum", 2) in problems and ("payload_missing", 4) in problems


def test_pruning_stops_the_file_from_growing(tmp_path):
    """LMDB reuses the pages pruned payloads free: past the retention window the file grows only by
    what every step keeps (its record without samples), not by its samples."""
    path = tmp_path / "j"
    sizes, kept, payloads = {}, 0, 0
    with Journal.open_writer(path) as j:
        for s in range(1, 401):
            j.writer.append_step(s, rollout_events(s, samples=16, tokens=512))
            if s % 10 == 0 and s > 20:
                j.retention.prune(s - 20)
            if s in (200, 400):
                sizes[s] = _used(j)
            if s > 200:
                frame = StepFrame.parse(j.read_raw(s))
                kept += len(frame.without_payload())  # a v2 record's core is also its summary
                payloads += len(frame.payload)
    growth = sizes[400] - sizes[200]
    assert payloads > 20 * kept  # the samples are what would make the file grow
    assert growth <= 2 * kept + (64 << 10), (growth, kept, payloads)


def _used(j: Journal) -> int:
    info, stat = j.store.env().info(), j.store.env().stat()
    return (info["last_pgno"] + 1) * stat["psize"]  # the file's used length (the map may be larger)


def test_kill_inside_the_prune_transaction_leaves_every_payload(tmp_path):
    path = tmp_path / "j"
    with Journal.open_writer(path) as j:
        for s in range(1, 5):
            j.writer.append_step(s, rollout_events(s))
    code = textwrap.dedent(f"""
        from verlj.journal import Journal
        with Journal.open_writer({str(path)!r}) as j:
            j.retention.prune(3, meta={{"archive": ["x"]}})
    """)
    env = {**os.environ, "VERLJ_FAILPOINT": "journal.prune:1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    assert out.returncode == -9, out.stderr
    with Journal.open_reader(path) as j:
        assert j.retention.pruned_through() == 0 and j.meta.get("archive") is None
        assert all(not j.read_step(s).pruned for s in range(1, 5))
        assert same(j.read_step(2).events, rollout_events(2))
        assert verify_journal(j).ok


def raw_read(path, step):
    out = {}
    tamper(path, lambda txn, db: out.setdefault("v", raw_get(txn, db, step)))
    return out["v"]


def varied_events(step: int, extra: bool = False) -> list[dict]:
    """Everything the v3 core encoding treats specially, and what it must leave alone."""
    events = [
        make_event("data", epoch=0, cursor=step, indices=np.arange(5, dtype=np.int64) + step, rounds=1),
        make_event("rng", seeds={"data": step, "rollout": 2**40 + step}, digests={"torch": f"{step:064x}", "numpy": "ABCDEF0123456789"}),
        make_event("buffer.consume", ids=np.array([7, 3, 9, 10], np.int64)),  # not consecutive: stays an array
        make_event("buffer.drop", ids=np.arange(2**63 - 3, 2**63, dtype=np.uint64), reason="stale"),
        make_event("metrics", values={"a/x": 1.5, "a/nan": float("nan"), "a/neg0": -0.0, "a/inf": float("-inf")}),
        make_event("state", fingerprint=f"{step:064x}", parts={"actor": "ab" * 32, "odd": "abc"}),
        make_event("control", kind="start", details={1: "int key", "nested": {"f": np.float64(0.25), "e": {}}, "one": 2.0}),
    ]
    if extra:
        events.append(make_event("eval", rows=np.arange(3, dtype=np.int32), scores=np.ones(3)))
    return events


def test_v3_cores_read_back_exactly_and_declare_each_shape_once(tmp_path):
    from verlj.journal import codec

    with Journal.open_writer(tmp_path / "j") as j:
        j.writer.append_step(1, varied_events(1))
        j.writer.append_step(2, varied_events(2))
        j.writer.append_step(3, varied_events(3, extra=True))
        heads = [codec.core_head(StepFrame.parse(j.read_raw(s)).body)[0] for s in (1, 2, 3)]
        back = [j.read_step(s).events for s in (1, 2, 3)]
    assert heads[0] is not None and heads[1] is None  # step 2 reuses step 1's shapes
    assert heads[2][0] == len(heads[0][1]) and len(heads[2][1]) == 1  # step 3 declares only the eval event's
    for s, events in zip((1, 2, 3), back):
        assert same(events, varied_events(s, extra=s == 3)), s
    with Journal.open_reader(tmp_path / "j") as j:
        assert same(j.read_summary(3).metrics, varied_events(3)[4]["values"])
        assert verify_journal(j).ok


def test_v3_core_is_a_fraction_of_the_v2_core(tmp_path):
    """On the journal bench's records (40 metrics, a fingerprint, consecutive ids): the core is what a
    pruned step keeps forever."""
    rng = np.random.default_rng(0)

    def events(s):
        ev = rollout_events(s)
        ev[3] = make_event("metrics", values={f"actor/metric_{i}": float(rng.standard_normal()) for i in range(40)})
        return ev

    with Journal.open_writer(tmp_path / "j") as j:
        for s in range(1, 4):
            j.writer.append_step(s, events(s))
        v3 = len(StepFrame.parse(j.read_raw(3)).body)
    core_events = [{k: v for k, v in e.items() if k != "samples"} for e in events(3)]
    v2 = len(packb({"v": 2, "step": 3, "time": 0.0, "events": core_events, "payload": {"codec": "zstd", "size": 1, "raw_size": 1}}))
    assert v3 <= 40 * 8 + 32 + 80 and v3 < 0.35 * v2, (v3, v2)  # the 40 float64 values and the digest, plus little


def test_an_append_that_fails_declares_nothing_and_readers_follow_new_shapes(tmp_path):
    from verlj.journal import StepOrderError

    with Journal.open_writer(tmp_path / "j") as w:
        w.writer.append_step(1, varied_events(1))
        with Journal.open_reader(tmp_path / "j") as r:  # another process's reader: its own table (a fresh handle here)
            r.store.forget_shapes()
            assert same(r.read_step(1).events, varied_events(1))
            with pytest.raises(StepOrderError):
                w.writer.append_step(5, varied_events(5, extra=True))  # not committed: its new shape is forgotten
            w.writer.append_step(2, varied_events(2, extra=True))  # declares it again, in a committed record
            assert same(r.read_step(2).events, varied_events(2, extra=True))  # the reader reloads the table
        assert verify_journal(w).ok


def test_tampered_shapes_in_meta_are_caught(tmp_path):
    path = tmp_path / "j"
    with Journal.open_writer(path) as j:
        j.writer.append_step(1, varied_events(1))
        j.writer.append_step(2, varied_events(2))
        shapes = j.meta.get("shapes")
    floats = next(i for i, e in enumerate(shapes) if e[0] == 1)
    shapes[floats] = [1, *reversed(shapes[floats][1:])]  # metric names swapped: the values would change names
    with Journal.open_writer(path) as j:
        j.meta.set("shapes", shapes)
        report = verify_journal(j)
    assert [p.kind for p in report.problems] == ["bad_meta"], report.problems


def test_a_journal_of_v2_cores_continues_in_v3(tmp_path):
    """Steps written before cores were compacted read as they were; new steps chain on in v3."""
    from verlj.journal import codec
    from verlj.journal.frames import frame_step2, split_payload

    path = tmp_path / "j"
    with Journal.open_writer(path) as j:
        j.writer.append_step(1, varied_events(1))  # creates the sub-databases; replaced below by a v2 frame
    core_events, payload, desc = split_payload(varied_events(1), 1)
    v2 = frame_step2(codec.packb_compact({"v": 2, "step": 1, "time": 1.0, "events": core_events, "payload": desc}), payload, bytes(32))

    env = lmdb.open(str(path), max_dbs=8, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(step_key(1), v2, db=env.open_db(b"steps", txn=txn))
        txn.delete(b"shapes", db=env.open_db(b"meta", txn=txn))  # a v2 journal had no shapes
    env.close()
    with Journal.open_writer(path) as j:
        j.writer.append_step(2, varied_events(2))
        assert not codec.is_core_v3(StepFrame.parse(j.read_raw(1)).body) and codec.is_core_v3(StepFrame.parse(j.read_raw(2)).body)
        assert same(j.read_step(1).events, varied_events(1)) and same(j.read_step(2).events, varied_events(2))
        assert same(j.read_summary(1).metrics, j.read_summary(2).metrics | {"a/x": 1.5})
        report = verify_journal(j)
    assert report.ok, report.problems
