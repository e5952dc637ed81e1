"""Shared helpers for engine tests: tiny configs, running `verlj`, reading journals for comparison."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import forkserver

from verlj.journal import open_journal_reader

REPO = Path(__file__).resolve().parents[1]

# A run that takes well under a second a step on 2 CPU cores.
TINY = [
    "trainer.total_steps=4",
    "trainer.save_interval=2",
    "data.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_response_length=4",
    "model.actor.micro_batch_size=4",
    "model.critic.micro_batch_size=4",
    "logging.progress=lines",
]
SMALL = [*TINY, "trainer.total_steps=4", "trainer.save_interval=2", "trainer.save_total_limit=2"]  # snapshots 2 and 4


# The bpe_model fixture (conftest.py) as examples/make_bpe_model.py made it (its warm-up is about 50 s of a core),
# shipped with the tests with the SHA-256 of the recipe that made it (recipe.sha256): the fixture copies it while the
# recipe is unchanged and makes the model again where it changed, and tests/unit/test_splice.py then fails until the
# model is shipped again (SHIPPED_BPE_REMAKE, from the repository's root).
SHIPPED_BPE = REPO / "tests" / "fixtures" / "bpe_model"
SHIPPED_BPE_REMAKE = ("python examples/make_bpe_model.py tests/fixtures/bpe_model && "
                      "sha256sum examples/make_bpe_model.py | cut -c1-64 > tests/fixtures/bpe_model/recipe.sha256")


def bpe_recipe() -> str:
    """The SHA-256 of examples/make_bpe_model.py."""
    import hashlib

    return hashlib.sha256((REPO / "examples" / "make_bpe_model.py").read_bytes()).hexdigest()


def session_dir(tmp_path_factory) -> Path:
    """This pytest session's own directory, the same for all its xdist workers (each one's basetemp lies under it):
    where what the session makes once for every worker goes (conftest.py's reference_run)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def env(**extra) -> dict:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "VERLJ_FAILPOINT"):
        e.pop(k, None)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def verlj(*args, check: bool = False, timeout: float = 300, ranks: int = 1, **env_extra) -> subprocess.CompletedProcess:
    """Run the real CLI in a process of its own (under torchrun when ranks > 1). The process (torchrun's agent,
    and its ranks through tests/forkclient.py) is forked by the fork server (tests/forkserver.py: torch and
    transformers already imported), unless VERLJ_TESTS_FRESH=1 or the environment asked for is one only a fresh
    interpreter gives (ForkServer.serves). With VERLJ_TESTS_RUNLOG=FILE each run adds a JSON line to FILE: the test,
    the command's arguments, its ranks, who started it (a fork server's kind, or fresh) and its seconds, what a
    look at where the suite's time goes starts from."""
    import time

    started = time.monotonic()
    e = env(**env_extra)
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(_port()),
               "-m", "verlj.cli", *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "verlj.cli", *map(str, args)]
    server, served_env = _served(e, cmd)
    if server is not None:
        out = server.run(cmd, served_env, timeout)
    else:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=REPO)
    if os.environ.get("VERLJ_TESTS_RUNLOG"):
        import json

        line = {"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "args": [str(a) for a in args], "ranks": ranks,
                "by": server.kind if server is not None else "fresh", "seconds": round(time.monotonic() - started, 2), "code": out.returncode}
        with open(os.environ["VERLJ_TESTS_RUNLOG"], "a") as f:
            f.write(json.dumps(line) + "\n")
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}")
    return out


# The end of a test's own script that started a process group (`python -c SCRIPT + LEAVE`), as the CLI's successful
# commands end (cli/main.py: _leave_process_group): the group destroyed, the output flushed, and no interpreter
# finalization, in which gloo's worker threads can abort a process whose work is done ("terminate called without an
# active exception", SIGABRT; pytorch/pytorch#190489; seen once in a clean-clone CI after "same bits" was printed).
LEAVE = """
import os as _os, sys as _sys
from verlj.engine.dist import teardown as _teardown
_teardown()
_sys.stdout.flush()
_sys.stderr.flush()
_os._exit(0)
"""


IN_OWN_PROCESS = ("train", "replay", "rerun", "whatif")  # they move file descriptor 1 (cli.common.data_stdout)


def cli(*args, check: bool = False) -> subprocess.CompletedProcess:
    """`verlj ARGS` run in this process (typer's test runner): the same command code, stdout, stderr and
    exit code as verlj(), without the seconds a fresh interpreter takes to import torch and DeepSpeed.
    For what a command says and exits with; verlj() where the point is a process of its own (a crash,
    a signal, torchrun ranks). Commands that move file descriptor 1 (train, replay, rerun, whatif,
    diff --stages) are refused here. An exception that a real run would end in with a traceback is
    raised, not turned into an exit code."""
    from typer.testing import CliRunner

    from verlj.cli.main import app

    args = [str(a) for a in args]
    assert args and args[0] not in IN_OWN_PROCESS and "--stages" not in args, f"run `verlj {args[0]}` with verlj()"
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    out = subprocess.CompletedProcess(["verlj", *args], r.exit_code, r.stdout, r.stderr)
    if check and out.returncode != 0:
        raise AssertionError(f"verlj {' '.join(args)} exited {out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}")
    return out


