"""Shipped journals (journal/segments.py): sealed segments, the bounded lag, rebuild, damage."""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import verlj.engine  # noqa: F401  (declares verlj's event types to the journal: these tests write them)
from verlj.journal import Journal, JournalError, make_event, open_journal_reader, segments, shipper, verify_journal


def _events(step: int) -> list[dict]:
    rng = np.random.default_rng(step)
    return [
        make_event("metrics", values={"loss": float(step) / 3, "nan": float("nan")}),
        make_event("buffer.add", ids=rng.integers(0, 50_000, size=(8, 64), dtype=np.int64),
                   logprobs=rng.standard_normal((8, 64)).astype(np.float32)),
        make_event("state", fingerprint=f"fp{step}"),
    ]


def _write(local: Path, shipped: Path, steps: range, max_lag: int = 1, snapshot_every: int = 5) -> None:
    j, _notes = segments.open_writer(local, shipped, max_lag)
    with j:
        if j.meta.get("config") is None:
            j.meta.update({"config": {"seed": 1}})
        for s in steps:
            j.writer.append_step(s, _events(s))
            assert j.shipping.shipper.shipped_step >= s - max_lag  # the bound holds after every commit
            if s % snapshot_every == 0:
                j.meta.add_snapshot(s, {"path": f"step_{s:05d}"})


def _dump(path: Path) -> dict:
    with Journal.open_reader(path) as j:
        _frames, meta, snapshots = j.shipping.read_cut(j.last_step(), 1)
        return {
            "steps": list(j.iter_raw()),
            "summary": list(j.store.iter_db(j.store.dbs()["summary"], None, None, 16)),
            "meta": meta,
            "snapshots": snapshots,
        }


def test_rebuild_is_byte_identical_to_the_live_journal(tmp_path):
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    _write(local, shipped, range(1, 31), max_lag=3)
    found = segments.scan(shipped)
    assert found.problem is None and found.last_step == 30
    segments.rebuild(shipped, tmp_path / "L2")
    assert _dump(tmp_path / "L2") == _dump(local)
    with Journal.open_reader(tmp_path / "L2") as j:
        assert verify_journal(j).ok


def test_a_segment_carries_the_metadata_committed_before_its_steps(tmp_path, monkeypatch):
    """The shipper stalls on a slow filesystem while the run's identity and two steps are committed:
    whatever segment carries those steps carries the identity too, so a rebuild from segments never
    holds steps without the run's config (a lost last segment then looked like a run never started)."""
    import threading

    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    gate, entered = threading.Event(), threading.Event()
    publish = shipper.publish

    def slow(where, seg, claim=None):
        entered.set()
        gate.wait(10)
        publish(where, seg, claim)

    monkeypatch.setattr(shipper, "publish", slow)
    j, _notes = segments.open_writer(local, shipped, max_lag=4)
    with j:
        assert entered.wait(10)  # the first shipment (the journal id) is on its way, and stuck
        j.meta.update({"config": {"seed": 1}})
        j.writer.append_step(1, _events(1))
        j.writer.append_step(2, _events(2))
        gate.set()
    for seg in (segments.read_segment(p) for p in sorted(segments.segment_dir(shipped).glob("*.seg"))):
        if seg.first is not None:
            assert seg.meta is not None and b"config" in seg.meta, (seg.seq, seg.first, seg.last)


def test_closing_ships_everything_and_reopening_continues_the_numbering(tmp_path):
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    _write(local, shipped, range(1, 6), max_lag=100)  # never waits: only close() ships the rest
    assert segments.scan(shipped).last_step == 5
    _write(local, shipped, range(6, 11), max_lag=100)
    found = segments.scan(shipped)
    assert found.problem is None and found.last_step == 10
    assert [s.seq for s in found.segments] == list(range(1, len(found.segments) + 1))


def test_reader_without_the_local_copy_rebuilds_and_cleans_up(tmp_path):
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    _write(local, shipped, range(1, 11))
    with open_journal_reader(shipped) as j:  # this host has the live copy: it is read in place
        assert Path(j.path) == local.resolve()
    live = _dump(local)
    for name in ("data.mdb", "lock.mdb", "writer.lock"):
        (local / name).unlink()
    with open_journal_reader(shipped) as j:
        tmp = Path(j.path)
        assert tmp != local and j.last_step() == 10 and j.shipping.problem is None
        assert _dump(tmp) == live
    with open_journal_reader(shipped) as j:  # rebuilt once per process
        assert Path(j.path) == tmp
    # ... and removed when the process exits
    code = ("import sys; from verlj.journal import open_journal_reader as o\n"
            "with o(sys.argv[1]) as j: print(j.path)")
    out = subprocess.run([sys.executable, "-c", code, str(shipped)], capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).name == "journal" and not Path(out.stdout.strip()).exists()


