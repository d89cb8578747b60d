"""A request whose coordinator goes away midway is sent again to the next one, and the user sees
the reply once: real HTTP servers (aiohttp) that stream Server-Sent Events as the API does, one
of which breaks off its stream after a few pieces, as a killed coordinator does."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from aiohttp import web

from swarm.errors import SwarmError
from swarm.peer.client import ApiUnavailableError, Endpoint, stream_chat, stream_chat_retrying

REPLY = ["Hel", "lo, ", "wor", "ld."]
BODY = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def _sse(piece: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'delta': {'content': piece}}]})}\n\n".encode()


def _error(code: str) -> dict:
    return {"error": {"message": f"this peer stopped serving the swarm's API ({code})", "type": "server_error",
                      "param": None, "code": code}}


def _app(pieces: list[str], *, break_after: int | None, hand_back_after: int | None = None,
         code: str = "coordinator_changed", freeze_after: int | None = None,
         thaw: asyncio.Event | None = None) -> web.Application:
    HANDED_BACK = _error(code)

    async def completions(request: web.Request) -> web.StreamResponse:
        if hand_back_after == -1:  # stepped down before the request: a 503 naming it
            return web.json_response(HANDED_BACK, status=503, headers={"Retry-After": "1"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, piece in enumerate(pieces):
            if i == break_after:
                request.transport.abort()  # the coordinator's process is gone: no end of stream
                return resp
            if i == freeze_after:  # its laptop asleep: the connection stays open, nothing more comes
                assert thaw is not None
                await thaw.wait()  # until the fixture stops the servers
                return resp
            if i == hand_back_after:  # stepped down midway: an error event, then the end
                await resp.write(f"data: {json.dumps(HANDED_BACK)}\n\ndata: [DONE]\n\n".encode())
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
    thaw = asyncio.Event()  # set on the servers' loop when they stop: a frozen handler then returns

    async def start(app: web.Application) -> int:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return runner.addresses[0][1]

    def make(pieces: list[str], break_after: int | None = None, hand_back_after: int | None = None,
             code: str = "coordinator_changed", freeze_after: int | None = None) -> Endpoint:
        app = _app(pieces, break_after=break_after, hand_back_after=hand_back_after, code=code,
                   freeze_after=freeze_after, thaw=thaw)
        port = asyncio.run_coroutine_threadsafe(start(app), loop).result(10)
        return Endpoint(f"http://127.0.0.1:{port}/v1", "token")

    yield make

    async def stop() -> None:
        thaw.set()
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


@pytest.fixture
def local_peer(tmp_path, monkeypatch):
    """``local_peer(url)``: a peer runs on this machine and its status names the API at ``url``
    (how the client finds the next coordinator); ``local_peer(None)``: no peer runs here."""
    from swarm.peer.status import STATUS_FILE

    monkeypatch.setenv("COLIBRI_SWARM_CONFIG_DIR", str(tmp_path))

    def point(url: str | None) -> None:
        status = {"pid": os.getpid(), "updated": time.time() + 3600, "role": "worker", "api_url": url}
        if url is None:
            (tmp_path / STATUS_FILE).unlink(missing_ok=True)
        else:
            (tmp_path / STATUS_FILE).write_text(json.dumps(status))

    return point


def test_retried_on_the_next_coordinator_and_shown_once(serve, local_peer):
    dying = serve(REPLY, break_after=2)
    successor = serve(["Hello, world."])  # another coordinator cuts the same text differently
    local_peer(successor.url)
    retries: list[SwarmError] = []
    pieces = list(stream_chat_retrying(dying, BODY, on_retry=retries.append))
    assert "".join(pieces) == "".join(REPLY)
    assert pieces[:2] == REPLY[:2] and len(retries) == 1 and isinstance(retries[0], ApiUnavailableError)


@pytest.mark.parametrize("after", [0, 2])
def test_a_coordinator_that_falls_silent_is_left_for_the_next(serve, local_peer, monkeypatch, after):
    """A coordinator asleep (SIGSTOP, a laptop's lid) keeps its connections open and sends
    nothing, not even the API's keep-alive comments: after STALL_S the request goes to the
    coordinator elected meanwhile, the reply shown once — not a wait as long as the sleep."""
    from swarm.peer import client

    monkeypatch.setattr(client, "STALL_S", 0.5)
    asleep = serve(REPLY, freeze_after=after)
    local_peer(serve(["Hello, world."]).url)
    retries: list[SwarmError] = []
    t0 = time.monotonic()
    pieces = list(stream_chat_retrying(asleep, BODY, on_retry=retries.append))
    assert "".join(pieces) == "".join(REPLY) and pieces[:after] == REPLY[:after]
    assert time.monotonic() - t0 < 5.0
    assert len(retries) == 1 and "sent nothing for 0.5 s" in str(retries[0])


@pytest.mark.parametrize("after", [-1, 0, 2])
def test_a_request_handed_back_by_a_deposed_coordinator_is_retried(serve, local_peer, after):
    """A coordinator that steps down fails its requests with code ``coordinator_changed`` (a 503,
    or an error event mid-stream): the client sends them to the next one; any other error is final."""
    deposed = serve(REPLY, hand_back_after=after)
    local_peer(serve(["Hello, world."]).url)
    retries: list[SwarmError] = []
    pieces = list(stream_chat_retrying(deposed, BODY, on_retry=retries.append))
    assert "".join(pieces) == "".join(REPLY) and len(retries) == 1
    assert isinstance(retries[0], ApiUnavailableError) and "stopped serving" in str(retries[0])


@pytest.mark.parametrize("after", [-1, 1])
def test_another_error_is_not_retried(serve, local_peer, after):
    failing = serve(REPLY, hand_back_after=after, code="server_error")
    local_peer(serve(REPLY).url)
    with pytest.raises(SwarmError, match="server_error") as info:
        list(stream_chat_retrying(failing, BODY))
    assert not isinstance(info.value, ApiUnavailableError)


def test_a_different_reply_after_the_retry_is_refused(serve, local_peer):
    dying = serve(REPLY, break_after=2)
    local_peer(serve(["Good", "bye."]).url)  # sampling without a seed: another text
    with pytest.raises(SwarmError, match="differs from the text already shown"):
        list(stream_chat_retrying(dying, BODY))


def test_no_coordinator_within_the_retry_window_fails_clearly(serve, local_peer):
    """Several attempts to find the next one, but the user is told of the wait once."""
    dying = serve(REPLY, break_after=1)
    local_peer(None)
    retries: list[SwarmError] = []
    with pytest.raises(SwarmError, match="no coordinator answered within 1.5 s"):
        list(stream_chat_retrying(dying, BODY, retry_s=1.5, on_retry=retries.append))
    assert len(retries) == 1


def test_a_named_api_is_not_retried(serve):
    """With --api there is no next coordinator to look for: the first failure is the answer."""
    dying = serve(REPLY, break_after=2)
    retries: list[SwarmError] = []
    got: list[str] = []
    with pytest.raises(SwarmError, match="(broke off|closed) the stream") as info:
        for piece in stream_chat_retrying(dying, BODY, rediscover=False, on_retry=retries.append):
            got.append(piece)
    assert got == REPLY[:2] and retries == [] and not isinstance(info.value, ApiUnavailableError)


def test_generate_at_an_unreachable_named_api_fails_at_once_in_one_line(tmp_path):
    """No "[cannot reach … trying the next coordinator]" lines: one error line, exit 2."""
    env = dict(os.environ, COLIBRI_SWARM_CONFIG_DIR=str(tmp_path), COLIBRI_SWARM_API_KEY="t" * 64)
    proc = subprocess.run([sys.executable, "-m", "swarm", "generate", "--api", "http://127.0.0.1:9/v1", "hi"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "colibri-swarm: error: cannot reach the coordinator's API at http://127.0.0.1:9/v1: [Errno 111] Connection "
        "refused; is `colibri-swarm join` running?"]
