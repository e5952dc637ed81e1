"""Tools through the journal (rl.gateway.tools, rollout.tools) without a trainer: Python functions served over MCP at
episode.mcp_url to the real `mcp` client, each call made durable as sent before its tool runs and with its result before its
caller is answered; a re-run after a crash answered from the journal and never sent again (external), run again (restorable);
an external call sent and never answered reconciled, or its episode unresolved; the idempotency key the same on every
attempt."""

from __future__ import annotations

import asyncio
import json

import httpx2
import openai
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from test_gateway import MODEL, TOK, Scripted

from verlj.engine.config import ConfigError
from verlj.engine.rl.gateway.agents import AgentEpisode
from verlj.engine.rl.gateway.prompts import Prompts
from verlj.engine.rl.gateway.runner import Episodes, Runner, Settings
from verlj.engine.rl.gateway.server import Gateway
from verlj.engine.rl.gateway.tools import as_tool, load_tools, tool
from verlj.engine.rl.models import chat_template
from verlj.engine.schema.agent_calls import AgentCalls, ToolCall

APPLIED: list[tuple[str, str]] = []  # (key, title) of every effect applied, as an outside service would see them
RECONCILE: dict = {"answer": None}


def _reconcile(key: str, arguments: dict):
    return RECONCILE["answer"]


@tool(effect="external", reconcile=_reconcile)
def create_ticket(title: str, idempotency_key: str) -> dict:
    """Open a ticket (an effect outside the episode)."""
    APPLIED.append((idempotency_key, title))
    return {"ticket": len(APPLIED), "title": title}


@tool(effect="external")
def send(text: str) -> str:
    APPLIED.append(("send", text))
    return "sent"


@tool(effect="restorable")
def move(steps: int) -> str:
    APPLIED.append(("move", str(steps)))
    return f"moved {steps}"


@tool(effect="external")
def slow(text: str) -> str:
    import time

    time.sleep(1.5)
    APPLIED.append(("slow", text))
    return "late"


def boom(x: int) -> str:
    raise RuntimeError("the service is down")


async def mcp_calls(ep: AgentEpisode, calls: list[tuple[str, dict]]) -> list:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {ep.api_key}"}) as hc, \
            streamable_http_client(ep.mcp_url, http_client=hc) as streams, ClientSession(streams[0], streams[1]) as s:
        await s.initialize()
        listed = (await s.list_tools()).tools
        out = [await s.call_tool(name, args) for name, args in calls]
    return [listed, out]


def agent(calls: list[tuple[str, dict]], seen: list):
    def run(ep: AgentEpisode) -> float:
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        first = client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": ep.row["prompt"]}], max_tokens=4)
        seen.append(asyncio.run(mcp_calls(ep, [(n, {**a, "title": f"{a['title']} {first.choices[0].message.content}"} if "title" in a else a)
                                               for n, a in calls])))
        return 1.0
    return run


class Sink:
    """A durable log in a list: each write as it came (place, position, the call's state)."""

    def __init__(self):
        self.writes: list[tuple[int, int, ToolCall, list]] = []

    def keep_tool(self, place, k, call, dropped):
        self.writes.append((place, k, call, dropped))


def runner(fn, tools) -> tuple[Runner, Gateway]:
    gw = Gateway(MODEL, load_tools(tools)).start()
    return Runner(gw, fn, Prompts(TOK, chat_template(TOK, True), 0), Scripted({}), Settings(2, 10.0, 3)), gw


def episodes(n: int, **kw) -> Episodes:
    return Episodes([{"prompt": f"row {i}"} for i in range(n)], [100 + i for i in range(n)], list(range(n)), lambda place, k: 1000 * place + k,
                    tool_key=lambda place, k: f"run-e{place}-t{k}", **kw)


TOOLS = ["test_gateway_tools:create_ticket", "test_gateway_tools:send", "test_gateway_tools:move",
         "test_gateway_tools:boom", "test_gateway_tools:slow"]


@pytest.fixture
def served():
    APPLIED.clear()
    RECONCILE["answer"] = None
    made = []
    yield made
    for gw in made:
        gw.stop()


