"""An agent library used unmodified against the gateway on chat completions: examples/agents_sdk.py's agent (the
OpenAI Agents SDK's Agent, @function_tool and Runner) on an OpenAIChatCompletionsModel over an AsyncOpenAI client
(its default model, the Responses API: tests/unit/test_gateway_responses.py), answered by a scripted policy that
calls the tool, then answers. The SDK's requests are accepted as sent; its tool call is run and its result sent back;
the episode's sample continues the first call's sequence with the tool's turn masked from the loss. And the
request fields OpenAI accepts beside (what such libraries send) are checked for their type and ignored."""

from __future__ import annotations

import json

import numpy as np
import pytest

from examples.agents_sdk import add, reward
from verlj.engine.rl.gateway import token_ledger as ledger
from verlj.engine.rl.gateway.prompts import Prompts
from verlj.engine.rl.gateway.protocol import ApiError, parse_request
from verlj.engine.rl.gateway.runner import Episodes, Runner, Settings
from verlj.engine.rl.gateway.server import Gateway
from verlj.engine.rl.models import builtin_tokenizer, chat_template
from verlj.engine.rl.vocab import VOCABS

TOK = builtin_tokenizer(VOCABS["ascii"])
MODEL = "verlj-policy"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def encode(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False).input_ids


def tool_then_answer(prompts, seeds, episodes=(), on_token=None):
    """The policy, scripted: a tool call first (no end-of-sequence token: cut at the length limit); once the tool has
    answered, its result."""
    outs = []
    for p in prompts:
        text = TOK.decode(p, skip_special_tokens=True)
        ids = encode(text.rsplit("<|tool|>\n", 1)[1].split("\n")[0]) + [TOK.eos_token_id] if "<|tool|>" in text else encode(CALL)
        outs.append(np.asarray(ids, np.int64))
    return outs, [np.full(len(o), -0.5, np.float32) for o in outs]


tool_then_answer.streams = False  # type: ignore[attr-defined]  # a generator that does not stream (gateway.runner.Generator)


async def solve(episode) -> float:
    """examples/agents_sdk.py's agent, on chat completions."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
    agent = Agent(name="adder", instructions="Answer with the number. Use the add tool to add.", tools=[add],
                  model=OpenAIChatCompletionsModel(model=episode.model, openai_client=client), model_settings=ModelSettings(parallel_tool_calls=False))
    result = await Runner.run(agent, episode.row["prompt"], max_turns=episode.max_turns, run_config=RunConfig(tracing_disabled=True))
    return reward(str(result.final_output or ""), str(episode.row["answer"]))


def test_an_agents_sdk_agent_calls_its_tool_through_the_gateway_and_the_tools_turn_is_masked():
    gw = Gateway(MODEL).start()
    try:
        r = Runner(gw, solve, Prompts(TOK, chat_template(TOK, True)), tool_then_answer, Settings(2, 10.0, 3))
        out = r.play(Episodes([{"prompt": "2+3=", "answer": "5"}, {"prompt": "2+3=", "answer": "7"}], [1, 2], [0, 1],
                              lambda place, k: 10 * place + k))
    finally:
        gw.stop()
    assert [p.fault for p in out] == ["", ""]
    assert out[0].reward == 1.0 and out[1].reward == pytest.approx(0.1)  # from the SDK's final output, "5"
    calls = out[0].calls
    assert len(calls) == 2
    first, second = (json.loads(c.request) for c in calls)
    # the SDK's own request: its instructions, its strict tool schema
    assert first["messages"][0] == {"role": "system", "content": "Answer with the number. Use the add tool to add."}
    assert first["tools"][0]["function"]["name"] == "add" and first["tools"][0]["function"]["strict"] is True
    assert json.loads(calls[0].response)["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add"
    # the SDK ran the tool and sent its result back against the call's id
    said, tool = second["messages"][-2:]
    assert said["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert tool == {"role": "tool", "content": "5", "tool_call_id": said["tool_calls"][0]["id"]}
    chain, segments = ledger.trained_chain(calls)
    assert (chain, segments) == ((0, 1), 1)  # the second call's prompt continues the first's prompt and completion
    f = ledger.sample_fields(calls, chain)
    n0, n1 = len(calls[0].completion_ids), len(calls[1].completion_ids)
    between = len(calls[1].prompt_ids) - len(calls[0].prompt_ids) - n0
    assert between > 0 and f["loss_mask"].tolist() == [1] * n0 + [0] * between + [1] * n1  # the tool's turn: masked
    full = np.concatenate([f["prompt_ids"], f["response_ids"]])
    assert "<|tool|>\n5" in TOK.decode(full[len(calls[0].prompt_ids) + n0: len(calls[1].prompt_ids)])


BASE = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("name, good, bad", [
    ("parallel_tool_calls", False, "no"),
    ("store", False, 1),
    ("metadata", {"task": "t"}, ["t"]),
    ("user", "someone", 3),
    ("service_tier", "auto", True),
    ("reasoning_effort", "low", 1),
    ("prompt_cache_key", "k", {}),
    ("verbosity", "low", 2),
    ("safety_identifier", "u1", 1),
    ("logit_bias", {"50256": -100}, [1]),
    ("modalities", ["text"], "text"),
    ("web_search_options", {}, "low"),
    ("prompt_cache_retention", "24h", 24),
    ("function_call", "auto", 1),
])
def test_a_field_openai_accepts_is_accepted_and_ignored_and_a_wrong_type_refused(name, good, bad):
    plain = parse_request(json.dumps(BASE).encode(), MODEL)
    got = parse_request(json.dumps({**BASE, name: good}).encode(), MODEL)
    assert got.canonical() == plain.canonical()  # decides nothing: the journaled request (and its hash) are the same
    with pytest.raises(ApiError) as e:
        parse_request(json.dumps({**BASE, name: bad}).encode(), MODEL)
    assert e.value.status == 400 and e.value.param == name and name in e.value.message


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("field", ["frobnicate", "tool_choise", "include_usage", "top_k"])
def test_a_field_no_openai_client_sends_is_refused_in_openais_words(api, field):
    """A typo (tool_choise), another server's knob (top_k) or nothing at all gets OpenAI's 400 naming it, on either
    API, through the openai client's extra_body: never a 200 that ignored what the agent asked."""
    from openai import BadRequestError, OpenAI

    gw = Gateway(MODEL).start()
    said = {}

    def agent(ep):
        client = OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        try:
            if api == "chat":
                client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": "x"}], extra_body={field: 1})
            else:
                client.responses.create(model=ep.model, input="x", extra_body={field: 1})
        except BadRequestError as e:
            said["error"] = e.body
        client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": "x"}])
        return 1.0

    try:
        out = Runner(gw, agent, Prompts(TOK, chat_template(TOK, True)), tool_then_answer, Settings(1, 10.0, 3)).play(
            Episodes([{"prompt": "x"}], [1], [0], lambda place, k: k))
    finally:
        gw.stop()
    assert out[0].fault == "" and len(out[0].calls) == 1  # the refused call was never generated
    assert said["error"] == {"message": f"Unrecognized request argument supplied: {field}", "type": "invalid_request_error", "param": field,
                             "code": None}


