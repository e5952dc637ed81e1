"""The test suite's fork server: `python -m verlj.cli ...` without paying torch's and transformers' imports each time.

`verlj_testing.verlj()` runs the CLI as a process of its own, under torchrun for more than one rank. A fresh
interpreter spends about 6 s of one core importing torch, transformers' model classes and torch's inductor
config (which `use_deterministic_algorithms` imports) before verlj does anything, and the suite starts about
400 of them. This process imports those once, then for each request forks a real process that becomes
`python -m MODULE ARGS` (verlj.cli, or torch.distributed.run: torchrun's agent) with the request's
environment, working directory and standard streams: its own pid, killed by a real SIGKILL, its exit status
what a fresh interpreter's would be. What it has not imported (verlj itself, DeepSpeed, vLLM, Ray) it imports
as a fresh process does, after the request's environment is set. torchrun's ranks come from here too: the
agent starts each rank as `$PYTHON_EXEC -u -m verlj.cli ARGS`, and PYTHON_EXEC is a script that runs
tests/forkclient.py, which asks this server for the rank with its own environment and file descriptors,
passes on the signals the agent sends and ends as the rank ended. A request whose environment differs from
this process's in a variable the preloaded libraries read at start or import (`preloaded_env_differs`) or
whose PYTHONPATH shadows a preloaded module (`shadows_preloaded`) needs a fresh interpreter: verlj() checks
before asking, and the server declines a rank's request that needs one (forkclient then starts it as a
fresh interpreter). With VERLJ_TESTS_FRESH=1 no server is used.

Protocol, on a Unix socket whose path is argv[1]: one connection a request; the client sends one JSON line
{"module", "args", "env", "cwd", "unbuffered" (python -u), "setsid" (a session of its own)} with the process's
descriptors 0, 1 and 2 attached (SCM_RIGHTS); the server answers {"pid": PID} when the process
starts and {"code": CODE} when it ends (negative: the signal that ended it, as subprocess reports it), or
{"declined": [VARIABLES]}. A waiter process between the two (forked per request) lets requests overlap,
reports the exit status, and SIGKILLs the process if the client goes away first (its own SIGKILL, a test's
timeout): a rank lives no longer than torchrun's process for it would.
"""

from __future__ import annotations

import json
import os
import sys

# Variables the preloaded libraries read when they are imported: a request that sets them otherwise than this
# process had them needs an interpreter of its own (verlj_testing checks before asking).
PRELOAD_PREFIXES = ("TORCH", "ATEN_", "PYTORCH", "HF_", "HUGGINGFACE", "TRANSFORMERS", "CUDA", "OMP_", "MKL_", "KMP_", "GOMP",
                    "TOKENIZERS", "LD_", "TRITON", "USE_", "XDG_", "NCCL", "PYTHON", "LANG", "LC_")

