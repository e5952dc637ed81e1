"""Journal behaviour across real processes: SIGKILL mid-append, a second writer, a live reader."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from journal_helpers import step_events
from verlj.journal import Journal, JournalLockedError, verify_journal

CHILD = str(Path(__file__).with_name("journal_child.py"))


def spawn(*args):
    return subprocess.Popen([sys.executable, CHILD, *map(str, args)], stdout=subprocess.PIPE, text=True)


def test_sigkill_mid_append_loses_nothing_committed(tmp_path):
    path = tmp_path / "j"
    rng = random.Random(1234)
    for _trial in range(6):
        child = spawn(path, "write")
        # wait for a few commits, then kill at a random moment
        first = child.stdout.readline()
        assert first.strip().isdigit()
        time.sleep(rng.uniform(0.0, 0.4))
        child.send_signal(signal.SIGKILL)
        printed = [int(line) for line in child.stdout.read().split()] + [int(first)]
        child.wait()
        with Journal.open_reader(path) as j:
            last = j.last_step()
            report = verify_journal(j)
            assert report.ok, report.problems
            # everything the child saw committed is there; nothing partial
            assert last >= max(printed)
            assert last <= max(printed) + 1  # at most the commit that raced the print
            for rec in j.iter_steps(last - 1, last):
                assert rec.events[2]["samples"]["response_ids"].shape == (8, 64)
    # appending resumes at the next step
    with Journal.open_writer(path) as j:
        nxt = j.last_step() + 1
        j.writer.append_step(nxt, step_events(nxt))
        assert j.last_step() == nxt and verify_journal(j).ok


def test_second_writer_is_refused_naming_the_holder(tmp_path):
    path = tmp_path / "j"
    holder = spawn(path, "hold")
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(JournalLockedError, match=f"pid {holder.pid}"):
            Journal.open_writer(path)
        # readers are welcome while the writer holds the journal
        with Journal.open_reader(path) as j:
            assert j.last_step() == 0
    finally:
        holder.kill()
        holder.wait()
    # once the holder is gone (even by SIGKILL) the lock is free
    with Journal.open_writer(path) as j:
        j.writer.append_step(1, step_events(1))


def test_reader_in_another_process_follows_a_live_writer(tmp_path):
    path = tmp_path / "j"
    with Journal.open_writer(path, map_size=1 << 20) as j:
        j.writer.append_step(1, step_events(1))
    follower = spawn(path, "follow", 150)
    writer = spawn(path, "write", 150)  # grows the map several times while being followed
    assert writer.wait(timeout=120) == 0
    out, _ = follower.communicate(timeout=120)
    assert follower.returncode == 0
    assert out.strip() == "followed 150"
