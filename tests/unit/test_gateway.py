"""The agent gateway without a trainer (rl.gateway): the OpenAI protocol spoken to the real `openai`
client (sync and async, streaming and not, tool calls), OpenAI-shaped refusals of bad requests and
wrong keys, the lockstep runner (each call from its own seed, the same tokens on every run), episode
faults, and the token ledger's segments."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading

import httpx
import numpy as np
import openai
import pytest

from verlj.engine.rl.gateway import token_ledger as ledger
from verlj.engine.rl.gateway.agents import AgentEpisode, load_agent
from verlj.engine.rl.gateway.prompts import Prompts
from verlj.engine.rl.gateway.protocol import ApiError, hermes, parse_request
from verlj.engine.rl.gateway.runner import Episodes, Runner, Settings
from verlj.engine.rl.gateway.server import Gateway
from verlj.engine.rl.models import builtin_tokenizer, chat_template
from verlj.engine.rl.vocab import VOCABS
from verlj.engine.schema.agent_calls import AgentCalls
from verlj_testing import raised_at

TOK = builtin_tokenizer(VOCABS["ascii"])
MODEL = "verlj-policy"


def encode(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False).input_ids


class Scripted:
    """A generator (gateway.runner.Generator): each call's text from `answers` by its prompt's last user line
    (default: the seed's digits), with log-prob -0.5 a token; it records every batch it is given."""

    streams = False

    def __init__(self, answers: dict):
        self.answers, self.batches = answers, []

    def __call__(self, prompts, seeds, episodes, on_token=None):
        self.batches.append([(len(p), s) for p, s in zip(prompts, seeds)])
        outs = []
        for p, s in zip(prompts, seeds):
            text = TOK.decode(p, skip_special_tokens=True)
            last = text.rsplit("<|user|>\n", 1)[-1].split("\n")[0] if "<|user|>" in text else ""
            outs.append(np.asarray(encode(self.answers.get(last, str(s))) + [TOK.eos_token_id], np.int64))
        return outs, [np.full(len(o), -0.5, np.float32) for o in outs]


def runner(agent, answers=None, gen=None, **kw) -> tuple[Runner, Gateway, list]:
    gw = Gateway(MODEL).start()
    gen = gen or Scripted(answers or {})
    r = Runner(gw, agent, Prompts(TOK, chat_template(TOK, True), kw.get("max_prompt", 0)), gen,
               Settings(kw.get("concurrency", 4), kw.get("timeout_s", 5.0), kw.get("max_turns", 3)))
    return r, gw, gen.batches


def episodes(rows: list[str], seeds: list[int] | None = None, **kw) -> Episodes:
    """A round of one episode a row (ids 0, 1, ...), call k of the episode at place p from seed 1000 p + k."""
    return Episodes([{"prompt": r} for r in rows], seeds or [100 + i for i in range(len(rows))], list(range(len(rows))),
                    lambda place, k: 1000 * place + k, **kw)


@pytest.fixture
def cleanup():
    made = []
    yield made
    for gw in made:
        gw.stop()


def play(agent, n=2, answers=None, cleanup=None, **kw):
    r, gw, batches = runner(agent, answers, **kw)
    if cleanup is not None:
        cleanup.append(gw)
    out = r.play(episodes([f"row {i}" for i in range(n)]))
    return out, r, gw, batches


def two_turns(ep: AgentEpisode):
    client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    msgs = [{"role": "user", "content": ep.row["prompt"]}]
    first = client.chat.completions.create(model=ep.model, messages=msgs, max_tokens=4)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "again"}]
    second = client.chat.completions.create(model=ep.model, messages=msgs)
    return float(len(second.choices[0].message.content or ""))


def test_a_sync_openai_agent_is_answered_in_lockstep_from_each_calls_seed(cleanup):
    out, r, _, batches = play(two_turns, n=3, answers={"again": "ok"}, cleanup=cleanup)
    assert [p.fault for p in out] == ["", "", ""]
    assert [p.reward for p in out] == [2.0, 2.0, 2.0]
    # every episode's first call in one batch, then every second call: the seed is (place, position)
    assert [sorted(s for _, s in b) for b in batches] == [[0, 1000, 2000], [1, 1001, 2001]]
    c0 = out[1].calls[0]
    body = json.loads(c0.response)
    assert body["choices"][0]["message"]["content"] == "1000" and body["choices"][0]["finish_reason"] == "length"
    assert len(c0.completion_ids) == 4 and c0.logprobs.tolist() == [-0.5] * 4  # cut at max_tokens: the eos not kept
    assert json.loads(c0.request)["max_tokens"] == 4 and c0.digest == hashlib.sha256(c0.request.encode()).hexdigest()  # the canonical's
    assert r.counts.calls == 6


