"""The suite's fork server (tests/forkserver.py) stands in for a fresh interpreter: what `python -m verlj.cli`
prints, writes and exits with is the same from a process it forks as from a fresh one, for a run, a refusal
and a SIGKILL."""

import re

import pytest

import verlj_testing
from verlj_testing import assert_same_journal, fingerprints, train


def both(monkeypatch, tmp_path, *args, **env_extra):
    """The same `verlj train` in a forked process and in a fresh interpreter, each in its own run directory."""
    out = {}
    for how in ("forked", "fresh"):
        monkeypatch.setenv("VERLJ_TESTS_FRESH", "1" if how == "fresh" else "0")
        out[how] = train(tmp_path / how, *args, **env_extra)
    assert verlj_testing._SERVER and verlj_testing._SERVER[0].alive()  # started by the forked call, which it served
    return out["forked"], out["fresh"]


def same_text(a: str, b: str, tmp_path) -> bool:
    def norm(s: str) -> str:
        return re.sub(r"time=[\d.]+s", "time=T", s.replace(str(tmp_path / "forked"), "RUN").replace(str(tmp_path / "fresh"), "RUN"))
    return norm(a) == norm(b)


@pytest.mark.slow
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


def test_the_server_starts_again_when_this_process_s_environment_changes_under_it(monkeypatch, tmp_path):
    """Importing vLLM (test_vllm does, in the test process) sets TORCHINDUCTOR_CACHE_DIR and others, which a
    fresh interpreter would see at torch's import: the next run gets a server started with them. A run that sets
    such a variable for itself alone gets a fresh interpreter, and the server stays."""
    monkeypatch.delenv("VERLJ_TESTS_FRESH", raising=False)
    assert train(tmp_path / "a", "trainer.total_steps=1").returncode == 0
    first = verlj_testing._SERVER[0]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # as vLLM's import sets it
    assert train(tmp_path / "b", "trainer.total_steps=1").returncode == 0
    second = verlj_testing._SERVER[0]
    assert second is not first and not first.alive() and second.alive() and second.env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    own = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "own")}  # this run's own: a fresh interpreter
    assert not second.serves(verlj_testing.env(**own))
    assert train(tmp_path / "c", "trainer.total_steps=1", **own).returncode == 0
    assert verlj_testing._SERVER[0] is second and second.alive()
    assert_same_journal(tmp_path / "a", tmp_path / "b")
    assert_same_journal(tmp_path / "a", tmp_path / "c")
