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
    monkeypatch.setattr(rendezvous, "DEAD_PATIENCE_S", 0.3)
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
    """A server that stops answering is tried every 0.05 s (5 s outside this test) while it has
    failed for less than 0.3 s (60 s: its host may be asleep and about to wake); a record mDNS
    keeps listing after its host died (no goodbye) is then tried after 0.1 s, then every 0.2 s
    (the cap; 5 minutes outside this test), with one line when it reaches the cap; a restart of
    that host (a new record) is tried at once."""
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
    patient = [p for a, p in zip(attempts, pauses) if a - attempts[0] < 0.3 - 0.03]
    later = pauses[len(patient) + 1:]  # the pause at the window's edge may be either
    assert len(patient) >= 4 and max(patient) <= 0.08, pauses
    assert later and later[0] == pytest.approx(0.1, abs=0.03) or min(later) >= 0.19, pauses
    assert min(later[1:]) >= 0.19 and 10 <= len(attempts) <= 16, pauses  # every 0.05 s for 1.5 s would be ~25
    capped = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert len(capped) == 1 and capped[0].endswith("set aside, tried again every 0.2 s until it announces a restart")
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


def test_dead_retry_pause_is_patient_for_a_minute_then_backs_off():
    """A sleeping host's server is tried every 5 s for its first 60 s of failures (a laptop that
    wakes is found again within seconds), then ever less often, up to every 5 minutes."""
    from swarm.discovery.rendezvous import DEAD_RETRY_MAX_S, dead_retry_pause

    assert [dead_retry_pause(t, n) for t, n in ((0, 1), (30, 7), (59.9, 12))] == [5.0, 5.0, 5.0]
    assert [dead_retry_pause(60, n) for n in (13, 14, 15)] == [10.0, 20.0, 40.0]
    assert dead_retry_pause(60, 12) == 10.0  # the first failure past the window backs off
    assert dead_retry_pause(3600, 80) == DEAD_RETRY_MAX_S == 300.0
    assert dead_retry_pause(1e9, 10**6) == DEAD_RETRY_MAX_S  # no overflow
