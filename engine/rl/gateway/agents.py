"""Agent programs, as the gateway runs them: what an agent is given (:class:`AgentEpisode`), loading one
(``rollout.agent``), a command's process (:class:`CommandAgent`), the event loop every ``async def`` agent
runs on (:func:`agent_loop`), and each episode's own output tagged with its name (:class:`Tagged`).

An agent is ``rollout.agent=module:function`` (a plain or ``async def`` function of one :class:`AgentEpisode`,
returning the episode's reward or None), ``rollout.agent=verifiers:TASKSET`` (a verifiers taskset played by its harness:
``gateway.verifiers_agent``) or ``rollout.agent=cmd:COMMAND`` (a program in any language:
``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``VERLJ_MODEL``, ``VERLJ_ROW`` (JSON), ``VERLJ_SEED``,
``VERLJ_MAX_TURNS``, ``VERLJ_EPISODE``, ``VERLJ_ATTEMPT`` and ``VERLJ_MCP_URL`` (rollout.tools) in its environment, its reward the last line it
prints; ``None`` or nothing: rollout.reward_fn scores).

**One event loop.** Every ``async def`` agent runs as a task on one event loop, in one thread, that lives as long
as the process (the gateway's HTTP server has a loop of its own, likewise: ``gateway.server``). An agent that makes
its own ``AsyncOpenAI`` or ``httpx.AsyncClient`` per episode and never closes it (the openai and Agents SDK docs'
pattern) leaves the client to the garbage collector, which closes it on whatever loop is running in the thread
that collects it; the loops never close, so the close succeeds. (Each agent on a loop of its own, closed when it
returned, made every such close fail later: ``Task exception was never retrieved ... RuntimeError: Event loop is
closed``.) The agents' loop is shared: an ``async def`` agent that blocks it (a sync client, ``time.sleep``) delays
the others (a blocking agent is better a plain function: it runs in a thread of its own). What an agent leaves
running when it returns (tasks it made) is cancelled, as ``asyncio.run`` would; a hung ``async def`` agent is
cancelled when its episode ends.

**Its output.** What an agent prints (stdout, stderr) and logs reaches the user once, each line tagged with
its episode (``[episode 37] ...``; ``[episode 37, attempt 2]`` for a re-run after a crash): a command's output
as it exits (its last line is its reward), a function's as it writes, through :class:`Tagged`, installed while
the gateway serves.
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging
import os
import shlex
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ...config import ConfigError
from ...plugins import check_signature, import_object

KEY = "rollout.agent"


@dataclass(frozen=True)
class AgentEpisode:
    """What an agent is given: where the model is (``base_url`` ends in /v1), its episode's secret
    ``api_key``, the ``model`` name to send, the dataset ``row`` (a dict), its ``seed`` and ``max_turns``,
    its identity: ``episode`` (the id of the sample it becomes) and ``attempt`` (1; 2, 3, ... when it is run
    again after a crash), and ``mcp_url``: rollout.tools served over MCP (``gateway.tools``; "" without). The gateway sends
    the episode and attempt back with every answer (headers ``x-verlj-episode``, ``x-verlj-attempt``)."""

    base_url: str
    api_key: str
    model: str
    row: dict
    seed: int
    max_turns: int
    episode: int = 0
    attempt: int = 1
    mcp_url: str = ""  # rollout.tools: the tools served over MCP (streamable HTTP, `api_key` as its bearer token); "" none


Agent = Callable[[AgentEpisode], object]


def load_agent(spec: str) -> Agent:
    """The agent rollout.agent names, or one ConfigError."""
    if spec.startswith("cmd:"):
        cmd = spec[4:].strip()
        if not cmd:
            raise ConfigError(f"{KEY}: {spec!r} names no command")
        return CommandAgent(cmd)
    if spec.startswith("verifiers:"):  # a verifiers taskset, played by its harness (gateway.verifiers_agent)
        from .verifiers_agent import load_verifiers_agent

        return load_verifiers_agent(spec.removeprefix("verifiers:"))
    module, _, attr = spec.partition(":")
    fn = import_object(spec, module, attr, KEY, ConfigError)
    if not callable(fn):
        raise ConfigError(f"{KEY}: {spec!r} is not a function")
    check_signature(fn, 1, f"{KEY}: {spec} (called as fn(episode))", ConfigError)
    return fn


@dataclass
class CommandAgent:
    """rollout.agent=cmd:COMMAND: the command run once an episode, its reward its last line of output; the lines
    before it and its stderr are the episode's own output (tagged)."""

    cmd: str
    procs: dict = field(default_factory=dict)  # api key -> the running process (killed when its episode ends)

    def __call__(self, ep: AgentEpisode) -> float | None:
        env = {**os.environ, "OPENAI_BASE_URL": ep.base_url, "OPENAI_API_KEY": ep.api_key, "VERLJ_MODEL": ep.model,
               "VERLJ_ROW": json.dumps(ep.row, default=str), "VERLJ_SEED": str(ep.seed), "VERLJ_MAX_TURNS": str(ep.max_turns),
               "VERLJ_EPISODE": str(ep.episode), "VERLJ_ATTEMPT": str(ep.attempt), "VERLJ_MCP_URL": ep.mcp_url}
        proc = subprocess.Popen(shlex.split(self.cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs[ep.api_key] = proc
        try:
            out, err = proc.communicate()
        finally:
            self.procs.pop(ep.api_key, None)
        lines = out.strip("\n").splitlines()
        said = [*lines[:-1], *err.splitlines()] if not proc.returncode else [*lines, *err.splitlines()[:-1]]
        if said:
            sys.stderr.write("".join(line + "\n" for line in said))
        if proc.returncode:
            tail = (err.strip().splitlines() or [""])[-1][:200]
            raise RuntimeError(f"command exited {proc.returncode}" + (f": {tail}" if tail else ""))
        last = lines[-1].strip() if lines else ""
        return None if last in ("", "None", "null") else float(last)

    def kill(self, key: str) -> None:
        proc = self.procs.get(key)
        if proc is not None and proc.poll() is None:
            proc.kill()


# ----------------------------------------------------------------------------- the agents' event loop

_LOOPS: dict[str, asyncio.AbstractEventLoop] = {}
_LOOPS_LOCK = threading.Lock()
_SPAWNED: dict[str, weakref.WeakSet] = {}  # an episode's tag -> the tasks its agent's code made (cancelled when it ends)


def _loop(name: str) -> asyncio.AbstractEventLoop:
    """The process's event loop `name` (uvloop when installed), running in a daemon thread of its own from its first
    use to the process's end."""
    with _LOOPS_LOCK:
        loop = _LOOPS.get(name)
        if loop is None:
            try:
                import uvloop

                loop = uvloop.new_event_loop()
            except ImportError:
                loop = asyncio.new_event_loop()
            loop.set_task_factory(_task)
            threading.Thread(target=loop.run_forever, name=f"verlj-{name}", daemon=True).start()
            _LOOPS[name] = loop
        return loop


def agent_loop() -> asyncio.AbstractEventLoop:
    """The one event loop every ``async def`` agent runs on (what it cannot hand to anyone is said in one line:
    ``gateway.server.unhandled``)."""
    return _loop("agents")


def tools_loop() -> asyncio.AbstractEventLoop:
    """Where the sessions with rollout.tools' MCP servers are held (``gateway.tools.Upstream``): a loop apart from the
    agents' and the server's, so that neither can block a forwarded call."""
    return _loop("tools")


def server_loop() -> asyncio.AbstractEventLoop:
    """The gateway's HTTP server's loop: a loop apart, so that an agent that blocks its own loop (a sync client in
    an ``async def``) still gets its answers."""
    return _loop("gateway")


def _task(loop: asyncio.AbstractEventLoop, coro: Any, context: contextvars.Context | None = None, **kw: Any) -> asyncio.Task:
    """The loops' task factory: a task made in an agent's code (its episode's tag in its context) is noted, so that
    what the agent leaves running when it returns is cancelled (as asyncio.run would), not left on the shared loop."""
    task = asyncio.Task(coro, loop=loop, context=context, **kw)
    tag = (context or contextvars.copy_context()).get(EPISODE, "")
    if tag:
        _SPAWNED.setdefault(tag, weakref.WeakSet()).add(task)
    return task


def cancel_spawned(tag: str) -> None:
    """Cancel the tasks an episode's agent made that are still running (on their loop's thread)."""
    for task in list(_SPAWNED.pop(tag, ())):
        if not task.done():
            task.get_loop().call_soon_threadsafe(task.cancel)


def start_async(awaitable: Any) -> Future:
    """An agent's coroutine (or any awaitable) started as a task on the agents' loop, in the calling thread's context
    (so with its episode's tag): the future to wait on; cancelling it cancels the task."""
    return asyncio.run_coroutine_threadsafe(awaitable if asyncio.iscoroutine(awaitable) else _awaited(awaitable), agent_loop())


async def _awaited(x: Any) -> object:
    return await x


# ----------------------------------------------------------------------------- the agents' output

EPISODE: contextvars.ContextVar[str] = contextvars.ContextVar("verlj_episode", default="")


class Tagged(io.TextIOBase):
    """A stream that writes each whole line an agent's code writes (the episode named in :data:`EPISODE`, set in
    its thread or task) tagged ``[TAG] line`` to the stream it wraps, at once and whole; what anything else
    writes passes through untouched."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.lock = threading.Lock()
        self.partial: dict[str, str] = {}  # an episode's line not yet ended

    def write(self, s: str) -> int:
        tag = EPISODE.get()
        if not tag:
            return self.inner.write(s)
        with self.lock:  # only the partial lines under the lock: the write below may come back here (a console's proxy)
            text = self.partial.pop(tag, "") + s
            *lines, rest = text.split("\n")
            if rest:
                self.partial[tag] = rest
        if lines:
            self.inner.write("".join(f"[{tag}] {line}\n" for line in lines))
            self.inner.flush()
        return len(s)

    def end(self, tag: str) -> None:
        """The episode is over: what it wrote without a line break, as a line."""
        with self.lock:
            rest = self.partial.pop(tag, "")
        if rest:
            self.inner.write(f"[{tag}] {rest}\n")
            self.inner.flush()

    def flush(self) -> None:
        self.inner.flush()

    def isatty(self) -> bool:
        return bool(getattr(self.inner, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self.inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.inner, "encoding", "utf-8")

    def __getattr__(self, name: str) -> Any:
        """Whatever else the wrapped stream has (``buffer``, ``name``; rich's ``rich_proxied_file``, by which a progress
        bar's console finds the real stream instead of writing back through this one)."""
        return getattr(self.inner, name)


class _EpisodeFilter(logging.Filter):
    """A log record made in an agent's code: its message tagged with the episode, for the handlers the logging
    configuration made before the agents' streams were tagged."""

    def filter(self, record: logging.LogRecord) -> bool:
        tag = EPISODE.get()
        if tag and not getattr(record, "verlj_tagged", False):
            record.msg, record.verlj_tagged = f"[{tag}] {record.msg}", True
        return True


class AgentOutput:
    """While the gateway serves: sys.stdout and sys.stderr tagged (:class:`Tagged`; one stream when they are one),
    and the root logger's handlers tag what agents log. `close` puts everything back."""

    def __init__(self) -> None:
        self.was = (sys.stdout, sys.stderr)
        self.err = Tagged(sys.stderr)
        self.out = self.err if sys.stdout is sys.stderr else Tagged(sys.stdout)
        sys.stdout, sys.stderr = self.out, self.err  # type: ignore[assignment]
        self.filter = _EpisodeFilter()
        self.handlers = list(logging.getLogger().handlers)  # none: logging's last resort writes to sys.stderr (tagged)
        for h in self.handlers:
            h.addFilter(self.filter)

    def end(self, tag: str) -> None:
        self.out.end(tag)
        if self.err is not self.out:
            self.err.end(tag)

    def close(self) -> None:
        """Each stream put back that is still this one's (one replaced meanwhile, e.g. by a redirect, is left alone)."""
        if sys.stdout is self.out:
            sys.stdout = self.was[0]
        if sys.stderr is self.err:
            sys.stderr = self.was[1]
        for h in self.handlers:
            h.removeFilter(self.filter)

