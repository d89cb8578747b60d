"""The coordinator's OpenAI-compatible API, driven by the official ``openai`` client.

Oracle: the engine's own greedy run on the same model (``sampling.generate`` with the
local FFN), decoded by the tokenizer — the API must stream exactly that text.
"""

from __future__ import annotations

import asyncio
import gc
import os

import aiohttp
import openai
import pytest

from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.api import ApiServer
from swarm.peer.coordinator.api_engine import EngineBackend
from swarm.peer.coordinator.api_request import ApiError, StopMatcher, parse_chat_request

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def oracle(engine):
    """prompt -> (text, completion token count, finish_reason) of the local greedy run."""
    from swarm.compute.sampling import SamplingParams, generate

    model, tok = engine
    out = {}
    for prompt in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        toks = list(generate(model, ids, SamplingParams(max_tokens=MAX_TOKENS, stop_tokens=tok.eos_token_ids)))
        stopped = toks[-1] in tok.eos_token_ids
        out[prompt] = (tok.decode([t for t in toks if t not in tok.eos_token_ids]), len(toks), len(ids),
                       "stop" if stopped else "length")
    return out


KEY = SwarmKey(bytes(range(32)))


@pytest.fixture
async def server(engine):
    model, tok = engine
    api = ApiServer.for_swarm_key(EngineBackend(model, tok, model_id="smollm2-135m-instruct-q4_1"), KEY)
    port = await api.start("127.0.0.1", 0)
    yield api, f"http://127.0.0.1:{port}/v1"
    await api.close()


def _client(base_url: str, key: str = KEY.api_token) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)


async def test_openai_client_non_streaming_equals_local_greedy(server, oracle):
    api, url = server
    client = _client(url)
    for prompt in PROMPTS:
        text, n_tokens, n_prompt, finish = oracle[prompt]
        r = await client.chat.completions.create(
            model="smollm2-135m-instruct-q4_1", messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.content == text
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == finish
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n_tokens)
    await client.close()


async def test_openai_client_streaming_equals_local_greedy(server, oracle):
    api, url = server
    client = _client(url)
    prompt = PROMPTS[1]
    text, n_tokens, _, finish = oracle[prompt]
    stream = await client.chat.completions.create(
        model="smollm2-135m-instruct-q4_1", messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, finishes, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finishes.append(choice.finish_reason)
    assert "".join(pieces) == text
    assert len([p for p in pieces if p]) > 1  # it really streamed, piece by piece
    assert finishes[-1] == finish and all(f is None for f in finishes[:-1])
    assert usage is not None and usage.completion_tokens == n_tokens
    await stream.close()
    await client.close()
    # The client leaves its stream's async generators in reference cycles: collect them now, so
    # their finalizers run on this loop rather than whenever a later collection finds them.
    gc.collect()
    await asyncio.sleep(0.05)


async def test_models_auth_and_key_code_refused(server):
    """Only the derived API token opens the API: the key code itself (which would let whoever
    sees one request join the swarm) is refused, with or without its dashes."""
    api, url = server
    models = await _client(url).models.list()
    assert [m.id for m in models.data] == ["smollm2-135m-instruct-q4_1"]
    for wrong in (KEY.code, KEY.code.replace("-", ""), SwarmKey(bytes(32)).api_token):
        with pytest.raises(openai.AuthenticationError, match="API token"):
            await _client(url, wrong).models.list()
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/models") as r:  # no Authorization header at all
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "invalid_api_key"


async def test_event_loop_stays_free_and_generations_queue(server, oracle):
    """While one generation streams, the loop answers other requests; a second generation waits its turn."""
    api, url = server
    client = _client(url)
    first = await client.chat.completions.create(
        model="smollm2-135m-instruct-q4_1", messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True)
    it = first.__aiter__()
    await it.__anext__()  # the role chunk: the generation holds the engine now
    second = asyncio.create_task(client.chat.completions.create(
        model="smollm2-135m-instruct-q4_1", messages=[{"role": "user", "content": PROMPTS[1]}],
        max_tokens=MAX_TOKENS, temperature=0))
    models = await client.models.list()  # answered while the first still generates
    assert models.data[0].id == "smollm2-135m-instruct-q4_1"
    rest = [c.choices[0].delta.content or "" async for c in it if c.choices]
    assert "".join(rest) == oracle[PROMPTS[0]][0]
    assert (await second).choices[0].message.content == oracle[PROMPTS[1]][0]
    await client.close()


async def test_client_gone_mid_stream_frees_the_engine(server, oracle):
    api, url = server
    async with aiohttp.ClientSession() as s:
        body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 200, "stream": True,
                "temperature": 0}
        r = await s.post(f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY.api_token}"})
        await r.content.readline()  # the first event, then hang up
        r.close()
    client = _client(url)
    r = await asyncio.wait_for(client.chat.completions.create(
        model="smollm2-135m-instruct-q4_1", messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=MAX_TOKENS, temperature=0), timeout=120)
    assert r.choices[0].message.content == oracle[PROMPTS[0]][0]
    await client.close()


