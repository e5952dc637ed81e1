"""The suite's fork server (tests/harness/forkserver.py) stands in for a fresh interpreter: what `python -m verlj.cli`
prints, writes and exits with is the same from a process it forks as from a fresh one, for a run, a refusal
and a SIGKILL, on one rank and on torchrun's two (whose ranks tests/harness/forkclient.py asks the server for)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import processes
from verlj_testing import REPO, TINY, assert_same_journal, children, env, fingerprints, popen, train


def both(monkeypatch, tmp_path, *args, ranks=1, **env_extra):
    """The same `verlj train` in a forked process and in a fresh interpreter, each in its own run directory."""
    out = {}
    for how in ("forked", "fresh"):
        monkeypatch.setenv("VERLJ_TESTS_FRESH", "1" if how == "fresh" else "0")
        out[how] = train(tmp_path / how, *args, ranks=ranks, **env_extra)
    kind = processes.kind_of(list(args))
    assert kind in processes.SERVERS and processes.SERVERS[kind].alive()  # started by the forked call, which it served
    return out["forked"], out["fresh"]


def same_text(a: str, b: str, tmp_path) -> bool:
    def norm(s: str) -> str:
        return re.sub(r"time=[\d.]+s", "time=T", s.replace(str(tmp_path / "forked"), "RUN").replace(str(tmp_path / "fresh"), "RUN"))
    return norm(a) == norm(b)


def test_a_forked_run_a_refusal_and_a_kill_are_what_a_fresh_interpreter_gives(monkeypatch, tmp_path):
    forked, fresh = both(monkeypatch, tmp_path / "run", "trainer.total_steps=3")
    assert forked.returncode == fresh.returncode == 0
    assert same_text(forked.stdout, fresh.stdout, tmp_path / "run") and same_text(forked.stderr, fresh.stderr, tmp_path / "run")
    assert_same_journal(tmp_path / "run" / "forked", tmp_path / "run" / "fresh")
    assert fingerprints(tmp_path / "run" / "forked") == fingerprints(tmp_path / "run" / "fresh")

    forked, fresh = both(monkeypatch, tmp_path / "bad", "trainer.total_step=3")  # a typo'd key: one line, exit 2
    assert forked.returncode == fresh.returncode == 2
    assert same_text(forked.stderr, fresh.stderr, tmp_path / "bad") and len(forked.stderr.strip().splitlines()) == 1

    forked, fresh = both(monkeypatch, tmp_path / "kill", VERLJ_FAILPOINT="journal.after_commit:2")  # the process SIGKILLs itself
    assert forked.returncode == fresh.returncode == -9
    assert max(fingerprints(tmp_path / "kill" / "forked")) == max(fingerprints(tmp_path / "kill" / "fresh")) == 2


READS_AS_VERLJ_IMPORTS = """
import json, os, sys
import forkserver
import_verlj, forkserver._import_verlj = forkserver._import_verlj, lambda: None
forkserver._preload()  # what the server imports before verlj
read = set()
class Recording(type(os.environ)):
    def __getitem__(self, key):
        read.add(key)
        return super().__getitem__(key)
    def __contains__(self, key):
        read.add(key)
        return super().__contains__(key)
