"""The rollout seam: what a step needs from collection (:class:`StepInputs`, made by a :class:`StepSource`)
and what every source shares (:class:`Source`: the rollout engine it drives, the step's seeds).

A source is the stochastic half of a step (``collect``): it draws prompts, has an engine generate,
scores, and decides what enters, leaves and is consumed from the rollout buffer. The trainer chooses
one (``sources.make_source``) and applies what it returns; replay asks it to bring a journaled
step's buffer changes back (``replayed``) instead of collecting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from verlj.journal import StepRecord

from ...config import Config
from ...errors import ReplayError
from ...schema import events as ev
from ...schema import sample as sample_codec
from ...schema.sample import Columns, EnvEnd, Sample
from ...state.seeding import derive_seed, rng_digest, seed_globals
from ..core import Core
from ..rollout import RolloutEngine, engine_class, make_engine

if TYPE_CHECKING:
    from ..buffer import RolloutBuffer
    from ..data import Example, Sampler
    from ..envs import EnvFactory
    from ..episodes import InFlightLog


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


class StepSource(Protocol):
    """One rollout source (sync, async in step order, async in completion order; each plays episodes
    when rollout.env is set, on any engine: the Ray fleet is one). What the trainer calls on it, and
    all it calls: a new source (an agent gateway) implements this and is named in ``make_source``."""

    engine: RolloutEngine | None  # the engine it drives: None until its first live collect (replay never builds one)

    def collect(self, step: int) -> StepInputs:
        """A live step's inputs: the samples, the journaled events' content, what it leaves in flight
        (the buffer's plans and requests). Changes the sampler and the buffer, nothing the update reads.
        Collective."""

    def finish_collect(self, step: int, inputs: StepInputs) -> StepInputs:
        """After the update, before the commit: what generated during it, taken into the step's inputs.
        Collective."""

    def replayed(self, inputs: StepInputs) -> None:
        """Recovery: a journaled step's buffer changes (added, dropped, planned, asked), as its live
        collect made them, so that the buffer is where that step left it."""

    def in_flight(self) -> dict[str, float]:
        """What waits once the step is done (buffer/*), for the step's metrics."""

    def set_config(self, cfg: Config) -> None:
        """Another config of the same run comes in force (before the trainer's changes)."""

    def close(self, at_once: bool = False) -> None:
        """Release the engine. `at_once`: the user asked to stop now; nothing in flight is waited for."""


class Host(Core, Protocol):
    """What a source reads of the trainer that chose it (the trainer conforms: rl.trainer)."""

    @property
    def sampler(self) -> Sampler: ...

    @property
    def buffer(self) -> RolloutBuffer: ...

    @property
    def prompt_ids(self) -> list[np.ndarray]: ...

    @property
    def dataset(self) -> list[Example]: ...

    @property
    def in_flight_log(self) -> InFlightLog | None: ...

    @property
    def policy_version(self) -> int:
        """The version of the actor's weights: the step whose update made them."""

    def envs(self) -> EnvFactory:
        """rollout.env's factory (made at its first use)."""


class Source:
    """What every source here shares: its engine (made at the first live collect, closed when the
    config names another), the step's seeds, its timings, and a journaled step's buffer changes."""

    def __init__(self, host: Host):
        self.host = host
        self.engine: RolloutEngine | None = None
        self.step = 0  # the live step being collected (begin)
        self.seeds: dict[str, int] = {}
        self.timings: dict[str, float] = {}

    @property
    def cfg(self) -> Config:
        return self.host.cfg

    def begin(self, step: int) -> int:
        """A live step's start: its seeds (the globals seeded too), the engine built and synced to the
        actor's weights. Returns the policy version it holds. Collective."""
        cfg, rt = self.cfg, self.host.rt
        self.step = step
        self.seeds = {
            "rollout": derive_seed(cfg.trainer.seed, step, "rollout"),
            "train": derive_seed(cfg.trainer.seed, step, "train"),
        }
        seed_globals(derive_seed(cfg.trainer.seed, step, "globals"))
        t = time.perf_counter()
        if self.engine is None:
            self.engine = make_engine(cfg.rollout.engine, rt, self.host.actor, self.host.tokenizer, cfg.rollout.mode)
        version = self.host.policy_version  # the update of the last step trained made the actor's weights
        self.engine.sync(cfg, version)  # vLLM, the async generator: started at the first live step, then the last update pushed
        self.timings = {"timing_s/weight_sync": time.perf_counter() - t, "timing_s/gen": 0.0, "timing_s/reward": 0.0}
        return version

    @property
    def live(self) -> RolloutEngine:
        """The engine, once `begin` has built it."""
        assert self.engine is not None, "a live step begins by building its engine"
        return self.engine

    def finish_collect(self, step: int, inputs: StepInputs) -> StepInputs:
        return inputs

    def replayed(self, inputs: StepInputs) -> None:
        self.host.buffer.admit(sample_codec.unpack(inputs.added), np.concatenate([inputs.dropped, inputs.stale, inputs.faulted]),
                               inputs.plans)

    def in_flight(self) -> dict[str, float]:
        return {"buffer/pending": float(len(self.host.buffer))}

    def set_config(self, cfg: Config) -> None:
        if self.engine is None:
            return
        other = type(self.engine) is not engine_class(cfg.rollout.engine, cfg.rollout.mode, cfg.rollout.fleet)
        # a fleet's actors made their envs (rollout.env) from the config they started with
        if other or (self.cfg.rollout.fleet == "ray" and cfg.rollout.env != self.cfg.rollout.env):
            self.engine.close()
            self.engine = None
            self.engine_closed()

    def engine_closed(self) -> None:
        """The engine was closed for another: what it was asked is gone with it."""

    def close(self, at_once: bool = False) -> None:
        if self.engine is not None:
            self.engine.close(at_once)
            self.engine = None

    def choose_consumed(self, added: list[Sample], dropped: set[int]) -> np.ndarray:
        """The first prompts_per_step valid groups in arrival order (carried-over ones first),
        trimmed so every data-parallel rank gets the same number of samples. `dropped`: ids that may not
        be chosen (zero-variance groups, and in async mode waiting groups too stale)."""
        order: dict[int, list[int]] = {g: ids for g, ids in self.host.buffer.groups().items() if ids[0] not in dropped}
        for s in added:
            if s.id not in dropped:
                order.setdefault(s.group, []).append(s.id)
        groups, dp = list(order.values())[: self.cfg.data.prompts_per_step], self.host.rt.dp_size
        while groups and sum(map(len, groups)) % dp:  # groups of unequal sizes (faults left out): the last one whose going evens it
            total = sum(map(len, groups))
            k = next((k for k in reversed(range(len(groups))) if (total - len(groups[k])) % dp == 0), len(groups) - 1)
            del groups[k]
        return np.asarray([i for g in groups for i in g], dtype=np.int64)


def zero_variance(samples: list[Sample], excluded: set[int]) -> list[int]:
    """Dynamic sampling: the ids of the groups whose rewards do not vary, over their samples not `excluded` (faults)."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        if s.id not in excluded:
            groups.setdefault(s.group, []).append(s)
    return [s.id for g in groups.values() if max(x.score for x in g) == min(x.score for x in g) for s in g]


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """rollout.env: the episodes generated this step: how many an env fault ended, their turns."""
    turns = [len(s.turn_lens) // 2 for s in samples if s.is_episode]
    return {"rollout/env/faults": float(sum(s.env_end == EnvEnd.FAULT for s in samples)),
            "rollout/env/turns/mean": float(np.mean(turns)) if turns else 0.0}


def add_time(timings: dict[str, float], name: str, seconds: float) -> None:
    timings.update({name: timings.get(name, 0.0) + seconds})