def test_the_second_call_continues_the_sequence_and_its_new_tokens_are_masked(cleanup):
    out, *_ = play(two_turns, n=1, answers={"row 0": "abcdefg", "again": "ok"}, cleanup=cleanup)
    calls = out[0].calls
    chain, segments = ledger.trained_chain(calls)
    assert (chain, segments) == ((0, 1), 1)  # the second call spliced onto the first (cut at 4 tokens: no eos)
    f = ledger.sample_fields(calls, chain)
    assert f["prompt_ids"].tolist() == calls[0].prompt_ids.tolist()
    full = np.concatenate([f["prompt_ids"], f["response_ids"]])
    assert full[: len(calls[1].prompt_ids)].tolist() == calls[1].prompt_ids.tolist()
    assert full[len(calls[1].prompt_ids):].tolist() == calls[1].completion_ids.tolist()
    assert f["turn_lens"].tolist() == [4, len(calls[1].prompt_ids) - len(calls[0].prompt_ids) - 4, len(calls[1].completion_ids), 0]
    mask = f["loss_mask"].tolist()
    assert mask == [1] * 4 + [0] * f["turn_lens"][1] + [1] * len(calls[1].completion_ids)
    assert np.all(f["gen_logprobs"][np.asarray(mask) == 0] == 0)


def mk(prompt: list, completion: list) -> ledger.Call:
    return ledger.Call("{}", "d", np.asarray(prompt), np.asarray(completion), np.zeros(len(completion), np.float32), b"{}")


def test_a_rewritten_history_is_a_prefix_break_and_the_longest_chain_is_trained():
    calls = [mk([1, 5], [6, 7]), mk([1, 5, 6, 7, 9], [8]), mk([1, 4], [6, 6, 6, 6])]
    assert ledger.parents(calls) == [-1, 0, -1]
    assert ledger.trained_chain(calls) == ((2,), 2)  # 4 generated tokens against 3
    assert ledger.trained_chain(calls[:2]) == ((0, 1), 1)
    assert ledger.trained_chain([]) == ((), 0)
    rec = ledger.ledger_of(calls, 0.5)
    back = AgentCalls.from_json(rec.to_json())
    assert (back.trained, back.reward, back.segments) == ((2,), 0.5, 2)
    assert back.prefix_breaks == 1 and back.calls[2].completion_ids.tolist() == [6, 6, 6, 6]
    assert back.to_json() == rec.to_json()  # read and written again: the same text


def test_calls_that_continue_one_call_branch_and_are_no_break():
    # two calls continue call 0 (an agent that asks twice from one point): a branch, not a prefix break
    calls = [mk([1, 5], [6]), mk([1, 5, 6, 9], [7]), mk([1, 5, 6, 8], [7, 7]), mk([1, 5, 6, 9, 7, 3], [4])]
    assert ledger.parents(calls) == [-1, 0, 0, 1]
    assert ledger.trained_chain(calls) == ((0, 1, 3), 1)  # 3 generated tokens on either branch: the later leaf
    f = ledger.sample_fields(calls, (0, 1, 3))
    assert f["response_ids"].tolist() == [6, 9, 7, 3, 4] and f["loss_mask"].tolist() == [1, 0, 1, 0, 1]


def test_a_version_1_ledger_reads_as_its_segment_then():
    calls = [mk([1, 5], [6, 7]), mk([1, 5, 6, 7, 9], [8]), mk([1, 4], [6])]
    v1 = {"v": 1, "segment": 0, "reward": None, "calls": [c.to_dict() for c in calls],
          "segments": 2}
    rec = AgentCalls.from_json(json.dumps(v1))
    assert rec.trained == (0, 1) and rec.segments == 2


