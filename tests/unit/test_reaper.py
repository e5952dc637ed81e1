"""rl.reaper: a process that started a local Ray cluster and is SIGKILLed leaves no process of the cluster
behind (the fleet's and `--launcher ray`'s own clusters; the Ray run itself: tests/integration/test_fleet.py)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from verlj.engine.rl.reaper import Reaper, holders

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="the reaper reads /proc")


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie (our child, killed, not waited for yet) is gone too
            if f.read().split(") ", 1)[1].startswith("Z"):
                return True
        time.sleep(0.1)
    return False


def test_a_sigkilled_starter_leaves_no_process_holding_its_session(tmp_path):
    """A stand-in trainer starts the reaper of a 'session' and a process in a session of its own that holds a
    file of it open (as Ray's agents hold their logs); SIGKILL of the trainer alone: the holder is killed too."""
    session = tmp_path / "session_x"
    (session / "logs").mkdir(parents=True)
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        from verlj.engine.rl.reaper import Reaper
        Reaper({str(session)!r})
        holder = subprocess.Popen([sys.executable, "-c", "import time; f = open({str(session / 'logs' / 'agent.out')!r}, 'w'); time.sleep(600)"],
                                  start_new_session=True)
        print(holder.pid, flush=True)
        time.sleep(600)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    holder = int(trainer.stdout.readline())
    deadline = time.monotonic() + 20
    while holder not in holders(str(session)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert holders(str(session)) == [holder]
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert _gone(holder, 10.0), "the session's process outlived its starter"
    assert holders(str(session)) == []


def test_a_clean_stop_ends_the_reaper_and_nothing_else(tmp_path):
    with open(tmp_path / "held", "w"):  # this process holds a file of the session: a stop must not touch it
        reaper = Reaper(str(tmp_path))
        pid = reaper.proc.pid
        reaper.stop()
        assert reaper.proc is None and _gone(pid, 5.0)
        assert holders(str(tmp_path)) == []  # this process is never counted among them


@pytest.mark.parametrize("apart", [True, False])
def test_a_group_kill_leaves_no_semaphore_when_the_tracker_runs_apart(apart):
    """A process (in a group of its own) makes a multiprocessing lock for spawned children (its name in
    /dev/shm, sem.mp-*, left to the resource tracker to unlink); the whole group SIGKILLed: with the
    tracker started apart (rl.reaper.resource_tracker_apart, as the async generator does) the name is
    gone, without it (Python's default) it stays (and this test unlinks it)."""
    import _multiprocessing

    code = textwrap.dedent(f"""
        import multiprocessing, time
        from verlj.engine.rl.reaper import resource_tracker_apart
        if {apart}:
            resource_tracker_apart()
        lock = multiprocessing.get_context("spawn").Lock()
        print(lock._semlock.name, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    name = proc.stdout.readline().strip()
    path = f"/dev/shm/sem.{name.lstrip('/')}"
    assert name and os.path.exists(path)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline and apart:
        time.sleep(0.1)
    try:
        assert os.path.exists(path) != apart
    finally:
        if os.path.exists(path):
            _multiprocessing.sem_unlink(name)
