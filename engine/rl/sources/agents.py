"""rollout.agent: agent programs as rollouts, in step order (sync, and async step order: the batch played
from the version the generator holds; completion order: ``sources.agents_async``). Each sample of a step is one agent episode
(its dataset row, its seed from its place in the step), run against the gateway (``rl.gateway``):
an OpenAI-compatible endpoint on loopback whose calls the rollout engine generates, each from its own
seed. The episode's sample is built from the calls' token ids (``gateway.ledger``), scored by the
reward the agent returned (or rollout.reward_fn on its last answer), and journaled with every call.

Seeds, from the sample's place (round r, place q) in step s, as an env episode's: the agent's
``derive_seed(seed, s, "rollout/agent", r, q)``; call 0's generation ``derive_seed(seed, s,
"rollout/sample", r, q)`` (a single-turn sample's), call k > 0's ``derive_seed(seed, s, "rollout/sample",
r, q, k)``. Replay never runs an agent: it reads the journaled samples.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ...errors import RunError
from ...schema.agent_calls import AgentCalls
from ...schema.sample import EnvEnd, Sample
from ...state.seeding import derive_seed
from ..envs import row_of
from ..episodes import longest_sequence
from ..models import BUILTIN_TINY, render_chat
from .base import Source, add_time
from .planned import PlannedSource
from .sync import StepOrder, SyncSource

if TYPE_CHECKING:
    from ..gateway.runner import Played, Runner
    from ..gateway.server import Gateway
    from .sync import Production


class AgentPlaying(Source):
    """What every rollout.agent source shares: the gateway, a runner for the agent, the samples of its episodes."""

    gateway: Gateway | None = None
    runner: Runner | None = None
    built: tuple = ()

    def _runner(self) -> Runner:
        """The gateway (started at the first live round) and a runner for the agent the config names now."""
        from ..gateway.runner import Runner, load_agent
        from ..gateway.server import Gateway

        cfg, host = self.cfg, self.host
        if host.rt.world_size > 1:
            raise RunError("rollout.agent runs on one rank for now; run it without torchrun (or with --nproc_per_node 1)")
        if self.gateway is None:
            self.gateway = Gateway(cfg.model.actor.model_name_or_path).start()
        ro = cfg.rollout
        want = (ro.agent, ro.agent_concurrency, ro.agent_timeout_s, ro.max_turns)
        if self.runner is None or want != self.built:
            assert ro.agent is not None
            self.runner = Runner(self.gateway, load_agent(ro.agent), host.tokenizer, self._render, self._generate, ro.agent_concurrency,
                                 ro.agent_timeout_s, ro.max_turns)
            self.built = want
        self.runner.max_prompt = self._max_prompt()
        self.runner.stream_tokens = self._streams()
        return self.runner

    def _max_prompt(self) -> int:
        """The longest prompt a call may have: the context a generation holds (rl.episodes.longest_sequence,
        what a vLLM engine is sized to: rollout.max_episode_length, else the model's positions, at least
        AGENT_CONTEXT), less rollout.max_response_length."""
        positions = getattr(self.host.actor.module.config, "max_position_embeddings", None) or 0  # a config may not say
        return max(1, longest_sequence(self.cfg, int(positions)) - self.cfg.rollout.max_response_length)

    def _render(self, messages: list, tools: list | None) -> str:
        tok = self.host.tokenizer
        if self.cfg.model.actor.model_name_or_path == BUILTIN_TINY:  # its template has no tools: they lead as a system message
            lead = [{"role": "system", "content": "Tools: " + json.dumps(tools, ensure_ascii=False)}] if tools else []
            return render_chat(tok, lead + messages, True)
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    def _generate(self, prompts: list, seeds: list, on_token: Callable | None = None) -> tuple[list, list]:
        """A batch of calls generated; `on_token` (the runner's, when it streams: `_streams`) given each step's tokens."""
        if on_token is not None:
            return self.live.generate(prompts, seeds, self.cfg, on_token)  # type: ignore[attr-defined]
        return self.live.result(self.live.submit(prompts, seeds, self.cfg))

    def _streams(self) -> bool:
        """Whether the engine generates here, step by step, so that a stream can go token by token: verlj's own
        sampler on the trainer's thread (rollout.engine=hf, sync). vLLM, and async mode's generator process,
        answer a stream whole once its call is generated."""
        from ..rollout import HFEngine

        return isinstance(self.live, HFEngine)

    def agent_samples(self, rows: list[int], played: list[Played], agent_seeds: list[int]) -> list[Sample]:
        """Each episode (of the dataset row `rows[k]`) as a sample: its longest consistent segment, its reward (the
        agent's, else rollout.reward_fn's on its last answer), its fault, its calls."""
        from ..gateway import ledger

        host = self.host
        out = []
        for k, p in enumerate(played):
            segs = ledger.segments(p.calls)
            seg = ledger.chosen(p.calls, segs) if segs else -1
            f = ledger.sample_fields(p.calls, segs[seg]) if segs else {
                "prompt_ids": host.prompt_ids[rows[k]], "response_ids": np.zeros(0, np.int64), "gen_logprobs": np.zeros(0, np.float32),
                "loss_mask": np.zeros(0, np.int8), "turn_lens": np.zeros(0, np.int64)}
            turns = len(segs[seg]) if segs else 0  # sample_fields: a turn per call of the segment
            rewards = np.full(turns, np.nan)
            if turns and p.reward is not None:
                rewards[-1] = p.reward
            out.append(Sample(index=rows[k], id=0, group=0, turn_rewards=rewards, env_seed=agent_seeds[k],
                              env_end=int(EnvEnd.FAULT if p.fault else EnvEnd.DONE), env_reason=p.fault,
                              agent_calls=AgentCalls(tuple(p.calls), seg, p.reward, len(segs)).to_json(), **f))
        self._rewards(out, played)
        return out

    def _rewards(self, samples: list[Sample], played: list[Played]) -> None:
        """score = rule_reward (the agent's reward, else rollout.reward_fn's of the last answer) + weight * the reward model's."""
        scorer, tok = self.host.scorer, self.host.tokenizer
        need = [k for k, p in enumerate(played) if p.reward is None and not p.fault]
        idx = list(range(len(samples))) if scorer.rm is not None else need
        last = [tok.decode(played[k].calls[-1].completion_ids, skip_special_tokens=True) if played[k].calls else "" for k in idx]
        rule, rm, faulted = scorer.rewards([int(samples[k].index) for k in idx], [samples[k].prompt_ids for k in idx],
                                           [samples[k].response_ids for k in idx], scored=last) if idx else ([], None, [])
        got = dict(zip(idx, zip(rule, faulted)))
        w = self.cfg.model.reward_model.weight
        for k, s in enumerate(samples):
            reward = played[k].reward
            if reward is not None:
                s.rule_reward = reward
            elif k in need:
                s.rule_reward, s.fault = got[k]
            if rm is not None:
                s.rm_score = rm[idx.index(k)]
            s.score = s.rule_reward + w * s.rm_score

    def close(self, at_once: bool = False) -> None:
        super().close(at_once)
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
            self.runner = None


class AgentRounds(AgentPlaying, StepOrder):
    """Step order with rollout.agent: each round's samples are agent episodes, played to their ends when the
    round is finished (sync: in the step's collect; async step order: after the update, from the version the
    generator held)."""

    def start_round(self, prod: Production) -> None:
        prod.handle = None  # the agents run (and call the engine) in round_samples

    def round_samples(self, prod: Production) -> list[Sample]:
        cfg, host = self.cfg, self.host
        runner, seed, n = self._runner(), cfg.trainer.seed, cfg.rollout.n
        rows = [row_of(host.dataset[int(i)]) for i in prod.mine for _ in range(n)]
        agent_seeds = [derive_seed(seed, prod.step, "rollout/agent", prod.rounds, q) for q in prod.places]
        step, rnd, places = prod.step, prod.rounds, prod.places

        def call_seed(place: int, k: int) -> int:
            return derive_seed(seed, step, "rollout/sample", rnd, places[place], *([k] if k else []))

        before = runner.counts.to_metrics()
        t0 = time.perf_counter()
        played = runner.play(rows, agent_seeds, call_seed)
        t1 = time.perf_counter()
        local = self.agent_samples([int(i) for i in prod.mine for _ in range(n)], played, agent_seeds)
        prod.gen_s += t1 - t0
        add_time(self.timings, "timing_s/reward", time.perf_counter() - t1)
        for name, v in runner.counts.to_metrics().items():
            add_time(self.timings, name, v - before[name])
        add_time(self.timings, "agent/prefix_breaks", float(sum(AgentCalls.from_json(s.agent_calls).prefix_breaks for s in local if s.agent_calls)))
        return local


class AgentSource(AgentRounds, SyncSource):
    """rollout.mode=sync with rollout.agent: each step's samples are agent episodes, played to their ends."""


class AgentPlannedSource(AgentRounds, PlannedSource):
    """rollout.mode=async, async_order=step with rollout.agent: the batch of step s+k played while (after) step s updates."""
