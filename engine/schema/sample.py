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
    version_runs   int32[]   the policy version of each response token, as runs of equal version: flat
                             (version, count) pairs (rollout.partial: a generation continued across weight
                             updates; :func:`version_runs`, :func:`token_versions`); policy_version is the
                             first run's, the oldest. Empty: every token is policy_version's
    env_states     str       an episode's env states (an env with a ``state()`` method: rl.envs.safe_states): one
                             JSON list, reset's state first, then one after each step the env answered, each
                             the dict state() returned (:func:`states_text`, :func:`state_texts`); "" for none

Samples travel columnar — padded arrays plus lengths (:func:`pack`, :func:`unpack`) — in journal
events, snapshots and between ranks: live training and replay both go through them, so the update
sees bit-identical inputs either way. The columns are a map ``{field: array, field_len: lengths}``
read and written here only; :class:`Columns` is the read-only view the rest of the engine uses. Each
column is declared once, on its Sample field (:func:`column`: its stored dtype, its part of the batch,
what a batch from before it reads as), and the tables above are made from those declarations.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any

import numpy as np

from .record import NOTHING, Record, stored

UNKNOWN_VERSION = -1  # policy_version of a sample journaled before the field existed (its step - 1: all were sync)
PAD = -1  # fills token-id rows past their length in the columnar form (log-probs: 0)
_EMPTY_F32 = np.zeros(0, np.float32)

# A column's part of the batch: in every batch; only in a batch where a sample is an episode; only in a
# batch where some sample's value (a text, a sequence) is not empty. Either way a batch without them keeps its bytes.
CORE, EPISODE, ANY = "core", "episode", "any"
_COLUMN = "verlj.column"  # the key of a Sample field's column in dataclasses.field(metadata=...)


@dataclass(frozen=True)
class Column:
    """A Sample field's column: its name, its dtype in the columnar form (a sequence of int32 is int64 in
    memory: the narrow form is the stored one), its part of the batch, and what a batch written before it
    existed reads as (`missing`)."""

    name: str
    dtype: Any  # str: a text column (a list of str)
    part: str
    kind: str  # "scalar", "sequence" (a padded 2-D array and its `_len`), "text"
    missing: Any = NOTHING

    def pack(self, out: dict, values: list) -> None:
        if self.kind == "text":
            out[self.name] = [str(x) for x in values]
        elif self.kind == "scalar":
            out[self.name] = np.array(values, dtype=self.dtype)
        else:
            lens = np.array([len(x) for x in values], dtype=np.int32)
            arr = np.full((len(values), int(lens.max()) if values else 0), PAD if self.dtype is np.int32 else 0, dtype=self.dtype)
            for i, x in enumerate(values):
                arr[i, : lens[i]] = x
            out[self.name] = arr
            out[self.name + "_len"] = lens

    def unpack(self, cols: dict, n: int) -> list:
        """The column's value for each of the batch's `n` samples, as a Sample holds it."""
        if self.kind == "text":
            return [str(x) for x in cols[self.name]]
        if self.kind == "scalar":
            if self.name not in cols:
                return [self.missing] * n
            cast = int if np.issubdtype(self.dtype, np.integer) else float
            return [cast(x) for x in cols[self.name].tolist()]
        memory = np.int64 if self.dtype is np.int32 else self.dtype
        arr, lens = cols[self.name], cols[self.name + "_len"]
        return [arr[i, : lens[i]].astype(memory) for i in range(n)]

    def readable(self, cols: dict) -> bool:
        return self.name in cols or self.missing is not NOTHING


def column(dtype: Any, part: str = CORE, missing: Any = NOTHING) -> dict[str, tuple]:
    """A Sample field's column, for ``dataclasses.field(metadata=...)`` (see :class:`Column`)."""
    return {_COLUMN: (dtype, part, missing)}


class EnvEnd(IntEnum):
    """How an episode ended (a sample's env_end): NONE is a single-turn sample, no env."""

    NONE = 0
    DONE = 1  # the env said done
    MAX_TURNS = 2  # rollout.max_turns actions taken
    FAULT = 3  # an env call raised, returned the wrong type or hung (env_reason says which)
    LENGTH = 4  # its context left no room for another action (rollout.max_episode_length)
    STOPPED = 5  # the policy's action was only its end-of-sequence token
    UNRESOLVED = 6  # rollout.tools: an external tool call's outcome is unknown after a crash and no reconcile told it (env_reason)


@dataclass(frozen=True)
class Turn:
    """One turn of an episode, as journaled: the action's tokens and generation log-probs, the
    observation's tokens, the env's reward (NaN: none)."""

    action_ids: np.ndarray
    action_logprobs: np.ndarray
    observation_ids: np.ndarray
    reward: float


