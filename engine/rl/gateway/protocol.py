"""The OpenAI chat-completions protocol, as the gateway speaks it: requests parsed and checked
(:func:`parse_request`, every refusal an :class:`ApiError` shaped as OpenAI's errors), their canonical
form (what the journal keeps and hashes), the tool-call parser (hermes ``<tool_call>`` JSON), and the
response bytes, JSON or a server-sent event stream (:func:`response_bytes`).

No server and no model here: ``gateway.server`` serves these, ``gateway.runner`` generates.

What a request may say (anything else of the right type is accepted and ignored, as OpenAI's own
server ignores what a model does not use):

- ``model`` (the run's name, ``GET /v1/models``), ``messages`` (system, developer, user, assistant, tool;
  ``content`` a string or a list of text parts; an assistant's ``tool_calls``; a tool's ``tool_call_id``),
  ``tools`` (functions), ``tool_choice`` (``auto``, ``none``, ``required`` or a named function: :func:`forced_prefix`),
  ``max_tokens`` / ``max_completion_tokens``
  (capped at rollout.max_response_length), ``stop`` (a string or up to 4), ``logprobs`` / ``top_logprobs``,
  ``stream`` (with ``stream_options.include_usage``; token by token where the engine streams and the
  request has no tools in play, stop strings or log-probs: :func:`streams_tokens`).
- ``temperature``, ``top_p``, ``seed``, ``presence_penalty``, ``frequency_penalty`` and the like are read
  and ignored: the trainer's sampling settings (rollout.temperature, rollout.top_p) and each call's own
  seed decide every sample, so that what is trained on is what the policy would sample.
- What agent libraries send beside (the OpenAI Agents SDK's ``parallel_tool_calls``; ``store``,
  ``metadata``, ``user``, ``service_tier``, ``reasoning_effort``, ``prompt_cache_key``, ``verbosity``, and every
  other field openai-python's ``chat.completions.create`` sends) is checked for OpenAI's type
  (:data:`_OTHER_FIELDS`) and ignored: it decides nothing here (every tool call a completion holds is returned,
  whatever ``parallel_tool_calls`` says; nothing is stored).
- ``n`` other than 1 and ``response_format`` are refused (400), and so is a field no OpenAI client sends (a typo:
  ``tool_choise``), as OpenAI refuses it: "Unrecognized request argument supplied: tool_choise".
- A ``tool`` message must answer a tool call of an earlier assistant message in the request (by its
  ``tool_call_id``), as OpenAI requires (400).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

CHAT, RESPONSES = "chat", "responses"  # the two APIs a request may come by
MAX_BODY = 4 << 20  # bytes: a request body over this is refused (413)
ROLES = ("system", "developer", "user", "assistant", "tool")
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "top_logprobs", "n", "seed")
_NUM_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
OBJECT, ARRAY, STRING, BOOLEAN, INTEGER = ((dict,), "an object"), ((list,), "an array"), ((str,), "a string"), ((bool,), "a boolean"), \
    ((int,), "an integer")
# fields OpenAI accepts that decide nothing here: their type checked as OpenAI does, their value ignored
_OTHER_FIELDS = {"parallel_tool_calls": BOOLEAN, "store": BOOLEAN, "metadata": OBJECT, "user": STRING, "service_tier": STRING,
                 "reasoning_effort": STRING, "prompt_cache_key": STRING, "verbosity": STRING, "safety_identifier": STRING,
                 "prompt_cache_retention": STRING, "prompt_cache_options": OBJECT, "audio": OBJECT, "modalities": ARRAY,
                 "prediction": OBJECT, "logit_bias": OBJECT, "web_search_options": OBJECT, "moderation": OBJECT,
                 "functions": ARRAY, "function_call": ((str, dict), "a string or an object")}
# every field a request may send: those read here and those ignored. Any other is refused as OpenAI refuses it (400
# "Unrecognized request argument supplied"), so that a typo is said, not ignored; the list holds every body field of
# openai-python's chat.completions.create (tests/unit/test_gateway_sdk.py fails when the installed SDK knows one more)
CHAT_FIELDS = frozenset({"model", "messages", "tools", "tool_choice", "stop", "logprobs", "stream", "stream_options", "response_format",
                         *_INT_FIELDS, *_NUM_FIELDS, *_OTHER_FIELDS})


class ApiError(Exception):
    """A request refused: its HTTP status and OpenAI's error object (message, type, param, code)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}).encode()


