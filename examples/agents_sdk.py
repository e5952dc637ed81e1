"""An agent written with the OpenAI Agents SDK (`openai-agents`), the library used unmodified: verlj runs
`solve` once per sample (rollout.agent=examples.agents_sdk:solve; examples/agents_sdk.yaml).

The agent is an `agents.Agent` with one `@function_tool`, `add`, run by `agents.Runner.run` on the SDK's default
model (the Responses API, `/v1/responses`) from an `OpenAIProvider` pointed at the episode's gateway: the SDK sends
its own requests (its instructions, its tools' strict JSON schemas, its input items, `include`, `parallel_tool_calls`)
and verlj answers them from the policy. A tool call the gateway parses (hermes `<tool_call>` JSON) is run by the SDK
and its result sent back as a `function_call_output` in the next call, which is spliced onto the first (the tool's
turn masked from the loss); the episode ends on the SDK's final output, at most episode.max_turns model calls. The
provider's client is made per episode and never closed, as the SDK's docs make it: the gateway's one event loop
closes it when it is collected. The SDK's tracing is off: nothing leaves the machine.

A response cut at rollout.max_response_length is `incomplete`, as OpenAI's are, and the SDK raises on one
(`ModelBehaviorError`): `solve` lets it, as the SDK's docs write an agent. verlj reads an episode whose agent raised
after its last answer was cut as **truncated** (ended by length, no fault), trained as rollout.overlong says
(examples/agents_sdk.yaml scores it 0.0, so the policy learns to end its turns). More than max_turns calls
(`MaxTurnsExceeded`) is the policy's doing too: `solve` scores it 0.0 (an exception would be a fault, left out of the
update). It runs on a model that ends its turns (examples/make_bpe_model.py's). To speak chat
completions instead, give the Agent `OpenAIChatCompletionsModel(model=episode.model, openai_client=AsyncOpenAI(...))`
(tests/unit/test_gateway_sdk.py does both).

Its reward, from the final output alone: 1.0 when it holds the row's answer, else a tenth of the share of
digits in it (so an untrained model has something to climb).
"""

from __future__ import annotations

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIProvider,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)

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
    provider = OpenAIProvider(base_url=episode.base_url, api_key=episode.api_key)  # the SDK's default model: the Responses API
    agent = Agent(name="adder", instructions="Answer with the number. Use the add tool to add.", tools=[add], model=episode.model,
                  model_settings=ModelSettings(parallel_tool_calls=False))
    try:
        result = await Runner.run(agent, episode.row["prompt"], max_turns=episode.max_turns,
                                  run_config=RunConfig(model_provider=provider, tracing_disabled=True))
    except MaxTurnsExceeded:  # too many calls: the policy's doing (a cut answer's ModelBehaviorError: truncated, verlj's)
        return 0.0
    return reward(str(result.final_output or ""), str(episode.row["answer"]))
