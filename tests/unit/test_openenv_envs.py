"""rl.openenv_envs without OpenEnv: observations rendered to text, the action's one string field, adapters, and a
session against a scripted WebSocket server speaking OpenEnv's wire protocol (reset, step, state, close), each way
a server fails (down, no answer, an error reply, a reply of no known form, a full server) one sentence, and an env
fault through safe_reset / safe_step; an MCP env's session (list_tools and call_tool steps): its tools in the prompt, a
call and its result as a tool message, an unknown tool, an answer ending the episode. The real servers:
tests/integration/test_openenv.py."""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass

import pytest
from websockets.sync.server import serve as ws_serve

from verlj.engine.config import config_from_dict
from verlj.engine.errors import ConfigError
from verlj.engine.rl import openenv_envs as oe
from verlj.engine.rl.envs import EnvFault, Environment, safe_reset, safe_step
from verlj.engine.rl.trl_envs import Prompt
from verlj_testing import free_port

SCHEMA = {"action": {"properties": {"guess": {"type": "string"}, "metadata": {"type": "object"}}, "required": ["guess"]}}


def test_render_takes_one_text_field_as_it_is_and_several_as_lines():
    assert oe.render({"message": "higher", "done": False, "reward": None, "metadata": {"k": 1}}) == "higher"
    assert oe.render({"message": "hi", "echoed": "", "length": None}) == "hi"  # empty fields are not text
    assert oe.render({"stdout": "4\n", "exit_code": 0, "files": ["a", "b"]}) == 'stdout: 4\n\nexit_code: 0\nfiles: ["a", "b"]'
    assert oe.render({"board": {"b": 1, "a": 2}}) == 'board: {"a": 2, "b": 1}'
    assert oe.render({"n": 3}) == "n: 3" and oe.render({}) == "" and oe.render("as is") == "as is"

    @dataclass
    class Model:  # a pydantic Observation as the env's own client parses it: model_dump
        message: str
        reward: float

        def model_dump(self, mode: str) -> dict:
            return {"message": self.message, "reward": self.reward}

    assert oe.render(Model("lower", 1.0)) == "lower"


@pytest.mark.parametrize(("props", "required", "field"), [
    ({"guess": {"type": "string"}, "metadata": {"type": "object"}}, ["guess"], "guess"),
    ({"message": {"type": "string"}}, [], "message"),
    ({"a": {"type": "string"}, "b": {"type": "string"}}, [], None),  # two: which one?
    ({"code": {"type": "string"}, "timeout": {"type": "integer"}}, ["code", "timeout"], None),  # another required field
    ({"code": {"type": "string"}, "timeout": {"type": "integer"}}, ["code"], "code"),  # an optional one keeps its default
    ({"move": {"type": "integer"}}, ["move"], None),
])
def test_the_action_takes_the_text_in_its_one_string_field(props, required, field):
    assert oe.text_field({"action": {"properties": props, "required": required}}) == field
    assert oe.text_field({}) is None and oe.text_field([]) is None


@pytest.mark.parametrize("spec", ["openenv:http://127.0.0.1:8765", "openenv:https://envs.example.org/", "openenv:ws://h:1"])
def test_a_server_url_is_http_or_ws_with_a_host(spec):
    assert oe.server_url(spec) == spec[len("openenv:"):].rstrip("/")


@pytest.mark.parametrize("spec", ["openenv:", "openenv:localhost:8765", "openenv:ftp://h", "openenv:http://", "openenv:http://h/?a=1"])
def test_a_bad_server_url_is_one_config_error(spec):
    with pytest.raises(ConfigError, match=r"rollout.env=openenv:URL needs the server's address, e.g. openenv:http://127.0.0.1:8765"):
        oe.server_url(spec)


def test_the_openenv_keys_apply_to_an_openenv_env_only():
    with pytest.raises(ConfigError, match="rollout.openenv_command and rollout.openenv_adapter apply to rollout.env=openenv:URL only"):
        config_from_dict({"rollout": {"env": "builtin:guess", "max_turns": 3, "openenv_command": "python serve.py"}})
    config_from_dict({"rollout": {"env": "openenv:http://127.0.0.1:8765", "max_turns": 3, "openenv_command": "python serve.py"}})


