"""`verlj train … trainer.max_restarts=N`: the process the user started supervises the one that trains.

The trainer runs as a child process (the same command, marked supervised); when it dies without
finishing (killed, crashed), it is started again with --resume, at most N times, and loses no
committed step: the resume is verlj's own (the newest valid snapshot, then the journal replayed).
A run that finishes, a bad command (exit 2) and a stop the user asked for (Ctrl-C, SIGTERM, which
are passed on to the trainer once each) are never restarted. Under torchrun the restarts are
torchrun's (`--max-restarts N`); each restarted rank resumes by itself (train_cmd).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

import typer

from .common import EXIT_SNAPSHOTS_FAILED, EXIT_USAGE

SUPERVISED = "VERLJ_SUPERVISED"  # set in the trainer's environment: it trains, never supervises
FINAL = (0, EXIT_SNAPSHOTS_FAILED, EXIT_USAGE, 130)  # exits a restart would not change


def under_launcher() -> bool:
    """torchrun (or another launcher) started this process as one rank of a job."""
    return "WORLD_SIZE" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def _own_group_dying_with_parent() -> None:  # in the child, before exec
    os.setpgid(0, 0)  # a Ctrl-C at the terminal reaches the supervisor alone, which passes it on once
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG: a supervisor killed stops its trainer cleanly


def how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def supervise(cmd: list[str], restarts: int, say: Callable[[str], None] | None = None) -> int:
    """Run CMD (`python -m verlj.cli train …`) as a child and restart it with --resume when it dies, at
    most `restarts` times. Returns the exit status to end with (the last child's; 128+N for signal N)."""
    say = say or (lambda line: typer.echo(f"verlj: {line}", err=True))
    cmd = list(cmd)
    env = {**os.environ, SUPERVISED: "1"}
    child: subprocess.Popen | None = None
    stopping = False

    def pass_on(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, pass_on)
    restarted = 0
    while True:
        child = subprocess.Popen(cmd, env=env, preexec_fn=_own_group_dying_with_parent)
        say(f"training in process {child.pid}" + (f" (restart {restarted} of {restarts})" if restarted else
                                                    f" (restarted with --resume if it dies, at most {restarts} times)"))
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:  # a signal arrived between handlers: wait on
                continue
        if code in FINAL or stopping:
            return exit_status(code)
        if restarted >= restarts:
            say(f"the training process {how_it_ended(code)}; no restart left (trainer.max_restarts={restarts}): "
                "every committed step is in the journal, and `verlj train --resume` continues it")
            return exit_status(code)
        restarted += 1
        say(f"the training process {how_it_ended(code)}; restarting it with --resume ({restarted} of {restarts})")
        if "--resume" not in cmd:
            cmd.append("--resume")