e = os.environ
os.environ = Recording(e._data, e.encodekey, e.decodekey, e.encodevalue, e.decodevalue)
before = set(sys.modules)
import_verlj()
new = set(sys.modules) - before
print(json.dumps({"read": sorted(read), "verlj": sorted(m for m in new if m.startswith("verlj.")), "new": sorted({m.partition(".")[0] for m in new})}))
"""


def test_importing_verlj_reads_only_variables_a_request_that_changes_them_is_declined_for():
    """The server imports every verlj module before it forks (forkserver._import_verlj), so a variable read as
    one is imported would be the server's value, not the request's: each one read is among those whose difference
    sends a request to a fresh interpreter (forkserver.PRELOAD_PREFIXES). VERLJ_FAILPOINT, say, is read at the
    first failpoint (the kill in the test above is the request's own)."""
    import json

    from harness.forkserver import PRELOAD_PREFIXES

    out = subprocess.run([sys.executable, "-c", READS_AS_VERLJ_IMPORTS], cwd=REPO / "tests" / "harness", env=env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["verlj"]) > 100 and "typer" in got["new"] and "lmdb" in got["new"]  # verlj's modules, and what they import
    assert "verlj.journal.failpoints" in got["verlj"] and "verlj.engine.rl.vllm_engine" in got["verlj"]
    assert "TYPER_USE_RICH" in got["read"]  # it saw what typer reads as it is imported
    assert [k for k in got["read"] if not k.startswith(PRELOAD_PREFIXES)] == []
    assert not {"vllm", "ray", "openai", "peft", "agents"} & set(got["new"])  # the optional libraries: imported where used


def test_the_server_starts_again_when_this_process_s_environment_changes_under_it(monkeypatch, tmp_path):
    """Importing vLLM (test_vllm does, in the test process) sets TORCHINDUCTOR_CACHE_DIR and others, which a
    fresh interpreter would see at torch's import: the next run gets a server started with them. A run that sets
    such a variable for itself alone gets a fresh interpreter, and the server stays."""
    monkeypatch.delenv("VERLJ_TESTS_FRESH", raising=False)
    assert train(tmp_path / "a", "trainer.total_steps=1").returncode == 0
    first = processes.SERVERS["plain"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # as vLLM's import sets it
    assert train(tmp_path / "b", "trainer.total_steps=1").returncode == 0
    second = processes.SERVERS["plain"]
    assert second is not first and not first.alive() and second.alive() and second.env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    own = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "own")}  # this run's own: a fresh interpreter
    assert not second.serves(env(**own))
    assert train(tmp_path / "c", "trainer.total_steps=1", **own).returncode == 0
    assert processes.SERVERS["plain"] is second and second.alive()
    assert_same_journal(tmp_path / "a", tmp_path / "b")
    assert_same_journal(tmp_path / "a", tmp_path / "c")


def test_a_vllm_run_is_forked_by_the_server_with_vllm_imported_and_is_what_a_fresh_interpreter_gives(monkeypatch, tmp_path):
    """A run on rollout.engine=vllm goes to the server that has vLLM imported (processes.KINDS); what it prints,
    journals and fingerprints is what a fresh interpreter gives, and the plain server never imports vLLM."""
    pytest.importorskip("vllm")
    forked, fresh = both(monkeypatch, tmp_path, "trainer.total_steps=2", "rollout.engine=vllm", "model.tiny.num_heads=2")
    assert forked.returncode == fresh.returncode == 0, forked.stderr[-3000:] + fresh.stderr[-3000:]
    assert same_text(forked.stdout, fresh.stdout, tmp_path) and same_text(forked.stderr, fresh.stderr, tmp_path)
    assert_same_journal(tmp_path / "forked", tmp_path / "fresh")
    assert fingerprints(tmp_path / "forked") == fingerprints(tmp_path / "fresh")
    server = processes.SERVERS["vllm"]
    assert "vllm" in server.preloaded and sum(line.startswith("forked verlj.cli") for line in server.said()) >= 1
    monkeypatch.delenv("VERLJ_TESTS_FRESH")
    plain = processes.fork_server(env())
    assert plain is not server and "vllm" not in plain.preloaded and "deepspeed" in plain.preloaded