def replay_here(run_dir: Path, to_step: int, export: Path | None = None) -> tuple[dict, str]:
    """`verlj replay RUN --to-step N [--export DIR]` by the calls it makes, in this process (one rank):
    what its --json prints (a dict), and its line on a topology crossed ('' when bit for bit)."""
    import gc
    import json

    from verlj.engine.post_mortem import materialize

    materialize.check_outputs(export, None, None)
    replayed = materialize.materialize(Path(run_dir), to_step)
    if export is not None:
        materialize.export_hf(replayed, export)
    said = json.loads(materialize.replay_report(replayed)), materialize.exactness_line(replayed) or ""
    del replayed
    gc.collect()  # the replayed engines, before the next test builds its own
    return said


# The fork servers a test process may start (tests/forkserver.py's arguments after the socket): `vllm`'s has vLLM
# imported too, for the runs on rollout.engine=vllm (_kind); the plain one's runs never import vLLM.
KINDS = {"plain": [], "vllm": ["vllm"]}


class ForkServer:
    """One of this test process's fork servers (tests/forkserver.py), started on first use, stopped at exit."""

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
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py")), self.socket, *KINDS[kind]],
                                     stdout=subprocess.PIPE, stderr=self.log, env=self.env, cwd=REPO)
        said = self.proc.stdout.readline().decode().split(" ", 1)
        if said[0] != "ready":
            raise RuntimeError(f"the fork server did not start: {(self.dir / 'server.log').read_text()[-3000:]}")
        ready = json.loads(said[1])
        self.preloaded, self.set_by_imports = set(ready["preloaded"]), ready["set_by_imports"]
        self.rank_python = str(self.dir / "python")  # a rank's (torchrun's PYTHON_EXEC) or Ray worker's interpreter from this server
        Path(self.rank_python).write_text(f"#!/bin/sh\nexport VERLJ_FORKCLIENT_PYTHON=\"$0\"\nexec {shlex.quote(sys.executable)} "
                                          f"{shlex.quote(str(Path(__file__).with_name('forkclient.py')))} \"$@\"\n")
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
        import shutil

        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self.log.close()
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


def _served(e: dict, cmd: list[str]) -> tuple[ForkServer | None, dict]:
    """The fork server that serves `cmd` with environment `e` (None: a fresh interpreter), and the environment to
    ask it with: under torchrun, the agent starts each rank as `$PYTHON_EXEC -u -m verlj.cli ...`, and
    forkclient asks the server for it."""
    server = _fork_server(e, _kind(cmd))
    if server is not None and server.kind != "plain" and not server.serves(e):  # a run that joins a Ray cluster, say
        server = _fork_server(e)
    if server is None or not server.serves(e):
        return None, e
    if cmd[2] == "torch.distributed.run":
        e = {**e, "PYTHON_EXEC": server.rank_python, "VERLJ_FORKSERVER_SOCKET": server.socket}
    return server, e


def ray_worker_server() -> ForkServer | None:
    """A fork server of its own for the workers of a local Ray cluster this process starts (None with
    VERLJ_TESTS_FRESH=1): started with this process's environment now, which the cluster's raylet takes as it
    starts and passes to every worker, and kept as it is for the cluster's life (this process's own servers are
    started again when its environment changes, _fork_server). Stop it after the cluster."""
    return None if os.environ.get("VERLJ_TESTS_FRESH") == "1" else ForkServer("plain")


