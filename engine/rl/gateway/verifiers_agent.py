"""verifiers tasksets as rollouts: ``rollout.agent=verifiers:TASKSET`` with ``data.train_dataset=verifiers:TASKSET``.

    verlj train --config examples/verifiers_taskset.yaml -o runs/verifiers

A taskset of Prime Intellect's verifiers (0.4, ``verifiers.v1``) is played as an agent program: each episode is
``SingleAgentEnv.run_episode(task, ModelContext(model, EvalClientConfig(base_url=the gateway)))``, so the taskset's
harness talks to verifiers' interception server, which relays every model call to verlj's gateway (spliced,
generated from its own seed and journaled as any agent's call). The task's ``@vf.reward`` functions score the
episode: the sample's reward is the trace's (the weighted sum), each named reward a metric (``reward/verifiers/NAME``,
summed over the episodes the step played: ``sources.agent_players``).

TASKSET is a verifiers taskset id: an importable module exporting one ``vf.Taskset`` subclass in ``__all__``
(verifiers' own convention, ``--env.taskset.id``; a dotted path such as ``examples.verifiers_taskset`` works), or
``MODULE:CLASS``. Its tasks are the dataset's rows, in ``load()`` order: a row's prompt is the task's prompt text,
its answer the task's key (``Task.key``, unique in a taskset), by which an episode finds its task.

The runtime is verifiers' ``subprocess`` (no sandbox, no network): the harness a taskset's module exports, else
:class:`OfflineChat`, verifiers' own chat program (the ``null`` harness's) run by this interpreter instead of a ``uv``
environment that would be fetched from the network.

An episode that did not end ``ok`` (its harness or a reward raised, a timeout) raises its first error: a fault,
never trained.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import os
import sys
import threading
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from ...config import ConfigError
from ...errors import install_hint
from ...plugins import import_object

if TYPE_CHECKING:
    from .agents import AgentEpisode

PREFIX = "verifiers:"
KEY = "rollout.agent"


def require_verifiers(key: str) -> Any:
    """verifiers.v1, or one ConfigError naming the extra that installs it."""
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError(f"{key}=verifiers:... needs the verifiers package, in a venv of its own (it pins openai<3, which the "
                          f"agent and dev extras' openai-agents refuses): {install_hint('verifiers')}") from None
    return vf


def taskset_class(spec: str, key: str) -> type:
    """The vf.Taskset subclass `spec` (after ``verifiers:``) names: MODULE:CLASS, or a module (or verifiers taskset id)
    exporting exactly one in ``__all__``; else one ConfigError."""
    vf = require_verifiers(key)
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        cls = import_object(spec, module_name, attr, key, ConfigError)
        if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
            raise ConfigError(f"{key}: verifiers:{spec} is not a verifiers Taskset class (a vf.Taskset subclass)")
        return cls
    module_name = spec.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_")  # a hub id names its module as verifiers does
    if not module_name:
        raise ConfigError(f"{key}: {PREFIX}{spec!r} names no taskset (verifiers:MODULE or verifiers:MODULE:CLASS)")
    import_object(spec, module_name, "__name__", key, ConfigError)  # its import errors as one line
    module = importlib.import_module(module_name)
    found = [obj for name in getattr(module, "__all__", ()) if isinstance(obj := getattr(module, name, None), type)
             and issubclass(obj, vf.Taskset) and obj is not vf.Taskset]
    if len(found) != 1:
        raise ConfigError(f"{key}: module {module_name!r} must export exactly one vf.Taskset subclass in __all__ "
                          f"(found {len(found)}); or name it: verifiers:{module_name}:CLASS")
    return found[0]


def tasks_of(cls: type) -> list:
    """The taskset's tasks in load() order (each its `idx`), under its default config."""
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.utils.generic import concrete_type

    taskset = cls((concrete_type(cls, TasksetConfig) or TasksetConfig)())
    if not taskset.bounded:
        raise ConfigError(f"data.train_dataset: the verifiers taskset {cls.__name__} is infinite (its load() never ends)")
    return list(taskset)


