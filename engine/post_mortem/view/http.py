"""The viewer's HTTP server: the standard library's ThreadingHTTPServer, GET and HEAD only.

Pages (each the one HTML shell, which draws itself from the JSON below; a run, step or pair the
server does not serve is a 404 page instead, with one sentence saying why):

    /                          the first run at a glance        /run/NAME/            the run NAME
    /step/N                    the first run's step N           /run/NAME/step/N
    /compare                   the first two runs               /compare/A/B
    /search?where=&text=&score=&faults=1                        /run/NAME/search?...

JSON (what the pages read; the overview polls /metrics for the steps after the last it has):

    /api/runs   /api/run/NAME/summary   /api/run/NAME/metrics?after=K   /api/run/NAME/verify
    /api/run/NAME/step/N   /api/compare/A/B   /api/run/NAME/search?...

Security: nothing here writes (no method but GET and HEAD; no endpoint changes a file); the
runs are the ones named on the command line, looked up by name in a map, and the static files
are a fixed list of the package's own: no part of a URL ever becomes a path. On loopback the
Host header must name the loopback (a page elsewhere cannot reach the viewer through DNS
rebinding); with a token every request must carry it (``?token=``, then a cookie).
"""

from __future__ import annotations

import hmac
import json
import re
import socket
import threading
from collections.abc import Callable
from html import escape
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from verlj.journal.errors import VerljError

from . import answers
from .answers import NotFound, Runs

STATIC = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
LOOPBACK = ("127.0.0.1", "localhost", "::1")
COOKIE = "verlj_view_token"
POLL_SECONDS = 2.0  # how often a page asks for new steps


def _static(name: str) -> bytes:
    return files(__package__).joinpath("static", name).read_bytes()


def _int(s: str, what: str) -> int:
    if not re.fullmatch(r"-?\d{1,18}", s):
        raise NotFound(f"{what} {s!r} is not a step number")
    return int(s)


class Viewer:
    """The routes over the served runs; each returns (status, content type, body)."""

    def __init__(self, runs: Runs, token: str | None) -> None:
        self.runs, self.token = runs, token
        self.shell = _static("index.html").decode()

    # -- pages: the HTML shell where the page exists, a 404 page where it does not

    def page(self, parts: list[str]) -> tuple[str, dict]:
        """The page a path names, as (kind, params), checking that its run and step exist."""
        runs = self.runs
        match parts:
            case []:
                return "run", {"run": runs.first().name}
            case ["run", name]:
                return "run", {"run": runs.get(name).name}
            case ["step", n]:
                return self._step(runs.first(), n)
            case ["run", name, "step", n]:
                return self._step(runs.get(name), n)
            case ["compare"]:
                if len(runs.runs) < 2:
                    raise NotFound("a comparison needs two runs: name both on the command line (verlj view RUN_A RUN_B)")
                a, b = list(runs.runs)[:2]
                return "compare", {"a": a, "b": b}
            case ["compare", a, b]:
                return "compare", {"a": runs.get(a).name, "b": runs.get(b).name}
            case ["search"]:
                return "search", {"run": runs.first().name}
            case ["run", name, "search"]:
                return "search", {"run": runs.get(name).name}
        raise NotFound("no such page: the viewer has /, /step/N, /compare, /search and /run/NAME/…")

    def _step(self, run: answers.Run, n: str) -> tuple[str, dict]:
        step = _int(n, "step")
        answers.check_step(run, step)
        return "step", {"run": run.name, "step": step}

    def html(self, kind: str, params: dict) -> bytes:
        boot = json.dumps({"page": kind, **params, "runs": self.runs.listing(), "poll": POLL_SECONDS}).replace("<", "\\u003c")
        return self.shell.replace("{{BOOT}}", boot).encode()

    @staticmethod
    def error_page(status: HTTPStatus, message: str) -> bytes:
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>{status.value} {escape(status.phrase)} · verlj view</title>"
                f"<link rel='stylesheet' href='/static/style.css'></head><body><main class='error'>"
                f"<h1>{status.value} {escape(status.phrase)}</h1><p id='error'>{escape(message)}</p>"
                f"<p><a href='/'>back to the run</a></p></main></body></html>").encode()

    # -- JSON

    def api(self, parts: list[str], query: dict[str, str]) -> Any:
        runs = self.runs
        match parts:
            case ["runs"]:
                return runs.listing()
            case ["run", name, "summary"]:
                return answers.summary(runs.get(name))
            case ["run", name, "metrics"]:
                return answers.metrics(runs.get(name), _int(query.get("after", "0"), "after"))
            case ["run", name, "verify"]:
                return answers.verification(runs.get(name))
            case ["run", name, "step", n]:
                return answers.step(runs.get(name), _int(n, "step"))
            case ["compare", a, b]:
                return answers.compare(runs.get(a), runs.get(b))
            case ["run", name, "search"]:
                return answers.search(runs.get(name), query.get("where", ""), query.get("text", ""), query.get("score", ""),
                                   query.get("faults", "") not in ("", "0"))
        raise NotFound("no such endpoint: see /api/runs")


