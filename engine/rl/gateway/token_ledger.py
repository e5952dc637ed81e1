"""An agent episode's token ledger: its model calls as the gateway answered them (:class:`Call`), and
the training sample built from their token ids, never from text tokenized again.

A call whose prompt ids begin with an earlier call's prompt and completion ids continues that call's
sequence (the gateway splices a call that continues a conversation as answered: ``gateway.prompts``): the
tokens between (the agent's tool results, its next user message, the template's role markers) are the
sample's observation tokens, masked from the loss (log-prob 0), exactly as an environment's observations are
(``rl.episodes``). Each call's **parent** is the latest earlier call it continues; a call that continues none
(the agent rewrote its history: a summary, an edited answer, other tools) is a **prefix break**: a new
segment begins. Calls that continue the same call (an agent that asks twice from one point, or in parallel)
branch. The episode is trained as one **chain** of calls, root to leaf: the one with the most tokens the
policy generated (the later leaf on a tie); the other calls stay in the journal (the sample's
``agent_calls``), untrained, and the breaks are counted (``agent/prefix_breaks``).

The ledger is journaled with the sample as one JSON text (``schema.sample``'s ``agent_calls``; its
record and codec are ``schema.agent_calls``): per call the canonical request and its hash, the prompt
ids, the completion ids and their log-probs, the exact response bytes (UTF-8), a flag
(``malformed_tool_call``) and the attempt that generated it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...schema.agent_calls import AgentCalls, Call, ToolCall
from .protocol import Message, conversation, last_sent, same_answer
from .wire import answered_message, read_answer


def parents(calls: list[Call]) -> list[int]:
    """Each call's parent: the latest earlier call whose prompt and completion ids begin its prompt ids (-1: none,
    a new segment)."""
    seqs = [np.concatenate([np.asarray(c.prompt_ids, np.int64), np.asarray(c.completion_ids, np.int64)]) for c in calls]
    out = []
    for k, c in enumerate(calls):
        p = np.asarray(c.prompt_ids, np.int64)
        out.append(next((j for j in reversed(range(k)) if len(p) >= len(seqs[j]) and np.array_equal(p[: len(seqs[j])], seqs[j])), -1))
    return out


def trained_chain(calls: list[Call]) -> tuple[tuple[int, ...], int]:
    """(the chain of calls trained, root first; the number of segments): of every chain from a root to a leaf, the
    one with the most generated tokens, the later leaf on a tie. ((), 0) for no call."""
    up = parents(calls)
    leaves = [k for k in range(len(calls)) if k not in set(up)]
    best: tuple[int, ...] = ()
    size = -1
    for leaf in leaves:
        chain = [leaf]
        while up[chain[-1]] >= 0:
            chain.append(up[chain[-1]])
        n = sum(len(calls[k].completion_ids) for k in chain)
        if n >= size:
            best, size = tuple(reversed(chain)), n
    return best, sum(p < 0 for p in up)


def ledger_of(calls: list[Call], reward: float | None, tools: list[ToolCall] | tuple = ()) -> AgentCalls:
    """An episode's calls as journaled: with the chain trained and the segment count, and its tool calls (rollout.tools)."""
    chain, segments = trained_chain(calls)
    return AgentCalls(tuple(calls), chain, reward, segments, tuple(tools))


def sample_fields(calls: list[Call], chain: tuple[int, ...] | list[int]) -> dict:
    """A chain of calls as an episode's Sample fields: the first call's prompt, then each completion and the
    observation tokens the next call's prompt added after it (masked), turn by turn."""
    first = calls[chain[0]]
    response: list = []
    logprobs: list = []
    mask: list = []
    lens: list = []
    for j, k in enumerate(chain):
        c = calls[k]
        response += c.completion_ids.tolist()
        logprobs += c.logprobs.tolist()
        mask += [1] * len(c.completion_ids)
        obs = calls[chain[j + 1]].prompt_ids[len(first.prompt_ids) + len(response):] if j + 1 < len(chain) else np.zeros(0, np.int64)
        response += obs.tolist()
        logprobs += [0.0] * len(obs)
        mask += [0] * len(obs)
        lens += [len(c.completion_ids), len(obs)]
    return {"prompt_ids": np.asarray(first.prompt_ids, np.int64), "response_ids": np.asarray(response, np.int64),
            "gen_logprobs": np.asarray(logprobs, np.float32), "loss_mask": np.asarray(mask, np.int8), "turn_lens": np.asarray(lens, np.int64)}


@dataclass(frozen=True)
class CallLine:
    """A journaled call, for reading (``verlj inspect --step``): the last message sent (``role: content``),
    the answer's text and tool calls (``name(arguments)``), its finish reason, its flag, whether the
    call is in the trained chain."""

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
    trained = set(rec.trained)
    out = []
    for k, c in enumerate(rec.calls):
        answer = read_answer(c.response)
        out.append(CallLine(last_sent(c.request), answer.content, answer.finish_reason, answer.tool_calls, c.flag, k in trained))
    return out


def tool_lines(text: str) -> list[ToolCall]:
    """A sample's journaled tool calls (rollout.tools; its ``agent_calls``), in the order sent; [] for "" or none."""
    return list(AgentCalls.from_json(text).tools) if text else []


@dataclass(frozen=True)
class TrainedChat:
    """A sample's trained chain of calls as a chat (``verlj export --sft/--dpo``): the messages of its last call's
    request, then that call's answer (:class:`protocol.Message`); the tools the request offered (None: none); how many
    messages the chain's first call was sent (``prompt``: what the sample's prompt ids hold); and which messages are
    the chain's answers (``trained``: the policy's tokens in the sample's loss mask; every other message's tokens are
    masked or in the prompt)."""

    messages: tuple[Message, ...]
    tools: list | None
    prompt: int
    trained: frozenset[int]


def trained_chat(text: str) -> TrainedChat | None:
    """A sample's journaled calls (its ``agent_calls``) as the chat its trained chain is; None for "" or an episode
    that made no call."""
    if not text:
        return None
    rec = AgentCalls.from_json(text)
    if not rec.trained:
        return None
    sent = [conversation(rec.calls[k].request) for k in rec.trained]
    answers = [answered_message(rec.calls[k].response) for k in rec.trained]
    last = sent[-1].messages
    messages = (*(Message.of(m) for m in last), Message.of({"role": "assistant", **answers[-1]}))
    # a call the next one continues as answered: its answer is the message after its own, in every later request
    trained = [len(c.messages) for c, a in zip(sent[:-1], answers[:-1]) if len(last) > len(c.messages) and same_answer(last[len(c.messages)], a)]
    return TrainedChat(messages, sent[-1].tools, len(sent[0].messages), frozenset([*trained, len(messages) - 1]))
