"""The gateway's HTTP server: ``POST /v1/chat/completions`` and ``GET /v1/models``, a FastAPI app
served by uvicorn in a thread of the trainer's process, on 127.0.0.1 at a port the system chooses
(``pip install 'verlj[agent]'``: fastapi, uvicorn, and the openai client agents use).

Every request names its episode by its API key (``Authorization: Bearer KEY``): a random secret made
for that episode alone and forgotten when it ends, so a missing, wrong or finished key gets 401 and
one episode can neither read nor add to another's calls. What a key's episode answers is its own
business (:class:`Session`: ``gateway.runner``); the server parses (``gateway.protocol``), hands the
request over and sends back the bytes it is given. Every refusal is OpenAI's error shape; nothing a
client sends ends in a traceback, to the client or in the log.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
from concurrent.futures import Future
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from .protocol import MAX_BODY, ApiError, ChatRequest, models_body, parse_request, unauthorized

log = logging.getLogger("verlj.gateway")


class Session(Protocol):
    """One episode as the server sees it: its calls are handed over here, answered by a future."""

    def submit(self, req: ChatRequest, retry: int) -> Future:
        """The call's answer (response bytes), or an ApiError set on the future (or raised at once)."""


class Gateway:
    """The server and its sessions by key. `open` gives an episode its key; `close_session` forgets it."""

    def __init__(self, model: str):
        self.model = model
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.server: Any = None  # uvicorn.Server, once started
        self.thread: threading.Thread | None = None
        self.sock: socket.socket | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

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

    def start(self) -> Gateway:
        """Serve in a daemon thread; returns once the port is listening."""
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app(self), log_level="critical", access_log=False, lifespan="off", timeout_keep_alive=30)
        self.server = server = uvicorn.Server(config)
        self.thread = threading.Thread(target=server.run, kwargs={"sockets": [self.sock]}, name="verlj-gateway", daemon=True)
        self.thread.start()
        while not server.started and self.thread.is_alive():
            threading.Event().wait(0.005)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            assert self.thread is not None
            self.thread.join(timeout=5)
            self.server = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def app(gw: Gateway):
    """The FastAPI app over `gw`'s sessions."""
    api = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    def error(e: ApiError) -> Response:
        return Response(e.body(), status_code=e.status, media_type="application/json")

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:  # never a traceback to the client
        log.error("gateway: %s on %s: %s", type(exc).__name__, request.url.path, exc)
        return error(ApiError(500, "The gateway failed on this request.", kind="server_error"))

    @api.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            gw.session(request.headers.get("authorization"))
        except ApiError as e:
            return error(e)
        return Response(models_body(gw.model), media_type="application/json")

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        try:
            session = gw.session(request.headers.get("authorization"))
            size = request.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > MAX_BODY:
                raise ApiError(413, f"The request body is {size} bytes, more than the gateway's limit of {MAX_BODY}.")
            req = parse_request(await request.body(), gw.model)
            retry = request.headers.get("x-stainless-retry-count", "0")
            body = await asyncio.wrap_future(session.submit(req, int(retry) if retry.isdigit() else 0))
        except ApiError as e:
            return error(e)
        if req.stream:
            return StreamingResponse(_events(body), media_type="text/event-stream", headers={"cache-control": "no-cache"})
        return Response(body, media_type="application/json")

    return api


async def _events(body: bytes):
    """An SSE stream's bytes, one event a chunk (what the journal keeps is their concatenation)."""
    for part in body.split(b"\n\n"):
        if part:
            yield part + b"\n\n"