def test_async_streaming_tool_calls_reach_the_client_parsed(cleanup):
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    call_text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'

    async def agent(ep):
        client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        stream = await client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": "tool"}], tools=[tool],
                                                      stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert calls[0].function.name == "add" and json.loads(calls[0].function.arguments) == {"a": 1}
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert chunks[-1].usage.completion_tokens == len(encode(call_text)) + 1
        msgs = [{"role": "user", "content": "tool"},
                {"role": "assistant", "content": None, "tool_calls": [tc.model_dump() for tc in calls]},
                {"role": "tool", "tool_call_id": calls[0].id, "content": "2"}]
        done = await client.chat.completions.create(model=ep.model, messages=msgs, tools=[tool], logprobs=True, top_logprobs=1)
        assert done.choices[0].logprobs.content[0].logprob == -0.5
        return 1.0

    out, r, *_ = play(agent, n=1, answers={"tool": call_text}, cleanup=cleanup)
    assert out[0].fault == "" and out[0].reward == 1.0
    assert out[0].calls[0].response.endswith(b"data: [DONE]\n\n") and out[0].calls[0].flag == ""


def test_a_tool_call_that_does_not_parse_is_flagged_and_returned_as_text():
    parsed = hermes('<tool_call>{"name": "add", "arguments": {oops}</tool_call>', "x", {"add"})
    assert parsed.flag == "malformed_tool_call" and parsed.tool_calls == [] and "oops" in parsed.content
    ok = hermes('thinking <tool_call>{"name": "f", "arguments": {}}</tool_call>', "x", {"f"})
    assert ok.content == "thinking" and ok.tool_calls[0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize("block", [
    '{"name": "add", "perties": {"a": 1}}',  # a key that is not arguments: not add({})
    '{"name": "add"}',  # no arguments
    '{"name": "add", "arguments": {"a": 1}, "id": "x"}',  # a key beside name and arguments
    '{"name": "sub", "arguments": {"a": 1}}',  # a tool never offered
    '{"name": ["add"], "arguments": {}}',
    '{"name": "add", "arguments": 7}',
    '{"name": "add", "arguments": "7"}',  # a JSON string, not of an object
    '{"name": "add", "arguments": "{oops"}',
    '["add", {}]',
])
def test_a_block_that_is_not_exactly_an_offered_tools_name_and_arguments_is_malformed(block):
    text = f"<tool_call>{block}</tool_call>"
    parsed = hermes(text, "x", {"add", "mul"})
    assert (parsed.flag, parsed.tool_calls, parsed.content) == ("malformed_tool_call", [], text)
    # a call beside a good one makes the whole completion malformed: answered as text, as OpenAI's tool calls are all parsed
    both = hermes('<tool_call>{"name": "mul", "arguments": {}}</tool_call>' + text, "x", {"add", "mul"})
    assert both.flag == "malformed_tool_call" and both.tool_calls == []


def test_arguments_as_an_object_or_a_json_string_of_one_parse():
    got = hermes('<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call><tool_call>{"name": "mul", "arguments": "{\\"b\\": 2}"}'
                 '</tool_call>', "x", {"add", "mul"})
    assert got.flag == "" and [(c["function"]["name"], c["function"]["arguments"]) for c in got.tool_calls] == [
        ("add", '{"a": 1}'), ("mul", '{"b": 2}')]


def test_a_tool_call_of_a_tool_never_offered_is_answered_as_text_and_counted(cleanup):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    seen = {}

    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        for q in ("sub", "add"):
            m = client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": q}], tools=tools).choices[0]
            seen[q] = (m.finish_reason, m.message.tool_calls, m.message.content)
        return 1.0

    sub, add = '<tool_call>{"name": "sub", "arguments": {"a": 1}}</tool_call>', '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    out, r, *_ = play(agent, n=1, answers={"sub": sub, "add": add}, cleanup=cleanup)
    assert seen["sub"] == ("stop", None, sub) and seen["add"][0] == "tool_calls" and seen["add"][1][0].function.name == "add"
    assert [c.flag for c in out[0].calls] == ["malformed_tool_call", ""] and r.counts.to_metrics()["agent/malformed_tool_calls"] == 1.0


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[]", 400, None),
    (json.dumps({"model": MODEL}).encode(), 400, "messages"),
    (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}).encode(), 400,
     "response_format"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "4"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "messages[0].role"),
    (json.dumps({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}).encode(), 400, "messages[0].tool_call_id"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]}).encode(),
     400, "messages[1].role"),  # no tool call before it: OpenAI's "must be a response to a preceeding message with 'tool_calls'"
    (json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"}]}).encode(), 400, "messages[2].tool_call_id"),  # answers no call made
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}).encode(), 400, "frobnicate"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}).encode(), 400, "tool_choice"),
])
def test_bad_requests_get_openai_shaped_errors(body, status, param):
    with pytest.raises(ApiError) as e:
        parse_request(body, MODEL)
    assert e.value.status == status and e.value.param == param
    err = json.loads(e.value.body())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_a_tool_message_is_refused_in_openais_words_unless_it_answers_a_call_made_before_it():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    ok = parse_request(json.dumps({"model": MODEL, "messages": [*base, {"role": "tool", "tool_call_id": "call_1", "content": "5"},
                                                               {"role": "user", "content": "y"}]}).encode(), MODEL)
    assert ok.messages[2]["tool_call_id"] == "call_1"
    for messages, said in [([base[0], {"role": "tool", "tool_call_id": "call_1", "content": "5"}],
                            "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'."),
                           ([*base, {"role": "tool", "tool_call_id": "call_9", "content": "5"}],
                            "Invalid parameter: 'tool_call_id' of 'call_9' not found in 'tool_calls' of any preceding message."),
                           ([{"role": "tool", "tool_call_id": "call_1", "content": "5"}, *base],  # answered before it was made
                            "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'.")]:
        with pytest.raises(ApiError) as e:
            parse_request(json.dumps({"model": MODEL, "messages": messages}).encode(), MODEL)
        assert (e.value.status, e.value.message) == (400, said)


