"""rollout.mode=sync: each step generates its own batch from the policy it starts from (version s-1).

:class:`StepOrder` is the batch machinery step order shares with async step order (``sources.planned``):
a :class:`Production` is one step's batch being generated, in rounds (dynamic sampling may draw
several), scored, given its reference log-probs and gathered from every rank; with rollout.env its
episodes are played to their ends (``sources.episodes.play_round``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from verlj.journal.failpoints import failpoint

from ...errors import RunError
from ...schema import events as ev
from ...schema import sample as sample_codec
from ...schema.sample import Sample
from ...state.seeding import derive_seed
from .. import faults
from ..envs import row_of
from ..episodes import Limits, Round
from .base import Source, StepInputs, add_time, episode_metrics, zero_variance
from .episodes import on_fleet, play_round, played_round, round_works


@dataclass
class Production:
    """One step's batch being generated: its rounds (dynamic sampling may need several), the samples
    and drops so far, and, once finished, the plan (the ids that step will train on)."""

    step: int  # the step that will train on it (its samples' seeds are their places in that step)
    version: int  # the policy version generating it
    pending_groups: int  # valid groups already waiting (carried over, unplanned, fresh enough)
    next_id: int
    stale: list = field(default_factory=list)  # async: waiting groups too old for this step, and so for any later one
    drawn: list = field(default_factory=list)
    added: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    faulted: list = field(default_factory=list)  # ids out of the update for a fault (rl.faults)
    rounds: int = 0
    handle: object = None  # the round in flight (RolloutEngine.submit)
    gen_s: float = 0.0  # time the trainer spent generating or waiting for generation
    mine: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prompts: list = field(default_factory=list)
    plan: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    places: list = field(default_factory=list)  # this rank's samples' places q in the round (their seeds')
    episodes: Round | None = None  # rollout.env: the round's episodes being played
    first: list = field(default_factory=list)  # rollout.env: the episodes whose turn 0 was asked (those whose reset did not fault)
    remote: bool = False  # rollout.env on a fleet: the round is played on its actors (handle: RayFleet.play's)


class StepOrder(Source):
    """Batches generated in step order: the batch of step s from version max(0, s-1-k)."""

    made: list[Production]
    consumed: np.ndarray

    def inputs(self) -> StepInputs:
        """The step's inputs from the batches made so far (`made`) and what it trains on (`consumed`)."""
        made, cfg = self.made, self.cfg
        added = [s for p in made for s in p.added]
        drawn = [i for p in made for i in p.drawn]
        self.timings.update({"sampling/rounds": float(sum(p.rounds for p in made)),
                             "sampling/dropped_groups": float(sum(len(p.dropped) for p in made) // cfg.rollout.n)})
        self.timings.update(faults.metrics(added))
        if cfg.rollout.env is not None:
            self.timings.update(episode_metrics(added))
        async_mode = cfg.rollout.mode == "async"
        mode = ev.RolloutMode.ASYNC if async_mode else ev.RolloutMode.SYNC
        sampler = self.host.sampler
        return StepInputs(
            seeds=self.seeds,
            data=ev.Data(sampler.epoch, sampler.cursor, np.concatenate(drawn) if drawn else np.zeros(0, np.int64),
                         sum(p.rounds for p in made)),
            added=sample_codec.pack(added),
            dropped=np.asarray([i for p in made for i in p.dropped], dtype=np.int64),
            consumed=self.consumed,
            timings=self.timings,
            rollout=ev.Rollout(self.live.name, self.live.version, mode, cfg.rollout.staleness if async_mode else None),
            plans={p.step: p.plan for p in made} if async_mode else {},
            stale=np.asarray([i for p in made for i in p.stale], dtype=np.int64),
            faulted=np.asarray([i for p in made for i in p.faulted], dtype=np.int64),
            admitted=True,
        )

    def start(self, step: int, version: int) -> Production:
        """Begin generating the batch of `step` from the actor's weights (policy `version`)."""
        want = max(0, step - 1 - self.cfg.rollout.staleness)
        if want != version:  # collect's schedule guarantees it; a broken invariant must not train silently
            raise RunError(f"the batch of step {step} must come from policy version {want} but the actor holds version {version}")
        buffer = self.host.buffer
        waiting = buffer.groups()
        stale = []
        if self.cfg.rollout.staleness:  # async: a step trains on no sample more than k versions behind it
            stale = [ids for ids in waiting.values() if buffer.samples[ids[0]].policy_version < want]
        prod = Production(step=step, version=version, pending_groups=len(waiting) - len(stale), next_id=buffer.next_id,
                          stale=[i for ids in stale for i in ids])
        self.submit_round(prod)
        return prod

    def submit_round(self, prod: Production) -> None:
        cfg, rt, host = self.cfg, self.host.rt, self.host
        prompts_per_step, group_size, dp_size = cfg.data.prompts_per_step, cfg.rollout.n, rt.dp_size
        indices = host.sampler.draw(prompts_per_step)
        prod.drawn.append(indices)
        first = rt.dp_rank * (prompts_per_step // dp_size)  # this rank's prompts are the step's first+0, first+1, ...
        prod.mine = indices[first : first + prompts_per_step // dp_size]
        prod.prompts = [host.prompt_ids[i] for i in prod.mine for _ in range(group_size)]
        # each sample's seed is its place in its step (round, k), whichever rank generates it
        prod.places = list(range(first * group_size, first * group_size + len(prod.prompts)))
        t = time.perf_counter()
        self.start_round(prod)
        prod.gen_s += time.perf_counter() - t

    def start_round(self, prod: Production) -> None:
        """Have the engine begin the round's samples (episodes: their first turns), each from its place's seed."""
        cfg, host = self.cfg, self.host
        group_size = cfg.rollout.n
        sample_seeds = [derive_seed(cfg.trainer.seed, prod.step, "rollout/sample", prod.rounds, q) for q in prod.places]
        prompts = prod.prompts
        if cfg.rollout.env is not None:  # episodes: each env reset from its sample's place (rl.episodes)
            rows = [row_of(host.dataset[int(i)]) for i in prod.mine for _ in range(group_size)]
            env_seeds = [derive_seed(cfg.trainer.seed, prod.step, "rollout/env", prod.rounds, q) for q in prod.places]
            fleet = on_fleet(self.live)
            if fleet is not None:  # its envs run on the fleet's actors, beside generation
                prod.remote, prod.handle = True, fleet.play(round_works(self, prod, rows, env_seeds), cfg)
                return
            prod.episodes = Round(host.envs(), rows, env_seeds, prod.prompts, host.tokenizer, Limits.of(cfg.rollout))
            prompts, prod.first = prod.episodes.first_prompts(), prod.episodes.live()  # a reset that faulted: no action
            prompts, sample_seeds = [prompts[i] for i in prod.first] or prompts[:1], [sample_seeds[i] for i in prod.first] or [0]
        prod.handle = self.live.submit(prompts, sample_seeds, cfg)

    def finish(self, prod: Production) -> Production:
        """Wait for the round in flight, score it, and draw more rounds while dynamic sampling needs
        them; then plan what the batch's step trains on."""
        cfg, timings, scorer = self.cfg, self.timings, self.host.scorer
        prompts_per_step, group_size = cfg.data.prompts_per_step, cfg.rollout.n
        while True:
            local = self.round_samples(prod)
            for s in local:
                s.policy_version = prod.version
            t2 = time.perf_counter()
            scorer.reference_logprobs(local, self.host.actor)
            add_time(timings, "timing_s/ref", time.perf_counter() - t2)
            # every rank gets every sample; TP peers generated the same ones, keep one copy per DP rank
            new = self.gathered(local, prod, group_size)
            prod.added += new
            prod.rounds += 1
            out = faults.excluded(new, faults.min_group(cfg.algorithm.name, group_size))
            prod.faulted += out
            if not cfg.algorithm.dynamic_sampling:
                break
            flat = zero_variance(new, set(out))
            prod.dropped += flat
            gone = set(out) | set(flat)
            prod.pending_groups += len({s.group for s in new if s.id not in gone})
            if prod.pending_groups >= prompts_per_step or prod.rounds >= cfg.algorithm.max_sampling_rounds:
                break
            self.submit_round(prod)
        add_time(timings, "timing_s/gen", prod.gen_s)  # async: only the wait the update did not cover
        prod.plan = self.choose_consumed(prod.added, set(prod.dropped) | set(prod.stale) | set(prod.faulted))
        return prod

    def round_samples(self, prod: Production) -> list[Sample]:
        """The round in flight on this rank: waited for (its episodes played), scored."""
        scorer, group_size = self.host.scorer, self.cfg.rollout.n
        t0 = time.perf_counter()
        responses: list[np.ndarray] = []
        logps: list[np.ndarray] = []
        if prod.remote:
            assert isinstance(prod.handle, int), "a fleet's play is named by its handle"
            prod.episodes = played_round(self, prod.handle)
        else:
            responses, logps = self.live.result(prod.handle)
        if prod.episodes is not None and not prod.remote:
            play_round(self, prod, responses, logps)
        t1 = time.perf_counter()
        if prod.episodes is not None:
            local = scorer.score_episodes(prod.mine, group_size, prod.episodes)
        else:
            local = scorer.score(prod.mine, group_size, prod.prompts, responses, logps)
        prod.gen_s += t1 - t0
        add_time(self.timings, "timing_s/reward", time.perf_counter() - t1)
        return local

    def gathered(self, local: list[Sample], prod: Production, group_size: int) -> list[Sample]:
        """Every rank's samples of the round (one copy per DP rank), given their ids and groups."""
        rt = self.host.rt
        gathered = rt.all_gather_obj(sample_codec.pack(local))
        new = [s for r, cols in enumerate(gathered) if r % rt.tp_size == 0 for s in sample_codec.unpack(cols)]
        for q, s in enumerate(new):
            s.id = prod.next_id + q
            s.group = prod.next_id + (q // group_size) * group_size  # a group is named by its first sample's id
        prod.next_id += len(new)
        return new

    def admit(self, prod: Production, planned: bool) -> Production:
        """A finished batch enters the buffer (async: with its plan); only then may a step count on it."""
        self.host.buffer.admit(prod.added, [*prod.dropped, *prod.stale, *prod.faulted], {prod.step: prod.plan} if planned else {})
        if planned:
            failpoint("async.admit")
        return prod


class SyncSource(StepOrder):
    """rollout.mode=sync: the step's own batch, generated, scored and admitted before its update."""

    def collect(self, step: int) -> StepInputs:
        version = self.begin(step)
        self.made = [self.admit(self.finish(self.start(step, version)), planned=False)]
        self.consumed = self.made[0].plan
        return self.inputs()
