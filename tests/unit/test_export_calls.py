"""`verlj export RUN --rollouts --turns` for agent episodes (post_mortem.rollouts.call_rows): a row per model
call, with the messages sent, the answer's text and tool calls, whether the call is trained, its ids and the
episode's reward; an episode that made no call is one row, call 0, with its fault's reason."""

from __future__ import annotations

import json

import numpy as np

from verlj.engine.post_mortem.rollouts import CALL_COLUMNS, call_rows
from verlj.engine.rl.gateway.protocol import Completion, parse_request, response_bytes
from verlj.engine.schema.agent_calls import AgentCalls, Call
from verlj.engine.schema.sample import AGENT_TEXT

MODEL = "m"


def call(messages: list, text: str, prompt: list, completion: list, tools: bool = False) -> Call:
    body = {"model": MODEL, "messages": messages}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    req = parse_request(json.dumps(body).encode(), MODEL)
    resp, flag = response_bytes(req, Completion(text, [], [], "stop", len(prompt), len(completion)), "c0")
    return Call(req.canonical(), req.digest(), np.asarray(prompt), np.asarray(completion), np.full(len(completion), -0.5, np.float32), resp, flag)


def test_a_row_per_call_with_its_messages_answer_tool_calls_and_the_episodes_reward():
    sent = [{"role": "user", "content": "2+3="}]
    first = call(sent, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', [1, 5], [6, 7], tools=True)
    back = [*sent, {"role": "assistant", "content": None, "tool_calls": json.loads(first.response)["choices"][0]["message"]["tool_calls"]},
            {"role": "tool", "tool_call_id": "call_c0_0", "content": "5"}]
    second = call(back, "5", [1, 5, 6, 7, 9], [8])
    rewritten = call([{"role": "user", "content": "again"}], "5", [1, 4], [8])  # a prefix break: not trained
    cols = {"step": np.array([3, 3]), "sample_id": np.array([10, 11]), "group": np.array([2, 2]), "index": np.array([7, 7]),
            "policy_version": np.array([2, 2]), "score": np.array([1.0, 0.0]), "env_end": np.array([1, 3], np.int8),
            "env_reason": ["", "the agent raised RuntimeError: down"],
            AGENT_TEXT: [AgentCalls((first, second, rewritten), (0, 1), 1.0, 2).to_json(), ""]}
    rows = list(call_rows(cols))
    assert all(list(r) == CALL_COLUMNS for r in rows)
    assert [(r["sample_id"], r["call"], r["attempt"]) for r in rows] == [(10, 1, 1), (10, 2, 1), (10, 3, 1), (11, 0, None)]  # the default: one process
    one, two, three, fault = rows
    assert json.loads(one["messages"]) == sent and one["tool_calls"] == ['add({"a": 2, "b": 3})'] and one["finish_reason"] == "tool_calls"
    assert json.loads(two["messages"])[-1] == {"role": "tool", "tool_call_id": "call_c0_0", "content": "5"}
    assert two["content"] == "5" and two["tool_calls"] == [] and two["completion_ids"] == [8] and two["logprobs"] == [-0.5]
    assert [r["trained"] for r in (one, two, three)] == [True, True, False]
    assert {r["reward"] for r in (one, two, three)} == {1.0} and one["step"] == 3 and one["policy_version"] == 2
    assert fault["call"] == 0 and fault["messages"] is None and fault["env_reason"] == "the agent raised RuntimeError: down"
    json.dumps(rows)  # JSON-ready