async def test_stop_string_cuts_the_reply(server, oracle):
    api, url = server
    text = oracle[PROMPTS[0]][0]
    stop = text.split()[2]  # a word in the middle of the greedy reply
    r = await _client(url).chat.completions.create(
        model="smollm2-135m-instruct-q4_1", messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


BAD = [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": -3}, "seed"),
    ({"seed": "x"}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"n": 2}, "n"),
    ({"stream_options": {"include_usage": "no"}}, "stream_options"),
]


@pytest.mark.parametrize("patch, param", BAD)
def test_every_field_is_validated(patch, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **patch}
    with pytest.raises(ApiError) as info:
        parse_chat_request(body, model_id="m", max_tokens_limit=8192)
    assert info.value.status == 400 and info.value.param == param
    assert param.split("[")[0] in str(info.value)


async def test_bad_requests_get_openai_error_shape(server):
    api, url = server
    headers = {"Authorization": f"Bearer {KEY.api_token}"}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/chat/completions", data=b"{not json", headers=headers) as r:
            assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
        async with s.post(f"{url}/chat/completions", json={"messages": [], "model": "x"}, headers=headers) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        async with s.post(f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "top_p": 7}, headers=headers) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["param"] == "top_p" and err["type"] == "invalid_request_error"
        async with s.post(f"{url}/chat/completions", data=b"x" * (2 << 20), headers=headers) as r:
            assert r.status == 413
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await _client(url).chat.completions.create(model="smollm2-135m-instruct-q4_1",
                                                   messages=[{"role": "user", "content": "x"}], temperature=9)


