"""An agent episode's model calls as the journal keeps them with its sample: the ``agent_calls`` text
column (``schema.sample``), one JSON text per sample, version :data:`VERSION`, and its one codec.

The text is ``{"v", "segment", "reward", "calls", "segments"}``: the trained segment's index (-1: no
call), the agent's reward (null: none), per call (:class:`Call`) the canonical request and its hash,
the prompt ids, the completion ids and their log-probs, the exact response bytes (UTF-8) and a flag,
then how many segments the calls split into (``rl.gateway.ledger.segments``). ``to_json`` writes the
bytes the journal has always held (compact separators, keys in that order, UTF-8 kept as is), so a
stored text read and written again is byte for byte the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

VERSION = 1


@dataclass(frozen=True)
class Call:
    """One model call of an episode, as answered."""

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


@dataclass(frozen=True)
class AgentCalls:
    """A sample's journaled calls: all of them, the segment trained, the agent's reward, the segment count."""

    calls: tuple[Call, ...]
    segment: int  # index of the trained segment; -1 when the episode made no call
    reward: float | None  # the agent's own reward (None: rollout.reward_fn scored the last answer)
    segments: int  # how many segments the calls split into (a prefix break starts one)

    @property
    def prefix_breaks(self) -> int:
        return self.segments - 1

    def to_json(self) -> str:
        return json.dumps({"v": VERSION, "segment": self.segment, "reward": self.reward, "calls": [c.to_dict() for c in self.calls],
                           "segments": self.segments}, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> AgentCalls:
        d = json.loads(text)
        if d["v"] != VERSION:
            raise ValueError(f"agent_calls version {d['v']} is not the {VERSION} this verlj reads")
        return cls(tuple(Call.from_dict(c) for c in d["calls"]), d["segment"], d["reward"], d["segments"])
