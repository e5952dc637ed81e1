"""The test suite's fork server: `python -m verlj.cli ...` without paying torch's and transformers' imports each time.

`verlj_testing.verlj()` runs the CLI as a process of its own (processes.py, beside this file), under torchrun for
more than one rank. A fresh interpreter spends about 7 s of one core importing torch, transformers' model classes, torch's inductor config
(which `use_deterministic_algorithms` imports) and DeepSpeed before verlj does anything, and the suite starts about
650 of them (its runs, and torchrun's agents and ranks). This process imports those once (DeepSpeed on a CPU build
of torch only, on the CPU accelerator that verlj.engine.dist.prepare_accelerator picks there), then for each
request forks a real process that becomes `python -m MODULE ARGS` (verlj.cli, or torch.distributed.run: torchrun's
agent) with the request's environment, working directory and standard streams: its own pid, killed by a real
SIGKILL, its exit status what a fresh interpreter's would be. It imports verlj's modules too, every one (0.2 s a
process; none reads the environment as it is imported, and none imports an optional library such as Ray or vLLM).
What it has not imported (Ray, vLLM in the plain server) a process imports as a fresh one does, after the
request's environment is set. A server started with `vllm` after the
socket's path imports vLLM too (about 3 s of a core; with the variables verlj.engine.rl.vllm_engine sets before it
imports vLLM), for the runs on rollout.engine=vllm (processes.kind_of picks the server by the command line); the other
server's runs never have vLLM imported. A run with rollout.mode=async forks, as it starts, the process that its
generator will be (_spawn_from_waiting): multiprocessing's spawn of the generator hands that process the
descriptors and the spawn_main it would give a fresh interpreter, which saves the interpreter's 4 s of imports each
time. Before it serves, the server moves what it imported into the garbage collector's permanent generation
(gc.freeze), so that a full collection in a forked process (vLLM makes several as it starts and stops) walks only
what that process made, as Python's documentation advises for a server that forks. torchrun's ranks come from here
too: the agent starts each rank as `$PYTHON_EXEC -u -m verlj.cli ARGS`, and PYTHON_EXEC is a script that runs
forkclient.py (beside this file), which asks this server for the rank with its own environment and file descriptors, passes on
the signals the agent sends and ends as the rank ended. A request whose environment differs from this process's in
a variable the preloaded libraries read at start or import (`preloaded_env_differs`) or whose PYTHONPATH shadows a
preloaded module (`shadows_preloaded`) needs a fresh interpreter: processes.served checks before asking, and the server
declines a rank's request that needs one (forkclient then starts it as a fresh interpreter). With
VERLJ_TESTS_FRESH=1 no server is used.

A local Ray cluster the suite starts (tests/integration/conftest.py's `cluster`) has a server of its own, whose
forks are its workers: the raylet starts each as `PYTHON default_worker.py ARGS` with PYTHON the script that runs
forkclient, which asks for the script by path (processes.workers_from). README.md beside this file says what
this server preloads and patches, and which library internals it touches.

Protocol, on a Unix socket whose path is argv[1] (argv[2], when given, is `vllm`): one connection a request; the
client sends one JSON line {"module" (`python -m MODULE`) or "script" (`python SCRIPT`), "args", "env", "cwd",
"unbuffered" (python -u), "setsid" (a session of its
own)} with the process's descriptors 0, 1 and 2 attached (SCM_RIGHTS); the server answers {"pid": PID} when the
process starts and {"code": CODE} when it ends (negative: the signal that ended it, as subprocess reports it),
or {"declined": [VARIABLES]}. A waiter process between the two (forked per request) lets requests overlap,
reports the exit status, and SIGKILLs the process if the client goes away first (its own SIGKILL, a test's
timeout): a rank lives no longer than torchrun's process for it would.
"""

from __future__ import annotations

import json
import os
import sys

