"""Tool calls of the chat API (OpenAI's ``tools``, ``tool_choice``, ``tool_calls``, the ``tool``
role), written in the format of the model's own chat template.

A chat template carries its model's tool format: it renders ``tools`` into the prompt, asks for
calls written a certain way, and renders earlier calls (``message.tool_calls``) and their results
(role ``tool``) itself. This module knows the formats of the families the engine loads
(:data:`FORMATS`); a template's is the one that reads back a call the template itself renders
(:func:`tool_format`):

* ``hermes`` (Hermes 2/3, Qwen2.5, Qwen3, Granite 4): ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``;
* ``glm`` (GLM-4.5/4.6/4.7): ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n…</tool_call>``;
* ``qwen-xml`` (Qwen3-Coder, Qwen3.5): ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n…</function>\\n</tool_call>``;
* ``llama-json`` (Llama 3.1/3.2/3.3): the reply is one ``{"name": …, "parameters": {…}}`` object.

In the XML formats a string argument is written as its text and any other as JSON; it is read
back by the function's ``parameters`` schema. A template with none of these formats (SmolLM2's
has no tools; DeepSeek's, Kimi's and gpt-oss's write calls between special tokens, MiniMax's in
its own tags: not read here) refuses a request with tools (or tool messages), naming the field. Nothing here
does I/O.

``tool_choice`` ``auto``: the model decides; the calls the reply writes become ``tool_calls``.
``required`` or a named function: the reply is constrained (:meth:`ToolFormat.grammar`, an
llguidance grammar) to one call of one of the tools (of that one), its arguments following the
function's ``parameters`` schema. ``none``: the reply is text.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from swarm.errors import SwarmError


@dataclass(frozen=True)
class ToolCall:
    """One call the reply made: ``arguments`` as JSON text (OpenAI's shape)."""

    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(name: str, arguments: dict[str, Any]) -> ToolCall:
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))


def _functions(tools: list[dict[str, Any]], name: str | None = None) -> list[dict[str, Any]]:
    return [t["function"] for t in tools if name is None or t["function"]["name"] == name]


def _lit(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text)


def _json_rule(schema: dict[str, Any]) -> str:
    """llguidance's ``%json`` of ``schema``, compact as the API's JSON output."""
    from swarm.compute.constrain import JSON_OPTIONS

    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def _is_string(schema: dict[str, Any] | None) -> bool:
    if not schema:
        return False
    enum = schema.get("enum")
    return schema.get("type") == "string" or (isinstance(enum, list) and bool(enum)
                                              and all(isinstance(v, str) for v in enum))


