"""The rollout seam: what a step source is (:class:`StepSource`) and what every source shares (:class:`Source`: the
rollout's parts, the engine it drives, the step's seeds and timings, a journaled step's buffer changes).

A source is the stochastic half of a step (``collect``): it draws prompts, has an engine generate,
has its player make and score samples, and decides what enters, leaves and is consumed from the rollout buffer. The
assembly (``sources.make_source``) makes one for a run; replay asks it to bring a journaled step's buffer changes back
(``replayed``) instead of collecting. What it returns, :class:`~verlj.engine.rl.inputs.StepInputs`, is what the journal
records and the update reads.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ...schema import sample as sample_codec
from ...schema.sample import EnvEnd, Sample
from ...state.seeding import derive_seed, seed_globals
from ..inputs import StepInputs
from ..rollout import RolloutEngine, make_engine
from .players import Parts

if TYPE_CHECKING:
    from ..buffer import RolloutBuffer


class StepSource(Protocol):
    """One rollout source (sync, async in step order, async in completion order; each plays episodes
    when rollout.env is set, on any engine: the Ray fleet is one). What the loop calls on it, and
    all it calls: a new source implements this and is named in ``make_source``."""

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

    def weights_changed(self) -> None:
        """The actor's weights changed (an update, a snapshot load): the engine, if any, must catch up."""

    def close(self, at_once: bool = False) -> None:
        """Release the engine. `at_once`: the user asked to stop now; nothing in flight is waited for."""


class Source:
    """What every source here shares: the rollout's parts (``sources.players.Parts``: its config, ranks, buffer,
    sampler, ...), its engine (made at the first live collect), the step's seeds and its timings."""

    def __init__(self, parts: Parts):
        self.cfg, self.rt, self.buffer, self.sampler = parts.cfg, parts.rt, parts.buffer, parts.sampler
        self.prompt_ids, self.scorer, self.actor, self.tokenizer = parts.prompt_ids, parts.scorer, parts.actor, parts.tokenizer
        self.engine: RolloutEngine | None = None
        self.seeds: dict[str, int] = {}
        self.timings: dict[str, float] = {}

    def begin(self, step: int) -> int:
        """A live step's start: its seeds (the globals seeded too), the engine built and synced to the
        actor's weights. Returns the policy version it holds: a live step s starts from version s - 1 (the update of
        the step before made the actor's weights; version 0, the initial ones, for step 1). Collective."""
        cfg = self.cfg
        self.seeds = {
            "rollout": derive_seed(cfg.trainer.seed, step, "rollout"),
            "train": derive_seed(cfg.trainer.seed, step, "train"),
        }
        seed_globals(derive_seed(cfg.trainer.seed, step, "globals"))
        t = time.perf_counter()
        if self.engine is None:
            self.engine = make_engine(cfg.rollout.engine, self.rt, self.actor, self.tokenizer, cfg.rollout.mode)
        version = step - 1
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
        self.buffer.admit(sample_codec.unpack(inputs.added), np.concatenate([inputs.dropped, inputs.stale, inputs.faulted]), inputs.plans)

    def in_flight(self) -> dict[str, float]:
        return {"buffer/pending": float(len(self.buffer))}

    def weights_changed(self) -> None:
        if self.engine is not None:
            self.engine.weights_changed()

    def close(self, at_once: bool = False) -> None:
        if self.engine is not None:
            self.engine.close(at_once)
            self.engine = None

    def choose_consumed(self, added: list[Sample], dropped: set[int]) -> np.ndarray:
        return choose_consumed(self.buffer, self.cfg.data.prompts_per_step, self.rt.dp_size, added, dropped)


def choose_consumed(buffer: RolloutBuffer, prompts_per_step: int, dp: int, added: list[Sample], dropped: set[int]) -> np.ndarray:
    """The first `prompts_per_step` valid groups in arrival order (those waiting in `buffer` first, then `added`),
    trimmed so every data-parallel rank (`dp`) gets the same number of samples. `dropped`: ids that may not be chosen
    (zero-variance groups, and in async mode waiting groups too stale)."""
    order: dict[int, list[int]] = {g: ids for g, ids in buffer.groups().items() if ids[0] not in dropped}
    for s in added:
        if s.id not in dropped:
            order.setdefault(s.group, []).append(s.id)
    groups = list(order.values())[:prompts_per_step]
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


def add_all(timings: dict[str, float], metrics: dict[str, float]) -> None:
    """Each of `metrics` added to what `timings` holds under its name."""
    for name, v in metrics.items():
        add_time(timings, name, v)