def taskset_rows(spec: str, key: str = "data.train_dataset") -> list[tuple[str, str]]:
    """data.train_dataset=verifiers:TASKSET: each task's (prompt text, key), in load() order. A task without a text
    prompt, or two tasks with one key, is one error."""
    cls = taskset_class(spec, key)
    rows, seen = [], set()
    for task in tasks_of(cls):
        text = task.data.prompt_text
        if task.key in seen:
            raise ConfigError(f"{key}: two tasks of {cls.__name__} have the key {task.key!r} (Task.key must be unique in a taskset)")
        seen.add(task.key)
        rows.append((text, task.key))
    if not rows:
        raise ConfigError(f"{key}: the verifiers taskset {cls.__name__} loads no task")
    return rows


def load_verifiers_agent(spec: str) -> VerifiersAgent:
    """rollout.agent=verifiers:TASKSET (`spec` without the prefix)."""
    return VerifiersAgent(spec, taskset_class(spec, KEY))


def _alias(name: str, exports: Mapping[str, Any]) -> str:
    """A flat module name verifiers' loaders import (they resolve an id as ``verifiers.v1.<group>.<id>`` first, which a
    dotted id breaks), holding `exports` in ``__all__``."""
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__dict__.update({**exports, "__all__": list(exports)})
        sys.modules[name] = module
    return name


class VerifiersAgent:
    """An ``async def``-style agent (called, it returns a coroutine run on the agents' loop): the episode's task played
    by the taskset's env against the gateway, its reward the trace's; its named rewards kept for the round's metrics
    (:meth:`drain`)."""

    def __init__(self, spec: str, cls: type):
        self.spec, self.cls = spec, cls
        self.tasks = {t.key: t for t in tasks_of(cls)}
        self.env: Any = None
        self.ready: asyncio.Future | None = None
        self.held: Any = None  # the env's serving context, entered at the first episode
        self.scored: dict[tuple[int, int], dict[str, float]] = {}  # (episode, attempt) -> its named rewards, until drained
        self.lock = threading.Lock()

    def __call__(self, ep: AgentEpisode) -> Any:
        return self.play(ep)

    async def play(self, ep: AgentEpisode) -> float:
        import verifiers.v1 as vf

        key = str(ep.row["answer"])
        task = self.tasks.get(key)
        if task is None:
            raise ValueError(f"the row's answer {key[:40]!r} is the key of no task of {self.cls.__name__} "
                             f"(data.train_dataset must be {PREFIX}{self.spec})")
        env = await self._serving()
        var = f"VERLJ_API_KEY_{ep.episode}_{ep.attempt}"  # verifiers reads a client's key from the environment by name
        os.environ[var] = ep.api_key
        client = vf.EvalClientConfig(base_url=ep.base_url, api_key_var=var)
        try:
            episode = await env.run_episode(task, vf.ModelContext(model=ep.model, client=client))
        finally:
            os.environ.pop(var, None)
            await self._forget(client)
        if not episode.ok:
            errors = [e for t in episode.traces for e in t.errors] + list(episode.errors)
            said = f"{errors[0].type}: {errors[0].message.splitlines()[0][:200] if errors[0].message else ''}" if errors else "not ok"
            raise RuntimeError(f"the verifiers episode failed: {said}")
        if not any(t.calls for t in episode.traces):  # (the runner's fault too; said here, before it is scored)
            raise RuntimeError("the verifiers episode made no model call")
        rewards: dict[str, float] = {}
        for trace in episode.traces:
            for name, r in trace.rewards.items():
                if r is None:
                    raise RuntimeError(f"the verifiers reward {name!r} did not run")
                rewards[name] = rewards.get(name, 0.0) + float(r.score)
        with self.lock:
            self.scored[(ep.episode, ep.attempt)] = rewards
        return float(sum(t.reward for t in episode.traces))

    async def _forget(self, client: Any) -> None:
        """Close the episode's client, which verifiers' interception servers keep, one per distinct client config, until
        they stop (here: the process's end): an episode's key makes its config one of its own, so each would stay."""
        interception = self.env._interception  # verifiers 0.4: a pool of servers (elastic, static) or a server
        key = client.model_dump_json()
        for server in getattr(interception, "servers", None) or [interception]:
            held = server.clients.pop(key, None)
            if held is not None:
                await held.close()  # (closed again by the server's stack when it stops: httpx allows it)

    def drain(self) -> list[dict[str, float]]:
        """The named rewards of the episodes scored since the last drain (each episode's once)."""
        with self.lock:
            out, self.scored = list(self.scored.values()), {}
        return out

    async def _serving(self) -> Any:
        """The env, serving (verifiers' interception server and shared tools) from the first episode to the process's
        end, on the agents' loop."""
        if self.ready is None:
            self.ready = asyncio.get_running_loop().create_future()
            try:
                self.env = self._make_env()
                held = self.env.serving()
                await held.__aenter__()
                self.held = held
            except BaseException as e:
                self.ready.set_exception(e)
                raise
            self.ready.set_result(self.env)
        return await asyncio.shield(self.ready)

    def _make_env(self) -> Any:
        from verifiers.v1.envs.single_agent import SingleAgentEnv, SingleAgentEnvConfig

        module = sys.modules[self.cls.__module__]
        exported = [getattr(module, n, None) for n in getattr(module, "__all__", ())]
        own = [h for h in exported if isinstance(h, type) and issubclass(h, _harness_base()) and h is not _harness_base()]
        tag = self.cls.__module__.replace(".", "_")
        ts = _alias(f"verlj_verifiers_taskset_{tag}_{self.cls.__name__}".lower(), {self.cls.__name__: self.cls, **{h.__name__: h for h in own}})
        # the taskset brings no harness: verifiers' chat program, offline
        harness = {} if own else {"harness": {"id": _alias("verlj_verifiers_offline_chat", {"OfflineChat": offline_chat_class()})}}
        return SingleAgentEnv(SingleAgentEnvConfig(taskset={"id": ts}, agent={"runtime": {"type": "subprocess"}, **harness}))