def test_tools_are_served_over_mcp_and_every_call_is_durable_as_sent_then_done_before_its_answer(served):
    seen: list = []
    r, gw = runner(agent([("create_ticket", {"title": "bug"}), ("boom", {"x": 1})], seen), TOOLS)
    served.append(gw)
    sink = Sink()
    played = r.play(episodes(2, tool_sink=sink))
    listed, out = seen[0]
    assert {t.name: t.input_schema["required"] for t in listed} == {"create_ticket": ["title"], "send": ["text"], "move": ["steps"], "boom": ["x"],
                                                                    "slow": ["text"]}
    assert next(t for t in listed if t.name == "create_ticket").description == "Open a ticket (an effect outside the episode)."
    first, failed = out
    assert json.loads(first.content[0].text)["title"].startswith("bug ") and first.meta == {"idempotency_key": first.meta["idempotency_key"]}
    assert failed.is_error and failed.content[0].text == "RuntimeError: the service is down"  # a tool that raises: its caller is told
    assert sorted(k for k, _ in APPLIED) == ["run-e0-t0", "run-e1-t0"]  # each episode's key, given to the function
    # per call two writes: sent (no result: from here on its outcome is unknown), then done with its result
    for place in (0, 1):
        mine = [(k, c.state, c.result) for p, k, c, _ in sink.writes if p == place]
        assert [(k, s) for k, s, _ in mine] == [(0, "sent"), (0, "done"), (1, "sent"), (1, "done")] and mine[0][2] == ""
        assert [t.key for t in played[place].tools] == [f"run-e{place}-t0", f"run-e{place}-t1"]
    assert played[0].tools[1].error and r.counts.tool_calls == 4
    rec = AgentCalls(tuple(played[0].calls), (0,), 1.0, 1, tuple(played[0].tools))
    back = AgentCalls.from_json(rec.to_json())
    assert back.tools == rec.tools and back.to_json() == rec.to_json()
    assert '"tools"' not in AgentCalls(tuple(played[0].calls), (0,), 1.0, 1).to_json()  # none: the text it always was


def test_a_rerun_is_answered_from_the_journal_never_sending_an_external_call_twice_and_restorable_calls_run_again(served):
    seen: list = []
    calls = [("create_ticket", {"title": "bug"}), ("move", {"steps": 2})]
    r, gw = runner(agent(calls, seen), TOOLS)
    served.append(gw)
    sink = Sink()
    first = r.play(episodes(1, tool_sink=sink))
    # an external call durable as sent then done; a restorable one (run again after a crash anyway) only once it is done
    assert [(k, c.name, c.state) for _, k, c, _ in sink.writes] == [(0, "create_ticket", "sent"), (0, "create_ticket", "done"), (1, "move", "done")]
    assert APPLIED == [("run-e0-t0", f"bug {json.loads(seen[0][1][0].content[0].text)['title'].split(' ', 1)[1]}"), ("move", "2")]
    again = r.play(episodes(1, journaled_tools={0: first[0].tools}, attempts=[2]))
    assert len(APPLIED) == 3 and APPLIED[2] == ("move", "2")  # the ticket is not opened again; the restorable move is made again
    assert [c.content[0].text for c in seen[1][1]] == [c.content[0].text for c in seen[0][1]]  # the same answers, byte for byte
    assert [t.attempt for t in again[0].tools] == [1, 2] and r.counts.tool_calls_from_journal == 1


