"""One writer per run, whatever the filesystem: a leased, fenced claim kept in the run directory.

    RUN/writer/0000000007.json     the claim of writer epoch 7: node (host, boot id, pid namespace),
                                   pid and process start, command, lease, and a renewal count that
                                   its holder's heartbeat thread raises every lease / 6 seconds
    RUN/writer/.tmp-0000000007-PID a claim or renewal being written (never read)

The current claim is the highest epoch present. A new writer takes over only when that claim is
released, when its process is gone (same node: its pid, process start time and pid namespace say
so at once), or when its lease expired (another node: its renewal count did not move for a whole
lease, timed on the claimer's own clock, so clock skew between nodes plays no part). It then
creates epoch + 1 with link(2), which fails when the name exists, so of two writers racing for the
same epoch exactly one wins; NFS servers make link atomic too.

Fencing: before every write another writer could collide with (a journal commit, a shipped segment,
a snapshot publish, a rotation's delete, a quarantine), the holder calls :meth:`Claim.check`: the
highest epoch must still be its own and its last renewal younger than a lease. A writer that was
taken over (a node that came back after its lease expired, a paused process) stops with one
sentence and writes nothing more. Knows nothing of runs beyond the directory it is given.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from .durable import fsync_dir, replace_durably, write_synced
from .errors import JournalError, JournalLockedError

_WIDTH = 10
KEEP_OLD = 4  # earlier claims kept for people to read (who wrote the run before)


class WriterClaimedError(JournalLockedError):
    """Another live process holds the run's claim."""


