"""Single-turn samples, one response a prompt: step order's round player (:class:`SingleTurn`) and completion order's
group player (:class:`SingleTurnGroups`, with rollout.partial the generations a push stopped: ``sources.partial_groups``).

Seeds: in step order a sample's from its place (round r, place q) in the step s that trains on it,
``derive_seed(seed, s, "rollout/sample", r, q)``; in completion order from its group's id g and its place j in the group,
``derive_seed(seed, 0, "rollout/group", g, j)``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from verlj.journal.failpoints import failpoint

from ...config import Config
from ...state.seeding import derive_seed
from .partial_groups import Partials
from .players import Asked, GroupCall, Made, Parts, RoundCall

if TYPE_CHECKING:
    from ...dist import Runtime
    from ..scoring import Scorer


class SingleTurn:
    """One response a prompt: the round submitted to the engine at once, scored when it is back."""

    def __init__(self, cfg: Config, scorer: Scorer):
        self.cfg, self.scorer = cfg, scorer

    @classmethod
    def of(cls, parts: Parts) -> SingleTurn:
        return cls(parts.cfg, parts.scorer)

    def start(self, call: RoundCall) -> object:
        seeds = [derive_seed(self.cfg.trainer.seed, call.step, "rollout/sample", call.round, q) for q in call.places]
        return call.engine.submit(call.prompts, seeds, self.cfg)

    def samples(self, call: RoundCall, started: object) -> Made:
        t0 = time.perf_counter()
        responses, logps = call.engine.result(started)
        t1 = time.perf_counter()
        local = self.scorer.score(call.mine, self.cfg.rollout.n, call.prompts, responses, logps)
        return Made(local, t1 - t0, {"timing_s/reward": time.perf_counter() - t1})

    def close(self) -> None:
        pass


class SingleTurnGroups:
    """One response a sample: a group asked of the generator with its samples' seeds (rollout.partial: from its durable
    tokens, if a push stopped it before a crash: the Partials it holds), scored when it arrives."""

    def __init__(self, cfg: Config, rt: Runtime, scorer: Scorer, prompt_ids: list[np.ndarray], partials: Partials | None):
        self.cfg, self.rt, self.scorer, self.prompt_ids, self.partials = cfg, rt, scorer, prompt_ids, partials

    @classmethod
    def of(cls, parts: Parts) -> SingleTurnGroups:
        partials = Partials(parts.rt, parts.durable) if parts.cfg.rollout.partial else None  # generations a push stopped
        return cls(parts.cfg, parts.rt, parts.scorer, parts.prompt_ids, partials)

    def resume(self, call: GroupCall) -> None:
        if self.partials is not None:
            self.partials.restore(call)

    def committed(self, groups: list[int]) -> None:
        if self.partials is not None:
            self.partials.committed(groups)

    def ask(self, groups: list[tuple[int, int]], call: GroupCall) -> Asked:
        cfg, n, rt = self.cfg, self.cfg.rollout.n, self.rt
        mine = [(g, r) for q, (g, r) in enumerate(groups) if q % rt.dp_size == rt.dp_rank]
        # rollout.partial: from durable tokens (every rank reads the same: each notes all the groups that go on, asks its own)
        asked, progress = (self.partials.progress(groups) if self.partials is not None else (Asked(), None))
        call.engine.ask([(g, self.prompt_ids[r], [derive_seed(cfg.trainer.seed, 0, "rollout/group", g, j) for j in range(n)])
                         for g, r in mine], cfg, max(1, cfg.data.prompts_per_step // rt.dp_size), progress)
        return asked

    def arrived(self, wait: float, call: GroupCall) -> Made:
        t = time.perf_counter()
        arrived = [a for got in self.rt.all_gather_obj(call.engine.arrived(wait)) for a in got]
        waited = time.perf_counter() - t  # the wait the update did not cover
        if not arrived:
            return Made([], waited, {})
        return self.scored(arrived, call, waited)

    def scored(self, arrived: list[tuple], call: GroupCall, waited: float) -> Made:
        """Single-turn groups arrived (group, responses, log-probs, version[, each sample's version runs:
        rollout.partial]), scored, as samples (a sample's policy_version: its oldest token's)."""
        n = self.cfg.rollout.n
        t = time.perf_counter()
        new = []
        for g, responses, logps, version, *runs in arrived:
            g, row = int(g), call.requests[int(g)]
            got = self.scorer.score([row], n, [self.prompt_ids[row]] * n, list(responses), list(logps))
            for j, smp in enumerate(got):
                smp.id, smp.group, smp.policy_version = g + j, g, int(version)
                if runs:
                    smp.version_runs = np.asarray(runs[0][j], np.int64)
                    smp.policy_version = int(smp.version_runs[0]) if len(smp.version_runs) else int(version)
            new += got
        return Made(new, waited, {"timing_s/reward": time.perf_counter() - t})

    def pushed(self, call: GroupCall) -> dict[str, float]:
        if self.partials is None:
            return {}
        failpoint("partial.before_durable")  # the groups the push stopped, durable before the commit
        out = self.partials.keep(call)
        failpoint("partial.after_durable")
        return out

    def close(self) -> None:
        pass