# Variables the preloaded libraries read when they are imported: a request that sets them otherwise than this
# process had them needs an interpreter of its own (processes.served checks before asking).
PRELOAD_PREFIXES = ("TORCH", "ATEN_", "PYTORCH", "HF_", "HUGGINGFACE", "TRANSFORMERS", "CUDA", "OMP_", "MKL_", "KMP_", "GOMP",
                    "TOKENIZERS", "LD_", "TRITON", "USE_", "XDG_", "NCCL", "PYTHON", "LANG", "LC_",
                    "DS_", "DEEPSPEED", "DISABLE_LOGS", "MSGPACK", "PYDANTIC",  # DeepSpeed's import
                    "TYPER_", "LMDB_", "READTHEDOCS",  # verlj's imports (typer's rich switch, lmdb's binding)
                    "VLLM_")  # vLLM's (the plain server: a test process that imported vLLM starts it again)
RAY_PREFIXES = ("RAY_",)  # vLLM's import imports Ray's core, which reads the cluster's address and token then

# ... but these are read only when used: each process gets its own sys.path; breakpoint() reads PYTHONBREAKPOINT
# when called (Ray's driver sets it); torchrun's agent reads PYTHON_EXEC, and sets TORCHELASTIC_* and
# TORCH_NCCL_ASYNC_ERROR_HANDLING for each rank, which torch.distributed reads when a process group is made.
AT_RUN_TIME = ("PYTHONPATH", "PYTHONBREAKPOINT", "PYTHON_EXEC", "TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def prefixes(preloaded) -> tuple[str, ...]:
    """The prefixes of the variables read at import by a server that preloaded the top-level modules `preloaded`."""
    return PRELOAD_PREFIXES + (RAY_PREFIXES if "ray" in preloaded else ())


def preloaded_env_differs(env: dict, base: dict, set_by_imports: dict | None = None, read=PRELOAD_PREFIXES) -> list[str]:
    """The variables read at start or import by what this server preloads (their prefixes: `read`) whose values
    differ between env and base. One that the imports set when it is unset (`set_by_imports`) counts as set to
    that value where unset."""
    env, base = {**(set_by_imports or {}), **env}, {**(set_by_imports or {}), **base}
    keys = {k for k in (*env, *base) if k.startswith(read) and not k.startswith(AT_RUN_TIME)}
    return sorted(k for k in keys if env.get(k) != base.get(k))


def shadows_preloaded(env: dict, preloaded: set[str]) -> list[str]:
    """The top-level modules this server has imported that the request's PYTHONPATH would put another file in
    front of (a test's stand-in for torch, say): such a request needs an interpreter of its own."""
    names = set()
    for entry in env.get("PYTHONPATH", "").split(os.pathsep):
        if entry and os.path.isdir(entry):
            names.update(n.removesuffix(".py") for n in os.listdir(entry))
    return sorted(names & preloaded)


def _preload(vllm: bool = False) -> None:
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

    if torch.version.cuda is None and torch.version.hip is None:  # a CPU build of torch: no GPU to leave untouched before fork
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as verlj.engine.dist.prepare_accelerator sets it where no GPU is visible
        import deepspeed  # noqa: F401
    if vllm:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as verlj.engine.rl.vllm_engine._env sets them before its import
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        import vllm  # noqa: F401
        from vllm import LLM, SamplingParams  # noqa: F401
        from vllm.inputs import TokensPrompt  # noqa: F401

        if torch.version.cuda is None and torch.version.hip is None:  # what its CPU engine imports as it starts (0.5 s)
            try:
                import vllm.v1.worker.cpu_model_runner  # noqa: F401
                import vllm.v1.worker.cpu_worker  # noqa: F401
            except ImportError:  # another vLLM's layout: its runs import what they need, as a fresh process does
                pass
            from torch._inductor import cpu_vec_isa

            # The vector instructions this CPU runs, which inductor probes (three processes, 0.7 s) as vLLM's
            # sampler compiles: the machine's, cached for the process's life, the same in every process.
            cpu_vec_isa.pick_vec_isa()
    _import_verlj()


def _import_verlj() -> None:
    """Every module of verlj.journal, verlj.engine and verlj.cli (each a run would import as it goes)."""
    import importlib
    import pkgutil

    import verlj.cli
    import verlj.engine
    import verlj.journal

    for package in (verlj.journal, verlj.engine, verlj.cli):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not module.name.endswith(".__main__"):  # cli's __main__ runs the CLI: each request runs it
                importlib.import_module(module.name)


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


def _become(req: dict, fds: list[int], base_path: list[str], set_by_imports: dict, preloaded: list[str]) -> None:
    """(In the forked process.) Become `python [-u] -m MODULE ARGS` (or `python [-u] SCRIPT ARGS`) as a fresh interpreter started with the
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
        was = {id(sys.stdout): 1, id(sys.stderr): 2}
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=sys.stdout.encoding,
                                                        errors=sys.stdout.errors, write_through=True)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=sys.stderr.encoding,
                                                        errors=sys.stderr.errors, write_through=True)
        _restream_handlers(was)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update({**set_by_imports, **req["env"]})
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    script = req.get("script")
    # as the interpreter puts them: the script's folder (its links resolved) or, for -m, the working directory; PYTHONPATH; the rest
    sys.path[:] = [os.path.dirname(os.path.realpath(script)) if script else os.getcwd(), *extra, *base_path]
    importlib.invalidate_caches()
    if script:
        sys.argv = [script, *req["args"]]
        runpy.run_path(script, run_name="__main__")
    else:
        if req["module"] == "verlj.cli" and "rollout.mode=async" in req["args"]:
            _spawn_from_waiting(preloaded)
        sys.argv = ["-m", *req["args"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


SPAWN_MAIN = "from multiprocessing.spawn import spawn_main;"  # how the command line of a process multiprocessing spawns begins
MAX_FDS = 200  # descriptors a message (SCM_RIGHTS) carries; Linux takes at most 253


def _spawn_from_waiting(preloaded: list[str]) -> None:
    """(In the process becoming a run with rollout.mode=async, as it starts.) Fork a process that waits, and
    make multiprocessing's first spawn of a process (the run's generator: `python -c "from
    multiprocessing.spawn import spawn_main; spawn_main(...)"` with the descriptors it passes) that waiting
    process instead of a fresh interpreter, which would spend about 4 s of a core importing torch, its inductor
    config and transformers' model classes again. The waiting process is the run's own child (its pid,
    waitpid, getppid and PR_SET_PDEATHSIG are what a spawned one's are); it gets the descriptors at the numbers
    they have here, and this process's environment and working directory at the spawn, and runs spawn_main
    as `python -c` would. A spawn that is not spawn_main's (the resource tracker's) goes as it would, and so
    does the first spawn_main when this process's environment has come to differ from the one it started with
    in a variable the preloaded libraries read at import (the waiting process then ends). The waiting process
    ends too when this one ends without spawning."""
    import socket
    from multiprocessing import util

    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    waiting = os.fork()
    if waiting == 0:
        here.close()
        _wait_to_be_spawned(there, parent)  # ends this process: never returns
    there.close()
    start = dict(os.environ)
    plain = util.spawnv_passfds
    ends: list = [here]

    def spawnv_passfds(path, args, passfds):
        prog = args[args.index("-c") + 1] if "-c" in args[:-1] else ""
        if not ends or not prog.startswith(SPAWN_MAIN):
            return plain(path, args, passfds)
        conn = ends.pop()
        with conn:
            differs = preloaded_env_differs(dict(os.environ), start, None, prefixes(preloaded))
            if set(differs) <= set(REAPPLIED):
                fds = sorted({int(fd) for fd in passfds})
                head = {"prog": prog, "argv": args[args.index("-c") + 2 :], "fds": fds, "env": dict(os.environ), "cwd": os.getcwd(),
                        "reapply": differs}
                try:
                    socket.send_fds(conn, [json.dumps(head).encode()], fds[:MAX_FDS])
                    for at in range(MAX_FDS, len(fds), MAX_FDS):
                        socket.send_fds(conn, [b"+"], fds[at : at + MAX_FDS])
                    return waiting
                except OSError:  # it has gone (killed with the test's process group): spawn as usual
                    pass
        return plain(path, args, passfds)

    util.spawnv_passfds = spawnv_passfds


# Variables that verlj's CLI sets for itself as it starts (cli.common.quiet_libraries), which a process it spawns
# inherits and reads as it imports transformers and huggingface_hub: the waiting process, whose modules were
# imported without them, applies them as those imports would have (_reapply).
REAPPLIED = ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")


def _reapply(names: list[str]) -> None:
    """What importing transformers and huggingface_hub makes of REAPPLIED's variables `names` as os.environ has them
    now: transformers' logging level, and huggingface_hub's HF_HUB_DISABLE_PROGRESS_BARS (in every module that
    copied it at import; read from their dictionaries, as an attribute of transformers' lazy modules imports)."""
    if "TRANSFORMERS_VERBOSITY" in names:
        from transformers.utils import logging as transformers_logging

        transformers_logging._get_library_root_logger().setLevel(transformers_logging._get_default_logging_level())
    if "HF_HUB_DISABLE_PROGRESS_BARS" in names:
        from huggingface_hub import constants

        raw = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
        value = None if raw is None else constants._is_true(raw)
        for name, module in list(sys.modules.items()):
            if name.startswith(("huggingface_hub", "transformers")) and "HF_HUB_DISABLE_PROGRESS_BARS" in getattr(module, "__dict__", {}):
                module.HF_HUB_DISABLE_PROGRESS_BARS = value


def _wait_to_be_spawned(conn, parent: int) -> None:
    """(The waiting process.) Become the process multiprocessing spawns (see _spawn_from_waiting), or end
    (os._exit) when the run ends or spawns otherwise. Ends by raising SystemExit, as `python -c` ends."""
    import ctypes
    import fcntl
    import signal
    import socket
    import types

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the run, as its generator would
    if os.getppid() != parent:  # the run died before that took hold
        os._exit(0)
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 253)
        if not data:
            os._exit(0)
        head = json.loads(data)
        while len(fds) < len(head["fds"]):
            more, got, _, _ = socket.recv_fds(conn, 1, 253)
            if not more:
                os._exit(1)
            fds += got
    except OSError:
        os._exit(1)
    base = max([*head["fds"], *fds, conn.fileno()]) + 1  # above every number in use or wanted
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, base) for fd in fds]
    for fd in fds:
        os.close(fd)
    conn.close()
    for target, fd in zip(head["fds"], high):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(head["env"])
    _reapply(head["reapply"])
    os.chdir(head["cwd"])
    sys.argv = ["-c", *head["argv"]]
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    exec(compile(head["prog"], "<string>", "exec"), main.__dict__)
    sys.exit(0)


