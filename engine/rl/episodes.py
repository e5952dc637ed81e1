"""Multi-turn episodes in the rollout: a round's episodes, played turn by turn against their envs.

The trainer drives the turns through the rollout engine's own API (``submit`` / ``result``): turn t of
every episode of a round still going is generated together, the prompts being each episode's context so
far (its prompt ids, then every action and observation), so every engine (hf, vllm, the async
generator) plays episodes unchanged. Between turns (:meth:`Round.take`): each action is decoded,
given to its env (``safe_steps``: every episode's at once, one rollout.env_timeout_s for them all),
and the observation tokenized (no special tokens; at most rollout.max_observation_length tokens,
marked TRUNCATED when cut) and appended. An episode ends when its env says done, at rollout.max_turns
actions, at a fault (an env call that raised, returned none of the forms or hung: rl.envs.EnvFault),
whose reason is journaled with the sample (env_reason; rl.faults leaves it out of the update), by
length (no room left under rollout.max_episode_length for another action), or when the policy's
action is only its end-of-sequence token (:class:`Limits`). An env with a ``state()`` method is asked it after
its reset and after each step it answered (``safe_states``, all at once), the states kept with the episode
(its sample's env_states); a state's fault is the episode's (``state raised ...``).

Seeds, all from the sample's place in its step (round r, place q; ``sources.batches.Batches.submit_round``):
turn 0's generation uses the sample's seed of a single-turn run, ``derive_seed(seed, step,
"rollout/sample", r, q)``; turn t > 0's ``derive_seed(seed, step, "rollout/sample", r, q, t)``; the
env's ``reset(row, seed)`` gets ``derive_seed(seed, step, "rollout/env", r, q)``. Replay never plays
an episode: it reads the journaled turns (schema.sample) like any sample.

Completion order (rollout.async_order=completion) plays each group of episodes on its own: a group's
turn is asked of the generator (its live episodes' contexts, each with its own seed:
``derive_seed(seed, 0, "rollout/group", g, j)`` for turn 0, as a single-turn group's sample j, then
``derive_seed(seed, 0, "rollout/group", g, j, t)``; the env's ``derive_seed(seed, 0, "rollout/env", g, j)``),
and when it arrives the trainer steps the envs and makes the group durable as it stands
(:meth:`Round.state`, the journal's pending store) before it asks the next turn. After a crash, a
group still asked resumes from its last durable turn (:meth:`Round.restored`): a fresh env per
episode still going, reset on its row and seed, its journaled actions re-applied in order (the only
env calls made twice, on a fresh env; its states are the durable ones, never asked again), and its next
turn generated from its own seed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..schema.sample import EnvEnd, GroupInFlight, state_texts, states_text
from ..state.seeding import derive_seed
from .envs import EnvFactory, EnvFault, has_state, safe_reset, safe_resets, safe_states, safe_step, safe_steps
from .trl_envs import Prompt


@dataclass
class Episode:
    """One episode being played: its env (None once ended), its context and its turns so far."""

    env: object
    prompt_ids: np.ndarray  # the dataset prompt's ids, then reset's observation's (the sample's prompt_ids)
    env_seed: int
    response: list = field(default_factory=list)  # token ids after the prompt: actions and observations
    logprobs: list = field(default_factory=list)  # per response token (0.0 on observation tokens)
    mask: list = field(default_factory=list)  # per response token: 1 the policy's, 0 an observation's
    turn_lens: list = field(default_factory=list)  # flat (action length, observation length) per turn
    turn_rewards: list = field(default_factory=list)
    end: int = EnvEnd.NONE
    reason: str = ""
    last_action: str = ""  # the last action's text (what rollout.reward_fn scores, when it is named)
    states: list[str] | None = None  # an env with state(): reset's, then one after each step it answered (JSON texts); None: none kept

    @property
    def live(self) -> bool:
        return self.end == EnvEnd.NONE

    def context(self) -> np.ndarray:
        return np.concatenate([self.prompt_ids, np.asarray(self.response, np.int64)])

    def stop(self, end: EnvEnd, reason: str = "") -> None:
        self.end, self.reason, self.env = int(end), reason, None

    def actions(self, tokenizer) -> list[str]:
        """Each turn's action, as text (what the env was given)."""
        out, at, ids = [], 0, np.asarray(self.response, np.int64)
        for a, o in np.asarray(self.turn_lens, np.int64).reshape(-1, 2).tolist():
            out.append(tokenizer.decode(ids[at : at + a], skip_special_tokens=True))
            at += a + o
        return out


