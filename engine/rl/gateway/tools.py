"""Tools through the journal (rollout.tools): Python functions the gateway serves to every episode as an MCP server, at
``episode.mcp_url`` (streamable HTTP, the episode's own key as for its model calls), each call journaled like a model call
and never executed twice where its effects are outside the episode.

    rollout:
      agent: my_agents:solve                 # an agent that connects an MCP client to episode.mcp_url
      tools: [my_tools:create_ticket, my_tools:lookup]

    from verlj.engine.rl.gateway.tools import tool

    @tool(effect="external", reconcile=ticket_by_key)   # effects outside the episode: never sent twice
    def create_ticket(title: str, idempotency_key: str) -> str: ...

    @tool(effect="pure")                                 # no effect outside the episode: run again freely
    def lookup(query: str) -> str: ...

What each effect promises (a function without ``@tool`` is ``external``):

- ``pure``: no effect outside the episode. After a crash a call the journal holds is answered from it; one sent and never
  answered (its outcome unknown) is run again.
- ``restorable``: its effects are inside a world verlj rebuilds (as an environment's steps are): run again on a re-run of the
  episode, every time, as the world is rebuilt from its start.
- ``external``: its effects are outside (a ticket, a message, a payment). A call the journal holds is answered from it and
  **not sent**; a call sent before a crash and never answered is an unknown outcome: verlj asks the tool's ``reconcile``
  (``reconcile(key, arguments)`` returns the call's result when it was applied, None when it was not: then it is sent now,
  with the same key), and without one the episode ends **unresolved**: out of the update, counted (``agent/unresolved``),
  its reason naming the call and its key (``verlj inspect --step``) for an operator to check the world.

Every call carries an **idempotency key** stable across attempts (the run, the episode, the call's position): passed to a
function with an ``idempotency_key`` parameter, and returned in the MCP result's ``_meta``. A service that honours keys
makes a re-sent call safe. The way a call is made durable and answered: ``gateway.runner.Play.call_tool``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import json
import sys
import typing
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...config import ConfigError
from ...plugins import import_object

if TYPE_CHECKING:
    from .server import Gateway

KEY = "rollout.tools"
PURE, RESTORABLE, EXTERNAL = "pure", "restorable", "external"
EFFECTS = (PURE, RESTORABLE, EXTERNAL)
KEY_PARAM = "idempotency_key"  # a function with a parameter of this name is given its call's key
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True)
class Tool:
    """A tool as the gateway serves it: its name, function, effect, description, the JSON schema of its arguments, its
    reconcile (None: none) and whether the function is given its idempotency key."""

    name: str
    fn: Callable[..., Any]
    effect: str
    description: str
    schema: dict
    reconcile: Callable[[str, dict], Any] | None
    given_key: bool

    def run(self, arguments: dict, key: str) -> Any:
        """The function called on `arguments` (and its key, when it asks: an MCP server's forward always does), awaited when it
        is ``async def``."""
        out = self.fn(**arguments, **({KEY_PARAM: key} if self.given_key else {}))
        return asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out


async def _awaited(x: Any) -> Any:
    return await x


@dataclass(frozen=True)
class Declared:
    """What ``@tool`` says of a function (a plain function: external, its own name and docstring, no reconcile)."""

    effect: str = EXTERNAL
    name: str | None = None
    description: str | None = None
    reconcile: Callable[[str, dict], Any] | None = None


_DECLARED: weakref.WeakKeyDictionary[Callable, Declared] = weakref.WeakKeyDictionary()  # what @tool said of each function


def tool(fn: Callable | None = None, *, effect: str = EXTERNAL, name: str | None = None, description: str | None = None,
         reconcile: Callable[[str, dict], Any] | None = None) -> Any:
    """Declare a function a tool (``@tool`` or ``@tool(effect=..., reconcile=...)``): its effect (``pure``, ``restorable``,
    ``external``), the name it is served by (default: the function's), its description (default: its docstring) and, for an
    external tool, how to learn whether a call sent before a crash was applied. The function itself is unchanged."""
    if effect not in EFFECTS:
        raise ValueError(f"tool effect {effect!r} is not one of {', '.join(EFFECTS)}")

    def mark(f: Callable) -> Callable:
        _DECLARED[f] = Declared(effect, name, description, reconcile)
        return f

    return mark(fn) if fn is not None else mark


def as_tool(fn: Callable) -> Tool:
    """A function as served: what ``@tool`` said of it (a plain function: external, no reconcile)."""
    said = _DECLARED.get(fn, Declared())
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - a hint that does not resolve is a parameter of any type
        hints = {}
    props, required = {}, []
    for p in sig.parameters.values():
        if p.name == KEY_PARAM or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(typing.get_origin(hints.get(p.name)) or hints.get(p.name))  # type: ignore[arg-type]
        props[p.name] = {"type": kind} if kind else {}
        if p.default is p.empty:
            required.append(p.name)
    return Tool(said.name or fn.__name__, fn, said.effect, said.description or inspect.getdoc(fn) or "",
                {"type": "object", "properties": props, "required": required}, said.reconcile, KEY_PARAM in sig.parameters)


def load_tools(specs: list[str]) -> dict[str, Tool]:
    """The tools rollout.tools names (``module:function`` each), by the name each is served by, or one ConfigError."""
    out: dict[str, Tool] = {}
    for spec in specs:
        module, _, attr = spec.partition(":")
        fn = import_object(spec, module, attr, KEY, ConfigError)
        if not callable(fn):
            raise ConfigError(f"{KEY}: {spec!r} is not a function")
        t = as_tool(fn)
        if t.name in out:
            raise ConfigError(f"{KEY}: two tools are named {t.name!r}; give one another name (@tool(name=...))")
        out[t.name] = t
    return out


# ----------------------------------------------------------------------------- MCP servers of the user's

RECONCILE = "reconcile"  # an MCP server's tool of this name is its reconcile (never served to episodes)


class McpToolError(Exception):
    """An MCP server's tool answered an error: its text."""


class Upstream:
    """An MCP server of the user's (rollout.tools: an ``http(s)://`` URL, or ``cmd:COMMAND`` started over stdio and stopped
    with the gateway): one session held open on an event loop of its own (the ``mcp`` package's ``Client``), its tools
    served to every episode as verlj's own are. A call is forwarded with its idempotency key in the request's ``_meta``
    (``idempotency_key``), and as an argument where the tool's schema asks for one (that parameter hidden from the agent);
    a tool named ``reconcile`` (its argument ``idempotency_key``; it answers the call's result, or nothing (an empty or ``null``
    answer) when no call under that key was applied) is the server's reconcile for every tool it serves."""

    def __init__(self, spec: str, timeout_s: float = 60.0):
        import shlex
        from concurrent.futures import Future

        from mcp import Client, StdioServerParameters

        from .agents import tools_loop

        self.spec, self.timeout_s, self.loop = spec, timeout_s, tools_loop()
        if spec.startswith("cmd:"):
            argv = shlex.split(spec[4:])
            target: Any = StdioServerParameters(command=sys.executable if argv[0] == "python" else argv[0], args=argv[1:])
        else:
            target = spec
        ready: Future = Future()
        self.stop: asyncio.Event | None = None

        async def hold() -> None:
            self.stop = asyncio.Event()
            try:
                async with Client(target) as client:
                    ready.set_result(client)
                    await self.stop.wait()
            except BaseException as e:  # noqa: BLE001 - its connection's failure, said where the tools are loaded
                if not ready.done():
                    ready.set_exception(e)

        asyncio.run_coroutine_threadsafe(hold(), self.loop)
        try:
            self.client = ready.result(timeout=timeout_s)
            listed = self.call(self.client.list_tools()).tools
        except Exception as e:  # noqa: BLE001 - one sentence, never a traceback
            self.close()
            raise ConfigError(f"{KEY}: the MCP server {spec} could not be reached: {_first(e)}") from None
        self.listed = listed

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=self.timeout_s)

    def tools(self, effects: dict[str, str]) -> list[Tool]:
        """Its tools as served (the reconcile not among them), each with the effect rollout.tool_effects gives it (external)."""
        names = {t.name for t in self.listed}
        reconcile = self._reconcile if RECONCILE in names else None
        out = []
        for t in self.listed:
            if t.name == RECONCILE:
                continue
            schema = dict(t.input_schema or {"type": "object"})
            props = dict(schema.get("properties") or {})
            wants = props.pop(KEY_PARAM, None) is not None
            schema = {**schema, "properties": props, "required": [r for r in schema.get("required") or [] if r != KEY_PARAM]}
            out.append(Tool(t.name, self._forward(t.name, wants), effects.get(t.name, EXTERNAL), t.description or "", schema,
                            reconcile, True))
        return out

    def _forward(self, name: str, wants: bool) -> Callable[..., Any]:
        def forward(**arguments: Any) -> str:
            key = arguments.pop(KEY_PARAM)
            got = self.call(self.client.call_tool(name, {**arguments, **({KEY_PARAM: key} if wants else {})}, meta={KEY_PARAM: key}))
            text = "".join(getattr(c, "text", "") for c in got.content)
            if got.is_error:
                raise McpToolError(text)
            return text
        return forward

    def _reconcile(self, key: str, arguments: dict) -> str | None:
        got = self.call(self.client.call_tool(RECONCILE, {KEY_PARAM: key}))
        text = "".join(getattr(c, "text", "") for c in got.content)
        if got.is_error:
            raise McpToolError(text)
        return None if text.strip() in ("", "null") else text

    def close(self) -> None:
        stop = self.stop
        if stop is not None:
            self.loop.call_soon_threadsafe(stop.set)


def _first(e: BaseException) -> str:
    """An exception (a task group's: its first) as one line."""
    while getattr(e, "exceptions", None):
        e = e.exceptions[0]  # type: ignore[attr-defined]
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


@dataclass
class Toolbox:
    """rollout.tools as served: every tool by its name, and the MCP servers they are forwarded to (closed with `close`)."""

    tools: dict[str, Tool]
    servers: list[Upstream]

    def close(self) -> None:
        for s in self.servers:
            s.close()


def open_tools(specs: list[str], effects: dict[str, str] | None = None) -> Toolbox:
    """The tools rollout.tools names: Python functions (``module:function``) and the tools of MCP servers (a URL, or
    ``cmd:COMMAND``), each with its effect (rollout.tool_effects over what ``@tool`` said), or one ConfigError."""
    effects = effects or {}
    python = [s for s in specs if not s.startswith(("http://", "https://", "cmd:"))]
    tools = {name: dataclasses.replace(t, effect=effects.get(name, t.effect)) for name, t in load_tools(python).items()}
    servers: list[Upstream] = []
    try:
        for spec in specs:
            if spec in python:
                continue
            server = Upstream(spec)
            servers.append(server)
            for t in server.tools(effects):
                if t.name in tools:
                    raise ConfigError(f"{KEY}: two tools are named {t.name!r} (one of them {spec}'s)")
                tools[t.name] = t
    except BaseException:
        Toolbox({}, servers).close()
        raise
    unknown = sorted(set(effects) - set(tools))
    if unknown:
        Toolbox({}, servers).close()
        raise ConfigError(f"rollout.tool_effects names {', '.join(unknown)}, which no tool in {KEY} is")
    return Toolbox(tools, servers)


def canonical(arguments: dict) -> str:
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def call_digest(name: str, arguments: str) -> str:
    return hashlib.sha256(f"{name}\n{arguments}".encode()).hexdigest()


def result_text(out: Any) -> str:
    """A tool's result as the text its caller is answered: a string as it is, anything else as JSON."""
    return out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)