@pytest.mark.parametrize("damage", [None, "truncate"])
def test_a_resume_from_segments_reads_them_once_and_copies_nothing(tmp_path, monkeypatch, damage):
    """The node is lost with its local journal. A resume stages the rebuild beside the new local_dir
    before it reads the run: every reader opens that copy, and the writer renames it into place. The
    segments are read (scanned) once, the data.mdb the writer opens is the staged file itself (same
    inode: not a copy), and the result is byte-identical to a rebuild, with a torn last segment too."""
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    _write(local, shipped, range(1, 13), max_lag=0)
    if damage:
        last = sorted(segments.segment_dir(shipped).glob("*.seg"))[-1]
        last.write_bytes(last.read_bytes()[:-7])
    segments.rebuild(shipped, tmp_path / "expected")
    shutil.rmtree(local)
    scans = []
    real_scan = segments.scan
    monkeypatch.setattr(segments, "scan", lambda where: scans.append(where) or real_scan(where))

    new = tmp_path / "node2" / "L"
    meta, last_step = segments.shipped_meta(shipped)
    assert meta["config"] == {"seed": 1} and last_step == segments.scan(shipped).last_step
    scans.clear()
    assert segments.stage_for_writer(shipped, new)
    staged = next((tmp_path / "node2").glob(".verlj-rebuild-L-*")) / "journal"
    inode = (staged / "data.mdb").stat().st_ino
    for _ in range(3):  # a resume reads the run several times before it opens the writer
        with open_journal_reader(shipped) as j:
            assert Path(j.path) == staged and (j.shipping.problem is not None) == bool(damage)
    j, notes = segments.open_writer(new, shipped, 0)
    with j:
        assert any(n.startswith(f"Rebuilt the journal in {new}") for n in notes), notes
        assert any(" lost with it and will be run again" in n for n in notes) == bool(damage), notes
        assert (new / "data.mdb").stat().st_ino == inode
    assert len(scans) == 1
    assert [p.name for p in (tmp_path / "node2").iterdir()] == ["L"]  # the staging directory is gone
    assert _dump(new)["steps"] == _dump(tmp_path / "expected")["steps"]
    assert not segments.stage_for_writer(shipped, new)  # it holds a journal now: nothing to stage


def test_a_staged_rebuild_nobody_adopts_is_removed_at_exit_or_by_the_next_resume(tmp_path):
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    _write(local, shipped, range(1, 4))
    shutil.rmtree(local)
    code = ("import os, sys; from verlj.journal import segments\n"
            "assert segments.stage_for_writer(sys.argv[1], sys.argv[2])\n"
            "if sys.argv[3] == 'kill': os.kill(os.getpid(), 9)")
    new = tmp_path / "n" / "L"
    subprocess.run([sys.executable, "-c", code, str(shipped), str(new), "exit"], check=True)
    assert list((tmp_path / "n").iterdir()) == []
    killed = subprocess.run([sys.executable, "-c", code, str(shipped), str(new), "kill"])
    assert killed.returncode == -9 and len(list((tmp_path / "n").iterdir())) == 1  # a resume killed after staging
    assert segments.stage_for_writer(shipped, new)  # the next resume removes it
    assert len(list((tmp_path / "n").iterdir())) == 1
    j, _notes = segments.open_writer(new, shipped, 0)
    j.close()
    assert [p.name for p in (tmp_path / "n").iterdir()] == ["L"]


