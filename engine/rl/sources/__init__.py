"""Rollout sources: one module per way a step's samples are collected, all behind one protocol
(:class:`~.base.StepSource`). The trainer calls :func:`make_source` and applies what the source returns.

- ``sync`` (:class:`SyncSource`): rollout.mode=sync, each step generates its own batch.
- ``planned`` (:class:`PlannedSource`): async in step order, k batches planned ahead.
- ``completion`` (:class:`CompletionSource`): async in completion order, a free-running generator.
- ``episodes``: rollout.env's episodes, played in either order by the sources above.
- ``agents`` (:class:`AgentSource`): rollout.agent's programs, each sample an episode over the gateway (sync).

Where they generate is the rollout engine's business (``rl.rollout``: hf, vLLM, the generator
process, the Ray fleet), so any source runs on any engine its order allows. A new source (an agent
gateway) is a module here, named below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...config import Config
from .agents import AgentSource
from .base import Host, StepInputs, StepSource
from .completion import CompletionSource
from .planned import PlannedSource
from .sync import SyncSource

__all__ = ["Host", "StepInputs", "StepSource", "make_source", "source_kind"]


def source_kind(cfg: Config) -> str:
    """The name of the source the config asks for: sync, agent, planned or completion."""
    if cfg.rollout.mode == "sync":
        return "agent" if cfg.rollout.agent is not None else "sync"
    return "completion" if cfg.rollout.free_running else "planned"


def make_source(host: Host) -> StepSource:
    """The source the host's config names (the one place it is chosen)."""
    kind = source_kind(host.cfg)
    if kind == "completion":
        return CompletionSource(host)
    if kind == "planned":
        return PlannedSource(host)
    if kind == "agent":
        return AgentSource(host)
    return SyncSource(host)


if TYPE_CHECKING:  # every source is a StepSource: mypy fails here when one stops conforming

    def _conforms(sync: SyncSource, planned: PlannedSource, completion: CompletionSource, agent: AgentSource) -> list[StepSource]:
        return [sync, planned, completion, agent]
