"""A tool-calling agent written against the `openai` client, as it would be against any OpenAI-compatible
endpoint: verlj runs it once per sample (rollout.agent=examples.tool_agent:solve; examples/agent.yaml).

It offers the model one tool, `add`; a tool call (hermes `<tool_call>{"name": "add", "arguments": {...}}`
</tool_call>, parsed by the gateway) is answered with the tool's result and the model asked again, up to
episode.max_turns calls. Its reward: 1.0 when the last answer holds the row's answer, else a tenth of the
share of digits in it (so an untrained model has something to climb).
"""

from __future__ import annotations

import json

import openai

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def _add(arguments: str) -> str:
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


def solve(episode) -> float:
    client = openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
    messages = [{"role": "system", "content": "Answer with the number."}, {"role": "user", "content": episode.row["prompt"]}]
    answer = ""
    for _ in range(episode.max_turns):
        reply = client.chat.completions.create(model=episode.model, messages=messages, tools=TOOLS).choices[0].message
        answer = reply.content or ""
        if not reply.tool_calls:
            break
        messages.append({"role": "assistant", "content": reply.content, "tool_calls": [c.model_dump() for c in reply.tool_calls]})
        messages += [{"role": "tool", "tool_call_id": c.id, "content": _add(c.function.arguments)} for c in reply.tool_calls]
    want = str(episode.row["answer"]).strip()
    if want and want in answer:
        return 1.0
    return 0.1 * sum(c.isdigit() for c in answer) / max(1, len(answer))
