"""The OpenAI Responses API, as the gateway speaks it (``POST /v1/responses``: what the OpenAI Agents SDK's default
model sends): a request read into the same checked form as a chat completion's (:class:`protocol.ChatRequest`,
``api="responses"``), so that it is rendered, spliced, generated, journaled and answered from the journal as one
is; and the answer written as a Responses object, JSON or a stream of its events.

What a request may say:

- ``input``: a string (a user message), or a list of items: messages (``role`` user, system, developer or
  assistant; ``content`` a string or a list of ``input_text`` / ``output_text`` parts), ``function_call`` items (an
  assistant's tool calls: ``call_id``, ``name``, ``arguments``) and ``function_call_output`` items (a tool's result:
  ``call_id``, ``output``). Consecutive assistant messages and function calls are one assistant message with its
  tool calls, as a chat completion has them; an item of another type is refused (400 naming it).
- ``instructions`` (the system message that leads, for this response only), ``tools`` (function tools:
  ``{type: function, name, description, parameters, strict}``; other tool types are refused), ``tool_choice``
  (``auto``, ``none``, ``required`` or ``{type: function, name}``: ``protocol.forced_prefix``),
  ``max_output_tokens`` (capped at rollout.max_response_length), ``stream``.
- ``previous_response_id``: an earlier response of the same episode; the request's input continues that
  response's conversation (its input, less its instructions, then its output). The gateway keeps no response
  past its episode, so another episode's or an unknown id is refused (400 ``previous_response_not_found``), as is
  ``conversation`` (a server-side conversation) and a stored ``prompt``.
- ``include`` with ``message.output_text.logprobs``: the output text's tokens with their log-probs (``top_logprobs``:
  the sampled token only, as a chat completion's: verlj's samplers keep no alternatives); what else it names is ignored.
- What the Agents SDK and others send beside (``metadata``, ``store``, ``parallel_tool_calls``, ``truncation``,
  ``reasoning``, ``temperature``, ``top_p``, ``user``, ``service_tier``, ``prompt_cache_key``, ..., every other field
  openai-python's ``responses.create`` sends) is checked for its type and ignored; ``text.format`` other than ``text``
  is refused as ``response_format`` is, and a field no OpenAI client sends as OpenAI refuses it (400 "Unrecognized
  request argument supplied").
- A ``function_call_output`` must answer a ``function_call`` of the input or of the previous response's conversation
  (by its ``call_id``), as OpenAI requires (400).

The answer: ``resp_ID`` with its output items (a ``message`` with one ``output_text``, then a ``function_call`` a
tool call, ids from the call's seed), ``status`` ``completed``, or ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``) when the output was cut at its length; the usage in tokens. A stream sends OpenAI's events in
order (``response.created``, ``response.in_progress``, each item's ``output_item.added``, its text or arguments
deltas and ``done`` events, ``output_item.done``, then ``response.completed`` or ``response.incomplete``), each
``event: TYPE`` and ``data: JSON`` with its ``sequence_number``; token by token where a chat stream would be
(``protocol.streams_tokens``).
"""

from __future__ import annotations

import json
from typing import Any

from .protocol import (
    ARRAY,
    BOOLEAN,
    INTEGER,
    OBJECT,
    RESPONSES,
    STRING,
    ApiError,
    ChatRequest,
    Completion,
    bad_request,
    message,
    request_object,
    streams_tokens,
    token_deltas,
    tool_choice_of,
    typed_field,
    unanswered,
    unrecognized,
)

# fields accepted and ignored: their type checked as OpenAI does
_IGNORED = {"metadata": OBJECT, "store": BOOLEAN, "parallel_tool_calls": BOOLEAN, "truncation": STRING, "reasoning": OBJECT,
            "temperature": ((int, float), "a number"), "top_p": ((int, float), "a number"), "user": STRING, "service_tier": STRING,
            "prompt_cache_key": STRING, "safety_identifier": STRING, "prompt_cache_retention": STRING, "prompt_cache_options": OBJECT,
            "max_tool_calls": INTEGER, "background": BOOLEAN, "background_options": OBJECT, "text": OBJECT, "stream_options": OBJECT,
            "context_management": ARRAY, "image": OBJECT, "moderation": OBJECT, "access_programs": OBJECT}
