"""A rank's interpreter under torchrun, or a Ray worker's, from the suite's fork server (forkserver.py, beside it).

torchrun's agent starts each rank as `$PYTHON_EXEC -u -m verlj.cli ARGS`; processes.served sets
PYTHON_EXEC to a script that runs this file with the real interpreter. It asks the server at
$VERLJ_FORKSERVER_SOCKET for a process that becomes `python -u -m verlj.cli ARGS` with this process's
environment (less those two variables, which a rank under plain torchrun does not have), working directory and
standard streams (their file descriptors go with the request), passes on every signal the agent sends it, and
ends as that process ended: the same exit status, or killed by the same signal. If this process is killed
(SIGKILL), the server kills the rank. Where the server declines (the rank's environment is one only a fresh
interpreter gives) or cannot be reached, or the command line is not `[-u] -m MODULE ARGS` (or Ray's worker,
SCRIPTS below), this process becomes the fresh interpreter itself (exec). Standard library only: it starts in a
few hundredths of a second.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


# The scripts asked of the server by path (`python [-u] SCRIPT ARGS`): a Ray worker, which the raylet of a cluster
# started under processes.workers_from() starts as `$PYTHON default_worker.py ARGS`, $PYTHON being the script
# (VERLJ_FORKCLIENT_PYTHON: it says its own path) that runs this file.
SCRIPTS = ("default_worker.py",)
# A worker whose job or actor has a runtime env (Ray's py_modules, env_vars) the raylet starts as `$PYTHON
# setup_worker.py ... default_worker.py ARGS`: setup_worker.py applies the env, then execs `PY default_worker.py
# ARGS`, PY being the runtime env agent's sys.executable. That setup runs as the fresh interpreter it was, the
# server's socket left in its environment, and the agent runs with sys.executable $PYTHON (RAY_AGENT_BOOT), so
# that the worker it execs comes back here and is asked of the server.
RAY_SETUP = "setup_worker.py"
RAY_AGENT = os.path.join("runtime_env", "agent", "main.py")
RAY_AGENT_BOOT = ("import os, runpy, sys; sys.executable = sys.argv[1]; sys.argv = sys.argv[2:]; "
                  "sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0])); runpy.run_path(sys.argv[0], run_name='__main__')")

PENDING: list[int] = []  # signals that came before the rank's pid


def fresh(env: dict) -> None:
    for signum in PENDING:  # what the rank would have got: the fresh interpreter would not be started
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os.execve(sys.executable, [sys.executable, *sys.argv[1:]], env)


def main() -> None:
    env = dict(os.environ)
    me = env.pop("VERLJ_FORKCLIENT_PYTHON", "")
    path = env.pop("VERLJ_FORKSERVER_SOCKET", "")
    env.pop("PYTHON_EXEC", None)
    argv = sys.argv[1:]
    unbuffered = argv[:1] == ["-u"]
    rest = argv[1:] if unbuffered else argv
    if rest[:1] == ["-m"] and len(rest) >= 2:
        what = {"module": rest[1], "args": rest[2:]}
    elif rest and os.path.basename(rest[0]) in SCRIPTS:
        what = {"script": rest[0], "args": rest[1:]}
    else:
        what = None
    if what is None and path and me and rest:
        if os.path.basename(rest[0]) == RAY_SETUP:
            os.execve(sys.executable, [sys.executable, *argv], {**env, "VERLJ_FORKSERVER_SOCKET": path})
        if rest[0].endswith(os.sep + RAY_AGENT):
            os.execve(sys.executable, [sys.executable, *argv[: len(argv) - len(rest)], "-c", RAY_AGENT_BOOT, me, *rest], env)
    if what is None or not path:
        fresh(env)
    pid = None

    def forward(signum, _frame):
        if pid is None:
            PENDING.append(signum)
        else:
            os.kill(pid, signum)

    for s in FORWARDED:
        signal.signal(s, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        req = {**what, "env": env, "cwd": os.getcwd(), "unbuffered": unbuffered}
        socket.send_fds(conn, [json.dumps(req).encode() + b"\n"], [0, 1, 2])
    except OSError:
        conn.close()
        fresh(env)
    got = b""
    while True:
        chunk = conn.recv(4096)
        if not chunk:
            sys.exit(f"forkclient: the fork server ended the request without an exit status (rank pid {pid})")
        got += chunk
        *lines, got = got.split(b"\n")
        for line in lines:
            said = json.loads(line)
            if "declined" in said:
                conn.close()
                fresh(env)
            if "pid" in said:
                pid = said["pid"]
                for signum in PENDING:
                    os.kill(pid, signum)
            if "code" in said:
                code = said["code"]
                if code < 0:  # killed by a signal: so is this process, as the agent would have seen the rank
                    signal.signal(-code, signal.SIG_DFL)
                    os.kill(os.getpid(), -code)
                os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