def test_an_external_call_sent_before_a_crash_is_reconciled_or_its_episode_is_unresolved(served, capsys):
    seen: list = []
    r, gw = runner(agent([("create_ticket", {"title": "bug"})], seen), TOOLS)
    served.append(gw)
    first = r.play(episodes(1))
    sent = [ToolCall(t.name, t.arguments, t.digest, t.key, t.effect, 1) for t in first[0].tools]  # journaled as sent, no result
    APPLIED.clear()
    RECONCILE["answer"] = {"ticket": 7, "title": "found by its key"}  # the service says it was applied
    sink = Sink()
    got = r.play(episodes(1, journaled_tools={0: sent}, attempts=[2], tool_sink=sink))
    assert APPLIED == [] and got[0].tools[0].state == "reconciled" and json.loads(got[0].tools[0].result)["ticket"] == 7
    assert [c.state for _, _, c, _ in sink.writes] == ["reconciled"] and not got[0].unresolved and got[0].reward == 1.0
    RECONCILE["answer"] = None  # it says it was not applied: sent now, with the same key
    got = r.play(episodes(1, journaled_tools={0: sent}, attempts=[3]))
    assert [k for k, _ in APPLIED] == ["run-e0-t0"] and got[0].tools[0].state == "done"
    # a tool without a reconcile: the episode ends unresolved, never trained, its key named
    r2, gw2 = runner(agent([("send", {"text": "hi"})], []), TOOLS)
    served.append(gw2)
    first = r2.play(episodes(1))
    APPLIED.clear()
    sent = [ToolCall(t.name, t.arguments, t.digest, t.key, t.effect, 1) for t in first[0].tools]
    got = r2.play(episodes(1, journaled_tools={0: sent}, attempts=[2]))
    assert APPLIED == [] and got[0].unresolved.startswith("tool call 0 (send, key run-e0-t0) was sent before a crash and its outcome is unknown")
    assert got[0].reward is None and r2.counts.unresolved == 1 and "is unresolved" in capsys.readouterr().err
    assert got[0].tools == sent  # kept with its episode as journaled: sent, its outcome unknown


def test_a_call_that_differs_from_the_journaled_one_is_a_divergence_and_goes_on_live(served, capsys):
    seen: list = []
    r, gw = runner(agent([("send", {"text": "a"})], seen), TOOLS)
    served.append(gw)
    other = ToolCall("send", '{"text":"b"}', "0" * 64, "run-e0-t0", "external", 1, "done", "sent")
    sink = Sink()
    got = r.play(episodes(1, journaled_tools={0: [other]}, tool_sink=sink))
    assert "diverged at tool call 0" in capsys.readouterr().err and APPLIED == [("send", "a")]
    assert sink.writes[0][3] == [0] and got[0].tools[0].arguments == '{"text":"a"}'  # the journaled one forgotten in the first write