def test_a_killed_reader_s_rebuilt_copy_is_removed_by_the_next_reader(tmp_path, monkeypatch):
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    _write(local, shipped, range(1, 4))
    shutil.rmtree(local)  # segments only: every reader rebuilds them into the temporary directory
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("import os, sys; from verlj.journal import open_journal_reader\n"
            "j = open_journal_reader(sys.argv[1]); assert j.last_step() == 3\n"
            "if sys.argv[2] == 'kill': os.kill(os.getpid(), 9)")
    subprocess.run([sys.executable, "-c", code, str(shipped), "exit"], check=True, env={**os.environ, "TMPDIR": str(tmp)})
    assert list(tmp.iterdir()) == []  # removed at exit
    killed = subprocess.run([sys.executable, "-c", code, str(shipped), "kill"], env={**os.environ, "TMPDIR": str(tmp)})
    assert killed.returncode == -9 and [p.name.startswith("verlj-journal-") for p in tmp.iterdir()] == [True]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    segments._REBUILT.pop(os.path.realpath(segments.segment_dir(shipped)), None)
    with open_journal_reader(shipped) as j:  # the next reader: its own copy, and the dead one's is gone
        assert j.last_step() == 3
        assert [p for p in tmp.iterdir()] == [Path(j.path).parent]
    segments._remove_rebuilt()


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_damaged_last_segment_costs_only_its_steps(tmp_path, damage):
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    _write(local, shipped, range(1, 13), max_lag=0, snapshot_every=100)
    files = sorted(segments.segment_dir(shipped).glob("*.seg"))
    last = segments.read_segment(files[-1])
    assert last.first is not None  # the last shipment carried steps
    raw = bytearray(files[-1].read_bytes())
    if damage == "truncate":
        files[-1].write_bytes(bytes(raw[: len(raw) - 7]))
    else:
        raw[-5] ^= 0x10
        files[-1].write_bytes(bytes(raw))
    found = segments.rebuild(shipped, tmp_path / "L2")
    assert found.problem_at_end and found.lost_steps == (last.first, last.last)
    with Journal.open_reader(tmp_path / "L2") as j:
        assert j.last_step() == last.first - 1 and verify_journal(j).ok
    # the node is lost with its local journal; a writer elsewhere sets the segment aside, says what was
    # lost, and ships the steps again under the same number
    shutil.rmtree(local)
    j, notes = segments.open_writer(tmp_path / "L3", shipped, 0)
    with j:
        was = f"step {last.first} was" if last.first == last.last else f"steps {last.first}–{last.last} were"  # "step 27 were lost" was said
        assert any(f": {was} lost with it and will be run again" in n for n in notes), notes
        j.writer.append_step(last.first, _events(last.first))
    assert segments.scan(shipped).problem is None
    assert (segments.segment_dir(shipped) / f".damaged-{last.seq:010d}.seg").exists()