def test_an_action_of_no_one_string_field_needs_an_adapter(monkeypatch):
    monkeypatch.setattr(oe, "get_json", lambda url, path, timeout_s=5.0: {"action": {"properties": {"x": {"type": "integer"},
                                                                                                     "y": {"type": "integer"}}}})
    with pytest.raises(ConfigError) as e:
        oe.load_adapter(None, "http://h:1")
    assert str(e.value) == ("rollout.env: the action of the OpenEnv env at http://h:1 has fields x (integer), y (integer), not one string "
                            "field for the policy's text; name an adapter that makes it (rollout.openenv_adapter=module:Class, a TextAdapter subclass)")


class Move(oe.TextAdapter):
    """The policy's text as an (x, y) move."""

    def action(self, text: str) -> dict:
        x, _, y = text.partition(",")
        return {"x": int(x), "y": int(y)}


def test_an_adapter_is_named_by_module_and_class(monkeypatch):
    monkeypatch.setattr(oe, "get_json", lambda url, path, timeout_s=5.0: {"action": {"properties": {"x": {"type": "integer"}}}})
    monkeypatch.setitem(sys.modules, "my_adapters", sys.modules[__name__])
    assert oe.load_adapter("my_adapters:Move", "http://h:1").action("3,4") == {"x": 3, "y": 4}
    with pytest.raises(ConfigError, match=r"rollout.openenv_adapter: 'my_adapters:SCHEMA' is not a subclass of verlj.engine.rl.openenv_envs.TextAdapter"):
        oe.load_adapter("my_adapters:SCHEMA", "http://h:1")
    with pytest.raises(ConfigError, match=r"rollout.openenv_adapter: cannot import 'no_such_module:A'"):
        oe.load_adapter("no_such_module:A", "http://h:1")


def test_a_server_that_is_not_there_is_one_config_error():
    port = free_port()
    with pytest.raises(ConfigError, match=rf"rollout.env: the OpenEnv server at http://127.0.0.1:{port} did not answer /schema \(.*\); start it, "
                                          "or set rollout.openenv_command to a command that serves it"):
        oe.load_adapter(None, f"http://127.0.0.1:{port}")


# ----------------------------------------------------------------------------- a scripted server


