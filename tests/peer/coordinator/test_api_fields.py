"""Every request field is served or refused, and what is served is right.

Refused: a 400 in OpenAI's error shape naming the field — never a 200 that did less than asked.
Served: ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` against a numpy
reimplementation of OpenAI's rule on the model's own logits; ``logprobs`` / ``top_logprobs`` (chat,
whole and streamed) and completions' ``logprobs`` against a float64 log-softmax of those logits.
Oracle: the local greedy run (``Model.forward`` in the prefill chunks every path uses).
"""

from __future__ import annotations

import asyncio
import gc
import json

import aiohttp
import numpy as np
import openai
import pytest

from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.api_request import (IGNORED_FIELDS, ApiError, parse_chat_request,
                                                parse_completion_request)
from tests.peer.coordinator._api import openai_client, serving

KEY = SwarmKey(bytes(range(2, 34)))
MODEL_ID = "smollm2"
HEADERS = {"Authorization": f"Bearer {KEY.api_token}"}
USER = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture
async def url(engine):
    async with serving(*engine, KEY, MODEL_ID) as base:
        yield base


def _client(url: str) -> openai.AsyncOpenAI:
    return openai_client(url, KEY)


async def _post(url: str, route: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/{route}", json=body, headers=HEADERS) as r:
            return r.status, await r.json()


def _greedy_steps(model, prompt, n, adjust=lambda z, counts: z):
    """The local greedy run, step by step: [(raw logits f32, picked id)]; ``adjust(z64, counts)``
    changes the float64 logits before the argmax."""
    from swarm.compute.sampling import PREFILL_CHUNK

    cache = model.new_cache()
    for lo in range(0, len(prompt), PREFILL_CHUNK):
        logits = model.forward(prompt[lo:lo + PREFILL_CHUNK], cache, last_only=True)[0]
    steps, counts = [], {}
    for _ in range(n):
        tok = int(np.argmax(adjust(logits.astype(np.float64), counts)))
        steps.append((logits, tok))
        counts[tok] = counts.get(tok, 0) + 1
        logits = model.forward([tok], cache, last_only=True)[0]
    return steps


def _log_softmax64(z):
    z = z.astype(np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def _reply(tok, steps):
    """The text of ``steps``' picks up to an end-of-sequence id, and those picks."""
    ids = [t for _, t in steps]
    for i, t in enumerate(ids):
        if t in tok.eos_token_ids:
            ids = ids[:i]
            break
    return tok.decode(ids), ids


# ------------------------------------------------------------------ refused, accepted

CHAT_REFUSED = [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),  # unknown fields too
    ({"min_p": 0.1}, "min_p"),
    ({"echo": True}, "echo"),  # a completions field
    ({"messages": [{"role": "user", "content": "x", "name": "ann"}]}, "messages[0].name"),
    ({"messages": [{"role": "function", "content": "42", "name": "f"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls"),
]
COMPLETION_REFUSED = [
    ({"suffix": "return x"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"top_logprobs": 2}, "top_logprobs"),  # a chat field
    ({"messages": USER}, "messages"),
    ({"logprobs": 6}, "logprobs"),  # past OpenAI's 5 (a served field's bound)
]


@pytest.mark.parametrize("patch, param", CHAT_REFUSED)
def test_unserved_chat_fields_are_refused_by_name(patch, param):
    with pytest.raises(ApiError) as info:
        parse_chat_request({"messages": USER, **patch}, model_id="m", max_tokens_limit=64)
    assert info.value.status == 400 and info.value.param == param
    assert str(info.value).startswith(f"`{param}` is not served by this server: ")


@pytest.mark.parametrize("patch, param", COMPLETION_REFUSED)
def test_unserved_completion_fields_are_refused_by_name(patch, param):
    with pytest.raises(ApiError) as info:
        parse_completion_request({"prompt": "x", **patch}, model_id="m", max_tokens_limit=64)
    assert info.value.status == 400 and info.value.param == param
    assert f"`{param}`" in str(info.value) or f"'{param}'" in str(info.value)


def test_harmless_fields_and_values_that_ask_nothing_are_accepted():
    """Identifiers for OpenAI's platform, and the 'off' values of refused fields, change nothing."""
    base = parse_chat_request({"messages": USER}, model_id="m", max_tokens_limit=64)
    harmless = {"user": "u1", "store": False, "metadata": {"a": "b"}, "service_tier": "auto", "n": 1,
                "parallel_tool_calls": True, "stream_options": {"include_usage": False}, "tool_choice": "none",
                "tools": [], "response_format": {"type": "text"}, "logprobs": False, "safety_identifier": "x",
                "presence_penalty": None, "echo": None, "suffix": None}
    assert set(harmless) >= IGNORED_FIELDS - {"prompt_cache_key"}
    assert parse_chat_request({"messages": USER, **harmless}, model_id="m", max_tokens_limit=64) == base
    assert parse_chat_request({"messages": [{**USER[0], "name": None, "tool_calls": [], "refusal": None}]},
                              model_id="m", max_tokens_limit=64) == base
    text = parse_completion_request({"prompt": "x"}, model_id="m", max_tokens_limit=64)
    assert parse_completion_request({"prompt": "x", "echo": False, "suffix": "", "best_of": 1, "user": "u"},
                                    model_id="m", max_tokens_limit=64) == text


@pytest.mark.parametrize("bias, says", [
    ({"49152": 1}, "names token 49152, but the model's vocabulary has 49152 ids"),
    ({"-3": 1}, "keys must be token ids written in decimal"),
    ({"hello": 1}, "keys must be token ids written in decimal"),
    ({"5": 101}, "must be a number in [-100, 100], got 101"),
    ({"5": "1"}, "must be a number in [-100, 100]"),
    ([5], "must be an object"),
])
def test_logit_bias_is_checked_against_the_vocabulary(bias, says):
    with pytest.raises(ApiError) as info:
        parse_chat_request({"messages": USER, "logit_bias": bias}, model_id="m", max_tokens_limit=64,
                           vocab_size=49152)
    assert info.value.param == "logit_bias" and says in str(info.value)


@pytest.mark.parametrize("patch, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"), ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tool_choice": {"type": "function", "function": {"name": "f"}}},
                                                   "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
])
def test_served_fields_are_checked(patch, param):
    with pytest.raises(ApiError) as info:
        parse_chat_request({"messages": USER, **patch}, model_id="m", max_tokens_limit=64)
    assert info.value.status == 400 and info.value.param == param


async def test_refusals_reach_the_client_in_openais_shape(url):
    """Through the server: the official client raises BadRequestError with the field named."""
    client = _client(url)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL_ID, messages=USER, max_tokens=4,
            tools=[{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
            tool_choice="required")
    error = info.value.body  # SmolLM2's chat template has no tool format
    assert info.value.status_code == 400 and error["param"] == "tools"
    assert error["type"] == "invalid_request_error" and error["message"].startswith(
        "`tools` is not served by this server: the model's chat template has no tool format")
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL_ID, max_tokens=4, messages=[
            *USER, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}])
    assert info.value.body["param"] == "messages[1].tool_calls"
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=4, extra_body={"min_p": 0.1})
    assert info.value.body["param"] == "min_p"
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL_ID, prompt="x", max_tokens=4, suffix="y")
    assert info.value.body["param"] == "suffix"
    await client.close()


