"""An OpenEnv MCP environment served locally: a question answered with its ``add`` tool (examples/openenv_mcp.yaml).

    python examples/openenv_mcp_server.py --port 8766   # serves http://127.0.0.1:8766 (needs pip install 'verlj[openenv]')
    verlj train -o runs/openenv-mcp --config examples/openenv_mcp.yaml model.actor.model_name_or_path=models/bpe

Written as any OpenEnv MCP environment is (``openenv.core``: an ``MCPEnvironment`` whose tools are FastMCP's,
served by ``create_app`` with ``CallToolAction`` as its action): nothing here knows verlj. ``reset`` takes the
question's ``answer`` (verlj passes the dataset row's fields; OpenEnv hands the env those it takes; without one,
the sum of two digits drawn from the seed, sha256 of it), so the env is deterministic given its reset and the
calls, and says to use the tool. ``add(a, b)`` answers the sum; a call whose sum is the answer scores 1.0 and
ends the episode (the reward and done set on that call's observation), another scores nothing and the policy
may call again.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class AddState(State):
    target: int = 0


class TaskObservation(Observation):
    hint: str = Field(default="", description="what to do, after the question")


class AddEnvironment(MCPEnvironment):
    """One tool, ``add``; the answer is the row's, or two digits' sum drawn from the seed."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session gets its own instance

    def __init__(self) -> None:
        mcp = FastMCP("add")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first addend.
                b: the second addend.
            """
            return a + b

        super().__init__(mcp)
        self._state = AddState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, answer: str | None = None, **kwargs: Any) -> Observation:
        digest = hashlib.sha256(f"add/{seed or 0}".encode()).digest()
        target = int(answer) if answer is not None else digest[0] % 10 + digest[1] % 10
        self._state = AddState(episode_id=episode_id, step_count=0, target=target)
        return TaskObservation(hint=" Use the add tool.")

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._judge(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._judge(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _judge(self, action: Action, obs: Observation) -> Observation:
        """A step counted (listing the tools is one too); a call of ``add`` whose sum is the answer scores 1.0 and ends
        the episode."""
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and isinstance(obs, CallToolObservation) and obs.error is None:
            if action.tool_name == "add" and getattr(obs.result, "data", None) == self._state.target:
                obs.done, obs.reward = True, 1.0
        return obs

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": f"unknown action {type(action).__name__}: call a tool"})

    @property
    def state(self) -> AddState:
        return self._state


def make_app(max_concurrent_envs: int = 64):
    """The FastAPI app serving AddEnvironment (one instance a WebSocket session)."""
    return create_app(AddEnvironment, CallToolAction, CallToolObservation, env_name="add_mcp", max_concurrent_envs=max_concurrent_envs)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--max-concurrent-envs", type=int, default=64, help="WebSocket sessions at once (one an episode)")
    args = parser.parse_args()
    uvicorn.run(make_app(args.max_concurrent_envs), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
