"""The signaling server over real HTTPS/WSS on loopback: SignalingClient peers, raw attackers."""

from __future__ import annotations

import asyncio
import hashlib
import json
import ssl

import aiohttp
import pytest

from swarm.errors import AuthenticationError, DuplicatePeerError, SignalingUnavailableError, SwarmError
from swarm.signaling import (
    CloseCode,
    Disconnected,
    PeerJoined,
    PeerLeft,
    SignalingClient,
    SignalingServer,
    SignalReceived,
    SignalRefused,
    auth,
    signaling_url,
)
from swarm.signaling.messages import Auth

KEY = bytes(range(32))


@pytest.fixture
async def server(tmp_path):
    srv = SignalingServer(KEY, "host-peer", config_dir=tmp_path, heartbeat_s=0.6, burst=30, rate_per_s=20)
    await srv.start("127.0.0.1", 0)
    yield srv
    await srv.stop()


async def connect(server, peer_id, key=KEY, **kw):
    return await SignalingClient.connect(server.url("127.0.0.1"), key, peer_id, name=f"name-{peer_id}",
                                         fingerprint=server.certificate.fingerprint, **kw)


async def next_event(client, kind, timeout=5.0):
    while True:
        event = await asyncio.wait_for(client.__anext__(), timeout)
        if isinstance(event, kind):
            return event


async def raw_ws(server, session):
    return await session.ws_connect(server.url("127.0.0.1"), ssl=False)


async def raw_auth(server, session, peer_id):
    """A hand-driven authenticated client (to send what SignalingClient never would)."""
    ws = await raw_ws(server, session)
    challenge = json.loads((await ws.receive()).data)
    k = auth.derive_signaling_key(KEY)
    cn = b"\x05" * 32
    mac = auth.client_mac(k, bytes.fromhex(challenge["nonce"]), cn, peer_id)
    await ws.send_str(Auth(peer_id=peer_id, kind="python", name="raw", nonce=cn, mac=mac).encode())
    assert json.loads((await ws.receive()).data)["type"] == "welcome"
    return ws


async def closed_with(ws, timeout=5.0):
    """Read until the server closes; returns (close code, reason, text frames seen before)."""
    seen = []
    while True:
        msg = await asyncio.wait_for(ws.receive(), timeout)
        if msg.type == aiohttp.WSMsgType.TEXT:
            seen.append(json.loads(msg.data))
            continue
        assert msg.type == aiohttp.WSMsgType.CLOSE, msg
        return msg.data, msg.extra, seen


async def test_presence_join_leave_and_relay(server):
    a = await connect(server, "A")
    b = await connect(server, "B")
    assert a.host == b.host == "host-peer"
    assert sorted(b.peers) == ["A", "B"] and b.peers["A"].name == "name-A"
    joined = await next_event(a, PeerJoined)
    assert joined.peer.peer_id == "B" and joined.peer.kind == "python"
    await b.send_signal("A", {"type": "offer", "sdp": "v=0\r\n"})
    got = await next_event(a, SignalReceived)
    assert got == SignalReceived("B", {"type": "offer", "sdp": "v=0\r\n"})
    await a.send_signal("nobody", {})
    assert (await next_event(a, SignalRefused)).code == "unknown-peer"
    await b.close()
    assert await next_event(a, PeerLeft) == PeerLeft("B")
    assert sorted(a.peers) == ["A"]
    await a.close()
    assert isinstance(await a.__anext__(), Disconnected)
    with pytest.raises(StopAsyncIteration):
        await a.__anext__()


async def test_status_and_certificate_served(server):
    a = await connect(server, "peer-secret-name")
    async with aiohttp.ClientSession() as session:
        pin = aiohttp.Fingerprint(server.certificate.sha256)
        async with session.get(f"https://127.0.0.1:{server.port}/api/status", ssl=pin) as resp:
            status = await resp.json()
    pem = await asyncio.to_thread(ssl.get_server_certificate, ("127.0.0.1", server.port))
    assert hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).digest() == server.certificate.sha256
    assert status == {"service": "colibri-swarm", "protocol": 1, "version": status["version"],
                      "swarm_id": auth.swarm_id(KEY), "host": "host-peer", "started": server.started,
                      "fingerprint": server.certificate.fingerprint, "peers": 1}
    assert "peer-secret-name" not in json.dumps(status)  # presence only for authenticated peers
    await a.close()


