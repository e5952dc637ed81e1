"""TRL environment classes as rollout.env: a class in the shape of TRL's ``GRPOTrainer(environment_factory=...)``,
played as any verlj environment (journaled per turn, restored by replaying its actions, resumed bit-identical).

    rollout.env: trl:my_module:MyEnv              # the class (or a function that makes an instance), made with no arguments
    rollout.env_reward_funcs: [my_module:reward]  # TRL's reward_funcs: (prompts, completions, environments=..., **kwargs)
    rollout.env_reward_weights: [1.0]             # TRL's reward_weights (empty: 1 each)
    rollout.max_turns: 4                          # generations per episode: TRL's max_tool_calling_iterations + 1

The ``trl:`` prefix says which protocol a class speaks (a verlj env also has public methods: its ``step`` is no tool).
What :class:`TrlEnv` does with the user's instance, as TRL 1.16 does (``grpo_trainer.py``):

- ``reset(row, seed)``: the instance's ``reset(**columns)`` (the row's ``prompt`` as chat messages, its ``answer``,
  ``data_source`` and ``extra_info`` when set); a string it returns joins the last user message; the prompt is rendered
  by the model's chat template with the class's public methods as tools (``transformers.utils.get_json_schema``: type
  hints and Google-style docstrings) and the generation prompt, and answered as a :class:`Prompt` (it replaces the
  dataset prompt's ids: rl.episodes.Round).
- ``step(action)``: the action's tool calls read by the gateway's hermes parser (rl.gateway.protocol); each called on
  the instance with its arguments; a result ``str(result)``, a call that raised or names no tool ``{'error': '...'}``;
  the tool messages rendered by the chat template after the assistant's end of turn (TRL's ``_get_tool_suffix_ids``) are
  the observation. An action without a tool call (or one that does not parse), or the rollout.max_turns-th action,
  ends the episode: its reward is ``get_reward()`` (when the class has it, weight 1) plus the weighted
  rollout.env_reward_funcs, each called as TRL calls a reward function, on this one episode (lists of one), a None
  left out (TRL's NaN), journaled as the last turn's reward.

Nothing here imports TRL: a TRL user's class and reward functions run unchanged without it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..errors import ConfigError
from ..plugins import check_signature, describe, import_object
from .gateway.protocol import Message, ToolCall, hermes
from .models import BUILTIN_TINY, chat_template, load_tokenizer

PREFIX = "trl:"
KEY = "rollout.env"
RESERVED = ("reset", "get_reward")  # TRL's reserved methods: never tools


class Prompt(str):
    """What an env's reset may answer instead of an observation: the episode's whole prompt text, which replaces the
    dataset prompt (a TRL class's reset joins the last user message, and its tools are rendered into the prompt)."""


class _AnyName(frozenset):
    """Every tool name is "offered" to the parser, so that a call of a tool the class lacks parses and is answered
    "Tool X not found." as TRL answers it (the gateway's parser makes a call of an unknown name malformed)."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str)


def tool_methods(cls: type) -> list[str]:
    """The names of the tools a TRL class offers, as TRL lists them: its public functions but reset and get_reward,
    sorted by name (inspect.getmembers on the class, so properties are not evaluated)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction) if name not in RESERVED and not name.startswith("_")]


def tool_schemas(instance: object) -> list[dict]:
    """The JSON schema of each tool of `instance`, as transformers' apply_chat_template builds it from a callable
    (get_json_schema: the type hints and the Google-style docstring); a ConfigError naming a tool it cannot describe."""
    from transformers.utils import get_json_schema

    out = []
    for name in tool_methods(type(instance)):
        try:
            out.append(get_json_schema(getattr(instance, name)))
        except Exception as e:  # noqa: BLE001 - transformers' DocstringParsingException, TypeHintParsingException
            raise ConfigError(f"{KEY}: the tool {type(instance).__name__}.{name} cannot be described to the model "
                              f"({str(e).strip().splitlines()[0][:200]}): give it type hints and a Google-style docstring") from None
    return out