def _harness_base() -> type:
    import verifiers.v1 as vf

    return vf.Harness


_OFFLINE: list[type] = []


def offline_chat_class() -> type:
    """:class:`OfflineChat`, made once (its bases are verifiers')."""
    if not _OFFLINE:
        _OFFLINE.append(_make_offline_chat())
    return _OFFLINE[0]


def _make_offline_chat() -> type:
    from verifiers.v1.harnesses.null.harness import NullHarness
    from verifiers.v1.harnesses.utils import launch

    class OfflineChat(NullHarness):
        """verifiers' ``null`` harness (its chat program: the task's prompt, the model's answers, no tools but the
        task's MCP servers) run by this interpreter, which has what the program imports: no ``uv`` environment, no
        network."""

        async def setup(self, runtime: Any) -> None:
            return None

        async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: dict[str, str],
                         data: Any, tool_interception_url: str | None = None) -> Any:
            return await launch.launch_chat_program(
                launch.CHAT_PROGRAM_SOURCE, self.config, ctx, trace, _Interpreter(runtime), endpoint, secret, mcp_urls,
                *self.resolve_prompt(data),
                extra_args=[f"--tool-interception-url={tool_interception_url}"] if tool_interception_url else ())

    return OfflineChat


class _Interpreter:
    """A runtime whose PEP 723 scripts run with this interpreter (what verifiers' `prepare_uv_script` would fetch with
    uv is here already); the rest is the runtime's own. A script is written once a process, whole before any runs it
    (written under a name of its own, then renamed: episodes start together)."""

    written: ClassVar[dict[str, asyncio.Future]] = {}  # the script's path -> done once it is in place

    def __init__(self, runtime: Any):
        self.runtime = runtime

    async def prepare_uv_script(self, script: str | bytes, env: dict[str, str] | None = None, *, activate: bool = True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = f"{self.runtime.scripts_dir}/verlj-{hashlib.sha256(data).hexdigest()}.py"
        done = self.written.get(path)
        if done is None:
            done = self.written[path] = asyncio.get_running_loop().create_future()
            try:
                tmp = f"{path}.{os.getpid()}.tmp"
                await self.runtime.write(tmp, data)
                moved = await self.runtime.run(["mv", "-f", tmp, path], {})
                if moved.exit_code:
                    raise RuntimeError(f"cannot put verifiers' chat program at {path}: {moved.stderr.strip()[:200]}")
                done.set_result(None)
            except BaseException as e:
                del self.written[path]
                done.set_exception(e)
                raise
        await asyncio.shield(done)
        return [sys.executable, path]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)
