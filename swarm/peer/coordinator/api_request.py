"""The OpenAI request model of the coordinator's API: what a body may hold, checked field by field.

:func:`parse_chat_request` (``POST /v1/chat/completions``) and :func:`parse_completion_request`
(``POST /v1/completions``) turn a decoded JSON body into a :class:`ChatRequest` or raise
:class:`ApiError` (400, OpenAI's error shape) naming the field — a bad value, or a field this
server does not serve (:data:`NOT_SERVED`, unknown fields: never silently ignored); :class:`StopMatcher` applies a
request's ``stop`` strings to the text as it streams. Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swarm.compute.sampling import MAX_LOGIT_BIAS, MAX_PENALTY
from swarm.compute.textgen import MAX_TEMPERATURE
from swarm.errors import SwarmError

MAX_BODY_BYTES = 1 << 20
MAX_MESSAGES = 512
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_TOOLS = 128  # as OpenAI
DEFAULT_MAX_TOKENS = 512  # a ChatRequest made in process without one; the API's requests take the context's
ROLES = ("system", "developer", "user", "assistant", "tool")


# ---------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body.

    ``messages``: ``[{"role", "content": str}]`` (``developer`` is mapped to ``system``,
    content parts are joined); ``temperature`` in [0, 2] (0: greedy); ``top_p`` in (0, 1];
    ``max_tokens`` ≥ 1 (``max_tokens_set``: the client chose it; else it shrinks to what the
    context leaves); ``stop``: up to 4 non-empty strings that end the reply (not included);
    ``prompt``: the raw prompt of ``POST /v1/completions`` (then encoded as is, without the
    chat template; ``messages`` holds it as one user message);
    ``prompt_ids``: the encoded, checked prompt once :meth:`ChatBackend.prepare` ran;
    ``presence_penalty``, ``frequency_penalty`` in [-2, 2] and ``logit_bias`` (``(id, bias)``)
    adjust the logits before sampling; ``logprobs``: None reports no logprobs, ``k`` ≥ 0 each
    token's and its ``k`` most likely alternatives' (chat's ``top_logprobs``, completions'
    ``logprobs``); ``json_schema``: the JSON schema (as JSON text) the reply must follow
    (``response_format``; ``{"type": "object"}`` for ``json_object``), compiled by
    :meth:`ChatBackend.prepare` into ``constraint``; ``tools`` (OpenAI's function tools),
    ``tool_choice`` (``none``, ``auto``, ``required``, or ``function``: the one named
    ``tool_name``) — messages may then carry an assistant's ``tool_calls`` and ``tool`` results.
    """

    messages: tuple[dict[str, Any], ...]
    model: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # an extension (as vLLM's): keep the k most likely tokens; 0 = all
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    max_tokens_set: bool = False
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    json_schema: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "none"
    tool_name: str | None = None
    echo: bool = False
    constraint: Any = dataclasses.field(default=None, compare=False)
    tool_format: Any = dataclasses.field(default=None, compare=False)  # the template's (api_tools), set by prepare


