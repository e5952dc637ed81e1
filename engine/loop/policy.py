"""When to snapshot: every `trainer.save_interval` steps, and whenever a CheckpointPolicy says so.

    trainer:
      save_interval: 50
      checkpoint_policy: verlj.engine.loop.policy.SaveOnRewardDrop   # any importable class
      checkpoint_policy_kwargs: {drop: 0.1}                           # its constructor's arguments

A policy's ``should_save(trainer_state, metrics_history)`` returns a bool; ``trainer_state`` holds
``global_step``, ``epoch`` and the cumulative ``samples_seen``; ``metrics_history`` the journaled
metrics of the last 100 steps. The schedule is Stateful: its history and the policy's own state
(``state_dict``/``load_state_dict`` if it has them) travel in snapshots, and replay feeds it the
journaled metrics, so a resumed run decides exactly as the uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import TrainerConfig
from ..errors import PluginError, loading
from ..plugins import check_signature, import_object
from ..report import REWARD_MEAN
from ..schema.record import Record
from ..state.stateful import check_version

HISTORY = 100
# dotted paths documented before the policy moved here (configs of runs made then name them)
_MOVED = {"verlj.engine.snapshot.SaveOnRewardDrop": "verlj.engine.loop.policy.SaveOnRewardDrop",
          "verlj.engine.state.policy.SaveOnRewardDrop": "verlj.engine.loop.policy.SaveOnRewardDrop"}


class CheckpointPolicy:
    """Decides when to snapshot besides `trainer.save_interval`. Subclass and name it in
    `trainer.checkpoint_policy`; its constructor takes `trainer.checkpoint_policy_kwargs`."""

    def should_save(self, trainer_state: dict, metrics_history: list[dict]) -> bool:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class SaveOnRewardDrop(CheckpointPolicy):
    """Save when the mean reward falls by more than `drop` (a fraction) from one step to the next."""

    def __init__(self, drop: float = 0.05):
        self.drop = drop

    def should_save(self, trainer_state, metrics_history):
        r = [m[REWARD_MEAN] for m in metrics_history[-2:] if REWARD_MEAN in m]
        return len(r) == 2 and r[1] < r[0] * (1 - self.drop)


def load_policy(dotted: str, kwargs: dict):
    key = "trainer.checkpoint_policy"
    dotted = _MOVED.get(dotted, dotted)
    mod, _, name = dotted.rpartition(".")
    cls = import_object(dotted, mod, name, key, loading(PluginError))
    if not callable(cls):
        raise PluginError(f"{key}: {dotted!r} is not a class")
    try:
        policy = cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - the user's constructor: one line naming it
        raise PluginError(f"{key}: {dotted}(**trainer.checkpoint_policy_kwargs) failed: {type(e).__name__}: {e}") from None
    if not callable(getattr(policy, "should_save", None)):
        raise PluginError(f"{key}: {dotted!r} has no should_save(trainer_state, metrics_history)")
    check_signature(policy.should_save, 2, f"{key}: {dotted}.should_save", loading(PluginError))
    return policy


@dataclass(frozen=True)
class ScheduleState(Record):
    """CheckpointSchedule's state map: the metrics history the policy sees, and the policy's own state."""

    version: int
    history: list[dict[str, float]]  # each step's metrics, the last HISTORY
    policy: dict[str, Any]  # the policy's own state_dict() ({} without one)


class CheckpointSchedule:
    """The snapshot schedule of a run: interval, policy, and the history the policy sees. Stateful."""

    VERSION = 1

    def __init__(self, cfg: TrainerConfig):
        self.interval = cfg.save_interval
        self.name = cfg.checkpoint_policy
        self.policy = load_policy(cfg.checkpoint_policy, cfg.checkpoint_policy_kwargs) if cfg.checkpoint_policy else None
        self.history: list[dict] = []

    def observe(self, step: int, metrics: dict, trainer_state: dict) -> bool:
        """Record a step's metrics; True if a snapshot is due after it. Live steps and replayed
        steps both call this, so the policy's state evolves the same way in both."""
        self.history.append(dict(metrics))
        del self.history[:-HISTORY]
        due = self.interval > 0 and step % self.interval == 0
        if self.policy is not None:
            try:
                answer = self.policy.should_save(dict(trainer_state), list(self.history))
            except Exception as e:  # noqa: BLE001 - the user's policy: one line naming it
                raise PluginError(f"trainer.checkpoint_policy: {self.name}.should_save raised {type(e).__name__}: {e}") from None
            if not isinstance(answer, (bool, np.bool_)):
                raise PluginError(f"trainer.checkpoint_policy: {self.name}.should_save returned {answer!r}; it must return a bool")
            due = due or bool(answer)
        return due

    def state_dict(self) -> dict:
        policy = self.policy.state_dict() if self.policy is not None and hasattr(self.policy, "state_dict") else {}
        return ScheduleState(self.VERSION, self.history, policy).to_dict()

    def load_state_dict(self, state: dict) -> None:
        saved = ScheduleState.from_dict(check_version("checkpoint schedule", state, self.VERSION))
        self.history = list(saved.history)
        if self.policy is not None and hasattr(self.policy, "load_state_dict") and saved.policy:
            self.policy.load_state_dict(saved.policy)
