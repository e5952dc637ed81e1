"""An agent episode's token ledger: its model calls as the gateway answered them (:class:`Call`), and
the training sample built from their token ids, never from text tokenized again.

A call whose prompt ids begin with the previous call's prompt and completion ids continues the same
sequence: the tokens between (the agent's tool results, its next user message, the template's role
markers) are the sample's observation tokens, masked from the loss (log-prob 0), exactly as an
environment's observations are (``rl.episodes``). A call whose prompt does not (the agent rewrote its
history: a summary, a template that drops earlier reasoning, a completion cut at a stop string and sent
back without it) is a **prefix break**: a new segment begins. The episode is trained as its longest
segment (the most tokens the policy generated; the later one on a tie); the other segments' calls
stay in the journal (the sample's ``agent_calls``) and are counted (``agent/prefix_breaks``).

The ledger is journaled with the sample as one JSON text (``schema.sample``'s ``agent_calls``,
version :data:`VERSION`): per call the canonical request and its hash, the prompt ids, the completion
ids and their log-probs, the exact response bytes (UTF-8), and a flag (``malformed_tool_call``).
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


def segments(calls: list[Call]) -> list[list[int]]:
    """The calls' indices, split where a call's prompt does not extend the sequence so far."""
    out: list[list[int]] = []
    seq = np.zeros(0, np.int64)
    for k, c in enumerate(calls):
        p = np.asarray(c.prompt_ids, np.int64)
        if out and len(p) >= len(seq) and np.array_equal(p[: len(seq)], seq):
            out[-1].append(k)
        else:
            out.append([k])
        seq = np.concatenate([p, np.asarray(c.completion_ids, np.int64)])
    return out


def chosen(calls: list[Call], segs: list[list[int]]) -> int:
    """The segment trained: the most generated tokens, the later one on a tie."""
    sizes = [sum(len(calls[k].completion_ids) for k in s) for s in segs]
    return max(range(len(segs)), key=lambda i: (sizes[i], i))


def sample_fields(calls: list[Call], seg: list[int]) -> dict:
    """A segment as an episode's Sample fields: the first call's prompt, then each completion and the
    observation tokens the next call's prompt added after it (masked), turn by turn."""
    first = calls[seg[0]]
    response: list = []
    logprobs: list = []
    mask: list = []
    lens: list = []
    for j, k in enumerate(seg):
        c = calls[k]
        response += c.completion_ids.tolist()
        logprobs += c.logprobs.tolist()
        mask += [1] * len(c.completion_ids)
        obs = calls[seg[j + 1]].prompt_ids[len(first.prompt_ids) + len(response):] if j + 1 < len(seg) else np.zeros(0, np.int64)
        response += obs.tolist()
        logprobs += [0.0] * len(obs)
        mask += [0] * len(obs)
        lens += [len(c.completion_ids), len(obs)]
    return {"prompt_ids": np.asarray(first.prompt_ids, np.int64), "response_ids": np.asarray(response, np.int64),
            "gen_logprobs": np.asarray(logprobs, np.float32), "loss_mask": np.asarray(mask, np.int8), "turn_lens": np.asarray(lens, np.int64)}


def dumps(calls: list[Call], segment: int, reward: float | None) -> str:
    """The ledger as the journal keeps it (one JSON text per sample)."""
    return json.dumps({"v": VERSION, "segment": segment, "reward": reward, "calls": [c.to_dict() for c in calls]},
                      ensure_ascii=False, separators=(",", ":"))


def loads(text: str) -> dict:
    """A journaled ledger: {"v", "segment", "reward", "calls": [Call]} ({} for "": no agent)."""
    if not text:
        return {}
    d = json.loads(text)
    return {**d, "calls": [Call.from_dict(c) for c in d["calls"]]}


def call_lines(text: str) -> list[dict]:
    """A journaled ledger call by call, for reading (``verlj inspect --step``): the last message sent
    (``role: content``), the answer's text and tool calls (``name(arguments)``), its finish reason, its
    flag, and whether the call is in the trained segment. [] for "" (no agent)."""
    if not text:
        return []
    d = json.loads(text)
    calls = [Call.from_dict(c) for c in d["calls"]]
    segs = segments(calls)
    trained = set(segs[d["segment"]]) if segs and d["segment"] >= 0 else set()
    out = []
    for k, c in enumerate(calls):
        last = json.loads(c.request)["messages"][-1]
        body = c.response.decode()
        if body.startswith("data: "):  # a stream: its deltas put together
            chunks = [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: {")]
            choices = [ch["choices"][0] for ch in chunks if ch["choices"]]
            content = "".join(ch["delta"].get("content") or "" for ch in choices)
            tools = [t for ch in choices for t in ch["delta"].get("tool_calls") or []]
            finish = next((ch["finish_reason"] for ch in choices if ch["finish_reason"]), "")
        else:
            choice = json.loads(body)["choices"][0]
            content, tools, finish = choice["message"]["content"] or "", choice["message"].get("tool_calls") or [], choice["finish_reason"]
        out.append({"sent": f"{last['role']}: {last['content'] or ''}", "text": content, "finish_reason": finish,
                    "tool_calls": [f"{t['function']['name']}({t['function']['arguments']})" for t in tools], "flag": c.flag,
                    "trained": k in trained})
    return out
