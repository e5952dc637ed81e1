"""An OpenAI Agents SDK agent whose tools are verlj's, reached over MCP: the tools are Python functions in this file
(rollout.tools=[examples.agents_sdk_mcp:add, examples.agents_sdk_mcp:submit]) that the gateway serves to every episode at
``episode.mcp_url`` (streamable HTTP, the episode's key as its bearer token), and the SDK's own MCP client,
``MCPServerStreamableHttp``, lists and calls them (examples/agents_sdk_mcp.yaml; the library used unmodified).

Every tool call is journaled with its sample like a model call, with an idempotency key that is the same on every attempt
(docs/guides/agents.md#tools-through-the-journal). `add` is pure: no effect outside the episode. `submit` is external:
its effect is outside (here a line appended to runs/submissions.jsonl, or to the file VERLJ_SUBMISSIONS names, standing
in for a ticket, a message or a write to a database): after a crash it is **never sent twice**; a call whose outcome the crash left unknown is asked of its
reconcile (`submitted`, which looks the key up), so the episode goes on exactly. Without a reconcile the episode would be
unresolved: out of the update, its key shown by `verlj inspect` for an operator to check.

Its reward, as examples/agents_sdk.py's: 1.0 when the final output holds the row's answer, else a tenth of its share of
digits.
"""

from __future__ import annotations

import json
import os

from agents import Agent, MaxTurnsExceeded, ModelSettings, OpenAIProvider, RunConfig, Runner, set_tracing_disabled
from agents.mcp import MCPServerStreamableHttp

from verlj.engine.rl.gateway.tools import tool

from .agents_sdk import reward

set_tracing_disabled(True)  # the SDK would otherwise export its traces to OpenAI's servers


@tool(effect="pure")
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _submissions() -> str:
    """Where submissions go: $VERLJ_SUBMISSIONS, else runs/submissions.jsonl (beside the examples' runs)."""
    path = os.environ.get("VERLJ_SUBMISSIONS", os.path.join("runs", "submissions.jsonl"))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return path


def submitted(key: str, arguments: dict) -> str | None:
    """The reconcile: what a submission sent under `key` answered, None when it never arrived."""
    try:
        with open(_submissions()) as f:
            return next((e["result"] for e in map(json.loads, f) if e["key"] == key), None)
    except FileNotFoundError:
        return None


@tool(effect="external", reconcile=submitted)
def submit(answer: str, idempotency_key: str) -> str:
    """Submit the final answer (once)."""
    result = f"received {answer[:32]}"
    with open(_submissions(), "a") as f:
        f.write(json.dumps({"key": idempotency_key, "answer": answer, "result": result}) + "\n")
    return result


async def solve(episode) -> float:
    provider = OpenAIProvider(base_url=episode.base_url, api_key=episode.api_key)
    server = MCPServerStreamableHttp({"url": episode.mcp_url, "headers": {"Authorization": f"Bearer {episode.api_key}"}},
                                     cache_tools_list=True, name="verlj-tools")
    async with server:
        agent = Agent(name="adder", instructions="Answer with the number. Use the add tool to add, then submit the answer.",
                      mcp_servers=[server], model=episode.model, model_settings=ModelSettings(parallel_tool_calls=False))
        try:
            result = await Runner.run(agent, episode.row["prompt"], max_turns=episode.max_turns,
                                      run_config=RunConfig(model_provider=provider, tracing_disabled=True))
        except MaxTurnsExceeded:  # too many calls: the policy's doing
            return 0.0
    return reward(str(result.final_output or ""), str(episode.row["answer"]))