def test_keys_are_per_episode_and_bad_requests_never_reach_an_agent_as_a_traceback(cleanup):
    seen = {}

    def agent(ep):
        h = {"Authorization": f"Bearer {ep.api_key}"}
        url = ep.base_url + "/chat/completions"
        seen["wrong"] = httpx.post(url, json={"model": ep.model, "messages": [{"role": "user", "content": "x"}]},
                                   headers={"Authorization": "Bearer sk-verlj-guess"})
        seen["missing"] = httpx.get(ep.base_url + "/models")
        seen["models"] = httpx.get(ep.base_url + "/models", headers=h).json()
        seen["big"] = httpx.post(url, content=b"x" * (5 << 20), headers={**h, "content-type": "application/json"})
        seen["malformed"] = httpx.post(url, content=b'{"model": ', headers=h)
        seen["key"] = ep.api_key
        return two_turns(ep)

    out, _, gw, _ = play(agent, n=1, cleanup=cleanup)
    assert out[0].fault == ""
    for k in ("wrong", "missing"):
        assert seen[k].status_code == 401 and seen[k].json()["error"]["code"] == "invalid_api_key"
    assert seen["models"]["data"][0]["id"] == MODEL
    assert seen["big"].status_code == 413 and seen["malformed"].status_code == 400
    assert "Traceback" not in seen["malformed"].text
    # the episode is over: its key is forgotten
    late = httpx.post(gw.base_url + "/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                      headers={"Authorization": f"Bearer {seen['key']}"})
    assert late.status_code == 401


def test_bad_agents_are_episode_faults_and_the_others_go_on(cleanup):
    def agent(ep):
        i = int(ep.row["prompt"].split()[1])
        if i == 0:
            raise ValueError("the sandbox is down")
        if i == 1:
            return 1.0  # never called the model
        if i == 2:
            import time
            time.sleep(3)  # past the timeout
        if i == 3:
            client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
            for _ in range(5):
                client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": "x"}])
        if i == 4:
            two_turns(ep)
            return "high"
        return two_turns(ep)

    out, *_ = play(agent, n=6, cleanup=cleanup, timeout_s=1.0, concurrency=6)
    faults = [p.fault for p in out]
    assert faults[0] == "the agent raised ValueError: the sandbox is down" + raised_at(__file__, 'raise ValueError("the sandbox is down")')
    assert faults[1] == "the agent never called the model"
    assert faults[2].startswith("the agent neither called the model nor returned within rollout.agent_timeout_s=1")
    assert faults[3] == "the agent asked more than rollout.max_turns=3 calls"
    assert faults[4].startswith("the agent returned 'high'")
    assert faults[5] == "" and out[5].reward is not None and len(out[5].calls) == 2


def test_the_same_agent_gets_the_same_bytes_on_every_run(cleanup):
    a, *_ = play(two_turns, n=3, cleanup=cleanup)
    b, *_ = play(two_turns, n=3, cleanup=cleanup)
    assert [[c.response for c in p.calls] for p in a] == [[c.response for c in p.calls] for p in b]


def test_an_async_agent_runs_in_its_own_event_loop(cleanup):
    async def agent(ep):
        client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        got = await client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": "hi"}])
        await asyncio.sleep(0)
        return None if got.choices[0].message.content else 0.0

    out, *_ = play(agent, n=2, cleanup=cleanup, answers={"hi": "yo"})
    assert [(p.fault, p.reward) for p in out] == [("", None), ("", None)]


COMMAND = """
import json, os, openai
client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
row = json.loads(os.environ["VERLJ_ROW"])
got = client.chat.completions.create(model=os.environ["VERLJ_MODEL"], messages=[{"role": "user", "content": row["prompt"]}])
print("some log line")
print(len(got.choices[0].message.content) if row["prompt"] != "row 1" else "None")
"""


def test_a_command_agent_gets_the_gateway_in_its_environment_and_prints_its_reward(cleanup, tmp_path):
    import sys

    script = tmp_path / "agent.py"
    script.write_text(COMMAND)
    out, *_ = play(load_agent(f"cmd:{sys.executable} {script}"), n=2, answers={"row 0": "abc"}, cleanup=cleanup, timeout_s=60)
    assert [(p.fault, p.reward) for p in out] == [("", 3.0), ("", None)]
    bad = tmp_path / "bad.py"
    bad.write_text("import sys; sys.exit('no luck')")
    out, *_ = play(load_agent(f"cmd:{sys.executable} {bad}"), n=1, cleanup=cleanup, timeout_s=60)
    assert out[0].fault == "the agent raised RuntimeError: command exited 1: no luck"


@pytest.mark.parametrize("overrides, message", [
    (["rollout.agent=nope"], "rollout.agent must be null, module:function or cmd:COMMAND, got 'nope'"),
    (["rollout.agent=m:f", "rollout.env=builtin:guess"], "rollout.agent and rollout.env are two ways to play episodes"),
    (["rollout.agent=m:f", "rollout.agent_concurrency=0"], "rollout.agent_concurrency must be positive"),
])
def test_bad_agent_configs_are_one_line(overrides, message):
    from verlj.engine.config import ConfigError, make_config

    with pytest.raises(ConfigError) as e:
        make_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_agent_that_cannot_be_imported_is_one_line():
    from verlj.engine.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.agent: cannot import 'no_such_agent_module:run'"):
        load_agent("no_such_agent_module:run")
    with pytest.raises(ConfigError, match="names no command"):
        load_agent("cmd: ")
    # an agent that cannot take its episode is refused up front, not 128 faults later
    with pytest.raises(ConfigError, match=r"rollout.agent: operator:add \(called as fn\(episode\)\) has the wrong signature"):
        load_agent("operator:add")


def test_an_sdk_retry_of_a_call_is_answered_with_that_call_never_generated_twice(cleanup):
    seen = {}

    def agent(ep):
        h = {"Authorization": f"Bearer {ep.api_key}"}
        body = {"model": ep.model, "messages": [{"role": "user", "content": "x"}]}
        first = httpx.post(ep.base_url + "/chat/completions", json=body, headers=h)
        again = httpx.post(ep.base_url + "/chat/completions", json=body, headers={**h, "x-stainless-retry-count": "1"})
        seen["same"] = first.content == again.content and first.status_code == 200
        return 1.0

    out, r, _, batches = play(agent, n=1, cleanup=cleanup)
    assert seen["same"] and len(out[0].calls) == 1 and len(batches) == 1 and r.counts.calls == 1


def test_a_conversation_past_the_context_is_refused_as_openai_does(cleanup):
    seen = {}

    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        try:
            client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": "x" * 100}])
        except openai.BadRequestError as e:
            seen["code"] = e.code
        return two_turns(ep)

    r, gw, _ = runner(agent, max_prompt=80)
    cleanup.append(gw)
    out = r.play(episodes(["row 0"], [1]))
    assert seen["code"] == "context_length_exceeded" and out[0].fault == "" and len(out[0].calls) == 2


def test_fewer_slots_than_episodes_keep_the_batches_the_same_on_every_run(cleanup):
    runs = [play(two_turns, n=5, cleanup=cleanup, concurrency=2) for _ in range(2)]
    (a, _, _, batches_a), (b, _, _, batches_b) = runs
    assert all(not p.fault and len(p.calls) == 2 for p in a + b)
    assert batches_a == batches_b and max(len(x) for x in batches_a) <= 2
    assert sorted(s for x in batches_a for _, s in x) == sorted(1000 * i + k for i in range(5) for k in range(2))


def test_every_call_is_durable_before_its_answer_and_a_rerun_is_answered_from_the_journal(cleanup):
    r, gw, batches = runner(two_turns, {"again": "ok"})
    cleanup.append(gw)

    class Sink:
        name, durable = "a list", []

        def keep_calls(self, new, discarded):  # under the runner's lock, before any of these answers is returned to its agent
            assert all(r.plays[q].pending and not any(fut.done() for *_, fut in r.plays[q].pending) for q, _, _ in new)
            assert all(r.plays[q].calls[k] is call for q, k, call in new) and discarded == []
            self.durable.append(sorted((q, k) for q, k, _ in new))

    sink = Sink()
    first = r.play(episodes(["row 0", "row 1"], sink=sink))
    assert sink.durable == [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]  # each call written once, in the batch that made it
    # a re-run (a crash after episode 0's two calls and episode 1's first): the journaled calls answered byte for
    # byte, never generated; episode 1's second call generated live from its own seed
    batches.clear()
    again = r.play(episodes(["row 0", "row 1"], journaled={0: first[0].calls, 1: first[1].calls[:1]}))
    assert [[c.response for c in p.calls] for p in again] == [[c.response for c in p.calls] for p in first]
    assert batches == [[(len(first[1].calls[1].prompt_ids), 1001)]]
    assert r.counts.calls_from_journal == 3 and r.counts.divergences == 0


def test_a_request_that_differs_from_the_journaled_one_is_a_divergence_and_goes_on_live(cleanup, capsys):
    r, gw, batches = runner(two_turns, {"again": "ok"})
    cleanup.append(gw)
    first = r.play(episodes(["row 0"]))
    batches.clear()
    again = r.play(episodes(["row 9"], journaled={0: first[0].calls}, name=lambda place: f"episode {place} of group 7"))  # the row changed
    err = capsys.readouterr().err
    assert err.count("diverged") == 1 and "episode 0 of group 7 diverged at call 0" in err and "messages[0]" in err
    assert "the 2 journaled call(s) from there on are discarded" in err
    assert r.counts.divergences == 1 and r.counts.calls_from_journal == 0
    assert r.discarded == [(0, 0), (0, 1)]  # its journaled calls, for the next durable write to forget
    assert len(batches) == 2 and len(again[0].calls) == 2  # both calls live: the journaled ones are in no episode
    assert json.loads(again[0].calls[0].request)["messages"][0]["content"] == "row 9"


def test_a_divergence_names_the_fields_that_differ():
    from verlj.engine.rl.gateway.runner import differing

    a, b, c = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}
    assert differing({"messages": [a, b], "tools": [1]}, {"messages": [a, c], "tools": [2]}) == ["messages[1]", "tools"]
    assert differing({"messages": [a]}, {"messages": [a, b], "stop": ["\n"]}) == ["messages[1]", "stop"]
    assert differing({"messages": [a], "max_tokens": 4}, {"messages": [a], "max_tokens": 4}) == []


