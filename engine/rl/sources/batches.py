"""Step order's batches (rollout.mode=sync, and async step order): a step's batch generated in rounds (dynamic
sampling may draw several), each round's samples made by a round player, scored, given their reference log-probs,
gathered from every rank and admitted to the buffer with the plan of the step that trains on them.

A :class:`Batches` holds its parts: the source whose engine and seeds it uses, and the round players it chooses from
by the config in force (:class:`SingleTurn`: one response a prompt; ``sources.episodes.EnvRounds``: rollout.env's
episodes; ``sources.agents.AgentRounds``: rollout.agent's programs). A :class:`Production` is one step's batch being
made (what changes as its rounds come back), a :class:`RoundAsk` this rank's share of the round in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from verlj.journal.failpoints import failpoint

from ...errors import RunError
from ...schema import events as ev
from ...schema import sample as sample_codec
from ...schema.sample import Sample
from ...state.seeding import derive_seed
from .. import faults, overlong
from .base import Source, StepInputs, add_time, episode_metrics, zero_variance

if TYPE_CHECKING:
    from .episodes import EnvRounds


@dataclass
class RoundAsk:
    """This rank's share of a round in flight: its dataset rows (`mine`: the step's prompts first+0, first+1, ...),
    their prompt ids (each rollout.n times), the samples' places q in the round (their seeds': a sample's seed is its
    place, whichever rank makes it), and what the round's player keeps of it while it generates (`handle`)."""

    mine: np.ndarray
    prompts: list[np.ndarray]
    places: list[int]
    handle: object = None


@dataclass
class Production:
    """One step's batch being made: the step that will train on it (its samples' seeds are their places in that step),
    the policy version generating it, the rounds drawn and what they added, dropped and left out, and once finished the
    plan (the ids that step trains on)."""

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
    plan: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ask: RoundAsk | None = None  # the round in flight


class RoundPlayer(Protocol):
    """What makes a round's samples on this rank."""

    def start(self, prod: Production, ask: RoundAsk) -> None:
        """Begin the round's samples (episodes: their resets and first turns), each from its place's seed."""

    def samples(self, prod: Production, ask: RoundAsk) -> list[Sample]:
        """The round on this rank, waited for (its episodes played) and scored; the wait counted in `prod.gen_s`.
        Collective."""

    def close(self) -> None:
        """Release what the player holds (a gateway)."""


class SingleTurn:
    """One response a prompt: the round submitted to the engine at once, scored when it is back."""

    def __init__(self, src: Source):
        self.src = src

    def start(self, prod: Production, ask: RoundAsk) -> None:
        cfg = self.src.cfg
        seeds = [derive_seed(cfg.trainer.seed, prod.step, "rollout/sample", prod.rounds, q) for q in ask.places]
        ask.handle = self.src.live.submit(ask.prompts, seeds, cfg)

    def samples(self, prod: Production, ask: RoundAsk) -> list[Sample]:
        src = self.src
        t0 = time.perf_counter()
        responses, logps = src.live.result(ask.handle)
        t1 = time.perf_counter()
        local = src.host.scorer.score(ask.mine, src.cfg.rollout.n, ask.prompts, responses, logps)
        prod.gen_s += t1 - t0
        add_time(src.timings, "timing_s/reward", time.perf_counter() - t1)
        return local

    def close(self) -> None:
        pass


