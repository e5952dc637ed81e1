"""How the suite's `verlj` runs get their processes: from one of this test process's fork servers (forkserver.py
beside this file: torch, transformers, DeepSpeed and verlj already imported) where it serves the run's environment,
else as a fresh interpreter. verlj_testing's `verlj()`, `train()` and `popen()` come through here, and so do the
workers of a local Ray cluster a test starts (`ray_worker_server`, `workers_from`). README.md beside this file says
what the servers preload, what they patch and which library internals they touch; VERLJ_TESTS_FRESH=1 turns them
off (every run a fresh interpreter, every cluster's workers fresh).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from harness import forkserver

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def env(**extra) -> dict:
    """The environment of a run the suite starts: this process's, with one thread, a fixed hash seed and the
    tokenizers' threads off, no torch.distributed variables or failpoint of this process's own, and `extra`."""
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "VERLJ_FAILPOINT"):
        e.pop(k, None)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def fresh() -> bool:
    """Whether VERLJ_TESTS_FRESH=1: no fork server, every process a fresh interpreter."""
    return os.environ.get("VERLJ_TESTS_FRESH") == "1"


def log_run(line: dict) -> None:
    """With VERLJ_TESTS_RUNLOG=FILE: `line` appended to FILE as a line of JSON (verlj_testing.verlj() writes one a run,
    a ForkServer one as it stops)."""
    if os.environ.get("VERLJ_TESTS_RUNLOG"):
        import json

        with open(os.environ["VERLJ_TESTS_RUNLOG"], "a") as f:
            f.write(json.dumps(line) + "\n")


def run(cmd: list[str], e: dict, timeout: float) -> tuple[subprocess.CompletedProcess, str]:
    """What subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=REPO) returns for `cmd` =
    `python -m verlj.cli ...` (or torchrun's `python -m torch.distributed.run ...`), and who started the process: a
    fork server's kind (KINDS) where one serves that environment (ForkServer.serves), else `fresh`."""
    server, served_env = served(e, cmd)
    if server is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=REPO), "fresh"
    return server.run(cmd, served_env, timeout), server.kind


# The fork servers a test process may start (forkserver.py's arguments after the socket): `vllm`'s has vLLM
# imported too, for the runs on rollout.engine=vllm (kind_of); the plain one's runs never import vLLM.
KINDS = {"plain": [], "vllm": ["vllm"]}


class ForkServer:
    """One of this test process's fork servers (forkserver.py), started on first use, stopped at exit."""

    def __init__(self, kind: str = "plain") -> None:
        import atexit
        import json
        import shlex
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="verlj-forkserver-"))
        self.socket = str(self.dir / "socket")
        self.env = env()
        self.env.pop("PYTHONPATH", None)
        self.log = open(self.dir / "server.log", "wb")
        self.kind = kind
        self.proc = subprocess.Popen([sys.executable, str(HERE / "forkserver.py"), self.socket, *KINDS[kind]],
                                     stdout=subprocess.PIPE, stderr=self.log, env=self.env, cwd=REPO)
        said = self.proc.stdout.readline().decode().split(" ", 1)
        if said[0] != "ready":
            raise RuntimeError(f"the fork server did not start: {(self.dir / 'server.log').read_text()[-3000:]}")
        ready = json.loads(said[1])
        self.preloaded, self.set_by_imports = set(ready["preloaded"]), ready["set_by_imports"]
        self.rank_python = str(self.dir / "python")  # a rank's (torchrun's PYTHON_EXEC) or Ray worker's interpreter from this server
        Path(self.rank_python).write_text(f"#!/bin/sh\nexport VERLJ_FORKCLIENT_PYTHON=\"$0\"\nexec {shlex.quote(sys.executable)} "
                                          f"{shlex.quote(str(HERE / 'forkclient.py'))} \"$@\"\n")
        os.chmod(self.rank_python, 0o755)
        atexit.register(self.stop)

    def serves(self, e: dict) -> bool:
        """Whether a process it forks is what a fresh interpreter with environment `e` would be."""
        return not self.differs(e, self.env) and not forkserver.shadows_preloaded(e, self.preloaded)

    def differs(self, e: dict, base: dict) -> list[str]:
        """The variables its preloaded libraries read at import whose values differ between `e` and `base`."""
        return forkserver.preloaded_env_differs(e, base, self.set_by_imports, forkserver.prefixes(self.preloaded))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def said(self) -> list[str]:
        """What it has forked ("forked MODULE PID") and declined ("declined MODULE: [VARIABLES]") so far: its log."""
        return (self.dir / "server.log").read_text().splitlines()

    def run(self, cmd: list[str], e: dict, timeout: float) -> subprocess.CompletedProcess:
        """What subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=REPO) returns, the
        process forked by the server. On a timeout the process is killed."""
        p = Forked(self, cmd, e, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)

    def stop(self) -> None:
        """Kill it and remove its directory; with VERLJ_TESTS_RUNLOG, log what it forked (a count of each module
        or script) and declined first. Once: again (at exit) does nothing."""
        import shutil
        from collections import Counter

        if self.log.closed:
            return
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        said = self.said()
        log_run({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "server": self.kind,
                 "forked": dict(Counter(os.path.basename(line.split()[1]) for line in said if line.startswith("forked "))),
                 "declined": [line for line in said if line.startswith("declined ")]})
        shutil.rmtree(self.dir, ignore_errors=True)


