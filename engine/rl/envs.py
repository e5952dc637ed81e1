"""Environments: multi-turn episodes with tools and games, one text action and one text observation a turn.

    rollout.env: builtin:calculator       # a tool: <calc>12+7</calc> -> <result>19</result>; no tag: the final answer
    rollout.env: builtin:equals           # a calculator's = key on the row's question, for the digits vocabulary
    rollout.env: builtin:guess            # a game: guess the number, told "higher" / "lower"
    rollout.env: builtin:reasoning_gym    # a reasoning-gym row, answered in up to rollout.max_turns attempts
    rollout.env: my_envs:Maze             # yours: a class (or a function) that makes an Environment, called with no arguments
    rollout.env: trl:my_envs:Wordle       # a TRL environment_factory class: its public methods the model's tools (rl.trl_envs)
    rollout.env: openenv:http://127.0.0.1:8765   # an OpenEnv server's env, one session an episode (rl.openenv_envs)
    rollout.max_turns: 4                  # actions per episode at most (the built-ins end their episodes within it)
    rollout.env_timeout_s: 30             # an env call that has not answered by then is a fault (safe_step)

An episode: ``obs = env.reset(row, seed)`` (text appended after the prompt; may be ""; or gymnasium's
``(obs, info)``), then ``env.step(action)`` for each of the policy's actions until its answer says done
(or the rollout has taken rollout.max_turns actions). A step answers a StepResult, a 3-tuple
``(observation, reward, done)`` or gymnasium's ``(observation, reward, terminated, truncated, info)``. An env is deterministic given its seed and the actions it got: the
rollout journals the row, the seed and the actions (the journal holds what the world answered, and
replay never calls an env), and :func:`restore` rebuilds an env in the middle of an episode by replaying
those actions on a fresh ``reset(row, seed)``; no state_dict is needed.

A ``row`` is the dataset row as a dict (:func:`row_of`): ``prompt`` and ``answer`` (strings) for every
dataset, ``entry`` (reasoning-gym's item) for ``reasoning_gym:TASK`` data, ``data_source`` and
``extra_info`` for a verl file. The rollout calls an env through :func:`safe_reset` / :func:`safe_step`
(and :func:`safe_states` for an env with a ``state()`` method, whose states the sample journals), which turn
an exception, a wrong return type or a hang into an :class:`EnvFault` naming it. Loading
(:func:`load_env`, :func:`check_env`) turns an env that cannot be imported or made into one ConfigError.
"""

from __future__ import annotations

import ast
import functools
import math
import numbers
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol, runtime_checkable

import blake3
import numpy as np

from ..config import REASONING_GYM, Config
from ..errors import ConfigError
from ..plugins import import_object, raised_at
from ..schema.sample import state_text
from . import tasks, trl_envs

KEY = "rollout.env"

# ----------------------------------------------------------------------------- the protocol


@dataclass(frozen=True)
class StepResult:
    """What one action brought: the observation (text the policy reads next; "" for none), the reward
    of this step (None: none yet) and whether the episode is over."""

    observation: str
    reward: float | None
    done: bool


@runtime_checkable
class Environment(Protocol):
    """A multi-turn environment. Deterministic given `seed` and the actions `step` received since.

    It may define ``state() -> dict`` too (not part of the runtime check): a dict of JSON, deterministic as its
    answers are, journaled after reset and after each step it answers (:func:`safe_states`; the sample's env_states)."""

    def reset(self, row: dict, seed: int) -> str:
        """Start an episode on the dataset row `row` (row_of); the first observation, appended after the
        prompt (gymnasium's ``(observation, info)`` is taken too: safe_reset)."""

    def step(self, action: str) -> StepResult:
        """The policy's next action (the text it generated this turn): what the world answers (a
        3-tuple ``(observation, reward, done)`` or gymnasium's 5-tuple is taken too: safe_step)."""


@dataclass(frozen=True)
class EnvFault:
    """An env call that failed: `reason` in a few words ("raised ValueError: ...", "no answer in 5.0 s")."""

    reason: str

    def __str__(self) -> str:
        return self.reason


