"""Every input the API can be sent gets a clear answer: one test per kind, the exact error or the
right value. And HTTPS: the official ``openai`` client works with the exported CA certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time

import aiohttp
import openai
import pytest

from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.api import ApiServer
from swarm.peer.coordinator.api_engine import EngineBackend

KEY = SwarmKey(bytes(range(1, 33)))
MODEL_ID = "smollm2"
HEADERS = {"Authorization": f"Bearer {KEY.api_token}"}
USER = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def backend(engine):
    model, tok = engine
    return EngineBackend(model, tok, model_id=MODEL_ID)


@pytest.fixture
async def url(backend):
    api = ApiServer.for_swarm_key(backend, KEY)
    port = await api.start("127.0.0.1", 0)
    assert api.scheme == "http"  # loopback: plain HTTP stays on this machine
    yield f"http://127.0.0.1:{port}/v1"
    await api.close()


async def _post(url: str, data: bytes) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/chat/completions", data=data, headers=HEADERS) as r:
            return r.status, (await r.json())["error"]


@pytest.mark.parametrize("data, says", [
    (b"[" * 100_000 + b"]" * 100_000, "nests arrays/objects too deeply"),
    (b'{"messages": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001, "nests arrays/objects too deeply"),
    (b"", "not valid JSON: Expecting value"),
    (b'{"messages": [}', "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8 (byte 0)"),
    (b'{"messages": [], "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),  # more digits than int() takes
    (b"[1, 2]", "must be a JSON object"),
    (b'"hello"', "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate '\\ud800' at character 0"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}',
     "lone surrogate '\\udfff' at character 1"),
])
async def test_malformed_bodies_are_400_naming_what_was_wrong(url, data, says):
    status, error = await _post(url, data)
    assert status == 400 and error["type"] == "invalid_request_error"
    assert says in error["message"]


async def test_prompt_past_the_context_is_400_naming_the_numbers(url, engine):
    """Checked before any work: a ~1 MB prompt is refused by its byte count (never encoded), one of
    ~500 kB by its token count (no KV cache for 100,000 positions, no MemoryError), and so is
    max_tokens past what the context leaves."""
    model, tok = engine
    ctx = model.config.max_position_embeddings
    assert (ctx, tok.max_token_bytes) == (8192, 81)  # SmolLM2's longest token: a newline and 80 spaces
    huge = "lorem ipsum " * 80_000  # 960 kB: at least 11,852 tokens whatever the text
    text = tok.apply_chat_template([{"role": "user", "content": huge}])
    status, error = await _post(url, json.dumps({"messages": [{"role": "user", "content": huge}]}).encode())
    assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert error["message"] == (
        f"the prompt in its chat template is {len(text)} bytes, so at least {-(-len(text) // 81)} tokens (no token "
        f"of this model stands for more than 81 bytes), with room for 1 reply token: more than the model's context "
        f"of {ctx} tokens; shorten the prompt")  # max_tokens not sent: not named

    long = "lorem ipsum " * 40_000  # 480 kB: under the byte bound, so encoded
    n = len(tok.encode_chat([{"role": "user", "content": long}]))
    status, error = await _post(url, json.dumps({"messages": [{"role": "user", "content": long}]}).encode())
    assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert error["message"] == (f"the prompt is {n} tokens with room for 1 reply token: {n + 1} > the model's "
                                f"context of {ctx} tokens; shorten the prompt")
    prompt = len(tok.encode_chat(USER))
    body = {"messages": USER, "max_tokens": ctx - prompt + 1}
    status, error = await _post(url, json.dumps(body).encode())
    assert status == 400 and f"{prompt} tokens and max_tokens is {ctx - prompt + 1}: {ctx + 1} > " in error["message"]


async def test_a_stream_keeps_its_pace_while_huge_prompts_are_refused(url):
    """Sixteen 1 MB prompts (refused by their byte count) and two of 480 kB (encoded, then refused
    by their token count) arrive while a reply streams: every one gets its 400 within seconds, the
    stream's tokens keep coming at their pace and the event loop stays free — encoding holds no
    lock the loop needs (the library's one-text call held the GIL 0.9 s per megabyte)."""
    lags: list[float] = []

    async def probe() -> None:  # how late the loop wakes a 10 ms sleep
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - start - 0.01)

    async def refused(s: aiohttp.ClientSession, content: str) -> tuple[int, str, str, float]:
        start = time.perf_counter()
        async with s.post(f"{url}/chat/completions", headers=HEADERS,
                          json={"messages": [{"role": "user", "content": content}]}) as r:
            error = (await r.json())["error"]
            return r.status, error["code"], error["message"], time.perf_counter() - start

    prober = asyncio.create_task(probe())
    try:
        async with aiohttp.ClientSession() as s:
            body = {"messages": [{"role": "user", "content": "Count from 1 to 200, separated by commas."}],
                    "max_tokens": 400, "stream": True, "temperature": 0}
            async with s.post(f"{url}/chat/completions", json=body, headers=HEADERS) as stream:
                assert stream.status == 200
                arrivals = []

                async def read(n: int) -> None:
                    while len(arrivals) < n:
                        line = await stream.content.readline()
                        assert line, "the stream ended early"
                        if line.startswith(b"data: {"):
                            arrivals.append(time.perf_counter())

                await read(8)  # the stream's own pace, before the flood
                before = max(b - a for a, b in zip(arrivals[1:], arrivals[2:]))
                lags.clear()
                flood_start = len(arrivals)
                flood = asyncio.gather(*(refused(s, "x" * 1_000_000) for _ in range(16)),
                                       *(refused(s, "lorem ipsum " * 40_000) for _ in range(2)))
                reader = asyncio.create_task(read(10_000))
                answers = await flood
                during = len(arrivals)
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, AssertionError):
                    await reader
    finally:
        prober.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await prober
    gaps = [b - a for a, b in zip(arrivals[flood_start:during], arrivals[flood_start + 1:during])]
    assert len(gaps) >= 3, "the stream sent too few tokens while the prompts arrived"
    assert max(gaps) < before + 0.5, (round(before, 3), [round(g, 3) for g in gaps])
    assert max(lags) < 0.25, sorted(lags)[-5:]
    assert all(a[:2] == (400, "context_length_exceeded") for a in answers), answers
    assert max(a[3] for a in answers) < 5.0, [round(a[3], 2) for a in answers]
    assert all("more than the model's context of 8192 tokens" in a[2] for a in answers[:16])
    assert all("> the model's context of 8192 tokens" in a[2] for a in answers[16:])


