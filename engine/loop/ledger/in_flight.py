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
from dataclasses import dataclass
from typing import Any, TypeVar

from verlj.journal import Journal

from ...schema.agent_calls import AgentCalls, Call, ToolCall
from ...schema.sample import GroupInFlight, GroupProgress
from .identity import RUN_TOKEN

_GROUP_PREFIX = b"episodes/"  # a group's entry: the prefix, then its id (8 bytes, big-endian)
_PARTIAL_PREFIX = b"partial/"  # rollout.partial: a group's generation as a push stopped it, its group id big-endian
_CALL_PREFIX = b"agentcalls/"  # rollout.agent in completion order: one pending entry a call, (group, episode, position) big-endian
_TOOL = b"t"  # rollout.tools: a tool call's entry is its (group, episode, position) key and this byte, forgotten with its group's calls


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


def _in_order(by_position: dict[int, dict], kind: Any) -> list:
    """Entries at positions 0, 1, ... up to the first missing (one that failed its checksum, and those after it, are made
    again)."""
    out: list = []
    while len(out) in by_position:
        try:
            out.append(kind.from_dict(by_position[len(out)]))
        except (KeyError, TypeError, ValueError, AttributeError):
            break
    return out


def _agent_calls(by_position: dict[int, dict], tools: dict[int, dict]) -> str:
    """An episode's durable model and tool calls as its agent_calls text; "" for none."""
    calls, done = _in_order(by_position, Call), _in_order(tools, ToolCall)
    return AgentCalls(tuple(calls), (), None, 0, tuple(done)).to_json() if calls or done else ""


def _parse_call_key(key: bytes) -> tuple[int, int, int, bool] | None:
    """(group, episode, position, whether a tool call's) of a call's key; None for another entry's."""
    at = len(_CALL_PREFIX)
    if not key.startswith(_CALL_PREFIX) or len(key) not in (at + 16, at + 17) or (len(key) == at + 17 and not key.endswith(_TOOL)):
        return None
    return int.from_bytes(key[at:at + 8], "big"), int.from_bytes(key[at + 8:at + 12], "big"), int.from_bytes(key[at + 12:at + 16], "big"), len(key) == at + 17


@dataclass(frozen=True)
class Carried:
    """What a journal that never committed a step held of rollout.tools: its run token and its tool calls in flight (with their
    groups' entries), by pending key."""

    token: str | None
    entries: dict[bytes, Any]


def unstarted_tools(journal: Journal) -> Carried | None:
    """rollout.tools, of a journal that never committed a step and is about to be discarded (its run started afresh): its tool
    calls in flight and its run token, to carry into the new journal (:func:`carry_tools`): their effects are the world's, and
    the fresh start plays the same episodes again."""
    held = journal.pending.entries()
    entries = {k: v for k, v in held.items() if (at := _parse_call_key(k)) is not None and at[3]}
    groups = {_group_key(at[0]) for k in entries if (at := _parse_call_key(k)) is not None}  # completion order: their groups' entries
    entries.update({k: held[k] for k in groups if k in held})
    return Carried(journal.meta.get(RUN_TOKEN), entries) if entries else None


def carry_tools(journal: Journal, carried: Carried | None) -> list[str]:
    """Write what :func:`unstarted_tools` kept (None: nothing) into the new journal, in one transaction each (before its run's
    start is recorded). Returns the line that says so ([] for nothing)."""
    if carried is None:
        return []
    if carried.token:
        journal.meta.update({RUN_TOKEN: carried.token})
    journal.pending.put(carried.entries)
    calls = sum(1 for k in carried.entries if (at := _parse_call_key(k)) is not None and at[3])
    return [f"rollout.tools: the {calls} tool call(s) in flight of the start that never committed a step are kept, with their "
            "idempotency keys: a call it completed is answered from them, never sent again (its episodes are played again as attempt 1)"]


