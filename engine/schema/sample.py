"""A generated sample: its one schema (:class:`Sample`) and its columnar form.

    id             int64     unique in the run, in order of generation
    index          int64     the dataset row of its prompt
    group          int64     the id of the first sample of its prompt's group (GRPO's n samples share it)
    score          float64   the reward the update uses: rule_reward + model.reward_model.weight * rm_score
    rule_reward    float64
    rm_score       float64
    policy_version int64     the policy that generated it: the step whose update produced the weights
                             (0 = the initial ones); a sync step s samples from version s-1. Journals
                             from before async rollout lack it: read as UNKNOWN_VERSION (their step - 1)
    prompt_ids     int32[]   (int64 in memory)
    response_ids   int32[]   (int64 in memory)
    gen_logprobs   float32[] per response token, as the rollout engine sampled it
    ref_logprobs   float32[] the reference model's, per response token (empty without a KL term)

An episode (rollout.env; rl.envs) has more: its response is every turn after the prompt, each turn's
action (the policy's tokens) then the observation the environment answered (tokenized, no special
tokens), and

    loss_mask      int8[]    per response token: 1 the policy's, 0 an observation's (gen_logprobs 0 there)
    turn_lens      int32[]   per turn: its action's length, its observation's length (2 a turn, flat)
    turn_rewards   float64[] per turn: the env's reward for that action (NaN: it gave none)
    env_seed       int64     the seed of the episode's env.reset(row, seed)
    env_end        int8      how it ended (EnvEnd): 1 done, 2 max_turns reached, 3 an env fault,
                             4 by length (rollout.max_episode_length), 5 an action that was only EOS
    env_reason     str       a fault's reason ("raised ValueError: ...", "no answer in 5.0 s"); "" else

A batch holds these columns only when one of its samples is an episode, so a single-turn run's
journal is byte for byte what it was before episodes existed. One more, for any sample, only when
one of the batch's samples has it (journals from before lack it: read as ""):

    fault          str       why the sample is out of the update besides an env fault: its reward
                             function raised or returned a non-finite number ("reward function m.f raised ...")
    agent_calls    str       an agent episode's token ledger (rollout.agent; schema.agent_calls): every model
                             call as answered, one JSON text carrying its own version ("" for any other sample)

Samples travel columnar — padded arrays plus lengths (:func:`pack`, :func:`unpack`) — in journal
events, snapshots and between ranks: live training and replay both go through them, so the update
sees bit-identical inputs either way. The columns are a map ``{field: array, field_len: lengths}``
read and written here only; :class:`Columns` is the read-only view the rest of the engine uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any

import numpy as np

SCALARS = {"id": np.int64, "index": np.int64, "group": np.int64, "score": np.float64, "rule_reward": np.float64, "rm_score": np.float64,
           "policy_version": np.int64}
UNKNOWN_VERSION = -1  # policy_version of a sample journaled before the field existed (its step - 1: all were sync)
SEQUENCES = {"prompt_ids": np.int32, "response_ids": np.int32, "gen_logprobs": np.float32, "ref_logprobs": np.float32}
FIELDS = {**SCALARS, **SEQUENCES}
EPISODE_SCALARS = {"env_seed": np.int64, "env_end": np.int8}
EPISODE_SEQUENCES = {"loss_mask": np.int8, "turn_lens": np.int32, "turn_rewards": np.float64}
EPISODE_TEXT = "env_reason"  # a list of str column
EPISODE_FIELDS = {**EPISODE_SCALARS, **EPISODE_SEQUENCES}
FAULT_TEXT = "fault"  # a list of str column, only in a batch where a sample has one
AGENT_TEXT = "agent_calls"  # a list of str column, only in a batch where a sample has one (rollout.agent)
PAD = -1  # fills token-id rows past their length in the columnar form (log-probs: 0)

_EMPTY_F32 = np.zeros(0, np.float32)


class EnvEnd(IntEnum):
    """How an episode ended (a sample's env_end): NONE is a single-turn sample, no env."""

    NONE = 0
    DONE = 1  # the env said done
    MAX_TURNS = 2  # rollout.max_turns actions taken
    FAULT = 3  # an env call raised, returned the wrong type or hung (env_reason says which)
    LENGTH = 4  # its context left no room for another action (rollout.max_episode_length)
    STOPPED = 5  # the policy's action was only its end-of-sequence token


@dataclass(frozen=True)
class Turn:
    """One turn of an episode, as journaled: the action's tokens and generation log-probs, the
    observation's tokens, the env's reward (NaN: none)."""

    action_ids: np.ndarray
    action_logprobs: np.ndarray
    observation_ids: np.ndarray
    reward: float


@dataclass(slots=True, eq=False)
class Sample:
    """One generated sample. Mutable while its step produces it (ids, rewards and reference
    log-probs are filled in as they become known); what is journaled is its packed form."""

    index: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    gen_logprobs: np.ndarray
    id: int = -1
    group: int = -1
    score: float = 0.0
    rule_reward: float = 0.0
    rm_score: float = 0.0
    policy_version: int = UNKNOWN_VERSION
    ref_logprobs: np.ndarray = field(default_factory=lambda: _EMPTY_F32)
    loss_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))  # empty: every response token is the policy's
    turn_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    turn_rewards: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    env_seed: int = 0
    env_end: int = EnvEnd.NONE
    env_reason: str = ""
    fault: str = ""  # a fault of its scoring (reward function): the sample is out of the update
    agent_calls: str = ""  # rollout.agent: the episode's calls as answered (schema.agent_calls's JSON)

    @property
    def is_episode(self) -> bool:
        return self.env_end != EnvEnd.NONE

    @property
    def fault_reason(self) -> str:
        """Why a fault ended it ("" none): its env's fault (env_reason), else its scoring's (fault).
        A sample with one is never trained on (rl.faults)."""
        return self.env_reason if self.env_end == EnvEnd.FAULT else self.fault

    def policy_mask(self) -> np.ndarray:
        """Per response token, 1 where the policy generated it, 0 on observation tokens (float32)."""
        if not self.is_episode:
            return np.ones(len(self.response_ids), np.float32)
        return np.asarray(self.loss_mask, np.float32)

    def policy_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask)) if self.is_episode else len(self.response_ids)

    def env_score(self) -> float:
        """The env's rewards summed over the episode (turns without one count 0)."""
        return float(np.nansum(np.asarray(self.turn_rewards, np.float64))) if len(self.turn_rewards) else 0.0

    def turns(self) -> list[Turn]:
        """The episode turn by turn (a single-turn sample: its response as one turn, reward NaN)."""
        if not self.is_episode:
            return [Turn(self.response_ids, self.gen_logprobs, self.response_ids[:0], float("nan"))]
        out, at = [], 0
        lens = np.asarray(self.turn_lens, np.int64).reshape(-1, 2)
        for t, (a, o) in enumerate(lens.tolist()):
            out.append(Turn(self.response_ids[at : at + a], self.gen_logprobs[at : at + a], self.response_ids[at + a : at + a + o],
                            float(self.turn_rewards[t])))
            at += a + o
        return out

    def __getitem__(self, name: str):
        """A field by name: `sample["score"]`, for user code written when samples were dicts (a probe's
        batch, a reward function's extra info). verlj's own code reads attributes."""
        if name not in FIELDS and name not in EPISODE_FIELDS and name not in (EPISODE_TEXT, FAULT_TEXT, AGENT_TEXT):
            raise KeyError(name)
        return getattr(self, name)

    def same_as(self, other: Sample) -> bool:
        """Every field equal, bit for bit (NaN equals NaN, -0.0 differs from 0.0), at its journaled dtype."""
        for name, dt in FIELDS.items():
            a, b = np.asarray(getattr(self, name), dt), np.asarray(getattr(other, name), dt)
            if a.shape != b.shape or a.tobytes() != b.tobytes():
                return False
        if ((self.is_episode or other.is_episode) and self.env_reason != other.env_reason) or self.fault != other.fault \
                or self.agent_calls != other.agent_calls:
            return False
        for name, dt in EPISODE_FIELDS.items():
            a, b = np.asarray(getattr(self, name), dt), np.asarray(getattr(other, name), dt)
            if a.shape != b.shape or a.tobytes() != b.tobytes():
                return False
        return True


