"""rollout.mode=async, rollout.async_order=step (verl's one-step-off-policy, and k steps off): the batch of
step s is planned already when s begins; s starts generating the batch of step s+k from version s-1,
which generates during the update and is taken in (``finish_collect``) before the commit. Step 1
first generates batches 1..k (all from version 0: the staleness of step s is min(k, s-1)). The plans
(which samples each later step trains on) are in the buffer, so a resume needs nothing more back.
"""

from __future__ import annotations

from .base import StepInputs
from .sync import Production, StepOrder


class PlannedSource(StepOrder):
    """Async step order: k batches planned ahead, one generating while the update runs."""

    inflight: Production | None = None  # the batch generating while the update runs

    def collect(self, step: int) -> StepInputs:
        version = self.begin(step)
        k, buffer = self.cfg.rollout.staleness, self.host.buffer
        self.made = []
        through = buffer.planned_through() or step - 1
        for j in range(through + 1, step + k):  # only at the run's first step: batches 2..k wait for no update
            self.made.append(self.admit(self.finish(self.start(j, version)), planned=True))
        self.inflight = self.start(step + k, version) if through < step + k else None
        self.consumed = buffer.plans[step]
        return self.inputs()

    def finish_collect(self, step: int, inputs: StepInputs) -> StepInputs:
        """After the update: wait for the batch `collect` started, score it, admit it and plan it; the
        step's inputs then include it. Collective."""
        if self.inflight is None:
            return inputs
        self.made.append(self.admit(self.finish(self.inflight), planned=True))
        self.inflight = None
        return self.inputs()