class ApiError(SwarmError):
    """A request the API refuses; ``status`` and the OpenAI error fields go to the client."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code
        self.headers = headers or {}
        self.extra = extra or {}  # more fields of the error object (e.g. ``coordinator_url``)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}


# ---------------------------------------------------------------------------- fields

# What each route serves. A field outside these, or one of NOT_SERVED with a value that asks for
# something, is refused with a 400 naming it: a client never gets a 200 that silently did less
# than it asked. A field sent as null counts as not sent.
SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
})
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                                 "tool_choice"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "echo"}
# Accepted and without effect on the reply: identifiers and bookkeeping for OpenAI's own platform.
IGNORED_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
                            "parallel_tool_calls"})  # parallel_tool_calls: a reply's calls are all parsed
# field → (values that ask for nothing and are accepted, why anything else is refused)
NOT_SERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": (([],), "text completions take no tools; send them to chat completions"),
    "tool_choice": (("none", "auto"), "text completions take no tools; send them to chat completions"),
    "functions": (([],), "this server does not parse function calls"),
    "function_call": (("none",), "this server does not parse function calls"),
    "echo": ((False,), "the reply never repeats the prompt"),
    "suffix": (("",), "the model is not asked to fill in between a prompt and a suffix"),
    "best_of": ((1,), "one completion is generated per request"),
    "modalities": ((["text"],), "the model writes text only"),
    "audio": ((), "the model writes text only"),
    "prediction": ((), "predicted outputs are not used"),
    "reasoning_effort": ((), "the model's reasoning is not configurable"),
    "verbosity": ((), "the model's verbosity is not configurable"),
    "web_search_options": ((), "this server does not search the web"),
}
MESSAGE_FIELDS = frozenset({"role", "content"})
MESSAGE_EXTRA = {"assistant": frozenset({"tool_calls"}), "tool": frozenset({"tool_call_id"})}
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions' logprobs


def not_served(field: str, why: str) -> ApiError:
    """The 400 for a field this server does not serve (``param`` names it)."""
    return ApiError(f"`{field}` is not served by this server: {why}", param=field, code="unsupported_parameter")


def _check_fields(body: dict, served: frozenset[str], route: str) -> None:
    for name, value in body.items():
        if value is None or name in served or name in IGNORED_FIELDS:
            continue
        if name in NOT_SERVED:
            harmless, why = NOT_SERVED[name]
            if value not in harmless:
                raise not_served(name, why)
            continue
        raise not_served(name, f"it is not a field of {route} that this server knows")


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ApiError(f"'{name}' must be a number, got {value!r}", param=name)
    if not (lo < value if lo_open else lo <= value) or value > hi:
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ApiError(f"'{name}' must be in {bound}, got {value}", param=name)
    return float(value)


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi):
        raise ApiError(f"'{name}' must be an integer in [{lo}, {hi}], got {value!r}", param=name)
    return value


def _unicode(value: str, param: str) -> str:
    """``value`` if it is valid Unicode; JSON allows "\ud800" escapes, which no tokenizer can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(f"'{param}' is not valid Unicode: a lone surrogate {value[exc.start]!r} at character "
                       f"{exc.start}", param=param) from None
    return value


def _content(value: Any, i: int) -> str:
    if isinstance(value, list):  # content parts: only text parts can be served by a text model
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"'messages[{i}].content' parts must be {{\"type\": \"text\", \"text\": str}}",
                               param=f"messages[{i}].content")
            texts.append(part["text"])
        value = "".join(texts)
    if not isinstance(value, str):
        raise ApiError(f"'messages[{i}].content' must be a string or a list of text parts",
                       param=f"messages[{i}].content")
    return _unicode(value, f"messages[{i}].content")