assert {f.name for f in fields(Sample)} == set(FIELDS) | set(EPISODE_FIELDS) | {EPISODE_TEXT, FAULT_TEXT, AGENT_TEXT}, \
    "Sample and FIELDS, EPISODE_FIELDS must name the same fields"


def _pack_sequences(out: dict, samples: list[Sample], sequences: dict) -> None:
    n = len(samples)
    for k, dt in sequences.items():
        seqs = [getattr(s, k) for s in samples]
        lens = np.array([len(x) for x in seqs], dtype=np.int32)
        width = int(lens.max()) if n else 0
        arr = np.full((n, width), PAD if dt is np.int32 else 0, dtype=dt)
        for i, x in enumerate(seqs):
            arr[i, : lens[i]] = x
        out[k] = arr
        out[k + "_len"] = lens


def pack(samples: Iterable[Sample]) -> dict:
    """Samples as columns: each scalar field an array, each sequence field a padded 2-D array and
    `<field>_len` its lengths."""
    samples = list(samples)
    out: dict = {k: np.array([getattr(s, k) for s in samples], dtype=dt) for k, dt in SCALARS.items()}
    _pack_sequences(out, samples, SEQUENCES)
    if any(s.is_episode for s in samples):  # only then: a single-turn batch's bytes are what they always were
        out.update({k: np.array([int(getattr(s, k)) for s in samples], dtype=dt) for k, dt in EPISODE_SCALARS.items()})
        _pack_sequences(out, samples, EPISODE_SEQUENCES)
        out[EPISODE_TEXT] = [str(s.env_reason) for s in samples]
    if any(s.fault for s in samples):  # only then: a batch without one keeps its bytes
        out[FAULT_TEXT] = [str(s.fault) for s in samples]
    if any(s.agent_calls for s in samples):  # only then: a batch without an agent episode keeps its bytes
        out[AGENT_TEXT] = [str(s.agent_calls) for s in samples]
    return out