class Forked:
    """What subprocess.Popen(cmd, env=e, cwd=REPO, text=True, ...) gives for `cmd` = `python -m MODULE ARGS`, the
    process forked by the fork server: `pid` is the process's own (signals go to it; with start_new_session it
    leads a session of its own, for os.killpg), `stdout`/`stderr` are pipes when asked for (PIPE, DEVNULL, STDOUT
    or None: this process's), and poll/wait/communicate/send_signal/terminate/kill behave as Popen's, the exit
    status coming from the server's waiter."""

    def __init__(self, server: ForkServer, cmd: list[str], e: dict, stdout=None, stderr=None, start_new_session: bool = False) -> None:
        import json
        import socket

        assert cmd[1] == "-m", cmd
        self.args, self.returncode, self._got = cmd, None, b""
        ends, mine = [], []  # (the child's descriptors 0-2), (read ends kept here)

        def target(spec, fd: int) -> int:
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                mine.append(r)
                return w
            if spec == subprocess.DEVNULL:
                return os.open(os.devnull, os.O_WRONLY)
            if spec == subprocess.STDOUT:
                return os.dup(ends[1])
            return os.dup(fd)

        ends.append(os.open(os.devnull, os.O_RDONLY))
        ends.append(target(stdout, 1))
        self.stdout = open(mine[-1]) if stdout == subprocess.PIPE else None
        ends.append(target(stderr, 2))
        self.stderr = open(mine[-1]) if stderr == subprocess.PIPE else None
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.conn.connect(server.socket)
            req = {"module": cmd[2], "args": cmd[3:], "env": e, "cwd": str(REPO), "setsid": start_new_session}
            socket.send_fds(self.conn, [json.dumps(req).encode() + b"\n"], ends)
        finally:
            for fd in ends:
                os.close(fd)
        said = self._answer(None)
        if "declined" in said:
            raise RuntimeError(f"the fork server declined a request ForkServer.serves accepted: {said['declined']}")
        self.pid = said["pid"]

    def _answer(self, timeout: float | None) -> dict | None:
        """The server's next answer line, or None if none came within `timeout` seconds."""
        import json

        while b"\n" not in self._got:
            self.conn.settimeout(timeout)
            try:
                chunk = self.conn.recv(4096)
            except TimeoutError:
                return None
            if not chunk:
                raise RuntimeError("the fork server ended a request without an exit status")
            self._got += chunk
        line, self._got = self._got.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            said = self._answer(timeout)
            if said is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = said["code"]
            self.conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0.0001)
        except subprocess.TimeoutExpired:
            return None

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        import threading

        got: dict = {}
        readers = [threading.Thread(target=lambda name=name, f=f: got.__setitem__(name, f.read()), daemon=True)
                   for name, f in (("out", self.stdout), ("err", self.stderr)) if f is not None]
        for t in readers:
            t.start()
        for t in readers:
            t.join(timeout)
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.stdout = self.stderr = None
        self.wait(timeout)
        return got.get("out"), got.get("err")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


