"""Rendezvous with ``--signal URL`` (no mDNS) over real WSS on loopback: connect, presence,
signals, and reconnection when the server comes back; mDNS find-or-host is covered by
tests/multihost/test_discovery_multihost.py."""

from __future__ import annotations

import asyncio

import pytest

from swarm.discovery import Connected, Rendezvous
from swarm.errors import AuthenticationError
from swarm.signaling import PeerJoined, SignalingServer, SignalReceived

KEY = bytes(range(1, 33))


async def next_of(rv, kind, timeout=10.0):
    while True:
        event = await asyncio.wait_for(rv.__anext__(), timeout)
        if isinstance(event, kind):
            return event


async def test_fixed_url_connect_signal_and_reconnect(tmp_path):
    server = SignalingServer(KEY, "h", config_dir=tmp_path)
    await server.start("127.0.0.1", 0)
    port = server.port
    url = server.url("127.0.0.1")
    a = Rendezvous(KEY, "A", signal_url=url, fingerprint=server.certificate.fingerprint)
    b = Rendezvous(KEY, "B", signal_url=url)  # unpinned: the server's HMAC proof authenticates it
    try:
        await a.start(timeout=10)
        await b.start(timeout=10)
        first = await next_of(a, Connected)
        assert first.host == "h" and not first.hosting and [p.peer_id for p in first.peers] == ["A"]
        assert first.url == url
        assert (await next_of(a, PeerJoined)).peer.peer_id == "B"
        await b.send_signal("A", {"type": "offer"})
        assert await next_of(a, SignalReceived) == SignalReceived("B", {"type": "offer"})

        await server.stop()  # the host goes away; both keep retrying the fixed URL
        server = SignalingServer(KEY, "h2", config_dir=tmp_path)
        await server.start("127.0.0.1", port)
        again = await next_of(a, Connected)
        assert again.host == "h2"
        while (await next_of(b, Connected)).host != "h2":
            pass
        while sorted(a.peers) != ["A", "B"]:
            await next_of(a, PeerJoined)
        await a.send_signal("B", {"n": 2})
        assert await next_of(b, SignalReceived) == SignalReceived("A", {"n": 2})
    finally:
        await a.stop()
        await b.stop()
        await server.stop()


async def test_fixed_url_wrong_key_is_an_error_not_a_retry_loop(tmp_path):
    server = SignalingServer(KEY, "h", config_dir=tmp_path)
    await server.start("127.0.0.1", 0)
    rv = Rendezvous(bytes(32), "A", signal_url=server.url("127.0.0.1"))
    try:
        with pytest.raises(AuthenticationError):
            await rv.start(timeout=10)
    finally:
        await rv.stop()
        await server.stop()
