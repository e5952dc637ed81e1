"""The test suite's fork server: `python -m verlj.cli ...` without paying torch's and transformers' imports each time.

`verlj_testing.verlj()` runs the CLI as a process of its own. A fresh interpreter spends about 6 s of one core
importing torch, transformers' model classes and torch's inductor config (which `use_deterministic_algorithms`
imports) before verlj does anything, and the suite starts about 300 of them. This process imports those once,
then for each request forks a real process that becomes `python -m verlj.cli ARGS` with the request's
environment, working directory and output files: its own pid, killed by a real SIGKILL, its exit status what a
fresh interpreter's would be. What it has not imported (verlj itself, DeepSpeed, vLLM, Ray) it imports as a
fresh process does, after the request's environment is set. verlj() runs in a fresh interpreter instead a
request whose environment differs from this process's in a variable the preloaded libraries read at start
or import (`preloaded_env_differs`) or whose PYTHONPATH shadows a preloaded module (`shadows_preloaded`), and
every request when VERLJ_TESTS_FRESH=1.

Protocol, on a Unix socket whose path is argv[1]: one connection a request; the client sends one JSON line
{"args", "env", "cwd", "stdout", "stderr"}; the server answers {"pid": PID} when the process starts and
{"code": CODE} when it ends (negative: the signal that ended it, as subprocess reports it). A waiter process
between the two (forked per request) lets requests overlap and reports the exit status.
"""

from __future__ import annotations

import json
import os
import sys

# Variables the preloaded libraries read when they are imported: a request that sets them otherwise than this
# process had them needs an interpreter of its own (verlj_testing checks before asking).
PRELOAD_PREFIXES = ("TORCH", "PYTORCH", "HF_", "HUGGINGFACE", "TRANSFORMERS", "CUDA", "OMP_", "MKL_", "KMP_", "GOMP",
                    "TOKENIZERS", "LD_", "TRITON", "USE_", "XDG_", "NCCL", "PYTHON")


AT_RUN_TIME = ("PYTHONPATH", "PYTHONBREAKPOINT")  # each process gets its own sys.path; breakpoint() reads the other when called (Ray's driver sets it)


def preloaded_env_differs(env: dict, base: dict) -> list[str]:
    """The variables read at start or import by what this server preloads whose values differ between env and
    base."""
    keys = {k for k in (*env, *base) if k.startswith(PRELOAD_PREFIXES) and k not in AT_RUN_TIME}
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


def _read_line(conn) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise EOFError("the client went away")
        data += chunk
    return data


def _become_cli(req: dict, base_path: list[str]) -> None:
    """(In the forked process.) Become `python -m verlj.cli ARGS` as a fresh interpreter started with the
    request's environment and working directory would be; returns only by raising SystemExit (or another
    exception), which ends this process as it would end the interpreter."""
    import importlib
    import runpy

    out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (out, err, null):
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *base_path]  # as `python -m` puts them: the working directory, PYTHONPATH, the rest
    importlib.invalidate_caches()
    sys.argv = ["-m", *req["args"]]
    runpy.run_module("verlj.cli", run_name="__main__", alter_sys=True)
    sys.exit(0)


def main() -> None:
    import socket

    path = sys.argv[1]
    _preload()
    assert "verlj" not in sys.modules and "deepspeed" not in sys.modules, "the server must not import what a request configures"
    base_path = sys.path[1:]  # without this file's folder (sys.path[0])
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    print("ready " + json.dumps(sorted({name.partition(".")[0] for name in sys.modules})), flush=True)
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
            req = json.loads(_read_line(conn))
            child = os.fork()
        except BaseException:  # noqa: BLE001 - the client sees the connection close without a pid
            os._exit(1)
        if child == 0:
            conn.close()
            _become_cli(req, base_path)  # raises SystemExit out of main(): this process ends as the CLI's interpreter would
        try:
            conn.sendall(json.dumps({"pid": child}).encode() + b"\n")
            _, status = os.waitpid(child, 0)
            conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        finally:
            os._exit(0)

if __name__ == "__main__":
    main()