async def test_default_max_tokens_shrinks_to_what_the_context_leaves(backend, engine):
    """Without max_tokens, a reply may take every position the prompt leaves (as OpenAI's API):
    a long prompt gets those left, not a 400, and a short one is not cut at some smaller default."""
    from swarm.peer.coordinator.api_request import parse_chat_request

    model, tok = engine
    ctx = model.config.max_position_embeddings
    for body in ({"messages": USER}, {"prompt": "Say hi."}):
        if "prompt" in body:
            from swarm.peer.coordinator.api_request import parse_completion_request as parse
            n = len(tok.encode("Say hi.", add_special_tokens=True))
        else:
            parse, n = parse_chat_request, len(tok.encode_chat(USER))
        short = backend.prepare(parse(body, model_id=MODEL_ID, max_tokens_limit=backend.max_tokens_limit))
        assert len(short.prompt_ids) == n and short.max_tokens == ctx - n > 8000, body
    long = [{"role": "user", "content": "lorem ipsum " * 1590}]
    n = len(tok.encode_chat(long))
    assert ctx - 512 < n < ctx
    chat = backend.prepare(parse_chat_request({"messages": long}, model_id=MODEL_ID,
                                              max_tokens_limit=backend.max_tokens_limit))
    assert len(chat.prompt_ids) == n and chat.max_tokens == ctx - n


async def test_tiny_temperature_is_the_greedy_reply(url, engine):
    """temperature 1e-45 (float32's smallest subnormal) used to give NaN probabilities and a 500."""
    from swarm.compute.sampling import SamplingParams
    from swarm.compute.textgen import generate_text

    model, tok = engine
    want = "".join(generate_text(model, tok, USER, SamplingParams(max_tokens=6)))
    client = openai.AsyncOpenAI(base_url=url, api_key=KEY.api_token, max_retries=0)
    r = await client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=6, temperature=1e-45, seed=3)
    assert r.choices[0].message.content == want
    await client.close()


