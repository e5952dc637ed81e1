"""The gateway's HTTP server: ``POST /v1/chat/completions``, ``POST /v1/responses`` and ``GET /v1/models``, a
plain ASGI app served by uvicorn on an event loop of its own (``gateway.agents.server_loop``: a thread of the
trainer's process that lives as long as it), on 127.0.0.1 at a port the system chooses
(``pip install 'verlj[agent]'``: uvicorn with httptools and uvloop, and the openai client agents use).
No web framework: three routes, the raw body parsed once (``gateway.protocol``, ``gateway.responses``), so what
a call costs is the gateway's own work (``tools/bench_gateway.py``).

Every answer says whose it is: ``x-verlj-episode`` (the id of the sample the episode becomes) and
``x-verlj-attempt`` (1; 2, 3, ... when the episode is run again after a crash), as the journal records them.

Every request names its episode by its API key (``Authorization: Bearer KEY``): a random secret made
for that episode alone and forgotten when it ends, so a missing, wrong or finished key gets 401 and
one episode can neither read nor add to another's calls. What a key's episode answers is its own
business (:class:`Session`: ``gateway.runner``); the server parses, hands the request over and sends
back the bytes it is given. Every refusal is OpenAI's error shape; nothing a client sends ends in a
traceback, to the client or in the log.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import secrets
import socket
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from .agents import agent_loop, server_loop
from .protocol import MAX_BODY, ApiError, ChatRequest, models_body, parse_request, unauthorized
from .responses import parse_responses

log = logging.getLogger("verlj.gateway")


class Session(Protocol):
    """One episode as the server sees it: its calls are handed over here, answered by a future."""

    episode: int  # the id of the sample it becomes
    attempt: int  # 1; 2, 3, ... when it is run again after a crash

    def submit(self, req: ChatRequest, retry: int, sink: Callable[[bytes], None] | None = None) -> Future:
        """The call's answer (response bytes), or an ApiError set on the future (or raised at once). A stream's
        events may go to `sink` (from any thread) as they are made; the answer's bytes then begin with them."""

    def call_tool(self, name: str, arguments: dict) -> tuple[str, bool, str]:
        """A tool call (rollout.tools, blocking: in a thread of its own): its result's text, whether it is an error, its
        idempotency key."""


class Gateway:
    """The server and its sessions by key. `open` gives an episode its key; `close_session` forgets it. With `tools`
    (rollout.tools: ``gateway.tools``) it serves them over MCP at `mcp_url` too."""

    def __init__(self, model: str, tools: dict | None = None):
        self.model = model
        self.tools = tools or {}
        self.mcp: Any = None  # gateway.tools.McpTools, once started with tools
        self.mcp_stop: asyncio.Event | None = None
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.server: Any = None  # uvicorn.Server, once started
        self.serving: Future | None = None  # its serve() on the agents' loop
        self.sock: socket.socket | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def mcp_url(self) -> str:
        """Where its tools are served over MCP ("" without tools)."""
        return f"http://127.0.0.1:{self.port}/mcp" if self.tools else ""

    def open(self, session: Session) -> str:
        key = "sk-verlj-" + secrets.token_urlsafe(24)
        with self.lock:
            self.sessions[key] = session
        return key

    def close_session(self, key: str) -> None:
        with self.lock:
            self.sessions.pop(key, None)

    def session(self, authorization: str | None) -> Session:
        scheme, _, key = (authorization or "").partition(" ")
        with self.lock:
            s = self.sessions.get(key.strip()) if scheme.lower() == "bearer" else None
        if s is None:
            raise unauthorized()
        return s

    def session_of(self, headers: Any) -> Session:
        """The session an HTTP request's headers name (its bearer key), or an ApiError (401)."""
        return self.session(headers.get("authorization"))

    def start(self) -> Gateway:
        """Serve on the agents' event loop; returns once the port is listening."""
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
        config = uvicorn.Config(app(self), http=http, log_level="critical", access_log=False, lifespan="off", timeout_keep_alive=30)
        self.server = server = uvicorn.Server(config)
        loop = server_loop()
        if self.tools:
            from .tools import McpTools

            self.mcp = McpTools(self, self.tools)
            self.mcp_stop = asyncio.run_coroutine_threadsafe(_event(), loop).result()
            asyncio.run_coroutine_threadsafe(self.mcp.run(self.mcp_stop), loop)
        loop.set_exception_handler(unhandled)
        agent_loop().set_exception_handler(unhandled)
        self.serving = serving = asyncio.run_coroutine_threadsafe(server.serve(sockets=[self.sock]), loop)
        while not server.started and not serving.done():
            threading.Event().wait(0.005)
        if serving.done():
            serving.result()  # raises what stopped it
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            assert self.serving is not None
            try:
                self.serving.result(timeout=5)
            except Exception:  # noqa: BLE001 - a server that did not stop in time is left to the daemon loop
                pass
            self.server = self.serving = None
        if self.mcp_stop is not None:
            server_loop().call_soon_threadsafe(self.mcp_stop.set)
            self.mcp = self.mcp_stop = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None