def _call(fn: Callable, *args, **kwargs):
    """fn's result, awaited when fn is a coroutine function (TRL runs those on its event loop)."""
    out = fn(*args, **kwargs)
    return asyncio.run(out) if inspect.iscoroutine(out) else out


@dataclass(frozen=True)
class RewardFuncs:
    """TRL's reward functions (rollout.env_reward_funcs) with their weights, and whether the class owns a get_reward."""

    funcs: tuple
    weights: tuple
    own: bool

    def score(self, env: Any, prompt: list, completion: list, completion_ids: list, columns: dict) -> float:
        """The episode's reward as TRL sums a sample's: each function's value (None: left out) times its weight, then
        get_reward()'s (weight 1); 0.0 when every one is None (TRL's nansum)."""
        values = []
        kwargs = {k: [v] for k, v in columns.items() if k != "prompt"}
        for fn, w in zip(self.funcs, self.weights):
            try:
                out = fn(prompts=[prompt], completions=[completion], completion_ids=[completion_ids], trainer_state=None,
                         log_extra=_ignored, log_metric=_ignored, environments=[env], **kwargs)
                if inspect.iscoroutine(out):
                    out = asyncio.run(out)
            except Exception as e:  # noqa: BLE001 - the user's function: the episode's fault, its reason naming it
                raise RewardFuncError(f"rollout.env_reward_funcs: {describe(fn)} raised {type(e).__name__}: {str(e).strip()}"[:300]) from e
            if not isinstance(out, (list, tuple)) or len(out) != 1:
                raise ValueError(f"reward function {describe(fn)} returned {out!r}; it must return a list of one reward per completion"[:300])
            values.append((out[0], w, describe(fn)))
        if self.own:
            values.append((_call(env.get_reward), 1.0, f"{type(env).__name__}.get_reward"))
        total, any_value = 0.0, False
        for v, w, who in values:
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
                raise ValueError(f"{who} returned {v!r}, not a finite number or None"[:300])
            total, any_value = total + float(w) * float(v), True
        return total if any_value else 0.0


class RewardFuncError(RuntimeError):
    """A reward function of rollout.env_reward_funcs raised: the episode's fault, its reason naming the function."""


def _ignored(*args, **kwargs) -> None:
    """TRL's log_extra / log_metric: accepted, not logged."""


def load_reward_funcs(cfg: Config, cls: type) -> RewardFuncs:
    """rollout.env_reward_funcs imported (one ConfigError for one that cannot be), with rollout.env_reward_weights."""
    ro, key = cfg.rollout, "rollout.env_reward_funcs"
    funcs = []
    for spec in ro.env_reward_funcs:
        module_name, _, attr = spec.partition(":")
        fn = import_object(spec, module_name, attr, key, ConfigError)
        if not callable(fn):
            raise ConfigError(f"{key}: {spec!r} is not a function")
        check_signature(fn, 0, f"{key}: {spec} (called as fn(prompts=, completions=, environments=, ...))", ConfigError,
                        prompts=[], completions=[], completion_ids=[], environments=[])
        funcs.append(fn)
    weights = tuple(ro.env_reward_weights) or (1.0,) * len(funcs)
    return RewardFuncs(tuple(funcs), weights, callable(getattr(cls, "get_reward", None)))


# ----------------------------------------------------------------------------- the adapter