def test_an_unknown_url_or_method_gets_an_openai_shaped_404(cleanup):
    gw = Gateway(MODEL).start()
    cleanup.append(gw)
    for got in (httpx.post(gw.base_url + "/completions", json={}), httpx.get(gw.base_url + "/chat/completions")):
        assert got.status_code == 404 and got.json()["error"]["code"] == "unknown_url" and "Traceback" not in got.text


class Streaming(Scripted):
    """A generator that streams: each step's tokens to `on_token`, and at the third it waits until a client has read a
    content delta (`arrived`, an Event): a stream sent only after generation never gets there."""

    streams = True

    def __init__(self, answers: dict, arrived: threading.Event):
        super().__init__(answers)
        self.arrived, self.waited = arrived, []

    def __call__(self, prompts, seeds, episodes, on_token=None):
        outs, lps = super().__call__(prompts, seeds, episodes)
        for t in range(max(len(o) for o in outs)) if on_token is not None else ():
            on_token(np.asarray([o[t] if t < len(o) else TOK.pad_token_id for o in outs]))
            if t == 2:
                self.waited.append(self.arrived.wait(10))
        return outs, lps


def streaming_runner(agent, answers: dict, arrived):
    gen = Streaming(answers, arrived)
    r, gw, _ = runner(agent, gen=gen)
    return r, gw, gen.waited


