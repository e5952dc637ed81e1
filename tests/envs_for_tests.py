"""Environments for the episode tests (rollout.env=envs_for_tests:NAME, with tests/ on PYTHONPATH).

VERLJ_TEST_ENV_FORBID=1: any reset or step ends the process at once (exit 97), so a replay, a rerun or a
resume that plays no live step proves it never called the environment."""

from __future__ import annotations

import os
import sys
import time

from verlj.engine.rl.envs import StepResult

FORBID = "VERLJ_TEST_ENV_FORBID"


def _forbidden(what: str) -> None:
    if os.environ.get(FORBID) == "1":
        sys.stderr.write(f"envs_for_tests: {what} called with {FORBID}=1\n")
        sys.stderr.flush()
        os._exit(97)


class Digits:
    """Deterministic, rewards that vary: each action is told its length back; the reward of an action
    is the share of its characters that are digits (every turn), and an action holding a 7 ends the
    episode. Up to 3 actions."""

    def reset(self, row: dict, seed: int) -> str:
        _forbidden("reset")
        self.turns, self.seed = 0, seed
        return f"#{seed % 10}:"

    def step(self, action: str) -> StepResult:
        _forbidden("step")
        self.turns += 1
        share = sum(c.isdigit() for c in action) / max(1, len(action))
        return StepResult(f"[{len(action)}]", share, "7" in action or self.turns >= 3)


class Faulty(Digits):
    """Digits, except that by its seed an episode's second step raises (seed % 8 == 1), returns a list
    (== 2) or hangs for 3 s (== 3; run it with a short rollout.env_timeout_s)."""

    def step(self, action: str):
        _forbidden("step")
        kind = self.seed % 8
        if self.turns == 1 and kind == 1:
            raise ValueError("the sandbox fell over")
        if self.turns == 1 and kind == 2:
            return ["obs", 1.0, True]
        if self.turns == 1 and kind == 3:
            time.sleep(3)
        out = super().step(action)
        return StepResult(out.observation, out.reward, False) if self.turns < 3 else out


class TupleDigits(Digits):
    """Digits written as most RL libraries write an env: step returns (observation, reward, done)."""

    def step(self, action: str):
        out = super().step(action)
        return out.observation, out.reward, out.done


class GymDigits(Digits):
    """Digits written as gymnasium writes one: reset returns (observation, info), step (observation,
    reward, terminated, truncated, info), truncated at the third action."""

    def reset(self, row: dict, seed: int):
        return super().reset(row, seed), {"seed": seed}

    def step(self, action: str):
        out = super().step(action)
        return out.observation, out.reward, "7" in action, self.turns >= 3, {}


class ResetFaulty(Digits):
    """Digits whose reset raises for one seed in four (seed % 4 == 1)."""

    def reset(self, row: dict, seed: int) -> str:
        if seed % 4 == 1:
            raise ConnectionError("no sandbox for this one")
        return super().reset(row, seed)


class PoolDown(Digits):
    """Digits whose reset raises for every episode of a group whose prompt ends in 1 or 2 (a sandbox pool down for those
    tasks): a group with no episode played, the infrastructure failure that must never be trained as reward 0."""

    def reset(self, row: dict, seed: int) -> str:
        if row["prompt"].rstrip("=").endswith(("1", "2")):
            raise ConnectionError("the sandbox pool for this task is down")
        return super().reset(row, seed)


class Flood(Digits):
    """Digits whose every observation is a megabyte of text (rollout.max_observation_length caps it)."""

    def step(self, action: str) -> StepResult:
        out = super().step(action)
        return StepResult("x" * 1_000_000, out.reward, out.done)


class Hang(Digits):
    """Digits whose every step hangs for 60 s (past any short rollout.env_timeout_s)."""

    def step(self, action: str) -> StepResult:
        time.sleep(60)
        return super().step(action)


DOWN = "VERLJ_TEST_SANDBOX_DOWN"


class Sandbox(Digits):
    """Digits whose every step raises RuntimeError("the sandbox is down") while the file named by
    $VERLJ_TEST_SANDBOX_DOWN exists: a fault that the test then fixes (removes the file)."""

    def step(self, action: str) -> StepResult:
        if os.path.exists(os.environ.get(DOWN, "/nonexistent/verlj")):
            raise RuntimeError("the sandbox is down")
        return super().step(action)


LOG = "VERLJ_TEST_ENV_LOG"


class Logged(Digits):
    """Digits that appends every reset and step it gets to the file $VERLJ_TEST_ENV_LOG (one JSON line: the
    process, the call, the env's seed, the action): what the crash tests count. It has a state() too."""

    def _log(self, call: str, action: str = "") -> None:
        import json

        with open(os.environ[LOG], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "call": call, "seed": self.seed, "action": action}) + "\n")

    def reset(self, row: dict, seed: int) -> str:
        out = super().reset(row, seed)
        self._log("reset")
        return out

    def step(self, action: str) -> StepResult:
        out = super().step(action)
        self._log("step", action)
        return out

    def state(self) -> dict:
        """Its seed and turns so far: journaled after reset and each step (the sample's env_states); never logged."""
        _forbidden("state")
        return {"seed": self.seed, "turns": self.turns}


def digit_share(prompt: str, response: str, answer: str) -> float:
    """A reward that varies for an untrained model (rollout.reward_fn=envs_for_tests:digit_share): the share
    of the response's characters that are digits."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def flaky_reward(prompt: str, response: str, answer: str) -> float:
    """A reward function that fails on some responses (rollout.reward_fn=envs_for_tests:flaky_reward): it raises
    on a response holding a 3, returns NaN on one holding a 5 (without a 3), else digit_share."""
    if "3" in response:
        raise RuntimeError("the grader is down")
    return float("nan") if "5" in response else digit_share(prompt, response, answer)


class CharTok:
    """A tokenizer for the unit tests of episodes: one token a character (its code point); 0 is the end-of-sequence token."""

    eos_token_id = 0
    bos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        class Out:
            input_ids = [ord(c) for c in text]
        return Out()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids if not (skip_special_tokens and int(i) == 0))
