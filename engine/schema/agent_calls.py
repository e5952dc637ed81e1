"""An agent episode's model calls as the journal keeps them with its sample: the ``agent_calls`` text
column (``schema.sample``), one JSON text per sample, version :data:`VERSION`, and its one codec.

The text is ``{"v", "trained", "reward", "calls", "segments"}`` (and ``"tools"`` when the episode called a tool through
the gateway: :class:`ToolCall`, rollout.tools): the indices of the calls trained (the
chain of calls the sample is built from, in order; [] when the episode made no call), the agent's reward
(null: none), per call (:class:`Call`) the canonical request and its hash, the prompt ids, the completion ids
and their log-probs, the exact response bytes (UTF-8) and a flag, then how many segments the calls split into
(``rl.gateway.token_ledger``: a call that continues no earlier call starts one). ``to_json`` writes compact
separators, keys in that order, UTF-8 kept as is, so a stored text read and written again is byte for byte
the same.

Version 1 (before calls were spliced, ``{"v", "segment", ...}``) named the trained segment by its index among
the calls split in order wherever a call's prompt did not extend the one before; it is read as version 2 with
those calls as ``trained`` (:func:`_from_v1`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

VERSION = 2


@dataclass(frozen=True)
class Call:
    """One model call of an episode, as answered. Its map is written here, not by the codec (schema.record): it is
    JSON text, whose ids and log-probs are lists and whose response is text, where the codec keeps arrays and
    bytes as they are (msgpack stores both)."""

    request: str  # canonical JSON (gateway.protocol.ChatRequest.canonical)
    digest: str  # sha256 of `request`
    prompt_ids: np.ndarray
    completion_ids: np.ndarray  # what the agent was answered (cut at max_tokens or a stop string): eos included when sampled
    logprobs: np.ndarray  # float32, one per completion id
    response: bytes  # exactly what was sent back
    flag: str = ""

    def to_dict(self) -> dict:
        return {"request": self.request, "digest": self.digest, "prompt_ids": [int(x) for x in self.prompt_ids],
                "completion_ids": [int(x) for x in self.completion_ids], "logprobs": [float(x) for x in self.logprobs],
                "response": self.response.decode(), "flag": self.flag}

    @classmethod
    def from_dict(cls, d: dict) -> Call:
        return cls(d["request"], d["digest"], np.asarray(d["prompt_ids"], np.int64), np.asarray(d["completion_ids"], np.int64),
                   np.asarray(d["logprobs"], np.float32), d["response"].encode(), d.get("flag", ""))


SENT, DONE, RECONCILED = "sent", "done", "reconciled"  # a tool call's state: sent (its outcome unknown until its result is durable)


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an episode through the gateway (rollout.tools: ``gateway.tools``), as the journal keeps it: made durable
    as `SENT` before the tool runs, then `DONE` (or `RECONCILED`: its outcome asked of the tool's reconcile after a crash) with
    its result. Its idempotency `key` is the same on every attempt (the run, the episode, the call's position)."""

    name: str
    arguments: str  # canonical JSON (keys sorted, no spaces)
    digest: str  # sha256 of the name, a newline, then `arguments`
    key: str  # the idempotency key it was sent with
    effect: str  # pure | restorable | external (gateway.tools.EFFECTS)
    attempt: int  # the attempt that sent it
    state: str = SENT
    result: str = ""  # the text the caller was answered
    error: bool = False  # the tool raised (its result says what)

    def to_dict(self) -> dict:
        return {"name": self.name, "arguments": self.arguments, "digest": self.digest, "key": self.key, "effect": self.effect,
                "attempt": self.attempt, "state": self.state, "result": self.result, "error": self.error}

    @classmethod
    def from_dict(cls, d: dict) -> ToolCall:
        return cls(d["name"], d["arguments"], d["digest"], d["key"], d["effect"], int(d["attempt"]), d["state"], d["result"], bool(d["error"]))


@dataclass(frozen=True)
class AgentCalls:
    """A sample's journaled calls: all of them, those trained (in order), the agent's reward, the segment count.
    JSON text with its own version and a reader of version 1, written here (see Call: not the codec's)."""

    calls: tuple[Call, ...]
    trained: tuple[int, ...]  # the calls the sample is built from, in order; () when the episode made no call
    reward: float | None  # the agent's own reward (None: rollout.reward_fn scored the last answer)
    segments: int  # how many segments the calls split into (a prefix break starts one)
    tools: tuple[ToolCall, ...] = ()  # its tool calls through the gateway, in the order sent

    @property
    def prefix_breaks(self) -> int:
        return max(0, self.segments - 1)

    def to_json(self) -> str:
        d = {"v": VERSION, "trained": list(self.trained), "reward": self.reward, "calls": [c.to_dict() for c in self.calls], "segments": self.segments}
        if self.tools:  # only then: a text without tool calls keeps the form (and bytes) it always had
            d["tools"] = [t.to_dict() for t in self.tools]
        return json.dumps(d, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> AgentCalls:
        d = json.loads(text)
        if d["v"] == 1:
            return _from_v1(d)
        if d["v"] != VERSION:
            raise ValueError(f"agent_calls version {d['v']} is not one this verlj reads (1 or {VERSION})")
        return cls(tuple(Call.from_dict(c) for c in d["calls"]), tuple(int(k) for k in d["trained"]), d["reward"], d["segments"],
                   tuple(ToolCall.from_dict(t) for t in d.get("tools", ())))


def _from_v1(d: dict) -> AgentCalls:
    """A version-1 text: its segments were the calls split in order where a call's prompt ids did not begin with the
    previous call's prompt and completion ids, and ``segment`` the index of the one trained."""
    calls = tuple(Call.from_dict(c) for c in d["calls"])
    segs: list[list[int]] = []
    seq = np.zeros(0, np.int64)
    for k, c in enumerate(calls):
        if segs and len(c.prompt_ids) >= len(seq) and np.array_equal(c.prompt_ids[: len(seq)], seq):
            segs[-1].append(k)
        else:
            segs.append([k])
        seq = np.concatenate([c.prompt_ids, c.completion_ids])
    trained = tuple(segs[d["segment"]]) if d["segment"] >= 0 else ()
    return AgentCalls(calls, trained, d["reward"], d["segments"])
