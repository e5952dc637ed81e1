"""What is in flight between two commits, as the run's journal keeps it (its pending store, outside
the step chain): with rollout.env in completion order each group of episodes, made durable after each
of its turns (schema.sample.GroupInFlight), with rollout.agent each model call as answered (one
entry a call: a write costs the calls it adds, never the episode's earlier ones), and with
rollout.partial each group's generation as a weight update stopped it (schema.sample.GroupProgress).
A resume reads them back; a group is forgotten with its calls once its samples are in a committed step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TypeVar

from verlj.journal import Journal

from ...schema.agent_calls import AgentCalls, Call
from ...schema.sample import GroupInFlight, GroupProgress

_GROUP_PREFIX = b"episodes/"  # a group's entry: the prefix, then its id (8 bytes, big-endian)
_PARTIAL_PREFIX = b"partial/"  # rollout.partial: a group's generation as a push stopped it, its group id big-endian
_CALL_PREFIX = b"agentcalls/"  # rollout.agent in completion order: one pending entry a call, (group, episode, position) big-endian


def _group_key(group: int) -> bytes:
    return _GROUP_PREFIX + group.to_bytes(8, "big")


def _partial_key(group: int) -> bytes:
    return _PARTIAL_PREFIX + group.to_bytes(8, "big")


def _call_key(group: int, episode: int | None = None, k: int | None = None) -> bytes:
    """A call's key; a group's calls' common prefix (`episode` None)."""
    key = _CALL_PREFIX + group.to_bytes(8, "big")
    return key if episode is None or k is None else key + episode.to_bytes(4, "big") + k.to_bytes(4, "big")


_State = TypeVar("_State", GroupInFlight, GroupProgress)


def _readable(kind: type[_State], value: dict) -> _State | None:
    """A group's durable entry read back, or None where it is not ours to read: as if never written, its group is
    asked again from its start."""
    try:
        return kind.from_dict(value)
    except (KeyError, TypeError, ValueError):
        return None


def _agent_calls(by_position: dict[int, dict]) -> str:
    """An episode's durable calls as its agent_calls text: positions 0, 1, ... up to the first missing (a call
    whose entry failed its checksum and those after it are made again); "" for none."""
    calls: list[Call] = []
    while len(calls) in by_position:
        try:
            calls.append(Call.from_dict(by_position[len(calls)]))
        except (KeyError, TypeError, ValueError, AttributeError):
            break
    return AgentCalls(tuple(calls), (), None, 0).to_json() if calls else ""


class InFlight:
    """The groups of episodes (and agent calls) in flight, and rollout.partial's stopped generations (``ledger.in_flight``)."""

    def __init__(self, journal: Journal):
        self.journal = journal

    def write_in_flight(self, groups: list[GroupInFlight], settled: Iterable[int], calls: Iterable[tuple] = (), dropped: Iterable[tuple] = ()) -> None:
        """Make these groups' episodes durable as they stand (one transaction, replacing each group's
        entry), and forget the groups in `settled` (their samples are in a committed step) with their calls.
        rollout.agent: `calls` are (group, episode, position, the call's dict: schema.agent_calls.Call), each
        added under its own key; `dropped` (group, episode, position) are forgotten (a divergence discarded them)."""
        self.journal.store.fence()
        values = {**{_group_key(g.group): g.to_dict() for g in groups}, **{_call_key(int(g), e, k): d for g, e, k, d in calls}}
        settled = list(settled)
        drop = [_group_key(int(g)) for g in settled] + [_call_key(int(g), e, k) for g, e, k in dropped]
        self.journal.pending.put(values, drop, [_call_key(int(g)) for g in settled])

    def groups(self) -> dict[int, GroupInFlight]:
        """The groups of episodes made durable and not yet forgotten, by group id (a resume keeps those
        still asked); an agent group's calls read back in order into its `agent_calls`."""
        out: dict[int, GroupInFlight] = {}
        calls: dict[int, dict[int, dict[int, dict]]] = {}
        for key, value in self.journal.pending.entries().items():
            if key.startswith(_GROUP_PREFIX):
                if (state := _readable(GroupInFlight, value)) is not None:
                    out[state.group] = state
            elif key.startswith(_CALL_PREFIX) and len(key) == len(_CALL_PREFIX) + 16:
                at = len(_CALL_PREFIX)
                group, episode, k = int.from_bytes(key[at:at + 8], "big"), int.from_bytes(key[at + 8:at + 12], "big"), int.from_bytes(key[at + 12:], "big")
                calls.setdefault(group, {}).setdefault(episode, {})[k] = value
        return {g: dataclasses.replace(state, agent_calls=[_agent_calls(calls[g].get(e, {})) for e in range(len(state.env_seed))])
                if g in calls else state for g, state in out.items()}

    def write_stopped(self, groups: list[GroupProgress], settled: Iterable[int]) -> None:
        """rollout.partial: make these groups' generations durable as a push stopped them (one transaction,
        replacing each group's entry), and forget the groups in `settled` (their samples are in a committed step)."""
        self.journal.store.fence()
        self.journal.pending.put({_partial_key(g.group): g.to_dict() for g in groups}, [_partial_key(int(g)) for g in settled])

    def partial_groups(self) -> dict[int, GroupProgress]:
        """rollout.partial: the groups made durable mid-generation and not yet forgotten, by group id."""
        states = (_readable(GroupProgress, value) for key, value in self.journal.pending.entries().items() if key.startswith(_PARTIAL_PREFIX))
        return {state.group: state for state in states if state is not None}
