"""What journaling a tool call costs (rollout.tools): the same tool calls made three ways, side by side in one process,
with the tool itself doing nothing (it returns its argument), so the differences are verlj's.

    python tools/bench_tools.py                        # 8 episodes in flight, 16 tool calls each, 5 repeats
    python tools/bench_tools.py --episodes 1 --calls 64

Arms, each the median over repeats of the wall time per call (every episode's calls over the round's time):

- function: the tool called in-process by the agent (what a tool costs without verlj);
- MCP, not journaled: each call through the gateway's MCP server (the `mcp` package's client and server, the episode's
  key, `gateway.runner.Play.call_tool`) with nowhere to make it durable;
- MCP, journaled: the same, each call made durable twice in a real LMDB journal's pending store (as sent before it runs,
  with its result before its caller is answered: fsynced transactions, ``ledger.in_flight``).

The journaled arm less the one not journaled is **what journaling adds** to a tool call (the issue's goal: at most 2 ms a
call, as for model calls); the MCP arm less the function is what MCP itself costs. The agents run on the gateway's event
loop, one MCP session an episode, their calls in sequence (an episode's tool calls are ordered).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from verlj.engine.loop.ledger.in_flight import InFlight
from verlj.engine.rl.gateway.agents import AgentEpisode
from verlj.engine.rl.gateway.prompts import Prompts
from verlj.engine.rl.gateway.runner import Episodes, Runner, Settings
from verlj.engine.rl.gateway.server import Gateway
from verlj.engine.rl.gateway.tools import as_tool, tool
from verlj.engine.rl.models import builtin_tokenizer, chat_template
from verlj.engine.rl.vocab import VOCABS
from verlj.journal import Journal

TOK = builtin_tokenizer(VOCABS["ascii"])


@tool(effect="external")
def echo(text: str, idempotency_key: str) -> str:
    """Return `text`."""
    return text


def generate(prompts, seeds, episodes=(), on_token=None):
    outs = [np.asarray([TOK.eos_token_id], np.int64) for _ in prompts]
    return outs, [np.zeros(1, np.float32) for _ in prompts]


generate.streams = False  # type: ignore[attr-defined]


class JournalSink:
    """Each tool call made durable in a real journal's pending store (gateway.runner.ToolSink), as a step-order run does."""

    def __init__(self, journal: Journal):
        self.in_flight = InFlight(journal)

    def keep_tool(self, place, k, call, dropped):
        self.in_flight.write_in_flight([], [], tools=[(place, 0, k, call.to_dict())], dropped_tools=[(place, 0, j) for j in dropped])


def mcp_agent(calls: int, times: list):
    async def run(ep: AgentEpisode) -> float:
        import httpx2
        from mcp import ClientSession
        from mcp.client.streamable_http import streamable_http_client

        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {ep.api_key}"}) as hc, \
                streamable_http_client(ep.mcp_url, http_client=hc) as streams, ClientSession(streams[0], streams[1]) as s:
            await s.initialize()
            t0 = time.perf_counter()
            for k in range(calls):
                await s.call_tool("echo", {"text": f"call {k}"})
            times.append(time.perf_counter() - t0)
        return 0.0
    return run


def through_gateway(episodes: int, calls: int, journaled: bool) -> float:
    """Seconds per tool call: the episodes' calls (each episode's in sequence, the episodes at once) over the round's time."""
    gw = Gateway("bench", {"echo": as_tool(echo)}).start()
    times: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as d:
            journal = Journal.open_writer(Path(d) / "journal") if journaled else None
            try:
                r = Runner(gw, mcp_agent(calls, times), Prompts(TOK, chat_template(TOK, True), 0), generate, Settings(episodes, 60.0, 1))
                eps = Episodes([{"prompt": "x"}] * episodes, list(range(episodes)), list(range(episodes)), lambda place, k: k,
                               tool_sink=JournalSink(journal) if journal is not None else None)
                t0 = time.perf_counter()
                r.play(eps)
                wall = time.perf_counter() - t0
            finally:
                if journal is not None:
                    journal.close()
    finally:
        gw.stop()
    assert len(times) == episodes, "an episode failed"
    return max(times) / calls if episodes == 1 else wall / (episodes * calls)


def function(calls: int) -> float:
    t0 = time.perf_counter()
    for k in range(calls):
        echo(f"call {k}", idempotency_key=f"k{k}")
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    arms = {"function": lambda: function(args.calls), "MCP, not journaled": lambda: through_gateway(args.episodes, args.calls, False),
            "MCP, journaled": lambda: through_gateway(args.episodes, args.calls, True)}
    got: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.repeats):  # the arms interleaved, so a noisy moment falls on all of them
        for name, arm in arms.items():
            got[name].append(arm())
    med = {name: statistics.median(v) for name, v in got.items()}
    print(f"{args.episodes} episodes in flight, {args.calls} tool calls each, median of {args.repeats} repeats (ms a call):")
    for name, v in med.items():
        print(f"  {name:20s} {v * 1e3:8.3f}")
    added = med["MCP, journaled"] - med["MCP, not journaled"]
    print(f"journaling adds {added * 1e3:.3f} ms a call ({med['MCP, journaled'] / med['MCP, not journaled']:.2f}x the call not "
          f"journaled; goal: at most 2 ms); MCP itself costs {(med['MCP, not journaled'] - med['function']) * 1e3:.3f} ms a call")


if __name__ == "__main__":
    main()