async def test_client_gone_mid_stream_logs_one_line(url, caplog):
    caplog.set_level(logging.DEBUG)
    async with aiohttp.ClientSession() as s:
        body = {"messages": USER, "max_tokens": 64, "stream": True, "temperature": 0}
        r = await s.post(f"{url}/chat/completions", json=body, headers=HEADERS)
        await r.content.readline()  # the first event, then hang up
        r.close()
    # the server notices at its next write; the next request waits for that generation to end
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/chat/completions", json={"messages": USER, "max_tokens": 1},
                          headers=HEADERS) as r2:
            assert r2.status == 200
    gone = [rec for rec in caplog.records if "went away mid-stream" in rec.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].exc_info is None
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info]


# ---------------------------------------------------------------------------------------- HTTPS


@pytest.fixture
async def https_url(backend):
    api = ApiServer.for_swarm_key(backend, KEY)
    port = await api.start("127.0.0.1", 0, tls=True)
    assert api.scheme == "https"
    yield f"https://127.0.0.1:{port}/v1", port
    await api.close()


async def test_openai_client_over_https_with_the_exported_certificate(https_url, tmp_path, engine, monkeypatch):
    """`colibri-swarm key` writes the CA; the openai package trusts it through verify= and through
    SSL_CERT_FILE, with host name checks on. Without it the connection is refused."""
    from swarm.compute.sampling import SamplingParams
    from swarm.compute.textgen import generate_text
    from swarm.peer.coordinator.api_tls import write_ca

    url, _ = https_url
    ca = write_ca(KEY, tmp_path)
    model, tok = engine
    want = "".join(generate_text(model, tok, USER, SamplingParams(max_tokens=6)))

    async with openai.DefaultAsyncHttpxClient(verify=ssl.create_default_context(cafile=str(ca))) as http:
        client = openai.AsyncOpenAI(base_url=url, api_key=KEY.api_token, max_retries=0, http_client=http)
        r = await client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=6, temperature=0)
        assert r.choices[0].message.content == want
        with pytest.raises(openai.AuthenticationError):  # HTTPS does not make the key code a token
            await openai.AsyncOpenAI(base_url=url, api_key=KEY.code, max_retries=0, http_client=http).models.list()

    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    client = openai.AsyncOpenAI(base_url=url, api_key=KEY.api_token, max_retries=0)
    assert [m.id async for m in client.models.list()] == [MODEL_ID]
    await client.close()

    monkeypatch.delenv("SSL_CERT_FILE")
    client = openai.AsyncOpenAI(base_url=url, api_key=KEY.api_token, max_retries=0)
    with pytest.raises(openai.APIConnectionError):  # the system's trust store does not know the swarm's CA
        await client.models.list()
    await client.close()


async def test_cli_client_pins_the_swarm_ca(https_url, tmp_path, monkeypatch):
    """The CLI's client trusts the CA derived from the stored key, and no other."""
    import asyncio

    from swarm.keys import swarmkey
    from swarm.peer.client import find_endpoint, stream_chat

    url, _ = https_url
    monkeypatch.setenv("COLIBRI_SWARM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("COLIBRI_SWARM_API_KEY", raising=False)
    swarmkey.store(KEY.code)
    endpoint = find_endpoint(url, mdns=False)
    assert endpoint.tls is not None
    body = {"messages": USER, "max_tokens": 2, "temperature": 0}
    assert "".join(await asyncio.to_thread(lambda: list(stream_chat(endpoint, body))))
    swarmkey.store(SwarmKey(bytes(32)).code)  # another swarm's key: another CA
    other = find_endpoint(url, mdns=False, token=KEY.api_token)
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
        await asyncio.to_thread(lambda: list(stream_chat(other, body)))


async def test_plain_http_to_the_https_port_gets_no_answer(https_url):
    _, port = https_url
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientError):
            await s.get(f"http://127.0.0.1:{port}/v1/models", headers=HEADERS)


def test_the_ca_is_the_same_on_every_key_holder():
    """Derived from the key alone, byte for byte: one fingerprint to compare on every machine."""
    from swarm.peer.coordinator.api_tls import ca_fingerprint, ca_pem

    again = SwarmKey(KEY.secret)
    assert ca_pem(again) == ca_pem(KEY) and ca_fingerprint(again) == ca_fingerprint(KEY)
    assert ca_pem(SwarmKey(bytes(32))) != ca_pem(KEY)
