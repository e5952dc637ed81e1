"""Step order's batches (rollout.mode=sync, and async step order): a step's batch generated in rounds (dynamic
sampling may draw several), each round's samples made by the round player, scored, given their reference log-probs,
gathered from every rank and admitted to the buffer with the plan of the step that trains on them.

:class:`Batches` is what the sync and planned sources hold: the rollout's parts it reads (the buffer, the sampler, the
prompts, the scorer, the actor) and the round player the assembly made for the run (``sources.single.SingleTurn``;
``sources.env_players.EnvRounds``: rollout.env's episodes; ``sources.agent_players.AgentRounds``: rollout.agent's
programs). A :class:`Production` is one step's batch being made (what changes as its rounds come back, and what they
add to the step's metrics), a :class:`RoundAsk` this rank's share of the round in flight.
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
from .. import faults, overlong
from ..inputs import StepInputs
from ..rollout import RolloutEngine
from .base import add_all, add_time, choose_consumed, episode_metrics, zero_variance
from .players import Parts, RoundCall, RoundPlayer


@dataclass
class RoundAsk:
    """This rank's share of a round in flight: what its player was asked (`call`) and what the player keeps of it while
    it generates (`started`)."""

    call: RoundCall
    started: object = None


@dataclass
class Production:
    """One step's batch being made: the step that will train on it (its samples' seeds are their places in that step),
    the policy version generating it, the rounds drawn and what they added, dropped and left out, what its rounds add to
    the step's metrics, and once finished the plan (the ids that step trains on)."""

    step: int
    version: int
    pending_groups: int  # valid groups already waiting (carried over, unplanned, fresh enough)
    next_id: int
    stale: list = field(default_factory=list)  # async: waiting groups too old for this step, and so for any later one
    drawn: list = field(default_factory=list)
    added: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    faulted: list = field(default_factory=list)  # ids out of the update for a fault (rl.faults)
    rounds: int = 0
    gen_s: float = 0.0  # time the trainer spent generating or waiting for generation
    metrics: dict = field(default_factory=dict)  # what its rounds' players add to the step's metrics (summed by name)
    plan: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ask: RoundAsk | None = None  # the round in flight