class FencedError(JournalError):
    """This process's claim was taken over (or could not be renewed): it must not write."""


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid it
    names one process, even after the pid is reused. "" when there is no such process."""
    stat = _read_text(f"/proc/{pid}/stat")
    if not stat:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # fields after the command name, which may hold spaces


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def this_process() -> dict:
    """Who is claiming: enough to tell, from any node, whether this process still lives."""
    return {
        "host": socket.gethostname(),
        "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
        "pid_namespace": _pid_namespace(),
        "pid": os.getpid(),
        "process_start": process_start(os.getpid()),
        "command": " ".join(sys.argv)[:200],
    }


def _same_node(holder: dict, me: dict) -> bool:
    """Whether a pid in `holder` can be looked up here: the same boot of the same machine, the same pid namespace."""
    return bool(me["boot_id"]) and holder.get("boot_id") == me["boot_id"] and holder.get("pid_namespace") == me["pid_namespace"]


def _alive_here(holder: dict) -> bool:
    return process_start(int(holder.get("pid", -1))) == holder.get("process_start")


def live_holder(directory: Path) -> tuple[dict, bool] | None:
    """(the current claim, whether it is on this node) when it is not released and its process runs, or
    may run (on another node, nothing short of acquire()'s watch tells); None when the slot is free."""
    found = current(Path(directory))
    if found is None or found[1] is None or found[1].get("released"):
        return None
    holder, here = found[1], _same_node(found[1], this_process())
    if here and not _alive_here(holder):
        return None
    return holder, here


def describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')} ({holder.get('command') or 'verlj'})"


def being_written(what: str, holder: dict, directory: Path) -> str:
    """'WHAT is being written by HOLDER'; for a claim made in another directory (a run directory copied
    or moved while its writer ran: cp -a carries the claims along), which directory that writer writes.
    Only on the writer's node: another node may mount the same directory under another path."""
    made = holder.get("directory")
    if made and made != os.path.realpath(directory) and _same_node(holder, this_process()):
        return f"{what} holds a claim copied from {Path(made).parent}, which {describe(holder)} is writing"
    return f"{what} is being written by {describe(holder)}"


def _name(epoch: int) -> str:
    return f"{epoch:0{_WIDTH}d}.json"


def _epochs(directory: Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def _read_claim(directory: Path, epoch: int) -> dict | None:
    """A claim file's content; None while it is unreadable (being replaced, or torn by a crash)."""
    try:
        data = json.loads((directory / _name(epoch)).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def current(directory: Path) -> tuple[int, dict | None] | None:
    """(epoch, claim) of the run's current claim, or None when the run was never claimed."""
    epochs = _epochs(Path(directory))
    if not epochs:
        return None
    for _ in range(50):  # a renewal replaces the file by rename: a read never sees half of it, but retry a torn one
        data = _read_claim(Path(directory), epochs[-1])
        if data is not None:
            return epochs[-1], data
        time.sleep(0.01)
    return epochs[-1], None


def _write_new(directory: Path, name: str, data: dict) -> bool:
    """Create directory/name holding `data`, only if no such name exists (False if it does)."""
    tmp = _tmp(directory, name)
    write_synced(tmp, json.dumps(data).encode())
    try:
        os.link(tmp, directory / name)
    except FileExistsError:
        return False
    except OSError as e:  # a filesystem without hard links: O_EXCL create (atomic on NFSv3 and later too)
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        try:
            fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(directory)
    return True


def _replace(directory: Path, name: str, data: dict) -> None:
    replace_durably(directory / name, json.dumps(data).encode(), _tmp(directory, name))


def _tmp(directory: Path, name: str) -> Path:
    """Where a claim or renewal of `name` (EPOCH.json) is written first: .tmp-EPOCH-PID (a leftover is known by it)."""
    return directory / f".tmp-{name[:-5]}-{os.getpid()}"


class Claim:
    """This process's claim on a directory's one writer slot (see the module docstring)."""

    def __init__(self, directory: Path, epoch: int, data: dict, lease_s: float):
        self.directory, self.epoch, self.data, self.lease_s = Path(directory), epoch, data, float(lease_s)
        self._renewed = time.monotonic()
        self._lost: str | None = None  # why this process may no longer write
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="verlj-writer-claim", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ taking it

    @classmethod
    def acquire(cls, directory: Path, lease_s: float, *, what: str = "this run", say=None) -> Claim:
        """Claim `directory`'s writer slot, or raise WriterClaimedError naming the live holder.

        `what` names the thing claimed in messages; `say(line)` receives one-line notes (a takeover).
        A holder on another node is watched for up to its lease: refused as soon as it renews, taken
        over when it has not renewed for a whole lease."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        me = this_process()
        while True:
            found = current(directory)
            epoch, previous = (0, None) if found is None else found
            note = None
            if found is not None and previous is None:
                note = f"the claim of writer epoch {epoch} in {directory} was unreadable (torn by a crash); taking over"
            elif previous is not None and not previous.get("released"):
                note = _judge(directory, epoch, previous, me, what)
            data = {**me, "directory": os.path.realpath(directory), "epoch": epoch + 1, "lease_s": float(lease_s), "renewals": 0, "released": False,
                    "claimed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            if previous is not None:
                data["previous"] = {k: previous.get(k) for k in ("host", "pid", "command", "released")}
            if _write_new(directory, _name(epoch + 1), data):
                break  # else another writer created that epoch first: judge it in turn
        if note and say is not None:
            say(note)
        claim = cls(directory, epoch + 1, data, lease_s)
        claim._forget_old()
        return claim

    # ------------------------------------------------------------------ holding it

    def check(self) -> None:
        """Raise FencedError unless this process still holds the claim (a directory listing and a clock read)."""
        if self._lost is None:
            top = _epochs(self.directory)
            if not top or top[-1] != self.epoch:
                self._lost = _taken_over(self.directory, top[-1] if top else None)
            elif time.monotonic() - self._renewed > self.lease_s:
                self._lost = (f"this process could not renew its claim on {self.directory.parent} for "
                              f"{time.monotonic() - self._renewed:.0f} s (lease {self.lease_s:g} s): another node may have taken the run over")
        if self._lost is not None:
            raise FencedError(f"{self._lost}; this process stops without writing more")

    def taken_over(self) -> bool:
        """Whether another writer claimed the run after this one (released or not, this one is then stale)."""
        top = _epochs(self.directory)
        return not top or top[-1] != self.epoch

    def held(self) -> bool:
        try:
            self.check()
        except FencedError:
            return False
        return True

    def _heartbeat(self) -> None:
        interval = max(self.lease_s / 6, 0.02)
        while not self._stop.wait(interval):
            try:
                top = _epochs(self.directory)
                if not top or top[-1] != self.epoch:
                    self._lost = self._lost or _taken_over(self.directory, top[-1] if top else None)
                    return
                self.data["renewals"] += 1
                _replace(self.directory, _name(self.epoch), self.data)
                self._renewed = time.monotonic()
            except OSError:
                pass  # the next beat tries again; check() fails once a whole lease passes without one

    def release(self) -> None:
        """Stop renewing and mark the claim released (the next writer takes over at once). A claim
        that was taken over is left alone: it is not this process's any more."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self._lost is None and self.held():
            self.data["released"] = True
            try:
                _replace(self.directory, _name(self.epoch), self.data)
            except OSError:
                pass  # unreleased, it is taken over once its process is gone or its lease expires
        self._lost = self._lost or "the claim was released"

    def _forget_old(self) -> None:
        for epoch in _epochs(self.directory):
            if epoch < self.epoch - KEEP_OLD:
                (self.directory / _name(epoch)).unlink(missing_ok=True)
        for name in os.listdir(self.directory):  # left by killed claimers of earlier epochs (never read)
            prefix = name[len(".tmp-"):].split("-")[0]
            if name.startswith(".tmp-") and prefix.isdigit() and int(prefix) < self.epoch:
                (self.directory / name).unlink(missing_ok=True)


def _judge(directory: Path, epoch: int, holder: dict, me: dict, what: str) -> str | None:
    """Return a note when the unreleased claim `holder` may be taken over; raise while it lives."""
    refuse = f"{being_written(what, holder, directory)}; stop that process first (only one writer per run)"
    if _same_node(holder, me):
        if _alive_here(holder):
            raise WriterClaimedError(refuse)
        return f"the previous writer of {what} (pid {holder.get('pid')} on {holder.get('host')}) is gone; taking over"
    lease = float(holder.get("lease_s", 60.0))
    start, renewals = time.monotonic(), holder.get("renewals")
    while time.monotonic() - start < lease:
        time.sleep(min(1.0, lease / 20))
        now = current(directory)
        if now is None or now[1] is None:
            continue
        if now[0] != epoch or now[1].get("released"):
            return None  # released, or another writer claimed it meanwhile: acquire() looks again at once
        if now[1].get("renewals") != renewals:
            raise WriterClaimedError(refuse.replace("; stop", " (on another node; its claim was renewed just now); stop"))
    return (f"taking over {what} from {describe(holder)}: its claim was not renewed for {lease:g} s "
            "(journal.writer_lease_s), so its node is taken to be gone")


def _taken_over(directory: Path, top: int | None) -> str:
    if top is None:
        return f"the writer claims in {directory} were removed"
    found = _read_claim(directory, top) or {}
    return f"{directory.parent} was taken over by {describe(found)} (writer epoch {top})"