async def test_lone_surrogates_in_prompt_and_stop_are_refused_by_name(url):
    """A completions prompt is named `prompt` (not messages[0].content); a stop string is refused as content is."""
    raw = b'{"prompt": "ab\\ud800", "max_tokens": 2}'
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/completions", data=raw, headers=HEADERS) as r:
            error = (await r.json())["error"]
    assert r.status == 400 and error["param"] == "prompt"
    assert error["message"] == "'prompt' is not valid Unicode: a lone surrogate '\\ud800' at character 2"
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "\\udc00x"]}'
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/chat/completions", data=raw, headers=HEADERS) as r:
            error = (await r.json())["error"]
    assert r.status == 400 and error["param"] == "stop" and "lone surrogate '\\udc00' at character 0" in error["message"]


# ------------------------------------------------------------------ penalties and logit bias


async def test_penalties_and_logit_bias_equal_a_numpy_reimplementation(url, engine):
    """Greedy with presence 0.7, frequency 1.3 and a bias: the reply equals OpenAI's rule applied
    in float64 to the local logits (counts of generated tokens), and differs from plain greedy."""
    model, tok = engine
    messages = [{"role": "user", "content": "Repeat after me: la la la la la la la la"}]
    prompt = tok.encode_chat(messages)
    plain, _ = _reply(tok, _greedy_steps(model, prompt, 16))
    boost = tok.encode(" blue", add_special_tokens=False)[0]
    bias = {boost: 3.0, _greedy_steps(model, prompt, 1)[0][1]: -100.0}

    def rule(z, counts):
        for t, b in bias.items():
            z[t] += b
        for t, c in counts.items():
            z[t] -= c * 1.3 + 0.7
        return z

    want, _ = _reply(tok, _greedy_steps(model, prompt, 16, rule))
    r = await _client(url).chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=16, temperature=0, presence_penalty=0.7,
        frequency_penalty=1.3, logit_bias={str(t): b for t, b in bias.items()})
    assert r.choices[0].message.content == want != plain


