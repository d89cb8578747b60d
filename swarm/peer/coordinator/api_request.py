"""The OpenAI request model of the coordinator's API: what a body may hold, checked field by field.

:func:`parse_chat_request` (``POST /v1/chat/completions``) and :func:`parse_completion_request`
(``POST /v1/completions``) turn a decoded JSON body into a :class:`ChatRequest` or raise
:class:`ApiError` (400, OpenAI's error shape) naming the field; :class:`StopMatcher` applies a
request's ``stop`` strings to the text as it streams. Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swarm.compute.textgen import MAX_TEMPERATURE
from swarm.errors import SwarmError

MAX_BODY_BYTES = 1 << 20
MAX_MESSAGES = 512
MAX_STOP_STRINGS = 4  # as OpenAI
DEFAULT_MAX_TOKENS = 512
ROLES = ("system", "developer", "user", "assistant")


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
    ``prompt_ids``: the encoded, checked prompt once :meth:`ChatBackend.prepare` ran.
    """

    messages: tuple[dict[str, str], ...]
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


class ApiError(SwarmError):
    """A request the API refuses; ``status`` and the OpenAI error fields go to the client."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


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
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON allows "\ud800" escapes; no tokenizer can take them
        raise ApiError(f"'messages[{i}].content' is not valid Unicode: a lone surrogate "
                       f"{value[exc.start]!r} at character {exc.start}", param=f"messages[{i}].content") from None
    return value


def parse_chat_request(body: Any, *, model_id: str, max_tokens_limit: int) -> ChatRequest:
    """Validate a decoded JSON body; unknown fields are ignored (clients send many).

    Raises:
        ApiError: 400 naming the bad field (``param``), or 404 for another model id.
    """
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError("'model' must be a string", param="model")
    if model not in (None, model_id):
        raise ApiError(f"The model '{model}' does not exist; this swarm serves '{model_id}' (see GET /v1/models)",
                       param="model", status=404, code="model_not_found")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError("'messages' must be a non-empty array", param="messages")
    if len(raw) > MAX_MESSAGES:
        raise ApiError(f"'messages' has {len(raw)} entries; at most {MAX_MESSAGES}", param="messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ApiError(f"'messages[{i}]' must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got {role!r}",
                           param=f"messages[{i}].role")
        messages.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), i)})

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens_set = max_tokens is not None
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, max_tokens_limit)
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
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(f"'stream' must be a boolean, got {stream!r}", param="stream")
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise ApiError("'n' must be 1: the swarm generates one choice per request", param="n")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError("'stream_options' must be an object with a boolean 'include_usage'", param="stream_options")
    return ChatRequest(
        messages=tuple(messages),
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=top_k,
        seed=seed,
        stop=stops,
        stream=bool(stream),
        include_usage=bool(options.get("include_usage", False)),
        max_tokens_set=max_tokens_set,
    )


def parse_completion_request(body: Any, *, model_id: str, max_tokens_limit: int) -> ChatRequest:
    """Validate a ``POST /v1/completions`` body: ``prompt``, one non-empty string (or an array
    of exactly one), and the fields of :func:`parse_chat_request`.

    Raises:
        ApiError: 400 naming the bad field, or 404 for another model id.
    """
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError("'prompt' must be a non-empty string (one prompt per request)", param="prompt")
    chat = parse_chat_request({**body, "messages": [{"role": "user", "content": prompt}]},
                              model_id=model_id, max_tokens_limit=max_tokens_limit)
    return dataclasses.replace(chat, prompt=chat.messages[0]["content"])


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