def row_of(example) -> dict:
    """The row an env's reset gets for an rl.data.Example (its fields, as plain values)."""
    messages = [dict(m) for m in example.messages] if example.messages is not None else None
    return {"prompt": example.prompt, "answer": example.answer, "task": example.task, "entry": example.entry,
            "messages": messages, "data_source": example.data_source, "extra_info": example.extra_info}


def restore(env_factory: Callable[[], Environment], row: dict, seed: int, actions: list[str]) -> Environment:
    """A fresh env from `env_factory`, reset on (row, seed), with `actions` stepped in order: the env as it
    was after them (what the rollout's recovery uses in the middle of an episode)."""
    env = env_factory()
    env.reset(row, seed)
    for action in actions:
        env.step(action)
    return env


# ----------------------------------------------------------------------------- calling an env safely


def safe_reset(env, row: dict, seed: int, timeout_s: float) -> str | EnvFault:
    """env.reset(row, seed), or an EnvFault when it raised, hung or returned anything else than an
    observation (a str) or gymnasium's ``(observation, info)`` (info a dict, not used)."""
    return as_observation(_call(lambda: env.reset(row, seed), timeout_s))


def safe_resets(calls: list[tuple[object, dict, int]], timeout_s: float) -> list[str | EnvFault]:
    """safe_reset on each (env, row, seed) of `calls`, all at once (as safe_steps)."""
    started = [_start(functools.partial(_reset, env, row, seed)) for env, row, seed in calls]
    deadline = time.monotonic() + timeout_s
    return [as_observation(_wait(call, deadline, timeout_s)) for call in started]


def as_observation(out) -> str | EnvFault:
    """What env.reset returned, as its observation, or the EnvFault saying what is wrong with it."""
    if isinstance(out, EnvFault) or isinstance(out, str):
        return out
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str) and isinstance(out[1], dict):
        return out[0]
    if isinstance(out, tuple) and len(out) == 2:
        return EnvFault(f"returned a tuple of {_a(out[0])} and {_a(out[1])}, not (observation str, info dict)")
    return EnvFault(f"returned {_a(out)}, not str or (observation, info)")


STEP_FORMS = "StepResult, (observation, reward, done) or (observation, reward, terminated, truncated, info)"


def safe_step(env, action: str, timeout_s: float) -> StepResult | EnvFault:
    """env.step(action) as a StepResult, or an EnvFault when it raised, hung or returned anything else.
    Three forms are taken (:func:`as_step_result`): a StepResult, a 3-tuple ``(observation, reward,
    done)``, gymnasium's 5-tuple ``(observation, reward, terminated, truncated, info)`` (done: either
    flag); in each the observation a str, the reward a finite number or None, done a bool."""
    out = _call(lambda: env.step(action), timeout_s)
    return out if isinstance(out, EnvFault) else as_step_result(out)


def as_step_result(out) -> StepResult | EnvFault:
    """What env.step returned, as a StepResult (reward a float or None), or the EnvFault saying what
    is wrong with it: the one place the forms of a step's answer are told apart (safe_step)."""
    if isinstance(out, StepResult):
        what, (obs, r, done) = "a StepResult", (out.observation, out.reward, out.done)
    elif isinstance(out, tuple) and len(out) == 3:
        what, (obs, r, done) = "a 3-tuple", out
    elif isinstance(out, tuple) and len(out) == 5:
        what, (obs, r, terminated, truncated, info) = "a 5-tuple", out
        for name, flag in (("terminated", terminated), ("truncated", truncated)):
            if not isinstance(flag, (bool, np.bool_)):
                return EnvFault(f"returned a 5-tuple whose {name} is {_a(flag)}, not bool")
        if not isinstance(info, dict):
            return EnvFault(f"returned a 5-tuple whose info is {_a(info)}, not dict")
        done = bool(terminated) or bool(truncated)
    elif isinstance(out, tuple):
        return EnvFault(f"returned a tuple of {len(out)}, not {STEP_FORMS}")
    else:
        return EnvFault(f"returned {_a(out)}, not {STEP_FORMS}")
    if not isinstance(obs, str):
        return EnvFault(f"returned {what} whose observation is {_a(obs)}, not str")
    if r is not None and (isinstance(r, (bool, np.bool_)) or not isinstance(r, numbers.Real) or not math.isfinite(float(r))):
        return EnvFault(f"returned {what} whose reward is {r!r}, not a finite number or None"[:200])
    if not isinstance(done, (bool, np.bool_)):
        return EnvFault(f"returned {what} whose done is {_a(done)}, not bool")
    if isinstance(out, StepResult) and (r is None or type(r) is float):
        return out
    return StepResult(obs, None if r is None else float(r), bool(done))


