"""`verlj train --launcher ray --nproc N`: the trainer's N ranks as Ray actors, one bundle each of a placement group.

    verlj train --launcher ray --nproc 2 -o runs/dp2                        # no cluster named: a local one, started and stopped here
    ray start --head   # then on each other node: ray start --address=HEAD_IP:6379
    RAY_ADDRESS=HEAD_IP:6379 verlj train --launcher ray --nproc 16 -o /shared/runs/big distributed.placement=spread
    verlj train --launcher ray --nproc 2 -o runs/dp2 trainer.max_restarts=3  # a dead rank: all stop, the run resumes by itself

Each actor runs the very `verlj train` a rank under torchrun runs (train_cmd.train, in the actor's own
process and main thread), with RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT set: rank 0's actor's node
IP and a port free there; torch.distributed starts as it does under torchrun (gloo on CPU). Rank 0 writes
the journal, as everywhere. What the ranks print reaches this process through Ray's log forwarding, each
line prefixed `(verlj rank R pid=P)`. The actors get this process's VERLJ_*, OMP_*, HF_*, … variables and
its working directory when their node has it (relative paths in the command are made absolute here).

An attempt ends when every rank has returned its exit status, or at once when one rank's actor dies (its
process killed, its node lost; Ray reports no signal or status for it: exit status 1): the other ranks'
actors are killed, their processes waited for (the next rank 0 takes the run's writer claim over from a
process that is gone) and the placement group removed. With trainer.max_restarts=R a new attempt starts
with --resume, by the restart policy every launcher shares (supervise.restart_or_end). SIGINT, SIGTERM and
SIGHUP here are passed on to every rank's process, each time (on its node, by a task that needs no CPU), and
the ranks stop as they always do; a stopped run is not restarted.

Ray is imported only here: ``ray.init(address=...)`` when RAY_ADDRESS or distributed.ray_address names a
cluster, else a local cluster this process starts and stops (as the rollout fleet does, engine/rl/fleet.py).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import typer

from verlj.engine.errors import install_hint

from .common import EXIT_USAGE, fail, guarded
from .supervise import SUPERVISED, Forwarded, exit_status, restart_or_end

PLACE_TIMEOUT_S = 600.0  # for the placement group (an autoscaling cluster may add nodes meanwhile)
PLACE_WAIT_SAID_S = 30.0  # after this, one line says what the launcher waits for
START_TIMEOUT_S = 600.0  # for the actors to start (a fresh worker process each)
GONE_TIMEOUT_S = 60.0  # for a killed rank's process to be gone
PEER_GRACE_S = 30.0  # after one rank ended with a failure, for the others to end by themselves
WAIT_S = 0.5
LOG_FLUSH_S = 1.0  # Ray forwards what the ranks print asynchronously: their last lines, before this process disconnects
LOST = 1  # the exit status of an attempt ended by a rank's actor dying
PASS_ENV = ("VERLJ_", "OMP_", "MKL_", "PYTHONHASHSEED", "PYTHONPATH", "TOKENIZERS_", "TRANSFORMERS_", "HF_", "DS_", "NCCL_",
            "GLOO_", "CUBLAS_", "WANDB_", "TORCH_")


def say(line: str) -> None:
    typer.echo(f"verlj: {line}", err=True)


class RankActor:
    """One rank of the trainer (a Ray actor: ``ray.remote`` is applied where the launcher starts)."""

    def __init__(self, rank: int, cwd: str):
        self.rank = rank
        if os.path.isdir(cwd):  # user code the config names (rollout.reward_fn) is imported from there
            os.chdir(cwd)

    def __repr__(self) -> str:  # Ray's prefix for the lines this actor prints
        return f"verlj rank {self.rank}"

    def where(self) -> dict:
        import ray

        return {"pid": os.getpid(), "ip": ray.util.get_node_ip_address(), "node": ray.get_runtime_context().get_node_id(),
                "gpus": len(ray.get_gpu_ids())}

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def train(self, env: dict, kwargs: dict, train: Callable[..., None]) -> int:
        """`verlj train` as this rank: its exit status. `train`: the command's function (cli.train_cmd.train,
        handed down by the command that launched, so this module does not import it back)."""
        os.environ.update(env)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])  # Ray blocks it in its workers: a passed-on Ctrl-C stops the rank as it stops a process
        try:
            train(**kwargs)
            code = 0
        except typer.Exit as e:
            code = e.exit_code
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if code == 0:  # after a failure a peer may still sit in a collective: the actor is killed instead (cli/main.py)
            from verlj.engine.dist import teardown

            teardown()
        return code


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        time.sleep(0.1)
    return False


def launch(output_dir: Path, config: Path | None, overrides: list[str], resume: bool, allow_config_change: bool,
           nproc: int, restarts: int, train: Callable[..., None]) -> int:
    """Train on `nproc` ranks placed by Ray, restarting them with --resume at most `restarts` times;
    each rank calls `train` (the `verlj train` command's function). Returns the exit status to end with."""
    from verlj.engine.config import launch_asked

    placement, address = guarded(lambda: launch_asked(config, overrides))
    try:
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # rank 0's lines are its own, never "repeated across cluster"
        if not sys.stderr.isatty():
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        import ray
    except ImportError:
        raise fail(f"--launcher ray needs ray: {install_hint('ray')}", EXIT_USAGE) from None
    output_dir = output_dir.absolute()
    config = config.absolute() if config is not None else None
    if not resume:  # bad input is refused here in one line, before anything is placed (a resume's ranks check theirs)
        from verlj.engine.loop.run import check_start
        from verlj.engine.rl.fleet import check_ranks

        cfg = guarded(lambda: check_start(output_dir, config, overrides, False, allow_config_change))[1]
        guarded(lambda: check_ranks(cfg, nproc))
    address = os.environ.get("RAY_ADDRESS") or address
    try:
        if address:
            ray.init(address=address, logging_level="ERROR", log_to_driver=True)
        else:
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, nproc), include_dashboard=False, logging_level="ERROR",
                     log_to_driver=True)
    except Exception as e:  # noqa: BLE001 - one sentence: the cluster is not there or not usable
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise fail(f"--launcher ray could not start or join {where}: {type(e).__name__}: "
                   f"{str(e).splitlines()[0] if str(e) else ''}") from None
    from verlj.engine.rl.reaper import Reaper, session_dir

    reaper = None if address else Reaper(session_dir())  # a SIGKILL of this process leaves no Ray process behind
    try:
        return _run(ray, output_dir, config, overrides, resume, allow_config_change, nproc, restarts, placement, train)
    finally:
        time.sleep(LOG_FLUSH_S)
        ray.shutdown()  # a local cluster stops; a cluster joined is left
        if reaper is not None:
            reaper.stop()