@dataclass(frozen=True)
class Limits:
    """What bounds an episode (rollout.*): its actions, each env call's wait, an observation's tokens
    (0: no cap), its context's tokens (0: no cap) and the room the next action needs
    (rollout.max_response_length)."""

    max_turns: int
    timeout_s: float
    max_observation: int = 0
    max_length: int = 0
    max_action: int = 0

    @classmethod
    def of(cls, rollout) -> Limits:
        """The limits a RolloutConfig sets."""
        return cls(rollout.max_turns, rollout.env_timeout_s, rollout.max_observation_length or 0, rollout.max_episode_length or 0,
                   rollout.max_response_length)


AGENT_CONTEXT = 2048  # an agent call's context at least, where rollout.max_episode_length does not say (the built-in model's positions state only the single-turn bound)


def longest_sequence(cfg, positions: int) -> int:
    """The most tokens one generation holds, prompt and response (what a vLLM engine is sized to): a prompt
    and its response; with rollout.env, an episode's context and its next action: at most
    rollout.max_episode_length (the first action after the reset's observation aside), or else the prompt
    and max_turns actions and observations of at most rollout.max_observation_length tokens each (no cap:
    the model's `positions`); with rollout.agent, a call's conversation: rollout.max_episode_length, else
    the model's `positions` (at least AGENT_CONTEXT)."""
    ro, prompt = cfg.rollout, cfg.data.max_prompt_length
    single = prompt + ro.max_response_length
    if ro.agent is not None:  # an agent's call: its conversation so far (template, tools) and the answer
        return max(ro.max_episode_length or max(positions, AGENT_CONTEXT), single)
    if ro.env is None:
        return single
    if ro.max_episode_length:
        return max(ro.max_episode_length, single + ro.max_observation_length)
    if not ro.max_observation_length:
        return max(positions, single)
    return prompt + ro.max_turns * (ro.max_response_length + ro.max_observation_length)


TRUNCATED = " [truncated]"  # ends an observation cut to rollout.max_observation_length tokens
_CHARS_PER_TOKEN = 32  # an observation's text is cut to this many characters a token before it is tokenized (memory)


_WARNED: list[str] = []  # an observation the vocabulary could not spell, said once a process


def _warn_unknown(tok, text: str, ids: np.ndarray) -> None:
    """One [WARNING] line (rank 0, once a process) when an observation's text holds characters the
    tokenizer has no token for: the policy would read <unk> where the environment wrote words, and
    train on nothing while the log looks healthy (the built-in model's digits vocabulary and a text env)."""
    unk = getattr(tok, "unk_token_id", None)
    if _WARNED or unk is None or not np.any(ids == unk):
        return
    _WARNED.append(text)
    if os.environ.get("RANK", "0") == "0":
        print(f"[WARNING] rollout.env's observation {text[:60]!r} holds characters the model's vocabulary has no token for: "
              "the policy reads <unk> there (with the built-in model, model.tiny.vocab=ascii spells any printable text)",
              file=sys.stderr, flush=True)