async def test_unknown_route_gets_openai_error_shape(server, oracle):
    """A path no route serves → 404 as JSON naming it and the routes there are (the openai client
    reads it as an error object); without the token the 401 comes first and names no route."""
    api, url = server
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/nope", headers={"Authorization": f"Bearer {KEY.api_token}"}) as r:
            assert r.status == 404 and r.content_type == "application/json"
            err = (await r.json())["error"]
            assert "GET /v1/nope" in err["message"] and "POST /v1/chat/completions" in err["message"]
            assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "unknown_route")
        async with s.get(f"{url}/nope") as r:
            err = (await r.json())["error"]
            assert r.status == 401 and err["code"] == "invalid_api_key" and "/v1/models" not in err["message"]
    client = _client(url)
    with pytest.raises(openai.NotFoundError) as info:
        await client.get("/nope", cast_to=object)
    assert isinstance(info.value.body, dict) and "/v1/nope" in info.value.body["message"]
    prompt = PROMPTS[0]  # a valid request on the same server still answers
    r = await client.chat.completions.create(model="smollm2-135m-instruct-q4_1",
                                             messages=[{"role": "user", "content": prompt}],
                                             max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == oracle[prompt][0]
    await client.close()


async def test_wrong_method_gets_405_with_allow_in_openai_error_shape(server):
    api, url = server
    headers = {"Authorization": f"Bearer {KEY.api_token}"}
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.get(f"{url}/chat/completions") as r:
            assert r.status == 405 and r.content_type == "application/json"
            assert "POST" in r.headers["Allow"]
            err = (await r.json())["error"]
            assert "GET /v1/chat/completions" in err["message"] and "POST" in err["message"]
            assert (err["type"], err["code"]) == ("invalid_request_error", "method_not_allowed")
        async with s.post(f"{url}/models", json={}) as r:
            assert r.status == 405 and "GET" in r.headers["Allow"]
            assert (await r.json())["error"]["code"] == "method_not_allowed"
        async with s.get(f"{url}/models") as r:
            assert r.status == 200


async def test_dashboard_keeps_its_own_answers_beside_json_404s(engine):
    """The dashboard's page stays HTML and a missing file of it keeps its plain-text 404; only a
    path no route serves gets the JSON error, which lists the dashboard's routes too."""
    from swarm.peer.coordinator.dashboard import Dashboard

    model, tok = engine
    api = ApiServer.for_swarm_key(EngineBackend(model, tok, model_id="m"), KEY)
    Dashboard(lambda: {}).attach(api)
    port = await api.start("127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/dashboard/") as r:
                assert r.status == 200 and r.content_type == "text/html"
            async with s.get(f"{base}/dashboard/nope.js") as r:  # public, matched, the handler's own 404
                assert r.status == 404 and r.content_type == "text/plain" and "nope.js" in await r.text()
            async with s.get(f"{base}/dashboard/a/b", headers={"Authorization": f"Bearer {KEY.api_token}"}) as r:
                err = (await r.json())["error"]
                assert r.status == 404 and "GET /dashboard/state" in err["message"]
    finally:
        await api.close()


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["</end>", "STOP"])
    out = []
    for piece in ["Hello </", "e", "nd", "> more"]:
        text, stopped = m.push(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Hello " and stopped
    m = StopMatcher(["STOP"])
    assert m.push("ST") == ("", False)
    assert m.push("ART") == ("START", False)
    assert m.push("ab S") == ("ab ", False)
    assert m.flush() == "S"


async def test_sampling_fields_reach_the_engine(server, engine):
    """temperature, top_p, top_k and seed give the engine's own seeded sample, not greedy."""
    from swarm.compute.sampling import SamplingParams
    from swarm.compute.textgen import generate_text

    model, tok = engine
    api, url = server
    messages = [{"role": "user", "content": PROMPTS[1]}]
    params = SamplingParams(temperature=1.3, top_p=0.95, top_k=50, seed=11, max_tokens=MAX_TOKENS)
    want = "".join(generate_text(model, tok, messages, params))
    r = await _client(url).chat.completions.create(
        model="smollm2-135m-instruct-q4_1", messages=messages, max_tokens=MAX_TOKENS,
        temperature=1.3, top_p=0.95, seed=11, extra_body={"top_k": 50})
    assert r.choices[0].message.content == want


async def test_a_closing_server_hands_its_streams_back_within_a_second(engine, oracle, tmp_path, monkeypatch):
    """A coordinator that steps down closes its API: a stream in flight ends within a second with
    an error event coded ``coordinator_changed`` (not after its last token), and ``generate``'s
    client sends the request to the next coordinator, whose reply it shows once: the local text."""
    import json
    import threading
    import time

    from swarm.peer.client import Endpoint, stream_chat_retrying
    from swarm.peer.status import STATUS_FILE

    model, tok = engine
    deposed = ApiServer.for_swarm_key(EngineBackend(model, tok, model_id="m"), KEY)
    successor = ApiServer.for_swarm_key(EngineBackend(model, tok, model_id="m"), KEY)
    port, next_port = await deposed.start("127.0.0.1", 0), await successor.start("127.0.0.1", 0)
    monkeypatch.setenv("COLIBRI_SWARM_CONFIG_DIR", str(tmp_path))  # how the client finds the next one
    (tmp_path / STATUS_FILE).write_text(json.dumps({"pid": os.getpid(), "updated": time.time() + 3600,
                                                    "role": "worker", "api_url": f"http://127.0.0.1:{next_port}/v1"}))
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": MAX_TOKENS, "temperature": 0}
    slow = {**body, "max_tokens": 400}
    try:
        # The raw stream: the error event, its code, and how soon after close() it came.
        async with aiohttp.ClientSession() as s:
            r = await s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**slow, "stream": True},
                             headers={"Authorization": f"Bearer {KEY.api_token}"})
            await r.content.readline()  # the role chunk: the sequence is admitted
            await r.content.readline()
            closing = asyncio.create_task(deposed.close())
            t0 = time.monotonic()
            events = [line async for line in r.content if line.startswith(b"data: ")]
            ended_s = time.monotonic() - t0
            await closing
        assert ended_s < 1.0, ended_s
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "coordinator_changed" and events[-1].strip() == b"data: [DONE]"
        assert len(events) < 50, "the stream ran on after the server began closing"

        # The client: a request handed back midway is finished by the successor, shown once.
        deposed = ApiServer.for_swarm_key(EngineBackend(model, tok, model_id="m"), KEY)
        port = await deposed.start("127.0.0.1", 0)
        pieces: list[str] = []
        first = threading.Event()

        def client() -> None:
            for piece in stream_chat_retrying(Endpoint(f"http://127.0.0.1:{port}/v1", KEY.api_token), slow):
                pieces.append(piece)
                first.set()

        done = asyncio.get_running_loop().run_in_executor(None, client)
        await asyncio.get_running_loop().run_in_executor(None, first.wait, 60)
        await deposed.close()
        await asyncio.wait_for(done, 120)
        text = "".join(pieces)
        assert text.startswith(oracle[PROMPTS[0]][0]) and len(pieces) > 1
    finally:
        await deposed.close()
        await successor.close()


