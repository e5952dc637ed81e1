"""What every part of a step reads of the trainer: the protocol the rollout sources' Host, the update's
Trained and the eval's Evaluated extend (rl.trainer conforms to all of them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..config import Config
    from ..dist import Runtime
    from .scoring import Scorer
    from .workers import ActorWorker


class Core(Protocol):
    """The run's config, its runtime (ranks, device), the actor, the tokenizer and the scorer (rewards, reference log-probs)."""

    @property
    def cfg(self) -> Config: ...

    @property
    def rt(self) -> Runtime: ...

    @property
    def actor(self) -> ActorWorker: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def scorer(self) -> Scorer: ...
