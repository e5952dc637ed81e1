"""What a step needs from collection (:class:`StepInputs`): the seeds, the dataset rows drawn, the samples added,
dropped and consumed, the engine, and what the step leaves in flight. It is exactly what the journal records
(``StepInputs.events``), and what replay reads back (``StepInputs.from_record``): the rollout sources (``rl.sources``)
make it, the update (``rl.update``) reads it. It lives below both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from verlj.journal import StepRecord

from ..errors import ReplayError
from ..schema import events as ev
from ..schema.sample import Columns
from ..state.seeding import rng_digest


@dataclass
class StepInputs:
    """Everything `apply` needs that `collect` produced: the journal's record of a step's inputs.

    The batches generated this step (`added`, `dropped`, the dataset rows drawn) and what the step
    trains on (`consumed`). Sync mode generates the step's own batch; async mode the batch of step
    s+k (the first step: of steps 1..k+1), with `plans` saying which samples that step will train on."""

    seeds: dict[str, int]
    data: ev.Data  # the dataset rows drawn this step (all rounds) and the sampler's place after them
    added: dict  # the samples generated this step, columnar (schema.sample.pack)
    dropped: np.ndarray  # ids dropped (zero-variance groups)
    consumed: np.ndarray  # ids the update trains on, in order
    rollout: ev.Rollout  # the engine that generated, the rollout mode, a what-if's correction
    timings: dict[str, float] = field(default_factory=dict)  # collect's own metrics (timings, sampling)
    plans: dict[int, np.ndarray] = field(default_factory=dict)  # async: step -> the ids it will train on
    stale: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # async: ids dropped as too stale for any later step
    requests: ev.Requests | None = None  # completion order: the groups and rows asked, and those asked again
    faulted: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # ids out of the update for a fault (rl.faults)
    admitted: bool = False  # live: collect has put the batches into the buffer already (not journaled)

    def events(self) -> list[dict]:
        out = [
            self.data.to_event(),
            self.rollout.to_event(),
            ev.Rng(self.seeds, rng_digest()).to_event(),
            ev.Added(Columns(self.added).ids, self.added).to_event(),
            ev.Dropped(self.dropped, ev.DropReason.ZERO_VARIANCE).to_event(),
            ev.Consumed(self.consumed).to_event(),
        ]
        if len(self.faulted):  # only then: a record without faults keeps its bytes
            out.append(ev.Dropped(self.faulted, ev.DropReason.FAULT).to_event())
        if self.rollout.is_async:
            out.append(ev.Dropped(self.stale, ev.DropReason.STALE).to_event())
            if self.rollout.completion_order:
                out.append((self.requests or ev.Requests()).to_event())
            else:
                out.append(ev.Plan.of(self.plans).to_event())
        return out

    @classmethod
    def from_record(cls, record: StepRecord) -> StepInputs:
        """A journaled step's inputs, as `apply` takes them (replay)."""
        step = ev.StepEvents.of(record)
        data, rng, added, consumed = step.require_inputs()
        if added.samples is None:
            raise ReplayError(f"step {record.step}'s samples were pruned from the journal (journal.retain_samples); it cannot be replayed")
        return cls(
            seeds=dict(rng.seeds),
            data=data,
            added=added.samples,
            dropped=step.dropped(ev.DropReason.ZERO_VARIANCE),
            stale=step.dropped(ev.DropReason.STALE),
            consumed=consumed.ids,
            rollout=step.rollout or ev.Rollout("hf", None),
            plans=step.plan.plans() if step.plan is not None else {},
            requests=step.requests,
            faulted=step.dropped(ev.DropReason.FAULT),
        )