# every field a request may send (those read, those refused with a reason, those ignored); any other is refused as
# OpenAI refuses it. It holds every body field of openai-python's responses.create (tests/unit/test_gateway_sdk.py)
FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "tools", "tool_choice", "stream", "previous_response_id",
                    "include", "top_logprobs", "conversation", "prompt", *_IGNORED})
LOGPROBS = "message.output_text.logprobs"  # what `include` names to have the output text's log-probs
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise bad_request(f"Invalid '{where}': expected a string or a list of input_text / output_text parts.", where)


def _items(raw: Any) -> list:
    """`input` as chat messages: an assistant's message and its function calls one assistant message."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("'input' must be a string or a non-empty array of input items.", "input")
    out: list[dict] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"Invalid '{where}.role': expected user, system, developer or assistant.", f"{where}.role")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant" and out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                out[-1]["content"] = (out[-1]["content"] or "") + text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_request(f"Invalid '{where}': a function_call has call_id, name and arguments (strings).", where)
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"Invalid '{where}.call_id': a function_call_output answers a function_call by its call_id.",
                                  f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise bad_request(f"Invalid '{where}': input items of type {kind!r} are not supported here (messages, function_call, "
                              "function_call_output).", where)
    return out


def _tools(raw: Any) -> list | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str) for t in raw):
        raise bad_request("Invalid 'tools': only function tools are supported here ({type: function, name, description, parameters}).",
                          "tools")
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}} for t in raw]


def parse_responses(body: bytes, model: str) -> ChatRequest:
    """A ``/v1/responses`` body checked, as the request it asks for (``api="responses"``; its
    previous_response_id resolved later, by the episode that holds that response: :func:`continued`)."""
    d, name = request_object(body, model)
    unrecognized(d, FIELDS)
    for k, (types, what) in _IGNORED.items():
        typed_field(d, k, types, what)
    include = typed_field(d, "include", *ARRAY) or []
    if not all(isinstance(x, str) for x in include):
        raise bad_request("Invalid 'include': expected an array of strings.", "include")
    top = typed_field(d, "top_logprobs", *INTEGER) or 0
    if not 0 <= top <= 20:
        raise bad_request("Invalid 'top_logprobs': expected an integer from 0 to 20.", "top_logprobs")
    logprobs = LOGPROBS in include
    for k in ("conversation", "prompt"):
        if d.get(k) is not None:
            raise bad_request(f"'{k}' is not supported: the gateway keeps no conversations or prompts; send the input (or "
                              "previous_response_id within the episode).", k)
    if d.get("background"):
        raise bad_request("'background' is not supported: each call of an episode is answered when it is generated.", "background")
    fmt = (d.get("text") or {}).get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("'text.format' other than text is not supported: the policy is trained on what it samples, unconstrained.",
                          "text.format")
    instructions = typed_field(d, "instructions", (str,), "a string")
    max_tokens = typed_field(d, "max_output_tokens", (int,), "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request("Invalid 'max_output_tokens': expected at least 1.", "max_output_tokens")
    tools = _tools(d.get("tools"))
    messages = _items(d.get("input"))
    previous = typed_field(d, "previous_response_id", (str,), "a string")
    if previous is None:  # else checked once that response's conversation leads them (`continued`)
        answered_calls(messages)
    return ChatRequest(model=name, messages=([{"role": "system", "content": instructions}] if instructions is not None else []) + messages,
                       tools=tools, tool_choice=tool_choice_of(d.get("tool_choice", "auto"), tools, "tool_choice"), max_tokens=max_tokens,
                       logprobs=logprobs, top_logprobs=top if logprobs else 0,  # without log-probs it decides nothing: not kept
                       stream=bool(typed_field(d, "stream", (bool,), "a boolean")), api=RESPONSES, instructions=instructions,
                       previous_response_id=previous, ignored={k: d[k] for k in ("temperature", "top_p") if k in d})


def answered_calls(messages: list) -> None:
    """A 400, worded as OpenAI's, for a function_call_output that answers no function_call before it."""
    if bad := unanswered(messages):
        raise bad_request(f"No tool call found for function call output with call_id {bad[0][1]}.", "input")


