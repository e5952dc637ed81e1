"""A LangChain agent whose tools are verlj's, reached over MCP by LangChain's own adapters: a program verlj runs once an
episode (rollout.agent=cmd:..., with examples/agents_sdk_mcp.yaml's tools), in an interpreter of its own, because LangChain's MCP
adapters pin mcp<2 while verlj's tools server is mcp 2's. It imports nothing of verlj: what it knows of its episode is
in its environment (OPENAI_BASE_URL, OPENAI_API_KEY, VERLJ_MODEL, VERLJ_ROW, VERLJ_MAX_TURNS, VERLJ_MCP_URL), and its
reward is the last line it prints.

``MultiServerMCPClient`` lists the tools rollout.tools names (examples/agents_sdk_mcp.py's `add`, pure, and `submit`,
external) at the episode's MCP address, with the episode's key as its bearer token; ``ChatOpenAI`` offers them to the
policy through the gateway's chat completions; each tool call the policy makes is sent through the same MCP client, so
verlj journals it with its idempotency key, answers it from the journal after a crash, and never sends an external one
twice (docs/guides/agents.md#langchain-with-mcp-tools). The loop is LangChain's tool-calling loop, written out.

    python -m venv .lc && .lc/bin/pip install langchain-openai 'langchain-mcp-adapters>=0.3'   # LangChain's own venv
    python examples/make_bpe_model.py models/bpe
    verlj train --config examples/agents_sdk_mcp.yaml -o runs/langchain_mcp 'rollout.agent=cmd:.lc/bin/python examples/langchain_mcp.py'
"""

from __future__ import annotations

import asyncio
import json
import os

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_mcp_adapters.client import MultiServerMCPClient
from langchain_openai import ChatOpenAI


def reward(final: str, answer: str) -> float:
    """1.0 when the final answer holds the row's answer, else a tenth of its share of digits (examples/agents_sdk.py's)."""
    want = answer.strip()
    if want and want in final:
        return 1.0
    return 0.1 * sum(c.isdigit() for c in final) / max(1, len(final))


def text_of(out: object) -> str:
    """A tool's output as the text the policy reads: its text blocks joined. (LangChain 1.x returns content blocks, each
    with a fresh random id: put in the prompt as they are, they would make every attempt's prompt differ.)"""
    if isinstance(out, str):
        return out
    if isinstance(out, list):
        return "".join(str(b.get("text", "")) if isinstance(b, dict) else str(b) for b in out)
    return json.dumps(out, default=str)


async def solve() -> float:
    row = json.loads(os.environ["VERLJ_ROW"])
    key = os.environ["OPENAI_API_KEY"]
    client = MultiServerMCPClient({"verlj": {"transport": "streamable_http", "url": os.environ["VERLJ_MCP_URL"],
                                             "headers": {"Authorization": f"Bearer {key}"}}})
    tools = {t.name: t for t in await client.get_tools()}
    llm = ChatOpenAI(model=os.environ["VERLJ_MODEL"], base_url=os.environ["OPENAI_BASE_URL"], api_key=key, max_retries=0)
    model = llm.bind_tools(list(tools.values()), parallel_tool_calls=False)
    messages = [SystemMessage("Answer with the number. Use the add tool to add, then submit the answer."), HumanMessage(row["prompt"])]
    final = ""
    for _ in range(int(os.environ["VERLJ_MAX_TURNS"])):
        answer = await model.ainvoke(messages)
        messages.append(answer)
        final = answer.text
        if not answer.tool_calls:
            break
        for call in answer.tool_calls:
            tool = tools.get(call["name"])
            try:
                out = await tool.ainvoke(call["args"]) if tool is not None else f"no tool named {call['name']}"
            except Exception as e:  # noqa: BLE001 - the policy's arguments or the tool's error: told to the policy, as LangChain's agents do
                out = f"error: {e}"
            messages.append(ToolMessage(content=text_of(out), tool_call_id=call["id"]))
    return reward(final, str(row["answer"]))


if __name__ == "__main__":
    print(asyncio.run(solve()))