def leaves(e: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds (the mcp client raises its task group's)."""
    subs = getattr(e, "exceptions", None)  # an ExceptionGroup's (Python 3.11+); the package supports older interpreters
    return [x for sub in subs for x in leaves(sub)] if subs is not None else [e]


def test_a_wrong_keys_and_an_unknown_tools_calls_get_mcp_errors_in_the_gateways_words(served):
    gw = Gateway(MODEL, load_tools(TOOLS)).start()
    served.append(gw)
    ep = AgentEpisode(gw.base_url, "sk-verlj-not-a-key", MODEL, {}, 0, 1, mcp_url=gw.mcp_url)
    with pytest.raises(BaseException) as e:
        asyncio.run(mcp_calls(ep, []))
    assert [str(x) for x in leaves(e.value)] == ["Incorrect API key provided: this key names no episode in flight (missing, wrong, or its "
                                                 "episode is over)."]
    said: list = []

    def unknown(ep: AgentEpisode) -> float:
        openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0).chat.completions.create(
            model=ep.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        try:
            asyncio.run(mcp_calls(ep, [("nope", {})]))
        except BaseException as e:  # noqa: BLE001 - what the client raised, for the test to read
            said.extend(str(x) for x in leaves(e))
        return 0.0

    r = Runner(gw, unknown, Prompts(TOK, chat_template(TOK, True), 0), Scripted({}), Settings(1, 10.0, 3))
    played = r.play(episodes(1))
    assert said == ["No tool is named 'nope': the gateway serves boom, create_ticket, move, send, slow."] and not played[0].fault


def test_tool_declarations_and_bad_specs():
    t = as_tool(create_ticket)
    assert (t.name, t.effect, t.given_key, t.reconcile) == ("create_ticket", "external", True, _reconcile)
    assert as_tool(boom).effect == "external" and as_tool(move).effect == "restorable"
    with pytest.raises(ValueError, match="not one of pure, restorable, external"):
        tool(effect="sometimes")
    with pytest.raises(ConfigError, match="rollout.tools"):
        load_tools(["test_gateway_tools:nothing_here"])
    with pytest.raises(ConfigError, match="two tools are named 'send'"):
        load_tools(["test_gateway_tools:send", "test_gateway_tools:send"])


@pytest.fixture
def counting(tmp_path):
    """examples/counting_service.py over streamable HTTP (keys honoured, a reconcile), its effects in a file."""
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    effects = tmp_path / "tickets.jsonl"
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, str(repo / "examples" / "counting_service.py"), "--effects", str(effects), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp", effects
    proc.kill()
    proc.wait()


def test_an_mcp_server_of_yours_is_forwarded_with_its_key_and_reconciled_through_a_crash(served, counting):
    from verlj.engine.rl.gateway.tools import open_tools

    url, effects = counting
    box = open_tools([url, "test_gateway_tools:move"], {"move": "pure"})
    try:
        t = box.tools["open_ticket"]
        # the server's tools served as ours, its reconcile not among them; the key parameter hidden from the agent, given by verlj
        assert sorted(box.tools) == ["move", "open_ticket"] and t.effect == "external" and t.reconcile is not None
        assert t.schema["required"] == ["title"] and "idempotency_key" not in t.schema["properties"]
        assert box.tools["move"].effect == "pure"  # rollout.tool_effects over what @tool said
        gw = Gateway(MODEL, box.tools).start()
        served.append(gw)
        seen: list = []
        r = Runner(gw, agent([("open_ticket", {"title": "bug"})], seen), Prompts(TOK, chat_template(TOK, True), 0), Scripted({}), Settings(2, 10.0, 3))
        first = r.play(episodes(2))
        assert [p.tools[0].key for p in first] == ["run-e0-t0", "run-e1-t0"]
        said = [json.loads(line) for line in effects.read_text().splitlines()]
        assert sorted(e["key"] for e in said) == ["run-e0-t0", "run-e1-t0"] and all(e["kind"] == "applied" for e in said)
        # a crash after episode 0's call was sent (applied: the server has it) and episode 1's too (its outcome unknown): played
        # again, the server's reconcile answers both by their keys; nothing applied again, nothing even re-sent
        sent = {q: [ToolCall(t.name, t.arguments, t.digest, t.key, t.effect, 1)] for q, t in ((q, p.tools[0]) for q, p in enumerate(first))}
        again = r.play(episodes(2, journaled_tools=sent, attempts=[2, 2]))
        assert [p.tools[0].state for p in again] == ["reconciled", "reconciled"]
        assert [p.tools[0].result for p in again] == [p.tools[0].result for p in first]
        assert len(effects.read_text().splitlines()) == 2
    finally:
        box.close()


def test_an_mcp_server_started_by_command_and_one_that_cannot_be_reached(tmp_path):
    from pathlib import Path

    from verlj.engine.rl.gateway.tools import open_tools

    script = Path(__file__).resolve().parents[2] / "examples" / "counting_service.py"
    box = open_tools([f"cmd:python {script} --effects {tmp_path / 'e.jsonl'} --stdio --no-keys"])
    try:
        t = box.tools["open_ticket"]
        assert t.reconcile is None and t.run({"title": "x"}, "k") == "ticket opened: x"  # a keyless server: no reconcile
    finally:
        box.close()
    with pytest.raises(ConfigError, match=r"rollout.tools: the MCP server http://127.0.0.1:9/mcp could not be reached"):
        open_tools(["http://127.0.0.1:9/mcp"])
    with pytest.raises(ConfigError, match="rollout.tool_effects names nope, which no tool in rollout.tools is"):
        open_tools(["test_gateway_tools:move"], {"nope": "pure"})


def test_a_call_that_answers_after_its_episode_ended_is_refused_and_not_the_episodes(served):
    """A tool slower than rollout.agent_timeout_s: its episode ends by the timeout (a fault) while the call runs; the effect
    happened (the world's), but the answer comes to an episode that is over: refused, in no sample."""
    gw = Gateway(MODEL, load_tools(TOOLS)).start()
    served.append(gw)
    r = Runner(gw, agent([("slow", {"text": "x"})], []), Prompts(TOK, chat_template(TOK, True), 0), Scripted({}), Settings(1, 0.5, 3))
    played = r.play(episodes(1))
    assert "neither called the model nor returned within rollout.agent_timeout_s=0.5" in played[0].fault
    import time

    time.sleep(1.5)  # the call answers now, to an episode that is over
    assert played[0].tools == [] and r.plays[0].tool_calls == [] and APPLIED == [("slow", "x")]  # refused: kept nowhere