def test_damage_before_the_last_segment_is_refused(tmp_path):
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    _write(local, shipped, range(1, 11), max_lag=0)
    files = sorted(segments.segment_dir(shipped).glob("*.seg"))
    raw = bytearray(files[3].read_bytes())
    raw[len(raw) // 2] ^= 0x01
    files[3].write_bytes(bytes(raw))
    with pytest.raises(JournalError, match="before its last segment|cannot be rebuilt"):
        segments.open_writer(tmp_path / "L2", shipped, 0)
    assert not (tmp_path / "L2" / "data.mdb").exists()
    files[3].unlink()
    with pytest.raises(JournalError, match="0000000004.seg is missing"):
        segments.rebuild(shipped, tmp_path / "L2")
    with open_journal_reader(shipped) as j:  # the live copy on this host is whole: read in place
        assert j.last_step() == 10 and Path(j.path) == local.resolve()
    for name in ("data.mdb", "lock.mdb", "writer.lock"):
        (local / name).unlink()
    # from the segments alone, post-mortem reads the intact prefix and says what is wrong
    with open_journal_reader(shipped) as j:
        assert j.shipping.problem and "missing" in j.shipping.problem
        assert j.last_step() == segments.scan(shipped).last_step < 10


def test_a_local_dir_holding_another_journal_is_refused(tmp_path):
    _write(tmp_path / "L", tmp_path / "a" / "journal", range(1, 4))
    with pytest.raises(JournalError, match="does not match"):
        segments.open_writer(tmp_path / "L", tmp_path / "b" / "journal", 1)
    _write(tmp_path / "M", tmp_path / "b" / "journal", range(1, 3))
    for name in ("data.mdb", "lock.mdb", "writer.lock"):
        (tmp_path / "M" / name).unlink()
    with pytest.raises(JournalError, match="does not match"):  # a's journal is not b's, whatever it holds
        segments.open_writer(tmp_path / "L", tmp_path / "b" / "journal", 1)


def test_a_copy_never_opens_the_original_s_local_journal_and_a_move_takes_it_over(tmp_path):
    """cp -a carries local.json along: the copy neither writes into nor reads the local journal its original
    still uses; a moved run (its old path gone) is that run and goes on in it."""
    local, run, copy, moved = tmp_path / "L", tmp_path / "run", tmp_path / "copy", tmp_path / "moved"
    _write(local, run / "journal", range(1, 6))
    shutil.copytree(run, copy)
    held = _dump(local)
    with pytest.raises(segments.CopiedJournalError, match=f"{copy / 'journal'} is a copy of that one"):
        segments.open_writer(local, copy / "journal", 1)
    assert _dump(local) == held
    _write(local, run / "journal", range(6, 9))  # the original goes on
    with open_journal_reader(copy / "journal") as j:  # the copy reads its own history, not the original's steps 6-8
        assert Path(j.path) != local.resolve() and j.last_step() == 5
    shutil.rmtree(copy)
    run.rename(moved)
    with open_journal_reader(moved / "journal") as j:
        assert Path(j.path) == local.resolve() and j.last_step() == 8
    _write(local, moved / "journal", range(9, 11))
    with Journal.open_reader(local) as j:
        assert j.last_step() == 10 and j.meta.get(segments.OWNER) == str((moved / "journal").resolve())
    shutil.copytree(moved, copy)  # and a copy of the moved run is a copy of it
    with pytest.raises(segments.CopiedJournalError, match=f"holds the journal of {(moved / 'journal').resolve()}"):
        segments.open_writer(local, copy / "journal", 1)


def test_kill_during_shipping_leaves_nothing_half_visible(tmp_path):
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    child = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_segments import _write
        from pathlib import Path
        _write(Path({str(local)!r}), Path({str(shipped)!r}), range(1, 20), max_lag=0)
    """)
    env = {**os.environ, "VERLJ_FAILPOINT": "ship.before_publish:6"}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr[-2000:]
    found = segments.scan(shipped)
    assert found.problem is None and found.leftovers == [".tmp-0000000006"]
    with Journal.open_reader(local) as j:
        committed = j.last_step()
    assert found.last_step is not None and committed - found.last_step <= 1  # max_lag 0: only the step in flight
    _write(local, shipped, range(committed + 1, 25), max_lag=0)  # the same node comes back
    found = segments.scan(shipped)
    assert found.problem is None and found.leftovers == [] and found.last_step == 24
    segments.rebuild(shipped, tmp_path / "L2")
    assert _dump(tmp_path / "L2") == _dump(local)


def test_network_filesystems_are_recognised():
    mounts = "\n".join([
        "/dev/sda1 / ext4 rw 0 0",
        "server:/export /mnt/shared nfs4 rw 0 0",
        "tmpfs /mnt/shared/local tmpfs rw 0 0",
        "lustre@tcp:/fs /lustre lustre rw 0 0",
    ])
    assert segments.network_filesystem(Path("/mnt/shared/runs/a"), mounts) == "nfs4"
    assert segments.network_filesystem(Path("/mnt/shared/local/j"), mounts) is None  # the longest mount wins
    assert segments.network_filesystem(Path("/lustre/x"), mounts) == "lustre"
    assert segments.network_filesystem(Path("/home/u"), mounts) is None


def test_make_durable_seals_what_a_deletion_relies_on_behind_another_segment(tmp_path):
    """A rebuild drops a damaged last segment. So make_durable (called before a rotation deletes a
    snapshot, or retention prunes) returns only once what it shipped is followed by another segment:
    damage to the last file then never takes away the index that made the deletion safe."""
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    j, _notes = segments.open_writer(local, shipped, 0)
    with j:
        for s in range(1, 5):
            j.writer.append_step(s, _events(s))
        j.meta.add_snapshot(4, {"path": "step_00004"})
        j.shipping.make_durable()  # a rotation would now delete the older snapshot
        newest = max(segments.segment_dir(shipped).glob("*.seg"))
        seal = segments.read_segment(newest)
        assert (seal.first, seal.meta, seal.snapshots, seal.steps) == (None, None, None, [])
        j.shipping.make_durable()  # nothing new: no second seal
        assert max(segments.segment_dir(shipped).glob("*.seg")) == newest
    raw = bytearray(newest.read_bytes())
    raw[-1] ^= 0x01
    newest.write_bytes(bytes(raw))
    found = segments.scan(shipped)
    assert found.problem_at_end and found.lost_steps is None and found.last_step == 4
    segments.rebuild(shipped, tmp_path / "L2")
    with Journal.open_reader(tmp_path / "L2") as jr:
        assert list(jr.meta.snapshots()) == [4] and jr.last_step() == 4


def _parent(path: Path, last: int) -> str:
    """A plain journal with steps 1..last; returns its chain hash after `last` (what a fork continues)."""
    with Journal.open_writer(path) as p:
        p.meta.update({"config": {"seed": 1}})
        for s in range(1, last + 1):
            p.writer.append_step(s, _events(s))
        return p.chain_hash(last)


def test_a_fork_s_segments_continue_its_parent_s_chain_and_rebuild(tmp_path):
    """A fork opens its shipped writer (which ships the journal id at once) and only then records the
    parent's step and chain (journal.writer.start_after): its segments still carry its steps under their own
    numbers, and the scan starts the chain at the parent's, not at GENESIS."""
    chain = _parent(tmp_path / "parent", 3)
    local, shipped = tmp_path / "L", tmp_path / "fork" / "journal"
    j, _notes = segments.open_writer(local, shipped, max_lag=1)
    with j:
        j.shipping.shipper.flush()  # the meta-only first shipment is out before the fork's base is recorded
        assert segments.scan(shipped).segments[0].meta is not None
        j.writer.start_after(3, chain, {"config": {"seed": 1}})
        for s in range(4, 9):
            j.writer.append_step(s, _events(s))
            assert j.shipping.shipper.shipped_step >= s - 1
    found = segments.scan(shipped)
    assert found.problem is None and found.last_step == 8, found.problem
    # under their own numbers, 4-8, contiguous (the shipper thread may put two steps in one cut)
    ranges = [(seg.first, seg.last) for seg in found.segments if seg.first is not None]
    assert ranges[0][0] == 4 and ranges[-1][1] == 8 and all(b[0] == a[1] + 1 for a, b in zip(ranges, ranges[1:])), ranges
    segments.rebuild(shipped, tmp_path / "L2")
    assert _dump(tmp_path / "L2") == _dump(local)
    with Journal.open_reader(tmp_path / "L2") as r:
        assert (r.base_step(), r.first_step(), r.last_step()) == (3, 4, 8)
        assert verify_journal(r).ok


def test_a_fork_at_its_parent_s_last_step_closes_at_once(tmp_path):
    """A fork with no step of its own yet: everything is shipped when it closes (it waited 600 s for
    steps 1..N it never holds), and its segments rebuild a journal that starts after the parent's step."""
    import threading

    chain = _parent(tmp_path / "parent", 5)
    local, shipped = tmp_path / "L", tmp_path / "fork" / "journal"
    j, _notes = segments.open_writer(local, shipped, max_lag=2)
    j.shipping.shipper.flush()
    j.writer.start_after(5, chain, {"config": {"seed": 1}})
    closing = threading.Thread(target=j.close, daemon=True)
    closing.start()
    closing.join(30)
    assert not closing.is_alive(), "closing the journal hung"
    assert j.shipping.shipper.shipped_step == 5
    found = segments.scan(shipped)
    assert found.problem is None and found.last_step is None
    with open_journal_reader(shipped) as r:  # another host: rebuilt from the segments
        assert (r.base_step(), r.last_step(), r.num_steps()) == (5, 5, 0)
        assert r.meta.get("chain_base") == chain


def test_a_shipper_that_gives_up_on_close_says_so_in_one_line_naming_the_steps(tmp_path, monkeypatch, capsys):
    """Shipping that stalls at close is given up after the close's timeout, in one line on stderr naming the
    steps not shipped and where they are; the next writer opened on the local journal ships them."""
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    _write(local, shipped, range(1, 3), max_lag=0)
    j, _notes = segments.open_writer(local, shipped, max_lag=4)
    stalled = j.shipping.shipper
    monkeypatch.setattr(stalled, "ship_once", lambda compact=False: time.sleep(0.2) or False)  # never gets anywhere
    for s in range(3, 6):
        j.writer.append_step(s, _events(s))
    stalled.close(timeout=1.0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[WARNING] journal shipping gave up on close: steps 3–5 not shipped to "), err
    assert f"the local journal {local}" in err[0] and "behind after 1 s" in err[0]
    j.close()  # its shipper closed already: nothing more is said
    assert capsys.readouterr().err == ""
    monkeypatch.undo()
    _write(local, shipped, range(6, 7), max_lag=0)
    assert segments.scan(shipped).last_step == 6
