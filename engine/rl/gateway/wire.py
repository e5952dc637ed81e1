"""What the gateway answers, whichever API a call came by (chat completions: ``gateway.protocol``; the Responses API:
``gateway.responses``): the response bytes, a token-by-token stream's events, and the answer read back from the
bytes a call journaled (for splicing the next call onto it, for ``inspect`` and ``export``)."""

from __future__ import annotations

from . import protocol, responses
from .protocol import RESPONSES, Answer, ChatRequest, Completion


def response_bytes(req: ChatRequest, c: Completion, cid: str) -> tuple[bytes, str]:
    """The exact bytes answered and the tool-call parser's flag."""
    return (responses.response_bytes if req.api == RESPONSES else protocol.response_bytes)(req, c, cid)


def head_event(req: ChatRequest, cid: str) -> bytes:
    """What a token-by-token stream sends with its first token."""
    return responses.head_events(req, cid) if req.api == RESPONSES else protocol.role_event(req, cid)


def piece_event(req: ChatRequest, cid: str, piece: str, index: int) -> bytes:
    """A token-by-token stream's `index`-th text delta."""
    return responses.piece_event(req, cid, piece, index) if req.api == RESPONSES else protocol.piece_event(req, cid, piece)


def answered_message(body: bytes) -> dict:
    """The assistant message a call answered: ``{"content", "tool_calls", "finish_reason"}`` (and a Responses answer's
    ``id``)."""
    return responses.answered(body) if responses.is_response(body) else protocol.answered_message(body)


def response_id(body: bytes) -> str | None:
    """A Responses answer's id (``resp_...``: what a later request's previous_response_id names); None for a chat
    completion's."""
    return responses.response_id(body) if responses.is_response(body) else None


def read_answer(body: bytes) -> Answer:
    """The answer, for reading: its text, its tool calls as ``name(arguments)``, its finish reason."""
    return protocol.answer_of(answered_message(body))