async def test_peer_page_served_from_web_peer(server):
    import importlib.resources

    root = importlib.resources.files("web_peer")
    base = f"https://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/", ssl=False) as resp:
            if (root / "index.html").is_file():
                assert resp.status == 200 and resp.content_type == "text/html"
                assert await resp.text() == (root / "index.html").read_text()
            else:
                assert resp.status == 404 and "index.html" in await resp.text()
        for asset in ("main.js", "signaling.js", "swiglu.wgsl"):
            if (root / asset).is_file():
                async with session.get(f"{base}/{asset}", ssl=False) as resp:
                    assert resp.status == 200 and await resp.text() == (root / asset).read_text()
                    assert resp.content_type in ("text/javascript", "text/wgsl")  # ES modules need a JS type
        # the package's Python, paths outside web_peer/ and unknown names are not served
        for path in ("/__init__.py", "/../swarm/errors.py", "/%2e%2e/swarm/errors.py", "/nothing.js", "/api"):
            async with session.get(f"{base}{path}", ssl=False) as resp:
                assert resp.status == 404, path
        from yarl import URL

        outside = URL(f"{base}/%2e%2e/tests/vectors/signaling_auth.json", encoded=True)  # a real .json file
        async with session.get(outside, ssl=False) as resp:
            assert resp.status == 404


async def test_wrong_key_refused(server):
    a = await connect(server, "A")
    with pytest.raises(AuthenticationError, match="refused our swarm key"):
        await connect(server, "evil", key=bytes(32))
    await asyncio.sleep(0.1)
    assert sorted(server.relay.peers[i].peer_id for i in range(len(server.relay.peers))) == ["A"]
    assert a._events.empty()  # A never heard of the stranger
    await a.close()


