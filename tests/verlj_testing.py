"""Shared helpers for engine tests: tiny configs, running `verlj`, reading journals for comparison."""

from __future__ import annotations

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
    interpreter gives (ForkServer.serves)."""
    e = env(**env_extra)
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(_port()),
               "-m", "verlj.cli", *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "verlj.cli", *map(str, args)]
    server = _fork_server(e)
    if server is not None and server.serves(e):
        if ranks > 1:  # the agent starts each rank as `$PYTHON_EXEC -u -m verlj.cli ...`: forkclient asks the server for it
            e.update(PYTHON_EXEC=server.rank_python, VERLJ_FORKSERVER_SOCKET=server.socket)
        out = server.run(cmd, e, timeout)
    else:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=REPO)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}")
    return out


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


class ForkServer:
    """This test process's fork server (tests/forkserver.py), started on first use, stopped at exit."""

    def __init__(self) -> None:
        import atexit
        import json
        import shlex
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="verlj-forkserver-"))
        self.socket = str(self.dir / "socket")
        self.env = env()
        self.env.pop("PYTHONPATH", None)
        self.log = open(self.dir / "server.log", "wb")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py")), self.socket],
                                     stdout=subprocess.PIPE, stderr=self.log, env=self.env, cwd=REPO)
        said = self.proc.stdout.readline().decode().split(" ", 1)
        if said[0] != "ready":
            raise RuntimeError(f"the fork server did not start: {(self.dir / 'server.log').read_text()[-3000:]}")
        ready = json.loads(said[1])
        self.preloaded, self.set_by_imports = set(ready["preloaded"]), ready["set_by_imports"]
        self.rank_python = str(self.dir / "python")  # torchrun's PYTHON_EXEC: a rank's interpreter from this server
        Path(self.rank_python).write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} "
                                          f"{shlex.quote(str(Path(__file__).with_name('forkclient.py')))} \"$@\"\n")
        os.chmod(self.rank_python, 0o755)
        atexit.register(self.stop)

    def serves(self, e: dict) -> bool:
        """Whether a process it forks is what a fresh interpreter with environment `e` would be."""
        return not forkserver.preloaded_env_differs(e, self.env, self.set_by_imports) and not forkserver.shadows_preloaded(e, self.preloaded)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, cmd: list[str], e: dict, timeout: float) -> subprocess.CompletedProcess:
        """`cmd` (`python -m MODULE ARGS`) as a process forked by the server, with environment `e`; what
        subprocess.run(cmd, capture_output=True, text=True, ...) returns. On a timeout the process is killed."""
        import json
        import signal
        import socket
        import tempfile
        import time

        fd, out_path = tempfile.mkstemp(dir=self.dir)
        os.close(fd)
        fd, err_path = tempfile.mkstemp(dir=self.dir)
        os.close(fd)
        deadline = time.monotonic() + timeout
        pid = None
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.socket)
                assert cmd[1] == "-m", cmd
                conn.sendall(json.dumps({"module": cmd[2], "args": cmd[3:], "env": e, "cwd": str(REPO), "stdout": out_path,
                                         "stderr": err_path}).encode() + b"\n")
                got, answers = b"", []
                while len(answers) < 2:
                    conn.settimeout(max(0.01, deadline - time.monotonic()))
                    try:
                        chunk = conn.recv(4096)
                    except TimeoutError:
                        if pid is not None:
                            os.kill(pid, signal.SIGKILL)
                        raise subprocess.TimeoutExpired(cmd, timeout, Path(out_path).read_text(), Path(err_path).read_text()) from None
                    if not chunk:
                        raise RuntimeError(f"the fork server ended the request without an exit status: {(self.dir / 'server.log').read_text()[-3000:]}")
                    got += chunk
                    *lines, got = got.split(b"\n")
                    answers += [json.loads(line) for line in lines]
                    if answers and "declined" in answers[0]:
                        raise RuntimeError(f"the fork server declined a request ForkServer.serves accepted: {answers[0]['declined']}")
                    if answers and pid is None:
                        pid = answers[0]["pid"]
            with open(out_path) as f, open(err_path) as g:  # text mode, as subprocess.run(text=True) reads its pipes
                return subprocess.CompletedProcess(cmd, answers[1]["code"], f.read(), g.read())
        finally:
            for p in (out_path, err_path):
                os.unlink(p)

    def stop(self) -> None:
        import shutil

        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_SERVER: list[ForkServer] = []


def _fork_server(e: dict) -> ForkServer | None:
    """This process's fork server for a run with environment `e`: started again with this process's environment
    when that has changed in a variable the server read at import since it started (importing vLLM or starting
    Ray in this process sets some), so that it serves the runs after as a fresh interpreter would."""
    if os.environ.get("VERLJ_TESTS_FRESH") == "1":
        return None
    base = env()
    if _SERVER and _SERVER[0].alive() and forkserver.preloaded_env_differs(base, _SERVER[0].env, _SERVER[0].set_by_imports) \
            and not forkserver.preloaded_env_differs(e, base, _SERVER[0].set_by_imports):
        _SERVER[0].stop()
    if not _SERVER or not _SERVER[0].alive():
        _SERVER[:] = [ForkServer()]
    return _SERVER[0]


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
