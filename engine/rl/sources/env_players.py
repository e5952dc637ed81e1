"""rollout.env: episodes, in either order (the envs themselves and a round of episodes: ``rl.envs``,
``rl.episodes``).

Step order (:class:`EnvRounds`, the step-order batches' round player): a round's episodes are played to their
ends within the step, turn t of every episode still going generated together (``rl.episodes.play_lockstep``, the
loop the held-out eval plays its episodes by too). Completion order (:class:`Turns`): each group's
episodes are played a turn at a time as the generator returns them; every group that took a turn is
made durable (the run's in-flight log) before its next turn is asked, so that after a crash a group
comes back from its last durable turn (its envs restored, the journaled actions re-applied) instead
of from its start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from verlj.journal.failpoints import failpoint

from ...config import Config
from ...schema import sample as sample_codec
from ...schema.sample import EnvEnd, GroupInFlight, Sample
from ...state.seeding import derive_seed
from ..envs import EnvFactory, row_of
from ..episodes import GroupWork, Limits, Play, Round, play_lockstep
from ..fleet import RayFleet
from ..rollout import RolloutEngine
from ..sampler import AskedGroup
from .players import Asked, GroupCall, InFlightLog, Made, Parts, RoundCall

if TYPE_CHECKING:
    from ...dist import Runtime
    from ..scoring import Scorer


def on_fleet(engine: RolloutEngine) -> RayFleet | None:
    """The engine when it is a Ray fleet (rollout.fleet=ray): rollout.env's envs then run on its actors,
    beside generation (rl.episodes.play_group), and the trainer holds each group's state only."""
    return engine if isinstance(engine, RayFleet) else None


@dataclass
class EnvAsk:
    """A round of episodes in flight on this rank: played here (`round`, its first turn asked of the engine: `handle`),
    or on a fleet's actors (`round` None, `handle` the fleet's)."""

    handle: object
    round: Round | None = None


