"""rollout.mode=sync: each step generates its own batch from the policy it starts from (version s-1), by the step-order
batch machinery it holds (``sources.batches``: rounds, scoring, gathering) and the round player the assembly made
(single-turn samples, rollout.env's episodes, or rollout.agent's programs)."""

from __future__ import annotations

from ..inputs import StepInputs
from .base import Source
from .batches import Batches
from .players import Parts, RoundPlayer


class SyncSource(Source):
    """rollout.mode=sync: the step's own batch, generated, scored and admitted before its update."""

    def __init__(self, parts: Parts, player: RoundPlayer):
        super().__init__(parts)
        self.batches = Batches(parts, player)

    def collect(self, step: int) -> StepInputs:
        version, b = self.begin(step), self.batches
        made = [b.admit(b.finish(b.start(step, version, self.live), self.live), planned=False)]
        return b.inputs(made, made[0].plan, self.seeds, self.live, self.timings)

    def close(self, at_once: bool = False) -> None:
        self.batches.close()
        super().close(at_once)