def unauthorized() -> ApiError:
    return ApiError(401, "Incorrect API key provided: this key names no episode in flight (missing, wrong, or its episode is over).",
                    code="invalid_api_key", kind="authentication_error")


@dataclass(frozen=True)
class ChatRequest:
    """A checked request: what decides the generation and the response's shape."""

    model: str
    messages: list
    tools: list | None = None
    tool_choice: str | dict = "auto"  # auto | none | required | {"type": "function", "function": {"name": ...}}
    max_tokens: int | None = None
    stop: tuple = ()
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    ignored: dict = field(default_factory=dict)  # temperature, top_p, ...: read and not used (see the module's doc)
    api: str = CHAT  # CHAT (/v1/chat/completions) or RESPONSES (/v1/responses: gateway.responses)
    instructions: str | None = None  # responses: the system message that leads `messages` (not carried to the next response)
    previous_response_id: str | None = None  # responses: the episode's earlier response whose conversation `messages` continues

    @cached_property
    def _canonical(self) -> str:
        """The request as the journal keeps it: every field that decides the answer, keys sorted, no spaces."""
        d = {"model": self.model, "messages": self.messages, "tools": self.tools, "tool_choice": self.tool_choice,
             "max_tokens": self.max_tokens, "stop": list(self.stop), "logprobs": self.logprobs, "top_logprobs": self.top_logprobs,
             "stream": self.stream, "include_usage": self.include_usage}
        if self.api != CHAT:  # only then: a chat request keeps the form (and hash) it always had
            d.update(api=self.api, instructions=self.instructions, previous_response_id=self.previous_response_id)
        return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @cached_property
    def _digest(self) -> str:
        return hashlib.sha256(self._canonical.encode()).hexdigest()

    def canonical(self) -> str:
        """The request as the journal keeps it (made once a request)."""
        return self._canonical

    def digest(self) -> str:
        """The sha256 of its canonical form (made once a request)."""
        return self._digest


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def typed_field(body: dict, name: str, types: tuple, what: str) -> Any:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise bad_request(f"Invalid type for '{name}': expected {what}, but got {type(v).__name__}.", name)
    return v


def unrecognized(body: dict, known: frozenset) -> None:
    """A 400 for the first field of `body` that is not `known`, worded as OpenAI's (its param: the field)."""
    for k in body:
        if k not in known:
            raise bad_request(f"Unrecognized request argument supplied: {k}", k)


def _content(m: dict, i: int) -> str | None:
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
        return "".join(p["text"] for p in c)
    raise bad_request(f"Invalid 'messages[{i}].content': expected a string or a list of text parts.", f"messages[{i}].content")


def _tool_calls(calls: Any, i: int) -> list:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"Invalid '{where}': expected an array.", where)
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments", ""), str)):
            raise bad_request(f"Invalid '{where}[{k}]': expected {{id, type: function, function: {{name, arguments (a string)}}}}.", f"{where}[{k}]")
        out.append({"id": str(c.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}})
    return out


