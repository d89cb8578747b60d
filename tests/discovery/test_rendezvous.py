"""Rendezvous with ``--signal URL`` (no mDNS) over real WSS on loopback: connect, presence,
signals, and reconnection when the server comes back; mDNS find-or-host is covered by
tests/multihost/test_discovery_multihost.py."""

from __future__ import annotations

import asyncio

import pytest

from swarm.discovery import Connected, Rendezvous
from swarm.errors import AuthenticationError, SignalingUnavailableError
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


@pytest.fixture
def quick_retries(monkeypatch):
    """The retry constants shrunk so a test sees many attempts in a second or two."""
    import swarm.discovery.rendezvous as rendezvous

    monkeypatch.setattr(rendezvous, "DEAD_RETRY_S", 0.05)
    monkeypatch.setattr(rendezvous, "DEAD_RETRY_MAX_S", 0.2)
    monkeypatch.setattr(rendezvous, "RECONNECT_S", 0.05)
    monkeypatch.setattr(rendezvous, "RECONNECT_MAX_S", 0.2)
    monkeypatch.setattr(rendezvous, "CONNECT_TIMEOUT_S", 0.5)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_dead_learned_server_is_tried_ever_less_often(quick_retries, caplog):
    """A record mDNS keeps listing after its host died (no goodbye): tried after 0.05, 0.1, 0.2 s,
    then every 0.2 s (the cap; 5 minutes outside this test), with one line when it reaches the cap;
    a restart of that host (a new record) is tried at once."""
    import logging
    import time
    from types import SimpleNamespace

    from swarm.discovery.choice import pick_server
    from swarm.discovery.records import ServerRecord

    dead = ServerRecord(name="x", version=1, swarm_id="s", port=_free_port(), fingerprint=bytes(32), host="gone",
                        started=1000.0, addresses=("127.0.0.1",))
    rv = Rendezvous(KEY, "A")
    rv._browser = SimpleNamespace(records={"x": dead})
    attempts = []
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="swarm.discovery.rendezvous"):
        while time.monotonic() - start < 1.5:
            record = pick_server(rv._browser.records.values(), rv._dead_keys())
            if record is None:
                await asyncio.sleep(0.005)
                continue
            attempts.append(time.monotonic() - start)
            assert await rv._try(record) is None
    pauses = [round(b - a, 2) for a, b in zip(attempts, attempts[1:])]
    assert 7 <= len(attempts) <= 10, pauses  # every 0.05 s for 1.5 s would be ~25
    assert pauses[:2] == pytest.approx([0.05, 0.1], abs=0.03) and min(pauses[2:]) >= 0.19, pauses
    capped = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert capped == ["signaling server of gone failed 3 times in a row: set aside, tried again every 0.2 s until it "
                      "announces a restart"]
    restarted = ServerRecord(**{**dead.__dict__, "started": 2000.0})
    assert pick_server([dead, restarted], rv._dead_keys()) == restarted


async def test_a_dead_signal_url_is_retried_with_backoff_and_a_clear_line(quick_retries, caplog):
    import logging

    url = f"wss://127.0.0.1:{_free_port()}/ws"
    rv = Rendezvous(KEY, "A", signal_url=url)
    with caplog.at_level(logging.INFO, logger="swarm.discovery.rendezvous"):
        with pytest.raises(SignalingUnavailableError, match="no signaling server within 1.2 s"):
            await rv.start(timeout=1.2)
        await rv.stop()
    lines = [r for r in caplog.records if "check the --signal URL" in r.getMessage()]
    assert lines[0].levelno == logging.WARNING and all(r.levelno == logging.INFO for r in lines[1:])
    waits = [r.getMessage().split("retrying in ")[1].split(" s")[0] for r in lines]
    assert waits[:4] == ["0.05", "0.1", "0.2", "0.2"] and 5 <= len(lines) <= 9, [r.getMessage() for r in lines]
    assert "attempt 1 failed" in lines[0].getMessage() and url.split("/ws")[0] in lines[0].getMessage()
