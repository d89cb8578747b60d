"""The engine's replies stream without a thread per request (the scheduler tells the event loop
once per step which replies it fed): over concurrent requests every stream gets every piece in
order, its finish reason and usage, and the same SSE bytes as the same requests iterated in a
thread (a backend whose replies cannot be polled) and as the request alone."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp

from swarm.compute.model import load_model
from swarm.compute.tokenizer import tokenizer_for
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.api import ApiServer
from swarm.peer.coordinator.api_engine import EngineBackend
from tests.peer._swarm_models import add_char_tokenizer, build

KEY = SwarmKey(bytes(range(2, 34)))
HEADERS = {"Authorization": f"Bearer {KEY.api_token}"}
# (prompt, extra fields): plain text, a stop string, logprobs with echo, a chat request
REQUESTS = [("the fox and the hen", {}), ("abc abc abc", {"max_tokens": 14}),
            ("tell me a story", {"logprobs": 2, "echo": True}), ("hello swarm", {"chat": True}),
            ("what is 2+2? " * 6, {}), ("zz", {"max_tokens": 3}), ("abc abc abc", {"max_tokens": 14, "stop": ["r"]})]


class _Plain:
    """A reply as a bare blocking iterator (no ``poll``/``listen``): the API iterates it in a thread."""

    def __init__(self, reply) -> None:
        self.reply = reply

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.reply)

    def cancel(self) -> None:
        self.reply.cancel()

    def prompt_logprobs(self):
        return self.reply.prompt_logprobs()


class _Ahead(_Plain):
    """A reply whose generation has run to its end before its first piece is read (as a batch
    runs on while the event loop is busy): its stats count every token computed."""

    def __init__(self, reply) -> None:
        super().__init__(reply)
        self.pieces = None

    def __next__(self):
        if self.pieces is None:  # on the API's worker thread
            self.pieces = iter(list(self.reply))
        return next(self.pieces)


class _Threaded:
    """The same engine, its replies iterated in a thread (``wrap``: as what)."""

    def __init__(self, inner: EngineBackend, wrap=_Plain) -> None:
        self.inner, self.wrap = inner, wrap
        self.model_id, self.max_tokens_limit, self.concurrency = inner.model_id, inner.max_tokens_limit, inner.concurrency

    def prepare(self, request):
        return self.inner.prepare(request)

    def generate(self, request, stats):
        return self.wrap(self.inner.generate(request, stats))


async def _lines(s: aiohttp.ClientSession, url: str, prompt: str, extra: dict) -> list[bytes]:
    """The SSE event lines of one streamed request, its id and creation time blanked."""
    extra = dict(extra)
    body = {"max_tokens": extra.pop("max_tokens", 12), "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if body.pop("chat", False):
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "chat/completions"
    else:
        body["prompt"] = prompt
        path = "completions"
    async with s.post(f"{url}/{path}", json=body, headers=HEADERS) as r:
        assert r.status == 200, await r.text()
        raw = await r.read()
    events = [e for e in raw.split(b"\n\n") if e and not e.startswith(b":")]  # comments (keep-alives) are no events
    return [re.sub(rb'"id": "[^"]*", "object": "([^"]*)", "created": \d+', rb'"object": "\1"', e) for e in events]


async def _run(backend, model, concurrent: bool, requests=REQUESTS) -> list[list[bytes]]:
    api = ApiServer.for_swarm_key(backend, KEY)
    port = await api.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        async with aiohttp.ClientSession() as s:
            if concurrent:
                return list(await asyncio.gather(*[_lines(s, url, p, x) for p, x in requests]))
            return [await _lines(s, url, p, x) for p, x in requests]
    finally:
        await api.close()


async def test_streams_from_the_loop_equal_threaded_and_solo_streams(tmp_path):
    model_dir = add_char_tokenizer(build("qwen2_moe", tmp_path))
    model = load_model(model_dir)
    tok = tokenizer_for(model)

    def engine():
        return EngineBackend(model, tok, model_id="tiny", max_batch=len(REQUESTS))

    loop_backend = engine()
    together = await _run(loop_backend, model, concurrent=True)
    assert loop_backend.scheduler.peak_batch > 1  # they shared steps
    threaded = await _run(_Threaded(engine()), model, concurrent=True)
    solo = await _run(engine(), model, concurrent=False)
    ahead = await _run(_Threaded(engine(), _Ahead), model, concurrent=True)
    assert together == threaded == solo == ahead
    # the stop request without its stop, with its tokens
    [uncut] = await _run(engine(), model, concurrent=False, requests=[("abc abc abc", {"max_tokens": 14, "logprobs": 0})])
    uncut = [json.loads(e.removeprefix(b"data: ")) for e in uncut[:-3]]
    uncut_tokens = [t for o in uncut for t in o["choices"][0]["logprobs"]["tokens"]]
    for (prompt, extra), events in zip(REQUESTS, together):
        assert events[-1] == b"data: [DONE]"
        objs = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
        for e, obj in zip(events, objs):  # each chunk is what json.dumps writes for it
            assert e == b"data: " + json.dumps(obj).encode()
        usage = objs[-1]["usage"]
        finish = objs[-2]["choices"][0]["finish_reason"]
        pieces = objs[:-2]
        if extra.get("chat"):
            text = "".join(o["choices"][0]["delta"].get("content", "") for o in pieces)
        else:
            text = "".join(o["choices"][0]["text"] for o in pieces)
        if extra.get("echo"):
            assert text.startswith(prompt)
            offsets = [x for o in pieces for x in o["choices"][0]["logprobs"]["text_offset"]]
            assert offsets == sorted(offsets) and len(offsets) == len(tok.encode(prompt)) + usage["completion_tokens"]
        if "stop" in extra:  # its reply without the stop string is "=c=c=r=r=…": cut at "r"
            assert finish == "stop" and text == "=c=c="
            # the tokens up to the one that wrote the "r", not those its batch ran on meanwhile
            assert usage["completion_tokens"] == next(i + 1 for i in range(len(uncut_tokens))
                                                      if "r" in "".join(uncut_tokens[:i + 1]))
        else:
            assert usage["completion_tokens"] == extra.get("max_tokens", 12)  # greedy, no end token in reach
            assert finish == "length" and text
        assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"]