def served(e: dict, cmd: list[str]) -> tuple[ForkServer | None, dict]:
    """The fork server that serves `cmd` with environment `e` (None: a fresh interpreter), and the environment to
    ask it with: under torchrun, the agent starts each rank as `$PYTHON_EXEC -u -m verlj.cli ...`, and
    forkclient asks the server for it."""
    server = fork_server(e, kind_of(cmd))
    if server is not None and server.kind != "plain" and not server.serves(e):  # a run that joins a Ray cluster, say
        server = fork_server(e)
    if server is None or not server.serves(e):
        return None, e
    if cmd[2] == "torch.distributed.run":
        e = {**e, "PYTHON_EXEC": server.rank_python, "VERLJ_FORKSERVER_SOCKET": server.socket}
    return server, e


def ray_worker_server() -> ForkServer | None:
    """A fork server of its own for the workers of a local Ray cluster this process starts (None with
    VERLJ_TESTS_FRESH=1): started with this process's environment now, which the cluster's raylet takes as it
    starts and passes to every worker, and kept as it is for the cluster's life (this process's own servers are
    started again when its environment changes, fork_server). Stop it after the cluster."""
    return None if fresh() else ForkServer("plain")


@contextlib.contextmanager
def workers_from(server: ForkServer | None):
    """Within: a local Ray cluster started here (ray.init(address="local")) has its raylet start each worker
    (`PYTHON default_worker.py ARGS`) through forkclient.py, as a process `server` forks (torch, transformers
    and DeepSpeed imported), not a fresh interpreter that spends about 5 s of a core importing them for a fleet's
    actor. Ray builds the raylet's worker command from sys.executable, and the raylet passes its environment to
    each worker: within, sys.executable is the server's rank_python and VERLJ_FORKSERVER_SOCKET its socket
    (forkclient takes it out of the worker's environment). Ray's other processes started then (its agents, its
    monitors) go through forkclient too, which execs each as the fresh interpreter it would have been."""
    if server is None:
        yield
        return
    executable, socket = sys.executable, os.environ.get("VERLJ_FORKSERVER_SOCKET")
    sys.executable, os.environ["VERLJ_FORKSERVER_SOCKET"] = server.rank_python, server.socket
    try:
        yield
    finally:
        sys.executable = executable
        if socket is None:
            os.environ.pop("VERLJ_FORKSERVER_SOCKET")
        else:
            os.environ["VERLJ_FORKSERVER_SOCKET"] = socket


def wait_forked_ended(timeout: float = 30) -> None:
    """Until every process this test process's fork servers have forked has ended. A rank under torchrun whose
    forkclient was killed (with its agent's process tree) ends a moment later, when the server's waiter for it
    kills it: a test that kills a node whole waits for that before it goes on."""
    import time

    pids = [int(line.rsplit(" ", 1)[1]) for server in SERVERS.values() if server.alive() for line in server.said()
            if line.startswith("forked ")]
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, f"processes forked for this test still live after {timeout} s"
        time.sleep(0.02)


def children(pid: int) -> list[int]:
    """The pids of process `pid`'s children (Linux's /proc: a zombie still counts)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def popen(cmd: list[str], env: dict, stdout=None, stderr=None, start_new_session: bool = False):
    """subprocess.Popen(cmd, env=env, cwd=REPO, text=True, ...) for `cmd` = `python -m verlj.cli ...` (or torchrun's
    `python -m torch.distributed.run ...`): the process forked by the fork server where it serves that
    environment (a Forked, whose pid is the process's own), else a fresh interpreter."""
    server, e = served(env, cmd)
    if server is None:
        return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, env=env, cwd=REPO, start_new_session=start_new_session)
    return Forked(server, cmd, e, stdout=stdout, stderr=stderr, start_new_session=start_new_session)


SERVERS: dict[str, ForkServer] = {}


def fork_server(e: dict, kind: str = "plain") -> ForkServer | None:
    """This process's fork server of `kind` (KINDS) for a run with environment `e`: started again with this process's
    environment when that has changed in a variable the server read at import since it started (importing vLLM or
    starting Ray in this process sets some), so that it serves the runs after as a fresh interpreter would."""
    if fresh():
        return None
    base = env()
    server = SERVERS.get(kind)
    if server is not None and server.alive() and server.differs(base, server.env) and not server.differs(e, base):
        server.stop()
    if server is None or not server.alive():
        server = SERVERS[kind] = ForkServer(kind)
    return server


def kind_of(cmd: list[str]) -> str:
    """Which fork server a command line goes to: `vllm` for a run on rollout.engine=vllm, where it says so."""
    return "vllm" if "rollout.engine=vllm" in cmd else "plain"


def free_port() -> int:
    """A free TCP port on this machine (torchrun's --master_port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