class EnvRounds:
    """Step order's round player for rollout.env (``sources.players.RoundPlayer``): each of the round's episodes reset
    (its env's seed from its place), played to its end in lockstep (rl.episodes.play_lockstep: turn t of every episode
    still going generated together, its context so far as the prompt, its own seed), scored as an episode; on a Ray
    fleet its envs run on the actors, beside generation, and the trainer gets each group's state back."""

    def __init__(self, cfg: Config, rt: Runtime, tokenizer: Any, dataset: list, scorer: Scorer, envs: Callable[[], EnvFactory]):
        self.cfg, self.rt, self.tokenizer, self.dataset, self.scorer, self.envs = cfg, rt, tokenizer, dataset, scorer, envs

    @classmethod
    def of(cls, parts: Parts) -> EnvRounds:
        return cls(parts.cfg, parts.rt, parts.tokenizer, parts.dataset, parts.scorer, parts.envs)

    def start(self, call: RoundCall) -> object:
        cfg, n = self.cfg, self.cfg.rollout.n
        rows = [row_of(self.dataset[int(i)]) for i in call.mine for _ in range(n)]
        env_seeds = [derive_seed(cfg.trainer.seed, call.step, "rollout/env", call.round, q) for q in call.places]
        fleet = on_fleet(call.engine)
        if fleet is not None:  # its envs run on the fleet's actors, beside generation
            return EnvAsk(fleet.play(self.works(call, rows, env_seeds), cfg))
        rnd = Round(self.envs(), rows, env_seeds, call.prompts, self.tokenizer, Limits.of(cfg.rollout))
        first = rnd.live()  # a reset that faulted: no action is asked of it (a stand-in prompt when none is left)
        seeds = [self.seed(call, i, 0) for i in first] or [0]
        return EnvAsk(call.engine.submit([rnd.first_prompts()[i] for i in first] or rnd.first_prompts()[:1], seeds, cfg), rnd)

    def seed(self, call: RoundCall, i: int, turn: int) -> int:
        """The seed of turn `turn` of the episode at place `i` of this rank's share (its sample's place in the step)."""
        return derive_seed(self.cfg.trainer.seed, call.step, "rollout/sample", call.round, call.places[i], *([turn] if turn else []))

    def samples(self, call: RoundCall, started: object) -> Made:
        """The round's episodes played to their ends from their first turns' actions, scored. Collective: the ranks
        generate each turn together while any rank has an episode going."""
        assert isinstance(started, EnvAsk), "an env round is started before its samples are asked for"
        t0 = time.perf_counter()
        here, cfg, engine = started.round, self.cfg, call.engine
        if here is None:  # played on the fleet's actors
            rnd = self.played(call, started.handle)
        else:
            rnd = here
            play_lockstep(rnd, lambda contexts, seeds: engine.result(engine.submit(contexts, seeds, cfg)),
                          lambda i, turn: self.seed(call, i, turn), self.rt.all_true, engine.result(started.handle))
        t1 = time.perf_counter()
        local = self.scorer.score_episodes(call.mine, cfg.rollout.n, rnd)
        return Made(local, t1 - t0, {"timing_s/reward": time.perf_counter() - t1})

    def works(self, call: RoundCall, rows: list[dict], env_seeds: list[int]) -> list[GroupWork]:
        """On a fleet: the round's groups of episodes to play to their ends on its actors, each episode's seeds those
        of its place in the step (as played here)."""
        cfg, n = self.cfg, self.cfg.rollout.n
        limits = Limits.of(cfg.rollout)
        return [GroupWork(k // n, int(call.mine[k // n]), rows[k : k + n], call.prompts[k : k + n], env_seeds[k : k + n],
                          [(cfg.trainer.seed, call.step, "rollout/sample", call.round, q) for q in call.places[k : k + n]], limits,
                          cfg.rollout.max_turns) for k in range(0, len(rows), n)]

    def played(self, call: RoundCall, handle: object) -> Round:
        """On a fleet: the round's episodes, as its actors played them (their envs stay there)."""
        fleet = on_fleet(call.engine)
        assert fleet is not None and isinstance(handle, int), "a round is played on a fleet only, named by its handle"
        states = [GroupInFlight.from_dict(d) for d in fleet.played(handle)]
        return Round.of_states(states, self.tokenizer, Limits.of(self.cfg.rollout))

    def close(self) -> None:
        pass