@dataclass(slots=True, eq=False, kw_only=True)
class Sample:
    """One generated sample. Mutable while its step produces it (ids, rewards and reference
    log-probs are filled in as they become known); what is journaled is its packed form, whose columns
    its fields declare (:func:`column`), in the order they are packed."""

    id: int = field(default=-1, metadata=column(np.int64))
    index: int = field(metadata=column(np.int64))
    group: int = field(default=-1, metadata=column(np.int64))
    score: float = field(default=0.0, metadata=column(np.float64))
    rule_reward: float = field(default=0.0, metadata=column(np.float64))
    rm_score: float = field(default=0.0, metadata=column(np.float64))
    policy_version: int = field(default=UNKNOWN_VERSION, metadata=column(np.int64, missing=UNKNOWN_VERSION))
    prompt_ids: np.ndarray = field(metadata=column(np.int32))
    response_ids: np.ndarray = field(metadata=column(np.int32))
    gen_logprobs: np.ndarray = field(metadata=column(np.float32))
    ref_logprobs: np.ndarray = field(default_factory=lambda: _EMPTY_F32, metadata=column(np.float32))
    env_seed: int = field(default=0, metadata=column(np.int64, EPISODE))
    env_end: int = field(default=EnvEnd.NONE, metadata=column(np.int8, EPISODE))
    # empty: every response token is the policy's
    loss_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8), metadata=column(np.int8, EPISODE))
    turn_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), metadata=column(np.int32, EPISODE))
    turn_rewards: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64), metadata=column(np.float64, EPISODE))
    env_reason: str = field(default="", metadata=column(str, EPISODE))
    fault: str = field(default="", metadata=column(str, ANY))  # a fault of its scoring (reward function): the sample is out of the update
    agent_calls: str = field(default="", metadata=column(str, ANY))  # rollout.agent: the episode's calls as answered (schema.agent_calls's JSON)
    # rollout.partial: each response token's version as flat (version, count) pairs; empty: all policy_version's
    version_runs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), metadata=column(np.int32, ANY))
    env_states: str = field(default="", metadata=column(str, ANY))  # an env with state(): reset's, then each step's, as one JSON list

    @property
    def is_episode(self) -> bool:
        return self.env_end != EnvEnd.NONE

    @property
    def fault_reason(self) -> str:
        """Why a fault ended it ("" none): its env's fault or why it is unresolved (env_reason), else its scoring's (fault).
        A sample with one is never trained on (rl.faults)."""
        return self.env_reason if self.env_end in (EnvEnd.FAULT, EnvEnd.UNRESOLVED) else self.fault

    def policy_mask(self) -> np.ndarray:
        """Per response token, 1 where the policy generated it, 0 on observation tokens (float32)."""
        if not self.is_episode:
            return np.ones(len(self.response_ids), np.float32)
        return np.asarray(self.loss_mask, np.float32)

    def policy_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask)) if self.is_episode else len(self.response_ids)

    def token_versions(self) -> np.ndarray:
        """The policy version of each response token (int64): its runs expanded, or policy_version for every
        token when it has none (a generation never continued across an update)."""
        if not len(self.version_runs):
            return np.full(len(self.response_ids), self.policy_version, np.int64)
        return token_versions(self.version_runs)

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
        if name not in _BY_NAME:
            raise KeyError(name)
        return getattr(self, name)

    def same_as(self, other: Sample) -> bool:
        """Every field equal, bit for bit (NaN equals NaN, -0.0 differs from 0.0), at its journaled dtype
        (an episode's text only where one of the two is an episode)."""
        for c in COLUMNS:
            a, b = getattr(self, c.name), getattr(other, c.name)
            if c.kind == "text":
                if a != b and (c.part != EPISODE or self.is_episode or other.is_episode):
                    return False
                continue
            a, b = np.asarray(a, c.dtype), np.asarray(b, c.dtype)
            if a.shape != b.shape or a.tobytes() != b.tobytes():
                return False
        return True


def _columns() -> tuple[Column, ...]:
    types = typing.get_type_hints(Sample)
    out = []
    for f in fields(Sample):
        dtype, part, missing = f.metadata[_COLUMN]
        kind = "text" if dtype is str else "sequence" if types[f.name] is np.ndarray else "scalar"
        out.append(Column(f.name, dtype, part, kind, missing))
    return tuple(out)


COLUMNS = _columns()  # in the order they are packed
_BY_NAME = {c.name: c for c in COLUMNS}


