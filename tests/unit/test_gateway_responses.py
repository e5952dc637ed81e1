"""The Responses API on the gateway (gateway.responses), spoken to the real `openai` client and to the OpenAI
Agents SDK's default model: a response as the client parses it, its stream's events in order, previous_response_id
within an episode, the SDK's tool call run and its result spliced onto the call that made it; tool_choice
"required" and a named function on both APIs (the answer made to begin as a tool call); the refusals; and every
answer's episode and attempt in its headers."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from verlj.engine.rl.gateway import token_ledger as ledger
from verlj.engine.rl.gateway.prompts import Prompts
from verlj.engine.rl.gateway.protocol import ApiError, forced_prefix, parse_request
from verlj.engine.rl.gateway.responses import parse_responses
from verlj.engine.rl.gateway.runner import Episodes, Runner, Settings
from verlj.engine.rl.gateway.server import Gateway
from verlj.engine.rl.models import chat_template

MODEL = "verlj-policy"
ADD = {"type": "function", "name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class Policy:
    """Scripted on the BPE tokenizer: a tool call while the conversation has no tool result, then the result's digits
    (spelt a character a token: not the tokenizer's own split), then <|im_end|>. A prompt that ends inside a forced
    tool call (tool_choice) is answered with the rest of one."""

    streams = False

    def __init__(self, tok, tool: bool = True, after: str = "\n</tool_call>"):
        self.tok, self.tool, self.prompts, self.after = tok, tool, [], after  # after: what follows a forced call's JSON

    def __call__(self, prompts, seeds, episodes, on_token=None):
        outs = []
        for p in prompts:
            self.prompts.append(p)
            text = self.tok.decode(p)
            if text.endswith('"arguments":'):
                answer = ' {"a": 2, "b": 3}}' + self.after
            elif text.endswith("<tool_call>\n"):
                answer = '{"name": "add", "arguments": {"a": 2, "b": 3}}' + self.after
            elif "<tool_response>" in text:
                answer = text.rsplit("<tool_response>\n", 1)[1].split("\n")[0]
            else:
                answer = CALL if self.tool else "hello world"
            ids = [i for ch in answer for i in self.tok(ch, add_special_tokens=False).input_ids]
            outs.append(np.asarray(ids + [self.tok.eos_token_id], np.int64))
        return outs, [np.full(len(o), -0.5, np.float32) for o in outs]


def play(tok, agent, n: int = 1, tool: bool = True, max_turns: int = 4, after: str = "\n</tool_call>"):
    gw = Gateway(MODEL).start()
    policy = Policy(tok, tool, after)
    try:
        r = Runner(gw, agent, Prompts(tok, chat_template(tok, False)), policy, Settings(n, 10.0, max_turns))
        out = r.play(Episodes([{"prompt": "2+3=", "answer": "5"}] * n, list(range(n)), [40 + i for i in range(n)],
                              lambda place, k: 100 * place + k))
    finally:
        gw.stop()
    return out, policy


def test_a_response_as_the_openai_client_reads_it_and_its_stream_in_order(bpe_tokenizer):
    seen = {}

    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        r = client.responses.create(model=ep.model, input="Say hello.", instructions="Be brief.")
        seen["plain"] = (r.id, r.status, r.output_text, r.usage.input_tokens, r.usage.output_tokens, r.instructions)
        with client.responses.create(model=ep.model, input="Say hello.", stream=True) as stream:
            events = list(stream)
        seen["kinds"] = [e.type for e in events]
        seen["seq"] = [e.sequence_number for e in events]
        seen["done"] = events[-1].response.output_text
        raw = httpx.post(ep.base_url + "/responses", json={"model": ep.model, "input": "hi"}, headers={"Authorization": f"Bearer {ep.api_key}"})
        seen["headers"] = (raw.headers["x-verlj-episode"], raw.headers["x-verlj-attempt"])
        return 1.0

    out, _ = play(bpe_tokenizer, agent, tool=False)
    assert out[0].fault == ""
    rid, status, text, prompt_tokens, completion_tokens, instructions = seen["plain"]
    first = out[0].calls[0]
    assert rid.startswith("resp_") and status == "completed" and text == "hello world" and instructions == "Be brief."
    assert prompt_tokens == len(first.prompt_ids) and completion_tokens == len(first.completion_ids)
    assert json.loads(first.request)["messages"][0] == {"role": "system", "content": "Be brief."}
    kinds = seen["kinds"]  # token by token: a text delta a character
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[4:-4] == ["response.output_text.delta"] * len("hello world")
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert seen["seq"] == list(range(len(kinds))) and seen["done"] == "hello world"
    assert out[0].calls[1].response.startswith(b"event: response.created\ndata: ")
    assert seen["headers"] == ("40", "1")


def test_previous_response_id_continues_that_responses_conversation_spliced(bpe_tokenizer):
    seen = {}

    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        first = client.responses.create(model=ep.model, input=ep.row["prompt"], instructions="Add.")
        second = client.responses.create(model=ep.model, input="and again?", previous_response_id=first.id, instructions="Add.")
        try:
            client.responses.create(model=ep.model, input="x", previous_response_id="resp_not_this_episodes")
        except openai.BadRequestError as e:
            seen["unknown"] = e.code
        return float(second.status == "completed")

    out, _ = play(bpe_tokenizer, agent, tool=False)
    assert out[0].fault == "" and out[0].reward == 1.0 and seen["unknown"] == "previous_response_not_found"
    a, b = out[0].calls
    messages = json.loads(b.request)["messages"]
    # this request's instructions, the first response's input (less its own instructions), its answer, the new input
    assert messages == [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+3="},
                        {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "and again?"}]
    assert ledger.trained_chain(out[0].calls) == ((0, 1), 1)  # spliced onto the response it continues
    assert json.loads(b.request)["previous_response_id"].startswith("resp_")


def test_the_agents_sdks_default_model_runs_its_tool_and_the_call_after_is_spliced(bpe_tokenizer):
    from examples.agents_sdk import solve

    out, policy = play(bpe_tokenizer, solve, n=2)
    assert [p.fault for p in out] == ["", ""] and [p.reward for p in out] == [1.0, 1.0]  # the tool's 5 in the final output
    for p in out:
        first, second = (json.loads(c.request) for c in p.calls)
        assert first["api"] == "responses" and first["instructions"].startswith("Answer with the number")
        assert first["tools"][0]["function"]["name"] == "add" and first["tools"][0]["function"]["strict"] is True
        call = json.loads(p.calls[0].response)["output"][0]
        assert call["type"] == "function_call" and call["name"] == "add" and json.loads(call["arguments"]) == {"a": 2, "b": 3}
        said, result = second["messages"][-2:]  # the SDK's items back: its function call, then the tool's output
        assert said["tool_calls"][0]["id"] == call["call_id"] and result == {"role": "tool", "tool_call_id": call["call_id"], "content": "5"}
        assert ledger.trained_chain(p.calls) == ((0, 1), 1)  # spliced: no break
        f = ledger.sample_fields(p.calls, (0, 1))
        a = p.calls[0]
        between = bpe_tokenizer.decode(p.calls[1].prompt_ids[len(a.prompt_ids) + len(a.completion_ids):])
        assert "<tool_response>\n5\n</tool_response>" in between and f["loss_mask"].tolist().count(0) == len(p.calls[1].prompt_ids) - len(
            a.prompt_ids) - len(a.completion_ids)


def test_the_agents_sdks_default_model_streamed(bpe_tokenizer):
    from agents import Agent, OpenAIProvider, RunConfig
    from agents import Runner as SdkRunner

    from examples.agents_sdk import add, reward

    async def streamed(ep):
        agent = Agent(name="adder", instructions="Add.", tools=[add], model=ep.model)
        run = SdkRunner.run_streamed(agent, ep.row["prompt"], max_turns=ep.max_turns,
                                     run_config=RunConfig(model_provider=OpenAIProvider(base_url=ep.base_url, api_key=ep.api_key),
                                                          tracing_disabled=True))
        kinds = {e.type async for e in run.stream_events()}
        assert "raw_response_event" in kinds
        return reward(str(run.final_output or ""), "5")

    out, _ = play(bpe_tokenizer, streamed)
    assert out[0].fault == "" and out[0].reward == 1.0 and len(out[0].calls) == 2
    assert all(json.loads(c.request)["stream"] and c.response.startswith(b"event: response.created") for c in out[0].calls)
    assert ledger.trained_chain(out[0].calls) == ((0, 1), 1)


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_choice_required_or_named_makes_the_answer_begin_as_a_tool_call(bpe_tokenizer, api, choice):
    seen = {}

    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        if api == "chat":
            named = {"type": "function", "function": {"name": "add"}}
            m = client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": "2+3="}],
                                               tools=[{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}],
                                               tool_choice="required" if choice == "required" else named).choices[0].message
            seen["call"] = (m.tool_calls[0].function.name, json.loads(m.tool_calls[0].function.arguments))
        else:
            r = client.responses.create(model=ep.model, input="2+3=", tools=[ADD],
                                        tool_choice="required" if choice == "required" else {"type": "function", "name": "add"})
            seen["call"] = (r.output[0].name, json.loads(r.output[0].arguments))
        return 1.0

    out, policy = play(bpe_tokenizer, agent, tool=False)  # the policy writes a tool call only when the prompt begins one
    assert out[0].fault == "" and seen["call"] == ("add", {"a": 2, "b": 3})
    forced = bpe_tokenizer.decode(out[0].calls[0].prompt_ids)
    assert forced.endswith("<tool_call>\n" if choice == "required" else '<tool_call>\n{"name": "add", "arguments":')
    assert out[0].calls[0].flag == ""


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_ends_where_its_json_closes_and_the_call_after_is_spliced_with_the_closing_tag_masked(bpe_tokenizer, api, choice,
                                                                                                            stream):
    """The policy writes a whole call, then goes on (another turn's text, no closing tag): the call is answered as a
    tool call, cut where its JSON closed (as constrained decoding ends it), journaled through the token that closed it;
    the call that sends the tool's result back is spliced, the closing tag the answer showed is an observation token."""
    tok, seen = bpe_tokenizer, {}
    tools = [{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}]
    forced = "required" if choice == "required" else {"type": "function", "function": {"name": "add"}}

    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        if api == "chat":
            msgs = [{"role": "user", "content": "2+3="}]
            got = client.chat.completions.create(model=ep.model, messages=msgs, tools=tools, tool_choice=forced, stream=stream)
            if stream:
                chunks = list(got)
                calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
                finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason][0]
                said = {"role": "assistant", "content": None, "tool_calls": [t.model_dump(exclude={"index"}) for t in calls]}
            else:
                m = got.choices[0]
                calls, finish, said = m.message.tool_calls or [], m.finish_reason, m.message.model_dump(exclude_none=True)
            seen["call"] = [(c.function.name, json.loads(c.function.arguments)) for c in calls], finish
            msgs += [said, *({"role": "tool", "tool_call_id": c.id, "content": "5"} for c in calls)]
            seen["after"] = client.chat.completions.create(model=ep.model, messages=msgs, tools=tools).choices[0].message.content
        else:
            named = "required" if choice == "required" else {"type": "function", "name": "add"}
            if stream:
                with client.responses.create(model=ep.model, input="2+3=", tools=[ADD], tool_choice=named, stream=True) as events:
                    r = [e for e in events][-1].response
            else:
                r = client.responses.create(model=ep.model, input="2+3=", tools=[ADD], tool_choice=named)
            calls = [o for o in r.output if o.type == "function_call"]
            seen["call"] = [(c.name, json.loads(c.arguments)) for c in calls], r.status
            outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "5"} for c in calls]
            seen["after"] = client.responses.create(model=ep.model, input=outputs, tools=[ADD], previous_response_id=r.id).output_text
        return 1.0

    out, _ = play(tok, agent, tool=False, after="\nuser\n<tool_response>\n9")  # no closing tag, no end of its turn
    assert out[0].fault == "" and seen["call"] == ([("add", {"a": 2, "b": 3})], "tool_calls" if api == "chat" else "completed")
    assert seen["after"] == "5"
    first, second = out[0].calls
    assert first.flag == "" and tok.decode(first.completion_ids).endswith('{"a": 2, "b": 3}}')  # through the brace, all generated
    assert len(first.logprobs) == len(first.completion_ids) and np.all(first.logprobs == -0.5)
    assert ledger.trained_chain(out[0].calls) == ((0, 1), 1)  # spliced: its prompt begins with the first's ids
    between = second.prompt_ids[len(first.prompt_ids) + len(first.completion_ids):]
    assert tok.decode(between).startswith("\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>")
    f = ledger.sample_fields(out[0].calls, (0, 1))
    n = len(first.completion_ids)
    assert f["loss_mask"].tolist() == [1] * n + [0] * len(between) + [1] * len(second.completion_ids)  # the tag: observation