async def test_a_deposed_server_sends_its_clients_to_the_next_coordinator(engine, oracle, tmp_path, monkeypatch):
    """A coordinator that steps down keeps answering at its address (ApiServer.hand_over): it
    finds the next coordinator's API on mDNS and answers every request with a 503 coded
    ``coordinator_changed`` naming it (``coordinator_url``); generate's client goes there at once
    (no mDNS search of its own) and shows the local text; the dashboard page is still served."""
    from swarm.peer import client as client_mod
    from swarm.peer.client import Endpoint, stream_chat_retrying
    from swarm.peer.coordinator.dashboard import Dashboard

    key = SwarmKey(os.urandom(32))  # a swarm of its own: other swarms' mDNS records are not ours
    model, tok = engine
    deposed = ApiServer.for_swarm_key(EngineBackend(model, tok, model_id="m"), key)
    Dashboard(lambda: {"swarm_id": key.swarm_id}).attach(deposed)
    successor = ApiServer.for_swarm_key(EngineBackend(model, tok, model_id="m"), key)
    port = await deposed.start("0.0.0.0", 0, tls=False, advertise=("peer-a", 1))
    next_port = await successor.start("0.0.0.0", 0, tls=False, advertise=("peer-b", 2))
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": MAX_TOKENS, "temperature": 0}
    headers = {"Authorization": f"Bearer {key.api_token}"}
    try:
        await deposed.hand_over()
        for _ in range(150):  # mDNS: the successor's record (its first announcements take ~1 s)
            if deposed.successor is not None:
                break
            await asyncio.sleep(0.1)
        assert deposed.successor is not None and deposed.successor.startswith("http://")
        assert deposed.successor.endswith(f":{next_port}")
        async with aiohttp.ClientSession() as s:
            r = await s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers)
            error = (await r.json())["error"]
            assert (r.status, error["code"], error["coordinator_url"]) == (503, "coordinator_changed", deposed.successor)
            r = await s.get(f"http://127.0.0.1:{port}/dashboard/state", headers=headers)
            assert r.status == 503 and (await r.json())["error"]["coordinator_url"] == deposed.successor
            r = await s.get(f"http://127.0.0.1:{port}/dashboard/")  # the page itself: still here, no secret in it
            assert r.status == 200 and "dashboard" in (await r.text()).lower()
            r = await s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
            assert r.status == 401  # a stranger learns nothing, not even where the coordinator went

        def no_search(last):
            raise AssertionError("the client searched mDNS although the deposed coordinator named the next one")

        monkeypatch.setattr(client_mod, "_next_endpoint", no_search)
        text = await asyncio.get_running_loop().run_in_executor(None, lambda: "".join(stream_chat_retrying(
            Endpoint(f"http://127.0.0.1:{port}/v1", key.api_token), body)))
        assert text == oracle[PROMPTS[0]][0]
    finally:
        await deposed.close()
        await successor.close()