def test_an_async_run_s_generator_is_the_fork_it_made_as_it_started_and_is_what_a_fresh_spawn_gives(monkeypatch, tmp_path):
    """rollout.mode=async: the generator multiprocessing spawns is the process the run forked as it started
    (forkserver._spawn_from_waiting), a child of the run running spawn_main, not a fresh interpreter; the run
    prints, journals and fingerprints what one whose generator is a fresh interpreter gives, and a generator
    killed alone ends both runs alike."""
    run = ["rollout.mode=async", "trainer.total_steps=3"]
    forked, fresh = both(monkeypatch, tmp_path / "run", *run)
    assert forked.returncode == fresh.returncode == 0, forked.stderr[-3000:] + fresh.stderr[-3000:]
    assert same_text(forked.stdout, fresh.stdout, tmp_path / "run") and same_text(forked.stderr, fresh.stderr, tmp_path / "run")
    assert_same_journal(tmp_path / "run" / "forked", tmp_path / "run" / "fresh")
    assert fingerprints(tmp_path / "run" / "forked") == fingerprints(tmp_path / "run" / "fresh")

    forked, fresh = both(monkeypatch, tmp_path / "kill", *run, VERLJ_FAILPOINT="generator.before_reply:2")  # SIGKILLs the generator
    assert forked.returncode == fresh.returncode != 0
    said = [re.sub(r"pid \d+", "pid N", out.stderr.strip().splitlines()[-1]) for out in (forked, fresh)]
    assert said[0] == said[1] and "the rollout generator process (pid N)" in said[0] and "killed by signal 9" in said[0]

    monkeypatch.setenv("VERLJ_TESTS_FRESH", "0")  # the generator, seen while the run goes: the run's child, no interpreter of its own
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(tmp_path / "seen"), *TINY, *run]
    p = popen(cmd, env=env(VERLJ_FAILPOINT="generator.before_reply:1:sleep-each=0.3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert isinstance(p, processes.Forked)
    for line in p.stdout:
        if "[INFO] Step 1: reward=" in line:
            break
    kids = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children(p.pid)}
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    generators = [pid for pid, line in kids.items() if b"forkserver.py" in line and b"spawn_main" not in line]
    assert len(generators) == 1 and not [line for line in kids.values() if b"spawn_main" in line], kids
    assert_same_journal(tmp_path / "seen", tmp_path / "run" / "fresh")


def served() -> list[str]:
    return processes.SERVERS["plain"].said()


def test_torchrun_s_ranks_forked_train_and_die_as_fresh_ones_do(monkeypatch, tmp_path):
    """Two ranks; rank 0 SIGKILLs itself after step 2's commit: the agent ends rank 1 (SIGTERM, which forkclient
    passes on) and exits 1, as with fresh ranks; the same journal and fingerprints up to the kill."""
    monkeypatch.delenv("VERLJ_TESTS_FRESH", raising=False)
    processes.fork_server(env())  # started, or started again for this process's environment, now
    before = len(served())
    forked, fresh = both(monkeypatch, tmp_path, "trainer.total_steps=3", ranks=2, VERLJ_FAILPOINT="journal.after_commit:2")
    new = served()[before:]
    assert [line.split()[1] for line in new if line.startswith("forked")].count("verlj.cli") == 2, new  # the ranks, by descriptor
    assert sum(line.startswith("forked torch.distributed.run") for line in new) == 1 and not [x for x in new if x.startswith("declined")]
    assert forked.returncode == fresh.returncode == 1
    steps = [[line for line in out.stdout.splitlines() if "[INFO] Step" in line] for out in (forked, fresh)]
    assert [re.sub(r"time=[\d.]+s", "", x) for x in steps[0]] == [re.sub(r"time=[\d.]+s", "", x) for x in steps[1]] and len(steps[0]) == 2
    assert_same_journal(tmp_path / "forked", tmp_path / "fresh")
    assert fingerprints(tmp_path / "forked") == fingerprints(tmp_path / "fresh") and max(fingerprints(tmp_path / "fresh")) == 2


def client(tmp_path, monkeypatch):
    """tests/harness/forkclient.py as torchrun starts a rank (PYTHON_EXEC -u -m MODULE ...), for a module that prints its
    pid and sleeps; returns the client's process and the pid of the process the server forked for it."""
    monkeypatch.delenv("VERLJ_TESTS_FRESH", raising=False)
    server = processes.fork_server(env())
    e = env(PYTHON_EXEC=server.rank_python, VERLJ_FORKSERVER_SOCKET=server.socket)
    p = subprocess.Popen([server.rank_python, "-u", "-m", "timeit", "-n", "1", "-r", "1",
                          "import os, time; print(os.getpid(), os.environ.get('PYTHON_EXEC')); time.sleep(120)"],
                         stdout=subprocess.PIPE, text=True, env=e, cwd=REPO)
    pid, exec_seen = p.stdout.readline().split()
    assert int(pid) != p.pid and exec_seen == "None"  # forked by the server; without the variables meant for the client
    return p, int(pid)


def gone(pid: int) -> bool:
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_signal_to_a_rank_s_client_reaches_the_rank_and_its_end_is_the_client_s(tmp_path, monkeypatch):
    p, pid = client(tmp_path, monkeypatch)
    p.send_signal(signal.SIGTERM)  # as torchrun's agent ends its ranks
    assert p.wait(timeout=30) == -signal.SIGTERM and gone(pid)


def test_a_rank_whose_client_is_killed_is_killed(tmp_path, monkeypatch):
    p, pid = client(tmp_path, monkeypatch)
    p.kill()  # SIGKILL cannot be passed on: the server's waiter sees the client go and kills the rank
    assert p.wait(timeout=30) == -signal.SIGKILL and gone(pid)
