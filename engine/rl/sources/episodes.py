"""rollout.env: episodes, in either order (the envs themselves and a round of episodes: ``rl.envs``,
``rl.episodes``).

Step order (:func:`play_round`): a round's episodes are played to their ends within the step, turn t
of every episode still going generated together. Completion order (:class:`Turns`): each group's
episodes are played a turn at a time as the generator returns them; every group that took a turn is
made durable (the run's in-flight log) before its next turn is asked, so that after a crash a group
comes back from its last durable turn (its envs restored, the journaled actions re-applied) instead
of from its start.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from verlj.journal.failpoints import failpoint

from ...schema import sample as sample_codec
from ...schema.sample import GroupInFlight, Sample
from ...state.seeding import derive_seed
from ..envs import row_of
from ..episodes import Limits, Play, Round
from ..sampler import AskedGroup
from .base import add_time

if TYPE_CHECKING:
    from .completion import CompletionSource
    from .sync import Production, StepOrder


def play_round(src: StepOrder, prod: Production, responses: list[np.ndarray], logps: list[np.ndarray]) -> None:
    """Play the round's episodes to their ends from turn 0's actions: turn t of every episode still
    going is generated together (its context so far as the prompt, its own seed). Collective: the
    ranks generate each turn together while any rank has an episode going."""
    cfg, rt, eps = src.cfg, src.host.rt, prod.episodes
    assert eps is not None
    places = list(range(len(eps.episodes)))
    while True:
        eps.take(places, responses, logps)
        if rt.all_true(eps.done()):
            return
        places = [] if eps.done() else eps.live()
        contexts = [eps.episodes[i].context() for i in places]
        seeds = [derive_seed(cfg.trainer.seed, prod.step, "rollout/sample", prod.rounds, prod.places[i], eps.turn) for i in places]
        if not places:  # this rank's episodes are over, another rank's are not: step with it, keep nothing
            contexts, seeds = [eps.episodes[0].context()], [0]
        responses, logps = src.live.result(src.live.submit(contexts, seeds, cfg))
        if not places:
            responses, logps = [], []


class Turns:
    """Completion order's groups of episodes: those this rank asked for, being played (`plays`); those
    durable from before this process (read at its first collect); restored ones already over; groups in
    a committed step, to forget at the next durable write."""

    def __init__(self, src: CompletionSource):
        self.src = src
        self.plays: dict[int, Play] = {}
        self.durable: dict[int, GroupInFlight] = {}
        self.over: list[int] = []
        self.settle: list[int] = []

    def durable_groups(self) -> dict[int, GroupInFlight]:
        """The groups of episodes made durable by an earlier process, each as it stood after its last turn
        generated from a committed version (a turn from the weights of a step that never committed is
        made again): those still asked, and those asked in a step that never committed, which this
        process asks again under the same ids when it draws the same rows (`begin_play` checks the row).
        The rest are forgotten at the next write. Collective."""
        host = self.src.host
        if host.in_flight_log is None:
            return {}
        version, buffer, out = host.policy_version, host.buffer, {}
        for g, state in host.in_flight_log.read().items():
            kept = state.before(sum(v <= version for v in state.versions)) if g in buffer.requests or g >= buffer.next_id else None
            if kept is None:
                self.settle.append(g)
            else:
                out[g] = kept
        return out

    def begin_play(self, g: int, row: int) -> AskedGroup | None:
        """A group's episodes begin (each env reset from its place: rl.episodes), or come back from their
        last durable turn; returns what to ask of the generator (None: the group is over already)."""
        cfg, host, n = self.src.cfg, self.src.host, self.src.cfg.rollout.n
        rows = [row_of(host.dataset[int(row)])] * n
        durable = self.durable.pop(g, None)
        if durable is not None and durable.row != int(row):  # another prompt under that id: not this group's turns
            self.settle.append(g)
            durable = None
        if durable is None:
            env_seeds = [derive_seed(cfg.trainer.seed, 0, "rollout/env", g, j) for j in range(n)]
            play = Play(Round(host.envs(), rows, env_seeds, [host.prompt_ids[row]] * n, host.tokenizer, Limits.of(cfg.rollout)), int(row))
        else:
            rnd, replayed = Round.restored(host.envs(), rows, durable, host.tokenizer, Limits.of(cfg.rollout))
            play = Play(rnd, int(row), list(durable.versions))
            self.src.now.restored_turns += replayed
        self.plays[g] = play
        return self.next_turn(g, play)

    def next_turn(self, g: int, play: Play) -> AskedGroup | None:
        """The group's next turn to ask (its live episodes' contexts, each with its own seed), or None when
        it is over (noted in `over`, taken in by the next `receive`)."""
        rnd, seed = play.round, self.src.cfg.trainer.seed
        if rnd.turn > 0 and rnd.done():
            self.over.append(g)
            return None
        play.places = list(range(len(rnd.episodes))) if rnd.turn == 0 else rnd.live()
        seeds = [derive_seed(seed, 0, "rollout/group", g, j, *([rnd.turn] if rnd.turn else [])) for j in play.places]
        return g, [rnd.episodes[j].context() for j in play.places], seeds

    def receive(self, arrived: list[tuple]) -> list[Sample]:
        """This rank's arrived turns: each group's envs stepped, every group that took a turn made
        durable as it stands (the journal's pending store, through the in-flight log) before its next
        turn is asked; the groups over scored. Returns every rank's groups over, as samples (rank
        order). Collective."""
        src = self.src
        cfg, n, host = src.cfg, src.cfg.rollout.n, src.host
        t = time.perf_counter()
        took = []
        for g, responses, logps, version in arrived:
            play = self.plays[int(g)]
            play.round.take(play.places, list(responses), list(logps))
            play.versions.append(int(version))
            took.append(int(g))
        add_time(src.timings, "timing_s/env", time.perf_counter() - t)
        if took:
            failpoint("episodes.before_durable")  # the envs have stepped; the turns are not durable
        states = [self.plays[g].state(g).to_dict() for g in took]
        over, self.over = [g for g in took if self.plays[g].round.done()] + self.over, []
        t = time.perf_counter()
        local = []
        for g in over:
            play = self.plays.pop(g)
            got = host.scorer.score_episodes([play.row], n, play.round)
            for j, smp in enumerate(got):
                smp.id, smp.group, smp.policy_version = g + j, g, play.versions[0]
            local += got
        add_time(src.timings, "timing_s/reward", time.perf_counter() - t)
        gathered = host.rt.all_gather_obj((states, sample_codec.pack(local)))
        kept = [GroupInFlight.from_dict(d) for st, _ in gathered for d in st]
        if kept and host.in_flight_log is not None:
            host.in_flight_log.keep(kept, self.settle)
            self.settle = []
            failpoint("episodes.after_durable")
        asks = [self.next_turn(g, self.plays[g]) for g in took if g in self.plays]
        src.live.ask([a for a in asks if a is not None], cfg, max(1, cfg.data.prompts_per_step // host.rt.dp_size))
        return [s for _, cols in gathered for s in sample_codec.unpack(cols)]
