"""`verlj view` over HTTP, no browser: pages and JSON for the runs it serves, a clear 404 page for a
step, run or page it does not (never a traceback), nothing outside the named runs whatever the URL,
no method that writes, the Host check on loopback, and --host only with a token.

The runs are copies of the release-0 journals kept as fixtures (tests/fixtures/v0): `sync` and `stepo`
(async step order) part at step 1."""

from __future__ import annotations

import hashlib
import html
import http.client
import json
import shutil
from pathlib import Path

import pytest

from verlj.engine.errors import UsageError
from verlj.engine.post_mortem.view import Server
from verlj_testing import REPO, cli

FIXTURES = REPO / "tests" / "fixtures" / "v0"


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "lock.mdb"}  # LMDB's reader table: a reader writes it by design


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("view")
    for name in ("sync", "stepo"):
        shutil.copytree(FIXTURES / name, root / "runs" / name)
    (root / "secret.txt").write_text("not for the browser")
    before = _digests(root / "runs")
    server = Server([root / "runs" / "sync", root / "runs" / "stepo"], port=0)
    server.start()
    yield server, root
    server.stop()
    assert _digests(root / "runs") == before, "serving changed a file of a run"


def request(server: Server, path: str, method: str = "GET", headers: dict | None = None, host: str | None = None):
    """(status, headers, body as str) for a raw `path` (http.client sends it as given: no '..' folded)."""
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        c.putrequest(method, path, skip_host=True)
        c.putheader("Host", host or f"127.0.0.1:{server.port}")
        for k, v in (headers or {}).items():
            c.putheader(k, v)
        c.endheaders()
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read().decode()
    finally:
        c.close()


def api(server: Server, path: str):
    status, _, body = request(server, path)
    assert status == 200, body
    return json.loads(body, parse_constant=lambda c: pytest.fail(f"{c} in JSON: a browser's JSON.parse refuses it"))


@pytest.mark.parametrize("path", ["/", "/run/sync/", "/step/3", "/run/stepo/step/1", "/compare", "/compare/stepo/sync", "/search?where=x",
                                  "/run/stepo/search", "/static/app.js", "/static/style.css"])
def test_pages_of_the_served_runs_answer(served, path):
    server, _ = served
    status, headers, body = request(server, path)
    assert status == 200, body
    if not path.startswith("/static/"):
        assert headers["Content-Type"].startswith("text/html") and '<script src="/static/app.js">' in body
        boot = json.loads(body.split('id="boot">')[1].split("</script>")[0])
        assert [r["name"] for r in boot["runs"]] == ["sync", "stepo"]


@pytest.mark.parametrize("path, said", [
    ("/step/0", "step 0 is not in run sync: it has steps 1–3"),
    ("/step/4", "step 4 is not in run sync: it has steps 1–3"),
    ("/run/stepo/step/-2", "step -2 is not in run stepo"),
    ("/step/abc", "step 'abc' is not a step number"),
    ("/step/99999999999999999999999", "is not a step number"),
    ("/run/nope/", "no run named 'nope' is served here (served: sync, stepo)"),
    ("/run/nope/step/1", "no run named 'nope'"),
    ("/compare/sync/nope", "no run named 'nope'"),
    ("/nothing/here", "no such page"),
    ("/api/run/nope/summary", "no run named 'nope'"),
    ("/api/run/sync/step/7", "step 7 is not in run sync"),
    ("/api/run/sync/metrics?after=x", "is not a step number"),
    ("/api/run/sync/write", "no such endpoint"),
])
def test_a_step_run_or_page_not_served_is_a_clear_404(served, path, said):
    server, _ = served
    status, headers, body = request(server, path)
    assert status == 404 and "Traceback" not in body, body
    if path.startswith("/api/"):
        assert said in json.loads(body)["error"]
    else:
        assert headers["Content-Type"].startswith("text/html") and "<h1>404 Not Found</h1>" in body and said in html.unescape(body)


@pytest.mark.parametrize("path", ["/static/../../secret.txt", "/static/..%2f..%2f..%2fsecret.txt", "/static/%2e%2e/server.py",
                                  "/static/index.html", "/static/", "/run/..%2fsecret.txt/", "/run/../../secret.txt",
                                  "/run/sync/../../secret.txt", "/run/%2e%2e/step/1", "/api/run/..%2f..%2fsecret.txt/summary",
                                  "/../../../../etc/passwd", "//etc/passwd", "/run/sync/journal/data.mdb", "/static/app.js/../../data.py"])
def test_no_path_outside_the_named_runs_whatever_the_url(served, path):
    server, _ = served
    status, _, body = request(server, path)
    assert status == 404, body
    assert "not for the browser" not in body and "root:" not in body and "import" not in body


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_no_method_that_could_write_is_answered(served, method):
    server, _ = served
    for path in ("/", "/api/run/sync/summary", "/api/run/sync/step/1"):
        status, headers, body = request(server, path, method, headers={"Content-Length": "2"} if method != "OPTIONS" else None)
        assert status == 405 and headers["Allow"] == "GET, HEAD" and "read-only" in body


def test_head_answers_without_a_body(served):
    server, _ = served
    status, headers, body = request(server, "/api/run/sync/summary", "HEAD")
    assert status == 200 and int(headers["Content-Length"]) > 100 and body == ""