# ------------------------------------------------------------------ logprobs


async def test_chat_logprobs_are_the_models_log_softmax(url, engine):
    """Each token's logprob and its top 5 equal a float64 log-softmax of the local logits; the
    top-1 is the greedy token; the tokens' bytes make the reply; the stream carries the same."""
    model, tok = engine
    prompt = tok.encode_chat(USER)
    steps = _greedy_steps(model, prompt, 10)
    text, ids = _reply(tok, steps)
    client = _client(url)
    r = await client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=10, temperature=0,
                                             logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == text
    assert len(content) == len(ids)
    assert b"".join(bytes(c.bytes) for c in content).decode() == text
    for c, (logits, picked) in zip(content, steps):
        lp = _log_softmax64(logits)
        assert bytes(c.bytes) == _bytes(tok, picked)
        assert abs(c.logprob - lp[picked]) < 1e-4 and isinstance(c.logprob, float)
        best = np.argsort(-lp, kind="stable")[:5]
        assert [bytes(a.bytes) for a in c.top_logprobs] == [_bytes(tok, t) for t in best]
        assert np.allclose([a.logprob for a in c.top_logprobs], lp[best], atol=1e-4)
        assert c.top_logprobs[0].token == c.token  # greedy: the pick is the most likely

    stream = await client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=10, temperature=0,
                                                  logprobs=True, top_logprobs=5, stream=True)
    streamed = [lp for chunk in [c async for c in stream] for choice in chunk.choices
                if choice.logprobs is not None for lp in choice.logprobs.content]
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    plain = await client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None
    await client.close()
    gc.collect()
    await asyncio.sleep(0.05)


async def test_logprobs_stay_the_models_under_penalties(url, engine):
    """With a penalty the pick changes, but its logprob is still the raw distribution's."""
    model, tok = engine
    prompt = tok.encode_chat(USER)

    def rule(z, counts):
        for t, c in counts.items():
            z[t] -= c * 2.0
        return z

    steps = _greedy_steps(model, prompt, 8, rule)
    status, body = await _post(url, "chat/completions", {"messages": USER, "max_tokens": 8, "temperature": 0,
                                                         "frequency_penalty": 2.0, "logprobs": True})
    content = body["choices"][0]["logprobs"]["content"]
    _, ids = _reply(tok, steps)
    assert status == 200 and len(content) == len(ids)
    for c, (logits, picked) in zip(content, steps):
        assert abs(c["logprob"] - _log_softmax64(logits)[picked]) < 1e-4 and c["top_logprobs"] == []


async def test_completions_logprobs_tokens_offsets_and_alternatives(url, engine):
    """/v1/completions ``logprobs: 3``: tokens that join to the text, their offsets in it, their
    logprobs and each one's top 3 (plus the pick, as OpenAI's legacy API) from the local logits."""
    model, tok = engine
    prompt_text = "The three primary colours are"
    steps = _greedy_steps(model, tok.encode(prompt_text), 8)
    text, ids = _reply(tok, steps)
    client = _client(url)
    r = await client.completions.create(model=MODEL_ID, prompt=prompt_text, max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and "".join(lp.tokens) == text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, value, top, (logits, picked) in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, steps):
        ref = _log_softmax64(logits)
        assert token == _bytes(tok, picked).decode() and abs(value - ref[picked]) < 1e-4
        best = np.argsort(-ref, kind="stable")[:3]
        assert set(top) == {_bytes(tok, t).decode("utf-8", "replace") for t in best}
        assert max(top.values()) == value  # greedy: the pick is the most likely
    stream = await client.completions.create(model=MODEL_ID, prompt=prompt_text, max_tokens=8, temperature=0,
                                             logprobs=3, stream=True)
    chunks = [c async for c in stream]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    await client.close()
    gc.collect()
    await asyncio.sleep(0.05)


