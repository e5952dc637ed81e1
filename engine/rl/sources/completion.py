"""rollout.mode=async, rollout.async_order=completion: the generator works through the groups asked of it
on its own; the step takes the first prompts_per_step groups that have arrived, in arrival order,
dropping those more than k versions behind it. Timing decides what a step trains on, so the journal
records what was asked, what arrived and what was asked again (the ``requests`` event).

What recovery needs back: the buffer's requests (groups asked and not arrived, in the buffer's state
and in each step's record). A process's first collect asks again for every one of them, from its
original seeds; with rollout.env a group of episodes comes back from its last durable turn
(``sources.env_players.Turns``), with rollout.partial a group a push stopped from its last durable token
(``sources.partial_groups.Partials``). The groups are played by the group player the assembly made for the run
(``sources.players.GroupPlayer``), which is told what it needs each call and returns what it made.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from verlj.journal.failpoints import failpoint

from ...schema import events as ev
from ...schema import sample as sample_codec
from ...schema.sample import Sample
from .. import faults, overlong
from ..inputs import StepInputs
from .base import Source, add_all, add_time, episode_metrics, zero_variance
from .players import Asked, GroupCall, GroupPlayer, Parts

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

    def took(self, asked: Asked) -> None:
        """What an ask did beyond asking, counted in the step's flow."""
        self.continued += asked.continued
        self.continued_tokens += asked.continued_tokens
        self.restored_turns += asked.restored_turns