def safe_steps(calls: list[tuple[object, str]], timeout_s: float) -> list[StepResult | EnvFault]:
    """safe_step on each (env, action) of `calls`, all at once: each in its own thread, all waited for
    until `timeout_s` after the first started, so a turn whose envs hang costs one timeout, not one each."""
    started = [_start(functools.partial(_step, env, action)) for env, action in calls]
    deadline = time.monotonic() + timeout_s
    out = [_wait(call, deadline, timeout_s) for call in started]
    return [got if isinstance(got, EnvFault) else as_step_result(got) for got in out]


def has_state(env) -> bool:
    """Whether `env` has a ``state()`` method (OpenEnv's; any env may define one): its state is journaled
    after reset and after each step it answers (the sample's env_states)."""
    return callable(getattr(type(env), "state", None))


def safe_states(envs: list, timeout_s: float) -> list[str | EnvFault]:
    """env.state() of each of `envs`, all at once (as safe_steps), each as the journal keeps it (its canonical
    JSON: schema.sample.state_text), or an EnvFault when it raised, hung, or returned anything but a dict of JSON."""
    started = [_start(env.state) for env in envs]
    deadline = time.monotonic() + timeout_s
    return [as_state(_wait(call, deadline, timeout_s)) for call in started]


def as_state(out) -> str | EnvFault:
    """What env.state() returned, as its JSON text (state_text), or the EnvFault saying what is wrong with it."""
    if isinstance(out, EnvFault):
        return out
    if not isinstance(out, dict):
        return EnvFault(f"returned {_a(out)}, not a dict")
    try:
        return state_text(out)
    except (TypeError, ValueError) as e:
        return EnvFault(f"returned a dict that is not JSON ({str(e).strip()[:160]})")


def _reset(env, row: dict, seed: int):
    return env.reset(row, seed)


def _step(env, action: str):
    return env.step(action)


def _call(fn: Callable[[], object], timeout_s: float):
    """fn() in a worker thread, waiting `timeout_s` for it. A call that does not return in time is
    abandoned: its thread (a daemon) runs on, or hangs, on its own, and the env must not be used again."""
    return _wait(_start(fn), time.monotonic() + timeout_s, timeout_s)


def _start(fn: Callable[[], object]) -> tuple[threading.Thread, list, list]:
    value: list = []  # what fn returned, once it has
    error: list[BaseException] = []

    def run():
        try:
            value.append(fn())
        except BaseException as e:  # noqa: BLE001 - the env's own code: reported, never raised here
            error.append(e)

    thread = threading.Thread(target=run, name="verlj-env", daemon=True)
    thread.start()
    return thread, value, error


def _wait(call: tuple[threading.Thread, list, list], deadline: float, timeout_s: float):
    thread, value, error = call
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        return EnvFault(f"no answer in {float(timeout_s)} s")
    if error:
        e = error[0]
        text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        return EnvFault((f"raised {type(e).__name__}: {text}" if text else f"raised {type(e).__name__}") + raised_at(e))
    return value[0]


def _a(value) -> str:
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


# ----------------------------------------------------------------------------- answers

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INTEGER = re.compile(r"[+-]?\d+")