def unpack(cols: dict) -> list[Sample]:
    n = len(cols["id"])
    if "policy_version" not in cols:  # written before the field existed
        cols = {**cols, "policy_version": np.full(n, UNKNOWN_VERSION, np.int64)}
    scal = {k: cols[k].tolist() for k in SCALARS}
    episodes = "env_end" in cols
    out = []
    for i in range(n):
        seq = {k: cols[k][i, : cols[k + "_len"][i]].astype(np.int64 if dt is np.int32 else dt) for k, dt in SEQUENCES.items()}
        if episodes:
            seq.update({k: cols[k][i, : cols[k + "_len"][i]].astype(np.int64 if dt is np.int32 else dt) for k, dt in EPISODE_SEQUENCES.items()})
            seq.update({k: int(cols[k][i]) for k in EPISODE_SCALARS}, env_reason=str(cols[EPISODE_TEXT][i]))
        if FAULT_TEXT in cols:
            seq.update(fault=str(cols[FAULT_TEXT][i]))
        if AGENT_TEXT in cols:
            seq.update(agent_calls=str(cols[AGENT_TEXT][i]))
        fields_: dict[str, Any] = {k: (int(v[i]) if SCALARS[k] is np.int64 else float(v[i])) for k, v in scal.items()}
        out.append(Sample(**fields_, **seq))
    return out


