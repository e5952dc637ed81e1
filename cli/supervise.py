"""`verlj train … trainer.max_restarts=N`: the process the user started supervises the one that trains.

The trainer runs as a child process (the same command, marked supervised); when it dies without
finishing (killed, crashed), it is started again with --resume, at most N times, and loses no
committed step: the resume is verlj's own (the newest valid snapshot, then the journal replayed).
A run that finishes, a bad command (exit 2) and a stop the user asked for (Ctrl-C, SIGTERM, which
are passed on to the trainer once each) are never restarted. Under torchrun the restarts are
torchrun's (`--max-restarts N`); each restarted rank resumes by itself (train_cmd). Under
`--launcher ray` they are cli/ray_launch's, by the same policy (restart_or_end).

While restarts remain, a standby process waits beside the trainer: the same command with --resume,
its libraries (torch, DeepSpeed, transformers) already imported and, where it can be, its trainer built
(engine/loop/standby.py), blocked on its stdin. A restart tells it "go" (most of a restart's time on this
machine went to those imports and that build); one that never hears it exits quietly when its stdin
closes, or with the supervisor.
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
STANDBY = "VERLJ_STANDBY"  # set in a standby's: import, then wait for "go" on stdin
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


class Forwarded:
    """From when it is made, INT, TERM and HUP do not stop this process: each is passed on to `send` (the
    trainer; every rank's process), and `stopping` says one came (a stop the user asked for: the
    supervisor ends once the trainer has, never restarts it). The supervisors of every launcher use it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, send: Callable[[int], None]):
        self.stopping = False
        self._send = send
        for sig in self.SIGNALS:
            signal.signal(sig, self._pass_on)

    def _pass_on(self, signum: int, _frame) -> None:
        self.stopping = True
        self._send(signum)


def restart_or_end(ended: str, code: int, stopping: bool, restarted: int, restarts: int, say: Callable[[str], None],
                   again: str = "it") -> bool:
    """The restart policy, the one for every launcher (this supervisor's and cli/ray_launch's): after the
    trainer ended with `code` (`ended`: that, in words), True when it is started again with --resume (said
    in one line); False when the command ends with exit_status(code) (said when no restart was left). A run
    that finished, a refused command and a stop the user asked for are never restarted."""
    if code in FINAL or stopping:
        return False
    if restarted >= restarts:
        say(f"{ended}; no restart left (trainer.max_restarts={restarts}): "
            "every committed step is in the journal, and `verlj train --resume` continues it")
        return False
    say(f"{ended}; restarting {again} with --resume ({restarted + 1} of {restarts})")
    return True


def supervise(cmd: list[str], restarts: int, say: Callable[[str], None] | None = None, standby: bool = True) -> int:
    """Run CMD (`python -m verlj.cli train …`) as a child and restart it with --resume when it dies, at
    most `restarts` times. Returns the exit status to end with (the last child's; 128+N for signal N)."""
    say = say or (lambda line: typer.echo(f"verlj: {line}", err=True))
    cmd = list(cmd)
    resume_cmd = cmd if "--resume" in cmd else [*cmd, "--resume"]
    env = {**os.environ, SUPERVISED: "1"}
    child: subprocess.Popen | None = None
    spare: subprocess.Popen | None = None

    def to_child(signum: int) -> None:
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    def start_spare() -> subprocess.Popen | None:
        if not standby:
            return None
        return subprocess.Popen(resume_cmd, env={**env, STANDBY: "1"}, stdin=subprocess.PIPE, text=True,
                                preexec_fn=_own_group_dying_with_parent)

    def take_spare() -> subprocess.Popen | None:
        nonlocal spare
        taken, spare = spare, None
        if taken is None or taken.poll() is not None:
            return None
        assert taken.stdin is not None  # started with stdin=PIPE
        try:
            taken.stdin.write("go\n")
            taken.stdin.close()
        except (BrokenPipeError, OSError):  # it died meanwhile
            return None
        return taken

    def end(code: int) -> int:
        if spare is not None:
            assert spare.stdin is not None  # started with stdin=PIPE
            spare.stdin.close()  # EOF: it exits without training
            try:
                spare.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spare.kill()
        return exit_status(code)

    signals = Forwarded(to_child)
    restarted = 0
    child = subprocess.Popen(cmd, env=env, preexec_fn=_own_group_dying_with_parent)
    while True:
        say(f"training in process {child.pid}" + (f" (restart {restarted} of {restarts})" if restarted else
                                                    f" (restarted with --resume if it dies, at most {restarts} times)"))
        if restarted < restarts and spare is None:
            spare = start_spare()
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:  # a signal arrived between handlers: wait on
                continue
        if not restart_or_end(f"the training process {how_it_ended(code)}", code, signals.stopping, restarted, restarts, say):
            return end(code)
        restarted += 1
        child = take_spare() or subprocess.Popen(resume_cmd, env=env, preexec_fn=_own_group_dying_with_parent)