def final_answer(action: str) -> str:
    """The answer an action gives: the text inside its last <answer>…</answer>, else all of it; stripped."""
    tagged = _ANSWER_TAG.findall(action)
    return (tagged[-1] if tagged else action).strip()


def same_answer(given: str, expected: str) -> bool:
    """Exact match: as integers when both are integers (so "+7" is "7"), else as stripped strings."""
    given, expected = given.strip(), expected.strip()
    if _INTEGER.fullmatch(given) and _INTEGER.fullmatch(expected):
        return int(given) == int(expected)
    return given == expected


class _Episode:
    """Turn counting shared by the built-ins: step only after reset, never after done."""

    max_turns: int
    over: bool | None = None  # None until reset

    def _start(self, row: dict | None = None) -> None:
        """A new episode, no action taken yet; with `row`, the answer is the row's."""
        if row is not None:
            self.answer = str(row["answer"])
        self.turns, self.over = 0, False

    def _turn(self) -> bool:
        """Count one action; True when it is the last one the episode allows."""
        if self.over is None:
            raise RuntimeError("step() before reset()")
        if self.over:
            raise RuntimeError("step() after the episode ended")
        self.turns += 1
        return self.turns >= self.max_turns

    def _end(self, reward: float) -> StepResult:
        self.over = True
        return StepResult("", reward, True)


# ----------------------------------------------------------------------------- builtin:calculator

CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_EXPRESSION = 256  # characters of one <calc> expression
MAX_DIGITS = 100  # any value (numerator or denominator) while evaluating: at most this many digits
MAX_EXPONENT = 64  # |e| of a ** e
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: Fraction(a // b), ast.Mod: lambda a, b: a % b}
_LIMIT = 10**MAX_DIGITS


class CalcError(ValueError):
    """An expression the calculator does not evaluate (its text says why)."""


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as text: integers, + - * / // % **, unary + -, parentheses.
    Exact (fractions): a whole result is an integer, any other a decimal of 12 significant digits.
    Parsed with ast and evaluated node by node (never eval): names, calls, attributes, floats, strings,
    more than MAX_EXPRESSION characters, values over MAX_DIGITS digits, exponents over MAX_EXPONENT and
    division by zero are a CalcError."""
    if len(expression) > MAX_EXPRESSION:
        raise CalcError(f"longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        value = _evaluate(tree.body)
    except (SyntaxError, RecursionError, MemoryError):
        raise CalcError("not an arithmetic expression") from None
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.12g}"


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _evaluate(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exp = _evaluate(node.left), _evaluate(node.right)
        if exp.denominator != 1 or abs(exp) > MAX_EXPONENT:
            raise CalcError(f"exponents must be integers from -{MAX_EXPONENT} to {MAX_EXPONENT}")
        return _bounded(base ** int(exp))  # at most 64 times 100 digits before the bound: cheap
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _bounded(_OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right)))
    raise CalcError(f"{type(node).__name__} is not arithmetic on integers")


def _bounded(v: Fraction) -> Fraction:
    if abs(v.numerator) >= _LIMIT or v.denominator >= _LIMIT:
        raise CalcError(f"a value over {MAX_DIGITS} digits")
    return v


class Calculator(_Episode):
    """builtin:calculator. An action holding ``<calc>EXPRESSION</calc>`` calls the tool on the first such
    tag: the observation is ``<result>VALUE</result>`` (``<result>error</result>`` for an expression
    `calculate` refuses), no reward, not done. An action without the tag is the final answer
    (final_answer): reward 1.0 when it is the row's ``answer`` (same_answer), else 0.0; done. The
    `max_turns`-th action ends the episode whatever it is (a tool call there scores 0.0)."""

    def __init__(self, max_turns: int = 1):
        self.max_turns = max_turns

    def reset(self, row: dict, seed: int) -> str:
        self._start(row)
        return ""

    def step(self, action: str) -> StepResult:
        last = self._turn()
        call = CALC.search(action)
        if call is None:
            return self._end(1.0 if same_answer(final_answer(action), self.answer) else 0.0)
        if last:
            return self._end(0.0)
        try:
            value = calculate(call.group(1))
        except CalcError:
            value = "error"
        return StepResult(f"<result>{value}</result>", None, False)


# ----------------------------------------------------------------------------- builtin:equals


class Equals(_Episode):
    """builtin:equals. A calculator with one key, for the built-in model's digits vocabulary (it has no
    letters for a ``<calc>`` tag): an action holding ``=`` presses it, and the calculator evaluates the
    row's question (its prompt less a trailing ``=``; `calculate`): the observation is the value (``7``;
    ``error`` for a question that is no arithmetic), reward `press` (0.1: a shaping reward, by which the
    untrained model finds the key), not done. An action without ``=`` is the
    final answer: reward 1.0 when it is the row's ``answer`` (same_answer), else 0.0; done. The
    `max_turns`-th action ends the episode whatever it is (a key press there scores 0.0)."""

    def __init__(self, max_turns: int = 2, press: float = 0.1):
        self.max_turns, self.press = max_turns, press

    def reset(self, row: dict, seed: int) -> str:
        self._start(row)
        question = str(row["prompt"]).strip()
        self.question = question[:-1] if question.endswith("=") else question
        return ""

    def step(self, action: str) -> StepResult:
        last = self._turn()
        if "=" not in action:
            return self._end(1.0 if same_answer(final_answer(action), self.answer) else 0.0)
        if last:
            return self._end(0.0)
        try:
            value = calculate(self.question)
        except CalcError:
            value = "error"
        return StepResult(value, self.press, False)


# ----------------------------------------------------------------------------- builtin:guess


class Guess(_Episode):
    """builtin:guess. A secret whole number in [lo, hi], drawn from the seed alone (blake3 of it, the same
    on every machine and Python); each action is a guess (final_answer, an integer). The observation is
    "higher" (the secret is above the guess), "lower", or "not a number"; a correct guess ends the
    episode with reward 1.0, the `max_turns`-th wrong one with 0.0. The rules are the first observation."""

    def __init__(self, max_turns: int = 7, lo: int = 1, hi: int = 100):
        if not lo <= hi:
            raise ValueError(f"lo ({lo}) must be at most hi ({hi})")
        self.max_turns, self.lo, self.hi = max_turns, lo, hi

    def reset(self, row: dict, seed: int) -> str:
        draw = int.from_bytes(blake3.blake3(f"guess/{seed}".encode()).digest()[:8], "big")
        self.secret = self.lo + draw % (self.hi - self.lo + 1)
        self._start()
        turns = "1 guess" if self.max_turns == 1 else f"{self.max_turns} guesses"
        return f"Guess a whole number from {self.lo} to {self.hi}; you have {turns}. Answer with the number only."

    def step(self, action: str) -> StepResult:
        last = self._turn()
        text = final_answer(action)
        guess = int(text) if _INTEGER.fullmatch(text) else None
        if guess == self.secret:
            return self._end(1.0)
        if last:
            return self._end(0.0)
        if guess is None:
            return StepResult("not a number", None, False)
        return StepResult("higher" if self.secret > guess else "lower", None, False)


# ----------------------------------------------------------------------------- builtin:reasoning_gym


class ReasoningGymAttempts(_Episode):
    """builtin:reasoning_gym. A reasoning-gym row (``entry``, data.train_dataset=reasoning_gym:TASK)
    answered in up to `max_turns` attempts, each scored by the task's own score_answer (`score`: the
    run's task dataset's, so the task's config counts) on final_answer(action). A score of 1.0 ends the
    episode with reward 1.0; a lower one is told as ``<feedback>incorrect (score S); try again</feedback>``
    until the last attempt, whose score is the reward."""

    def __init__(self, score: Callable[[str, dict], float], max_turns: int = 1):
        self.score, self.max_turns = score, max_turns

    def reset(self, row: dict, seed: int) -> str:
        if not isinstance(row.get("entry"), dict):
            raise ValueError("builtin:reasoning_gym needs a reasoning-gym row (data.train_dataset=reasoning_gym:TASK)")
        self.entry = row["entry"]
        self._start()
        return ""

    def step(self, action: str) -> StepResult:
        last = self._turn()
        score = float(self.score(final_answer(action), self.entry))
        if score >= 1.0 or last:
            return self._end(score)
        return StepResult(f"<feedback>incorrect (score {score:g}); try again</feedback>", None, False)


# ----------------------------------------------------------------------------- loading

BUILTIN = ("builtin:calculator", "builtin:equals", "builtin:guess", "builtin:reasoning_gym")


@dataclass(frozen=True)
class EnvFactory:
    """Makes the envs rollout.env names: ``factory()`` is a fresh Environment (one per episode)."""

    spec: str
    make: Callable[[], object]

    def __call__(self) -> Environment:
        try:
            env = self.make()
        except Exception as e:  # noqa: BLE001 - the user's constructor: one sentence naming it
            raise ConfigError(f"{KEY}: making {self.spec} failed: {type(e).__name__}: {str(e).strip()[:200]}") from None
        if not isinstance(env, Environment):
            hint = f"; a TRL environment_factory class is named trl:{self.spec}" if callable(getattr(env, "reset", None)) else ""
            raise ConfigError(f"{KEY}: {self.spec} made {_a(env)}, which is not an Environment "
                              f"(it needs reset(row, seed) -> str and step(action) -> StepResult or a tuple: docs/guides/environments.md){hint}")
        return env


def load_env(cfg: Config, task_dataset=None, on_actor: bool = False) -> EnvFactory | None:
    """The factory of the envs cfg.rollout.env names (None: no env, single-turn samples), checked by
    making one. `task_dataset`: the run's reasoning-gym dataset (rl.data.Dataset.task_dataset), whose
    scorer builtin:reasoning_gym uses; None makes it from cfg.data. `on_actor`: made on a fleet's actor, where
    an OpenEnv server the trainer started and checked is only connected to. One ConfigError for an env that
    cannot be imported or made."""
    spec, turns = cfg.rollout.env, cfg.rollout.max_turns
    if spec is None:
        return None
    if spec == "builtin:calculator":
        factory = EnvFactory(spec, lambda: Calculator(turns))
    elif spec == "builtin:equals":
        factory = EnvFactory(spec, lambda: Equals(turns))
    elif spec == "builtin:guess":
        factory = EnvFactory(spec, lambda: Guess(turns))
    elif spec == "builtin:reasoning_gym":
        if not tasks.is_task(cfg.data.train_dataset):
            raise ConfigError(f"{KEY}=builtin:reasoning_gym answers reasoning-gym rows: it needs data.train_dataset={REASONING_GYM}:TASK")
        if task_dataset is None:
            task_dataset, _ = tasks.generate(cfg.data, cfg.trainer.seed)
        factory = EnvFactory(spec, lambda: ReasoningGymAttempts(task_dataset.score_answer, turns))
    elif spec.startswith(trl_envs.PREFIX):
        factory = EnvFactory(spec, trl_envs.trl_maker(cfg))
    elif spec.startswith("openenv:"):
        from .openenv_envs import make_factory

        factory = EnvFactory(spec, make_factory(cfg, on_actor))
    elif spec.startswith("builtin:"):
        raise ConfigError(f"{KEY}: unknown built-in {spec!r}; known: {', '.join(BUILTIN)}")
    else:
        module_name, _, attr = spec.partition(":")
        make = import_object(spec, module_name, attr, KEY, ConfigError)
        if not callable(make):
            raise ConfigError(f"{KEY}: {spec!r} is {_a(make)}, not a class or function that makes an Environment")
        factory = EnvFactory(spec, make)
    factory()
    return factory


def check_env(cfg: Config) -> None:
    """Before training: one ConfigError if cfg.rollout.env cannot be imported or made (load_env)."""
    load_env(cfg)
