"""What a rollout source and its player say to each other: the parts a player is made with (:class:`Parts`), the
small context it gets per call (:class:`RoundCall` in step order, :class:`GroupCall` in completion order), what it
returns (:class:`Made`), and the two player protocols (:class:`RoundPlayer`, :class:`GroupPlayer`).

A player makes samples: single-turn responses (``sources.single``), an environment's episodes (``sources.env_players``),
agent programs' episodes (``sources.agent_players``, ``sources.agent_groups``). It is made once, by the assembly
(``sources.make_source``), with what it needs; each call brings what changes from call to call (the step, the engine,
the policy version, the round's rows and places) and returns the samples, the metrics the call adds to the step's and
the seconds the trainer waited on generation. It reads and writes nothing of its owner's or the trainer's: what it makes
durable goes to the durable log it was made with (:class:`InFlightLog`), and only there. This module imports no
player and no source: they all import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...config import Config
from ...schema.sample import GroupInFlight, GroupProgress, Sample

if TYPE_CHECKING:
    from ...dist import Runtime
    from ..buffer import RolloutBuffer
    from ..data import Example, Sampler
    from ..envs import EnvFactory
    from ..rollout import RolloutEngine
    from ..scoring import Scorer
    from ..workers import ActorWorker


class InFlightLog(Protocol):
    """Where completion order makes what is in flight durable between commits: groups of episodes after each turn,
    agent calls as they are answered, generations a push stopped (loop.run makes one over the run's journal). Every
    call is collective: rank 0 reads and writes."""

    def keep_in_flight(self, groups: list[GroupInFlight], settled: list[int], calls: list | None = None, dropped: list | None = None,
                       tools: list | None = None, dropped_tools: list | None = None) -> None:
        """Make `groups` durable as they stand; forget the groups in `settled` (in a committed step) with their calls.
        rollout.agent: add `calls` (group, episode, position, the call's dict), each under its own key; forget `dropped`
        (group, episode, position). `read_in_flight` gives an agent group's calls back in its `agent_calls`. rollout.tools:
        `tools` and `dropped_tools` likewise, for tool calls (step order: the episode's id as its group, episode 0)."""

    def read_tools(self) -> dict[int, list[dict]]:
        """rollout.tools in step order: each episode's durable tool calls (schema.agent_calls.ToolCall's dicts), by its id."""

    def run_token(self) -> str:
        """What names this run in a tool call's idempotency key: the same for every process of the run, another run's
        another."""

    def read_in_flight(self) -> dict[int, GroupInFlight]:
        """The groups made durable and not forgotten, by group id."""

    def keep_stopped(self, groups: list[GroupProgress], settled: list[int]) -> None:
        """rollout.partial: make `groups` durable as they stand; forget the groups in `settled`."""

    def read_stopped(self) -> dict[int, GroupProgress]:
        """rollout.partial: the groups made durable mid-generation and not forgotten, by group id."""

    def attempt(self, step: int) -> int:
        """How many processes of this run have begun live step `step`, this one included (the run's lineage:
        loop.records.attempt_at): what an agent episode is told of its attempt."""


@dataclass(frozen=True)
class Parts:
    """What the rollout is made of, given by the trainer when the rollout is assembled: the config in force (a process's
    live steps run under one), the ranks, the tokenizer, the dataset and its prompts' ids, the rollout buffer and the
    sampler (the source's), the scorer, the actor (what the engine generates from; its positions), rollout.env's factory
    (made at its first use) and the durable log (None: nothing is made durable between commits). A player takes what it
    needs of them when it is made (its `of`)."""

    cfg: Config
    rt: Runtime
    tokenizer: Any
    dataset: list[Example]
    prompt_ids: list[np.ndarray]
    buffer: RolloutBuffer
    sampler: Sampler
    scorer: Scorer
    actor: ActorWorker
    envs: Callable[[], EnvFactory]
    durable: InFlightLog | None = None


@dataclass
class Made:
    """What a player returns of a call: the samples over (this rank's, or every rank's where the call gathers them),
    the seconds the trainer spent generating or waiting for it, and what the call adds to the step's metrics (summed
    with what the step has under the same name)."""

    samples: list[Sample] = field(default_factory=list)
    gen_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundCall:
    """Step order: one round of a step's batch on this rank. The step that trains on it (its samples' seeds are their
    places in that step), the round's index in it, the policy version generating it, the engine, this rank's dataset
    rows (`mine`, each rollout.n times in `prompts`), each sample's place in the round (its seed's), and the id its
    round's first sample gets (an agent episode is named by the sample it becomes)."""

    step: int
    round: int
    version: int
    engine: RolloutEngine
    mine: np.ndarray
    prompts: list[np.ndarray]
    places: list[int]
    first_id: int


class RoundPlayer(Protocol):
    """Step order's player: makes a round's samples on this rank."""

    def start(self, call: RoundCall) -> object:
        """Begin the round's samples (episodes: their resets and first turns), each from its place's seed. Returns what
        the round holds while it generates (handed back to `samples`)."""

    def samples(self, call: RoundCall, started: object) -> Made:
        """The round on this rank, waited for (its episodes played) and scored. Collective."""

    def close(self) -> None:
        """Release what the player holds (a gateway)."""


@dataclass(frozen=True)
class GroupCall:
    """Completion order: what one call on the groups asked needs of the step. The live step being collected, the policy
    version the trainer holds (the last step trained), the engine, the buffer's groups asked and not arrived (group ->
    its dataset row) and the id the buffer gives next (a group asked in a step that never committed comes back under an
    id from there on)."""

    step: int
    version: int
    engine: RolloutEngine
    requests: dict[int, int]
    next_id: int


@dataclass
class Asked:
    """What an ask did beyond asking: the groups that went on from durable tokens (rollout.partial) and their tokens,
    the env steps re-applied to bring groups of episodes back from their last durable turn (rollout.env), and where the
    ask played its groups at once (rollout.agent) the seconds spent generating and what it adds to the step's metrics."""

    continued: list[int] = field(default_factory=list)
    continued_tokens: int = 0
    restored_turns: int = 0
    gen_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


class GroupPlayer(Protocol):
    """Completion order's player: plays the groups a completion-order source asks. Each holds what it makes durable
    between commits and reads it back after a crash."""

    def resume(self, call: GroupCall) -> None:
        """A process's first collect: what an earlier process made durable, read back for the groups still to come.
        Collective."""

    def committed(self, groups: list[int]) -> None:
        """The groups whose samples are in the step committed since: forgotten at the next durable write."""

    def ask(self, groups: list[tuple[int, int]], call: GroupCall) -> Asked:
        """Begin this rank's share of `groups` (group, row): the q-th is rank q mod dp's. Collective."""

    def arrived(self, wait: float, call: GroupCall) -> Made:
        """Every rank's groups over since the last call (rank order, then arrival order), scored, waiting up to `wait`
        seconds for the first. Collective."""

    def pushed(self, call: GroupCall) -> dict[str, float]:
        """After a push of new weights, before the step's commit: what it made durable, as the step's metrics.
        Collective."""

    def close(self) -> None:
        """Release what it holds (a gateway)."""