async def test_a_second_process_with_our_peer_id_is_refused_by_name(server, tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_SWARM_CONFIG_DIR", str(tmp_path / "cfg"))
    a = await connect(server, "A", instance="aa" * 8)
    b = await connect(server, "B")
    with pytest.raises(DuplicatePeerError) as exc:
        await connect(server, "A", instance="bb" * 8)
    text = str(exc.value)
    assert "another machine uses this peer identity A" in text and "on the signaling host's machine" in text
    assert f"delete {tmp_path / 'cfg' / 'identity.pem'}" in text
    refused = await next_event(a, SignalRefused)
    assert refused.code == "duplicate-peer" and "claimed peer id A" in refused.detail
    # the one that holds the id keeps it: still present and still reachable
    await b.send_signal("A", {"x": 1})
    assert (await next_event(a, SignalReceived)).data == {"x": 1}
    # the same process reconnecting (same instance) takes its id over, as before
    a2 = await connect(server, "A", instance="aa" * 8)
    assert (await next_event(a, Disconnected)).code == CloseCode.REPLACED
    for c in (a, a2, b):
        await c.close()


async def test_fingerprint_pin_mismatch(server):
    with pytest.raises(SignalingUnavailableError, match="fingerprint mismatch"):
        await SignalingClient.connect(server.url("127.0.0.1"), KEY, "A", fingerprint=b"\x00" * 32)


async def test_impostor_server_without_key_is_detected(tmp_path):
    """A stranger's server that waves every client through cannot prove the key: the client refuses it."""
    from aiohttp import web

    from swarm.signaling import tls
    from swarm.signaling.messages import Challenge, Welcome

    async def impostor(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(Challenge(nonce=b"\x07" * 32, host="impostor").encode())
        await ws.receive()
        await ws.send_str(Welcome(mac=b"\x00" * 32, peers=()).encode())
        await ws.receive()
        return ws

    cert = tls.load_or_create(tmp_path)
    app = web.Application()
    app.router.add_get("/ws", impostor)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=cert.ssl_context())
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(AuthenticationError, match="signaling server did not prove the swarm key"):
            await SignalingClient.connect(f"wss://127.0.0.1:{port}/ws", KEY, "A", fingerprint=cert.sha256)
    finally:
        await runner.cleanup()


async def test_anonymous_client_gets_nothing_and_is_closed(server):
    a = await connect(server, "A")
    b = await connect(server, "B")
    async with aiohttp.ClientSession() as session:
        ws = await raw_ws(server, session)
        challenge = json.loads((await ws.receive()).data)
        assert challenge["type"] == "challenge"
        await ws.send_str(json.dumps({"type": "signal", "to": "A", "data": {"sdp": "evil"}}))
        code, reason, seen = await closed_with(ws)
    assert code == CloseCode.AUTH_FAILED and "authenticate" in reason
    assert seen == []
    await b.send_signal("A", {"still": "working"})
    assert await next_event(a, SignalReceived) == SignalReceived("B", {"still": "working"})
    await a.close()
    await b.close()


async def test_forged_sender_refused_others_keep_working(server):
    a = await connect(server, "A")
    b = await connect(server, "B")
    async with aiohttp.ClientSession() as session:
        ws = await raw_auth(server, session, "M")
        await ws.send_str(json.dumps({"type": "signal", "to": "A", "from": "B", "data": {"sdp": "forged"}}))
        code, reason, _ = await closed_with(ws)
    assert code == CloseCode.PROTOCOL_ERROR and "from" in reason
    await b.send_signal("A", {"n": 1})
    event = await next_event(a, SignalReceived)
    assert event == SignalReceived("B", {"n": 1})  # the forged one never arrived before it
    await a.close()
    await b.close()


async def test_oversized_frame_refused(server):
    a = await connect(server, "A")
    async with aiohttp.ClientSession() as session:
        ws = await raw_auth(server, session, "M")
        await ws.send_str(json.dumps({"type": "signal", "to": "A", "data": {"x": "y" * 70_000}}))
        code, reason, _ = await closed_with(ws)
        assert code == CloseCode.TOO_BIG and "65536" in reason
        ws = await raw_auth(server, session, "M2")
        await ws.send_str("x" * 300_000)  # far beyond: aiohttp's own backstop closes it
        code, _, _ = await closed_with(ws)
        assert code in (CloseCode.TOO_BIG, aiohttp.WSCloseCode.MESSAGE_TOO_BIG)
    b = await connect(server, "B")
    await b.send_signal("A", {"ok": True})
    assert await next_event(a, SignalReceived) == SignalReceived("B", {"ok": True})
    with pytest.raises(SwarmError, match="frame limit"):
        await b.send_signal("A", {"x": "y" * 70_000})
    await a.close()
    await b.close()


async def test_flooding_client_cut_off_others_keep_working(server):
    a = await connect(server, "A")
    b = await connect(server, "B")
    async with aiohttp.ClientSession() as session:
        ws = await raw_auth(server, session, "M")
        frame = json.dumps({"type": "signal", "to": "A", "data": {}})
        for _ in range(200):
            await ws.send_str(frame)
        code, reason, _ = await closed_with(ws)
    assert code == CloseCode.RATE_LIMITED and "frames/s" in reason
    floods = 0
    while True:
        event = await next_event(a, (SignalReceived, PeerLeft))
        if isinstance(event, PeerLeft):
            break
        floods += 1
    assert floods <= 30  # at most the burst got through before the cut
    await b.send_signal("A", {"after": "flood"})
    assert await next_event(a, SignalReceived) == SignalReceived("B", {"after": "flood"})
    await a.close()
    await b.close()


async def test_dead_connection_removed_by_heartbeat(server):
    a = await connect(server, "A")
    async with aiohttp.ClientSession() as session:
        # autoping off: this client never answers pings, like a machine that vanished.
        ws = await session.ws_connect(server.url("127.0.0.1"), ssl=False, autoping=False)
        challenge = json.loads((await ws.receive()).data)
        k = auth.derive_signaling_key(KEY)
        cn = b"\x06" * 32
        mac = auth.client_mac(k, bytes.fromhex(challenge["nonce"]), cn, "Z")
        await ws.send_str(Auth(peer_id="Z", kind="browser", name="", nonce=cn, mac=mac).encode())
        assert (await next_event(a, PeerJoined)).peer.peer_id == "Z"
        assert await next_event(a, PeerLeft, timeout=5.0) == PeerLeft("Z")
    await a.close()


async def test_server_stop_disconnects_clients(tmp_path):
    srv = SignalingServer(KEY, "h", config_dir=tmp_path)
    await srv.start("127.0.0.1", 0)
    fingerprint = srv.certificate.sha256
    a = await connect(srv, "A")
    await srv.stop()
    event = await next_event(a, Disconnected)
    assert event.code == CloseCode.SERVER_STOPPING
    await a.close()
    # the certificate is kept: a restarted server has the same fingerprint
    srv2 = SignalingServer(KEY, "h", config_dir=tmp_path)
    assert srv2.certificate.sha256 == fingerprint


def test_signaling_url_forms():
    assert signaling_url("10.0.0.2:8443") == "wss://10.0.0.2:8443/ws"
    assert signaling_url("https://host:1/") == "wss://host:1/ws"
    assert signaling_url("wss://host:1/ws") == "wss://host:1/ws"
    for bad in ("ws://host:1/ws", "http://host:1", "wss://"):
        with pytest.raises(SwarmError, match="wss://"):
            signaling_url(bad)


async def test_fetch_status_pinned(server):
    from swarm.signaling import fetch_status

    status = await fetch_status(server.page_url("127.0.0.1"), server.certificate.fingerprint)
    assert status["swarm_id"] == auth.swarm_id(KEY) and status["host"] == "host-peer"
    assert server.page_url("127.0.0.1") == f"https://127.0.0.1:{server.port}/"
    with pytest.raises(SignalingUnavailableError, match="api/status"):
        await fetch_status(server.url("127.0.0.1"), b"\x01" * 32)
