"""Bounded request heads (swarm.httpserver): the API, the signaling server and the slice server
serve through it. Oracles: the status line a client reads, the log records, and whether the
server closed the connection (``read()`` returns b"" at once) or not."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time

import pytest
from aiohttp import web

from swarm.httpserver import HttpServer
from swarm.peer.coordinator.api import ApiServer

BIG_HEADER = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 16384 + b"\r\n\r\n"


class _Backend:  # what ApiServer reads of a backend before any request reaches the engine
    model_id, max_tokens_limit, concurrency = "m", 16, 1


async def _serve_ok(**options) -> HttpServer:
    app = web.Application()

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/", ok)
    server = HttpServer(app, name="test", **options)
    await server.start("127.0.0.1", 0)
    return server


async def test_a_header_over_8_kib_is_400_without_a_traceback(caplog):
    api = ApiServer(_Backend(), ["t" * 64])
    port = await api.start("127.0.0.1", 0)
    try:
        with caplog.at_level(logging.INFO):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(BIG_HEADER)
            answer = await asyncio.wait_for(reader.read(), 5)
            writer.close()
    finally:
        await api.close()
    assert answer.startswith(b"HTTP/1.0 400 Bad Request\r\n") or answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"Got more than 8190 bytes" in answer
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    refused = [r.getMessage() for r in caplog.records if "refused a malformed request" in r.getMessage()]
    assert refused and "(400, LineTooLong" in refused[0] and "127.0.0.1" in refused[0]
    assert not [r for r in caplog.records if r.exc_info], "a client's malformed request logged a traceback"


async def test_a_trickling_head_is_cut_at_the_deadline_a_prompt_one_is_served():
    server = await _serve_ok(header_timeout_s=0.4)
    try:
        slow_r, slow_w = await asyncio.open_connection("127.0.0.1", server.port)
        start = time.monotonic()

        async def trickle() -> None:  # one byte at a time, never the blank line
            for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                slow_w.write(bytes([byte]))
                await asyncio.sleep(0.02)

        trickling = asyncio.create_task(trickle())
        try:
            cut = await asyncio.wait_for(slow_r.read(), 3)
        except ConnectionResetError:  # closed while a byte was on its way: the kernel answered it with a reset
            cut = b""
        held = time.monotonic() - start
        trickling.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await trickling
        fast_r, fast_w = await asyncio.open_connection("127.0.0.1", server.port)
        fast_w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(fast_r.readuntil(b"ok"), 3)
        idle_start = time.monotonic()
        assert await asyncio.wait_for(fast_r.read(), 3) == b""  # an idle keep-alive goes at the deadline too
        idle = time.monotonic() - idle_start
        for w in (slow_w, fast_w):
            w.close()
    finally:
        await server.close()
    assert cut == b"" and 0.4 <= held < 1.2, (cut[:40], held)
    assert answer.startswith(b"HTTP/1.1 200 OK") and 0.3 <= idle < 1.2, idle


async def test_waiting_connections_past_the_cap_are_closed_oldest_first():
    server = await _serve_ok(header_timeout_s=30, max_waiting=4)
    try:
        conns = []
        for _ in range(10):
            conns.append(await asyncio.open_connection("127.0.0.1", server.port))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        server.sweep()
        open_ = []
        for reader, writer in conns:
            try:
                await asyncio.wait_for(reader.read(1), 0.2)
                open_.append(False)  # read returned: closed by the server
            except asyncio.TimeoutError:
                open_.append(True)
            writer.close()
    finally:
        await server.close()
    assert open_ == [False] * 6 + [True] * 4
    assert server.closed_stalled == 6


async def test_signaling_server_cuts_a_trickling_head(tmp_path, monkeypatch, caplog):
    import swarm.httpserver as httpserver
    from swarm.signaling.server import SignalingServer

    monkeypatch.setattr(httpserver, "HEADER_TIMEOUT_S", 0.4)
    srv = SignalingServer(bytes(range(32)), "host-peer", config_dir=tmp_path)
    await srv.start("127.0.0.1", 0)
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with caplog.at_level(logging.INFO):
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port, ssl=context)
            start = time.monotonic()
            writer.write(b"GET / HTT")
            cut = await asyncio.wait_for(reader.read(), 3)
            held = time.monotonic() - start
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port, ssl=context)
            writer.write(BIG_HEADER)
            answer = await asyncio.wait_for(reader.read(), 3)
            writer.close()
    finally:
        await srv.stop()
    assert cut == b"" and held < 1.5
    assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("timeout, cap", [(0, 4), (1, 0)])
def test_bad_settings_are_refused(timeout, cap):
    with pytest.raises(ValueError, match="header_timeout_s must be > 0 and max_waiting"):
        HttpServer(web.Application(), header_timeout_s=timeout, max_waiting=cap)