def _body_fields(params: type) -> set[str]:
    """The JSON body fields of one of openai-python's request TypedDicts: its keys, by their wire names (an alias where
    the SDK gives one)."""
    import typing

    from openai._utils import PropertyInfo

    out = set()
    for name, hint in typing.get_type_hints(params, include_extras=True).items():
        alias = next((m.alias for m in getattr(hint, "__metadata__", ()) if isinstance(m, PropertyInfo) and m.alias), None)
        out.add(alias or name)
    return out


def test_the_gateway_knows_every_body_field_the_installed_openai_sdk_sends():
    """Every field openai-python's chat.completions.create and responses.create may put in a body is one the gateway
    reads or accepts-and-ignores: a new SDK release's field would otherwise be refused as unrecognized, and agents on
    it would break. When this fails, add the field (read it, or check its type and ignore it) and say so in the agents
    guide."""
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses

    from verlj.engine.rl.gateway.protocol import CHAT_FIELDS
    from verlj.engine.rl.gateway.responses import FIELDS

    sdk_chat = _body_fields(chat.CompletionCreateParamsStreaming) | _body_fields(chat.CompletionCreateParamsNonStreaming)
    sdk_responses = _body_fields(responses.ResponseCreateParamsStreaming) | _body_fields(responses.ResponseCreateParamsNonStreaming)
    assert {"messages", "tools", "stream"} <= sdk_chat and {"input", "include", "stream"} <= sdk_responses  # read as meant
    assert sdk_chat - CHAT_FIELDS == set(), "chat.completions.create sends fields the gateway would refuse"
    assert sdk_responses - FIELDS == set(), "responses.create sends fields the gateway would refuse"


def test_stream_options_are_honoured_with_a_stream_and_ignored_without():
    assert parse_request(json.dumps({**BASE, "stream": True, "stream_options": {"include_usage": True}}).encode(), MODEL).include_usage
    assert not parse_request(json.dumps({**BASE, "stream_options": {"include_usage": True}}).encode(), MODEL).include_usage
    with pytest.raises(ApiError) as e:
        parse_request(json.dumps({**BASE, "stream_options": "usage"}).encode(), MODEL)
    assert e.value.param == "stream_options"