def _value(text: str, schema: dict[str, Any] | None) -> Any:
    """An argument written as text in an XML format, read back by its ``schema``: a string
    parameter is the text; any other is JSON (Python's ``True``/``False``/``None``, which some
    templates write, taken too), else the text."""
    if _is_string(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return {"True": True, "False": False, "None": None}.get(text.strip(), text)


def _params(functions: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The ``properties`` of function ``name``'s parameters ({} when unknown)."""
    for f in functions:
        if f.get("name") == name:
            return (f.get("parameters") or {}).get("properties") or {}
    return {}


class ToolFormat:
    """How one family's chat template writes a tool call: read back from a reply, and
    constrained when a call is forced."""

    name = ""

    def parse(self, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
        """The reply ``text`` split into its prose (the calls cut out, stripped when there were
        calls) and its calls; a block that is not a well-formed call stays in the prose."""
        raise NotImplementedError

    def grammar(self, tools: list[dict[str, Any]], name: str | None) -> str:
        """The llguidance (Lark) grammar of one call of the function ``name``, or of any of
        ``tools`` when ``name`` is None (``tool_choice: "required"``)."""
        raise NotImplementedError


class _Blocks(ToolFormat):
    """Formats whose calls are blocks matched by ``pattern``, each read by ``read``."""

    pattern: re.Pattern[str]

    def read(self, m: re.Match[str], tools: list[dict[str, Any]]) -> ToolCall | None:
        raise NotImplementedError

    def parse(self, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []

        def take(m: re.Match[str]) -> str:
            call = self.read(m, tools)
            if call is None:
                return m.group(0)
            calls.append(call)
            return ""

        prose = self.pattern.sub(take, text)
        return (prose.strip() if calls else prose), calls


class Hermes(_Blocks):
    name = "hermes"
    opening, closing = "<tool_call>\n", "\n</tool_call>"
    pattern = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)

    def read(self, m: re.Match[str], tools: list[dict[str, Any]]) -> ToolCall | None:
        try:
            call = json.loads(m.group(1))
        except ValueError:
            return None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            return None
        return _call(call["name"], call.get("arguments", {}))

    def grammar(self, tools: list[dict[str, Any]], name: str | None) -> str:
        schema = forced_call_schema(tools, name)
        return f"start: {_lit(self.opening)} call {_lit(self.closing)}\ncall: {_json_rule(schema)}"


class _Xml(_Blocks):
    """A call as its function's name and ``(key, value)`` pairs in tags: ``pattern`` matches a
    call (group 1 the name, group 2 the arguments), ``args`` one argument (key, value); ``head``
    (with ``{name}``), ``pair`` (the text before and after a value, with ``{key}``) and ``tail``
    are how the template writes them."""

    def __init__(self, name: str, pattern: str, args: str, head: str, pair: tuple[str, str], tail: str) -> None:
        self.name, self.head, self.pair, self.tail = name, head, pair, tail
        self.pattern, self.args = re.compile(pattern, re.DOTALL), re.compile(args, re.DOTALL)

    def read(self, m: re.Match[str], tools: list[dict[str, Any]]) -> ToolCall | None:
        name, body = m.group(1).strip(), m.group(2)
        if not name or self.args.sub("", body).strip():
            return None  # something between the arguments that is not one
        props = _params(_functions(tools), name)
        return _call(name, {k.strip(): _value(v, props.get(k.strip())) for k, v in self.args.findall(body)})

    def grammar(self, tools: list[dict[str, Any]], name: str | None) -> str:
        rules, calls = [], []
        for i, f in enumerate(_functions(tools, name)):
            params = f.get("parameters") or {}
            required = set(params.get("required") or ())
            parts = [_lit(self.head.format(name=f["name"]))]
            for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
                before, after = (p.format(key=key) for p in self.pair)
                value = f"v{i}_{j}"
                if _is_string(schema) and "enum" in schema:
                    rules.append(f"{value}: " + " | ".join(_lit(v) for v in schema["enum"]))
                elif _is_string(schema):
                    limit = schema.get("maxLength")
                    rules.append(f"{value}: /[^<]{{0,{int(limit)}}}/" if isinstance(limit, int)
                                 else f"{value}: /[^<]*/")
                else:
                    rules.append(f"{value}: {_json_rule(schema or {})}")
                part = f"{_lit(before)} {value} {_lit(after)}"
                parts.append(part if key in required else f"({part})?")
            parts.append(_lit(self.tail))
            rules.append(f"call{i}: " + " ".join(parts))
            calls.append(f"call{i}")
        return "start: " + " | ".join(calls) + "\n" + "\n".join(rules)


GLM = _Xml("glm", r"<tool_call>([^<\n]*)\n?((?:\s*<arg_key>.*?</arg_value>)*)\s*</tool_call>",
           r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>",
           "<tool_call>{name}\n", ("<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n"), "</tool_call>")
QWEN_XML = _Xml("qwen-xml", r"<tool_call>\s*<function=([^>\n]*)>\n?((?:\s*<parameter=.*?</parameter>)*)\s*</function>"
                r"\s*</tool_call>", r"\s*<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>",
                "<tool_call>\n<function={name}>\n", ("<parameter={key}>\n", "\n</parameter>\n"),
                "</function>\n</tool_call>")


class LlamaJson(ToolFormat):
    """Llama 3.1–3.3: a reply that is one JSON object ``{"name", "parameters"}`` is a call
    (after the ``<|python_tag|>`` a reply may open with)."""

    name = "llama-json"

    def parse(self, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        try:
            call = json.loads(body)
        except ValueError:
            return text, []
        args = call.get("parameters", call.get("arguments", {})) if isinstance(call, dict) else None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(args, dict)):
            return text, []
        return "", [_call(call["name"], args)]

    def grammar(self, tools: list[dict[str, Any]], name: str | None) -> str:
        return f"start: call\ncall: {_json_rule(forced_call_schema(tools, name, arguments='parameters'))}"


FORMATS: tuple[ToolFormat, ...] = (Hermes(), GLM, QWEN_XML, LlamaJson())

# The call a template is asked to write to find its format: a string and an integer argument.
_PROBE_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
_PROBE_CALL = ("get_weather", {"city": "Paris", "days": 3})
_PROBE_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@functools.lru_cache(maxsize=16)
def tool_format(template: str | None, special_tokens: tuple[tuple[str, str], ...] = ()) -> ToolFormat | None:
    """The tool format ``template`` (a chat template's source) writes, or None when it has none
    this server reads: the template renders a call (:data:`_PROBE_CALL`) after a question, and
    the format that reads that call back from the reply's text is its format.
    ``special_tokens``: the ``(name, text)`` pairs the template is rendered with (``bos_token``, …)."""
    if not template or "tool" not in template:
        return None
    from swarm.compute.tokenizer import _compile_template

    name, args = _PROBE_CALL
    answer = {"role": "assistant", "content": "",
              "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": name, "arguments": args}}]}
    try:
        compiled = _compile_template(template)
        asked = compiled.render(messages=_PROBE_ASK, add_generation_prompt=True, tools=[_PROBE_TOOL],
                                **dict(special_tokens))
        answered = compiled.render(messages=[*_PROBE_ASK, answer], add_generation_prompt=False, tools=[_PROBE_TOOL],
                                   **dict(special_tokens))
    except Exception:  # a template that cannot render tool calls (jinja2 raises many types) has no format
        return None
    reply = _reply(asked, answered)
    for fmt in FORMATS:
        _, calls = fmt.parse(reply, [_PROBE_TOOL])
        if [(c.name, json.loads(c.arguments)) for c in calls] == [_PROBE_CALL]:
            return fmt
    return None