@dataclass(frozen=True)
class Columns:
    """A packed batch of samples (a `buffer.add` event's `samples`, read only): its size, ids, any
    column as the journal holds it, and its sequences without padding."""

    cols: dict

    @property
    def n(self) -> int:
        return len(self.cols["id"]) if "id" in self.cols else 0

    @property
    def ids(self) -> np.ndarray:
        return np.asarray(self.cols["id"], np.int64) if "id" in self.cols else np.zeros(0, np.int64)

    def has(self, name: str) -> bool:
        return name in self.cols

    def scalar(self, name: str, default: np.ndarray | None = None) -> np.ndarray:
        """A scalar column (`default`, or zeros, when the journal lacks it)."""
        dt = SCALARS.get(name) or EPISODE_SCALARS[name]
        if name in self.cols:
            return np.asarray(self.cols[name], dt)
        return default if default is not None else np.zeros(self.n, dt)

    def text(self, name: str) -> list[str]:
        """A text column (env_reason) as str; empty strings when the journal lacks it."""
        return [str(x) for x in self.cols[name]] if name in self.cols else [""] * self.n

    def padded(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """A sequence column as (padded 2-D array, lengths); empty when the journal lacks it."""
        arr = np.asarray(self.cols.get(name, np.zeros((self.n, 0))), SEQUENCES.get(name) or EPISODE_SEQUENCES[name])
        lens = np.asarray(self.cols.get(name + "_len", np.zeros(self.n)), np.int64)
        return arr, lens

    def samples(self) -> list[Sample]:
        return unpack(self.cols)


@dataclass(frozen=True)
class GroupInFlight:
    """Completion order with rollout.env: one group's episodes between two commits, made durable after
    each of its turns (the journal's pending store, written by loop.ledger; rl.episodes plays them), so
    a resume brings them back from their last durable turn. One entry per episode of the group in
    each list, the fields an episode's Sample has (env_end NONE while it goes on); `row`: the dataset
    row of its prompt; `versions`: the policy version each of the group's turns was generated from
    (the first is the group's, for staleness)."""

    group: int
    row: int
    versions: list
    prompt_ids: list
    response_ids: list
    gen_logprobs: list
    loss_mask: list
    turn_lens: list
    turn_rewards: list
    env_seed: list
    env_end: list
    env_reason: list
    agent_calls: list = field(default_factory=list)  # rollout.agent: each episode's calls so far (schema.agent_calls.AgentCalls.to_json)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> GroupInFlight:
        seq = lambda name, dt: [np.asarray(x, dt) for x in d[name]]  # noqa: E731
        return cls(int(d["group"]), int(d["row"]), [int(v) for v in d["versions"]], seq("prompt_ids", np.int64), seq("response_ids", np.int64),
                   seq("gen_logprobs", np.float32), seq("loss_mask", np.int8), seq("turn_lens", np.int64), seq("turn_rewards", np.float64),
                   [int(x) for x in d["env_seed"]], [int(x) for x in d["env_end"]], [str(x) for x in d["env_reason"]],
                   [str(x) for x in d.get("agent_calls", [])])

    @property
    def turn(self) -> int:
        """The group's turns taken."""
        return len(self.versions)

    @property
    def live(self) -> int:
        """Its episodes still going."""
        return sum(e == EnvEnd.NONE for e in self.env_end)

    @property
    def turns_durable(self) -> int:
        """The turns its episodes have taken in all (what verify counts)."""
        return sum(len(t) // 2 for t in self.turn_lens)

    def before(self, turns: int) -> GroupInFlight | None:
        """The group as it stood after its first `turns` turns (None: before its first): an episode that
        ended later is going again."""
        if turns >= self.turn:
            return self
        if turns <= 0:
            return None
        cut: dict[str, list] = {k: [] for k in ("response_ids", "gen_logprobs", "loss_mask", "turn_lens", "turn_rewards", "env_end", "env_reason")}
        for k, lens in enumerate(self.turn_lens):
            pairs = np.asarray(lens, np.int64).reshape(-1, 2)
            if len(pairs) <= turns:
                for name in cut:
                    cut[name].append(getattr(self, name)[k])
                continue
            n = int(pairs[:turns].sum())
            cut["response_ids"].append(self.response_ids[k][:n])
            cut["gen_logprobs"].append(self.gen_logprobs[k][:n])
            cut["loss_mask"].append(self.loss_mask[k][:n])
            cut["turn_lens"].append(np.asarray(lens, np.int64)[: 2 * turns])
            cut["turn_rewards"].append(self.turn_rewards[k][:turns])
            cut["env_end"].append(int(EnvEnd.NONE))
            cut["env_reason"].append("")
        return GroupInFlight(self.group, self.row, self.versions[:turns], self.prompt_ids, cut["response_ids"], cut["gen_logprobs"],
                             cut["loss_mask"], cut["turn_lens"], cut["turn_rewards"], self.env_seed, cut["env_end"], cut["env_reason"])
