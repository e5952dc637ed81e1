"""Compaction of shipped segments (journal/segments.py): merged files, samples pruned from them too,
and a kill at every point of a compaction followed by the loss of the local journal."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import verlj.engine  # noqa: F401  (declares verlj's event types to the journal: these tests write them)
from verlj.journal import Journal, make_event, segments, verify_journal
from verlj.journal.frames import StepFrame

HERE = Path(__file__).parent


def _events(step: int) -> list[dict]:
    rng = np.random.default_rng(step)
    return [
        make_event("data", epoch=0, cursor=step * 2, indices=np.arange(2, dtype=np.int64) + 2 * step),
        make_event("buffer.add", ids=np.arange(8, dtype=np.int64) + 8 * step,
                   samples={"response_ids": rng.integers(0, 32000, (8, 64), dtype=np.int64)}),
        make_event("metrics", values={"loss": step / 3, "reward": -step / 7}),
        make_event("state", fingerprint=f"{step:064x}"),
    ]


def run(local: Path, shipped: Path, upto: int, interval: int = 5, window: int = 2, fanout: int = 4) -> tuple[int, int]:
    """What the trainer does to its journal: a step a commit (max_lag 0), a snapshot every `interval`
    steps keeping `window` of them, samples pruned through the oldest kept one (retention). Fixed
    wall times: two runs of the same steps store the same bytes."""
    j, _notes = segments.open_writer(local, shipped, 0, retention=True, fanout=fanout)  # fan-ins 4, then 2 above level 1
    with j:
        for s in range(j.last_step() + 1, upto + 1):
            j.writer.append_step(s, _events(s), wall_time=float(s))
            if s % interval == 0:
                j.meta.add_snapshot(s, {"path": f"step_{s:05d}"})
                kept = sorted(j.meta.snapshots())[-window:]
                for old in sorted(j.meta.snapshots())[:-window]:
                    j.meta.remove_snapshot(old)
                if kept[0] > j.retention.pruned_through():
                    j.shipping.make_durable()
                    j.retention.prune(kept[0])
        j.shipping.make_durable()
        while j.shipping.shipper.compact_once():
            pass
        assert j.shipping.shipper.compaction_problem is None
        return j.retention.pruned_through(), j.shipping.shipper.compactions


def frames(path: Path) -> dict[int, bytes]:
    with Journal.open_reader(path) as j:
        return dict(j.iter_raw())


def test_the_rule_bounds_the_file_count_over_100000_shipments():
    """plan_compaction alone, on 100,000 one-step shipments with retention (snapshot every 200, two
    kept): the files it leaves, at every moment, and that every step is in exactly one file."""
    from types import SimpleNamespace as E

    index, pruned, most = [], 0, 0
    for s in range(1, 100_001):
        index.append(E(span=(s, s), level=0, first=s, last=s, pruned=pruned))
        if s % 200 == 0 and s >= 400:
            pruned = s - 200
        while (job := segments.plan_compaction(index, pruned, True)) is not None:
            i, j, level, _rewrite = job
            part = index[i:j]
            index[i:j] = [E(span=(part[0].span[0], part[-1].span[1]), level=level, first=part[0].first,
                            last=part[-1].last, pruned=pruned)]
        most = max(most, len(index))
    assert [e.span[0] for e in index] == [1] + [e.span[1] + 1 for e in index[:-1]]  # contiguous, no overlap
    assert index[-1].span[1] == 100_000
    assert most <= 100 + 400 // 64 + 1, most  # the bound the rule states
    assert all(e.level == 0 or e.pruned >= min(e.last, pruned) or e.last > pruned for e in index)


def test_compacted_segments_hold_every_step_and_no_pruned_samples(tmp_path):
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    pruned, compactions = run(local, shipped, 60)
    found = segments.scan(shipped)
    assert found.problem is None and found.superseded == [] and found.last_step == 60
    n_files = len(list(segments.segment_dir(shipped).glob("*.seg")))
    assert n_files == len(found.segments) and n_files < 20 and compactions > 0
    assert any(seg.level >= 2 for seg in found.segments)
    assert pruned == 55  # the oldest of the two snapshots kept at step 60
    usable = 50  # compaction strips through the bound of a meta in a file before the last (the last's, 55, waits)
    for seg in found.segments:
        for k, raw in enumerate(seg.steps):
            frame = StepFrame.parse(raw)
            assert frame.payload_len == 0 if seg.first + k <= usable and seg.level else True
    in_segments = sum(StepFrame.parse(raw).payload_len for seg in found.segments for raw in seg.steps)
    with Journal.open_reader(local) as jr:
        live = sum(StepFrame.parse(raw).payload_len for _s, raw in jr.iter_raw())
    assert in_segments <= live + (pruned - usable + 4) * max(StepFrame.parse(r).payload_len for seg in found.segments for r in seg.steps)  # steps 51-55 and up to 3 one-shipment files
    segments.rebuild(shipped, tmp_path / "L2")  # the node is lost: the segments alone
    assert frames(tmp_path / "L2") == frames(local)
    with Journal.open_reader(tmp_path / "L2") as jr:
        report = verify_journal(jr)
    assert report.ok and report.pruned_through == pruned, report.problems


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    from pathlib import Path
    from test_compaction import run
    run(Path({local!r}), Path({shipped!r}), {upto})
""")


