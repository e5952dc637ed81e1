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

The ledger is journaled with the sample as one JSON text (``schema.sample``'s ``agent_calls``; its
record and codec are ``schema.agent_calls``): per call the canonical request and its hash, the prompt
ids, the completion ids and their log-probs, the exact response bytes (UTF-8), and a flag
(``malformed_tool_call``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...schema.agent_calls import AgentCalls, Call
from .protocol import Message, Sent, answered, last_sent, read_answer


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


@dataclass(frozen=True)
class CallLine:
    """A journaled call, for reading (``verlj inspect --step``): the last message sent (``role: content``),
    the answer's text and tool calls (``name(arguments)``), its finish reason, its flag, and whether the
    call is in the trained segment."""

    sent: str
    text: str
    finish_reason: str
    tool_calls: tuple[str, ...]
    flag: str
    trained: bool


def call_lines(text: str) -> list[CallLine]:
    """A sample's journaled calls (its ``agent_calls``) call by call; [] for "" (no agent)."""
    if not text:
        return []
    rec = AgentCalls.from_json(text)
    segs = segments(list(rec.calls))
    trained = set(segs[rec.segment]) if segs and rec.segment >= 0 else set()
    out = []
    for k, c in enumerate(rec.calls):
        answer = read_answer(c.response)
        out.append(CallLine(last_sent(c.request), answer.content, answer.finish_reason, answer.tool_calls, c.flag, k in trained))
    return out


@dataclass(frozen=True)
class Conversation:
    """A sample's trained segment as a chat (``verlj export --sft/--dpo``): the messages of its last call's
    request, then that call's answer, as the gateway keeps them; the tools the request offered (None: none); how
    many messages the segment's first call was sent (``prompt``: what the sample's prompt ids hold); and which
    messages are the segment's answers (``trained``: the policy's tokens in the sample's loss mask, every other
    message's tokens masked or in the prompt)."""

    messages: tuple[Message, ...]
    tools: list | None
    prompt: int
    trained: frozenset[int]


def conversation(text: str) -> Conversation | None:
    """A sample's journaled calls (its ``agent_calls``) as the chat its trained segment is; None for "" or an
    episode that made no call."""
    if not text:
        return None
    rec = AgentCalls.from_json(text)
    if rec.segment < 0 or not rec.calls:
        return None
    calls = list(rec.calls)
    seg = segments(calls)[rec.segment]
    sent = [Sent.of(calls[k].request) for k in seg]
    answer, _ = answered(calls[seg[-1]].response)
    messages = (*sent[-1].messages, answer)
    # call j's answer is the message after call j's own messages in every later request of the segment
    trained = frozenset([len(s.messages) for s in sent[:-1]] + [len(messages) - 1])
    return Conversation(messages, sent[-1].tools, len(sent[0].messages), trained)