def _messages(raw: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(raw, list) or not raw:
        raise ApiError("'messages' must be a non-empty array", param="messages")
    if len(raw) > MAX_MESSAGES:
        raise ApiError(f"'messages' has {len(raw)} entries; at most {MAX_MESSAGES}", param="messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ApiError(f"'messages[{i}]' must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role == "function":
            raise not_served(f"messages[{i}].role", "the 'function' role answers a function call, which this "
                             "server does not parse; use tools and the 'tool' role")
        if role not in ROLES:
            raise ApiError(f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got {role!r}",
                           param=f"messages[{i}].role")
        known = MESSAGE_FIELDS | MESSAGE_EXTRA.get(role, frozenset())
        for name, value in m.items():  # name, audio …: not rendered, so refused ([] and null ask nothing)
            if name not in known and value not in (None, [], ""):
                raise not_served(f"messages[{i}].{name}", "messages are rendered from their role, content, "
                                 "an assistant's tool_calls and a tool's tool_call_id only")
        message: dict[str, Any] = {"role": "system" if role == "developer" else role}
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            message["tool_calls"] = _tool_calls(calls, i)
            message["content"] = "" if m.get("content") is None else _content(m.get("content"), i)
        else:
            message["content"] = _content(m.get("content"), i)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ApiError(f"'messages[{i}].tool_call_id' must be the id of the call this answers",
                               param=f"messages[{i}].tool_call_id")
            message["tool_call_id"] = m["tool_call_id"]
        messages.append(message)
    return tuple(messages)


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(f"'{param}' must be an array", param=param)
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(call.get("id"), str)
                or call.get("type", "function") != "function" or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments"), str)):
            raise ApiError(f"'{param}' entries must be {{\"id\", \"type\": \"function\", \"function\": "
                           f"{{\"name\", \"arguments\": JSON text}}}}", param=param)
        try:
            if not isinstance(json.loads(function["arguments"]), dict):
                raise ValueError
        except ValueError:
            raise ApiError(f"'{param}': the arguments of {function['name']!r} must be a JSON object as text",
                           param=param) from None
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": function["arguments"]}})
    return out


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise ApiError(f"'tools' must be an array of up to {MAX_TOOLS} function tools", param="tools")
    tools: list[dict[str, Any]] = []
    for k, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise ApiError(f"'tools[{k}]' must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise ApiError(f"'tools[{k}].function.name' must be 1 to 64 letters, digits, _ or -", param="tools")
        if not isinstance(function.get("parameters", {}), dict) or not isinstance(function.get("description", ""), str):
            raise ApiError(f"'tools[{k}].function': 'parameters' must be a JSON schema object and 'description' "
                           "a string", param="tools")
        kept = {key: function[key] for key in ("name", "description", "parameters") if function.get(key) is not None}
        tools.append({"type": "function", "function": kept})
    if len({t["function"]["name"] for t in tools}) < len(tools):
        raise ApiError("'tools' names a function twice", param="tools")
    return tuple(tools)


def _tool_choice(value: Any, tools: tuple[dict[str, Any], ...]) -> tuple[str, str | None]:
    """``(choice, function name)``: choice ``none``, ``auto``, ``required`` or ``function``."""
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto"):
        return (value if tools else "none"), None
    names = [t["function"]["name"] for t in tools]
    if value == "required":
        choice, name = "required", None
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        choice, name = "function", value["function"].get("name")
        if tools and name not in names:
            raise ApiError(f"'tool_choice' names {name!r}, which is not one of 'tools' ({', '.join(names)})",
                           param="tool_choice")
    else:
        raise ApiError("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", param="tool_choice")
    if not tools:
        raise ApiError(f"'tool_choice' {value!r} needs 'tools'", param="tool_choice")
    return choice, name


def _logit_bias(value: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError("'logit_bias' must be an object mapping token ids (as strings) to numbers in [-100, 100]",
                       param="logit_bias")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ApiError(f"'logit_bias' keys must be token ids written in decimal, got {key!r}", param="logit_bias")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise ApiError(f"'logit_bias' names token {token}, but the model's vocabulary has {vocab_size} "
                           f"ids (0 to {vocab_size - 1})", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ApiError(f"'logit_bias[\"{key}\"]' must be a number in [-100, 100], got {bias!r}",
                           param="logit_bias")
        out.append((token, float(bias)))
    return tuple(out)


def _sampling(body: dict, *, max_tokens_limit: int, vocab_size: int | None) -> dict[str, Any]:
    """The fields chat and text completions share, as ChatRequest keyword arguments."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens_set = max_tokens is not None
    if max_tokens is None:  # what the context leaves after the prompt (ChatBackend.prepare), as OpenAI's API
        max_tokens = max_tokens_limit
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_tokens_limit:
        raise ApiError(f"'max_tokens' must be an integer in [1, {max_tokens_limit}], got {max_tokens!r}",
                       param="max_tokens")
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ApiError(f"'top_k' must be a non-negative integer (0 = all tokens), got {top_k!r}", param="top_k")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ApiError(f"'seed' must be a non-negative integer, got {seed!r}", param="seed")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else () if stop is None else None
    if stops is None or len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(f"'stop' must be a non-empty string or an array of up to {MAX_STOP_STRINGS} of them",
                       param="stop")
    for s in stops:
        _unicode(s, "stop")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(f"'stream' must be a boolean, got {stream!r}", param="stream")
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise ApiError("'n' must be 1: the swarm generates one choice per request", param="n")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError("'stream_options' must be an object with a boolean 'include_usage'", param="stream_options")
    return dict(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=top_k,
        seed=seed,
        stop=stops,
        stream=bool(stream),
        include_usage=bool(options.get("include_usage", False)),
        max_tokens_set=max_tokens_set,
        presence_penalty=_number(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        logit_bias=_logit_bias(body.get("logit_bias"), vocab_size),
    )


def _response_format(value: Any) -> str | None:
    """The JSON schema a ``response_format`` asks the reply to follow, as JSON text; None for text.

    OpenAI's shapes: ``{"type": "text"}``, ``{"type": "json_object"}`` (any JSON object) and
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``."""
    param = "response_format"
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind != "json_schema":
        raise ApiError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       param=param)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ApiError("'response_format.json_schema' must be an object with a string 'name'", param=param)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ApiError("'response_format.json_schema.schema' must be a JSON schema object", param=param)
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise ApiError("'response_format.json_schema.strict' must be a boolean", param=param)
    return json.dumps(schema)


def _model(body: Any, model_id: str) -> str | None:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError("'model' must be a string", param="model")
    if model not in (None, model_id):
        raise ApiError(f"The model '{model}' does not exist; this swarm serves '{model_id}' (see GET /v1/models)",
                       param="model", status=404, code="model_not_found")
    return model


def parse_chat_request(body: Any, *, model_id: str, max_tokens_limit: int,
                       vocab_size: int | None = None) -> ChatRequest:
    """Validate a decoded ``POST /v1/chat/completions`` body: each field served (checked, and
    ``logit_bias`` ids against ``vocab_size`` when given) or refused (:data:`NOT_SERVED`,
    unknown fields); :data:`IGNORED_FIELDS` are accepted.

    Raises:
        ApiError: 400 naming the bad or unserved field (``param``), or 404 for another model id.
    """
    model = _model(body, model_id)
    _check_fields(body, CHAT_FIELDS, "chat completions")
    messages = _messages(body.get("messages"))
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ApiError(f"'logprobs' must be a boolean, got {logprobs!r}", param="logprobs")
    top = _int(body, "top_logprobs", 0, MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    tools = _tools(body.get("tools"))
    tool_choice, tool_name = _tool_choice(body.get("tool_choice"), tools)
    json_schema = _response_format(body.get("response_format"))
    if json_schema is not None and tool_choice in ("required", "function"):
        raise ApiError("'tool_choice' forces a tool call, which 'response_format' would forbid; ask for one of them",
                       param="tool_choice")
    return ChatRequest(messages=messages, model=model, logprobs=(top or 0) if logprobs else None,
                       json_schema=json_schema, tools=tools, tool_choice=tool_choice, tool_name=tool_name,
                       **_sampling(body, max_tokens_limit=max_tokens_limit, vocab_size=vocab_size))


def parse_completion_request(body: Any, *, model_id: str, max_tokens_limit: int,
                             vocab_size: int | None = None) -> ChatRequest:
    """Validate a ``POST /v1/completions`` body: ``prompt``, one non-empty string (or an array
    of exactly one); ``logprobs``, the number of alternatives (0 to 5) to report per token;
    ``echo`` (the prompt, then the completion; with ``logprobs``, the prompt's tokens come first
    in them, the first with a null logprob, as OpenAI's legacy API); and the sampling fields
    of :func:`parse_chat_request`.

    Raises:
        ApiError: 400 naming the bad or unserved field, or 404 for another model id.
    """
    model = _model(body, model_id)
    _check_fields(body, COMPLETION_FIELDS, "text completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError("'prompt' must be a non-empty string (one prompt per request)", param="prompt")
    prompt = _unicode(prompt, "prompt")
    logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise ApiError(f"'echo' must be a boolean, got {echo!r}", param="echo")
    return ChatRequest(messages=({"role": "user", "content": prompt},), model=model, prompt=prompt, logprobs=logprobs,
                       echo=bool(echo),
                       **_sampling(body, max_tokens_limit=max_tokens_limit, vocab_size=vocab_size))


class StopMatcher:
    """Cuts a text stream at the first of ``stops``, holding back what could begin one.

    ``push(text)`` returns ``(safe_text, stopped)``; ``flush()`` returns what was held back
    when the stream ends without a stop. The concatenation of the returned text equals
    the input up to (not including) the first stop string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = max((k for s in self._stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
