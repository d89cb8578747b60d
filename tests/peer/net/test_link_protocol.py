"""The link protocol core, sans-I/O: greeting, heartbeats and RTT, liveness, the jumbo probe's
turn, driven by messages and ``now`` alone (no sockets, no sleeps)."""

from __future__ import annotations

import ast
import dataclasses
import importlib

import pytest

from swarm.errors import AuthenticationError, IdentityError, RemoteProtocolError, VersionMismatchError
from swarm.keys.identity import Identity
from swarm.peer.net import messages
from swarm.peer.net.link_protocol import Deliver, Echo, Greeted, LinkProtocol, LinkState
from swarm.peer.net.messages import Error, LinkHeartbeat, WeightsHeld
from tests.peer._links import VERSION, blob, hello

A, B = Identity.generate().peer_id, Identity.generate().peer_id


def greeting(now: float = 0.0, **kw) -> LinkProtocol:
    """A's side with the channel proved to be B's: GREETING."""
    p = LinkProtocol(hello(A), now=now, expected_peer_id=B, **kw)
    assert p.channel_open() and not p.channel_open()
    assert p.authenticated(B) == hello(A)
    assert p.state is LinkState.GREETING
    return p


def opened(now: float = 0.0, **kw) -> LinkProtocol:
    p = greeting(now, **kw)
    event = p.receive(hello(B), now)
    assert event == Greeted(hello(B))
    p.check_hello(event.hello, lambda: B)
    p.open(event.hello)
    return p


def test_the_remote_hello_must_come_first_and_name_the_proved_peer() -> None:
    with pytest.raises(AuthenticationError, match="signaling announced"):
        LinkProtocol(hello(A), now=0.0, expected_peer_id=B).authenticated(A)
    with pytest.raises(RemoteProtocolError, match="expected a Hello first"):
        greeting().receive(blob(b"x"), 0.0)
    with pytest.raises(RemoteProtocolError, match=r"refused the link \(model\)"):
        greeting().receive(Error(request_id=0, code="model", message="another model"), 0.0)
    p = greeting()
    with pytest.raises(AuthenticationError, match="Hello names peer"):
        p.check_hello(hello(A), lambda: A)
    with pytest.raises(AuthenticationError, match="certificate of peer"):
        p.check_hello(hello(B), lambda: A)
    with pytest.raises(AuthenticationError, match="DTLS certificate"):
        p.check_hello(hello(B), lambda: (_ for _ in ()).throw(IdentityError("not a P-256 key")))
    browser = dataclasses.replace(hello(B), peer_kind="browser")
    p.check_hello(browser, lambda: pytest.fail("a browser's certificate is not read"))
    with pytest.raises(AuthenticationError, match="joined signaling as a python peer"):
        greeting(remote_kind="python").check_hello(browser, lambda: B)


def test_another_version_is_refused_and_the_refusal_names_it() -> None:
    p = greeting()
    with pytest.raises(VersionMismatchError, match=f"we speak {VERSION}") as refused:
        p.check_hello(hello(B, VERSION + 1), lambda: B)
    refusal = p.refusal(refused.value)
    assert (refusal.request_id, refusal.code) == (0, "version") and f"we speak {VERSION}" in refusal.message
    messages.encode(refusal)  # it goes on the wire as it is
    with pytest.raises(VersionMismatchError, match=r"refused the link \(version\)"):
        opened().receive(refusal, 0.0)


def test_an_open_link_echoes_pings_measures_rtt_by_the_median_and_delivers_the_rest() -> None:
    p = opened()
    assert p.state is LinkState.OPEN and p.hello == hello(B) and p.rtt_s is None
    theirs = LinkHeartbeat(seq=1, sent_s=123.0)
    assert p.receive(theirs, 1.0) == Echo(theirs)
    for now, rtt in ((10.0, 0.002), (11.0, 0.5), (12.0, 0.004)):  # one echo queued behind a large message
        ping = p.ping(now)
        assert p.receive(ping, now + rtt) is None
    assert p.rtt_s == pytest.approx(0.004)
    held = WeightsHeld(plan_version=3, weight_bytes=1 << 20)
    assert p.receive(held, 13.0) is None and p.weights_held == held
    chunk = blob(b"rows")
    assert p.receive(chunk, 13.0) == Deliver(chunk)
    with pytest.raises(RemoteProtocolError, match="second Hello"):
        p.receive(hello(B), 13.0)


def test_only_the_recent_unanswered_pings_are_remembered() -> None:
    p = opened()
    pings = [p.ping(float(i)) for i in range(20)]
    assert p.receive(pings[0], 30.0) == Echo(pings[0])  # forgotten: taken for the remote's own
    assert p.receive(pings[-1], 30.0) is None and p.rtt_s == pytest.approx(11.0)


def test_a_link_not_open_in_time_or_silent_once_open_is_overdue() -> None:
    p = greeting(now=100.0, handshake_timeout_s=10.0, dead_after_s=5.0)
    assert p.overdue(109.9) is None
    assert p.overdue(110.0) == "no authenticated link within 10 s (greeting)"
    p = opened(now=100.0, handshake_timeout_s=10.0, dead_after_s=5.0)
    p.heard(120.0)
    assert p.overdue(124.9) is None
    assert p.overdue(125.0) == "nothing heard for 5.0 s (dead after 5 s)"
    assert p.close() is LinkState.OPEN and p.close() is None and p.state is LinkState.CLOSED


@pytest.mark.parametrize(("ours", "theirs", "probe"), [(16384, 16384, 16384), (16384, 9000, 9000),
                                                       (None, 16384, None), (16384, None, None)])
def test_a_jumbo_probe_is_due_only_when_both_ends_offer_jumbo_packets(ours, theirs, probe) -> None:
    p = greeting(jumbo_packets=ours)
    p.remote_packet_length = theirs
    assert p.open(hello(B)) == probe


@pytest.mark.parametrize("module", ["swarm.peer.net.link_protocol", "swarm.peer.net.schema", "swarm.peer.net.messages"])
def test_the_cores_read_no_clock_and_touch_no_socket(module) -> None:
    tree = ast.parse(open(importlib.import_module(module).__file__, encoding="utf-8").read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"asyncio", "time", "socket", "aiortc", "aiohttp"}, imported