async def _event() -> asyncio.Event:
    return asyncio.Event()


def unhandled(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """What the gateway's loop could not hand to anyone (an exception no task's owner read: an agent's forgotten task,
    a client gone mid-stream): one line, never a traceback."""
    exc = context.get("exception")
    what = f"{type(exc).__name__}: {exc}" if exc is not None else context.get("message", "")
    sys.stderr.write(f"[WARNING] the agent gateway's event loop: {what}\n")


JSON = b"application/json"


async def _respond(send, status: int, body: bytes, media: bytes = JSON, headers: tuple = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", media), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def identity(session: Session) -> tuple:
    """The headers that say whose answer it is."""
    return ((b"x-verlj-episode", str(session.episode).encode()), (b"x-verlj-attempt", str(session.attempt).encode()))


async def _stream(send, session: Session, req: ChatRequest, retry: int) -> None:
    """A server-sent event stream: each event as the session makes it (a token's text delta, while its batch
    generates), the rest once the answer is complete (durable: the finish reason, the usage, ``[DONE]``).
    What was sent is where the answer's bytes begin: the journal keeps their concatenation."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[bytes] = asyncio.Queue()

    def sink(event: bytes) -> None:  # from the trainer's thread
        loop.call_soon_threadsafe(events.put_nowait, event)

    done = asyncio.wrap_future(session.submit(req, retry, sink))
    sent, started = b"", False

    async def out(body: bytes, more: bool = True) -> None:
        nonlocal sent, started
        if not started:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *identity(session)]})
            started = True
        sent += body
        await send({"type": "http.response.body", "body": body, "more_body": more})

    while not done.done():
        got = asyncio.ensure_future(events.get())
        await asyncio.wait({got, done}, return_when=asyncio.FIRST_COMPLETED)
        if got.done():
            await out(got.result())
        else:
            got.cancel()
    while not events.empty():  # put before the answer was set: every event is in the queue by now
        await out(events.get_nowait())
    try:
        body = done.result()
    except ApiError as e:
        if not started:
            raise
        await out(b"data: " + e.body() + b"\n\n", more=False)  # as OpenAI's streams say an error midway
        return
    if not body.startswith(sent):
        log.error("gateway: a stream's answer does not begin with the events sent while it was generated")
    for part in body[len(sent):].split(b"\n\n"):
        if part:
            await out(part + b"\n\n")
    await out(b"", more=False)


async def _body(receive, size: str | None) -> bytes:
    """The request's body, refused (413) past MAX_BODY as soon as its length says so."""
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise ApiError(413, f"The request body is {size} bytes, more than the gateway's limit of {MAX_BODY}.")
    parts, got = [], 0
    while True:
        m = await receive()
        chunk = m.get("body", b"")
        got += len(chunk)
        if got > MAX_BODY:
            raise ApiError(413, f"The request body is more than the gateway's limit of {MAX_BODY} bytes.")
        parts.append(chunk)
        if not m.get("more_body"):
            return b"".join(parts)


def app(gw: Gateway):
    """The ASGI app over `gw`'s sessions."""

    async def call(headers: dict, receive, send, parse: Callable[[bytes, str], ChatRequest]) -> None:
        session = gw.session(headers.get("authorization"))
        req = parse(await _body(receive, headers.get("content-length")), gw.model)
        retry = headers.get("x-stainless-retry-count", "0")
        if req.stream:
            await _stream(send, session, req, int(retry) if retry.isdigit() else 0)
            return
        body = await asyncio.wrap_future(session.submit(req, int(retry) if retry.isdigit() else 0))
        await _respond(send, 200, body, headers=identity(session))

    async def asgi(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        route = (scope["method"], scope["path"].rstrip("/"))
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            if route == ("POST", "/v1/chat/completions"):
                await call(headers, receive, send, parse_request)
            elif route == ("POST", "/v1/responses"):
                await call(headers, receive, send, parse_responses)
            elif scope["path"].rstrip("/") == "/mcp" and gw.mcp is not None:  # rollout.tools: the MCP server's own answers
                await gw.mcp.app(scope, receive, send)
            elif route == ("GET", "/v1/models"):
                gw.session(headers.get("authorization"))
                await _respond(send, 200, models_body(gw.model))
            else:
                raise ApiError(404, f"Invalid URL ({route[0]} {scope['path']}): the gateway serves POST /v1/chat/completions, "
                               "POST /v1/responses and GET /v1/models.", code="unknown_url")
        except ApiError as e:
            await _respond(send, e.status, e.body())
        except Exception as exc:  # noqa: BLE001 - never a traceback to the client
            log.error("gateway: %s on %s: %s", type(exc).__name__, scope["path"], exc)
            await _respond(send, 500, ApiError(500, "The gateway failed on this request.", kind="server_error").body())

    return asgi