# ... but these are read only when used: each process gets its own sys.path; breakpoint() reads PYTHONBREAKPOINT
# when called (Ray's driver sets it); torchrun's agent reads PYTHON_EXEC, and sets TORCHELASTIC_* and
# TORCH_NCCL_ASYNC_ERROR_HANDLING for each rank, which torch.distributed reads when a process group is made.
AT_RUN_TIME = ("PYTHONPATH", "PYTHONBREAKPOINT", "PYTHON_EXEC", "TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def preloaded_env_differs(env: dict, base: dict, set_by_imports: dict | None = None) -> list[str]:
    """The variables read at start or import by what this server preloads whose values differ between env and
    base. One that the imports set when it is unset (`set_by_imports`) counts as set to that value where unset."""
    env, base = {**(set_by_imports or {}), **env}, {**(set_by_imports or {}), **base}
    keys = {k for k in (*env, *base) if k.startswith(PRELOAD_PREFIXES) and not k.startswith(AT_RUN_TIME)}
    return sorted(k for k in keys if env.get(k) != base.get(k))


def shadows_preloaded(env: dict, preloaded: set[str]) -> list[str]:
    """The top-level modules this server has imported that the request's PYTHONPATH would put another file in
    front of (a test's stand-in for torch, say): such a request needs an interpreter of its own."""
    names = set()
    for entry in env.get("PYTHONPATH", "").split(os.pathsep):
        if entry and os.path.isdir(entry):
            names.update(n.removesuffix(".py") for n in os.listdir(entry))
    return sorted(names & preloaded)


def _preload() -> None:
    import torch  # noqa: F401
    import torch._inductor.config  # noqa: F401  (torch.use_deterministic_algorithms imports it: 1-2 s)
    from transformers import (  # noqa: F401
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )


def _read_request(conn) -> tuple[dict, list[int]]:
    """One JSON line and the file descriptors sent with it (they come with its first bytes)."""
    import socket

    data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise EOFError("the client went away")
        data += chunk
    return json.loads(data), fds


def _become(req: dict, fds: list[int], base_path: list[str], set_by_imports: dict) -> None:
    """(In the forked process.) Become `python [-u] -m MODULE ARGS` as a fresh interpreter started with the
    request's environment, working directory and standard streams would be; returns only by raising SystemExit
    (or another exception), which ends this process as it would end the interpreter."""
    import fcntl
    import importlib
    import io
    import runpy

    if req.get("setsid"):
        os.setsid()
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in fds]  # out of the way of 0-2, whatever numbers they came in
    for fd in fds:
        os.close(fd)
    for target, fd in enumerate(high):
        os.dup2(fd, target)
        os.close(fd)
    if req.get("unbuffered"):  # as `python -u` makes them: no buffer under the text layer, written through
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=sys.stdout.encoding,
                                                        errors=sys.stdout.errors, write_through=True)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=sys.stderr.encoding,
                                                        errors=sys.stderr.errors, write_through=True)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update({**set_by_imports, **req["env"]})
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *base_path]  # as `python -m` puts them: the working directory, PYTHONPATH, the rest
    importlib.invalidate_caches()
    sys.argv = ["-m", *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


def main() -> None:
    import socket

    path = sys.argv[1]
    start_env = dict(os.environ)
    _preload()
    set_by_imports = {k: v for k, v in os.environ.items() if k not in start_env}  # TORCHINDUCTOR_CACHE_DIR: a fresh process's imports set them too
    assert "verlj" not in sys.modules and "deepspeed" not in sys.modules, "the server must not import what a request configures"
    base_path = sys.path[1:]  # without this file's folder (sys.path[0])
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    preloaded = sorted({name.partition(".")[0] for name in sys.modules})
    print("ready " + json.dumps({"preloaded": preloaded, "set_by_imports": set_by_imports}), flush=True)
    while True:
        conn, _ = srv.accept()
        while True:  # reap the waiters that have ended
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() != 0:
            conn.close()
            continue
        # the waiter: start the process, say its pid, wait for it, say how it ended
        srv.close()
        try:
            req, fds = _read_request(conn)
            declined = preloaded_env_differs(req["env"], start_env, set_by_imports) + shadows_preloaded(req["env"], set(preloaded))
            if declined:
                print(f"declined {req['module']}: {declined}", file=sys.stderr, flush=True)
                conn.sendall(json.dumps({"declined": declined}).encode() + b"\n")
                os._exit(0)
            child = os.fork()
        except BaseException:  # noqa: BLE001 - the client sees the connection close without a pid
            os._exit(1)
        if child == 0:
            conn.close()
            _become(req, fds, base_path, set_by_imports)  # raises SystemExit out of main(): this process ends as the interpreter would
        for fd in fds:
            os.close(fd)
        print(f"forked {req['module']} {child}", file=sys.stderr, flush=True)  # the log tests read
        try:
            conn.sendall(json.dumps({"pid": child}).encode() + b"\n")
            _wait_or_kill(child, conn)
            _, status = os.waitpid(child, 0)
            conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        finally:
            os._exit(0)


def _wait_or_kill(child: int, conn) -> None:
    """Until the process ends; SIGKILL it if the client goes away first."""
    import select
    import signal

    pidfd = os.pidfd_open(child)
    while True:
        ready, _, _ = select.select([pidfd, conn], [], [])
        if pidfd in ready:
            return
        if not conn.recv(4096):
            os.kill(child, signal.SIGKILL)
            return

if __name__ == "__main__":
    main()
