"""Shared helpers for engine tests: tiny configs, running `verlj`, reading journals for comparison. How a run gets its
process (a fork server's, or a fresh interpreter) is the harness's (tests/harness/, its README.md): `env`, `popen`,
`children`, `ray_worker_server`, `workers_from`, `wait_forked_ended` and `free_port` are imported from there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness import processes
from harness.processes import REPO, children, env, free_port, popen, ray_worker_server, wait_forked_ended, workers_from  # noqa: F401 - the test modules import them from here
from verlj.journal import open_journal_reader

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


def verlj(*args, check: bool = False, timeout: float = 300, ranks: int = 1, **env_extra) -> subprocess.CompletedProcess:
    """Run the real CLI in a process of its own (under torchrun when ranks > 1). The process (torchrun's agent, and
    its ranks through the harness's forkclient.py) is forked by a fork server (tests/harness/: torch and transformers
    already imported), unless VERLJ_TESTS_FRESH=1 or the environment asked for is one only a fresh interpreter gives
    (harness.processes.run). With VERLJ_TESTS_RUNLOG=FILE each run adds a JSON line to FILE: the test, the command's
    arguments, its ranks, who started it (a fork server's kind, or fresh), its seconds and exit status, what a look
    at where the suite's time goes starts from, and the lines it printed that say how it went (RUN_LINES), which
    test_forked_as_fresh compares between a forked and a fresh pass."""
    import time

    started = time.monotonic()
    e = env(**env_extra)
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(free_port()),
               "-m", "verlj.cli", *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "verlj.cli", *map(str, args)]
    out, by = processes.run(cmd, e, timeout)
    processes.log_run({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "args": [str(a) for a in args], "ranks": ranks, "by": by,
                       "seconds": round(time.monotonic() - started, 2), "code": out.returncode,
                       "said": [line for line in (out.stdout + out.stderr).splitlines() if line.startswith(RUN_LINES)]})
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}")
    return out


RUN_LINES = ("[INFO] ", "error: ", "Done: ")  # what a run prints about its steps, snapshots and resumes, its end and its refusal


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