def test_the_json_is_what_the_readers_say_and_a_browser_can_parse(served):
    server, _ = served
    s = api(server, "/api/run/sync/summary")
    assert s["last_step"] == 3 and s["steps_committed"] == 3 and "critic/score/mean" in s["default_charts"]
    m = api(server, "/api/run/sync/metrics?after=1")
    assert [r["step"] for r in m["rows"]] == [2, 3] and "critic/score/mean" in m["names"]
    step = api(server, "/api/run/sync/step/2")
    assert step["step"] == 2 and step["fingerprint"] and step["samples"]
    # seeds above 2**53 as strings: JavaScript's numbers would round them
    assert step["seeds"] and all(isinstance(v, str) == (abs(int(v)) > 2**53) for v in step["seeds"].values())
    s0 = step["samples"][0]
    assert s0["tokens"] and all(isinstance(t, str) and lp <= 0 and policy is True for t, lp, policy in s0["tokens"])
    d = api(server, "/api/compare/sync/stepo")
    assert d["identical"] is False and d["step"] == 1 and d["a"] == "sync" and d["b"] == "stepo"
    same = api(server, "/api/compare/sync/sync")
    assert same["identical"] is True and same["step"] is None


def test_search_finds_steps_as_find_does_and_samples_by_text_and_score(served):
    server, _ = served
    r = api(server, "/api/run/sync/search?where=critic/score/mean+>%3D+0&score=%3E%3D+0")
    assert [m["step"] for m in r["steps"]] == [1, 2, 3]
    assert len(r["samples"]) == 48 and not r["truncated"]  # every sample of the 3 steps (4 prompts x 4 samples each)
    some = r["samples"][5]
    hit = api(server, f"/api/run/sync/search?text={some['response']}")
    assert hit["steps"] is None and any(s["id"] == some["id"] for s in hit["samples"])
    assert all(some["response"] in s["prompt"] + "\n" + s["response"] for s in hit["samples"])
    none = api(server, "/api/run/sync/search?score=%3E+5")
    assert none["samples"] == []
    status, _, body = request(server, "/api/run/sync/search?where=what+ever")
    assert status == 400 and json.loads(body)["error"].startswith("cannot parse --where")
    status, _, body = request(server, "/api/run/sync/search?score=big")
    assert status == 400 and "cannot parse score 'big'" in body


def test_on_loopback_a_request_for_another_host_is_refused(served):
    """A page elsewhere that rebinds its name to 127.0.0.1 sends its own name as Host."""
    server, _ = served
    status, _, body = request(server, "/api/run/sync/summary", host=f"evil.example:{server.port}")
    assert status == 403 and "127.0.0.1 and localhost only" in body
    assert request(server, "/", host=f"localhost:{server.port}")[0] == 200


def test_another_host_only_with_a_token_and_every_request_carries_it(tmp_path):
    run = tmp_path / "sync"
    shutil.copytree(FIXTURES / "sync", run)
    with pytest.raises(UsageError, match=r"^--host 127.0.0.2 serves the runs beyond this machine: give a --token too"):
        Server([run], host="127.0.0.2", port=0)
    for bad in ("short", "has space in it", "semi;colon=1"):
        with pytest.raises(UsageError, match=r"^--token must be at least 8 characters"):
            Server([run], host="127.0.0.2", port=0, token=bad)
    server = Server([run], host="127.0.0.2", port=0, token="s3cret-token")
    server.start()
    try:
        assert server.url == f"http://127.0.0.2:{server.port}/?token=s3cret-token"

        def ask(path, headers=None):
            c = http.client.HTTPConnection("127.0.0.2", server.port, timeout=30)
            c.request("GET", path, headers=headers or {})
            r = c.getresponse()
            return r.status, r.getheader("Set-Cookie"), r.read().decode()

        for path in ("/", "/api/run/sync/summary", "/static/app.js", "/step/1?token=wrong", "/?token="):
            status, _, body = ask(path)
            assert status == 403 and "needs its token" in body, path
        status, cookie, _ = ask("/?token=s3cret-token")
        assert status == 200 and cookie.startswith("verlj_view_token=s3cret-token;") and "HttpOnly" in cookie
        assert ask("/api/run/sync/summary", {"Cookie": "verlj_view_token=s3cret-token"})[0] == 200
        assert ask("/api/run/sync/summary", {"Cookie": "verlj_view_token=s3cret-toke"})[0] == 403
    finally:
        server.stop()


def test_the_command_refuses_in_one_line(tmp_path):
    run = tmp_path / "sync"
    shutil.copytree(FIXTURES / "sync", run)
    for args, said, code in [(["--host", "0.0.0.0"], "error: --host 0.0.0.0 serves the runs beyond this machine: give a --token too", 2),
                             ([str(tmp_path / "nope")], f"error: {tmp_path / 'nope'} does not exist", 1),
                             ([str(tmp_path)], f"error: {tmp_path} is not a verlj run (no journal/ with run metadata)", 1)]:
        out = cli("view", *([str(run)] if args[0].startswith("--") else []), *args)
        assert out.returncode == code and out.stderr.strip().splitlines() == [said + (" (anyone with it can read them)" if "--host" in args else "")], out.stderr


def test_the_command_prints_its_url_serves_and_stops_on_ctrl_c(tmp_path):
    """In a process of its own: Ctrl-C (SIGINT) is how it stops."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    run = tmp_path / "sync"
    shutil.copytree(FIXTURES / "sync", run)
    p = subprocess.Popen([sys.executable, "-m", "verlj.cli", "view", str(run), "--port", "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = p.stdout.readline()
        assert line.startswith("verlj view: http://127.0.0.1:") and "(read-only; Ctrl-C stops it)" in line, line + p.stderr.read()
        url = line.split()[2]
        with urllib.request.urlopen(url + "api/run/sync/summary", timeout=30) as r:
            assert json.loads(r.read())["last_step"] == 3
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0 and out.strip() == "stopped" and err == "", err
    finally:
        p.kill()


def test_verify_is_verify_runs_report(served):
    server, _ = served
    v = api(server, "/api/run/sync/verify")
    assert v["ok"] is True and v["last_step"] == 3 and "hash chain verified" in v["text"] and v["text"].endswith("intact.")
