"""A verifiers taskset (Prime Intellect's verifiers 0.4, ``verifiers.v1``) with an in-memory task list, trained by
verlj as it is: arithmetic questions, each scored by two ``@vf.reward`` functions (exact match, weight 1.0, and a
reply that is a number, weight 0.1). verifiers' own ``vf-eval``/prime-rl would load it by its id
(``examples.verifiers_taskset`` exports its Taskset in ``__all__``); verlj plays each task with verifiers'
chat program against its gateway (docs/guides/environments.md, "verifiers tasksets"):

    pip install -e '.[verifiers]'
    python examples/make_bpe_model.py models/bpe
    verlj train --config examples/verifiers_taskset.yaml -o runs/verifiers
"""

from __future__ import annotations

import random

import verifiers.v1 as vf


class Question(vf.TaskData):
    answer: str


class Arithmetic(vf.Task[Question, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact(self, task: Question, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.1)
    async def number(self, task: Question, trace: vf.Trace) -> float:
        return float(trace.last_reply.removeprefix("-").isdigit())


class ArithmeticTaskset(vf.Taskset[Arithmetic, vf.TasksetConfig]):
    """64 additions and subtractions of numbers below 20, the same every time (seeded)."""

    def load(self):
        rng = random.Random(0)
        for _ in range(64):
            a, b, op = rng.randrange(20), rng.randrange(20), rng.choice("+-")
            yield Arithmetic(Question(prompt=f"What is {a} {op} {b}? Answer with the number.",
                                      answer=str(a + b if op == "+" else a - b)), self.config.task)


__all__ = ["ArithmeticTaskset"]