def continued(req: ChatRequest, earlier: list[tuple[str, list, dict]]) -> list:
    """The messages of a request with a previous_response_id: that response's conversation (its messages less its
    instructions, then its answer), then this request's input, led by this request's instructions. `earlier`: the
    episode's responses so far, (id, messages less instructions, the answered assistant message)."""
    found = [(messages, answer) for rid, messages, answer in earlier if rid == req.previous_response_id]
    if not found:
        raise ApiError(400, f"Previous response with id '{req.previous_response_id}' not found: only this episode's own responses "
                       "can be continued.", "previous_response_id", "previous_response_not_found")
    messages, answer = found[-1]
    said = [{"role": "assistant", "content": answer["content"], **({"tool_calls": answer["tool_calls"]} if answer["tool_calls"] else {})}]
    lead = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    out = lead + messages + said + own_messages(req)
    answered_calls(out)
    return out


def own_messages(req: ChatRequest) -> list:
    """A request's messages less the system message its instructions lead with."""
    return req.messages[1:] if req.instructions is not None else req.messages


# ----------------------------------------------------------------------------- the answer


def _tool_choice(req: ChatRequest) -> Any:
    c = req.tool_choice
    return {"type": "function", "name": c["function"]["name"]} if isinstance(c, dict) else c


def _response(req: ChatRequest, c: Completion | None, cid: str, items: list, status: str) -> dict:
    usage = None if c is None else {"input_tokens": c.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                                    "output_tokens": c.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                                    "total_tokens": c.prompt_tokens + c.completion_tokens}
    return {"id": f"resp_{cid}", "object": "response", "created_at": 0, "status": status, "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_tokens, "model": req.model, "output": items,
            "parallel_tool_calls": True, "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": None, "text": {"format": {"type": "text"}}, "tool_choice": _tool_choice(req),
            "tools": [{"type": "function", **t["function"]} for t in req.tools or []], "top_p": None, "truncation": "disabled",
            "usage": usage, "user": None, "metadata": {}}


def _logprobs(req: ChatRequest, c: Completion, part: bool) -> list:
    """The output text's tokens and log-probs (``include``: message.output_text.logprobs; [] without), as OpenAI's
    Responses types have them: an ``output_text`` part's with each token's bytes, a stream's text events' without.
    ``top_logprobs``: the sampled token only, as a chat completion's (verlj's samplers keep no alternatives)."""
    if not req.logprobs:
        return []
    out = []
    for t, lp in zip(c.tokens, c.logprobs):
        one = {"token": t, "logprob": float(lp), **({"bytes": list(t.encode())} if part else {})}
        out.append({**one, "top_logprobs": [one] if req.top_logprobs else []})
    return out


