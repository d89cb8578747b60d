"""Tools through the chat API, in the format of the model's own chat template.

SmolLM2's template has no tool format (refused: tests/peer/coordinator/test_api_fields.py); here the same
weights and tokenizer carry Qwen2.5's template, which writes tools into the system text and asks
for ``<tool_call>`` blocks. Oracles: the local run on the prompt the template renders (the same
text, the same tokens), ``jsonschema`` for the arguments against the function's parameters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json

import jsonschema
import openai
import pytest

from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.api_tools import Hermes, parse_tool_calls, tool_format
from tests.peer.coordinator._api import openai_client, serving


KEY = SwarmKey(bytes(range(5, 37)))
# Qwen2.5-Instruct's chat template (its tool format is Hermes'), as its tokenizer_config.json has it.
QWEN_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n"
    "{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def tool_engine(engine):
    model, tok = engine
    return model, dataclasses.replace(tok, chat_template=QWEN_TEMPLATE)


@pytest.fixture
async def url(tool_engine):
    async with serving(*tool_engine, KEY) as base:
        yield base


def _client(url: str) -> openai.AsyncOpenAI:
    return openai_client(url, KEY)


def _local(tool_engine, messages, name=None, forced=True):
    """The local run: the template's prompt with the tools, the forced call's grammar when
    ``forced``; returns (prompt ids, rendered prompt, reply text)."""
    from swarm.compute.constrain import Grammar
    from swarm.compute.sampling import SamplingParams
    from swarm.compute.textgen import encode_prompt, stream_reply

    model, tok = tool_engine
    ids = encode_prompt(model, tok, messages, MAX_TOKENS, tools=TOOLS)
    grammar = Grammar(tok, model.config.vocab_size, Hermes().grammar(TOOLS, name))
    params = SamplingParams(max_tokens=MAX_TOKENS, constraint=grammar if forced else None)
    return ids, tok.apply_chat_template(messages, tools=TOOLS), "".join(stream_reply(model, tok, ids, params))


def test_the_template_decides_whether_tools_are_served(engine):
    assert isinstance(tool_format(QWEN_TEMPLATE), Hermes)
    assert tool_format(engine[1].chat_template) is None  # SmolLM2's: refused by name


def test_tool_calls_are_parsed_from_the_reply():
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "CET"})]
    assert parse_tool_calls("<tool_call>\nnot json\n</tool_call>") == ("<tool_call>\nnot json\n</tool_call>", [])
    assert parse_tool_calls("plain text") == ("plain text", [])


async def test_a_forced_call_then_a_second_turn_with_its_result(url, tool_engine):
    """tool_choice naming a function: one call, arguments valid for its parameters, equal to the
    local run; then the call and its result sent back are rendered by the template and the reply
    equals the local run of that conversation."""
    client = _client(url)
    r = await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS,
                                             temperature=0,
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    ids, rendered, text = _local(tool_engine, ASK, "get_weather")
    assert "<tools>" in rendered and '"name": "get_weather"' in rendered  # the template wrote the tools
    assert r.usage.prompt_tokens == len(ids)
    assert parse_tool_calls(text)[1][0].name == call.function.name == "get_weather"
    assert json.loads(parse_tool_calls(text)[1][0].arguments) == arguments

    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
    r2 = await client.chat.completions.create(model="m", messages=turn, tools=TOOLS, max_tokens=MAX_TOKENS,
                                              temperature=0)
    local = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}, turn[2]]
    ids2, rendered2, text2 = _local(tool_engine, local, forced=False)
    assert '<tool_response>\n{"temperature": 18}\n</tool_response>' in rendered2
    assert r2.usage.prompt_tokens == len(ids2)
    content, calls = parse_tool_calls(text2)
    assert (r2.choices[0].message.content or None) == (content or None)
    assert [(c.function.name, c.function.arguments) for c in r2.choices[0].message.tool_calls or []] == [
        (c.name, c.arguments) for c in calls]
    await client.close()


async def test_required_streams_the_same_call(url, tool_engine):
    """tool_choice "required": a call of one of the tools; streamed, the deltas carry the same call."""
    client = _client(url)
    body = dict(model="m", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0, tool_choice="required")
    whole = (await client.chat.completions.create(**body)).choices[0]
    [call] = whole.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    schema = next(t for t in TOOLS if t["function"]["name"] == call.function.name)["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    _, _, text = _local(tool_engine, ASK)
    assert json.loads(parse_tool_calls(text)[1][0].arguments) == json.loads(call.function.arguments)
    stream = await client.chat.completions.create(**body, stream=True)
    deltas, finishes = [], []
    async for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finishes.append(c.finish_reason)
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, call.function.name, call.function.arguments)]
    assert finishes[-1] == "tool_calls"
    await client.close()
    gc.collect()
    await asyncio.sleep(0.05)
