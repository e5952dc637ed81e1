"""What a process that started a local Ray cluster leaves behind when it is SIGKILLed: nothing.

Ray's own processes follow the process that started them out only in part (its agents, reparented to
init, stay). So whoever starts a local cluster (the fleet, ``verlj train --launcher ray``) starts a
reaper too (:class:`Reaper`): a small process in a session of its own, so that no signal meant
for the trainer's process group reaches it, that waits for the trainer to end, then SIGKILLs every
process holding a file of the cluster's session directory open (Ray's processes write their logs
there), and ends. A clean stop (``ray.shutdown``) ends the reaper first (:meth:`Reaper.stop`).

Python's multiprocessing names its semaphores in /dev/shm (``sem.mp-*``) and leaves unlinking them to
its resource tracker, a process of the trainer's process group: a group kill (``kill -9 -PGID``, a job
scheduler's) takes it too, and the names stay for good. :func:`resource_tracker_apart` starts this
process's tracker in a session of its own before the first process is spawned (the async generator,
vLLM's): the group killed, the tracker reads the end of its pipe and unlinks what they left.

    python -m verlj.engine.rl.reaper PID SESSION_DIR     # what the reaper runs (Linux: /proc, pidfd)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path


class Reaper:
    """The reaper of one local cluster (see the module's doc)."""

    def __init__(self, session_dir: str):
        self.proc: subprocess.Popen | None = None
        if not Path("/proc/self/fd").is_dir():  # no /proc: nothing to read the session's processes from
            return
        self.proc = subprocess.Popen([sys.executable, "-m", "verlj.engine.rl.reaper", str(os.getpid()), session_dir],
                                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, close_fds=True)

    def stop(self) -> None:
        """The cluster was shut down cleanly: the reaper is not needed."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


_APART: list[subprocess.Popen] = []  # the tracker's Popen, kept: the tracker itself reaps it (multiprocessing's waitpid)


def resource_tracker_apart() -> None:
    """Start this process's multiprocessing resource tracker in a session of its own (see the module's
    doc), unless it runs already. Call before anything spawns a process."""
    from multiprocessing import resource_tracker, util

    tracker = resource_tracker._resource_tracker
    if tracker._fd is not None:  # type: ignore[attr-defined]  # started already (by this call or by a spawn before it)
        return
    plain = util.spawnv_passfds

    def apart(path, args, passfds):
        proc = subprocess.Popen(args, executable=path, pass_fds=tuple(passfds), close_fds=True, start_new_session=True)
        _APART.append(proc)
        return proc.pid

    util.spawnv_passfds = apart
    try:
        tracker.ensure_running()
    finally:
        util.spawnv_passfds = plain


def session_dir() -> str:
    """The session directory of the local cluster this process started (ray.init done)."""
    from ray._private import worker  # the one place Ray says where its node's session is

    return str(worker._global_node.get_session_dir_path())


def holders(session_dir: str) -> list[int]:
    """The processes (other than this one) holding a file under `session_dir` open."""
    prefix, me, out = session_dir.rstrip("/") + "/", os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if any(os.readlink(fd).startswith(prefix) for fd in (entry / "fd").iterdir()):
                out.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return out


def _wait_for(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # already gone (or no pidfd): poll instead
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)
    select.select([fd], [], [])
    os.close(fd)


def main(pid: int, session_dir: str) -> None:
    _wait_for(pid)
    for _ in range(3):  # a process Ray starts while the others go: looked for again
        for p in holders(session_dir):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.5)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