class Round:
    """A round's episodes (this rank's samples of it, in order): reset, then one `take` per turn."""

    def __init__(self, factory: EnvFactory, rows: list[dict], env_seeds: list[int], prompts: list[np.ndarray], tokenizer,
                 limits: Limits):
        self.tok, self.limits, self.max_turns, self.timeout_s = tokenizer, limits, limits.max_turns, limits.timeout_s
        self.turn = 0
        self.episodes: list[Episode] = []
        envs = [factory() for _ in rows]
        firsts = safe_resets(list(zip(envs, rows, env_seeds)), limits.timeout_s)  # concurrently: a hang costs one timeout
        for env, first, seed, prompt in zip(envs, firsts, env_seeds, prompts):
            ep = Episode(env, np.asarray(prompt, np.int64), int(seed))
            if isinstance(first, EnvFault):
                ep.stop(EnvEnd.FAULT, f"reset {first.reason}")  # no action is asked of it: an episode of no turn
            elif isinstance(first, Prompt):  # the episode's whole prompt (a TRL class's: rl.trl_envs)
                ep.prompt_ids = self._prompt(first)
            elif first:
                ep.prompt_ids = np.concatenate([ep.prompt_ids, self._observation(first)])
            if ep.live and has_state(env):
                ep.states = []
            self.episodes.append(ep)
        self._states([(ep, ep.env) for ep in self.episodes if ep.live])

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok(text, add_special_tokens=False).input_ids, np.int64)

    def _prompt(self, text: str) -> np.ndarray:
        """A prompt's ids, as the trainer encodes a dataset's chat prompt: <bos> first unless the text writes its own."""
        ids = self._encode(text)
        bos = self.tok.bos_token_id
        if bos is not None and not (self.tok.bos_token and text.startswith(self.tok.bos_token)):
            ids = np.concatenate([np.asarray([bos], np.int64), ids])
        return ids

    def _observation(self, text: str) -> np.ndarray:
        """An observation's tokens, at most limits.max_observation: a longer one is cut, its end marked TRUNCATED."""
        _warn_unknown(self.tok, text, self._encode(text[:256]))
        cap = self.limits.max_observation
        if not cap:
            return self._encode(text)
        ids = self._encode(text[: cap * _CHARS_PER_TOKEN])
        if len(ids) <= cap and len(text) <= cap * _CHARS_PER_TOKEN:
            return ids
        mark = self._encode(TRUNCATED)
        return np.concatenate([ids[: cap - len(mark)], mark]) if cap > len(mark) else ids[:cap]

    def _only_eos(self, resp: np.ndarray) -> bool:
        eos = getattr(self.tok, "eos_token_id", None)
        return eos is not None and len(resp) > 0 and bool(np.all(resp == eos))

    def first_prompts(self) -> list[np.ndarray]:
        return [ep.prompt_ids for ep in self.episodes]

    def live(self) -> list[int]:
        """The episodes still going (their places in the round), once the turns so far are taken."""
        return [i for i, ep in enumerate(self.episodes) if ep.live]

    def take(self, places: list[int], responses: list[np.ndarray], logps: list[np.ndarray]) -> None:
        """Turn `self.turn`'s actions of the episodes at `places`: each stepped through its env (all at
        once: safe_steps), its observation appended; the turn counter moves on. An action that is only
        the end-of-sequence token ends its episode (STOPPED) without a step; one whose context leaves no
        room for another action ends it by length (LENGTH: rollout.max_episode_length)."""
        self.turn += 1
        stepped = []
        for i, resp, lp in zip(places, responses, logps):
            ep = self.episodes[i]
            resp, lp = np.asarray(resp, np.int64), np.asarray(lp, np.float32)
            ep.response += resp.tolist()
            ep.logprobs += lp.tolist()
            ep.mask += [1] * len(resp)
            ep.last_action = self.tok.decode(resp, skip_special_tokens=True)
            if not ep.live or self._only_eos(resp):  # over already (no env to ask), or it stopped
                ep.turn_lens += [len(resp), 0]
                ep.turn_rewards.append(float("nan"))
                if ep.live:
                    ep.stop(EnvEnd.STOPPED)
                continue
            stepped.append(i)
        envs = [self.episodes[i].env for i in stepped]  # the last step may end an episode (its env dropped): its state is asked still
        answers = safe_steps([(env, self.episodes[i].last_action) for i, env in zip(stepped, envs)], self.timeout_s)
        for i, got in zip(stepped, answers):
            self._answer(self.episodes[i], got)
        self._states([(self.episodes[i], env) for i, env, got in zip(stepped, envs, answers) if not isinstance(got, EnvFault)])

    def _states(self, answered: list[tuple[Episode, object]]) -> None:
        """The state() of each (episode, env) of `answered` (its reset or step answered) whose env has one, all at
        once (safe_states), kept in its states; a state's fault ends the episode (``state raised ...``): its last
        turn keeps the step's observation and reward, and no state."""
        asked = [(ep, env) for ep, env in answered if ep.states is not None]
        for (ep, _), got in zip(asked, safe_states([env for _, env in asked], self.timeout_s)):
            if isinstance(got, EnvFault):
                ep.stop(EnvEnd.FAULT, f"state {got.reason}")
            else:
                assert ep.states is not None
                ep.states.append(got)

    def _answer(self, ep: Episode, got) -> None:
        """What the env answered the episode's last action (already appended): its observation, reward and end."""
        n = len(ep.response) - sum(ep.turn_lens)  # the action's tokens
        if isinstance(got, EnvFault):
            ep.turn_lens += [n, 0]
            ep.turn_rewards.append(float("nan"))
            ep.stop(EnvEnd.FAULT, f"step {got.reason}")
            return
        obs = self._observation(got.observation) if got.observation else np.zeros(0, np.int64)
        lim = self.limits
        room = lim.max_length - len(ep.prompt_ids) - len(ep.response) if lim.max_length else len(obs)
        obs = obs[: max(0, room)]
        ep.response += obs.tolist()
        ep.logprobs += [0.0] * len(obs)
        ep.mask += [0] * len(obs)
        ep.turn_lens += [n, len(obs)]
        ep.turn_rewards.append(float("nan") if got.reward is None else float(got.reward))
        if got.done:
            ep.stop(EnvEnd.DONE)
        elif self.turn >= self.max_turns:
            ep.stop(EnvEnd.MAX_TURNS)
        elif lim.max_length and len(ep.prompt_ids) + len(ep.response) + max(1, lim.max_action) > lim.max_length:
            ep.stop(EnvEnd.LENGTH)

    def done(self) -> bool:
        return self.turn >= self.max_turns or not self.live()

    def fields(self, i: int) -> dict:
        """The episode at place `i` as Sample fields (every turn taken)."""
        ep = self.episodes[i]
        return {"prompt_ids": ep.prompt_ids, "response_ids": np.asarray(ep.response, np.int64),
                "gen_logprobs": np.asarray(ep.logprobs, np.float32), "loss_mask": np.asarray(ep.mask, np.int8),
                "turn_lens": np.asarray(ep.turn_lens, np.int64), "turn_rewards": np.asarray(ep.turn_rewards, np.float64),
                "env_seed": ep.env_seed, "env_end": ep.end if not ep.live else int(EnvEnd.MAX_TURNS), "env_reason": ep.reason,
                "env_states": states_text(ep.states or [])}

    def state(self, group: int, row: int, versions: list[int]) -> GroupInFlight:
        """Its episodes as they stand, every turn taken so far (what completion order makes durable);
        `row`: the dataset row of its prompt; `versions`: each turn's policy version."""
        eps = self.episodes
        return GroupInFlight(group, row, list(versions), [ep.prompt_ids for ep in eps], [np.asarray(ep.response, np.int64) for ep in eps],
                             [np.asarray(ep.logprobs, np.float32) for ep in eps], [np.asarray(ep.mask, np.int8) for ep in eps],
                             [np.asarray(ep.turn_lens, np.int64) for ep in eps], [np.asarray(ep.turn_rewards, np.float64) for ep in eps],
                             [ep.env_seed for ep in eps], [int(ep.end) for ep in eps], [ep.reason for ep in eps],
                             env_states=[states_text(ep.states or []) for ep in eps] if any(ep.states for ep in eps) else [])

    @classmethod
    def restored(cls, factory: EnvFactory, rows: list[dict], state: GroupInFlight, tokenizer, limits: Limits) -> tuple[Round, int]:
        """The round as `state` left it, and the env steps re-applied to bring it back: each episode still
        going gets a fresh env, reset on its row and seed, with its durable actions stepped in order.
        What the env answers now is not used (it need not be deterministic): the durable observations
        (and states) are the episode's; state() is not asked on the way. An env that faults on the way ends its episode (reason ``restore: ...``)."""
        self, timeout_s, replayed = cls.of_states([state], tokenizer, limits), limits.timeout_s, 0
        for ep, row in zip(self.episodes, rows):
            actions = ep.actions(tokenizer)
            if ep.live:
                env = factory()
                first = safe_reset(env, row, ep.env_seed, timeout_s)
                if isinstance(first, EnvFault):
                    ep.stop(EnvEnd.FAULT, f"restore: reset {first.reason}")
                ep.env = env if ep.live else None
                for action in actions if ep.live else []:
                    replayed += 1
                    got = safe_step(env, action, timeout_s)
                    if isinstance(got, EnvFault):
                        ep.stop(EnvEnd.FAULT, f"restore: step {got.reason}")
                        break
        return self, replayed

    @classmethod
    def of_states(cls, states: list[GroupInFlight], tokenizer, limits: Limits) -> Round:
        """The round the groups' `states` hold (their episodes in order), without envs: what scoring and
        the next ask read of groups whose envs live elsewhere (a fleet's actors: :func:`play_group`)."""
        self = cls.__new__(cls)
        self.tok, self.limits, self.max_turns, self.timeout_s = tokenizer, limits, limits.max_turns, limits.timeout_s
        self.turn = max((st.turn for st in states), default=0)
        self.episodes = []
        for st, k in [(g, k) for g in states for k in range(len(g.prompt_ids))]:
            ep = Episode(None, st.prompt_ids[k], st.env_seed[k], st.response_ids[k].tolist(), st.gen_logprobs[k].tolist(),
                         st.loss_mask[k].tolist(), st.turn_lens[k].tolist(), st.turn_rewards[k].tolist(), st.env_end[k], st.env_reason[k],
                         states=state_texts(st.env_states[k]) if st.env_states and st.env_states[k] else None)
            actions = ep.actions(tokenizer)
            ep.last_action = actions[-1] if actions else ""
            self.episodes.append(ep)
        return self

    def env_score(self, i: int) -> float:
        r = np.asarray(self.episodes[i].turn_rewards, np.float64)
        return float(np.nansum(r)) if len(r) else 0.0


