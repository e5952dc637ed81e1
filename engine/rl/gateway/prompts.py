"""A call's prompt ids: spliced onto the call it continues, else its conversation rendered whole.

A byte-level BPE does not give back the ids it was given: a sampled sequence is often not the tokenizer's own
split of its text (``hel`` + ``lo``, a character cut between two tokens), so a conversation rendered by the
chat template and tokenized again would not begin with the ids the policy produced, and the call would fall out
of the trained sequence (a prefix break). So a call whose ``messages`` are an earlier call's messages, then the
assistant message the gateway answered it with (content and tool calls as sent), then new messages, is
**spliced**: its prompt ids are that call's prompt ids and completion ids as generated, then the end-of-turn
text the template writes after an assistant message (less the end token when the completion ended with it),
then the new messages alone, tokenized:

    ids = earlier.prompt_ids + earlier.completion_ids + tokens(closing + end_of_turn + new_messages_text)

``closing`` is "" but after a forced tool call (tool_choice ``required`` or a named function), which ends at the
token that closed its JSON object: then it is the tag that closes the call (``\n</tool_call>``), which the answer
showed and the policy did not generate (as the forced prefix before it is prompt text), less what that last token
held past the brace.

``new_messages_text`` is the template's rendering of the whole conversation less its rendering through that
assistant message; where the template renders the history differently once more follows (Qwen3's drops
earlier ``<think>`` reasoning), the new messages rendered after a fixed stand-in conversation instead. The
completion is never tokenized again: the policy's own tokens stay, whatever the template would have written in
their place. Only a real rewrite (an earlier message changed, dropped or summarised, an answer edited, the tools
changed) is rendered whole, which starts a new segment in the ledger (``gateway.token_ledger``).

Nothing here is random: the same calls give the same ids (given a template that is itself deterministic: one
that writes today's date changes with it), so a call answered again after a crash is spliced as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .protocol import ApiError, forced_closing, same_answer, same_history, template_messages

# (messages, tools, add_generation_prompt) -> the chat template's text
Template = Callable[[list, "list | None", bool], str]

SENTINEL = "VERLJ-SPLICE-SENTINEL"  # an assistant's content, to find what the template writes after one
# conversations the new messages are rendered after when the history's rendering moves (the first that renders and
# stays a prefix: one ending in a user message for templates that drop earlier reasoning, one ending in an
# assistant's for templates that make roles alternate)
STAND_INS = ([{"role": "user", "content": "-"}], [{"role": "user", "content": "-"}, {"role": "assistant", "content": "-"}])


@dataclass(frozen=True)
class Answered:
    """An earlier call of an episode, as a later call may continue it: its request's messages and tools, its
    prompt and completion ids, and the assistant message it was answered with."""

    messages: list
    tools: list | None
    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    answer: dict  # {"content": str | None, "tool_calls": [...], "finish_reason": str} (protocol.answered_message)
    forced: str = ""  # the text its answer was made to begin with (protocol.forced_prefix), "" for none


def continued(messages: list, tools: list | None, earlier: list[Answered]) -> int:
    """The earlier call a request continues (its messages, the answer, then at least one more), the latest with the
    longest history on a tie; -1 for none."""
    best, at = -1, -1
    for k, a in enumerate(earlier):
        m = len(a.messages)
        if (len(messages) > m + 1 and m >= best and a.tools == tools and same_history(messages[:m], a.messages)
                and same_answer(messages[m], a.answer)):
            best, at = m, k
    return at


class Prompts:
    """What turns a request into prompt ids: the chat template (`template`) and the tokenizer, a cap on the
    prompt's length (`max_prompt`, 0: none), and the splice."""

    def __init__(self, tokenizer, template: Template, max_prompt: int = 0):
        self.tok, self.template, self.max_prompt = tokenizer, template, max_prompt

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def render(self, messages: list, tools: list | None, generation_prompt: bool = True) -> str:
        try:
            return self.template(template_messages(messages), tools, generation_prompt)
        except Exception as e:  # noqa: BLE001 - the template (the tokenizer's jinja) refusing these messages
            raise ApiError(400, f"The chat template cannot render these messages: {str(e).splitlines()[0][:200]}", "messages") from None

    def ids(self, messages: list, tools: list | None, earlier: list[Answered], forced: str = "") -> np.ndarray:
        """A request's prompt ids: spliced onto the earlier call it continues, else rendered whole (the ledger reads
        which call a call continues from the ids themselves: gateway.token_ledger.parents). `forced`: text the answer must
        begin with, written after the generation prompt (tool_choice "required": the tool-call tag)."""
        k = continued(messages, tools, earlier)
        ids = self.spliced(messages, tools, earlier[k], forced) if k >= 0 else None
        if ids is None:
            ids = self.whole(messages, tools, forced)
        if self.max_prompt and len(ids) > self.max_prompt:
            raise ApiError(400, f"This conversation is {len(ids)} tokens, more than the {self.max_prompt} the model's context leaves "
                           "for a prompt (rollout.max_episode_length, or the model's positions, less rollout.max_response_length).",
                           "messages", "context_length_exceeded")
        return ids

    def whole(self, messages: list, tools: list | None, forced: str = "") -> np.ndarray:
        """The conversation rendered by the chat template and tokenized, <bos> first (as every prompt)."""
        text = self.render(messages, tools) + forced
        tok = self.tok
        ids = self.encode(text)
        if tok.bos_token_id is not None and not (tok.bos_token and text.startswith(tok.bos_token)):
            ids = [tok.bos_token_id] + ids
        return np.asarray(ids, np.int64)

    def spliced(self, messages: list, tools: list | None, a: Answered, forced: str = "") -> np.ndarray | None:
        """`a`'s prompt and completion ids, the end of its turn, then the new messages tokenized (None: the
        template cannot say where its assistant turn ends, or renders no new messages after it)."""
        m = len(a.messages)
        try:
            end = self.end_of_turn(messages[:m], tools, a.completion_ids)
            new = self.new_text(messages, m, tools)
        except ApiError:  # the template refuses a partial conversation: the whole one is rendered (or refused) instead
            return None
        if end is None or new is None:
            return None
        text = self.closing(a) + end + new + forced
        return np.concatenate([a.prompt_ids, a.completion_ids, np.asarray(self.encode(text), np.int64)]).astype(np.int64)

    def closing(self, a: Answered) -> str:
        """The text `a`'s answer showed after the policy's tokens when it was a forced tool call ended at its JSON's
        close (the tag that closes the call: protocol.forced_closing), else ""."""
        return forced_closing(a.forced, a.answer, a.completion_ids, self.decode)

    def decode(self, ids) -> str:
        """Completion ids as text, as the runner reads them (special tokens left out)."""
        return self.tok.decode([int(t) for t in ids], skip_special_tokens=True)

    def end_of_turn(self, before: list, tools: list | None, completion: np.ndarray) -> str | None:
        """What the template writes after an assistant message's content (ChatML: ``<|im_end|>\\n``), less the
        token the completion ended with when it begins it (the end-of-sequence token sampled)."""
        text = self.render([*before, {"role": "assistant", "content": SENTINEL}], tools, False)
        at = text.rfind(SENTINEL)
        if at < 0:
            return None
        end = text[at + len(SENTINEL):]
        if len(completion):
            last = self.tok.convert_ids_to_tokens(int(completion[-1]))
            if last in self.tok.all_special_tokens and end.startswith(last):
                end = end[len(last):]
        return end

    def new_text(self, messages: list, m: int, tools: list | None) -> str | None:
        """The template's text for messages[m+1:] and the generation prompt: the whole conversation's rendering
        less its rendering through messages[m] (the assistant answer); where that is not a prefix (the template
        renders history differently once more follows), the new messages rendered after a stand-in conversation."""
        through, whole = self.render(messages[: m + 1], tools, False), self.render(messages, tools)
        if whole.startswith(through):
            return whole[len(through):]
        for stand_in in STAND_INS:
            try:
                base, after = self.render(stand_in, tools, False), self.render([*stand_in, *messages[m + 1:]], tools)
            except ApiError:
                continue
            if after.startswith(base):
                return after[len(base):]
        return None
