"""rollout.mode=sync: each step generates its own batch from the policy it starts from (version s-1), by the step-order
batch machinery it holds (``sources.batches``: rounds, scoring, gathering; single-turn samples, rollout.env's
episodes, or rollout.agent's programs)."""

from __future__ import annotations

from collections.abc import Callable

from .base import Host, Source, StepInputs
from .batches import Batches, RoundPlayer
from .episodes import EnvRounds


class SyncSource(Source):
    """rollout.mode=sync: the step's own batch, generated, scored and admitted before its update. `agents`: what makes
    the round player of rollout.agent's programs (sources.agents.AgentRounds), for an agent run."""

    def __init__(self, host: Host, agents: Callable[[Source], RoundPlayer] | None = None):
        super().__init__(host)
        self.batches = Batches(self, EnvRounds(self), agents(self) if agents is not None else None)

    def collect(self, step: int) -> StepInputs:
        version, b = self.begin(step), self.batches
        made = [b.admit(b.finish(b.start(step, version)), planned=False)]
        return b.inputs(made, made[0].plan)

    def close(self, at_once: bool = False) -> None:
        self.batches.close()
        super().close(at_once)