class Batches:
    """Batches generated in step order: the batch of step s from version max(0, s-1-k), its rounds made by `player` from
    the rollout's `parts` (buffer, sampler, prompts, scorer, actor)."""

    def __init__(self, parts: Parts, player: RoundPlayer):
        self.cfg, self.rt, self.buffer, self.sampler = parts.cfg, parts.rt, parts.buffer, parts.sampler
        self.prompt_ids, self.scorer, self.actor, self.eos = parts.prompt_ids, parts.scorer, parts.actor, parts.tokenizer.eos_token_id
        self.player = player

    def start(self, step: int, version: int, engine: RolloutEngine) -> Production:
        """Begin generating the batch of `step` from the actor's weights (policy `version`)."""
        want = max(0, step - 1 - self.cfg.rollout.staleness)
        if want != version:  # collect's schedule guarantees it; a broken invariant must not train silently
            raise RunError(f"the batch of step {step} must come from policy version {want} but the actor holds version {version}")
        buffer = self.buffer
        waiting = buffer.groups()
        stale = []
        if self.cfg.rollout.staleness:  # async: a step trains on no sample more than k versions behind it
            stale = [ids for ids in waiting.values() if buffer.samples[ids[0]].policy_version < want]
        prod = Production(step=step, version=version, pending_groups=len(waiting) - len(stale), next_id=buffer.next_id,
                          stale=[i for ids in stale for i in ids])
        self.submit_round(prod, engine)
        return prod

    def submit_round(self, prod: Production, engine: RolloutEngine) -> None:
        cfg, rt = self.cfg, self.rt
        prompts_per_step, group_size, dp_size = cfg.data.prompts_per_step, cfg.rollout.n, rt.dp_size
        indices = self.sampler.draw(prompts_per_step)
        prod.drawn.append(indices)
        first = rt.dp_rank * (prompts_per_step // dp_size)  # this rank's prompts are the step's first+0, first+1, ...
        mine = indices[first : first + prompts_per_step // dp_size]
        prompts = [self.prompt_ids[i] for i in mine for _ in range(group_size)]
        call = RoundCall(prod.step, prod.rounds, prod.version, engine, mine, prompts,
                         list(range(first * group_size, first * group_size + len(prompts))), prod.next_id)
        t = time.perf_counter()
        prod.ask = RoundAsk(call, self.player.start(call))
        prod.gen_s += time.perf_counter() - t

    def finish(self, prod: Production, engine: RolloutEngine) -> Production:
        """Wait for the round in flight, score it, and draw more rounds while dynamic sampling needs
        them; then plan what the batch's step trains on."""
        cfg = self.cfg
        prompts_per_step, group_size = cfg.data.prompts_per_step, cfg.rollout.n
        while True:
            assert prod.ask is not None, "a round is asked before it is finished"
            made = self.player.samples(prod.ask.call, prod.ask.started)
            prod.gen_s += made.gen_s
            add_all(prod.metrics, made.metrics)
            local = made.samples
            for s in local:
                s.policy_version = prod.version
            t2 = time.perf_counter()
            self.scorer.reference_logprobs(local, self.actor)
            add_time(prod.metrics, "timing_s/ref", time.perf_counter() - t2)
            # every rank gets every sample; TP peers generated the same ones, keep one copy per DP rank
            new = self.gathered(local, prod, group_size)
            overlong.shape(new, cfg.rollout, self.eos)  # before dynamic sampling reads the scores
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
            self.submit_round(prod, engine)
        add_time(prod.metrics, "timing_s/gen", prod.gen_s)  # async: only the wait the update did not cover
        prod.plan = choose_consumed(self.buffer, prompts_per_step, self.rt.dp_size, prod.added,
                                    set(prod.dropped) | set(prod.stale) | set(prod.faulted))
        return prod

    def gathered(self, local: list[Sample], prod: Production, group_size: int) -> list[Sample]:
        """Every rank's samples of the round (one copy per DP rank), given their ids and groups."""
        rt = self.rt
        gathered = rt.all_gather_obj(sample_codec.pack(local))
        new = [s for r, cols in enumerate(gathered) if r % rt.tp_size == 0 for s in sample_codec.unpack(cols)]
        for q, s in enumerate(new):
            s.id = prod.next_id + q
            s.group = prod.next_id + (q // group_size) * group_size  # a group is named by its first sample's id
        prod.next_id += len(new)
        return new

    def admit(self, prod: Production, planned: bool) -> Production:
        """A finished batch enters the buffer (async: with its plan); only then may a step count on it."""
        self.buffer.admit(prod.added, [*prod.dropped, *prod.stale, *prod.faulted], {prod.step: prod.plan} if planned else {})
        if planned:
            failpoint("async.admit")
        return prod

    def inputs(self, made: list[Production], consumed: np.ndarray, seeds: dict[str, int], engine: RolloutEngine,
               timings: dict[str, float]) -> StepInputs:
        """The step's inputs from the batches it made (`made`) and what it trains on (`consumed`): `timings`, the
        source's (its weight sync), with what the batches' rounds added."""
        cfg = self.cfg
        added = [s for p in made for s in p.added]
        drawn = [i for p in made for i in p.drawn]
        metrics = dict(timings)
        for p in made:
            add_all(metrics, p.metrics)
        metrics.update({"sampling/rounds": float(sum(p.rounds for p in made)),
                        "sampling/dropped_groups": float(sum(len(p.dropped) for p in made) // cfg.rollout.n)})
        metrics.update({**faults.metrics(added), **overlong.metrics(added, self.eos)})
        if cfg.rollout.env is not None:
            metrics.update(episode_metrics(added))
        async_mode = cfg.rollout.mode == "async"
        mode = ev.RolloutMode.ASYNC if async_mode else ev.RolloutMode.SYNC
        sampler = self.sampler
        return StepInputs(
            seeds=seeds,
            data=ev.Data(sampler.epoch, sampler.cursor, np.concatenate(drawn) if drawn else np.zeros(0, np.int64),
                         sum(p.rounds for p in made)),
            added=sample_codec.pack(added),
            dropped=np.asarray([i for p in made for i in p.dropped], dtype=np.int64),
            consumed=consumed,
            timings=metrics,
            rollout=ev.Rollout(engine.name, engine.version, mode, cfg.rollout.staleness if async_mode else None),
            plans={p.step: p.plan for p in made} if async_mode else {},
            stale=np.asarray([i for p in made for i in p.stale], dtype=np.int64),
            faulted=np.asarray([i for p in made for i in p.faulted], dtype=np.int64),
            admitted=True,
        )

    def close(self) -> None:
        self.player.close()
