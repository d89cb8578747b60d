"""``response_format``: JSON output enforced while sampling (llguidance masks on the coordinator).

Oracles: ``jsonschema`` validates the reply against the request's schema; the reply equals the
local run with the same constraint (``generate_text``), and plain greedy on the same prompt is
not JSON (so the mask did the work); each token is the best one the mask allowed under the local
logits.
"""

from __future__ import annotations

import json

import aiohttp
import jsonschema
import numpy as np
import openai
import pytest

from swarm.keys.swarmkey import SwarmKey
from tests.peer.coordinator._api import openai_client, serving


KEY = SwarmKey(bytes(range(4, 36)))
HEADERS = {"Authorization": f"Bearer {KEY.api_token}"}
MESSAGES = [{"role": "user", "content": "Describe a cat called Tom who likes blue and green."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "colours": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "colours"],
    "additionalProperties": False,
}
MAX_TOKENS = 80


@pytest.fixture
async def url(engine):
    async with serving(*engine, KEY) as base:
        yield base


def _client(url: str) -> openai.AsyncOpenAI:
    return openai_client(url, KEY)


def _local(engine, schema, max_tokens=MAX_TOKENS):
    from swarm.compute.constrain import JsonGrammar
    from swarm.compute.sampling import SamplingParams
    from swarm.compute.textgen import generate_text

    model, tok = engine
    params = SamplingParams(max_tokens=max_tokens, constraint=JsonGrammar(tok, model.config.vocab_size, schema))
    return "".join(generate_text(model, tok, MESSAGES, params))


async def test_json_schema_reply_validates_and_equals_the_local_run(url, engine):
    client = _client(url)
    r = await client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": SCHEMA, "strict": True}})
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert r.choices[0].finish_reason == "stop"  # the document ended, then the end-of-sequence token
    assert text == _local(engine, SCHEMA)
    plain = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    with pytest.raises(ValueError):
        json.loads(plain.choices[0].message.content)  # unconstrained, the model writes prose
    await client.close()


async def test_each_token_is_the_best_the_mask_allowed(url, engine):
    """Stepping the local model with the reply's tokens: each is the argmax of the logits over
    the tokens the constraint allowed at that step, and the logprobs reported are the raw ones."""
    from swarm.compute.constrain import JsonGrammar
    from swarm.compute.sampling import PREFILL_CHUNK

    model, tok = engine
    status, body = await _post(url, {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
                                     "logprobs": True, "response_format": {"type": "json_object"}})
    assert status == 200
    choice = body["choices"][0]
    assert isinstance(json.loads(choice["message"]["content"]), dict)
    constraint = JsonGrammar(tok, model.config.vocab_size, {"type": "object"})()
    prompt = tok.encode_chat(MESSAGES)
    cache = model.new_cache()
    for lo in range(0, len(prompt), PREFILL_CHUNK):
        logits = model.forward(prompt[lo:lo + PREFILL_CHUNK], cache, last_only=True)[0]
    for entry in choice["logprobs"]["content"]:
        allowed = constraint.allowed()
        best = int(np.argmax(np.where(allowed, logits, -np.inf)))
        assert bytes(entry["bytes"]) == tok.decode([best]).encode()
        z = logits.astype(np.float64)
        assert abs(entry["logprob"] - (z[best] - z.max() - np.log(np.exp(z - z.max()).sum()))) < 1e-4
        constraint.advance(best)
        logits = model.forward([best], cache, last_only=True)[0]


async def _post(url: str, body: dict, route: str = "chat/completions") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/{route}", json=body, headers=HEADERS) as r:
            return r.status, await r.json()


@pytest.mark.parametrize("response_format, says", [
    ({"type": "xml"}, "'response_format' must be"),
    ({"type": "json_schema"}, "must be an object with a string 'name'"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "must be a JSON schema object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "the schema cannot constrain output"),
])
async def test_bad_response_formats_are_400_naming_it(url, response_format, says):
    status, body = await _post(url, {"messages": MESSAGES, "max_tokens": 4, "response_format": response_format})
    assert status == 400 and body["error"]["param"] == "response_format" and says in body["error"]["message"]


async def test_completions_do_not_take_a_response_format(url):
    status, body = await _post(url, {"prompt": "x", "response_format": {"type": "json_object"}}, "completions")
    assert status == 400 and body["error"]["param"] == "response_format"
    assert "is not served by this server" in body["error"]["message"]