class Scripted:
    """A WebSocket server on /ws that answers as OpenEnv's does, or as `how` says it goes wrong; it records what it got."""

    def __init__(self, how: str = "ok"):
        self.how, self.got, self.closed = how, [], 0
        self.server = ws_serve(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.socket.getsockname()[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, ws) -> None:
        if self.how == "full":
            ws.send(json.dumps({"type": "error", "data": {"message": "Server at capacity (4/4 sessions)", "code": "CAPACITY_REACHED",
                                                          "active_sessions": 4, "max_sessions": 4}}))
            return
        turns = 0
        for raw in ws:
            msg = json.loads(raw)
            self.got.append(msg)
            kind = msg["type"]
            if kind == "close":
                self.closed += 1
                return
            if self.how == "hang":
                continue
            if self.how == "garbage":
                ws.send("<html>not json</html>")
            elif self.how == "error" and kind == "step":
                ws.send(json.dumps({"type": "error", "data": {"message": "Invalid message\nmore", "code": "EXECUTION_ERROR"}}))
            elif self.how == "wrong" and kind == "step":
                ws.send(json.dumps({"type": "state", "data": {}}))
            elif kind == "state":
                ws.send(json.dumps({"type": "state", "data": {"episode_id": f"uuid-{time.monotonic_ns()}", "step_count": turns}}))
            elif kind == "reset":
                ws.send(json.dumps({"type": "observation", "data": {"observation": {"message": "rules"}, "reward": None, "done": False}}))
            else:
                turns += 1
                ws.send(json.dumps({"type": "observation", "data": {"observation": {"message": f"got {msg['data']['guess']}"},
                                                                    "reward": True if turns == 2 else None, "done": turns == 2}}))

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def scripted():
    made = []

    def make(how: str = "ok") -> Scripted:
        made.append(Scripted(how))
        return made[-1]

    yield make
    for s in made:
        s.close()


def eventually(ok, wait_s: float = 5.0) -> bool:
    """ok() once it holds (the server's thread reads what the client sent), False after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while not ok() and time.monotonic() < deadline:
        time.sleep(0.01)
    return ok()


def env_on(server: Scripted, timeout_s: float = 5.0) -> oe.OpenEnvEnv:
    return oe.OpenEnvEnv(server.url, oe.TextAdapter(SCHEMA), timeout_s, 16)


def test_an_episode_is_one_session_reset_with_the_seed_and_the_row(scripted):
    server = scripted()
    env = env_on(server)
    assert isinstance(env, Environment)
    assert env.reset({"prompt": "guess", "answer": "3", "entry": None}, 2**62 + 5) == "rules"
    assert env.state() == {"step_count": 0}  # its episode_id (a uuid, as OpenEnv's template draws it) is no state: left out
    assert env.step("five") == ("got five", None, False)
    assert env.step("6") == ("got 6", 1.0, True)  # a bool reward is a number; done closes the session, its last state asked first
    assert server.got[0] == {"type": "reset", "data": {"prompt": "guess", "answer": "3", "seed": 2**62 + 5}}
    assert eventually(lambda: server.closed == 1)
    assert server.got[2:] == [{"type": "step", "data": {"guess": "five"}}, {"type": "step", "data": {"guess": "6"}}, {"type": "state"},
                              {"type": "close"}]
    assert env.state() == {"step_count": 2}  # the state the episode ended in, after its session closed
    with pytest.raises(oe.OpenEnvError, match=r"step\(\) before reset\(\) or after the episode ended"):
        env.step("7")
    with pytest.raises(oe.OpenEnvError, match=r"state\(\) before reset\(\) or after the session closed"):
        env_on(server).state()


def test_an_env_dropped_mid_episode_closes_its_session(scripted):
    server = scripted()
    env = env_on(server)
    env.reset({}, 1)
    del env  # the rollout drops the env of an episode that ended by max_turns or a fault
    assert eventually(lambda: server.closed == 1)


def test_the_envs_own_client_class_makes_the_payload_and_reads_the_answer(scripted):
    @dataclass
    class Result:
        observation: dict
        reward: float | None
        done: bool

    class GuessClient:  # what an OpenEnv EnvClient subclass offers: made with base_url, never connected here
        def __init__(self, base_url: str):
            self.base_url = base_url

        def _step_payload(self, action: dict) -> dict:
            return {"guess": action["text"].upper()}

        def _parse_result(self, payload: dict) -> Result:
            return Result(payload["observation"], 0.5, payload["done"])

    class Adapter(oe.TextAdapter):
        client = GuessClient

        def action(self, text: str) -> dict:
            return {"text": text}

    server = scripted()
    env = oe.OpenEnvEnv(server.url, Adapter(SCHEMA), 5.0, 16)
    env.reset({}, 1)
    assert env.step("abc") == ("got ABC", 0.5, False)


@pytest.mark.parametrize(("how", "reason"), [
    ("error", "the OpenEnv server at {url} answered the step with an error (EXECUTION_ERROR): Invalid message"),
    ("garbage", "the OpenEnv server at {url} answered a step with something that is not JSON"),
    ("wrong", "the OpenEnv server at {url} answered a step with a 'state' message, not 'observation'"),
    ("hang", "the OpenEnv server at {url} did not answer a step in 0.3 s"),
])
def test_a_server_that_answers_wrong_is_an_env_fault_of_one_sentence(scripted, how, reason):
    server = scripted("ok" if how == "hang" else how)
    env = env_on(server, 0.3)
    assert safe_reset(env, {}, 1, 5.0) == ("" if how == "garbage" else "rules") or how == "garbage"
    if how == "hang":
        server.how = "hang"
    got = safe_step(env, "4", 5.0)
    assert got == EnvFault("raised OpenEnvError: " + reason.format(url=server.url)), got


def test_a_server_that_is_down_or_full_is_an_env_fault_naming_what_to_do(scripted):
    port = free_port()
    got = safe_reset(oe.OpenEnvEnv(f"http://127.0.0.1:{port}", oe.TextAdapter(SCHEMA), 2.0, 16), {}, 1, 5.0)
    assert isinstance(got, EnvFault) and got.reason.startswith(f"raised OpenEnvError: the OpenEnv server at http://127.0.0.1:{port} is not answering (")
    server = scripted("full")
    got = safe_reset(env_on(server), {}, 1, 5.0)
    assert got == EnvFault(f"raised OpenEnvError: the OpenEnv server at {server.url} is full: max_concurrent_envs=4, and this run plays up "
                           "to 16 episodes at once; serve it with max_concurrent_envs=16 or more")
    with pytest.raises(ConfigError, match=r"^rollout.env: the OpenEnv server at .* is full: max_concurrent_envs=4, and this run plays up to 16"):
        oe.probe_capacity(server.url, 16, 5.0)


def test_a_command_that_exits_before_it_serves_is_one_config_error():
    port = free_port()
    command = f"{sys.executable} -c \"import sys; print('no env here', file=sys.stderr); sys.exit(3)\""
    with pytest.raises(ConfigError) as e:
        oe.serve(f"http://127.0.0.1:{port}", command)
    assert str(e.value) == f"rollout.openenv_command {command!r} exited with code 3 before it served http://127.0.0.1:{port}: no env here"


HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(b'{"status": "healthy"}')
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_command_is_started_once_health_checked_and_stopped(tmp_path):
    port, script = free_port(), tmp_path / "healthy.py"
    script.write_text(HEALTHY)
    url = f"http://127.0.0.1:{port}"
    oe.serve(url, f"{sys.executable} {script} {port}")
    try:
        proc = oe._SERVED[url]
        assert oe.healthy(url) and proc.poll() is None
        oe.serve(url, f"{sys.executable} {script} {port}")  # once a process
        assert oe._SERVED[url] is proc
    finally:
        oe._stop(oe._SERVED.pop(url))
    assert proc.returncode is not None and not oe.healthy(url)


# ----------------------------------------------------------------------------- an MCP env: its tools offered as tools

ADD = {"name": "add", "description": "Add two integers.", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                                        "b": {"type": "integer"}}}}
MCP_SCHEMA = {"action": {"properties": {"metadata": {"type": "object"}, "type": {"const": "call_tool", "default": "call_tool", "type": "string"},
                                        "tool_name": {"type": "string"}, "arguments": {"type": "object"}},
                         "required": ["tool_name"], "title": "CallToolAction"}}


class ScriptedMcp(Scripted):
    """An MCPEnvironment's session as OpenEnv's server answers it: list_tools and call_tool steps (``add`` its one tool:
    a sum of 7 scores 1.0 and ends the episode; a tool it lacks answered as FastMCP's error)."""

    def handle(self, ws) -> None:
        steps = 0
        for raw in ws:
            msg = json.loads(raw)
            self.got.append(msg)
            kind, data = msg["type"], msg.get("data") or {}
            if kind == "close":
                self.closed += 1
                return
            if kind == "state":
                ws.send(json.dumps({"type": "state", "data": {"episode_id": None, "step_count": steps}}))
                continue
            if kind == "reset":
                obs, reward, done = {"hint": " Use the add tool."}, None, False
            elif data["type"] == "list_tools":
                obs, reward, done = {"tools": [ADD]}, None, False
            elif data["tool_name"] != "add":
                obs, reward, done = {"tool_name": data["tool_name"], "result": None,
                                     "error": {"error_type": "tool_not_found", "message": f"Unknown tool: '{data['tool_name']}'"}}, None, False
            else:
                total = data["arguments"]["a"] + data["arguments"]["b"]
                obs = {"tool_name": "add", "error": None, "result": {"content": [{"type": "text", "text": str(total)}], "data": total,
                                                                     "is_error": False}}
                reward, done = (1.0, True) if total == 7 else (None, False)
            steps += kind == "step"
            ws.send(json.dumps({"type": "observation", "data": {"observation": obs, "reward": reward, "done": done}}))


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@pytest.fixture
def mcp_env(bpe_model):
    from transformers import AutoTokenizer

    from verlj.engine.rl.models import chat_template

    server = ScriptedMcp()
    tok = AutoTokenizer.from_pretrained(bpe_model)
    yield server, oe.McpEnv(oe.OpenEnvEnv(server.url, oe.TextAdapter(MCP_SCHEMA), 5.0, 16), chat_template(tok, False), tok, 0)
    server.close()


def test_an_mcp_env_is_known_by_its_action_and_its_tools_are_listed_once_into_the_prompt(mcp_env):
    assert oe.mcp_actions(MCP_SCHEMA) and not oe.mcp_actions(SCHEMA) and not oe.mcp_actions({})
    assert oe.text_field(MCP_SCHEMA) is None  # two strings: no text field, no adapter needed for its tools
    server, env = mcp_env
    prompt = env.reset({"prompt": "3+4=", "answer": "7"}, 9)
    assert isinstance(prompt, Prompt) and prompt.endswith("<|im_start|>user\n3+4= Use the add tool.<|im_end|>\n<|im_start|>assistant\n")
    assert ('{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {"type": "object", '
            '"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}') in prompt  # MCP's input_schema, the parameters
    assert server.got == [{"type": "reset", "data": {"prompt": "3+4=", "answer": "7", "seed": 9}}, {"type": "step", "data": {"type": "list_tools"}}]
    assert env.state() == {"step_count": 1}


def test_a_call_is_a_call_tool_step_and_its_result_a_tool_message_the_steps_reward_and_done_its(mcp_env):
    server, env = mcp_env
    env.reset({"prompt": "3+4="}, 1)
    assert env.step(call("add", a=2, b=3)) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n", None, False)
    assert env.step("Let me add. " + call("add", a=3, b=4)) == ("\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
                                                               "<|im_start|>assistant\n", 1.0, True)
    assert [m["data"] for m in server.got[2:4]] == [{"type": "call_tool", "tool_name": "add", "arguments": {"a": 2, "b": 3}},
                                                     {"type": "call_tool", "tool_name": "add", "arguments": {"a": 3, "b": 4}}]
    assert eventually(lambda: server.closed == 1) and server.got[-2:] == [{"type": "state"}, {"type": "close"}]  # done: its state, then closed
    assert env.state() == {"step_count": 3}
    with pytest.raises(oe.OpenEnvError, match=r"step\(\) before reset\(\) or after the episode ended"):
        env.step(call("add", a=1, b=1))


def test_a_tool_the_env_did_not_list_or_a_call_that_fails_is_an_error_tool_message(mcp_env):
    server, env = mcp_env
    env.reset({"prompt": "3+4="}, 1)
    said = "\n<|im_start|>user\n<tool_response>\n{'error': 'Tool mul not found.'}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert env.step(call("mul", a=2, b=3)) == (said, None, False)  # answered here, as TRL answers it: never sent
    assert len(server.got) == 2
    env.tools["sub"] = env.tools["add"]  # listed, yet the server fails the call: its error, as TRL words a tool that raised
    assert env.step(call("sub", a=2)) == (said.replace("'Tool mul not found.'", "\"Unknown tool: 'sub'\""), None, False)
    assert oe.mcp_result({"observation": {"tool_name": "t", "result": {"content": [{"type": "text", "text": "boom"}], "is_error": True}},
                          "reward": False, "done": False}) == ("{'error': 'boom'}", 0.0, False)
    assert oe.mcp_result({"observation": {"tool_name": "t", "result": {"content": [], "data": [1, 2]}}}) == ("[1, 2]", None, False)


def test_an_answer_without_a_tool_call_ends_the_episode_the_server_not_stepped(mcp_env):
    server, env = mcp_env
    env.reset({"prompt": "3+4="}, 1)
    assert env.step("7") == ("", None, True)
    assert eventually(lambda: server.closed == 1)
    assert [m["type"] for m in server.got] == ["reset", "step", "state", "close"]
    assert env.state() == {"step_count": 1}
