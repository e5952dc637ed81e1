"""An agent written with the OpenAI Agents SDK (`openai-agents`), the library used unmodified: verlj runs
`solve` once per sample (rollout.agent=examples.agents_sdk:solve; examples/agents_sdk.yaml).

The agent is an `agents.Agent` with one `@function_tool`, `add`, run by `agents.Runner.run` on an
`OpenAIChatCompletionsModel` over an `AsyncOpenAI` client pointed at the episode's gateway: the SDK sends its
own requests (its tools' strict JSON schemas, `parallel_tool_calls`, its tool results as `tool` messages)
and verlj answers them from the policy. A tool call the gateway parses (hermes `<tool_call>` JSON) is run
by the SDK and its result sent back as the next call; the episode ends on the SDK's final output, at most
episode.max_turns model calls. The SDK's tracing is off: nothing leaves the machine.

Its reward, from the final output alone: 1.0 when it holds the row's answer, else a tenth of the share of
digits in it (so an untrained model has something to climb). A run that exceeds max_turns is an episode
fault (the SDK raises MaxTurnsExceeded), counted in the step's line.
"""

from __future__ import annotations

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)  # the SDK would otherwise export its traces to OpenAI's servers


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
    """
    return a + b


def reward(final: str, answer: str) -> float:
    """1.0 when the final output holds the answer, else a tenth of its share of digits."""
    want = answer.strip()
    if want and want in final:
        return 1.0
    return 0.1 * sum(c.isdigit() for c in final) / max(1, len(final))


async def solve(episode) -> float:
    client = AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
    model = OpenAIChatCompletionsModel(model=episode.model, openai_client=client)
    agent = Agent(name="adder", instructions="Answer with the number. Use the add tool to add.", tools=[add], model=model,
                  model_settings=ModelSettings(parallel_tool_calls=False))
    try:
        result = await Runner.run(agent, episode.row["prompt"], max_turns=episode.max_turns,
                                  run_config=RunConfig(tracing_disabled=True))
    finally:
        await client.close()
    return reward(str(result.final_output or ""), str(episode.row["answer"]))
