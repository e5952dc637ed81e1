"""A TRL environment class and reward function, as TRL 1.16's docs write them for ``GRPOTrainer(environment_factory=...)``,
trained by verlj unchanged (rollout.env=trl:examples.trl_env:AdderEnv; examples/trl_env.yaml).

The class's public methods are the model's tools (``add`` here: its schema comes from the type hints and the
Google-style docstring); ``reset(**kwargs)`` gets the dataset row's columns and may return text that joins the last user
message; ``get_reward()`` scores an episode from the environment's state, and ``reward_func`` is a TRL reward function
given the episodes' ``environments``. Nothing here imports verlj or TRL.

    python examples/make_bpe_model.py models/bpe
    verlj train -o runs/trl --config examples/trl_env.yaml model.actor.model_name_or_path=models/bpe
"""

from __future__ import annotations


class AdderEnv:
    def reset(self, **kwargs) -> str | None:
        self.answer = str(kwargs["answer"])
        self.calls = 0
        self.last_result: int | None = None
        return " Use the add tool."

    def add(self, a: int, b: int) -> int:
        """
        Add two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum of the two integers.
        """
        self.calls += 1
        self.last_result = a + b
        return a + b

    def get_reward(self) -> float:
        return 0.1 if self.calls else 0.0


def reward_func(completions, environments, **kwargs) -> list[float]:
    """1.0 when the last answer holds the right sum, 0.5 when only the tool found it."""
    rewards = []
    for completion, env in zip(completions, environments):
        answer = completion[-1]["content"] if completion[-1]["role"] == "assistant" else ""
        if env.answer in answer:
            rewards.append(1.0)
        elif env.last_result is not None and str(env.last_result) == env.answer:
            rewards.append(0.5)
        else:
            rewards.append(0.0)
    return rewards