@dataclass
class Play:
    """Completion order: one group's episodes being played, held by the rank that asked for them."""

    round: Round
    row: int  # the dataset row of the group's prompt
    versions: list = field(default_factory=list)  # the policy version of each turn taken
    places: list = field(default_factory=list)  # the episodes whose turn is asked now
    work: GroupWork | None = None  # on a fleet: what its actors are given each turn (the envs live there)
    asked_at: int = 0  # the policy version the trainer held when it began: a group whose every reset faulted took no turn

    @property
    def version(self) -> int:
        """The group's policy version (its samples'): its first turn's, or, with none taken, the one it began at."""
        return self.versions[0] if self.versions else self.asked_at

    def state(self, group: int) -> GroupInFlight:
        return self.round.state(group, self.row, self.versions)

    def asking(self, places: list[int]) -> list[int]:
        """Its next turn is asked for the episodes at `places` (its live ones)."""
        self.places = places
        return places

    def took(self, responses: list, logps: list, version: int) -> None:
        """The turn asked came back (generated by policy `version`): the episodes' envs stepped (Round.take)."""
        self.round.take(self.places, responses, logps)
        self.versions.append(version)

    def took_remote(self, state: GroupInFlight, tokenizer, limits: Limits) -> None:
        """On a fleet: the group as its actor's envs left it after the turn."""
        self.round, self.versions = Round.of_states([state], tokenizer, limits), list(state.versions)

    def next_work(self, group: int) -> GroupWork:
        """On a fleet: what its actor is given for the next turn (from its resets, or from its state as it stands)."""
        assert self.work is not None, "a group played on a fleet has its work"
        self.work.state = self.state(group).to_dict() if self.round.turn > 0 else None
        return self.work