def _run(ray, output_dir, config, overrides, resume, allow_config_change, nproc, restarts, placement, train) -> int:
    bundle = {"CPU": 1.0, **({"GPU": 1.0} if ray.cluster_resources().get("GPU", 0) >= 1 else {})}
    env = {k: v for k, v in os.environ.items() if k.startswith(PASS_ENV)}
    env[SUPERVISED] = "1"  # a rank trains, never supervises (trainer.max_restarts is this process's)
    attempt = Attempt(ray, nproc, bundle, placement.upper(), env, train)
    signals = Forwarded(attempt.signal)
    restarted = 0
    while True:
        kwargs = {"output_dir": output_dir, "overrides": list(overrides), "config": config, "resume": resume,
                  "allow_config_change": allow_config_change}
        code, ended = attempt.run(kwargs, restarted, restarts)
        if not restart_or_end(ended, code, signals.stopping, restarted, restarts, say, again="the ranks"):
            return exit_status(code)
        restarted += 1
        resume = True


class Attempt:
    """The ranks of one attempt: a placement group, an actor per bundle, `verlj train` in each."""

    def __init__(self, ray, n: int, bundle: dict, strategy: str, env: dict, train: Callable[..., None]):
        self.ray, self.n, self.bundle, self.strategy, self.env, self.train = ray, n, bundle, strategy, env, train
        self.where: list[dict] = []
        self.stopped = False

    def signal(self, signum: int) -> None:
        """Pass a signal on to every rank's process, on its node (ranks not training yet never start to)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.stopped = True
        task = self.ray.remote(_signal)
        for w in self.where:
            task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(w["node"], soft=False)).remote(w["pid"], signum)

    def run(self, kwargs: dict, restarted: int, restarts: int) -> tuple[int, str]:
        """(the attempt's exit status, how it ended in words): rank 0's status, else the first failure's."""
        ray = self.ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = placement_group([dict(self.bundle) for _ in range(self.n)], strategy=self.strategy)
        actors: list = []
        self.where = []
        try:
            self._place(pg)
            remote = ray.remote(RankActor)
            actors = [remote.options(num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0), max_restarts=0,
                                     max_task_retries=0, runtime_env={"env_vars": self.env},
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
                                     ).remote(r, os.getcwd()) for r in range(self.n)]
            try:
                self.where = ray.get([a.where.remote() for a in actors], timeout=START_TIMEOUT_S)
                port = ray.get(actors[0].free_port.remote(), timeout=START_TIMEOUT_S)
            except RayActorError as e:
                return LOST, f"a rank's actor died as it started ({_cause(e)})"
            except GetTimeoutError:
                raise fail(f"the {self.n} rank actors did not all start within {START_TIMEOUT_S:.0f} s") from None
            except RayError as e:  # their runtime environment, say: one sentence, not Ray's traceback
                raise fail(f"the rank actors could not start: {_cause(e)}") from None
            say(f"training on {self.n} ranks (" + ", ".join(f"rank {r} in process {w['pid']} on {w['ip']}" for r, w in enumerate(self.where))
                + (f"; restart {restarted} of {restarts})" if restarted else
                   f"; restarted with --resume if one dies, at most {restarts} times)" if restarts else ")"))
            if self.stopped:
                return 130, "stopped before the ranks trained"
            refs = {}
            for r, a in enumerate(actors):
                local = 0 if self.where[r]["gpus"] else sum(w["node"] == self.where[r]["node"] for w in self.where[:r])
                rank_env = {"RANK": str(r), "WORLD_SIZE": str(self.n), "LOCAL_RANK": str(local),
                            "MASTER_ADDR": self.where[0]["ip"], "MASTER_PORT": str(port)}
                refs[a.train.remote(rank_env, kwargs, self.train)] = r
            codes: dict[int, int] = {}
            grace: float | None = None
            while refs and (grace is None or time.monotonic() < grace):
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=WAIT_S)
                for ref in ready:
                    r = refs.pop(ref)
                    try:
                        codes[r] = ray.get(ref)
                    except RayActorError:
                        w = self.where[r]
                        return LOST, f"rank {r}'s actor (process {w['pid']} on {w['ip']}) died"
                    except RayTaskError as e:
                        say(f"rank {r} failed: {_cause(e)}")
                        codes[r] = 1
                if grace is None and any(codes.values()):  # as torchrun: one rank's failure ends the others
                    grace = time.monotonic() + PEER_GRACE_S
            code = codes.get(0) or next((c for c in codes.values() if c), 0) or (LOST if refs else 0)
            return code, f"the ranks exited with code {code}"
        finally:
            self._end(actors, pg, remove_placement_group)

    def _place(self, pg) -> None:
        start, said, ready = time.monotonic(), False, pg.ready()
        while not self.ray.wait([ready], timeout=WAIT_S * 4)[0]:
            waited = time.monotonic() - start
            if waited > PLACE_TIMEOUT_S:
                raise fail(f"the Ray cluster did not place {self.n} bundles of {self.bundle} ({self.strategy.lower()}) within "
                           f"{PLACE_TIMEOUT_S:.0f} s; it has {self.ray.cluster_resources()}")
            if waited > PLACE_WAIT_SAID_S and not said:
                said = True
                say(f"waiting for the Ray cluster to place {self.n} bundles of {self.bundle} (distributed.placement="
                    f"{self.strategy.lower()}); it has {self.ray.cluster_resources()}")

    def _end(self, actors: list, pg, remove_placement_group) -> None:
        """Kill the actors, wait until their processes are gone (a rank 0 still alive would keep the run's writer
        claim from the next attempt), remove the placement group."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for a in actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        gone = self.ray.remote(_gone)
        waits = [gone.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(w["node"], soft=False)).remote(w["pid"], GONE_TIMEOUT_S)
                 for w in self.where]
        if waits:
            self.ray.wait(waits, num_returns=len(waits), timeout=GONE_TIMEOUT_S + 10)
        remove_placement_group(pg)
        self.where = []


def _cause(e) -> str:
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"
