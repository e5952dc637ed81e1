"""The supervisor of `verlj train … trainer.max_restarts=N` (cli/supervise.py), over real child processes
that stand in for the trainer: what it restarts, with which arguments, and when it stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from verlj.cli.supervise import STANDBY, SUPERVISED, supervise
from verlj.engine.config import launch_asked, make_config, restarts_asked
from verlj.engine.errors import ConfigError


def child(tmp_path, body: str) -> list[str]:
    """A stand-in trainer: as a standby, waits for "go" on stdin (counting in idle.txt the ones never
    told); then appends its argv and environment marks to calls.jsonl and runs BODY (`n` is how many
    times it was started before)."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, signal, sys, time
        calls = {str(tmp_path / "calls.jsonl")!r}
        standby = os.environ.get({STANDBY!r}) == "1"
        if standby and sys.stdin.readline().strip() != "go":
            open({str(tmp_path / "idle.txt")!r}, "a").write("idle\\n")
            sys.exit(0)
        n = sum(1 for _ in open(calls)) if os.path.exists(calls) else 0
        with open(calls, "a") as f:
            f.write(json.dumps({{"argv": sys.argv[1:], "supervised": os.environ.get({SUPERVISED!r}), "standby": standby}}) + "\\n")
    """) + textwrap.dedent(body))
    return [sys.executable, str(script), "train", "--output-dir", "r"]


def calls(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_a_killed_trainer_is_restarted_with_resume_until_it_finishes(tmp_path):
    said = []
    cmd = child(tmp_path, "if n < 2: os.kill(os.getpid(), signal.SIGKILL)\n")
    assert supervise(cmd, restarts=3, say=said.append) == 0
    seen = calls(tmp_path)
    assert [c["argv"] for c in seen] == [["train", "--output-dir", "r"]] + [["train", "--output-dir", "r", "--resume"]] * 2
    assert all(c["supervised"] == "1" for c in seen)  # the trainer never supervises in turn
    assert [c["standby"] for c in seen] == [False, True, True]  # each restart was a standby, its imports done
    assert (tmp_path / "idle.txt").read_text() == "idle\n"  # the one standby not needed exited, and was waited for
    assert sum("was killed by SIGKILL; restarting it with --resume" in line for line in said) == 2


def test_without_a_standby_a_restart_starts_a_new_process(tmp_path):
    cmd = child(tmp_path, "if n < 1: os.kill(os.getpid(), signal.SIGKILL)\n")
    assert supervise(cmd, restarts=2, say=lambda _: None, standby=False) == 0
    assert [c["standby"] for c in calls(tmp_path)] == [False, False] and not (tmp_path / "idle.txt").exists()


def test_restarts_run_out_with_one_line_and_the_trainer_s_status(tmp_path):
    said = []
    cmd = child(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert supervise(cmd, restarts=1, say=said.append) == 128 + signal.SIGKILL
    assert len(calls(tmp_path)) == 2
    assert "no restart left (trainer.max_restarts=1)" in said[-1] and "--resume" in said[-1]


@pytest.mark.parametrize("code", [0, 2, 3, 130])
def test_a_finished_run_a_bad_command_and_a_stop_are_not_restarted(tmp_path, code):
    cmd = child(tmp_path, f"sys.exit({code})\n")
    assert supervise(cmd, restarts=5, say=lambda _: None) == code
    assert len(calls(tmp_path)) == 1


def test_a_crash_is_restarted(tmp_path):
    cmd = child(tmp_path, "if n == 0: raise RuntimeError('NCCL timeout')\n")
    assert supervise(cmd, restarts=1, say=lambda _: None) == 0
    assert len(calls(tmp_path)) == 2


def test_sigterm_to_the_supervisor_reaches_the_trainer_once_and_is_not_restarted(tmp_path):
    """A scheduler's SIGTERM is passed on; the trainer ends as it chooses, and that is the end."""
    body = """
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        open(calls + ".ready", "w").close()
        deadline = time.time() + 30
        while not got and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a second signal would arrive now
        sys.exit(40 + len(got))
    """
    cmd = child(tmp_path, body)
    sup = subprocess.Popen([sys.executable, "-c", f"import sys; from verlj.cli.supervise import supervise; "
                            f"sys.exit(supervise({cmd!r}, restarts=3, say=lambda _: None))"])
    ready = tmp_path / "calls.jsonl.ready"
    deadline = time.time() + 60
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    os.kill(sup.pid, signal.SIGTERM)
    assert sup.wait(timeout=60) == 41  # one SIGTERM seen, and no restart after its exit
    assert len(calls(tmp_path)) == 1


def test_max_restarts_is_one_command_s_choice(tmp_path):
    assert restarts_asked(None, ["trainer.max_restarts=3"]) == 3
    assert restarts_asked(None, []) == 0
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("trainer:\n  max_restarts: 2\n")
    assert restarts_asked(cfg_file, []) == 2 and restarts_asked(cfg_file, ["trainer.max_restarts=0"]) == 0
    with pytest.raises(ConfigError, match="trainer.max_restarts must be an integer >= 0"):
        restarts_asked(None, ["trainer.max_restarts=-1"])
    assert make_config(None, ["trainer.max_restarts=3"]).to_stored()["trainer"]["max_restarts"] == 0  # never stored with the run


def test_the_ray_launcher_s_placement_is_one_command_s_choice(tmp_path):
    """`--launcher ray` places the ranks before any reads the run's config: placement and cluster as this command asks."""
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("distributed:\n  placement: spread\n  ray_address: head:6379\n")
    assert launch_asked(None, []) == ("pack", None)
    assert launch_asked(cfg_file, []) == ("spread", "head:6379")
    assert launch_asked(cfg_file, ["distributed.placement=pack"]) == ("pack", "head:6379")
    with pytest.raises(ConfigError, match="distributed.placement must be one of pack, spread; got 'wide'"):
        launch_asked(None, ["distributed.placement=wide"])
    with pytest.raises(ConfigError, match="distributed.placement must be one of pack, spread"):
        make_config(None, ["distributed.placement=wide"])
    assert make_config(None, ["distributed.placement=spread"]).to_stored()["distributed"]["placement"] == "pack"  # never stored