class CompletionSource(Source):
    """Async completion order: arrivals enter the buffer (and this step's record) as they come. It holds the group player
    the assembly made for the run and tells it, each call, what it needs of the step."""

    def __init__(self, parts: Parts, player: GroupPlayer):
        super().__init__(parts)
        self.player = player
        self.eos = parts.tokenizer.eos_token_id
        self.flow: Flow | None = None  # this step's arrivals and asks
        self.step = 0  # the live step being collected
        self.resumed_asks = False  # the groups asked and not arrived were asked again of this process's generator
        self.pushed_metrics: dict[str, float] = {}  # what the last push made durable (rollout.partial)
        self.consumed = np.zeros(0, np.int64)

    def call(self, pushed: bool = False) -> GroupCall:
        """What the player needs of the step, as it stands now (the buffer's requests change as groups arrive); the
        policy version the trainer holds: the step's before its update, the step's own once it is `pushed`."""
        return GroupCall(self.step, self.step if pushed else self.step - 1, self.live, dict(self.buffer.requests), self.buffer.next_id)

    def collect(self, step: int) -> StepInputs:
        """The step takes the first prompts_per_step groups waiting; it asks for more when what waits
        and what is asked cannot fill it, then asks for the next k rounds, which generate while it
        trains. Collective."""
        self.begin(step)
        self.step = step
        cfg, P, buffer = self.cfg, self.cfg.data.prompts_per_step, self.buffer
        if self.flow is not None:  # its groups are in the step committed since
            self.player.committed(sorted({int(s.group) for s in self.flow.added}))
        self.flow = flow = Flow()
        if not self.resumed_asks:
            flow.regenerated = list(buffer.requests)
            self.player.resume(self.call())
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
                self.ask_round()
            elif not buffer.requests:
                break  # dynamic sampling drew its rounds: the step trains on what it has
            wait = ARRIVAL_POLL_S if self.rt.world_size == 1 else ARRIVAL_POLL_S / 10  # ranks gather as often
        self.consumed = consumed = self.choose_consumed([], set())
        ahead = len(buffer.groups()) - len({int(buffer.samples[int(i)].group) for i in consumed})
        while ahead + len(buffer.requests) + P <= cfg.rollout.staleness * P:  # k rounds ahead
            self.ask_round()
        return self.inputs()

    def finish_collect(self, step: int, inputs: StepInputs) -> StepInputs:
        """After the update: push the new weights (the generator pauses at a batch's boundary first) and
        take in what arrived. Collective."""
        t = time.perf_counter()
        self.live.sync(self.cfg, step)  # before the commit: a group in flight at a crash began from a committed version
        add_time(self.timings, "timing_s/weight_sync", time.perf_counter() - t)
        self.receive(0.0, pushed=True)
        self.pushed_metrics = self.player.pushed(self.call(pushed=True))
        return self.inputs()

    def replayed(self, inputs: StepInputs) -> None:
        if inputs.requests is not None:
            self.buffer.request(inputs.requests.groups, inputs.requests.rows, self.cfg.rollout.n)
        super().replayed(inputs)

    def in_flight(self) -> dict[str, float]:
        return {**super().in_flight(), "buffer/requested_groups": float(len(self.buffer.requests))}

    @property
    def now(self) -> Flow:
        assert self.flow is not None, "a live step's collect made its flow"
        return self.flow

    def ask_round(self) -> None:
        """Draw prompts_per_step prompts and ask the generator for their groups: each group's samples
        get their ids now, and their seeds from the group's id."""
        cfg, n, buffer = self.cfg, self.cfg.rollout.n, self.buffer
        rows = self.sampler.draw(cfg.data.prompts_per_step)
        groups = [buffer.next_id + q * n for q in range(len(rows))]
        buffer.request(groups, rows, n)
        self.now.asked += list(zip(groups, rows.tolist()))
        self.now.rounds += 1
        self.ask(list(zip(groups, rows.tolist())))

    def ask(self, groups: list[tuple[int, int]]) -> None:
        """Ask the player for `groups` (group, row), this rank its share: single-turn groups of the generator; with
        rollout.env each group's episodes begin (or come back from their last durable turn) and their turn is asked;
        with rollout.agent the groups are played at once."""
        asked = self.player.ask(groups, self.call())
        self.now.took(asked)
        add_time(self.timings, "timing_s/gen", asked.gen_s)
        add_all(self.timings, asked.metrics)

    def receive(self, wait: float, pushed: bool = False) -> None:
        """Take in the groups every rank's player has over (rank order, then arrival order), scored: reference
        log-probs, admitted; dynamic sampling drops the groups whose rewards do not vary. Collective."""
        made = self.player.arrived(wait, self.call(pushed))
        add_time(self.timings, "timing_s/gen", made.gen_s)
        add_all(self.timings, made.metrics)
        if made.samples:
            self.take_in(made.samples)

    def take_in(self, new: list[Sample]) -> None:
        """Arrived samples given their reference log-probs and admitted; dynamic sampling drops the groups
        whose rewards do not vary, a fault's group is out of the update."""
        cfg, n = self.cfg, self.cfg.rollout.n
        overlong.shape(new, cfg.rollout, self.eos)  # before dynamic sampling reads the scores
        t = time.perf_counter()
        self.scorer.reference_logprobs(new, self.actor)
        add_time(self.timings, "timing_s/ref", time.perf_counter() - t)
        out = faults.excluded(new, faults.min_group(cfg.algorithm.name, n))
        dropped = zero_variance(new, set(out)) if cfg.algorithm.dynamic_sampling else []
        self.buffer.admit(new, dropped + out, {})
        self.now.added += new
        self.now.dropped += dropped
        self.now.faulted += out
        failpoint("async.admit")

    def metrics(self) -> dict[str, float]:
        """What the step's flow says of the player's kind of samples: rollout.env's episodes, rollout.partial's
        stopped and continued generations."""
        flow, ro = self.now, self.cfg.rollout
        if ro.env is not None:
            return {**episode_metrics(flow.added), "rollout/env/restored_turns": float(flow.restored_turns)}
        if ro.partial and ro.agent is None:
            return {"rollout/partial/stopped_groups": 0.0, "rollout/partial/stopped_tokens": 0.0, **self.pushed_metrics,
                    "rollout/partial/continued_groups": float(len(flow.continued)),
                    "rollout/partial/continued_tokens": float(flow.continued_tokens), "rollout/dropped_stale": float(len(flow.stale))}
        return {}

    def inputs(self) -> StepInputs:
        flow, cfg, sampler = self.now, self.cfg, self.sampler
        self.timings.update({"sampling/rounds": float(flow.rounds), "sampling/dropped_groups": float(len(flow.dropped) // cfg.rollout.n),
                             "rollout/regenerated_groups": float(len(flow.regenerated)), **faults.metrics(flow.added),
                             **overlong.metrics(flow.added, self.eos)})
        self.timings.update(self.metrics())
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
        self.player.close()
        super().close(at_once)