def _messages(raw: Any) -> list:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array of messages.", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad_request(f"Invalid 'messages[{i}].role': expected one of {', '.join(ROLES)}.", f"messages[{i}].role")
        msg: dict = {"role": m["role"], "content": _content(m, i)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        elif msg["content"] is None:
            raise bad_request(f"Invalid 'messages[{i}].content': a {m['role']} message needs content.", f"messages[{i}].content")
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad_request(f"Missing 'messages[{i}].tool_call_id': a tool message answers a tool call by its id.", f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    for i, call_id in unanswered(out):
        if not any(m.get("tool_calls") for m in out[:i]):
            raise bad_request("Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'.",
                              f"messages[{i}].role")
        raise bad_request(f"Invalid parameter: 'tool_call_id' of '{call_id}' not found in 'tool_calls' of any preceding message.",
                          f"messages[{i}].tool_call_id")
    return out


def unanswered(messages: list) -> list[tuple[int, str]]:
    """The tool messages (index, tool_call_id) that answer no tool call of an earlier assistant message."""
    made: set[str] = set()
    out = []
    for i, m in enumerate(messages):
        made.update(c["id"] for c in m.get("tool_calls") or ())
        if m["role"] == "tool" and m["tool_call_id"] not in made:
            out.append((i, m["tool_call_id"]))
    return out


def tools_of(raw: Any) -> list | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                                            and isinstance(t["function"].get("name"), str) for t in raw):
        raise bad_request("Invalid 'tools': expected an array of {type: function, function: {name, description, parameters}}.", "tools")
    return [{"type": "function", "function": t["function"]} for t in raw]


def _stop(raw: Any) -> tuple:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("Invalid 'stop': expected a string or an array of up to 4 non-empty strings.", "stop")
    return tuple(stops)


def tool_choice_of(raw: Any, tools: list | None, param: str) -> str | dict:
    """``auto``, ``none``, ``required`` or a named function (``{"type": "function", "function": {"name": ...}}``; the
    Responses API's ``{"type": "function", "name": ...}`` is read as the same), checked against the tools."""
    if raw in ("auto", "none"):
        return raw
    fn = raw.get("function", raw) if isinstance(raw, dict) and raw.get("type") == "function" else None
    named = fn.get("name") if isinstance(fn, dict) else None
    if raw != "required" and not isinstance(named, str):
        raise bad_request(f"Invalid '{param}': expected 'auto', 'none', 'required' or {{type: function, function: {{name}}}}.", param)
    offered = [t["function"]["name"] for t in tools or []]
    if not offered:
        raise bad_request(f"Invalid '{param}': {raw if raw == 'required' else 'a named function'} needs 'tools'.", param)
    if named is not None and named not in offered:
        raise bad_request(f"Invalid '{param}': the function '{named}' is not among the tools ({', '.join(offered)}).", param)
    return "required" if named is None else {"type": "function", "function": {"name": named}}


TOOL_OPEN, TOOL_CLOSE = "<tool_call>\n", "\n</tool_call>"  # what a forced call begins with, and what closes it (hermes)


def forced_prefix(req: ChatRequest) -> str:
    """The text an answer is made to begin with, written after the generation prompt (its tokens part of the prompt,
    masked from the loss): for tool_choice ``required`` the hermes tool-call tag, for a named function the tag and
    the call's name, so that the policy writes the call (its arguments, for a named one). "" for ``auto`` and ``none``.
    The call ends where its JSON object closes (``Runner.completion``: the tag that closes it is added, as the prefix
    was); a completion that does not close one that parses is answered as text, flagged ``malformed_tool_call``."""
    return forced_text(req.tools, req.tool_choice)


def forced_text(tools: list | None, choice: str | dict) -> str:
    """:func:`forced_prefix` of a request's tools and tool_choice (a canonical request's, too)."""
    if not tools or choice in ("auto", "none"):
        return ""
    if choice == "required":
        return TOOL_OPEN
    assert isinstance(choice, dict)
    return TOOL_OPEN + '{"name": ' + json.dumps(choice["function"]["name"], ensure_ascii=False) + ', "arguments":'


def object_end(text: str) -> int:
    """Where the JSON object `text` begins with (after any whitespace) closes: the index just past its closing brace,
    braces in strings (and escaped quotes) not counted. -1 when it never closes, or `text` begins with anything else.
    Only where it ends: whether it parses is the tool-call parser's business."""
    depth, quoted, escaped = 0, False, False
    for i, ch in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == "{":
            depth += 1
        elif depth == 0:
            if not ch.isspace():
                return -1
        elif ch == '"':
            quoted = True
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def forced_closing(forced: str, answer: dict, ids: Any, decode: Callable[[Any], str]) -> str:
    """What a forced tool call's answer showed after its completion ids (`decode` reads them as the runner does): the
    tag that closes the call (:data:`TOOL_CLOSE`), less what the token that closed its JSON held past the brace, when
    the call ended there (``Runner.completion``). "" for any other call: not forced, an answer that shows no closing
    tag (cut at its length or at a stop string), or a JSON that closed before the last token (a call journaled before
    forced calls ended at their JSON, which wrote its own closing tag)."""
    if not forced or not len(ids) or not (answer.get("tool_calls") or (answer.get("content") or "").endswith(TOOL_CLOSE)):
        return ""
    head = forced[len(TOOL_OPEN):]
    text = head + decode(ids)
    end = object_end(text)
    if end < 0 or object_end(head + decode(ids[:-1])) >= 0:
        return ""
    past = text[end:]
    return TOOL_CLOSE[len(past):] if TOOL_CLOSE.startswith(past) else TOOL_CLOSE


def request_object(body: bytes, model: str) -> tuple[dict, str]:
    """A request body as its JSON object and the model it names (either API's), or an ApiError: 413 too large, 400
    not a JSON object or no model, 404 another model."""
    if len(body) > MAX_BODY:
        raise ApiError(413, f"The request body is {len(body)} bytes, more than the gateway's limit of {MAX_BODY}.")
    try:
        d = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("We could not parse the JSON body of your request. The body must be a JSON object.") from None
    if not isinstance(d, dict):
        raise bad_request("The body of your request must be a JSON object.")
    name = typed_field(d, "model", (str,), "a string")
    if name is None:
        raise bad_request("Missing required parameter: 'model'.", "model")
    if name != model:
        raise ApiError(404, f"The model `{name}` does not exist; this gateway serves `{model}` (GET /v1/models).", "model", "model_not_found")
    return d, name


def parse_request(body: bytes, model: str) -> ChatRequest:
    """A request body checked, or an ApiError (400 malformed or refused, 404 another model, 413 too large)."""
    d, name = request_object(body, model)
    unrecognized(d, CHAT_FIELDS)
    for k in _INT_FIELDS:
        typed_field(d, k, (int,), "an integer")
    for k in _NUM_FIELDS:
        typed_field(d, k, (int, float), "a number")
    for k, (types, what) in _OTHER_FIELDS.items():
        typed_field(d, k, types, what)
    if d.get("n") not in (None, 1):
        raise bad_request("'n' must be 1: each call of an episode is one sample of the policy (call again for another).", "n")
    if d.get("response_format") is not None:
        raise bad_request("'response_format' is not supported: the policy is trained on what it samples, unconstrained.", "response_format")
    tools = tools_of(d.get("tools"))
    choice = tool_choice_of(d.get("tool_choice", "auto"), tools, "tool_choice")
    max_tokens = d.get("max_completion_tokens", d.get("max_tokens"))
    if max_tokens is not None and max_tokens < 1:
        raise bad_request("Invalid 'max_tokens': expected at least 1.", "max_tokens")
    top = d.get("top_logprobs") or 0
    if not 0 <= top <= 20:
        raise bad_request("Invalid 'top_logprobs': expected an integer from 0 to 20.", "top_logprobs")
    stream = typed_field(d, "stream", (bool,), "a boolean") or False
    logprobs = typed_field(d, "logprobs", (bool,), "a boolean") or False
    opts = typed_field(d, "stream_options", (dict,), "an object") or {}
    return ChatRequest(model=name, messages=_messages(d.get("messages")), tools=tools, tool_choice=choice,
                       max_tokens=max_tokens, stop=_stop(d.get("stop")), logprobs=logprobs, top_logprobs=int(top), stream=stream,
                       include_usage=bool(opts.get("include_usage")) and stream,
                       ignored={k: d[k] for k in _NUM_FIELDS + ("seed",) if k in d})


# ----------------------------------------------------------------------------- tool calls

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Parsed:
    """A completion's text read by a tool-call parser: the content left, the calls, and a flag
    ("malformed_tool_call": it looks like a tool call and does not parse; "" else)."""

    content: str | None
    tool_calls: list
    flag: str = ""


def hermes(text: str, call_id: str, offered: frozenset[str] | set[str]) -> Parsed:
    """Hermes-style tool calls: each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` a call.
    Text outside the tags is the content (None when only whitespace is left). A block is a call only when it is
    exactly ``name`` (one of the `offered` tools) and ``arguments`` (an object, or a JSON string of one), as OpenAI's
    tool calls are; one that is not makes the completion malformed (answered as text, flagged)."""
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        return Parsed(text, [], "malformed_tool_call" if "<tool_call>" in text else "")
    calls = []
    for k, b in enumerate(blocks):
        try:
            d = json.loads(b)
            args = d["arguments"] if isinstance(d, dict) else None
            ok = (isinstance(d, dict) and set(d) == {"name", "arguments"} and d["name"] in offered
                  and (isinstance(args, dict) or isinstance(args, str) and isinstance(json.loads(args), dict)))
        except (ValueError, KeyError, TypeError):  # not JSON, no arguments, an unhashable name
            ok = False
        if not ok:
            return Parsed(text, [], "malformed_tool_call")
        calls.append({"id": f"call_{call_id}_{k}", "type": "function",
                      "function": {"name": d["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
    rest = _TOOL_CALL.sub("", text).strip()
    return Parsed(rest or None, calls)


PARSERS = {"hermes": hermes}


def render_tool_calls(calls: list) -> str:
    """An assistant message's tool calls as hermes text (for a template that has no tool syntax of its own)."""
    out = []
    for c in calls:
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
        except ValueError:
            args = c["function"]["arguments"]
        out.append("<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": args}, ensure_ascii=False) + "</tool_call>")
    return "".join(out)


def template_messages(messages: list) -> list:
    """A request's messages for a chat template: an assistant's tool calls written into its content as hermes text."""
    return [{"role": m["role"], "content": (m["content"] or "") + render_tool_calls(m.get("tool_calls", []))}
            if m.get("tool_calls") else m for m in messages]


# ----------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class Completion:
    """What the model answered one call: the text (cut at a stop string), the tokens' texts and
    log-probs (those shown), why it ended, the token counts."""

    text: str
    tokens: list  # str per completion token shown (up to a stop string)
    logprobs: list  # float per token shown
    finish_reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int
    pieces: tuple = ()  # a token-by-token stream's text deltas, one a token ("" for none): see `streams_tokens`


def streams_tokens(req: ChatRequest) -> bool:
    """Whether a request's stream sends its text token by token, as it is generated: a stream without
    tools in play, stop strings or log-probs (each of those decides what is sent only once the whole
    completion is known: a tool call is parsed, a stop string cuts the text). The others are streamed
    whole, after generation. Either way the bytes are the same whenever the call is answered."""
    return req.stream and not req.logprobs and not req.stop and not (req.tools and req.tool_choice != "none")


class TextStream:
    """A completion's text token by token (`feed` a token id, get its text delta, "" while a character is
    incomplete): the text of a window of recent tokens is decoded and what it adds is the delta, so that
    no token's text depends on how the tokenizer joins it to the ones long before."""

    def __init__(self, decode: Callable[[list], str]):
        self.decode, self.ids, self.prefix, self.read = decode, list[int](), 0, 0

    def feed(self, token: int) -> str:
        self.ids.append(int(token))
        before = self.decode(self.ids[self.prefix : self.read])
        now = self.decode(self.ids[self.prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]


def token_deltas(c: Completion) -> list[str]:
    """A token-by-token stream's text deltas: a delta a token, as they were sent while generating, then what they
    miss of the text (none empty)."""
    sent = "".join(c.pieces)
    return [p for p in ([*c.pieces, c.text[len(sent):]] if c.text.startswith(sent) else c.pieces) if p]


def sse_event(d: dict) -> bytes:
    return f"data: {json.dumps(d, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def stream_head(req: ChatRequest, call_id: str) -> dict:
    """A stream's chunk fields (every event has them)."""
    return {"id": f"chatcmpl-{call_id}", "created": 0, "model": req.model, "system_fingerprint": "verlj", "object": "chat.completion.chunk"}


def role_event(req: ChatRequest, call_id: str) -> bytes:
    """A stream's first event: the assistant's role."""
    return sse_event({**stream_head(req, call_id), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                                              "finish_reason": None}]})


def piece_event(req: ChatRequest, call_id: str, piece: str) -> bytes:
    """A token-by-token stream's event for one text delta."""
    return sse_event({**stream_head(req, call_id), "choices": [{"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}]})


def _logprobs(req: ChatRequest, c: Completion) -> dict | None:
    if not req.logprobs:
        return None
    # top_logprobs: the sampled token only (verlj's samplers keep no alternatives; say so, never invent them)
    return {"content": [{"token": t, "logprob": float(lp), "bytes": list(t.encode()),
                         "top_logprobs": [{"token": t, "logprob": float(lp), "bytes": list(t.encode())}] if req.top_logprobs else []}
                        for t, lp in zip(c.tokens, c.logprobs)], "refusal": None}


def message(req: ChatRequest, c: Completion, call_id: str, parser: str = "hermes") -> tuple[dict, str, str]:
    """(the assistant message, its finish_reason, the parser's flag) of a completion."""
    offered = frozenset(t["function"]["name"] for t in req.tools or ())
    parsed = PARSERS[parser](c.text, call_id, offered) if req.tools and req.tool_choice != "none" else Parsed(c.text, [])
    msg: dict = {"role": "assistant", "content": parsed.content, "refusal": None}
    if parsed.tool_calls:
        msg["tool_calls"] = parsed.tool_calls
    finish = "tool_calls" if parsed.tool_calls and c.finish_reason == "stop" else c.finish_reason
    return msg, finish, parsed.flag


def _usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens, "total_tokens": c.prompt_tokens + c.completion_tokens}


def response_bytes(req: ChatRequest, c: Completion, call_id: str, parser: str = "hermes") -> tuple[bytes, str]:
    """The exact bytes answered (a JSON object, or an SSE stream ending ``data: [DONE]``) and the parser's flag.
    Deterministic: the id comes from the call (its seed), ``created`` is 0, so a call made again answers the same bytes."""
    msg, finish, flag = message(req, c, call_id, parser)
    head = {"id": f"chatcmpl-{call_id}", "created": 0, "model": req.model, "system_fingerprint": "verlj"}
    lp = _logprobs(req, c)
    if not req.stream:
        body = {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish}], "usage": _usage(c)}
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(), flag
    chunk = stream_head(req, call_id)
    deltas: list[dict] = []
    if streams_tokens(req):
        deltas += [{"delta": {"content": p}, "logprobs": None, "finish_reason": None} for p in token_deltas(c)]
    elif msg["content"]:
        deltas.append({"delta": {"content": msg["content"]}, "logprobs": lp, "finish_reason": None})
    for k, tc in enumerate(msg.get("tool_calls", [])):
        deltas.append({"delta": {"tool_calls": [{"index": k, **tc}]}, "logprobs": None, "finish_reason": None})
    deltas.append({"delta": {}, "logprobs": None, "finish_reason": finish})
    events = [{**chunk, "choices": [{"index": 0, **d}]} for d in deltas]
    if req.include_usage:
        events.append({**chunk, "choices": [], "usage": _usage(c)})
    return role_event(req, call_id) + b"".join(map(sse_event, events)) + b"data: [DONE]\n\n", flag


def models_body(model: str) -> bytes:
    return json.dumps({"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "verlj"}]}).encode()


@dataclass(frozen=True)
class Answer:
    """A response as the agent read it: its text, its tool calls (``name(arguments)``), its finish reason."""

    content: str
    tool_calls: tuple[str, ...]
    finish_reason: str


def same_answer(sent: dict, answer: dict) -> bool:
    """Whether a message sent back is the assistant message answered (:func:`answered_message`): its content (None and
    "" alike) and its tool calls by name and arguments, as the gateway sent them. Not by id: a call's id is never
    rendered into tokens (:func:`template_messages` writes the name and arguments), so an agent that gives the calls
    ids of its own sends back the tokens it was answered."""
    if sent.get("role") != "assistant" or (sent.get("content") or "") != (answer.get("content") or ""):
        return False
    return rendered_calls(sent) == rendered_calls(answer)


def rendered_calls(m: dict) -> list[tuple[str, str]]:
    """A message's tool calls as they are rendered: (name, arguments), never the id."""
    return [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()]


def same_history(a: list, b: list) -> bool:
    """Whether two conversations render alike: the same messages, an assistant's tool calls compared by name and
    arguments only (:func:`same_answer`); a tool message's ``tool_call_id`` is compared as sent (a template may write it)."""
    return len(a) == len(b) and all(x == y or _rendered(x) == _rendered(y) for x, y in zip(a, b))


def _rendered(m: dict) -> dict:
    return {**m, "tool_calls": rendered_calls(m)} if m.get("tool_calls") else m


@dataclass(frozen=True)
class Conversation:
    """A journaled call's (canonical) request, as a later call reads it: its messages, tools and instructions (the
    Responses API's system message that leads the messages; None for a chat completion), and the text its answer was
    made to begin with (:func:`forced_prefix`; "" for none)."""

    messages: list
    tools: list | None
    instructions: str | None
    forced: str = ""

    @property
    def own(self) -> list:
        """The messages less the system message its instructions lead with."""
        return self.messages[1:] if self.instructions is not None else self.messages


def conversation(canonical: str) -> Conversation:
    d = json.loads(canonical)
    return Conversation(d["messages"], d["tools"], d.get("instructions"), forced_text(d["tools"], d["tool_choice"]))


def answered_message(body: bytes) -> dict:
    """The assistant message in response bytes (:func:`response_bytes`'s): a JSON object, or a stream's deltas put
    together; ``{"content": str | None, "tool_calls": [...], "finish_reason": str}``."""
    text = body.decode()
    if text.startswith("data: "):
        chunks = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
        choices = [ch["choices"][0] for ch in chunks if ch["choices"]]
        content = "".join(ch["delta"].get("content") or "" for ch in choices)
        tools = [{k: t[k] for k in ("id", "type", "function")} for ch in choices for t in ch["delta"].get("tool_calls") or []]
        finish = next((ch["finish_reason"] for ch in choices if ch["finish_reason"]), "")
        return {"content": content or None, "tool_calls": tools, "finish_reason": finish}
    choice = json.loads(text)["choices"][0]
    return {"content": choice["message"]["content"], "tool_calls": choice["message"].get("tool_calls") or [],
            "finish_reason": choice["finish_reason"]}


def answer_of(m: dict) -> Answer:
    """An answered message (:func:`answered_message`'s) for reading: its text, tool calls as ``name(arguments)``, finish."""
    return Answer(m["content"] or "", tuple(f"{t['function']['name']}({t['function']['arguments']})" for t in m["tool_calls"]),
                  m["finish_reason"])


@dataclass(frozen=True)
class ToolCall:
    """An assistant's tool call, as a request sends it back: its id, the function's name, its arguments (JSON text)."""

    id: str
    name: str
    arguments: str

    @classmethod
    def of(cls, c: dict) -> ToolCall:
        return cls(str(c.get("id", "")), c["function"]["name"], c["function"].get("arguments", ""))


@dataclass(frozen=True)
class Message:
    """A chat message as the gateway keeps it (a canonical request's, or an answer's, :func:`answered_message`): its
    role, its content (None: none), an assistant's tool calls, a tool message's call id."""

    role: str
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    @classmethod
    def of(cls, m: dict) -> Message:
        return cls(m["role"], m.get("content"), tuple(ToolCall.of(c) for c in m.get("tool_calls") or ()), m.get("tool_call_id"))


def last_sent(request: str) -> str:
    """A canonical request's last message, as ``role: content``."""
    last = json.loads(request)["messages"][-1]
    return f"{last['role']}: {last['content'] or ''}"