@pytest.mark.parametrize("text, end", [
    ('{"name": "add", "arguments": {"a": 1}}', 38),
    ('  \n{"a": "}"} after', 13),  # leading whitespace; a brace in a string is text
    ('{"a": "say \\"}\\" ok"}}', 21),  # an escaped quote does not end the string
    ('{"a": "\\\\"}x', 11),  # an escaped backslash does
    ('{"a": {"b": 1}', -1),  # never closes
    ('{"a": {"b": 1}, "c": [1, {}]', -1),
    ('x {"a": 1}', -1),  # not an object first
    ('"{}"', -1),
    ('', -1),
])
def test_where_a_json_object_closes(text, end):
    from verlj.engine.rl.gateway.protocol import object_end

    assert object_end(text) == end
    if end >= 0:
        json.loads(text[:end])  # what it found is the whole object


def test_the_closing_a_call_that_continues_a_forced_one_is_given():
    """protocol.forced_closing: the closing tag the answer showed and the policy did not write, less what the token that
    closed the JSON held past the brace; "" where the call did not end there (a call journaled before, which wrote its own
    tag and end of turn; one cut at its length)."""
    from verlj.engine.rl.gateway.protocol import TOOL_CLOSE, TOOL_OPEN, forced_closing

    decode = "".join  # a token a string; an end of turn decodes to ""
    named = TOOL_OPEN + '{"name": "add", "arguments":'
    call = {"content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}
    assert forced_closing(named, call, [" {", "}", "}"], decode) == TOOL_CLOSE
    assert forced_closing(TOOL_OPEN, call, ['{"name": "add", "arguments": {}', "}\n"], decode) == "</tool_call>"  # held the newline
    assert forced_closing(TOOL_OPEN, call, ['{"name": "add", "arguments": {}', "}}"], decode) == TOOL_CLOSE  # held another brace
    # what calls journaled before forced calls ended at their JSON were: the tag and the end of turn written by the policy
    assert forced_closing(named, call, [" {}", "}", "\n", "</tool_call>", ""], decode) == ""
    assert forced_closing("", call, ['{"a": 1}'], decode) == ""  # not forced
    cut = {"content": named + ' {"a": 1', "tool_calls": []}  # cut at its length: never closed
    assert forced_closing(named, cut, [' {"a": 1'], decode) == ""
    malformed = {"content": named + ' {"a": plus}' + "}" + TOOL_CLOSE, "tool_calls": []}  # closed, did not parse: the tag shown all the same
    assert forced_closing(named, malformed, [' {"a": plus}', "}"], decode) == TOOL_CLOSE


def test_forced_prefixes_and_their_refusals():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": tools}
    req = parse_request(json.dumps({**body, "tool_choice": {"type": "function", "function": {"name": "add"}}}).encode(), MODEL)
    assert forced_prefix(req) == '<tool_call>\n{"name": "add", "arguments":'
    assert forced_prefix(parse_request(json.dumps({**body, "tool_choice": "auto"}).encode(), MODEL)) == ""
    assert forced_prefix(parse_request(json.dumps({**body, "tool_choice": "none"}).encode(), MODEL)) == ""
    for bad, param in [({**body, "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
                       ({"model": MODEL, "messages": body["messages"], "tool_choice": "required"}, "tool_choice"),
                       ({**body, "tool_choice": "always"}, "tool_choice"),
                       ({**body, "tool_choice": {"type": "function", "function": "add"}}, "tool_choice"),
                       ({**body, "tool_choice": {"type": "function", "function": None}}, "tool_choice")]:
        with pytest.raises(ApiError) as e:
            parse_request(json.dumps(bad).encode(), MODEL)
        assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "5"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {}}}}, "text.format"),
    ({"input": "x", "tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "5"}]}, "input"),  # answers no function_call
    ({"input": [{"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_2", "output": "5"}]}, "input"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "include": [1]}, "include"),
])
def test_bad_responses_requests_get_openai_shaped_errors(body, param):
    with pytest.raises(ApiError) as e:
        parse_responses(json.dumps({"model": MODEL, **body}).encode(), MODEL)
    assert e.value.status == 400 and e.value.param == param and json.loads(e.value.body())["error"]["message"]