def _dtypes(part: str, kind: str) -> dict[str, Any]:
    return {c.name: c.dtype for c in COLUMNS if c.part == part and c.kind == kind}


SCALARS = _dtypes(CORE, "scalar")
SEQUENCES = _dtypes(CORE, "sequence")
FIELDS = {**SCALARS, **SEQUENCES}
EPISODE_SCALARS = _dtypes(EPISODE, "scalar")
EPISODE_SEQUENCES = _dtypes(EPISODE, "sequence")
EPISODE_FIELDS = {**EPISODE_SCALARS, **EPISODE_SEQUENCES}
(EPISODE_TEXT,) = _dtypes(EPISODE, "text")  # env_reason
FAULT_TEXT, AGENT_TEXT, STATES_TEXT = _dtypes(ANY, "text")  # fault, agent_calls, env_states
PARTIAL_SEQUENCES = _dtypes(ANY, "sequence")  # version_runs (rollout.partial)
(RUNS,) = PARTIAL_SEQUENCES


def pack(samples: Iterable[Sample]) -> dict:
    """Samples as columns: each scalar field an array, each sequence field a padded 2-D array and
    `<field>_len` its lengths, each text a list of str; a part's columns only in a batch that has them
    (a single-turn batch's bytes are what they were before episodes, a batch without a fault's before faults)."""
    samples = list(samples)
    out: dict = {}
    episodes = any(s.is_episode for s in samples)
    for c in COLUMNS:
        values = [getattr(s, c.name) for s in samples]
        if (c.part == EPISODE and not episodes) or (c.part == ANY and not any(len(v) for v in values)):
            continue
        c.pack(out, values)
    return out


def unpack(cols: dict) -> list[Sample]:
    n = len(cols["id"])
    found = {c.name: c.unpack(cols, n) for c in COLUMNS if c.readable(cols)}
    names = tuple(found)
    return [Sample(**dict(zip(names, row))) for row in zip(*found.values())]


