"""rollout.mode=async, rollout.async_order=completion: the generator works through the groups asked of it
on its own; the step takes the first prompts_per_step groups that have arrived, in arrival order,
dropping those more than k versions behind it. Timing decides what a step trains on, so the journal
records what was asked, what arrived and what was asked again (the ``requests`` event).

What recovery needs back: the buffer's requests (groups asked and not arrived, in the buffer's state
and in each step's record). A process's first collect asks again for every one of them, from its
original seeds; with rollout.env a group of episodes comes back from its last durable turn
(``sources.episodes.Turns``), with rollout.partial a group a push stopped from its last durable token
(``sources.partial.Partials``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from verlj.journal.failpoints import failpoint

from ...schema import events as ev
from ...schema import sample as sample_codec
from ...schema.sample import Sample
from ...state.seeding import derive_seed
from .. import faults, overlong
from .base import Host, Source, StepInputs, add_time, zero_variance
from .episodes import Turns
from .partial import Partials

ARRIVAL_POLL_S = 0.5  # how long one wait for the generator's groups lasts before the ranks compare


@dataclass
class Flow:
    """What one step's collect saw of the free-running generator."""

    asked: list = field(default_factory=list)  # (group, row) asked this step, in order
    regenerated: list = field(default_factory=list)  # groups asked again: in flight when the last process stopped
    restored_turns: int = 0  # rollout.env: env steps re-applied to bring groups of episodes back from their last durable turn
    added: list = field(default_factory=list)  # samples arrived, in arrival order
    dropped: list = field(default_factory=list)  # ids of zero-variance groups (dynamic sampling)
    stale: list = field(default_factory=list)  # ids of waiting groups more than k versions behind
    faulted: list = field(default_factory=list)  # ids out of the update for a fault (rl.faults)
    rounds: int = 0  # rounds of prompts_per_step prompts asked
    continued: list = field(default_factory=list)  # rollout.partial: groups asked that went on from their durable tokens
    continued_tokens: int = 0  # and those tokens


class GroupPlayer(Protocol):
    """What plays the groups a completion-order source asks: single-turn samples (:class:`SingleTurnGroups`),
    rollout.env's episodes (``sources.episodes.Turns``), rollout.agent's programs (``sources.agents_async.AgentGroups``).
    Each holds what it makes durable between commits and reads it back after a crash."""

    def resume(self) -> None:
        """A process's first collect (or the first after its engine changed): what an earlier process made durable, read
        back for the groups still to come. Collective."""

    def committed(self, groups: list[int]) -> None:
        """The groups whose samples are in the step committed since: forgotten at the next durable write."""

    def ask(self, groups: list[tuple[int, int]]) -> None:
        """Begin this rank's share of `groups` (group, row): the q-th is rank q mod dp's. Collective."""

    def arrived(self, wait: float) -> list[Sample]:
        """Every rank's groups over since the last call (rank order, then arrival order), scored, waiting up to `wait`
        seconds for the first; the wait counted in timing_s/gen. Collective."""

    def pushed(self) -> None:
        """After a push of new weights, before the step's commit. Collective."""

    def metrics(self) -> dict[str, float]:
        """The player's own metrics for the step."""

    def close(self) -> None:
        """Release what it holds (a gateway)."""


