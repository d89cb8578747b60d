"""The API serves several requests at once (continuous batching): each reply equals the same
request's solo reply token for token, streamed or not; a client that goes away mid-prompt frees
its slot; beyond the queue a request gets 429 with Retry-After."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from swarm.compute.model import load_model
from swarm.compute.tokenizer import tokenizer_for
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.api import ApiServer
from swarm.peer.coordinator.api_engine import EngineBackend
from swarm.peer.coordinator.dashboard import Dashboard
from tests.peer._swarm_models import add_char_tokenizer, build

KEY = SwarmKey(bytes(range(2, 34)))
HEADERS = {"Authorization": f"Bearer {KEY.api_token}"}
# Prompts of one chunk and of several (64 prompt tokens a chunk; one character a token here).
PROMPTS = ["hello swarm", "tell me a long story about a fox who " * 4, "abc", "what is 2+2? " * 8]


async def _serve(backend):
    api = ApiServer.for_swarm_key(backend, KEY)
    Dashboard(dict).attach(api)  # as the coordinator serves it: the dashboard meters every generation
    port = await api.start("127.0.0.1", 0)
    return api, f"http://127.0.0.1:{port}/v1"


async def _ask(s: aiohttp.ClientSession, url: str, prompt: str, *, stream: bool, max_tokens: int = 10) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    async with s.post(f"{url}/chat/completions", json=body, headers=HEADERS) as r:
        assert r.status == 200, await r.text()
        if not stream:
            return (await r.json())["choices"][0]["message"]["content"]
        import json

        text = ""
        async for line in r.content:
            if line.startswith(b"data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        return text


async def test_concurrent_requests_get_their_solo_replies(tmp_path):
    model_dir = add_char_tokenizer(build("qwen2_moe", tmp_path))
    model = load_model(model_dir)
    backend = EngineBackend(model, tokenizer_for(model), model_id="tiny", max_batch=4)
    api, url = await _serve(backend)
    try:
        async with aiohttp.ClientSession() as s:
            solo = [await _ask(s, url, p, stream=False) for p in PROMPTS]
            assert backend.scheduler.peak_batch == 1
            together = await asyncio.gather(*[_ask(s, url, p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)])
        assert together == solo and all(solo)
        assert backend.scheduler.peak_batch > 1  # they did share steps
        assert len(api.dashboard.generations) == 2 * len(PROMPTS) == api.generations
    finally:
        await api.close()


async def _until(what, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
    return got


async def test_a_client_gone_mid_prompt_frees_its_slot_and_beyond_the_queue_is_429(engine):
    model, tok = engine
    backend = EngineBackend(model, tok, model_id="smollm2", max_batch=1, max_queue=0)
    sched = backend.scheduler
    api, url = await _serve(backend)
    try:
        async with aiohttp.ClientSession() as s:
            # A prompt of ~1,500 tokens: ~24 chunks. Its client hangs up once the prompt is being read.
            long = asyncio.create_task(_ask(s, url, "The quick brown fox jumps over the lazy dog. " * 150,
                                            stream=True, max_tokens=5))
            ident, fed = next(iter((await _until(lambda: sched.snapshot()["prefilling"])).items()))
            long.cancel()
            await asyncio.gather(long, return_exceptions=True)
        left = await _until(lambda: next((x for x in sched.left if x[0] == ident), None))  # out of the batch
        assert sched.snapshot()["running"] == []
        assert left[1] < left[2] and left[3] == 0, left  # it left before its prompt was read: no token made

        async with aiohttp.ClientSession() as s:
            busy = asyncio.create_task(_ask(s, url, "Tell me a story.", stream=True, max_tokens=200))
            await _until(lambda: sched.snapshot()["running"] and not sched.snapshot()["prefilling"])
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with s.post(f"{url}/chat/completions", json=body, headers=HEADERS) as r:
                assert r.status == 429
                assert int(r.headers["Retry-After"]) >= 1
                error = (await r.json())["error"]
                assert error["code"] == "server_busy" and "retry later" in error["message"]
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
            await _until(lambda: sched.snapshot()["running"] == [])
            assert await _ask(s, url, "hi", stream=False, max_tokens=2) is not None  # the slot is free again
    finally:
        await api.close()