class Handler(BaseHTTPRequestHandler):
    """One request: GET or HEAD answered, every other method refused (405). `handler` binds it to a viewer."""

    viewer: Viewer
    hosts: frozenset[str] = frozenset()  # on loopback: the Host headers answered (empty: any, with the token)
    server_version = "verlj-view"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # the terminal keeps the URL line; requests are not news

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(head=True)

    def _refuse(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, "text/html; charset=utf-8",
                   Viewer.error_page(HTTPStatus.METHOD_NOT_ALLOWED, "the viewer is read-only: it answers GET and HEAD only"),
                   extra={"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _refuse  # noqa: N815

    def _send(self, status: HTTPStatus, ctype: str, body: bytes, head: bool = False, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _authorized(self, query: dict[str, str]) -> tuple[bool, dict]:
        """(allowed, headers to add): the token from ?token= (then kept as a cookie) or the cookie."""
        if self.viewer.token is None:
            return True, {}
        given = query.get("token")
        if given is not None and hmac.compare_digest(given.encode(), self.viewer.token.encode()):
            return True, {"Set-Cookie": f"{COOKIE}={self.viewer.token}; Path=/; HttpOnly; SameSite=Strict"}
        cookie = SimpleCookie(self.headers.get("Cookie", ""))
        held = cookie[COOKIE].value if COOKIE in cookie else ""
        return hmac.compare_digest(held.encode(), self.viewer.token.encode()), {}

    def _answer(self, head: bool) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        is_api = url.path.startswith("/api/")
        if self.hosts and self.headers.get("Host", "") not in self.hosts:
            return self._fail(HTTPStatus.FORBIDDEN, "this viewer answers requests to 127.0.0.1 and localhost only", is_api, head)
        ok, extra = self._authorized(query)
        if not ok:
            return self._fail(HTTPStatus.FORBIDDEN, "this viewer needs its token: open the URL `verlj view` printed", is_api, head)
        parts = [unquote(p) for p in url.path.split("/") if p]
        try:
            if parts[:1] == ["static"]:
                if len(parts) != 2 or parts[1] not in STATIC:
                    raise NotFound(f"no static file {url.path!r}")
                return self._send(HTTPStatus.OK, STATIC[parts[1]], _static(parts[1]), head, extra)
            if parts == ["favicon.ico"]:
                return self._send(HTTPStatus.NO_CONTENT, "image/x-icon", b"", head, extra)
            with self.viewer.runs.lock:  # the answer is made under the lock, sent after it
                if is_api:
                    ctype, body = "application/json", json.dumps(self.viewer.api(parts[1:], query), allow_nan=False).encode()
                else:
                    ctype, body = "text/html; charset=utf-8", self.viewer.html(*self.viewer.page(parts))
            self._send(HTTPStatus.OK, ctype, body, head, extra)
        except NotFound as e:
            self._fail(HTTPStatus.NOT_FOUND, str(e), is_api, head)
        except VerljError as e:  # a search it cannot parse, a run it cannot read
            self._fail(HTTPStatus.BAD_REQUEST, str(e), is_api, head)
        except Exception as e:  # noqa: BLE001 - the page says what failed; the server goes on
            self._fail(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}", is_api, head)

    def _fail(self, status: HTTPStatus, message: str, is_api: bool, head: bool) -> None:
        if is_api:
            self._send(status, "application/json", json.dumps({"error": message}).encode(), head)
        else:
            self._send(status, "text/html; charset=utf-8", Viewer.error_page(status, message), head)


def handler(viewer: Viewer, port: int, local: bool) -> type[Handler]:
    hosts = frozenset(f"{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]")) if local else frozenset()
    return type("BoundHandler", (Handler,), {"viewer": viewer, "hosts": hosts})


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class Server:
    """`verlj view`'s server: made (bound) here, served until stopped; `url` is what to open."""

    def __init__(self, paths: list[Path], host: str = "127.0.0.1", port: int = 8765, token: str | None = None) -> None:
        from ...errors import UsageError

        if host not in LOOPBACK and not token:
            raise UsageError(f"--host {host} serves the runs beyond this machine: give a --token too (anyone with it can read them)")
        if token is not None and not re.fullmatch(r"[A-Za-z0-9._~-]{8,}", token):
            raise UsageError("--token must be at least 8 characters of A-Z a-z 0-9 . _ ~ - (it travels in a URL and a cookie)")
        runs = Runs([Path(p) for p in paths])
        for r in runs.runs.values():  # open each once: a path that is not a run, or one the ledger cannot read, is said now
            answers.steps_of(r)
        self.viewer = Viewer(runs, token)
        self.httpd = (_Server6 if ":" in host else ThreadingHTTPServer)((host, port), handler(self.viewer, port, local=host in LOOPBACK))
        self.port = self.httpd.server_address[1]
        if port == 0:  # the Host check needs the port it was given
            self.httpd.RequestHandlerClass = handler(self.viewer, self.port, local=host in LOOPBACK)
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/" + (f"?token={token}" if token else "")

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> threading.Thread:
        """Serve from a thread of its own (tests): `stop()` ends it."""
        t = threading.Thread(target=self.serve_forever, daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve(paths: list[Path], host: str, port: int, token: str | None, say: Callable[[str], None]) -> None:
    """`verlj view`: serve until Ctrl-C."""
    server = Server(paths, host, port, token)
    say(f"verlj view: {server.url}  (read-only; Ctrl-C stops it)")
    try:
        server.serve_forever()
    finally:
        server.httpd.server_close()
