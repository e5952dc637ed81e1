"""Rollout sources, assembled in one place: :func:`make_source` makes a run's source (its order) and its player (the kind
of samples it makes) from the config, each given what it needs when it is made.

    order (rollout.mode, rollout.async_order)        player (rollout.env, rollout.agent)
    sync       SyncSource      (sync.py)              single   SingleTurn / SingleTurnGroups   (single.py)
    planned    PlannedSource   (planned.py)           env      EnvRounds / Turns               (env_players.py)
    completion CompletionSource (completion.py)       agent    AgentRounds / AgentGroups       (agent_players.py, agent_groups.py)

Step order (sync, planned) asks a round player (``players.RoundPlayer``) for each round of a step's batch
(``batches.Batches``); completion order asks a group player (``players.GroupPlayer``) for groups as the generator
frees them. A player is made once with the rollout's parts (``players.Parts``: config, ranks, tokenizer, data, scorer,
the durable log...), takes a small context per call and returns what it made: it reads and writes nothing of its
source's or the trainer's. A new kind of samples is a player module and a line in ROUND_PLAYERS and GROUP_PLAYERS below;
a new order, a source module and a line in ORDERS. Where they generate is the rollout engine's business
(``rl.rollout``: hf, vLLM, the generator process, the Ray fleet), so any source runs on any engine its order allows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ...config import Config
from .agent_groups import AgentGroups
from .agent_players import AgentRounds
from .base import StepSource
from .completion import CompletionSource
from .env_players import EnvRounds, Turns
from .planned import PlannedSource
from .players import GroupPlayer, InFlightLog, Parts, RoundPlayer
from .single import SingleTurn, SingleTurnGroups
from .sync import SyncSource

__all__ = ["InFlightLog", "Parts", "StepSource", "make_source", "order_of", "player_of"]

# the players, by the kind of samples they make: step order's and completion order's (each made from the rollout's parts)
ROUND_PLAYERS: dict[str, Callable[[Parts], RoundPlayer]] = {"single": SingleTurn.of, "env": EnvRounds.of, "agent": AgentRounds.of}
GROUP_PLAYERS: dict[str, Callable[[Parts], GroupPlayer]] = {"single": SingleTurnGroups.of, "env": Turns.of, "agent": AgentGroups.of}
# the step orders (completion order asks groups: CompletionSource)
ORDERS: dict[str, Callable[[Parts, RoundPlayer], StepSource]] = {"sync": SyncSource, "planned": PlannedSource}


def order_of(cfg: Config) -> str:
    """The order a config's rollout runs in: sync, planned (async step order) or completion (async completion order)."""
    if cfg.rollout.mode == "sync":
        return "sync"
    return "completion" if cfg.rollout.free_running else "planned"


def player_of(cfg: Config) -> str:
    """The kind of samples a config's rollout makes: agent (rollout.agent), env (rollout.env) or single."""
    return "agent" if cfg.rollout.agent is not None else "env" if cfg.rollout.env is not None else "single"


def make_source(parts: Parts) -> StepSource:
    """The run's source and its player, for the config in `parts` (the one place they are chosen and made)."""
    order, kind = order_of(parts.cfg), player_of(parts.cfg)
    if order == "completion":
        return CompletionSource(parts, GROUP_PLAYERS[kind](parts))
    return ORDERS[order](parts, ROUND_PLAYERS[kind](parts))


if TYPE_CHECKING:  # every source is a StepSource and every player its order's: mypy fails here when one stops conforming

    def _conforms(sync: SyncSource, planned: PlannedSource, completion: CompletionSource) -> list[StepSource]:
        return [sync, planned, completion]

    def _groups(single: SingleTurnGroups, episodes: Turns, agents: AgentGroups) -> list[GroupPlayer]:
        return [single, episodes, agents]

    def _rounds(single: SingleTurn, episodes: EnvRounds, agents: AgentRounds) -> list[RoundPlayer]:
        return [single, episodes, agents]
