"""An OpenEnv environment served locally: guess a digit, told "higher" or "lower" (examples/openenv_guess.yaml).

    python examples/openenv_server.py --port 8765       # serves http://127.0.0.1:8765 (needs pip install 'verlj[openenv]')
    verlj train -o runs/openenv --config examples/openenv_guess.yaml model.actor.model_name_or_path=models/bpe

Written as any OpenEnv environment is (``openenv.core``: an ``Environment`` with its ``Action`` and
``Observation`` models, served by ``create_app``): nothing here knows verlj. The secret digit is drawn from
the seed ``reset`` gets (sha256 of it: the same on every machine), so the env is deterministic given the
seed and the guesses, as verlj's resume needs. A guess is the first digit in the action's text: the right
one scores 1.0 and ends the episode; a wrong one is told "higher" or "lower"; an action without a digit is
told so; the third wrong guess ends the episode with 0.0.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

TRIES = 3


class GuessAction(Action):
    """The policy's text: its first digit is the guess."""

    guess: str = Field(..., description="text holding a digit from 0 to 9")


class GuessObservation(Observation):
    message: str = Field(default="", description="the rules, or how the last guess compares to the secret")


class GuessState(State):
    tries: int = 0


class GuessEnvironment(Environment):
    """Guess a secret digit in up to TRIES tries; the secret from the seed alone."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session gets its own instance

    def __init__(self) -> None:
        super().__init__()
        self._state, self._secret = GuessState(), 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._secret = int.from_bytes(hashlib.sha256(f"guess/{seed or 0}".encode()).digest()[:8], "big") % 10
        self._state = GuessState(episode_id=episode_id, step_count=0, tries=0)
        return GuessObservation(message=f"Guess a digit from 0 to 9 in {TRIES} tries.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        digit = re.search(r"\d", action.guess)
        if digit is None:
            return GuessObservation(message="write a digit", done=self._state.step_count >= TRIES, reward=0.0 if self._state.step_count >= TRIES else None)
        self._state.tries += 1
        guess = int(digit.group())
        if guess == self._secret:
            return GuessObservation(message="right", done=True, reward=1.0)
        if self._state.step_count >= TRIES:
            return GuessObservation(message=f"no: it was {self._secret}", done=True, reward=0.0)
        return GuessObservation(message="higher" if self._secret > guess else "lower", reward=None)

    @property
    def state(self) -> GuessState:
        return self._state


def make_app(max_concurrent_envs: int = 64):
    """The FastAPI app serving GuessEnvironment (one instance a WebSocket session)."""
    return create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess_digit", max_concurrent_envs=max_concurrent_envs)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--max-concurrent-envs", type=int, default=64, help="WebSocket sessions at once (one an episode)")
    args = parser.parse_args()
    uvicorn.run(make_app(args.max_concurrent_envs), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
