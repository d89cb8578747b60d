"""Tool calls of the chat API (OpenAI's ``tools``, ``tool_choice``, ``tool_calls``, the ``tool``
role), written in the format of the model's own chat template.

A template serves tools when it writes them the way Hermes 2/3, Qwen2.5 and Qwen3 do: it takes
``tools`` (rendered into its system text) and asks for each call as
``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``, and renders earlier calls
(``message.tool_calls``) and their results (role ``tool``) itself. A template that never mentions
``<tool_call>`` has no tool format this server can read back, and a request with tools (or tool
messages) is refused naming the field. Nothing here does I/O.

``tool_choice`` ``auto``: the model decides; the reply's ``<tool_call>`` blocks become
``tool_calls``. ``required`` or a named function: the reply is constrained
(:func:`~swarm.compute.constrain.tool_call_grammar`) to one call of one of the tools (of that
one), its arguments following the function's ``parameters`` schema. ``none``: the reply is text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from swarm.errors import SwarmError

HERMES = ("<tool_call>\n", "\n</tool_call>")  # how a call opens and closes in the template's format
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the reply made: ``arguments`` as JSON text (OpenAI's shape)."""

    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def tool_format(template: str | None) -> tuple[str, str] | None:
    """How ``template`` (a chat template's source) writes a tool call — ``(opening, closing)`` —
    or None when it has no tool format this server reads."""
    if template and "tools" in template and "<tool_call>" in template:
        return HERMES
    return None


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The reply ``text`` split into its prose (the calls cut out, stripped) and its calls: each
    ``<tool_call>`` block holding a JSON object with a string ``name`` and an object
    ``arguments``; a block that is not one stays in the prose."""
    calls: list[ToolCall] = []

    def take(m: re.Match) -> str:
        try:
            call = json.loads(m.group(1))
        except ValueError:
            return m.group(0)
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            return m.group(0)
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", call["name"], json.dumps(call.get("arguments", {}))))
        return ""

    prose = _CALL.sub(take, text)
    return (prose.strip() if calls else prose), calls


def forced_call_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """The JSON schema of one call (``{"name", "arguments"}``) of the function ``name``, or of any
    of ``tools`` when ``name`` is None (``tool_choice: "required"``)."""
    def one(function: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": function["name"]},
                                                 "arguments": function.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}

    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
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
                       messages: tuple[dict[str, Any], ...]) -> tuple[str, str] | None:
    """The template's tool format when the request uses tools; None when it uses none.

    Raises: ToolsNotServed naming ``tools`` or the first message that needs a tool format."""
    needs = "tools" if tools else next((f"messages[{i}].role" if m["role"] == "tool" else f"messages[{i}].tool_calls"
                                        for i, m in enumerate(messages)
                                        if m["role"] == "tool" or m.get("tool_calls")), None)
    if needs is None:
        return None
    found = tool_format(template)
    if found is None:
        raise ToolsNotServed("the model's chat template has no tool format (it never writes a <tool_call>), so "
                             "tool calls could not be read back; describe the tools in the prompt instead", needs)
    return found
