"""Agents for the gateway's tests (rollout.agent=agents_for_tests:NAME, with tests/ on PYTHONPATH), each
written against the real `openai` client as any agent program is.

VERLJ_TEST_AGENT_FORBID=1: any agent run ends the process at once (exit 97), so a replay or a resume that
plays no live step proves it never ran an agent. VERLJ_TEST_AGENT_MORE: what `digits` sends as its second
user message ("more"): another one is an agent changed between a crash and its resume."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import openai

FORBID = "VERLJ_TEST_AGENT_FORBID"


_HTTP: list = []  # this process's one connection pool for the synchronous clients
_HTTP_LOCK = threading.Lock()


def _client(ep, cls=openai.OpenAI):
    """A client of the episode's own (its base_url and key). The synchronous ones share one connection pool, as an
    agent service that keeps an httpx client does: a pool of its own per episode would spend most of a test run
    loading the system's CA certificates (about 30 ms a client, for a gateway served over plain HTTP)."""
    if os.environ.get(FORBID) == "1":
        sys.stderr.write(f"agents_for_tests: an agent ran with {FORBID}=1\n")
        sys.stderr.flush()
        os._exit(97)
    if cls is not openai.OpenAI:
        return cls(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    with _HTTP_LOCK:
        if not _HTTP:
            _HTTP.append(openai.DefaultHttpxClient())
    return cls(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, http_client=_HTTP[0])


def digits(ep):
    """Two calls (the second continues the first's conversation); the reward: the share of digits in both answers."""
    client = _client(ep)
    msgs = [{"role": "user", "content": ep.row["prompt"][-12:]}]
    first = client.chat.completions.create(model=ep.model, messages=msgs)
    a = first.choices[0].message.content or ""
    msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": os.environ.get("VERLJ_TEST_AGENT_MORE", "more")}]
    second = client.chat.completions.create(model=ep.model, messages=msgs)
    b = second.choices[0].message.content or ""
    text = a + b
    return sum(c.isdigit() for c in text) / max(1, len(text))


def ticketing(ep):
    """A model call, then a tool call through the gateway's MCP server (rollout.tools: VERLJ_TEST_TOOL, default open_ticket) with
    the answer as its title, its result the next user message of the second call; the reward as digits'."""
    import asyncio

    client = _client(ep)
    msgs = [{"role": "user", "content": ep.row["prompt"][-12:]}]
    a = client.chat.completions.create(model=ep.model, messages=msgs).choices[0].message.content or ""
    got = asyncio.run(_mcp_call(ep, os.environ.get("VERLJ_TEST_TOOL", "open_ticket"), {"title": a}))
    msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": got}]
    b = client.chat.completions.create(model=ep.model, messages=msgs).choices[0].message.content or ""
    return sum(c.isdigit() for c in a + b) / max(1, len(a + b))


async def _mcp_call(ep, name: str, arguments: dict) -> str:
    """One tool call with the `mcp` package's own client, the episode's key as its bearer token."""
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {ep.api_key}"}) as hc, \
            streamable_http_client(ep.mcp_url, http_client=hc) as streams, ClientSession(streams[0], streams[1]) as s:
        await s.initialize()
        out = await s.call_tool(name, arguments)
    if out.is_error:
        raise RuntimeError(out.content[0].text)
    return out.content[0].text


async def streaming(ep):
    """One streamed call with the async client; None: rollout.reward_fn scores the answer."""
    client = _client(ep, openai.AsyncOpenAI)
    stream = await client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": ep.row["prompt"][-12:]}],
                                                  stream=True)
    async for _ in stream:
        pass
    return None


def flaky(ep):
    """Raises for one seed in four (an episode fault); else as digits."""
    if ep.seed % 4 == 0:
        _client(ep)
        raise RuntimeError("the sandbox is down")
    return digits(ep)


def uneven(ep):
    """One to three calls (1 + seed mod 3), each continuing the conversation: episodes of a step end at different
    calls, so ranks run out of calls at different batches. The reward: the share of digits in the answers."""
    client = _client(ep)
    msgs, text = [{"role": "user", "content": ep.row["prompt"][-12:]}], ""
    for k in range(1 + ep.seed % 3):
        got = client.chat.completions.create(model=ep.model, messages=msgs).choices[0].message.content or ""
        msgs += [{"role": "assistant", "content": got}, {"role": "user", "content": f"more {k}"}]
        text += got
    return sum(c.isdigit() for c in text) / max(1, len(text))


def _main_thread_in() -> set[str]:
    """The functions the trainer's main thread is in now (its stack's qualified code names)."""
    frame, names = sys._current_frames().get(threading.main_thread().ident), set()
    while frame is not None:
        names.add(frame.f_code.co_qualname)
        frame = frame.f_back
    return names


def overlapping(ep):
    """As digits, after watching the trainer's main thread (up to 10 s, until it waits for the round's agents in
    AgentRounds.samples, sources/agent_players.py): seen in the update (rl.update._update), the file
    VERLJ_TEST_AGENT_OVERLAP names is written."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        names = _main_thread_in()
        if "_update" in names:
            with open(os.environ["VERLJ_TEST_AGENT_OVERLAP"], "a") as f:
                f.write(f"{ep.seed}\n")
            break
        if "AgentRounds.samples" in names:  # the trainer waits for this round: no update runs until it is played
            break
        time.sleep(0.005)
    return digits(ep)


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def tooled(ep):
    """Three calls with the add tool offered, each answer sent back as it came (the message as the client parsed it): a
    tool call is run and its result sent, else a next question. The reward: 1.0 when the last answer holds the row's
    answer, else a tenth of its share of digits."""
    client = _client(ep)
    msgs = [{"role": "user", "content": ep.row["prompt"]}]
    text = ""
    for k in range(3):
        m = client.chat.completions.create(model=ep.model, messages=msgs, tools=TOOLS).choices[0].message
        msgs.append(m.model_dump(exclude_none=True))
        text = m.content or ""
        if m.tool_calls:
            for c in m.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                    result = str(int(args["a"]) + int(args["b"]))
                except (ValueError, KeyError, TypeError) as e:
                    result = f"error: {e}"
                msgs.append({"role": "tool", "tool_call_id": c.id, "content": result})
        else:
            msgs.append({"role": "user", "content": f"Are you sure? ({k})"})
    want = str(ep.row["answer"])
    return 1.0 if want in text else 0.1 * sum(ch.isdigit() for ch in text) / max(1, len(text))


async def leaky_stream(ep):
    """Two streamed calls with an AsyncOpenAI client of its own, never closed (the openai docs' pattern), the second
    continuing the first as answered; it says where it is on stdout. None: rollout.reward_fn scores the last answer."""
    client = _client(ep, openai.AsyncOpenAI)
    msgs = [{"role": "user", "content": ep.row["prompt"]}]
    for _ in range(2):
        stream = await client.chat.completions.create(model=ep.model, messages=msgs, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Once more."}]
    print(f"leaky_stream: episode {ep.episode} played, attempt {ep.attempt}")
    return None