Generate = Callable[[list[np.ndarray], list[int]], tuple[list[np.ndarray], list[np.ndarray]]]


def play_lockstep(rnd: Round, generate: Generate, seed_of: Callable[[int, int], int], all_done: Callable[[bool], bool],
                  turn0: tuple[list[np.ndarray], list[np.ndarray]] | None = None) -> None:
    """Play `rnd`'s episodes to their ends, in lockstep: turn t of every episode still going generated together, each
    from its context so far and its own seed (`seed_of(place, t)`), then every env stepped (Round.take). `turn0`: the
    first turn's responses and log-probs when they were generated already (asked beside the trainer), for the
    episodes the resets left going (a stand-in's when none). Collective (`all_done`: every rank's episodes over): a
    rank whose episodes are over while another's are not generates a stand-in with it (ZeRO-3's gathers, TP) and
    keeps nothing. The one loop for the rollout's rounds (sources.env_players) and the held-out eval (rl.evaluation)."""
    places = rnd.live()  # a reset that faulted: no action is asked of it
    if turn0 is not None:
        responses, logps = turn0 if places else ([], [])
    else:
        responses, logps = _turn(rnd, places, generate, seed_of)
    while True:
        rnd.take(places, responses, logps)
        if all_done(rnd.done()):
            return
        places = [] if rnd.done() else rnd.live()
        responses, logps = _turn(rnd, places, generate, seed_of)