def state_text(state: dict) -> str:
    """One env state as the journal keeps it: canonical JSON (keys sorted, no spaces, NaN and infinities
    refused), so the same state is the same bytes. Raises TypeError or ValueError for one that is not JSON."""
    return json.dumps(state, sort_keys=True, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def states_text(texts: list[str]) -> str:
    """An episode's env_states from its states' texts (state_text), in order: one JSON list; "" for none."""
    return "[" + ",".join(texts) + "]" if texts else ""


def state_texts(env_states: str) -> list[str]:
    """The states' texts (state_text) an env_states holds, in order ([] for "")."""
    return [state_text(s) for s in json.loads(env_states)] if env_states else []


def version_runs(versions) -> np.ndarray:
    """Per-token policy versions as runs of equal version: flat (version, count) pairs, int64 (empty for no token)."""
    v = np.asarray(versions, np.int64)
    if not len(v):
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
    counts = np.diff(np.r_[starts, len(v)])
    return np.stack([v[starts], counts], axis=1).reshape(-1)


def token_versions(runs) -> np.ndarray:
    """The per-token versions a sample's runs (flat (version, count) pairs) stand for, int64."""
    pairs = np.asarray(runs, np.int64).reshape(-1, 2)
    return np.repeat(pairs[:, 0], pairs[:, 1])


def extend_runs(runs, version: int, count: int) -> np.ndarray:
    """Runs with `count` more tokens of `version` after them (merged into the last run when it is that version's)."""
    pairs = np.asarray(runs, np.int64).reshape(-1, 2)
    if count <= 0:
        return pairs.reshape(-1)
    if len(pairs) and pairs[-1, 0] == version:
        pairs = pairs.copy()
        pairs[-1, 1] += count
        return pairs.reshape(-1)
    return np.concatenate([pairs, [[version, count]]]).astype(np.int64).reshape(-1)


def runs_through(runs, version: int) -> np.ndarray:
    """The leading runs of versions up to `version` (what a resume holding `version` may keep of them)."""
    pairs = np.asarray(runs, np.int64).reshape(-1, 2)
    keep = 0
    while keep < len(pairs) and pairs[keep, 0] <= version:
        keep += 1
    return pairs[:keep].reshape(-1)


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
        arr = np.asarray(self.cols.get(name, np.zeros((self.n, 0))), SEQUENCES.get(name) or EPISODE_SEQUENCES.get(name) or PARTIAL_SEQUENCES[name])
        lens = np.asarray(self.cols.get(name + "_len", np.zeros(self.n)), np.int64)
        return arr, lens

    def samples(self) -> list[Sample]:
        return unpack(self.cols)


@dataclass(frozen=True)
class GroupInFlight(Record):
    """Completion order with rollout.env: one group's episodes between two commits, made durable after
    each of its turns (the journal's pending store, written by loop.ledger; rl.episodes plays them), so
    a resume brings them back from their last durable turn. One entry per episode of the group in
    each list, the fields an episode's Sample has (env_end NONE while it goes on); `row`: the dataset
    row of its prompt; `versions`: the policy version each of the group's turns was generated from
    (the first is the group's, for staleness)."""

    group: int
    row: int
    versions: list[int]
    prompt_ids: list[np.ndarray] = field(metadata=stored(dtype=np.int64))
    response_ids: list[np.ndarray] = field(metadata=stored(dtype=np.int64))
    gen_logprobs: list[np.ndarray] = field(metadata=stored(dtype=np.float32))
    loss_mask: list[np.ndarray] = field(metadata=stored(dtype=np.int8))
    turn_lens: list[np.ndarray] = field(metadata=stored(dtype=np.int64))
    turn_rewards: list[np.ndarray] = field(metadata=stored(dtype=np.float64))
    env_seed: list[int]
    env_end: list[int]
    env_reason: list[str]
    agent_calls: list[str] = field(default_factory=list)  # rollout.agent: each episode's calls so far (schema.agent_calls.AgentCalls.to_json)
    # an env with state(): each episode's states so far (its Sample's env_states); left out of the map when none has any
    env_states: list[str] = field(default_factory=list, metadata=stored(optional=True))

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
        states = []
        for k, lens in enumerate(self.turn_lens):
            pairs = np.asarray(lens, np.int64).reshape(-1, 2)
            text = self.env_states[k] if self.env_states else ""
            if len(pairs) <= turns:
                for name in cut:
                    cut[name].append(getattr(self, name)[k])
                states.append(text)
                continue
            states.append(states_text(state_texts(text)[: turns + 1]))  # reset's, then one a turn
            n = int(pairs[:turns].sum())
            cut["response_ids"].append(self.response_ids[k][:n])
            cut["gen_logprobs"].append(self.gen_logprobs[k][:n])
            cut["loss_mask"].append(self.loss_mask[k][:n])
            cut["turn_lens"].append(np.asarray(lens, np.int64)[: 2 * turns])
            cut["turn_rewards"].append(self.turn_rewards[k][:turns])
            cut["env_end"].append(int(EnvEnd.NONE))
            cut["env_reason"].append("")
        return GroupInFlight(self.group, self.row, self.versions[:turns], self.prompt_ids, cut["response_ids"], cut["gen_logprobs"],
                             cut["loss_mask"], cut["turn_lens"], cut["turn_rewards"], self.env_seed, cut["env_end"], cut["env_reason"],
                             env_states=states if any(states) else [])


@dataclass(frozen=True)
class GroupProgress(Record):
    """rollout.partial: one group's generation so far, as the generator stopped it at a weight update (its
    samples' tokens, log-probs and each token's policy version, as runs) and as it is made durable at that
    update (the journal's pending store, written by loop.ledger), so that a resume continues each of its
    samples from its last durable token. One entry per sample in each list; `row`: the dataset row of
    the group's prompt; `done`: the sample ended (end-of-sequence or rollout.max_response_length)."""

    group: int
    row: int
    responses: list[np.ndarray] = field(metadata=stored(dtype=np.int64))
    logprobs: list[np.ndarray] = field(metadata=stored(dtype=np.float32))
    runs: list[np.ndarray] = field(metadata=stored(dtype=np.int64))  # flat (version, count) pairs a sample
    done: list[bool]

    @property
    def tokens(self) -> int:
        """Its samples' tokens so far, in all."""
        return sum(len(r) for r in self.responses)

    @property
    def oldest(self) -> int | None:
        """The version of its oldest token (None: none generated yet)."""
        firsts = [int(r[0]) for r in self.runs if len(r)]
        return min(firsts) if firsts else None

    def through(self, version: int) -> GroupProgress:
        """The group as it stood with only its tokens of versions up to `version` (a resume holding that
        version keeps no token of a later one): a sample cut short is going again."""
        responses, logprobs, runs, done = [], [], [], []
        for r, lp, rn, d in zip(self.responses, self.logprobs, self.runs, self.done):
            kept = runs_through(rn, version)
            n = int(kept.reshape(-1, 2)[:, 1].sum())
            responses.append(r[:n])
            logprobs.append(lp[:n])
            runs.append(kept)
            done.append(d and n == len(r))
        return GroupProgress(self.group, self.row, responses, logprobs, runs, done)