async def test_a_stop_string_cuts_the_logprobs_with_the_text(url, engine):
    """Tokens after the stop string are not reported; the reported ones cover the text."""
    model, tok = engine
    text, ids = _reply(tok, _greedy_steps(model, tok.encode_chat(USER), 10))
    stop = text.split()[2]
    status, body = await _post(url, "chat/completions", {"messages": USER, "max_tokens": 10, "temperature": 0,
                                                         "logprobs": True, "stop": [stop]})
    choice = body["choices"][0]
    cut = choice["message"]["content"]
    assert status == 200 and cut == text[:text.index(stop)]
    joined = b"".join(bytes(c["bytes"]) for c in choice["logprobs"]["content"]).decode()
    assert joined.startswith(cut) and len(joined) - len(cut) < len(stop) + 8
    assert len(choice["logprobs"]["content"]) < len(ids)


def _bytes(tok, token: int) -> bytes:
    """The bytes of ``token`` by the tokenizer's own decode of it (whole characters here)."""
    return tok.decode([token], skip_special_tokens=False).encode()


def test_body_is_json_serializable_floats():
    """Logprobs are reported as JSON numbers (float32 values converted to Python floats)."""
    from swarm.peer.coordinator.api import _logprobs
    from swarm.peer.coordinator.api_engine import TokenLogprob

    chat = parse_chat_request({"messages": USER, "logprobs": True, "top_logprobs": 1}, model_id="m",
                              max_tokens_limit=8)
    t = TokenLogprob("a", b"a", float(np.float32(-0.25)), (("a", b"a", -0.25),))
    assert json.loads(json.dumps(_logprobs(chat, [(0, t)]))) == {"content": [
        {"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": [{"token": "a", "logprob": -0.25,
                                                                            "bytes": [97]}]}], "refusal": None}


async def test_completions_echo_with_logprobs_scores_the_prompt(url, engine):
    """``echo`` with ``logprobs``: the prompt's tokens come first in the logprobs, the first with
    null (no token before it), each other one scored by the local logits of the row before it;
    then the completion's, their offsets in the echoed text. Streamed: the same, the prompt's
    with the first chunk."""
    model, tok = engine
    prompt_text = "The three primary colours are"
    ids = tok.encode(prompt_text)
    logits = model.forward(ids, model.new_cache())  # [T, V]: row i scores token i + 1
    client = _client(url)
    r = await client.completions.create(model=MODEL_ID, prompt=prompt_text, max_tokens=4, temperature=0, echo=True,
                                        logprobs=2)
    lp = r.choices[0].logprobs
    n = len(ids)
    assert r.choices[0].text.startswith(prompt_text) and "".join(lp.tokens) == r.choices[0].text
    assert lp.tokens[:n] == [_bytes(tok, t).decode() for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        ref = _log_softmax64(logits[i - 1])
        assert abs(lp.token_logprobs[i] - ref[ids[i]]) < 1e-4
        best = np.argsort(-ref, kind="stable")[:2]
        assert set(lp.top_logprobs[i]) == {_bytes(tok, t).decode() for t in best} | {lp.tokens[i]}
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert lp.text_offset[n] == len(prompt_text)  # the completion's offsets in the echoed text
    assert max(lp.top_logprobs[n].values()) == lp.token_logprobs[n]  # greedy: its first token the likeliest
    stream = await client.completions.create(model=MODEL_ID, prompt=prompt_text, max_tokens=4, temperature=0,
                                             echo=True, logprobs=2, stream=True)
    chunks = [c.choices[0] async for c in stream if c.choices]
    assert chunks[0].text == prompt_text and chunks[0].logprobs.tokens == lp.tokens[:n]
    assert sum((c.logprobs.token_logprobs for c in chunks if c.logprobs), []) == lp.token_logprobs
    assert sum((c.logprobs.text_offset for c in chunks if c.logprobs), []) == lp.text_offset
    await client.close()
    gc.collect()
    await asyncio.sleep(0.05)


async def test_completions_echo_puts_the_prompt_first(url, engine):
    """``echo``: the prompt, then the local greedy completion; streamed, the prompt comes first."""
    model, tok = engine
    prompt_text = "The three primary colours are"
    text, _ = _reply(tok, _greedy_steps(model, tok.encode(prompt_text), 6))
    client = _client(url)
    r = await client.completions.create(model=MODEL_ID, prompt=prompt_text, max_tokens=6, temperature=0, echo=True)
    assert r.choices[0].text == prompt_text + text
    stream = await client.completions.create(model=MODEL_ID, prompt=prompt_text, max_tokens=6, temperature=0,
                                             echo=True, stream=True)
    pieces = [c.choices[0].text async for c in stream if c.choices]
    assert pieces[0] == prompt_text and "".join(pieces) == prompt_text + text
    await client.close()
    gc.collect()
    await asyncio.sleep(0.05)