def test_a_stream_goes_token_by_token_and_joins_to_the_answer_not_streamed(cleanup):
    arrived, got = threading.Event(), {}

    def agent(ep, stream):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "user", "content": ep.row["prompt"]}]
        if not stream:
            got["plain"] = client.chat.completions.create(model=ep.model, messages=msgs).choices[0].message.content
            return 1.0
        chunks = []
        for c in client.chat.completions.create(model=ep.model, messages=msgs, stream=True):
            chunks.append(c)
            if c.choices and c.choices[0].delta.content:
                arrived.set()
        got["chunks"] = chunks
        return 1.0

    answers = {"row 0": "hello world"}
    r, gw, waited = streaming_runner(lambda ep: agent(ep, True), answers, arrived)
    cleanup.append(gw)
    streamed = r.play(episodes(["row 0"]))
    r2, gw2, _ = streaming_runner(lambda ep: agent(ep, False), answers, arrived)
    cleanup.append(gw2)
    plain = r2.play(episodes(["row 0"]))
    assert waited == [True]  # a delta reached the client while its call was still generating
    deltas = [c.choices[0].delta.content for c in got["chunks"] if c.choices and c.choices[0].delta.content]
    assert len(deltas) == len("hello world") and "".join(deltas) == got["plain"] == "hello world"
    assert got["chunks"][-1].choices[0].finish_reason == "stop"
    a, b = streamed[0].calls[0], plain[0].calls[0]  # the same tokens and log-probs: what is trained on is unchanged
    assert np.array_equal(a.completion_ids, b.completion_ids) and np.array_equal(a.logprobs, b.logprobs)
    assert np.array_equal(a.prompt_ids, b.prompt_ids)