def test_input_items_read_as_chat_messages():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "2+3="}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "let me add", "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2}', "id": "fc_1", "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "5"}]
    req = parse_responses(json.dumps({"model": MODEL, "input": items, "instructions": "Add.", "include": [], "metadata": {},
                                      "parallel_tool_calls": False, "truncation": "disabled"}).encode(), MODEL)
    assert req.messages == [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+3="},
                            {"role": "assistant", "content": "let me add",
                             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
                            {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    assert json.loads(req.canonical())["api"] == "responses" and req.digest() != parse_responses(
        json.dumps({"model": MODEL, "input": items}).encode(), MODEL).digest()


def test_a_function_call_output_must_answer_a_call_of_the_input_or_the_previous_response(bpe_tokenizer):
    said = {}

    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        first = client.responses.create(model=ep.model, input="2+3=", tools=[ADD])
        call = first.output[0]
        for call_id in ("call_not_made", call.call_id):
            try:
                r = client.responses.create(model=ep.model, input=[{"type": "function_call_output", "call_id": call_id, "output": "5"}],
                                            tools=[ADD], previous_response_id=first.id)
                said[call_id] = r.output_text
            except openai.BadRequestError as e:
                said[call_id] = e.body
        return 1.0

    out, _ = play(bpe_tokenizer, agent)
    assert out[0].fault == "" and len(out[0].calls) == 2  # the refused call was never generated
    refused = said.pop("call_not_made")
    assert refused == {"message": "No tool call found for function call output with call_id call_not_made.", "type": "invalid_request_error",
                       "param": "input", "code": None}
    assert list(said.values()) == ["5"]


def _exact(model) -> None:
    """A parsed SDK object holds only the fields its type declares (the openai SDK keeps any other as an extra)."""
    from pydantic import BaseModel

    assert not model.model_extra, model.model_extra
    for v in dict(model).values():
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, BaseModel):
                _exact(x)


@pytest.mark.parametrize("top", [0, 2])
def test_responses_logprobs_are_served_in_openais_shape_the_sampled_token_only_as_top(bpe_tokenizer, top):
    """include message.output_text.logprobs: each output token's text, log-prob and bytes in the output_text part, and
    without bytes in the stream's text events, as the openai SDK's Responses types declare them (parsed by them, no
    field left over); top_logprobs lists the sampled token only (verlj's samplers keep no alternatives). The same
    tokens and log-probs as the call journaled; without include, none, and the request journaled as before."""
    from openai.types.responses import ResponseOutputText, ResponseTextDeltaEvent, ResponseTextDoneEvent

    seen = {}

    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        ask = {"model": ep.model, "input": "Say hello.", "include": ["message.output_text.logprobs"], "top_logprobs": top}
        seen["plain"] = client.responses.create(**ask)
        with client.responses.create(**ask, stream=True) as events:
            seen["events"] = list(events)
        seen["none"] = client.responses.create(model=ep.model, input="Say hello.", top_logprobs=top)
        return 1.0

    out, _ = play(bpe_tokenizer, agent, tool=False)
    assert out[0].fault == ""
    call, streamed = out[0].calls[:2]
    tokens = [bpe_tokenizer.decode([int(t)], skip_special_tokens=True) for t in call.completion_ids]  # its end of turn: ""
    assert tokens[-1] == "" and "".join(tokens) == "hello world"  # as a chat completion's logprobs show it
    want = [(t, float(lp)) for t, lp in zip(tokens, call.logprobs)]
    # the journaled bytes validated by the SDK's own types (strictly: the client only constructs what it reads)
    for part in (ResponseOutputText.model_validate(json.loads(call.response)["output"][0]["content"][0]),
                 seen["plain"].output[0].content[0]):
        _exact(part)
        assert part.text == "hello world" and [(x.token, x.logprob) for x in part.logprobs] == want
        assert all(x.bytes == list(x.token.encode()) for x in part.logprobs)
        assert [[(y.token, y.logprob, y.bytes) for y in x.top_logprobs] for x in part.logprobs] == [
            [(x.token, x.logprob, x.bytes)] if top else [] for x in part.logprobs]
    kinds = {"response.output_text.delta": ResponseTextDeltaEvent, "response.output_text.done": ResponseTextDoneEvent}
    events = [e.split("\ndata: ", 1) for e in streamed.response.decode().split("\n\n") if e]
    text_events = [kinds[k[len("event: "):]].model_validate_json(data) for k, data in events if k[len("event: "):] in kinds]
    assert [type(e) for e in text_events] == [ResponseTextDeltaEvent, ResponseTextDoneEvent]  # with log-probs the text is sent whole
    assert [e.type for e in seen["events"] if e.type in kinds] == list(kinds)
    for e in text_events:
        _exact(e)
        assert [(x.token, x.logprob) for x in e.logprobs] == want
        assert [[(y.token, y.logprob) for y in x.top_logprobs] for x in e.logprobs] == [[(x.token, x.logprob)] if top else [] for x in e.logprobs]
    assert seen["events"][-1].response.output[0].content[0].logprobs == seen["plain"].output[0].content[0].logprobs
    # without include: no log-probs, and top_logprobs alone decides nothing (the journaled request is the one it always was)
    assert seen["none"].output[0].content[0].logprobs == []
    plain = parse_responses(json.dumps({"model": MODEL, "input": "Say hello."}).encode(), MODEL)
    assert out[0].calls[2].request == plain.canonical()
