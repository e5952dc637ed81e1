"""OpenEnv servers as environments: one WebSocket session a episode, the policy's text as the action.

    rollout.env: openenv:http://127.0.0.1:8765        # a server made with openenv.core.create_app, serving there
    rollout.openenv_command: python examples/openenv_server.py --port 8765   # verlj starts it (else: yours, running)
    rollout.openenv_adapter: my_adapter:Adapter      # a TextAdapter subclass: the env's own client class, or
                                                     # how text becomes its action and its observation text

An episode is one session on the server's ``/ws`` (OpenEnv's ``EnvClient`` wire protocol: ``{"type": "reset",
"data": {...}}``, ``{"type": "step", "data": ACTION}``, each answered ``{"type": "observation", "data":
{"observation", "reward", "done"}}``; ``close`` ends it). ``reset(row, seed)`` opens the session and resets
with ``seed`` and the row's fields as keyword arguments (the server passes its env's ``reset`` those it
takes), so a server env that draws from the seed is deterministic and verlj's restore (a fresh reset, the
actions stepped again) brings it back. A step's action is the policy's text in the action's one string
field (the server's ``/schema``), or whatever the adapter makes of it; the observation is rendered to text
(:func:`render`); reward and done come from the step's answer. ``state()`` asks the session's state (its
``episode_id`` left out), which the rollout journals after reset and after each step (the sample's env_states).
The session is closed when the episode is done (its last state asked first), and when verlj drops the env
(an episode ended by rollout.max_turns, a fault, its length).

An MCP env (OpenEnv's ``MCPEnvironment``, served with ``CallToolAction`` as its action: :func:`mcp_actions`) is
played by :class:`McpEnv` unless an adapter is named: at reset its tools are listed once (``ListToolsAction``) and
rendered into the prompt by the chat template, as a TRL class's are (rl.trl_envs: the same prompt, hermes parsing and
tool-message rendering); each tool call of an action is a ``CallToolAction`` step whose result is a tool message; an
action without one ends the episode, the server not stepped.

The transport is a synchronous ``websockets`` client, not OpenEnv's ``SyncEnvClient`` (an event-loop
thread a client, closed on garbage collection at best): a session here is closed when its episode ends,
so a server's ``max_concurrent_envs`` sessions are enough for the run's concurrent episodes. A client
class an adapter names (``client = EchoEnv``) is used for what it knows about its env: its
``_step_payload`` and ``_parse_result``, as OpenEnv's ``EnvClient`` uses them.

Anything the server does wrong (down, no answer in rollout.env_timeout_s, an error reply, a reply of no
known form) raises :class:`OpenEnvError` whose text is one sentence; the rollout's safe_reset / safe_step
turn it into an env fault (counted, never trained).
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import ConfigError
from ..plugins import import_object
from .trl_envs import Prompt, joined, prompt_of, template_of, tool_calls, tool_prompt, tool_suffix

PREFIX = "openenv:"
KEY = "rollout.env"
HEALTH_WAIT_S = 60.0  # rollout.openenv_command: how long the server may take to answer /health
_NOT_OBSERVATION = frozenset({"done", "reward", "metadata"})  # an OpenEnv Observation's fields that are not its text


class OpenEnvError(RuntimeError):
    """What went wrong with the server, in one sentence (a fault's reason)."""


# ----------------------------------------------------------------------------- the server


def server_url(spec: str) -> str:
    """The server's base URL from ``openenv:URL`` (http(s) or ws(s), host and port; no trailing slash), or
    one ConfigError."""
    url = spec[len(PREFIX):].strip().rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(f"{KEY}=openenv:URL needs the server's address, e.g. openenv:http://127.0.0.1:8765; got {spec!r}")
    return url


def _http(url: str) -> str:
    scheme = {"ws": "http", "wss": "https"}.get(url.split(":", 1)[0])
    return f"{scheme}:{url.split(':', 1)[1]}" if scheme else url


def _ws(url: str) -> str:
    scheme = {"http": "ws", "https": "wss"}.get(url.split(":", 1)[0])
    return f"{scheme}:{url.split(':', 1)[1]}" if scheme else url


def get_json(url: str, path: str, timeout_s: float = 5.0) -> Any:
    """GET the server's `path`, as JSON (raises OSError or ValueError)."""
    request = urllib.request.Request(_http(url) + path, headers={"Accept": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local server: never through a proxy
    with opener.open(request, timeout=timeout_s) as reply:
        return json.loads(reply.read())


def healthy(url: str) -> bool:
    """Whether the server answers ``/health`` with status healthy."""
    try:
        got = get_json(url, "/health", 2.0)
    except (OSError, ValueError):
        return False
    return isinstance(got, dict) and got.get("status") == "healthy"


_SERVED: dict[str, subprocess.Popen] = {}  # url -> the server this process started (rollout.openenv_command)
_SERVE_LOCK = threading.Lock()


def serve(url: str, command: str, wait_s: float = HEALTH_WAIT_S) -> None:
    """Start `command` (rollout.openenv_command) to serve `url`, once a process, and wait until ``/health``
    answers; it is stopped when this process exits (atexit; and by the kernel if this process is killed).
    Other ranks than 0 wait for rank 0's. One ConfigError when it exits, or does not answer in `wait_s`."""
    with _SERVE_LOCK:
        if url in _SERVED and _SERVED[url].poll() is None:
            return
        if os.environ.get("RANK", "0") != "0":
            _wait_healthy(url, command, None, wait_s)
            return
        if healthy(url):
            raise ConfigError(f"rollout.openenv_command: something already serves {url}; stop it, or remove rollout.openenv_command "
                              "to train against it")
        try:
            argv = shlex.split(command)
            if argv and argv[0] in ("python", "python3"):  # the interpreter running verlj, as `python -m` would be in its venv
                argv[0] = sys.executable
        except ValueError as e:
            raise ConfigError(f"rollout.openenv_command: {command!r} is not a command line ({e})") from None
        log = tempfile.TemporaryFile()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        except OSError as e:
            raise ConfigError(f"rollout.openenv_command: cannot start {command!r} ({e.strerror or e})") from None
        atexit.register(_stop, proc)
        _wait_healthy(url, command, (proc, log), wait_s)
        _SERVED[url] = proc


def _wait_healthy(url: str, command: str, started: tuple[subprocess.Popen, Any] | None, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not healthy(url):
        if started is not None and started[0].poll() is not None:
            started[1].seek(0)
            lines = [ln for ln in started[1].read().decode(errors="replace").splitlines() if ln.strip()]
            last = f": {lines[-1].strip()[:200]}" if lines else ""
            raise ConfigError(f"rollout.openenv_command {command!r} exited with code {started[0].returncode} before it served {url}{last}")
        if time.monotonic() > deadline:
            if started is not None:
                _stop(started[0])
            raise ConfigError(f"rollout.openenv_command {command!r} did not answer {url}/health within {wait_s:g} s")
        time.sleep(0.1)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, between fork and exec
    """The server gets SIGTERM when the process that started it dies, however it dies (Linux; elsewhere
    a killed trainer leaves it running)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------- text in, text out


def render(observation: Any) -> str:
    """An observation as the text the policy reads: an OpenEnv Observation (or the dict of its fields, as
    the server sends it) less done, reward and metadata; its one non-empty field's text when that is a str,
    else one ``name: value`` line per non-empty field (a value that is not a str as JSON, keys sorted)."""
    if hasattr(observation, "model_dump"):
        observation = observation.model_dump(mode="json")
    if isinstance(observation, str):
        return observation
    if not isinstance(observation, dict):
        return json.dumps(observation, sort_keys=True, ensure_ascii=False)
    items = [(k, v) for k, v in observation.items() if k not in _NOT_OBSERVATION and v is not None and v != "" and v != [] and v != {}]
    if len(items) == 1 and isinstance(items[0][1], str):
        return items[0][1]
    return "\n".join(f"{k}: {v if isinstance(v, str) else json.dumps(v, sort_keys=True, ensure_ascii=False)}" for k, v in items)


def text_field(schema: dict) -> str | None:
    """The action's one string field in the server's ``/schema`` (metadata aside), or None when it has
    none or several, or other required fields."""
    action = schema.get("action") if isinstance(schema, dict) else None
    if not isinstance(action, dict) or not isinstance(action.get("properties"), dict):
        return None
    props = action["properties"]
    fields = {k: v for k, v in props.items() if k != "metadata"}
    strings = [k for k, v in fields.items() if isinstance(v, dict) and v.get("type") == "string"]
    required = set(action.get("required") or ())
    if len(strings) == 1 and required <= {strings[0]}:
        return strings[0]
    return None


MCP_ACTIONS = frozenset({"call_tool", "list_tools"})  # the `type` of OpenEnv's CallToolAction and ListToolsAction


def mcp_actions(schema: dict) -> bool:
    """Whether the server's env takes OpenEnv's MCP actions: its ``/schema``'s action is CallToolAction or
    ListToolsAction (its ``type`` a const of theirs), the action class an MCPEnvironment is served with (OpenEnv's
    server reads a ``call_tool`` or ``list_tools`` step as one only then)."""
    action = schema.get("action") if isinstance(schema, dict) else None
    props = action.get("properties") if isinstance(action, dict) else None
    kind = props.get("type") if isinstance(props, dict) else None
    return isinstance(kind, dict) and kind.get("const") in MCP_ACTIONS


LIST_TOOLS = {"type": "list_tools"}  # ListToolsAction's JSON


def call_tool(name: str, arguments: dict) -> dict:
    """CallToolAction's JSON."""
    return {"type": "call_tool", "tool_name": name, "arguments": arguments}


def mcp_tools(data: dict) -> dict[str, dict]:
    """A ListToolsObservation (a step's answer) as the chat template takes its tools, by name, in the server's order:
    ``{"type": "function", "function": {"name", "description", "parameters"}}`` (MCP's input_schema, the parameters)."""
    obs = data.get("observation")
    tools = obs.get("tools") if isinstance(obs, dict) else None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
        raise OpenEnvError("the OpenEnv MCP env answered list_tools with no list of named tools")
    out = {}
    for t in tools:
        params = t.get("input_schema") or t.get("inputSchema") or {"type": "object", "properties": {}}
        out[t["name"]] = {"type": "function", "function": {"name": t["name"], "description": t.get("description") or "", "parameters": params}}
    return out


def mcp_result(data: dict) -> tuple[str, float | None, bool]:
    """A CallToolObservation (a step's answer) as a tool message's content, with the step's reward and done: the
    result's text (an MCP CallToolResult's text contents, one a line; another result as JSON), or ``{'error': ...}``
    as TRL words a tool that failed, for an error (a tool not found, bad arguments, a tool that raised)."""
    obs = data.get("observation")
    obs = obs if isinstance(obs, dict) else {}
    error, result = obs.get("error"), obs.get("result")
    if isinstance(result, dict) and result.get("is_error"):
        error = {"message": _texts(result)}
    reward = data.get("reward")
    reward = float(reward) if isinstance(reward, bool) else reward
    if error:
        message = error.get("message") if isinstance(error, dict) else error
        return str({"error": str(message)}), reward, bool(data.get("done", False))
    return _texts(result), reward, bool(data.get("done", False))


def _texts(result: Any) -> str:
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        texts = [c.get("text") for c in result["content"] if isinstance(c, dict) and c.get("type") == "text"]
        if texts and all(isinstance(t, str) for t in texts):
            return "\n".join(map(str, texts))
        result = result.get("data", result.get("structured_content"))
    return result if isinstance(result, str) else json.dumps(result, sort_keys=True, ensure_ascii=False)


def _fields(schema: dict) -> str:
    props = ((schema or {}).get("action") or {}).get("properties") or {}
    named = [f"{k} ({v.get('type', 'object')})" for k, v in props.items() if k != "metadata" and isinstance(v, dict)]
    return ", ".join(named) or "none"


class TextAdapter:
    """How the policy's text meets an OpenEnv env. Subclass it and name yours with rollout.openenv_adapter
    (module:Class, made once with the server's ``/schema``; its methods are called from several threads).

    - ``client``: the env's own ``EnvClient`` subclass (None: the generic dict client): its
      ``_step_payload(action)`` makes the step's JSON and ``_parse_result(data)`` reads the answer.
    - ``action(text)``: the action for the policy's text (a dict, or the env's Action: a pydantic model);
      by default ``{FIELD: text}`` for the action's one string field.
    - ``observation(obs)``: the text for an observation (a dict, or the client's Observation); :func:`render`.
    """

    client: type | None = None

    def __init__(self, schema: dict):
        self.schema, self.field = schema, text_field(schema)

    def action(self, text: str) -> Any:
        if self.field is None:
            raise OpenEnvError(f"the env's action has fields {_fields(self.schema)}, not one string field")
        return {self.field: text}

    def observation(self, observation: Any) -> str:
        return render(observation)


def read_schema(url: str) -> dict:
    """The server's ``/schema``; one ConfigError when it does not answer."""
    try:
        return get_json(url, "/schema", 10.0)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{KEY}: the OpenEnv server at {url} did not answer /schema ({_why(e)}); start it, or set "
                          "rollout.openenv_command to a command that serves it") from None


def load_adapter(spec: str | None, url: str, schema: dict | None = None) -> TextAdapter:
    """The adapter rollout.openenv_adapter names (None: TextAdapter), made with the server's /schema (read when not
    given); one ConfigError when the server does not answer, the adapter cannot be made, or nothing takes the text."""
    if schema is None:
        schema = read_schema(url)
    cls = TextAdapter
    if spec is not None:
        module_name, _, attr = spec.partition(":")
        cls = import_object(spec, module_name, attr, "rollout.openenv_adapter", ConfigError)
        if not (isinstance(cls, type) and issubclass(cls, TextAdapter)):
            raise ConfigError(f"rollout.openenv_adapter: {spec!r} is not a subclass of verlj.engine.rl.openenv_envs.TextAdapter")
    try:
        adapter = cls(schema)
    except Exception as e:  # noqa: BLE001 - the user's adapter: one sentence naming it
        raise ConfigError(f"rollout.openenv_adapter: making {spec} failed: {type(e).__name__}: {str(e).strip()[:200]}") from None
    if type(adapter).action is TextAdapter.action and adapter.client is None and adapter.field is None:
        raise ConfigError(f"{KEY}: the action of the OpenEnv env at {url} has fields {_fields(schema)}, not one string field for "
                          "the policy's text; name an adapter that makes it (rollout.openenv_adapter=module:Class, a TextAdapter subclass)")
    return adapter


def _why(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code}"
    reason = getattr(e, "reason", None)
    return str(reason if reason is not None else e).strip()[:120] or type(e).__name__


# ----------------------------------------------------------------------------- one episode, one session


class OpenEnvEnv:
    """One episode on the server: an Environment (rl.envs) whose step answers ``(observation, reward, done)``."""

    def __init__(self, url: str, adapter: TextAdapter, timeout_s: float, concurrent: int):
        self.url, self.adapter, self.timeout_s, self.concurrent = url, adapter, timeout_s, concurrent
        self._client = adapter.client(base_url=_http(url)) if adapter.client is not None else None
        self._ws: Any = None
        self._last_state: dict | None = None  # the state the session ended in (a done step), for state() after it

    def reset(self, row: dict, seed: int) -> str:
        self.open()
        data = {k: v for k, v in row.items() if v is not None}
        data["seed"] = int(seed)
        obs, _, _ = self._result(self._ask("reset", data))
        return obs

    def open(self) -> None:
        """A new session (the one before closed)."""
        self.close()
        self._last_state = None
        from websockets.sync.client import connect

        try:
            self._ws = connect(_ws(self.url) + "/ws", open_timeout=self.timeout_s, close_timeout=2, proxy=None, max_size=2**27)
        except TimeoutError:
            raise OpenEnvError(f"the OpenEnv server at {self.url} did not open a session in {self.timeout_s:g} s") from None
        except Exception as e:  # noqa: BLE001 - refused, reset, an HTTP answer that is no WebSocket: all one sentence
            raise OpenEnvError(f"the OpenEnv server at {self.url} is not answering ({_why(e)})") from None

    def step(self, action: str) -> tuple[str, float | None, bool]:
        if self._ws is None:
            raise OpenEnvError("step() before reset() or after the episode ended")
        act = self.adapter.action(action)
        payload = self._client._step_payload(act) if self._client is not None else act
        if hasattr(payload, "model_dump"):
            payload = payload.model_dump(mode="json", exclude_unset=True)
        out = self._result(self.ask_step(payload))
        if out[2]:
            self.finish()
        return out

    def ask_step(self, payload: Any) -> dict:
        """The server's answer to one step of `payload` (the action's JSON): ``{"observation", "reward", "done"}``."""
        if self._ws is None:
            raise OpenEnvError("step() before reset() or after the episode ended")
        return self._ask("step", payload)

    def finish(self) -> None:
        """The episode is done: the session ends, the state it ended in asked first (the rollout journals it)."""
        self._last_state = self.state()
        self.close()

    def state(self) -> dict:
        """The env's state (OpenEnv's ``state()``) as the server sends it, less its ``episode_id`` (OpenEnv's State
        has one, which an env made from OpenEnv's template draws from uuid4 at each reset: an identifier, not state,
        which would make the journal of a resumed run differ); after a done step, the state the episode ended in."""
        if self._ws is None:
            if self._last_state is None:
                raise OpenEnvError("state() before reset() or after the session closed")
            return self._last_state
        data = self._ask("state", None)
        return {k: v for k, v in data.items() if k != "episode_id"}

    def close(self) -> None:
        """End the session (the server frees it); nothing when there is none."""
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.send(json.dumps({"type": "close"}))
            except Exception:  # noqa: BLE001, S110 - closing a session that is gone already
                pass
            try:
                ws.close()
            except Exception:  # noqa: BLE001, S110
                pass

    def __del__(self) -> None:  # the rollout drops an env whose episode ended (max_turns, a fault): its session ends too
        self.close()

    def _ask(self, kind: str, data: Any) -> Any:
        from websockets.exceptions import ConnectionClosed

        message = {"type": kind} if data is None else {"type": kind, "data": data}
        try:
            text = json.dumps(message, default=_jsonable)
        except TypeError as e:
            raise OpenEnvError(f"the {kind} could not be sent as JSON ({e})") from None
        try:
            try:
                self._ws.send(text)
            except ConnectionClosed:
                pass  # the server closed it with a word, maybe (a full server: CAPACITY_REACHED): read it
            raw = self._ws.recv(timeout=self.timeout_s)
        except TimeoutError:
            raise OpenEnvError(f"the OpenEnv server at {self.url} did not answer a {kind} in {self.timeout_s:g} s") from None
        except (ConnectionClosed, OSError) as e:
            raise OpenEnvError(f"the OpenEnv server at {self.url} closed the session during a {kind} ({_why(e)})") from None
        try:
            reply = json.loads(raw)
        except ValueError:
            raise OpenEnvError(f"the OpenEnv server at {self.url} answered a {kind} with something that is not JSON") from None
        if not isinstance(reply, dict):
            raise OpenEnvError(f"the OpenEnv server at {self.url} answered a {kind} with a JSON {type(reply).__name__}, not an object")
        if reply.get("type") == "error":
            raise OpenEnvError(self._error(kind, reply.get("data") or {}))
        expected = "state" if kind == "state" else "observation"
        if reply.get("type") != expected or not isinstance(reply.get("data"), dict):
            raise OpenEnvError(f"the OpenEnv server at {self.url} answered a {kind} with a {str(reply.get('type'))[:40]!r} message, not {expected!r}")
        return reply["data"]

    def _error(self, kind: str, data: dict) -> str:
        code, message = str(data.get("code", "")), str(data.get("message", "")).strip().splitlines()
        if code == "CAPACITY_REACHED":
            return (f"the OpenEnv server at {self.url} is full: max_concurrent_envs={data.get('max_sessions')}, and this run plays up to "
                    f"{self.concurrent} episodes at once; serve it with max_concurrent_envs={self.concurrent} or more")
        return f"the OpenEnv server at {self.url} answered the {kind} with an error ({code or 'no code'}): {(message or [''])[0][:200]}"

    def _result(self, data: dict) -> tuple[str, float | None, bool]:
        if self._client is not None:
            try:
                got = self._client._parse_result(data)
            except Exception as e:  # noqa: BLE001 - the env's own client on the server's answer
                raise OpenEnvError(f"{type(self._client).__name__}._parse_result raised {type(e).__name__}: {str(e)[:160]}") from None
            obs, reward, done = got.observation, got.reward, got.done
        else:
            obs, reward, done = data.get("observation", {}), data.get("reward"), data.get("done", False)
        if isinstance(reward, bool):  # OpenEnv's Observation allows a bool reward: True is 1.0
            reward = float(reward)
        return self.adapter.observation(obs), reward, done


class McpEnv:
    """One episode on an OpenEnv MCP env (its action CallToolAction): its tools, listed once at reset, offered to the
    policy through the chat template as a TRL class's are (rl.trl_envs); each hermes tool call a CallToolAction step,
    its result a tool message; the reward and done the steps'. An action without a tool call ends the episode."""

    def __init__(self, session: OpenEnvEnv, render: Callable, tok: Any, max_prompt: int):
        self.session, self.render, self.tok, self.max_prompt = session, render, tok, max_prompt
        self.tools: dict[str, dict] = {}  # name -> its schema for the chat template, as the server listed them
        self.turns, self.over = 0, True

    def reset(self, row: dict, seed: int) -> Prompt:
        first = self.session.reset(row, seed)
        self.tools = mcp_tools(self.session.ask_step(LIST_TOOLS))
        self.turns, self.over = 0, False
        return tool_prompt(self.render, self.tok, joined(prompt_of(row), first), list(self.tools.values()), self.max_prompt)

    def step(self, action: str) -> tuple[str, float | None, bool]:
        if self.over:
            raise OpenEnvError("step() before reset() or after the episode ended")
        self.turns += 1
        _, named = tool_calls(action, self.turns)
        if not named:  # an answer: the episode ends as TRL's loop ends it, the server not stepped
            return self._end("", None)
        messages, total, done = [], None, False
        for name, arguments in named:
            content, reward, done = self._dispatch(name, arguments)
            messages.append({"role": "tool", "name": name, "content": content})
            total = total if reward is None else (total or 0.0) + float(reward)
            if done:  # the env ended the episode: the calls after it are not made
                break
        suffix = tool_suffix(self.render, self.tok, messages, named[0][0])
        return self._end(suffix, total) if done else (suffix, total, False)

    def _dispatch(self, name: str, arguments: dict) -> tuple[str, float | None, bool]:
        """One call: a tool the server did not list is answered here as TRL answers it, never sent."""
        if name not in self.tools:
            return str({"error": f"Tool {name} not found."}), None, False
        return mcp_result(self.session.ask_step(call_tool(name, arguments)))

    def _end(self, text: str, reward: float | None) -> tuple[str, float | None, bool]:
        self.over = True
        self.session.finish()
        return text, reward, True

    def state(self) -> dict:
        return self.session.state()

    def close(self) -> None:
        self.session.close()


def _jsonable(value: Any) -> Any:
    """A row's numpy values as JSON (a verl file's extra_info)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


# ----------------------------------------------------------------------------- the factory

_PROBED: set[tuple[str, int]] = set()


def probe_capacity(url: str, sessions: int, timeout_s: float) -> None:
    """Open `sessions` sessions at once and ask each for its state: one ConfigError when the server refuses
    one for its max_concurrent_envs (once a process and URL; rank 0 only: the ranks share the server)."""
    if (url, sessions) in _PROBED or os.environ.get("RANK", "0") != "0":
        return
    adapter = TextAdapter({})
    envs = [OpenEnvEnv(url, adapter, timeout_s, sessions) for _ in range(sessions)]

    def ask(env: OpenEnvEnv) -> str:  # the session stays open: all of them at once
        try:
            env.open()
            env.state()
            return ""
        except OpenEnvError as e:
            return str(e)

    try:
        with ThreadPoolExecutor(min(sessions, 32)) as pool:
            said = list(pool.map(ask, envs))
    finally:
        for env in envs:
            env.close()
    refused = [s for s in said if " is full: max_concurrent_envs=" in s]
    if refused:
        raise ConfigError(f"{KEY}: {refused[0]}")
    _PROBED.add((url, sessions))


def concurrent_episodes(cfg) -> int:
    """The most episodes the run plays at once: a step's (data.prompts_per_step x rollout.n), or the held-out
    eval's when it is more (data.eval_size, with trainer.eval_interval)."""
    held = int(cfg.data.eval_size) if cfg.trainer.eval_interval else 0
    return max(int(cfg.data.prompts_per_step) * int(cfg.rollout.n), held)


def make_factory(cfg, on_actor: bool = False):
    """What makes an episode's env for ``rollout.env=openenv:URL``: the server started (rollout.openenv_command)
    and healthy, its /schema read into the adapter, its capacity checked against the run's concurrent episodes.
    On a fleet's actor (`on_actor`) the trainer has done the starting and the checking: the actor only connects."""
    try:
        import websockets.sync.client  # noqa: F401
    except ImportError:
        raise ConfigError(f"{KEY}=openenv:URL needs the websockets client: pip install 'verlj[openenv]'") from None
    ro = cfg.rollout
    url = server_url(ro.env)
    if on_actor:
        if not healthy(url):
            raise ConfigError(f"{KEY}: no OpenEnv server answers {url}/health from the fleet's actor on {socket.gethostname()}; "
                              "actors on other machines than the trainer's need a URL they reach")
    elif ro.openenv_command is not None:
        serve(url, ro.openenv_command)
    elif not healthy(url):
        raise ConfigError(f"{KEY}: no OpenEnv server answers {url}/health; start it, or set rollout.openenv_command to a command "
                          "that serves it")
    schema = read_schema(url)
    mcp = mcp_actions(schema) and ro.openenv_adapter is None
    adapter = TextAdapter(schema) if mcp else load_adapter(ro.openenv_adapter, url, schema)
    concurrent = concurrent_episodes(cfg)
    if not on_actor:  # (actors probing at once would fill the server with their probes)
        probe_capacity(url, concurrent, ro.env_timeout_s)
    if not mcp:
        return lambda: OpenEnvEnv(url, adapter, ro.env_timeout_s, concurrent)
    tok, render = template_of(cfg)
    max_prompt = cfg.data.max_prompt_length
    return lambda: McpEnv(OpenEnvEnv(url, adapter, ro.env_timeout_s, concurrent), render, tok, max_prompt)