def _turn(rnd: Round, places: list[int], generate: Generate, seed_of: Callable[[int, int], int]) -> tuple[list, list]:
    """The turn's actions of the episodes at `places` (none: a stand-in generated with the other ranks, kept nowhere)."""
    if not places:
        generate([rnd.episodes[0].context()], [0])
        return [], []
    return generate([rnd.episodes[i].context() for i in places], [seed_of(i, rnd.turn) for i in places])


@dataclass
class GroupWork:
    """A group's episodes to play where their envs live beside generation (a fleet's actor:
    :func:`play_group`), as the trainer asks for them: from their resets or from the state they last
    stood in durable, for `turns` turns (step order: rollout.max_turns, to their ends; completion
    order: one, made durable by the trainer before the next is asked)."""

    group: int
    row: int  # the dataset row of its prompt
    rows: list  # that row as an env's reset gets it (rl.envs.row_of), once per episode
    prompts: list  # each episode's prompt ids
    env_seeds: list
    seeds: list  # each episode's turn-0 generation seed as derive_seed's arguments; turn t > 0 appends t
    limits: Limits
    turns: int
    state: dict | None = None  # GroupInFlight.to_dict() as it last stood durable; None: from its resets


def play_group(work: GroupWork, factory: EnvFactory, tokenizer, generate: Generate, version: int, held: dict[int, Round]) -> dict:
    """Play `work` beside generation: its envs reset (no state), or brought back from its state (a fresh
    env each, its actions re-applied: Round.restored) unless `held` has its round at that turn already
    (this actor played its last turn); then `work.turns` turns, each live episode's action generated
    by `generate` from its own seed, its env stepped. Returns the group's state after them
    (GroupInFlight.to_dict(), each turn's version `version`); a round not over stays in `held`."""
    state = GroupInFlight.from_dict(work.state) if work.state is not None else None
    rnd = held.pop(work.group, None)
    if state is None:
        rnd = Round(factory, work.rows, work.env_seeds, work.prompts, tokenizer, work.limits)
    elif rnd is None or rnd.turn != state.turn:
        rnd, _ = Round.restored(factory, work.rows, state, tokenizer, work.limits)
    versions = list(state.versions) if state is not None else []
    for _ in range(work.turns):
        if rnd.done():  # at turn 0 too: every reset faulted (no action is asked after one)
            break
        places = rnd.live()
        seeds = [derive_seed(*work.seeds[j], *([rnd.turn] if rnd.turn else [])) for j in places]
        responses, logps = generate([rnd.episodes[j].context() for j in places], seeds)
        rnd.take(places, list(responses), list(logps))
        versions.append(int(version))
    if not rnd.done():
        held[work.group] = rnd
    return rnd.state(work.group, work.row, versions).to_dict()