def _items_of(req: ChatRequest, c: Completion, cid: str) -> tuple[list, str, str]:
    """(the output items, the response's status, the parser's flag) of a completion."""
    msg, finish, flag = message(req, c, cid)
    items = []
    if msg["content"] is not None or not msg.get("tool_calls"):
        items.append({"id": f"msg_{cid}", "type": "message", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": msg["content"] or "", "annotations": [], "logprobs": _logprobs(req, c, True)}]})
    for k, tc in enumerate(msg.get("tool_calls", [])):
        items.append({"id": f"fc_{cid}_{k}", "type": "function_call", "status": "completed", "call_id": tc["id"],
                      "name": tc["function"]["name"], "arguments": tc["function"]["arguments"]})
    return items, "incomplete" if finish == "length" else "completed", flag


class _Events:
    """A stream's events in order, each with its sequence number."""

    def __init__(self, start: int = 0, sent: bytes = b""):
        """`sent`: the events already sent (a token-by-token stream's head), `start` events in all."""
        self.n, self.out = start, sent

    def add(self, kind: str, **fields: Any) -> _Events:
        data = json.dumps({"type": kind, "sequence_number": self.n, **fields}, ensure_ascii=False, separators=(",", ":"))
        self.out += f"event: {kind}\ndata: {data}\n\n".encode()
        self.n += 1
        return self


def head_events(req: ChatRequest, cid: str) -> bytes:
    """A token-by-token stream's first events (before its first text delta): the response begun, its message item and
    text part opened."""
    begun = _response(req, None, cid, [], "in_progress")
    item = {"id": f"msg_{cid}", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    return (_Events().add("response.created", response=begun).add("response.in_progress", response=begun)
            .add("response.output_item.added", output_index=0, item=item)
            .add("response.content_part.added", item_id=f"msg_{cid}", output_index=0, content_index=0,
                 part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}).out)


HEAD = 4  # the events head_events sends


def piece_event(req: ChatRequest, cid: str, piece: str, index: int) -> bytes:
    """A token-by-token stream's `index`-th text delta."""
    return _Events(HEAD + index).add("response.output_text.delta", item_id=f"msg_{cid}", output_index=0, content_index=0, delta=piece,
                                     logprobs=[]).out


def response_bytes(req: ChatRequest, c: Completion, cid: str) -> tuple[bytes, str]:
    """The exact bytes answered (a Responses object, or a stream of its events) and the parser's flag. Deterministic,
    as a chat completion's are; a token-by-token stream's bytes begin with the events sent while it was generated."""
    items, status, flag = _items_of(req, c, cid)
    whole = _response(req, c, cid, items, status)
    if not req.stream:
        return json.dumps(whole, ensure_ascii=False, separators=(",", ":")).encode(), flag
    ev = _Events(HEAD, head_events(req, cid)) if streams_tokens(req) else _Events()
    if not streams_tokens(req):
        begun = _response(req, None, cid, [], "in_progress")
        ev.add("response.created", response=begun).add("response.in_progress", response=begun)
    for i, item in enumerate(items):
        if item["type"] == "message":
            iid, text = item["id"], item["content"][0]["text"]
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            if streams_tokens(req):  # a delta a token, as sent while generating; what they miss of the text, last
                deltas = token_deltas(c)
            else:
                ev.add("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "content": []})
                ev.add("response.content_part.added", item_id=iid, output_index=i, content_index=0, part=part)
                deltas = [text]
            lps = _logprobs(req, c, False)  # with log-probs the text is one delta (streamed whole: streams_tokens)
            for d in deltas:
                if d:
                    ev.add("response.output_text.delta", item_id=iid, output_index=i, content_index=0, delta=d, logprobs=lps)
            ev.add("response.output_text.done", item_id=iid, output_index=i, content_index=0, text=text, logprobs=lps)
            ev.add("response.content_part.done", item_id=iid, output_index=i, content_index=0, part=item["content"][0])
        else:
            ev.add("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "arguments": ""})
            ev.add("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=item["arguments"])
            ev.add("response.function_call_arguments.done", item_id=item["id"], output_index=i, name=item["name"],
                   arguments=item["arguments"])
        ev.add("response.output_item.done", output_index=i, item=item)
    ev.add(f"response.{status}", response=whole)
    return ev.out, flag


def read_response(body: bytes) -> dict:
    """The Responses object in response bytes: the JSON, or the one a stream's last event carries."""
    text = body.decode()
    if not text.startswith("event: "):
        return json.loads(text)
    last = [e for e in text.split("\n\n") if e.startswith("event: ")][-1]
    return json.loads(last.split("\ndata: ", 1)[1])["response"]


def response_id(body: bytes) -> str:
    return read_response(body)["id"]


def answered(body: bytes) -> dict:
    """The assistant message in a Responses answer, as protocol.answered_message gives a chat completion's: its text,
    its tool calls as a chat message has them, a finish reason (tool_calls, length or stop), and the response's id."""
    r = read_response(body)
    text = [p["text"] for item in r["output"] if item["type"] == "message" for p in item["content"] if p["type"] == "output_text"]
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in r["output"] if item["type"] == "function_call"]
    finish = "tool_calls" if calls else "length" if r["status"] == "incomplete" else "stop"
    return {"content": "".join(text) if text else None, "tool_calls": calls, "finish_reason": finish, "id": r["id"]}


def is_response(body: bytes) -> bool:
    """Whether response bytes are a Responses answer (else a chat completion's)."""
    return body.startswith(b"event: ") or body.startswith(b'{"id":"resp_')
