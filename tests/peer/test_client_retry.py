"""A request whose coordinator goes away midway is sent again to the next one, and the user sees
the reply once: real HTTP servers (aiohttp) that stream Server-Sent Events as the API does, one
of which breaks off its stream after a few pieces, as a killed coordinator does."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from swarm.errors import SwarmError
from swarm.peer.client import ApiUnavailableError, Endpoint, stream_chat, stream_chat_retrying

REPLY = ["Hel", "lo, ", "wor", "ld."]
BODY = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def _sse(piece: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'delta': {'content': piece}}]})}\n\n".encode()


def _app(pieces: list[str], *, break_after: int | None) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, piece in enumerate(pieces):
            if i == break_after:
                request.transport.abort()  # the coordinator's process is gone: no end of stream
                return resp
            await resp.write(_sse(piece))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    return app


@pytest.fixture
def serve() -> Iterator:
    """``serve(pieces, break_after)`` → an Endpoint of a live server in a background loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="coordinators", daemon=True)
    thread.start()
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> int:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return runner.addresses[0][1]

    def make(pieces: list[str], break_after: int | None = None) -> Endpoint:
        port = asyncio.run_coroutine_threadsafe(start(_app(pieces, break_after=break_after)), loop).result(10)
        return Endpoint(f"http://127.0.0.1:{port}/v1", "token")

    yield make

    async def stop() -> None:
        for runner in runners:
            await runner.cleanup()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_a_broken_stream_is_an_unavailable_api(serve):
    dying = serve(REPLY, break_after=2)
    got: list[str] = []
    with pytest.raises(ApiUnavailableError):
        for piece in stream_chat(dying, BODY):
            got.append(piece)
    assert got == REPLY[:2]


def test_retried_on_the_next_coordinator_and_shown_once(serve):
    dying = serve(REPLY, break_after=2)
    successor = serve(["Hello, world."])  # another coordinator cuts the same text differently
    retries: list[SwarmError] = []
    pieces = list(stream_chat_retrying(dying, BODY, api=successor.url, on_retry=retries.append))
    assert "".join(pieces) == "".join(REPLY)
    assert pieces[:2] == REPLY[:2] and len(retries) == 1 and isinstance(retries[0], ApiUnavailableError)


def test_a_different_reply_after_the_retry_is_refused(serve):
    dying = serve(REPLY, break_after=2)
    other = serve(["Good", "bye."])  # sampling without a seed: another text
    with pytest.raises(SwarmError, match="differs from the text already shown"):
        list(stream_chat_retrying(dying, BODY, api=other.url))


def test_no_coordinator_within_the_retry_window_fails_clearly(serve):
    dying = serve(REPLY, break_after=1)
    with pytest.raises(SwarmError, match="no coordinator answered within 1 s"):
        list(stream_chat_retrying(dying, BODY, api="http://127.0.0.1:9/v1", retry_s=1.0))