class InFlight:
    """The groups of episodes (and agent calls) in flight, and rollout.partial's stopped generations (``ledger.in_flight``)."""

    def __init__(self, journal: Journal):
        self.journal = journal

    def write_in_flight(self, groups: list[GroupInFlight], settled: Iterable[int], calls: Iterable[tuple] = (), dropped: Iterable[tuple] = (),
                        tools: Iterable[tuple] = (), dropped_tools: Iterable[tuple] = ()) -> None:
        """Make these groups' episodes durable as they stand (one transaction, replacing each group's
        entry), and forget the groups in `settled` (their samples are in a committed step) with their calls.
        rollout.agent: `calls` are (group, episode, position, the call's dict: schema.agent_calls.Call), each
        added under its own key; `dropped` (group, episode, position) are forgotten (a divergence discarded them).
        rollout.tools: `tools` (group, episode, position, schema.agent_calls.ToolCall's dict) each written under its own key
        (replacing the entry of a call sent with the call done); `dropped_tools` (group, episode, position) forgotten."""
        self.journal.store.fence()
        values = {**{_group_key(g.group): g.to_dict() for g in groups}, **{_call_key(int(g), e, k): d for g, e, k, d in calls},
                  **{_call_key(int(g), e, k) + _TOOL: d for g, e, k, d in tools}}
        settled = list(settled)
        drop = [_group_key(int(g)) for g in settled] + [_call_key(int(g), e, k) for g, e, k in dropped] + \
            [_call_key(int(g), e, k) + _TOOL for g, e, k in dropped_tools]
        self.journal.pending.put(values, drop, [_call_key(int(g)) for g in settled])

    def groups(self) -> dict[int, GroupInFlight]:
        """The groups of episodes made durable and not yet forgotten, by group id (a resume keeps those
        still asked); an agent group's calls read back in order into its `agent_calls`."""
        out: dict[int, GroupInFlight] = {}
        calls: dict[int, dict[int, dict[int, dict]]] = {}
        tools: dict[int, dict[int, dict[int, dict]]] = {}
        for key, value in self.journal.pending.entries().items():
            if key.startswith(_GROUP_PREFIX):
                if (state := _readable(GroupInFlight, value)) is not None:
                    out[state.group] = state
            elif (at := _parse_call_key(key)) is not None:
                group, episode, k, tool = at
                (tools if tool else calls).setdefault(group, {}).setdefault(episode, {})[k] = value
        return {g: dataclasses.replace(state, agent_calls=[_agent_calls(calls.get(g, {}).get(e, {}), tools.get(g, {}).get(e, {}))
                                                           for e in range(len(state.env_seed))])
                if g in calls or g in tools else state for g, state in out.items()}

    def tool_calls(self) -> dict[int, list[ToolCall]]:
        """rollout.tools in step order (an episode's tool calls under its id as the group, episode 0): each episode's durable
        tool calls in order, by its id."""
        by: dict[int, dict[int, dict]] = {}
        for key, value in self.journal.pending.entries().items():
            if (at := _parse_call_key(key)) is not None and at[3] and at[1] == 0:
                by.setdefault(at[0], {})[at[2]] = value
        return {g: got for g, entries in by.items() if (got := _in_order(entries, ToolCall))}

    def write_stopped(self, groups: list[GroupProgress], settled: Iterable[int]) -> None:
        """rollout.partial: make these groups' generations durable as a push stopped them (one transaction,
        replacing each group's entry), and forget the groups in `settled` (their samples are in a committed step)."""
        self.journal.store.fence()
        self.journal.pending.put({_partial_key(g.group): g.to_dict() for g in groups}, [_partial_key(int(g)) for g in settled])

    def partial_groups(self) -> dict[int, GroupProgress]:
        """rollout.partial: the groups made durable mid-generation and not yet forgotten, by group id."""
        states = (_readable(GroupProgress, value) for key, value in self.journal.pending.entries().items() if key.startswith(_PARTIAL_PREFIX))
        return {state.group: state for state in states if state is not None}