class McpTools:
    """The gateway's MCP server (the ``mcp`` package's, streamable HTTP, JSON answers, no session state): ``tools/list`` the
    tools, ``tools/call`` handed to the caller's episode (by its key) in a thread of its own, its key in the result's
    ``_meta``. Serve `app` at /mcp while `run` runs on the gateway's loop."""

    def __init__(self, gw: Gateway, tools: dict[str, Tool]):
        from mcp import types
        from mcp.server.lowlevel import Server

        self.gw, self.tools, self.types = gw, tools, types
        listed = [types.Tool(name=t.name, description=t.description, input_schema=t.schema) for t in tools.values()]

        async def list_tools(ctx: Any, params: Any) -> Any:
            self._session(ctx)
            return types.ListToolsResult(tools=listed)

        async def call_tool(ctx: Any, params: Any) -> Any:
            from mcp.shared.exceptions import MCPError

            from .protocol import ApiError

            session = self._session(ctx)
            try:
                text, error, key = await asyncio.to_thread(session.call_tool, params.name, dict(params.arguments or {}))
            except ApiError as e:  # an unknown tool, a finished or unresolved episode: said in MCP's words
                raise MCPError(-32000 - e.status, e.message) from None
            return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=error,
                                        _meta={KEY_PARAM: key} if key else None)

        self.server = Server("verlj", on_list_tools=list_tools, on_call_tool=call_tool)
        self.app = self.server.streamable_http_app(streamable_http_path="/mcp", json_response=True, stateless_http=True)

    def _session(self, ctx: Any) -> Any:
        """The caller's episode, by the key it sent (an MCP error, never a traceback, for a wrong or finished one)."""
        from mcp.shared.exceptions import MCPError

        try:
            return self.gw.session_of(ctx.request.headers if ctx.request is not None else {})
        except Exception as e:  # noqa: BLE001 - gateway.protocol.unauthorized: said in MCP's words
            raise MCPError(-32001, str(e)) from None

    async def run(self, stop: asyncio.Event) -> None:
        """The server's session manager, running until `stop` is set."""
        manager = self.server._session_manager  # noqa: SLF001 - the app made above owns it; it runs as its lifespan would
        assert manager is not None
        async with manager.run():
            await stop.wait()