def _reply(asked: str, answered: str) -> str:
    """What the model wrote in ``answered`` (the conversation with its reply) after ``asked``
    (the conversation up to the generation prompt): from where the two part — backed off to a
    line or tag boundary, as a generation prompt may open a thinking block the reply does not
    have — to the first end-of-turn token (``<|…|>``) or ``</s>``."""
    common = 0
    for a, b in zip(asked, answered):
        if a != b:
            break
        common += 1
    start = max(answered.rfind("\n", 0, common), answered.rfind(">", 0, common)) + 1 if common < len(asked) else common
    return re.split(r"<\|[^|>]*\|>|</s>", answered[start:], maxsplit=1)[0]


def parse_tool_calls(text: str, fmt: ToolFormat | None = None,
                     tools: list[dict[str, Any]] | tuple[dict[str, Any], ...] = ()) -> tuple[str, list[ToolCall]]:
    """The reply ``text`` split into its prose and the calls it writes in format ``fmt``
    (Hermes' when None); ``tools`` type the arguments of the XML formats."""
    return (fmt or FORMATS[0]).parse(text, list(tools))


def forced_call_schema(tools: list[dict[str, Any]], name: str | None, arguments: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call (``{"name", arguments}``) of the function ``name``, or of any
    of ``tools`` when ``name`` is None (``tool_choice: "required"``)."""
    def one(function: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": function["name"]},
                                                 arguments: function.get("parameters") or {"type": "object"}},
                "required": ["name", arguments], "additionalProperties": False}

    functions = _functions(tools, name)
    return one(functions[0]) if len(functions) == 1 else {"anyOf": [one(f) for f in functions]}


def template_messages(messages: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The messages as chat templates take them (transformers' convention): an assistant's
    ``tool_calls`` with their ``arguments`` parsed into objects."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{"id": c["id"], "type": "function",
                                      "function": {"name": c["function"]["name"],
                                                   "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]}
        out.append(m)
    return out


class ToolsNotServed(SwarmError):
    """A request with tools (or tool messages) to a model whose chat template has no tool format;
    ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_tools_served(template: str | None, tools: tuple[dict[str, Any], ...],
                       messages: tuple[dict[str, Any], ...],
                       special_tokens: dict[str, str] | None = None) -> ToolFormat | None:
    """The template's tool format (:func:`tool_format`, rendered with ``special_tokens``) when the
    request uses tools; None when it uses none.

    Raises: ToolsNotServed naming ``tools`` or the first message that needs a tool format."""
    needs = "tools" if tools else next((f"messages[{i}].role" if m["role"] == "tool" else f"messages[{i}].tool_calls"
                                        for i, m in enumerate(messages)
                                        if m["role"] == "tool" or m.get("tool_calls")), None)
    if needs is None:
        return None
    found = tool_format(template, tuple(sorted((special_tokens or {}).items())))
    if found is None:
        known = ", ".join(f.name for f in FORMATS)
        raise ToolsNotServed(f"the model's chat template has no tool format this server reads back ({known}), "
                             "so calls could not be returned as tool_calls; describe the tools in the prompt "
                             "instead", needs)
    return found