def test_the_bytes_a_stream_sent_are_the_bytes_journaled(cleanup):
    arrived, raw = threading.Event(), []

    def agent(ep):
        body = {"model": ep.model, "messages": [{"role": "user", "content": "row 0"}], "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", ep.base_url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {ep.api_key}"}) as resp:
            for part in resp.iter_bytes():
                raw.append(part)
                if b'"content":"h' in b"".join(raw):
                    arrived.set()
        return 1.0

    r, gw, waited = streaming_runner(agent, {"row 0": "hi there"}, arrived)
    cleanup.append(gw)
    out = r.play(episodes(["row 0"]))
    assert waited == [True] and b"".join(raw) == out[0].calls[0].response
    assert out[0].calls[0].response.endswith(b"data: [DONE]\n\n") and b'"usage"' in out[0].calls[0].response


def test_the_samplers_steps_are_its_tokens_and_watching_them_changes_nothing():
    import torch

    from verlj.engine.config import make_config
    from verlj.engine.rl.models import BUILTIN_TINY, load_causal_lm
    from verlj.engine.rl.sampler import sample_seeded, sampling_params

    cfg = make_config(None, ["rollout.max_response_length=12", "rollout.temperature=1.0"])
    model = load_causal_lm(BUILTIN_TINY, cfg, 0)
    prompts, seeds, steps = [np.asarray([1, 5, 6, 7]), np.asarray([1, 9])], [3, 4], []
    plain = sample_seeded(model, prompts, seeds, sampling_params(cfg), 2, 0, torch.device("cpu"))
    watched = sample_seeded(model, prompts, seeds, sampling_params(cfg), 2, 0, torch.device("cpu"), on_token=steps.append)
    for i in range(2):
        assert np.array_equal(plain[0][i], watched[0][i]) and np.array_equal(plain[1][i], watched[1][i])
        assert [int(s[i]) for s in steps[: len(plain[0][i])]] == plain[0][i].tolist()


def test_a_steps_attempt_counts_the_processes_that_began_it():
    from verlj.engine.loop.records import LineageEntry, attempt_at
    from verlj.engine.schema.events import ControlKind

    start = LineageEntry(ControlKind.START, 0)
    assert [attempt_at([start], s) for s in (1, 2, 9)] == [1, 1, 1]
    crashed = [start, LineageEntry(ControlKind.RESUME, 2)]  # stopped with step 3 begun, resumed after step 2
    assert [attempt_at(crashed, s) for s in (2, 3, 4)] == [1, 2, 1]
    twice = [*crashed, LineageEntry(ControlKind.RESUME, 2), LineageEntry(ControlKind.RESUME, 5)]
    assert [attempt_at(twice, s) for s in (3, 4, 6, 7)] == [3, 1, 2, 1]


def test_an_agent_is_told_its_episode_and_attempt_and_its_output_is_tagged_once(capfd, caplog):
    import logging

    seen = {}

    def agent(ep):
        seen[ep.episode] = ep.attempt
        print(f"working on {ep.row['prompt']}", end="")  # a line ended only when the episode is
        print(" ... done")
        logging.getLogger("my_agent").warning("a warning from %s", ep.row["prompt"])
        r = httpx.post(ep.base_url + "/chat/completions", json={"model": ep.model, "messages": [{"role": "user", "content": "x"}]},
                       headers={"Authorization": f"Bearer {ep.api_key}"})
        seen[f"h{ep.episode}"] = (r.headers["x-verlj-episode"], r.headers["x-verlj-attempt"])
        return 1.0

    r, gw, _ = runner(agent)
    try:
        out = r.play(Episodes([{"prompt": "row 0"}, {"prompt": "row 1"}], [1, 2], [17, 18], lambda p, k: k, attempts=[1, 3]))
    finally:
        gw.stop()
    assert [p.fault for p in out] == ["", ""] and seen == {17: 1, 18: 3, "h17": ("17", "1"), "h18": ("18", "3")}
    said = capfd.readouterr()
    text = said.out + said.err
    assert text.count("[episode 17] working on row 0 ... done\n") == 1 and text.count("[episode 18, attempt 3] working on row 1 ... done\n") == 1
    assert "working on" not in text.replace("] working on", "")
    logged = [r.getMessage() for r in caplog.records if r.name == "my_agent"]  # the root logger's handlers: pytest's here
    assert sorted(logged) == ["[episode 17] a warning from row 0", "[episode 18, attempt 3] a warning from row 1"]


def test_async_agents_that_never_close_their_clients_leave_no_traceback(capfd):
    import gc

    from verlj.engine.rl.gateway.agents import agent_loop

    async def leaky(ep):  # a client of its own, never closed: the openai and Agents SDK docs' pattern
        client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        for _ in range(2):
            stream = await client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": "x"}], stream=True)
            async for _ in stream:
                pass
        return None

    for _ in range(3):
        out, *_ = play(leaky, n=4)
        assert [p.fault for p in out] == [""] * 4
    # the clients are collected wherever the collector runs: here, and on the agents' loop (where the server runs)
    gc.collect()
    asyncio.run_coroutine_threadsafe(asyncio.to_thread(lambda: None), agent_loop()).result()
    asyncio.run_coroutine_threadsafe(_collect(), agent_loop()).result()
    said = capfd.readouterr()
    assert "Traceback" not in said.err and "Event loop is closed" not in said.err and "Task exception" not in said.err, said.err[-2000:]


async def _collect():
    import gc

    gc.collect()
    await asyncio.sleep(0.2)  # the closes the collector scheduled on this loop run


def test_the_tagged_stream_hands_through_what_it_does_not_own_and_never_holds_its_lock_writing():
    """A progress bar's console finds the real stream through a proxy's attribute (rich's rich_proxied_file) and may
    write back through sys.stdout while a line is written: the tagged stream neither hides the one nor deadlocks on the
    other."""
    import io

    from verlj.engine.rl.gateway.agents import EPISODE, Tagged

    class Proxy(io.StringIO):
        rich_proxied_file = "the real stream"

        def write(self, s):  # as a console writing back through the stream it was given
            if s.startswith("[episode 1]") and not getattr(self, "again", False):
                self.again = True
                tagged.write("(the console's own line)\n")
            return super().write(s)

    tagged = Tagged(Proxy())
    assert tagged.rich_proxied_file == "the real stream" and tagged.getvalue() == ""
    done = threading.Event()

    def agent_thread():
        EPISODE.set("episode 1")
        tagged.write("hello\n")
        done.set()

    threading.Thread(target=agent_thread, daemon=True).start()
    assert done.wait(5), "the tagged stream deadlocked on a write that came back through it"
    assert tagged.inner.getvalue().count("[episode 1] hello\n") == 1


def test_an_async_agent_that_blocks_its_loop_still_gets_its_answer_and_what_it_leaves_running_is_cancelled():
    import time

    from verlj.engine.rl.gateway.agents import agent_loop

    left = []

    async def agent(ep):
        async def forever():
            await asyncio.sleep(3600)

        left.append(asyncio.get_running_loop().create_task(forever()))  # made and never awaited
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=10)  # a sync client: blocks the loop
        got = client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": "x"}])
        return float(bool(got.choices))

    out, *_ = play(agent, n=1)
    assert out[0].fault == "" and out[0].reward == 1.0  # the server runs apart from the agents' loop
    deadline = time.monotonic() + 5
    while not left[0].done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert left[0].cancelled() and left[0].get_loop() is agent_loop()
