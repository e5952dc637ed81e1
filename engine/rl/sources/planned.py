"""rollout.mode=async, rollout.async_order=step (verl's one-step-off-policy, and k steps off): the batch of
step s is planned already when s begins; s starts generating the batch of step s+k from version s-1,
which generates during the update and is taken in (``finish_collect``) before the commit. Step 1
first generates batches 1..k (all from version 0: the staleness of step s is min(k, s-1)). The plans
(which samples each later step trains on) are in the buffer, so a resume needs nothing more back. The batches are
made by the step-order machinery the source holds (``sources.batches``).
"""

from __future__ import annotations

import numpy as np

from ..inputs import StepInputs
from .base import Source
from .batches import Batches, Production
from .players import Parts, RoundPlayer


class PlannedSource(Source):
    """Async step order: k batches planned ahead, one generating while the update runs."""

    def __init__(self, parts: Parts, player: RoundPlayer):
        super().__init__(parts)
        self.batches = Batches(parts, player)
        self.made: list[Production] = []
        self.inflight: Production | None = None  # the batch generating while the update runs
        self.consumed = np.zeros(0, np.int64)  # what the step being collected trains on

    def collect(self, step: int) -> StepInputs:
        version, b = self.begin(step), self.batches
        k, buffer, engine = self.cfg.rollout.staleness, self.buffer, self.live
        self.made = []
        through = buffer.planned_through() or step - 1
        for j in range(through + 1, step + k):  # only at the run's first step: batches 2..k wait for no update
            self.made.append(b.admit(b.finish(b.start(j, version, engine), engine), planned=True))
        self.inflight = b.start(step + k, version, engine) if through < step + k else None
        self.consumed = buffer.plans[step]
        return b.inputs(self.made, self.consumed, self.seeds, engine, self.timings)

    def finish_collect(self, step: int, inputs: StepInputs) -> StepInputs:
        """After the update: wait for the batch `collect` started, score it, admit it and plan it; the
        step's inputs then include it. Collective."""
        if self.inflight is None:
            return inputs
        b = self.batches
        self.made.append(b.admit(b.finish(self.inflight, self.live), planned=True))
        self.inflight = None
        return b.inputs(self.made, self.consumed, self.seeds, self.live, self.timings)

    def close(self, at_once: bool = False) -> None:
        self.batches.close()
        super().close(at_once)