class TrlEnv:
    """A TRL environment instance as a verlj Environment (rl.envs): one per episode, reset on its row."""

    def __init__(self, instance: Any, render: Callable, tok, tools: list[dict], rewards: RewardFuncs, max_turns: int, max_prompt: int = 0):
        self.env, self.render, self.tok, self.tools, self.rewards, self.max_turns = instance, render, tok, tools, rewards, max_turns
        self.max_prompt = max_prompt  # data.max_prompt_length: a longer prompt is the reset's fault (0: no cap)
        self.names = set(tool_methods(type(instance)))
        self.turns, self.over = 0, True
        self.prompt: list[dict] = []
        self.completion: list[dict] = []  # TRL's completion: the assistant's messages and the tool messages, in order
        self.answers: list[str] = []  # the assistant's texts, in order (what completion_ids are made of)
        self.columns: dict = {}

    def reset(self, row: dict, seed: int) -> Prompt:
        messages = prompt_of(row)
        self.columns = {"prompt": [dict(m) for m in messages], **columns_of(row)}
        got = self.env.reset(**self.columns)
        if got is not None and not isinstance(got, str):
            raise TypeError(f"{type(self.env).__name__}.reset returned {type(got).__name__}, not str or None")
        messages = joined(messages, got)
        self.prompt, self.completion, self.answers, self.turns, self.over = messages, [], [], 0, False
        return tool_prompt(self.render, self.tok, messages, self.tools, self.max_prompt)

    def step(self, action: str) -> tuple[str, float | None, bool]:
        if self.over:
            raise RuntimeError("step() before reset() or after the episode ended")
        self.turns += 1
        content, named = tool_calls(action, self.turns)
        if not named:
            self.completion.append({"role": "assistant", "content": action})
            self.answers.append(action)
            return self._end()
        calls = [{"type": "function", "function": {"name": name, "arguments": arguments}} for name, arguments in named]
        self.completion.append({"role": "assistant", "content": content, "tool_calls": calls})
        self.answers.append(content)
        if self.turns >= self.max_turns:  # TRL's last iteration: its calls are not run
            return self._end()
        results = [self._dispatch(name, arguments) for name, arguments in named]
        tool_messages = [{"role": "tool", "name": name, "content": text} for name, text in results]
        self.completion += tool_messages
        return tool_suffix(self.render, self.tok, tool_messages, results[0][0]), None, False

    def _dispatch(self, name: str, arguments: dict) -> tuple[str, object]:
        """One tool call, answered as TRL answers it: str(result), or {'error': ...} for a call that raised or a tool
        the class lacks (a list, TRL's multimodal content, is passed on as it is)."""
        try:
            if name not in self.names:
                raise ValueError(f"Tool {name} not found.")
            result = _call(getattr(self.env, name), **arguments)
        except Exception as e:  # noqa: BLE001 - the tool's own failure: told to the policy, as TRL tells it
            result = {"error": str(e)}
        return name, result if isinstance(result, list) else str(result)

    def _end(self) -> tuple[str, float, bool]:
        self.over = True
        ids = self.tok("".join(self.answers), add_special_tokens=False).input_ids
        return "", self.rewards.score(self.env, self.prompt, self.completion, ids, self.columns), True


# ----------------------------------------------------------------------------- tools through the chat template (TRL's and an OpenEnv MCP env's)


def joined(messages: list[dict], text: str | None) -> list[dict]:
    """The prompt's messages with `text` (what a reset answered) joined to the last user message, as TRL joins it."""
    if not text:
        return messages
    return [*messages[:-1], {**messages[-1], "content": (Message.of(messages[-1]).content or "") + text}]


def tool_prompt(render: Callable, tok, messages: list[dict], tools: list[dict], max_prompt: int) -> Prompt:
    """The episode's prompt: `messages` rendered by the chat template with `tools` and the generation prompt; a prompt
    longer than data.max_prompt_length (`max_prompt`, 0: no cap) is the reset's fault, saying to raise it."""
    text = Prompt(render(messages, tools or None, True))
    n = len(tok(text, add_special_tokens=False).input_ids) + (tok.bos_token_id is not None)
    if max_prompt and n > max_prompt:
        raise ValueError(f"the prompt with its tools is {n} tokens, more than data.max_prompt_length ({max_prompt}): raise it")
    return text


def tool_calls(action: str, turn: int) -> tuple[str, list[tuple[str, dict]]]:
    """The action's text besides its tool calls, and each call's (name, arguments), read by the gateway's hermes parser;
    no call for an action without one or one that does not parse. Any name parses (the caller answers an unknown one)."""
    parsed = hermes(action, str(turn), _AnyName())
    return parsed.content or "", [(c.name, json.loads(c.arguments)) for c in map(ToolCall.of, parsed.tool_calls or ())]