class SingleTurnGroups:
    """One response a sample: a group asked of the generator with its samples' seeds (rollout.partial: from its durable
    tokens, if a push stopped it before a crash: the Partials it holds), scored when it arrives."""

    def __init__(self, src: CompletionSource):
        self.src = src
        self.partials = Partials(src) if src.cfg.rollout.partial else None  # rollout.partial: generations a push stopped

    def resume(self) -> None:
        if self.partials is not None:
            self.partials.restore()

    def committed(self, groups: list[int]) -> None:
        if self.partials is not None:
            self.partials.settle += groups

    def ask(self, groups: list[tuple[int, int]]) -> None:
        src = self.src
        cfg, n, rt = src.cfg, src.cfg.rollout.n, src.host.rt
        mine = [(g, r) for q, (g, r) in enumerate(groups) if q % rt.dp_size == rt.dp_rank]
        prompt_ids = src.host.prompt_ids
        # rollout.partial: from durable tokens (every rank reads the same: each notes all the groups that go on, asks its own)
        progress = self.partials.progress(groups) if self.partials is not None else None
        src.live.ask([(g, prompt_ids[r], [derive_seed(cfg.trainer.seed, 0, "rollout/group", g, j) for j in range(n)])
                      for g, r in mine], cfg, max(1, cfg.data.prompts_per_step // rt.dp_size), progress)

    def arrived(self, wait: float) -> list[Sample]:
        src = self.src
        t = time.perf_counter()
        arrived = [a for got in src.host.rt.all_gather_obj(src.live.arrived(wait)) for a in got]
        add_time(src.timings, "timing_s/gen", time.perf_counter() - t)  # the wait the update did not cover
        return self.scored(arrived) if arrived else []

    def scored(self, arrived: list[tuple]) -> list[Sample]:
        """Single-turn groups arrived (group, responses, log-probs, version[, each sample's version runs:
        rollout.partial]), scored, as samples (a sample's policy_version: its oldest token's)."""
        src = self.src
        n, host = src.cfg.rollout.n, src.host
        t = time.perf_counter()
        new = []
        for g, responses, logps, version, *runs in arrived:
            g, row = int(g), host.buffer.requests[int(g)]
            got = host.scorer.score([row], n, [host.prompt_ids[row]] * n, list(responses), list(logps))
            for j, smp in enumerate(got):
                smp.id, smp.group, smp.policy_version = g + j, g, int(version)
                if runs:
                    smp.version_runs = np.asarray(runs[0][j], np.int64)
                    smp.policy_version = int(smp.version_runs[0]) if len(smp.version_runs) else int(version)
            new += got
        add_time(src.timings, "timing_s/reward", time.perf_counter() - t)
        return new

    def pushed(self) -> None:
        if self.partials is not None:  # the groups the push stopped, durable before the commit
            failpoint("partial.before_durable")
            self.partials.keep()
            failpoint("partial.after_durable")

    def metrics(self) -> dict[str, float]:
        return self.partials.metrics() if self.partials is not None else {}

    def close(self) -> None:
        pass


class CompletionSource(Source):
    """Async completion order: arrivals enter the buffer (and this step's record) as they come. It holds its group
    players and asks the one the config in force names (`agents`: what makes an agent run's, sources.agents_async)."""

    def __init__(self, host: Host, agents: Callable[[CompletionSource], GroupPlayer] | None = None):
        super().__init__(host)
        self.flow: Flow | None = None  # this step's arrivals and asks
        self.resumed_asks = False  # the groups asked and not arrived were asked again of this process's generator
        self.single = SingleTurnGroups(self)
        self.turns = Turns(self)  # rollout.env: the groups of episodes being played
        self.agents = agents(self) if agents is not None else None
        self.consumed = np.zeros(0, np.int64)

    def player(self) -> GroupPlayer:
        """The group player the config in force asks for."""
        if self.agents is not None:
            return self.agents
        return self.turns if self.cfg.rollout.env is not None else self.single

    def engine_closed(self) -> None:
        self.resumed_asks = False  # a new generator: what the old one was asked must be asked again

    def collect(self, step: int) -> StepInputs:
        """The step takes the first prompts_per_step groups waiting; it asks for more when what waits
        and what is asked cannot fill it, then asks for the next k rounds, which generate while it
        trains. Collective."""
        self.begin(step)
        cfg, P, buffer = self.cfg, self.cfg.data.prompts_per_step, self.host.buffer
        if self.flow is not None:  # its groups are in the step committed since
            self.player().committed(sorted({int(s.group) for s in self.flow.added}))
        self.flow = flow = Flow()
        if not self.resumed_asks:
            flow.regenerated = list(buffer.requests)
            self.player().resume()
            self.ask(list(buffer.requests.items()))
            self.resumed_asks = True
        bound = cfg.rollout.max_token_staleness if cfg.rollout.partial else cfg.rollout.staleness  # partial: the oldest token's
        oldest = max(0, step - 1 - bound) if bound is not None else 0
        wait = 0.0
        while True:
            self.receive(wait)
            stale = [i for ids in buffer.groups().values() if min(buffer.samples[i].policy_version for i in ids) < oldest for i in ids]
            buffer.drop(stale)
            flow.stale += stale
            waiting = len(buffer.groups())
            if waiting >= P:
                break
            if waiting + len(buffer.requests) < P and flow.rounds < cfg.algorithm.max_sampling_rounds:
                self.ask_round(step)
            elif not buffer.requests:
                break  # dynamic sampling drew its rounds: the step trains on what it has
            wait = ARRIVAL_POLL_S if self.host.rt.world_size == 1 else ARRIVAL_POLL_S / 10  # ranks gather as often
        self.consumed = consumed = self.choose_consumed([], set())
        ahead = len(buffer.groups()) - len({int(buffer.samples[int(i)].group) for i in consumed})
        while ahead + len(buffer.requests) + P <= cfg.rollout.staleness * P:  # k rounds ahead
            self.ask_round(step)
        return self.inputs()

    def finish_collect(self, step: int, inputs: StepInputs) -> StepInputs:
        """After the update: push the new weights (the generator pauses at a batch's boundary first) and
        take in what arrived. Collective."""
        t = time.perf_counter()
        self.live.sync(self.cfg, step)  # before the commit: a group in flight at a crash began from a committed version
        add_time(self.timings, "timing_s/weight_sync", time.perf_counter() - t)
        self.receive(0.0)
        self.player().pushed()
        return self.inputs()

    def replayed(self, inputs: StepInputs) -> None:
        if inputs.requests is not None:
            self.host.buffer.request(inputs.requests.groups, inputs.requests.rows, self.cfg.rollout.n)
        super().replayed(inputs)

    def in_flight(self) -> dict[str, float]:
        return {**super().in_flight(), "buffer/requested_groups": float(len(self.host.buffer.requests))}

    @property
    def now(self) -> Flow:
        assert self.flow is not None, "a live step's collect made its flow"
        return self.flow

    def ask_round(self, step: int) -> None:
        """Draw prompts_per_step prompts and ask the generator for their groups: each group's samples
        get their ids now, and their seeds from the group's id."""
        cfg, n, buffer = self.cfg, self.cfg.rollout.n, self.host.buffer
        rows = self.host.sampler.draw(cfg.data.prompts_per_step)
        groups = [buffer.next_id + q * n for q in range(len(rows))]
        buffer.request(groups, rows, n)
        self.now.asked += list(zip(groups, rows.tolist()))
        self.now.rounds += 1
        self.ask(list(zip(groups, rows.tolist())))

    def ask(self, groups: list[tuple[int, int]]) -> None:
        """Ask for `groups` (group, row), this rank its share: single-turn groups of the generator; with rollout.env each
        group's episodes begin (or come back from their last durable turn) and their turn is asked; with rollout.agent the
        groups are played at once."""
        self.player().ask(groups)

    def receive(self, wait: float) -> None:
        """Take in the groups every rank's player has over (rank order, then arrival order), scored: reference
        log-probs, admitted; dynamic sampling drops the groups whose rewards do not vary. Collective."""
        new = self.player().arrived(wait)
        if new:
            self.take_in(new)

    def take_in(self, new: list[Sample]) -> None:
        """Arrived samples given their reference log-probs and admitted; dynamic sampling drops the groups
        whose rewards do not vary, a fault's group is out of the update."""
        cfg, n, host = self.cfg, self.cfg.rollout.n, self.host
        overlong.shape(new, cfg.rollout, host.tokenizer.eos_token_id)  # before dynamic sampling reads the scores
        t = time.perf_counter()
        host.scorer.reference_logprobs(new, host.actor)
        add_time(self.timings, "timing_s/ref", time.perf_counter() - t)
        out = faults.excluded(new, faults.min_group(cfg.algorithm.name, n))
        dropped = zero_variance(new, set(out)) if cfg.algorithm.dynamic_sampling else []
        host.buffer.admit(new, dropped + out, {})
        self.now.added += new
        self.now.dropped += dropped
        self.now.faulted += out
        failpoint("async.admit")

    def inputs(self) -> StepInputs:
        flow, cfg, sampler = self.now, self.cfg, self.host.sampler
        self.timings.update({"sampling/rounds": float(flow.rounds), "sampling/dropped_groups": float(len(flow.dropped) // cfg.rollout.n),
                             "rollout/regenerated_groups": float(len(flow.regenerated)), **faults.metrics(flow.added),
                             **overlong.metrics(flow.added, self.host.tokenizer.eos_token_id)})
        self.timings.update(self.player().metrics())
        ids = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
        return StepInputs(
            seeds=self.seeds,
            data=ev.Data(sampler.epoch, sampler.cursor, ids([r for _, r in flow.asked]), flow.rounds),
            added=sample_codec.pack(flow.added),
            dropped=ids(flow.dropped),
            consumed=self.consumed,
            timings=self.timings,
            rollout=ev.Rollout(self.live.name, self.live.version, ev.RolloutMode.ASYNC, cfg.rollout.staleness, ev.AsyncOrder.COMPLETION,
                               partial=cfg.rollout.partial),
            stale=ids(flow.stale),
            faulted=ids(flow.faulted),
            requests=ev.Requests(ids([g for g, _ in flow.asked]), ids([r for _, r in flow.asked]), ids(flow.regenerated), ids(flow.continued)),
            admitted=True,
        )

    def close(self, at_once: bool = False) -> None:
        if self.agents is not None:
            self.agents.close()
        super().close(at_once)
