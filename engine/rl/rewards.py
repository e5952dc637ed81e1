"""Rewards: rule-based functions and reward models.

A rule reward is ``fn(prompt: str, response: str, answer: str) -> float``, or verl's
``compute_score(data_source, solution_str, ground_truth, extra_info)`` (told apart by its parameter
names, called with keywords: ComputeScore): ``builtin:add`` for the built-in task, ``reasoning_gym`` (a reasoning-gym task's own scorer, rl.tasks), or any
``module:function`` importable by the run; ``auto`` is the dataset's own. A reward model (a local
sequence-classification directory) adds ``weight * logits[:, 0]`` of prompt + response.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Callable

from ..config import REASONING_GYM
from ..errors import RewardError, loading
from ..plugins import check_signature, describe, import_object, raised_at
from .tasks import TaskScorer

RewardFn = Callable[[str, str, str], float]

_NUMBER = re.compile(r"\s*(-?\d+)\s*")


def add_reward(prompt: str, response: str, answer: str) -> float:
    """1 for the exact answer; a bare number earns 0.1 to 0.5, more the closer it is; anything else 0."""
    m = _NUMBER.fullmatch(response)
    if m is None:
        return 0.0
    if m.group(1) == answer:
        return 1.0
    try:
        gap = abs(int(m.group(1)) - int(answer))
    except ValueError:
        return 0.1
    return 0.1 + 0.4 / (1 + gap)


BUILTIN = {"builtin:add": add_reward}

VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")


class ComputeScore:
    """A verl-style reward ``compute_score(data_source, solution_str, ground_truth, extra_info)``:
    called with keywords (those of the four it names; all four if it takes **kwargs): the row's
    `data_source` and `extra_info` fields, the response, the answer. verl's {"score": x, ...} result
    scores x."""

    def __init__(self, fn, names: tuple[str, ...]):
        self.fn, self.names = fn, names
        self.__module__, self.__qualname__ = getattr(fn, "__module__", "?"), getattr(fn, "__qualname__", repr(fn))

    @staticmethod
    def names_of(fn) -> tuple[str, ...] | None:
        """The verl parameters fn takes, or None when it is not verl-style (no solution_str and ground_truth)."""
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return None
        if "solution_str" not in params or "ground_truth" not in params:
            return None
        if any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return VERL_PARAMS
        return tuple(n for n in VERL_PARAMS if n in params)

    def score(self, response: str, ex):
        args = {"data_source": ex.data_source, "solution_str": response, "ground_truth": ex.answer, "extra_info": ex.extra_info}
        v = self.fn(**{n: args[n] for n in self.names})
        return v["score"] if isinstance(v, dict) and "score" in v else v


def load_reward_fn(spec: str, train_dataset: str = "builtin:add", task_dataset=None, answer_format: str = "text"):
    """The rule reward `spec` names (rollout.reward_fn): a RewardFn, or for reasoning_gym the
    task's scorer over `task_dataset` (rl.data.Dataset.task_dataset)."""
    key = "rollout.reward_fn"
    if spec == "auto":
        spec = REASONING_GYM if train_dataset.startswith(REASONING_GYM + ":") else "builtin:add"
    if spec == REASONING_GYM:
        if task_dataset is None:
            raise RewardError(f"{key}=reasoning_gym needs data.train_dataset=reasoning_gym:TASK")
        return TaskScorer(task_dataset, answer_format)
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec.startswith("builtin:"):
        raise RewardError(f"{key}: unknown built-in {spec!r}; known: {', '.join(BUILTIN)}")
    module_name, _, attr = spec.partition(":")
    fn = import_object(spec, module_name, attr, key, loading(RewardError))
    if not callable(fn):
        raise RewardError(f"{key}: {spec!r} is not a function")
    names = ComputeScore.names_of(fn)
    if names is not None:
        check_signature(fn, 0, f"{key}: {spec} (called as compute_score({', '.join(f'{n}=' for n in VERL_PARAMS)}))", loading(RewardError),
                        **dict.fromkeys(names))
        return ComputeScore(fn, names)
    check_signature(fn, 3, f"{key}: {spec} (called as fn(prompt, response, answer))", loading(RewardError))
    return fn


def rule_rewards(fn, prompts: list[str], responses: list[str], examples: list) -> list[float]:
    """fn on every sample (`examples`: the rl.data.Example each was drawn from); numpy scalars are
    numbers too. Anything else, or an exception, is one sentence naming the function and the prompt."""
    out: list[float] = []
    for p, r, ex in zip(prompts, responses, examples):
        try:
            v = _call(fn, p, r, ex)
        except Exception as e:  # noqa: BLE001 - the user's function: one line naming it
            raise RewardError(f"reward function {describe(fn)} raised {type(e).__name__}: {e} (prompt {p!r}){raised_at(e)}") from None
        if not _finite(v):
            raise RewardError(f"reward function {describe(fn)} returned {v!r} for prompt {p!r}; it must return a finite number")
        out.append(float(v))
    return out


def _call(fn, prompt: str, response: str, ex):
    if isinstance(fn, TaskScorer):
        return fn.score(response, ex.entry)
    if isinstance(fn, ComputeScore):
        return fn.score(response, ex)
    return fn(prompt, response, ex.answer)


def _finite(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(float(v))


def scored_or_faults(fn, prompts: list[str], responses: list[str], examples: list) -> tuple[list[float], list[str]]:
    """fn on every sample, as rule_rewards, a fault a sample's own: (rewards, faults), a sample whose call
    raised or returned no finite number scoring 0.0 with its fault's reason ("reward function m.f raised
    ValueError: ...", "... returned nan, not a finite number"), every other one "" (what training journals:
    such a sample is out of the update, rl.faults)."""
    out: list[float] = []
    faults: list[str] = []
    for p, r, ex in zip(prompts, responses, examples):
        try:
            v = _call(fn, p, r, ex)
        except Exception as e:  # noqa: BLE001 - the user's function: its fault, the sample's
            text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            out.append(0.0)
            said = f"reward function {describe(fn)} raised {type(e).__name__}"
            faults.append((f"{said}: {text}" if text else said) + raised_at(e))
            continue
        out.append(float(v) if _finite(v) else 0.0)
        faults.append("" if _finite(v) else f"reward function {describe(fn)} returned {v!r}, not a finite number"[:300])
    return out, faults


def reward_model_scores(model, tokenizer, texts: list[str], device, batch_size: int = 16) -> list[float]:
    """logits[:, 0] of a sequence-classification model on each text."""
    import torch

    model.eval()
    out: list[float] = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True)
        with torch.no_grad():
            logits = model(input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device)).logits
        out += logits[:, 0].float().cpu().tolist()
    return out