class Batches:
    """Batches generated in step order: the batch of step s from version max(0, s-1-k)."""

    def __init__(self, src: Source, episodes: EnvRounds, agents: RoundPlayer | None = None):
        """`episodes`: rollout.env's player; `agents`: rollout.agent's (the source of an agent run's)."""
        self.src, self.single, self.episodes, self.agents = src, SingleTurn(src), episodes, agents

    def player(self) -> RoundPlayer:
        """The round player the config in force asks for."""
        if self.agents is not None:
            return self.agents
        return self.episodes if self.src.cfg.rollout.env is not None else self.single

    def start(self, step: int, version: int) -> Production:
        """Begin generating the batch of `step` from the actor's weights (policy `version`)."""
        src = self.src
        want = max(0, step - 1 - src.cfg.rollout.staleness)
        if want != version:  # collect's schedule guarantees it; a broken invariant must not train silently
            raise RunError(f"the batch of step {step} must come from policy version {want} but the actor holds version {version}")
        buffer = src.host.buffer
        waiting = buffer.groups()
        stale = []
        if src.cfg.rollout.staleness:  # async: a step trains on no sample more than k versions behind it
            stale = [ids for ids in waiting.values() if buffer.samples[ids[0]].policy_version < want]
        prod = Production(step=step, version=version, pending_groups=len(waiting) - len(stale), next_id=buffer.next_id,
                          stale=[i for ids in stale for i in ids])
        self.submit_round(prod)
        return prod

    def submit_round(self, prod: Production) -> None:
        cfg, host = self.src.cfg, self.src.host
        rt = host.rt
        prompts_per_step, group_size, dp_size = cfg.data.prompts_per_step, cfg.rollout.n, rt.dp_size
        indices = host.sampler.draw(prompts_per_step)
        prod.drawn.append(indices)
        first = rt.dp_rank * (prompts_per_step // dp_size)  # this rank's prompts are the step's first+0, first+1, ...
        mine = indices[first : first + prompts_per_step // dp_size]
        prompts = [host.prompt_ids[i] for i in mine for _ in range(group_size)]
        prod.ask = RoundAsk(mine, prompts, list(range(first * group_size, first * group_size + len(prompts))))
        t = time.perf_counter()
        self.player().start(prod, prod.ask)
        prod.gen_s += time.perf_counter() - t

    def finish(self, prod: Production) -> Production:
        """Wait for the round in flight, score it, and draw more rounds while dynamic sampling needs
        them; then plan what the batch's step trains on."""
        src = self.src
        cfg, timings, scorer = src.cfg, src.timings, src.host.scorer
        prompts_per_step, group_size = cfg.data.prompts_per_step, cfg.rollout.n
        while True:
            assert prod.ask is not None, "a round is asked before it is finished"
            local = self.player().samples(prod, prod.ask)
            for s in local:
                s.policy_version = prod.version
            t2 = time.perf_counter()
            scorer.reference_logprobs(local, src.host.actor)
            add_time(timings, "timing_s/ref", time.perf_counter() - t2)
            # every rank gets every sample; TP peers generated the same ones, keep one copy per DP rank
            new = self.gathered(local, prod, group_size)
            overlong.shape(new, cfg.rollout, src.host.tokenizer.eos_token_id)  # before dynamic sampling reads the scores
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
        prod.plan = src.choose_consumed(prod.added, set(prod.dropped) | set(prod.stale) | set(prod.faulted))
        return prod

    def gathered(self, local: list[Sample], prod: Production, group_size: int) -> list[Sample]:
        """Every rank's samples of the round (one copy per DP rank), given their ids and groups."""
        rt = self.src.host.rt
        gathered = rt.all_gather_obj(sample_codec.pack(local))
        new = [s for r, cols in enumerate(gathered) if r % rt.tp_size == 0 for s in sample_codec.unpack(cols)]
        for q, s in enumerate(new):
            s.id = prod.next_id + q
            s.group = prod.next_id + (q // group_size) * group_size  # a group is named by its first sample's id
        prod.next_id += len(new)
        return new

    def admit(self, prod: Production, planned: bool) -> Production:
        """A finished batch enters the buffer (async: with its plan); only then may a step count on it."""
        self.src.host.buffer.admit(prod.added, [*prod.dropped, *prod.stale, *prod.faulted], {prod.step: prod.plan} if planned else {})
        if planned:
            failpoint("async.admit")
        return prod

    def inputs(self, made: list[Production], consumed: np.ndarray) -> StepInputs:
        """The step's inputs from the batches it made (`made`) and what it trains on (`consumed`)."""
        src = self.src
        cfg = src.cfg
        added = [s for p in made for s in p.added]
        drawn = [i for p in made for i in p.drawn]
        src.timings.update({"sampling/rounds": float(sum(p.rounds for p in made)),
                            "sampling/dropped_groups": float(sum(len(p.dropped) for p in made) // cfg.rollout.n)})
        src.timings.update({**faults.metrics(added), **overlong.metrics(added, src.host.tokenizer.eos_token_id)})
        if cfg.rollout.env is not None:
            src.timings.update(episode_metrics(added))
        async_mode = cfg.rollout.mode == "async"
        mode = ev.RolloutMode.ASYNC if async_mode else ev.RolloutMode.SYNC
        sampler = src.host.sampler
        return StepInputs(
            seeds=src.seeds,
            data=ev.Data(sampler.epoch, sampler.cursor, np.concatenate(drawn) if drawn else np.zeros(0, np.int64),
                         sum(p.rounds for p in made)),
            added=sample_codec.pack(added),
            dropped=np.asarray([i for p in made for i in p.dropped], dtype=np.int64),
            consumed=consumed,
            timings=src.timings,
            rollout=ev.Rollout(src.live.name, src.live.version, mode, cfg.rollout.staleness if async_mode else None),
            plans={p.step: p.plan for p in made} if async_mode else {},
            stale=np.asarray([i for p in made for i in p.stale], dtype=np.int64),
            faulted=np.asarray([i for p in made for i in p.faulted], dtype=np.int64),
            admitted=True,
        )

    def close(self) -> None:
        if self.agents is not None:
            self.agents.close()