def test_the_sdks_streamed_run_gets_its_tool_call_and_answer_as_server_sent_events():
    from agents import Agent, OpenAIChatCompletionsModel, RunConfig
    from agents import Runner as SdkRunner
    from openai import AsyncOpenAI

    async def streamed(ep):
        client = AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        agent = Agent(name="adder", instructions="Add.", tools=[add], model=OpenAIChatCompletionsModel(model=ep.model, openai_client=client))
        run = SdkRunner.run_streamed(agent, ep.row["prompt"], max_turns=ep.max_turns, run_config=RunConfig(tracing_disabled=True))
        kinds = {e.type async for e in run.stream_events()}
        assert "raw_response_event" in kinds
        return reward(str(run.final_output or ""), "5")

    gw = Gateway(MODEL).start()
    try:
        out = Runner(gw, streamed, Prompts(TOK, chat_template(TOK, True)), tool_then_answer, Settings(1, 10.0, 3)).play(
            Episodes([{"prompt": "2+3="}], [1], [0], lambda place, k: k))
    finally:
        gw.stop()
    assert out[0].fault == "" and out[0].reward == 1.0 and len(out[0].calls) == 2
    assert all(json.loads(c.request)["stream"] and c.response.endswith(b"data: [DONE]\n\n") for c in out[0].calls)


SUBMIT = '<tool_call>{"name": "submit", "arguments": {"answer": "5"}}</tool_call>'


def submit_then_answer(prompts, seeds, episodes=(), on_token=None):
    """The policy, scripted: a call of the MCP tool `submit` first; once it has answered, its result."""
    outs = []
    for p in prompts:
        text = TOK.decode(p, skip_special_tokens=True)
        ids = encode(text.rsplit("<|tool|>\n", 1)[1].split("\n")[0]) + [TOK.eos_token_id] if "<|tool|>" in text else encode(SUBMIT) + [TOK.eos_token_id]
        outs.append(np.asarray(ids, np.int64))
    return outs, [np.full(len(o), -0.5, np.float32) for o in outs]


submit_then_answer.streams = False  # type: ignore[attr-defined]


def test_the_sdks_own_mcp_client_calls_verljs_tools_and_an_external_call_is_never_sent_twice(tmp_path, monkeypatch):
    """examples/agents_sdk_mcp.py: the SDK's MCPServerStreamableHttp at episode.mcp_url lists rollout.tools and calls `submit`
    (external) through the journal; played again as after a crash with the call journaled as sent and never answered, its
    reconcile finds the submission by its key and the SDK gets the same answer, nothing submitted twice."""
    from dataclasses import replace

    from examples.agents_sdk_mcp import solve as solve_mcp
    from verlj.engine.rl.gateway.tools import load_tools

    monkeypatch.setenv("VERLJ_SUBMISSIONS", str(tmp_path / "submissions.jsonl"))
    gw = Gateway(MODEL, load_tools(["examples.agents_sdk_mcp:add", "examples.agents_sdk_mcp:submit"])).start()
    rows = [{"prompt": "2+3=", "answer": "5"}]
    try:
        r = Runner(gw, solve_mcp, Prompts(TOK, chat_template(TOK, True)), submit_then_answer, Settings(1, 10.0, 3))
        first = r.play(Episodes(rows, [1], [0], lambda place, k: 10 * place + k, tool_key=lambda place, k: f"run-e{place}-t{k}"))
        req = json.loads(first[0].calls[0].request)  # the SDK offered the MCP server's tools to the model, as it lists them
        assert sorted(t["function"]["name"] for t in req["tools"]) == ["add", "submit"]
        assert [p.fault for p in first] == [""] and first[0].reward == 1.0  # its final output: the tool's answer, "received 5"
        (call,) = first[0].tools
        assert (call.name, call.arguments, call.key, call.state, call.result) == ("submit", '{"answer":"5"}', "run-e0-t0", "done", "received 5")
        sent = replace(call, state="sent", result="")  # a crash after it was sent, before its result was durable
        again = r.play(Episodes(rows, [1], [0], lambda place, k: 10 * place + k, [2], journaled_tools={0: [sent]},
                                tool_key=lambda place, k: f"run-e{place}-t{k}"))
    finally:
        gw.stop()
    assert [t.state for t in again[0].tools] == ["reconciled"] and again[0].reward == 1.0
    assert [c.response for c in again[0].calls] == [c.response for c in first[0].calls]  # the SDK saw the same answers
    assert len((tmp_path / "submissions.jsonl").read_text().splitlines()) == 1  # submitted once
