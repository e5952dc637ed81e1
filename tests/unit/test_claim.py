"""The writer's claim on a run (journal.claim): one writer, taken over only from a dead or silent one, fenced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import verlj.engine  # noqa: F401  (declares verlj's event types to the journal)
from verlj.journal import Journal, make_event
from verlj.journal.claim import Claim, FencedError, WriterClaimedError, current, this_process


def fake_holder(directory, epoch: int, *, remote: bool, lease_s: float = 0.6, pid: int | None = None, **extra) -> dict:
    """A claim file as another process wrote it: on this node (a pid to look up) or on another one."""
    me = this_process()
    data = {**me, "epoch": epoch, "lease_s": lease_s, "renewals": 0, "released": False, **extra}
    if remote:
        data.update(host="node-b", boot_id="another-boot", pid=4242, process_start="1")
    elif pid is not None:
        data.update(pid=pid, process_start="0")  # a start time no live process of that pid has
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{epoch:010d}.json").write_text(json.dumps(data))
    return data


def test_one_claim_at_a_time_then_released(tmp_path):
    d = tmp_path / "writer"
    a = Claim.acquire(d, 60, what="run r")
    with pytest.raises(WriterClaimedError, match=r"run r is being written by pid \d+ on .*only one writer per run"):
        Claim.acquire(d, 60, what="run r")  # this very process is alive: refused at once, nothing written
    assert [p.name for p in sorted(d.iterdir())] == ["0000000001.json"]
    a.check()
    a.release()
    assert current(d)[1]["released"] is True
    b = Claim.acquire(d, 60)
    assert b.epoch == 2
    with pytest.raises(FencedError):
        a.check()  # released: it may not write again
    b.release()


def test_a_dead_process_on_this_node_is_taken_over_at_once(tmp_path):
    d = tmp_path / "writer"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    fake_holder(d, 3, remote=False, pid=int(dead.stdout), lease_s=3600)
    said = []
    t0 = time.monotonic()
    c = Claim.acquire(d, 60, what="run r", say=said.append)
    assert time.monotonic() - t0 < 1.0 and c.epoch == 4
    assert said == [f"the previous writer of run r (pid {int(dead.stdout)} on {this_process()['host']}) is gone; taking over"]
    c.release()


def test_a_silent_writer_on_another_node_is_taken_over_after_its_lease(tmp_path):
    d = tmp_path / "writer"
    fake_holder(d, 1, remote=True, lease_s=0.6)
    said = []
    t0 = time.monotonic()
    c = Claim.acquire(d, 60, what="run r", say=said.append)
    assert time.monotonic() - t0 >= 0.6  # watched for a whole lease of its own
    assert "pid 4242 on node-b" in said[0] and "not renewed for 0.6 s" in said[0]
    assert current(d)[1]["previous"]["host"] == "node-b"
    c.release()


def test_a_live_writer_on_another_node_is_refused_as_soon_as_it_renews(tmp_path):
    d = tmp_path / "writer"
    data = fake_holder(d, 1, remote=True, lease_s=30)
    stop = threading.Event()

    def renew():  # the other node's heartbeat
        while not stop.wait(0.1):
            data["renewals"] += 1
            tmp = d / ".tmp-renew"
            tmp.write_text(json.dumps(data))
            os.replace(tmp, d / "0000000001.json")

    t = threading.Thread(target=renew)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(WriterClaimedError, match="pid 4242 on node-b .*on another node"):
            Claim.acquire(d, 60, what="run r")
        assert time.monotonic() - t0 < 5
    finally:
        stop.set()
        t.join()
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == ["0000000001.json"]


def test_a_taken_over_writer_is_fenced_and_a_journal_refuses_its_writes(tmp_path):
    d = tmp_path / "writer"
    a = Claim.acquire(d, 60, what="run r")
    j = Journal.open_writer(tmp_path / "journal", claim=a)
    j.writer.append_step(1, [make_event("metrics", values={})])
    fake_holder(d, a.epoch + 1, remote=True)  # another node took the run over (say, after a network partition)
    with pytest.raises(FencedError, match="was taken over by pid 4242 on node-b .*stops without writing"):
        j.writer.append_step(2, [make_event("metrics", values={})])
    assert a.taken_over() and not a.held()
    j.close()  # closing does not touch the new writer's claim
    assert current(d)[0] == a.epoch + 1 and current(d)[1]["released"] is False
    with Journal.open_reader(tmp_path / "journal") as r:
        assert r.last_step() == 1


def test_a_writer_that_cannot_renew_for_a_lease_fences_itself(tmp_path):
    d = tmp_path / "writer"
    c = Claim.acquire(d, 0.6)
    c._stop.set()  # the heartbeat stops (a hung filesystem, a paused process)
    c._thread.join()
    time.sleep(0.7)
    with pytest.raises(FencedError, match="could not renew its claim"):
        c.check()


def test_two_claimers_racing_for_one_epoch(tmp_path):
    """link(2) decides: of processes that all find the run free, exactly one claims it."""
    d = tmp_path / "writer"
    code = ("import sys, time; from verlj.journal.claim import Claim, WriterClaimedError\n"
            "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"  # a child that starts late (a loaded machine) goes at once
            "try:\n    c = Claim.acquire(sys.argv[1], 60); print('won', c.epoch); time.sleep(4); c.release()\n"
            "except WriterClaimedError: print('refused')\n")
    start = time.time() + 3  # every child is up by then (the winner holds the claim 4 s: a late one is still refused)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(d), str(start)], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outs.count("won 1") == 1 and outs.count("refused") == 3, outs