class Turns:
    """Completion order's groups of episodes (``sources.players.GroupPlayer``): those this rank asked for, being played
    (`plays`); those durable from before this process (read at its first collect); restored ones already over; groups in
    a committed step, to forget at the next durable write."""

    def __init__(self, cfg: Config, rt: Runtime, tokenizer: Any, dataset: list, prompt_ids: list[np.ndarray], scorer: Scorer, envs: Callable[[], EnvFactory],
                 durable: InFlightLog | None):
        self.cfg, self.rt, self.tokenizer, self.dataset, self.prompt_ids = cfg, rt, tokenizer, dataset, prompt_ids
        self.scorer, self.envs, self.durable_log = scorer, envs, durable
        self.limits = Limits.of(cfg.rollout)
        self.plays: dict[int, Play] = {}
        self.durable: dict[int, GroupInFlight] = {}
        self.over: list[int] = []
        self.settle: list[int] = []

    @classmethod
    def of(cls, parts: Parts) -> Turns:
        return cls(parts.cfg, parts.rt, parts.tokenizer, parts.dataset, parts.prompt_ids, parts.scorer, parts.envs, parts.durable)

    # ------------------------------------------------------------------ the completion source's group player

    def resume(self, call: GroupCall) -> None:
        """A process's first collect: the groups made durable by an earlier one, read back (durable_groups)."""
        self.durable = self.durable_groups(call)

    def committed(self, groups: list[int]) -> None:
        self.settle += groups

    def ask(self, groups: list[tuple[int, int]], call: GroupCall) -> Asked:
        """This rank's share of `groups` (the q-th is rank q mod dp's): each group's episodes begin (or come back from their
        last durable turn), and their turn is asked of the generator."""
        cfg, rt, asked = self.cfg, self.rt, Asked()
        asks = [self.begin_play(g, r, call, asked) for q, (g, r) in enumerate(groups) if q % rt.dp_size == rt.dp_rank]
        call.engine.ask([a for a in asks if a is not None], cfg, max(1, cfg.data.prompts_per_step // rt.dp_size))
        return asked

    def arrived(self, wait: float, call: GroupCall) -> Made:
        """This rank's turns arrived, taken (receive): every rank's groups over, as samples. Collective."""
        t = time.perf_counter()
        mine = call.engine.arrived(wait)
        waited = time.perf_counter() - t
        made = self.receive(mine, call)
        return Made(made.samples, waited, made.metrics)

    def pushed(self, call: GroupCall) -> dict[str, float]:
        """Nothing: a group's turns are durable as they are taken."""
        return {}

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ its groups

    def durable_groups(self, call: GroupCall) -> dict[int, GroupInFlight]:
        """The groups of episodes made durable by an earlier process, each as it stood after its last turn
        generated from a committed version (a turn from the weights of a step that never committed is
        made again): those still asked, and those asked in a step that never committed, which this
        process asks again under the same ids when it draws the same rows (`begin_play` checks the row).
        The rest are forgotten at the next write. Collective."""
        if self.durable_log is None:
            return {}
        out = {}
        for g, state in self.durable_log.read_in_flight().items():
            kept = state.before(sum(v <= call.version for v in state.versions)) if g in call.requests or g >= call.next_id else None
            if kept is None:
                self.settle.append(g)
            else:
                out[g] = kept
        return out

    def begin_play(self, g: int, row: int, call: GroupCall, asked: Asked) -> AskedGroup | None:
        """A group's episodes begin (each env reset from its place: rl.episodes), or come back from their
        last durable turn; returns what to ask of the generator (None: the group is over already)."""
        cfg, n = self.cfg, self.cfg.rollout.n
        rows = [row_of(self.dataset[int(row)])] * n
        durable = self.durable.pop(g, None)
        if durable is not None and durable.row != int(row):  # another prompt under that id: not this group's turns
            self.settle.append(g)
            durable = None
        fleet = on_fleet(call.engine)
        if fleet is not None:
            asked.restored_turns += self.begin_remote(g, int(row), rows, durable, fleet, call.version)
            return None
        if durable is None:
            env_seeds = [derive_seed(cfg.trainer.seed, 0, "rollout/env", g, j) for j in range(n)]
            play = Play(Round(self.envs(), rows, env_seeds, [self.prompt_ids[row]] * n, self.tokenizer, self.limits), int(row),
                        asked_at=call.version)
        else:
            rnd, replayed = Round.restored(self.envs(), rows, durable, self.tokenizer, self.limits)
            play = Play(rnd, int(row), list(durable.versions), asked_at=call.version)
            asked.restored_turns += replayed
        self.plays[g] = play
        return self.next_turn(g, play)

    def begin_remote(self, g: int, row: int, rows: list[dict], durable: GroupInFlight | None, fleet: RayFleet, version: int) -> int:
        """On a fleet: the group's first turn (from its resets), or its next from its last durable turn,
        asked of the actors, whose envs play it (rl.episodes.play_group); the trainer holds its state (begun at policy
        `version`). Returns the env steps the actor re-applies."""
        cfg, n, limits = self.cfg, self.cfg.rollout.n, self.limits
        prompts = [self.prompt_ids[row]] * n
        work = GroupWork(g, row, rows, prompts, [derive_seed(cfg.trainer.seed, 0, "rollout/env", g, j) for j in range(n)],
                         [(cfg.trainer.seed, 0, "rollout/group", g, j) for j in range(n)], limits, 1)
        none = lambda dt: [np.zeros(0, dt)] * n  # noqa: E731 - before its first turn: no response yet
        start = durable or GroupInFlight(g, row, [], prompts, none(np.int64), none(np.float32), none(np.int8), none(np.int64),
                                         none(np.float64), list(work.env_seeds), [int(EnvEnd.NONE)] * n, [""] * n)
        play = Play(Round.of_states([start], self.tokenizer, limits), row, list(start.versions), work=work, asked_at=version)
        # the actor re-applies the durable actions of each episode still going
        restored = sum(len(ep.turn_lens) // 2 for ep in play.round.episodes if ep.live) if durable is not None else 0
        self.plays[g] = play
        self.ask_remote([g], fleet)
        return restored

    def ask_remote(self, groups: list[int], fleet: RayFleet) -> None:
        """On a fleet: the next turn of each of `groups` not over, each from its state as it stands."""
        works = []
        for g in groups:
            play = self.plays[g]
            if play.round.turn > 0 and play.round.done():
                self.over.append(g)
                continue
            assert play.work is not None, "a group played on a fleet has its work"
            works.append(play.next_work(g))
        cfg = self.cfg
        fleet.ask_play(works, cfg, max(1, cfg.data.prompts_per_step))

    def next_turn(self, g: int, play: Play) -> AskedGroup | None:
        """The group's next turn to ask (its live episodes' contexts, each with its own seed), or None when
        it is over (noted in `over`, taken in by the next `receive`)."""
        rnd, seed = play.round, self.cfg.trainer.seed
        if rnd.done():  # at turn 0 too: every reset faulted (no action is asked after one)
            self.over.append(g)
            return None
        places = play.asking(rnd.live())
        seeds = [derive_seed(seed, 0, "rollout/group", g, j, *([rnd.turn] if rnd.turn else [])) for j in places]
        return g, [rnd.episodes[j].context() for j in places], seeds

    def receive(self, arrived: list[tuple], call: GroupCall) -> Made:
        """This rank's arrived turns: each group's envs stepped, every group that took a turn made
        durable as it stands (the journal's pending store, through the in-flight log) before its next
        turn is asked; the groups over scored. Returns every rank's groups over, as samples (rank
        order). Collective."""
        cfg, n = self.cfg, self.cfg.rollout.n
        t = time.perf_counter()
        took = []
        fleet = on_fleet(call.engine)
        for item in arrived:
            play = self.plays[int(item[0])]
            if fleet is not None:  # the group's state after the turn its actor played
                play.took_remote(GroupInFlight.from_dict(item[1]), self.tokenizer, self.limits)
            else:
                play.took(list(item[1]), list(item[2]), int(item[3]))
            took.append(int(item[0]))
        env_s = time.perf_counter() - t
        if took:
            failpoint("episodes.before_durable")  # the envs have stepped; the turns are not durable
        states = [self.plays[g].state(g).to_dict() for g in took]
        over, self.over = [g for g in took if self.plays[g].round.done()] + self.over, []
        t = time.perf_counter()
        local = []
        for g in over:
            play = self.plays.pop(g)
            got = self.scorer.score_episodes([play.row], n, play.round)
            for j, smp in enumerate(got):
                smp.id, smp.group, smp.policy_version = g + j, g, play.version
            local += got
        reward_s = time.perf_counter() - t
        gathered = self.rt.all_gather_obj((states, sample_codec.pack(local)))
        kept = [GroupInFlight.from_dict(d) for st, _ in gathered for d in st]
        if kept and self.durable_log is not None:
            self.durable_log.keep_in_flight(kept, self.settle)
            self.settle = []
            failpoint("episodes.after_durable")
        if fleet is not None:
            self.ask_remote([g for g in took if g in self.plays], fleet)
        else:
            asks = [self.next_turn(g, self.plays[g]) for g in took if g in self.plays]
            call.engine.ask([a for a in asks if a is not None], cfg, max(1, cfg.data.prompts_per_step // self.rt.dp_size))
        samples: list[Sample] = [s for _, cols in gathered for s in sample_codec.unpack(cols)]
        return Made(samples, 0.0, {"timing_s/env": env_s, "timing_s/reward": reward_s})