def tool_suffix(render: Callable, tok, tool_messages: list[dict], first: str) -> str:
    """What the chat template writes after the assistant's end of turn for these tool messages, and the generation
    prompt (TRL's _get_tool_suffix_ids, on text): a dummy call rendered with and without them, the shorter cut after
    its last end-of-sequence token. `first`: the first tool message's name (the dummy call's, as TRL names it)."""
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": first, "arguments": {}}}]}]
    prefix, full = render(dummy, None, False), render(dummy + tool_messages, None, True)
    eos = tok.eos_token
    if eos and eos in prefix:
        prefix = prefix[: prefix.rindex(eos) + len(eos)]
    if not full.startswith(prefix):
        raise ValueError("the chat template renders a conversation's tool messages in a way that changes what came before them")
    return full[len(prefix):]


def template_of(cfg: Config) -> tuple[Any, Callable]:
    """The model's tokenizer and its chat template (the built-in model's lists the tools in a system message)."""
    path = cfg.model.actor.model_name_or_path
    tok = load_tokenizer(path, cfg=cfg)
    return tok, chat_template(tok, path == BUILTIN_TINY)

COLUMNS = ("answer", "data_source", "extra_info", "task", "entry")  # a verlj row's fields a TRL class gets, beside its prompt


def prompt_of(row: dict) -> list[dict]:
    """A verlj row's prompt (rl.envs.row_of) as TRL's conversational prompt: its chat messages, or its text as one user
    message."""
    match row:
        case {"messages": [_, *_] as messages}:
            return [dict(m) for m in messages]
        case {"prompt": text}:
            return [{"role": "user", "content": text}]
    raise ValueError("the row has neither chat messages nor a prompt")


def columns_of(row: dict) -> dict:
    """The dataset columns a TRL class's reset and reward functions get beside its prompt for a verlj row: ``answer``,
    and ``data_source``, ``extra_info``, ``task`` and ``entry`` where the row has them."""
    return {k: row[k] for k in COLUMNS if k == COLUMNS[0] or row.get(k) not in (None, "")}


def trl_maker(cfg: Config) -> Callable[[], TrlEnv]:
    """What makes rollout.env=trl:MODULE:CLASS's episodes' envs: the class imported, one instance made and its tools
    described (a ConfigError for a class that has no reset or a tool it cannot describe), the reward functions loaded,
    the model's tokenizer and chat template (the built-in model's lists the tools in a system message)."""
    spec = cfg.rollout.env
    assert spec is not None and spec.startswith(PREFIX)
    module_name, _, attr = spec[len(PREFIX):].partition(":")
    make = import_object(spec, module_name, attr, KEY, ConfigError)
    if not callable(make):
        raise ConfigError(f"{KEY}: {spec!r} is not a class or function that makes a TRL environment")
    try:
        probe = make()
    except Exception as e:  # noqa: BLE001 - the user's constructor: one sentence naming it
        raise ConfigError(f"{KEY}: making {spec} failed: {type(e).__name__}: {str(e).strip()[:200]}") from None
    if not callable(getattr(type(probe), "reset", None)):
        raise ConfigError(f"{KEY}: {spec} made {type(probe).__name__}, which has no reset(**kwargs) (a TRL environment class needs one)")
    tools = tool_schemas(probe)
    rewards = load_reward_funcs(cfg, type(probe))
    if not rewards.funcs and not rewards.own:
        raise ConfigError(f"{KEY}: {spec} has no get_reward() and rollout.env_reward_funcs names no reward function: name one "
                          "(TRL's reward_funcs), or give the class a get_reward()")
    tok, render = template_of(cfg)
    turns, max_prompt = cfg.rollout.max_turns, cfg.data.max_prompt_length

    def one() -> TrlEnv:
        return TrlEnv(make(), render, tok, tools, rewards, turns, max_prompt)

    return one
