"""loop.reader.StepReader, the one way a run's steps are read back, on a real LMDB journal and without
a trainer: the walk a replay applies (each step present and in order, a pruned one refused), one
step's read (the what-if's check where it is read), and the post-mortem scan (pruned steps included)."""

from __future__ import annotations

import numpy as np
import pytest

from verlj.engine.errors import ReplayError, RunError
from verlj.engine.loop.reader import StepReader
from verlj.journal import Journal, make_event, packb


class OneRank:
    """A runtime of one process (dist.Runtime's from_rank0 with world size 1: fn() itself)."""

    is_main, world_size = True, 1

    def __init__(self):
        self.asked: list[str] = []

    def from_rank0(self, fn, what=""):
        self.asked.append(what)
        return fn()


def fp(step: int) -> str:
    return f"{step:064x}"


@pytest.fixture
def journal(tmp_path):
    """A journal of steps 1..4, each with its samples (the payload retention prunes), a metric and its fingerprint."""
    j = Journal.open_writer(tmp_path / "journal")
    for s in range(1, 5):
        ids = np.arange(2, dtype=np.int64) + 2 * s
        j.writer.append_step(s, [make_event("buffer.add", ids=ids, samples={"id": ids, "score": np.ones(2)}),
                          make_event("metrics", values={"loss": s / 10}), make_event("state", fingerprint=fp(s), parts={})])
    yield j
    j.close()


def test_a_walk_yields_each_step_in_order_as_every_rank_receives_it(journal):
    rt = OneRank()
    got = list(StepReader(journal, rt).walk(2, 4))
    assert [r.step for r in got] == [2, 3, 4]
    assert [r.state_fingerprint for r in got] == [fp(2), fp(3), fp(4)]
    assert [r.metrics for r in got] == [{"loss": 0.2}, {"loss": 0.3}, {"loss": 0.4}]
    assert rt.asked == [f"reading step {s} from the journal" for s in (2, 3, 4)]  # one record at a time: streamed
    alone = list(StepReader(journal).walk(2, 4))  # read by this process alone: the same records
    assert [packb(r.to_dict()) for r in alone] == [packb(r.to_dict()) for r in got]


def test_a_walk_past_the_journal_refuses_the_missing_step(journal):
    walk = StepReader(journal, OneRank()).walk(3, 5)
    assert [next(walk).step, next(walk).step] == [3, 4]
    with pytest.raises(ReplayError, match=r"^journal step 5 is missing \(found the journal's end\); run `verlj verify`$"):
        next(walk)


def test_a_walk_refuses_a_pruned_step_and_the_scan_shows_it(journal):
    journal.retention.prune(2)
    with pytest.raises(ReplayError, match=r"^step 1's samples were pruned from the journal \(journal.retain_samples\); it cannot be replayed$"):
        next(StepReader(journal, OneRank()).walk(1, 4))
    assert [r.step for r in StepReader(journal).walk(3, 4)] == [3, 4]  # the kept steps still walk
    scanned = list(StepReader(journal).records(payload=False))
    assert [(r.step, r.pruned) for r in scanned] == [(1, True), (2, True), (3, False), (4, False)]
    assert [r.state_fingerprint for r in scanned] == [fp(s) for s in range(1, 5)]


def test_read_runs_the_check_where_the_step_is_read(journal):
    rt = OneRank()
    assert StepReader(journal, rt).read(3, "reading step 3 of RUN").state_fingerprint == fp(3)
    assert rt.asked == ["reading step 3 of RUN"]

    def refuse(record):
        raise RunError(f"step {record.step} refused")

    with pytest.raises(RunError, match="^step 2 refused$"):
        StepReader(journal, rt).read(2, check=refuse)
    with pytest.raises(AssertionError):
        StepReader(journal, rt).records()  # a replay's ranks walk; only a process alone scans