def _restream_handlers(was: dict[int, int]) -> None:
    """The logging handlers the preloaded libraries made at import (DeepSpeed's logger writes to the sys.stdout of
    then, transformers' to its sys.stderr) write to the streams that replaced those (`was`: the old streams' ids,
    and the descriptor each wrote to), as they would had they been made in this process."""
    import logging

    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and id(h.stream) in was:
                h.setStream(sys.stdout if was[id(h.stream)] == 1 else sys.stderr)


def main() -> None:
    import gc
    import socket

    path = sys.argv[1]
    start_env = dict(os.environ)
    _preload(vllm=sys.argv[2:] == ["vllm"])
    set_by_imports = {k: v for k, v in os.environ.items() if k not in start_env}  # TORCHINDUCTOR_CACHE_DIR: a fresh process's imports set them too
    base_path = sys.path[1:]  # without this file's folder (sys.path[0])
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    preloaded = sorted({name.partition(".")[0] for name in sys.modules})
    gc.collect()
    gc.freeze()
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
            what = req.get("module") or req["script"]
            declined = preloaded_env_differs(req["env"], start_env, set_by_imports, prefixes(preloaded)) + \
                shadows_preloaded(req["env"], set(preloaded))
            if declined:
                print(f"declined {what}: {declined}", file=sys.stderr, flush=True)
                conn.sendall(json.dumps({"declined": declined}).encode() + b"\n")
                os._exit(0)
            child = os.fork()
        except BaseException:  # noqa: BLE001 - the client sees the connection close without a pid
            os._exit(1)
        if child == 0:
            conn.close()
            _become(req, fds, base_path, set_by_imports, preloaded)  # raises SystemExit out of main(): this process ends as the interpreter would
        for fd in fds:
            os.close(fd)
        print(f"forked {what} {child}", file=sys.stderr, flush=True)  # the log tests read
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
