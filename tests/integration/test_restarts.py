"""A run that goes on by itself after its trainer is killed: `verlj train … trainer.max_restarts=N`
(the process the user started supervises the one that trains) and `torchrun --max-restarts N` (each
restarted rank resumes by itself). Both end bit-identical to the uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from verlj_testing import REPO, TINY, assert_same_journal, children, env, free_port


@pytest.fixture(scope="module")
def reference(tmp_path_factory, reference_run) -> Path:
    """The default run (test_distill_runs's default_run, trained once)."""
    return reference_run(tmp_path_factory.mktemp("restarts") / "reference", TINY, {})


def test_a_trainer_killed_by_sigkill_is_restarted_and_the_run_ends_identical(tmp_path, reference):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, "trainer.max_restarts=2"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), cwd=REPO)
    active = killed = None
    for line in p.stdout:
        if m := re.search(r"verlj: training in process (\d+)", line):
            active = int(m.group(1))
        if "[INFO] Step 2: reward=" in line:  # the trainer is a child of the supervisor (beside its standby): kill -9 it alone
            assert active in children(p.pid) and len(children(p.pid)) == 2
            killed = active
            os.kill(killed, signal.SIGKILL)
            break
    rest, _ = p.communicate(timeout=600)
    assert p.returncode == 0, rest[-3000:]
    assert "the training process was killed by SIGKILL; restarting it with --resume (1 of 2)" in rest
    restarted = int(re.search(r"verlj: training in process (\d+) \(restart 1 of 2\)", rest).group(1))
    assert restarted != killed and "Step 4: reward=" in rest and f"Done: last committed step 4 in {run}" in rest
    assert "Took the trainer the standby built before the restart (models, DeepSpeed engines, data)." in rest  # loop/standby.py
    assert not Path(f"/proc/{p.pid}").exists() or not children(p.pid)  # no standby left behind
    assert_same_journal(run, reference)


def test_a_standby_built_for_another_config_than_the_runs_builds_the_runs_and_says_so(tmp_path):
    """The command's config is not the run's (a --resume of a run whose first command set other keys): the standby's
    trainer, built for the command's, is closed and the run's built; the run goes on and verifies."""
    run = tmp_path / "run"
    first = subprocess.run([sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, "trainer.total_steps=2"],
                           capture_output=True, text=True, timeout=600, cwd=REPO, env=env())
    assert first.returncode == 0, first.stderr[-3000:]
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), "--resume", "trainer.total_steps=5", "trainer.max_restarts=1"]
    # SIGKILL after the process's second commit (step 4); the restart commits one (step 5)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env(VERLJ_FAILPOINT="journal.after_commit:2"))
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout + out.stderr
    assert "restarting it with --resume (1 of 1)" in said and f"Done: last committed step 5 in {run}" in said
    assert ("The standby built its trainer for the command's config, and the run's is another (a --resume changed it): "
            "built the run's instead.") in said
    verify = subprocess.run([sys.executable, "-m", "verlj.cli", "verify", str(run)], capture_output=True, text=True, timeout=600, cwd=REPO,
                            env=env())
    assert verify.returncode == 0, verify.stdout[-3000:]


def test_torchrun_max_restarts_resumes_each_restart_by_itself(tmp_path, reference):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--max-restarts", "1", "--master_port",
           str(free_port()), "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                         env=env(VERLJ_FAILPOINT="journal.after_commit:3"))  # SIGKILL after step 3, once per process
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"torchrun restart 1: resuming the run in {run}" in out.stderr
    assert_same_journal(run, reference)