@contextlib.contextmanager
def workers_from(server: ForkServer | None):
    """Within: a local Ray cluster started here (ray.init(address="local")) has its raylet start each worker
    (`PYTHON default_worker.py ARGS`) through tests/forkclient.py, as a process `server` forks (torch, transformers
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

    pids = [int(line.rsplit(" ", 1)[1]) for server in _SERVERS.values() if server.alive() for line in server.said()
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
    server, e = _served(env, cmd)
    if server is None:
        return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, env=env, cwd=REPO, start_new_session=start_new_session)
    return Forked(server, cmd, e, stdout=stdout, stderr=stderr, start_new_session=start_new_session)


_SERVERS: dict[str, ForkServer] = {}


def _fork_server(e: dict, kind: str = "plain") -> ForkServer | None:
    """This process's fork server of `kind` (KINDS) for a run with environment `e`: started again with this process's
    environment when that has changed in a variable the server read at import since it started (importing vLLM or
    starting Ray in this process sets some), so that it serves the runs after as a fresh interpreter would."""
    if os.environ.get("VERLJ_TESTS_FRESH") == "1":
        return None
    base = env()
    server = _SERVERS.get(kind)
    if server is not None and server.alive() and server.differs(base, server.env) and not server.differs(e, base):
        server.stop()
    if server is None or not server.alive():
        server = _SERVERS[kind] = ForkServer(kind)
    return server


def _kind(cmd: list[str]) -> str:
    """Which fork server a command line goes to: `vllm` for a run on rollout.engine=vllm, where it says so."""
    return "vllm" if "rollout.engine=vllm" in cmd else "plain"


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(run_dir: Path, *overrides: str, ranks: int = 1, resume: bool = False, **env_extra) -> subprocess.CompletedProcess:
    args = ["train", "--output-dir", run_dir, *TINY, *overrides]
    if resume:
        args.append("--resume")
    return verlj(*args, ranks=ranks, **env_extra)


def kill_and_resume(run: Path, ref: Path, *overrides: str, failpoint: str, **env_extra) -> subprocess.CompletedProcess:
    """Train `run` SIGKILLed at `failpoint` (VERLJ_FAILPOINT), resume it to its end, and check it against
    `ref`, the same run uninterrupted: the same fingerprints and the same journal. Returns the resume."""
    out = train(run, *overrides, VERLJ_FAILPOINT=failpoint, **env_extra)
    assert out.returncode == -9, out.stderr[-3000:]
    out = train(run, *overrides, resume=True, **env_extra)
    assert out.returncode == 0, out.stderr[-3000:]
    assert fingerprints(run) == fingerprints(ref)
    assert_same_journal(run, ref)
    return out


def comparable_steps(run_dir: Path, ignore: tuple[str, ...] = ()) -> list[dict]:
    """Each step's events with wall time, timing metrics (and the metrics whose names start with one of
    `ignore`) and nothing else removed."""
    out = []
    with open_journal_reader(Path(run_dir) / "journal") as j:
        for rec in j.iter_steps():
            events = []
            for e in rec.events:
                if e["type"] == "control":
                    continue  # start / resume / fork differ by design between a resumed and a straight run
                if e["type"] == "config":
                    continue
                if e["type"] == "metrics":
                    e = {**e, "values": {k: v for k, v in e["values"].items() if not k.startswith(("timing_s/", *ignore))}}
                events.append(e)
            out.append({"step": rec.step, "events": events})
    return out


def assert_same_journal(a: Path, b: Path, ignore: tuple[str, ...] = ()) -> None:
    sa, sb = comparable_steps(a, ignore), comparable_steps(b, ignore)
    assert [s["step"] for s in sa] == [s["step"] for s in sb]
    for x, y in zip(sa, sb):
        for ex, ey in zip(x["events"], y["events"], strict=True):
            assert ex["type"] == ey["type"], (x["step"], ex["type"], ey["type"])
            assert _same(ex, ey), f"step {x['step']}: event {ex['type']} differs"


def _same(a, b) -> bool:
    import numpy as np

    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def fingerprints(run_dir: Path) -> dict[int, str]:
    out = {}
    with open_journal_reader(Path(run_dir) / "journal") as j:
        for step, e in j.iter_events("state"):
            out[step] = e["fingerprint"]
    return out


def committed(run_dir: Path) -> int:
    """The run's last committed step, read while its trainer runs (0 before the journal exists)."""
    return max(fingerprints(run_dir), default=0) if (Path(run_dir) / "journal" / "data.mdb").exists() else 0


def pickle_module_reducing(reduce):
    """A pickle module for torch.save(pickle_module=...) whose Pickler reduces an object as `reduce(obj)`
    says (None: as usual): the forms other interpreters write, made on this one."""
    import pickle
    import types

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            out = reduce(obj)
            return NotImplemented if out is None else out

    mod = types.ModuleType("pickle_reducing")
    mod.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")}, Pickler=Pickler)
    return mod


def raised_at(path, needle: str) -> str:
    """What a fault's reason ends with when the user's code raised at the one line of `path` that is `needle`
    (stripped): `` (at NAME:LINE)`` (engine.plugins.raised_at)."""
    path = Path(path)
    hits = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if line.strip() == needle]
    assert len(hits) == 1, (path.name, needle, hits)
    return f" (at {path.name}:{hits[0]})"


class Driven:
    """A trainer and the rollout source a run would assemble for it, driven as the train loop drives them, without a run
    directory (the engine tests'): `collect` is the source's, `apply` the trainer's followed by the engine told the
    weights changed, `rollout` the source's engine; every other attribute is the trainer's."""

    def __init__(self, trainer):
        from verlj.engine.rl.sources import make_source

        self.trainer, self.source = trainer, make_source(trainer.rollout_parts(None))

    def __getattr__(self, name: str):
        return getattr(self.trainer, name)

    @property
    def rollout(self):
        return self.source.engine

    def collect(self, step: int):
        return self.source.collect(step)

    def apply(self, step: int, inputs, samples):
        out = self.trainer.apply(step, inputs, samples)
        self.source.weights_changed()
        return out

    def weights_changed(self) -> None:
        self.source.weights_changed()

    def close(self) -> None:
        self.source.close()
        self.trainer.close()
