"""Rollout sources: one module per way a step's samples are collected, all behind one protocol
(:class:`~.base.StepSource`). The trainer calls :func:`make_source` and applies what the source returns.

- ``sync`` (:class:`SyncSource`): rollout.mode=sync, each step generates its own batch.
- ``planned`` (:class:`PlannedSource`): async in step order, k batches planned ahead.
- ``batches``: what those two hold: step order's batches (``Batches``), made round by round by a round player
  (``SingleTurn``; ``episodes.EnvRounds`` for rollout.env; ``agents.AgentRounds`` for rollout.agent).
- ``completion`` (:class:`CompletionSource`): async in completion order, a free-running generator; it holds its
  group players (``SingleTurnGroups``; ``episodes.Turns`` for rollout.env; ``agents_async.AgentGroups``).
- ``episodes``: rollout.env's episodes, in step order (``EnvRounds``) and completion order (``Turns``).
- ``agents``: rollout.agent's programs over the gateway (``Agents``, what every agent source holds; ``AgentRounds``).
- ``agents_async``: rollout.agent in completion order (``AgentGroups``, a completion source's group player), every
  call durable.

Where they generate is the rollout engine's business (``rl.rollout``: hf, vLLM, the generator
process, the Ray fleet), so any source runs on any engine its order allows. A new source (an agent
gateway) is a module here, named below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...config import Config
from .agents import AgentRounds
from .agents_async import AgentGroups
from .base import Host, StepInputs, StepSource
from .batches import RoundPlayer, SingleTurn
from .completion import CompletionSource, GroupPlayer, SingleTurnGroups
from .episodes import EnvRounds, Turns
from .planned import PlannedSource
from .sync import SyncSource

__all__ = ["Host", "StepInputs", "StepSource", "make_source", "source_kind"]


def source_kind(cfg: Config) -> str:
    """The name of the source the config asks for: sync, planned or completion, with rollout.agent agent,
    agent_planned or agent_completion."""
    if cfg.rollout.mode == "sync":
        return "agent" if cfg.rollout.agent is not None else "sync"
    if cfg.rollout.free_running:
        return "agent_completion" if cfg.rollout.agent is not None else "completion"
    return "agent_planned" if cfg.rollout.agent is not None else "planned"


def make_source(host: Host) -> StepSource:
    """The source the host's config names (the one place it is chosen)."""
    kind = source_kind(host.cfg)
    if kind == "completion":
        return CompletionSource(host)
    if kind == "planned":
        return PlannedSource(host)
    if kind == "agent":
        return SyncSource(host, AgentRounds)
    if kind == "agent_planned":
        return PlannedSource(host, AgentRounds)
    if kind == "agent_completion":
        return CompletionSource(host, AgentGroups)
    return SyncSource(host)


if TYPE_CHECKING:  # every source is a StepSource: mypy fails here when one stops conforming

    def _conforms(sync: SyncSource, planned: PlannedSource, completion: CompletionSource) -> list[StepSource]:
        return [sync, planned, completion]

    def _groups(single: SingleTurnGroups, episodes: Turns, agents: AgentGroups) -> list[GroupPlayer]:
        return [single, episodes, agents]

    def _plays(single: SingleTurn, episodes: EnvRounds, agents: AgentRounds) -> list[RoundPlayer]:
        return [single, episodes, agents]