@pytest.mark.parametrize("point", ["compact.before_publish:3", "compact.after_publish:3", "compact.delete:3",
                                   "compact.rewrite:2"])
def test_a_kill_at_any_point_of_a_compaction_then_the_node_lost(tmp_path, point):
    """Killed inside a compaction (a merge or a rewrite that drops pruned samples), the local journal
    lost with the node: a new node rebuilds from the segments, finishes the run, and holds exactly what
    an uninterrupted run holds; verify is clean and nothing of the compaction is left over."""
    run(tmp_path / "ref" / "L", tmp_path / "ref" / "run", 60)
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    child = CHILD.format(here=str(HERE), local=str(local), shipped=str(shipped), upto=60)
    out = subprocess.run([sys.executable, "-c", child], env={**os.environ, "VERLJ_FAILPOINT": point},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr[-2000:]
    with Journal.open_reader(local) as j:
        committed = j.last_step()
    found = segments.scan(shipped)
    assert found.problem is None and committed - found.last_step <= 1  # max_lag 0: at most the step in flight
    if point.startswith(("compact.before_publish", "compact.rewrite")):  # the new file never became visible
        assert any(name.startswith(".tmp-") for name in found.leftovers)
    else:  # visible: it is read, and what it replaced (all of it, or what deletion left) is ignored
        assert found.superseded
    os.replace(local, tmp_path / "lost")  # the node is gone
    run(tmp_path / "L-new", shipped, 60)
    assert frames(tmp_path / "L-new") == frames(tmp_path / "ref" / "L")
    found = segments.scan(shipped)
    assert found.problem is None and found.superseded == [] and found.leftovers == []
    segments.rebuild(shipped, tmp_path / "again")
    assert frames(tmp_path / "again") == frames(tmp_path / "ref" / "L")
    with Journal.open_reader(tmp_path / "again") as jr:
        assert verify_journal(jr).ok


def test_a_damaged_last_segment_never_takes_the_meta_that_compaction_pruned_by(tmp_path):
    """The last file carries the newest meta (retention's bound after the last snapshot). A rebuild drops
    that file if it is damaged, so compaction strips samples only through the bound of a meta in a
    file that is not the last: the rebuilt journal never holds a step without samples that its meta
    does not call pruned (found by the node-loss campaign: a bit flipped in the last segment)."""
    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    run(local, shipped, 60)
    last = max(segments.segment_dir(shipped).glob("*.seg"))
    assert last.stem == f"{segments.scan(shipped).last_seq:010d}"  # the last file is always one shipment
    raw = bytearray(last.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    last.write_bytes(bytes(raw))
    found = segments.scan(shipped)
    assert found.problem_at_end
    segments.rebuild(shipped, tmp_path / "L2", tolerate="tail")
    with Journal.open_reader(tmp_path / "L2") as jr:
        report = verify_journal(jr)
    assert report.ok, report.problems


def test_scans_during_live_compaction_never_report_damage(tmp_path):
    """verify reads the segments while the trainer writes: files a compaction replaces under a scan
    are not damage."""
    import threading

    local, shipped = tmp_path / "L", tmp_path / "run" / "journal"
    writer = threading.Thread(target=run, args=(local, shipped, 120))
    writer.start()
    problems, scans = [], 0
    while writer.is_alive():
        found = segments.scan(shipped)
        scans += 1
        if found.problem is not None:
            problems.append(found.problem)
    writer.join()
    assert scans > 5 and problems == [], problems[:3]
