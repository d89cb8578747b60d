"""The sans-I/O signaling relay: handshake, presence, relay, and every refusal, with no sockets."""

from __future__ import annotations

import json

import pytest

from swarm.signaling import auth
from swarm.signaling.messages import Auth, Signal
from swarm.signaling.relay import Close, CloseCode, Send, SignalingRelay

KEY = bytes(range(32))
K_SIG = auth.derive_signaling_key(KEY)


def texts(outputs, conn):
    return [json.loads(o.text) for o in outputs if isinstance(o, Send) and o.conn == conn]


def closes(outputs):
    return {o.conn: (o.code, o.reason) for o in outputs if isinstance(o, Close)}


def join(relay: SignalingRelay, conn: int, peer: str, now: float = 0.0, key: bytes = K_SIG, kind="python",
         instance: str = "", address: str = ""):
    """Connect and authenticate ``peer`` on ``conn``; returns the outputs of the auth step."""
    (challenge,) = relay.connect(conn, now, address)
    nonce = bytes.fromhex(json.loads(challenge.text)["nonce"])
    client_nonce = bytes([conn]) * 32
    mac = auth.client_mac(key, nonce, client_nonce, peer)
    message = Auth(peer_id=peer, kind=kind, name=f"n-{peer}", nonce=client_nonce, mac=mac, instance=instance)
    out = relay.receive(conn, message.encode(), now)
    return out, nonce, client_nonce


@pytest.fixture
def relay():
    return SignalingRelay(k_sig=K_SIG, host="host-peer", rate_per_s=10, burst=20, auth_timeout_s=5.0)


def test_handshake_welcome_proves_server_and_lists_presence(relay):
    out, server_nonce, client_nonce = join(relay, 1, "A")
    (welcome,) = texts(out, 1)
    assert welcome["type"] == "welcome"
    assert bytes.fromhex(welcome["mac"]) == auth.server_mac(K_SIG, server_nonce, client_nonce, "A")
    assert [p["peer"] for p in welcome["peers"]] == ["A"]
    out, *_ = join(relay, 2, "B", now=1.0)
    assert [p["peer"] for p in texts(out, 2)[0]["peers"]] == ["A", "B"]
    assert texts(out, 1) == [{"type": "joined", "peer": {"peer": "B", "name": "n-B", "kind": "python", "joined": 1.0}}]


def test_challenge_carries_host_and_fresh_nonce(relay):
    (a,) = relay.connect(1, 0.0)
    (b,) = relay.connect(2, 0.0)
    ja, jb = json.loads(a.text), json.loads(b.text)
    assert ja["host"] == "host-peer" and ja["version"] == 1
    assert ja["nonce"] != jb["nonce"] and len(ja["nonce"]) == 64


def test_wrong_key_refused_and_never_present(relay):
    join(relay, 1, "A")
    out, *_ = join(relay, 2, "evil", key=auth.derive_signaling_key(bytes(32)))
    assert closes(out) == {2: (CloseCode.AUTH_FAILED, "wrong swarm key")}
    assert texts(out, 1) == []  # nobody hears of it
    assert [p.peer_id for p in relay.peers] == ["A"]


def test_mac_bound_to_peer_id(relay):
    (challenge,) = relay.connect(1, 0.0)
    nonce = bytes.fromhex(json.loads(challenge.text)["nonce"])
    mac = auth.client_mac(K_SIG, nonce, b"\x01" * 32, "A")
    out = relay.receive(1, Auth(peer_id="B", kind="python", name="", nonce=b"\x01" * 32, mac=mac).encode(), 0.0)
    assert closes(out)[1][0] == CloseCode.AUTH_FAILED


def test_anonymous_signal_refused(relay):
    join(relay, 1, "A")
    relay.connect(2, 0.0)
    out = relay.receive(2, Signal(to="A", data={"sdp": "x"}).encode(), 0.0)
    assert closes(out)[2][0] == CloseCode.AUTH_FAILED
    assert texts(out, 1) == []


def test_relay_stamps_sender(relay):
    join(relay, 1, "A")
    join(relay, 2, "B")
    out = relay.receive(2, Signal(to="A", data={"type": "offer", "sdp": "v=0"}).encode(), 0.0)
    assert texts(out, 1) == [{"type": "signal", "from": "B", "data": {"type": "offer", "sdp": "v=0"}}]


def test_forged_from_field_closes_only_the_forger(relay):
    join(relay, 1, "A")
    join(relay, 2, "B")
    join(relay, 3, "C")
    forged = json.dumps({"type": "signal", "to": "A", "from": "C", "data": {}})
    out = relay.receive(2, forged, 0.0)
    assert closes(out)[2][0] == CloseCode.PROTOCOL_ERROR
    assert texts(out, 1) == [{"type": "left", "peer": "B"}]  # A never got the forged signal
    out = relay.receive(3, Signal(to="A", data={"ok": 1}).encode(), 0.0)
    assert texts(out, 1) == [{"type": "signal", "from": "C", "data": {"ok": 1}}]


def test_unknown_peer_and_self_get_a_notice(relay):
    join(relay, 1, "A")
    for to in ("nobody", "A"):
        out = relay.receive(1, Signal(to=to, data={}).encode(), 0.0)
        assert [m["code"] for m in texts(out, 1)] == ["unknown-peer"]
        assert closes(out) == {}


def test_oversized_frame(relay):
    join(relay, 1, "A")
    join(relay, 2, "B")
    big = Signal(to="A", data={"sdp": "x" * relay.max_frame_chars}).encode()
    out = relay.receive(2, big, 0.0)
    assert closes(out)[2][0] == CloseCode.TOO_BIG
    assert [p.peer_id for p in relay.peers] == ["A"]


def test_flood_is_rate_limited_then_bucket_refills(relay):
    join(relay, 1, "A")
    join(relay, 2, "B")
    join(relay, 3, "C")
    frame = Signal(to="A", data={}).encode()
    delivered = 0
    for _ in range(100):
        out = relay.receive(2, frame, 0.5)
        delivered += len(texts(out, 1)) - texts(out, 1).count({"type": "left", "peer": "B"})
        if 2 in closes(out):
            assert closes(out)[2][0] == CloseCode.RATE_LIMITED
            break
    else:
        pytest.fail("flood never limited")
    # one token went to auth at t=0; by t=0.5 the bucket refilled to its cap: exactly `burst` pass
    assert delivered == 20
    # C sends at the sustained rate for 10 s and is never cut off
    for i in range(100):
        out = relay.receive(3, frame, 1.0 + i * 0.1)
        assert closes(out) == {}


def test_binary_and_garbage_frames(relay):
    join(relay, 1, "A")
    for conn, frame in ((2, b"\x00\x01"), (3, "not json"), (4, "[1,2]"), (5, '{"type":"auth"}')):
        relay.connect(conn, 0.0)
        assert closes(relay.receive(conn, frame, 0.0))[conn][0] == CloseCode.AUTH_FAILED
    out = relay.receive(1, "{" * 100_000, 0.0)  # deep nesting / over size: closed, no crash
    assert 1 in closes(out)


def test_second_auth_is_a_protocol_error(relay):
    out, nonce, _ = join(relay, 1, "A")
    mac = auth.client_mac(K_SIG, nonce, b"\x09" * 32, "A")
    out = relay.receive(1, Auth(peer_id="A", kind="python", name="", nonce=b"\x09" * 32, mac=mac).encode(), 0.0)
    assert closes(out)[1][0] == CloseCode.PROTOCOL_ERROR


def test_auth_timeout(relay):
    relay.connect(1, 100.0)
    assert relay.next_deadline() == 105.0
    assert relay.handle_timer(104.9) == []
    assert closes(relay.handle_timer(105.0)) == {1: (CloseCode.AUTH_TIMEOUT, "no authentication within 5 s")}
    assert relay.next_deadline() is None


def test_disconnect_broadcasts_left_once(relay):
    join(relay, 1, "A")
    join(relay, 2, "B")
    out = relay.disconnect(2, 1.0)
    assert texts(out, 1) == [{"type": "left", "peer": "B"}]
    assert relay.disconnect(2, 1.0) == []
    assert [p.peer_id for p in relay.peers] == ["A"]


def test_reconnect_replaces_old_connection(relay):
    join(relay, 1, "A")
    join(relay, 2, "B")
    out, *_ = join(relay, 3, "B", now=2.0)
    assert closes(out)[2][0] == CloseCode.REPLACED
    assert [m["type"] for m in texts(out, 1)] == ["left", "joined"]
    assert relay.disconnect(2, 3.0) == []  # the old socket going away later changes nothing
    assert [p.peer_id for p in relay.peers] == ["A", "B"]
    out = relay.receive(1, Signal(to="B", data={}).encode(), 3.0)
    assert [o.conn for o in out] == [3]


def test_reconnect_of_the_same_process_replaces_its_old_connection(relay):
    join(relay, 1, "A", instance="aa" * 8)
    out, *_ = join(relay, 2, "A", now=1.0, instance="aa" * 8)
    assert closes(out) == {1: (CloseCode.REPLACED, "replaced by a newer connection of the same peer")}
    assert [p.peer_id for p in relay.peers] == ["A"]


def test_a_copied_identity_is_refused_and_named_to_both(relay):
    join(relay, 1, "A", instance="aa" * 8, address="10.0.0.1")
    join(relay, 2, "B", instance="bb" * 8, address="10.0.0.2")
    out, *_ = join(relay, 3, "A", now=1.0, instance="cc" * 8, address="10.0.0.3")
    # the newcomer is refused with the address of the one that holds the id ...
    assert closes(out) == {3: (CloseCode.DUPLICATE_PEER, "peer id in use by another process at 10.0.0.1")}
    # ... which stays, is told who else claimed it, and nobody sees presence change
    (notice,) = texts(out, 1)
    assert notice["type"] == "error" and notice["code"] == "duplicate-peer" and "10.0.0.3" in notice["detail"]
    assert texts(out, 2) == []
    assert [p.peer_id for p in relay.peers] == ["A", "B"]
    assert relay.disconnect(3, 2.0) == []
    out = relay.receive(2, Signal(to="A", data={"x": 1}).encode(), 2.0)
    assert [o.conn for o in out] == [1]
    # once the holder is gone, the other process may have the id
    relay.disconnect(1, 3.0)
    out, *_ = join(relay, 4, "A", now=4.0, instance="cc" * 8)
    assert closes(out) == {} and [p.peer_id for p in relay.peers] == ["B", "A"]


def test_auth_instance_is_checked():
    from swarm.errors import RemoteProtocolError
    from swarm.signaling.messages import decode_client_message

    frame = json.loads(Auth(peer_id="A", kind="python", name="", nonce=b"\x01" * 32, mac=b"\x02" * 32,
                            instance="0123abcd").encode())
    assert decode_client_message(json.dumps(frame)).instance == "0123abcd"
    del frame["instance"]
    assert decode_client_message(json.dumps(frame)).instance == ""  # optional: pages of older builds
    for bad in ("XYZ", "abc", 5, "0" * 65):
        with pytest.raises(RemoteProtocolError, match="'instance'"):
            decode_client_message(json.dumps({**frame, "instance": bad}))


def test_version_mismatch(relay):
    (challenge,) = relay.connect(1, 0.0)
    nonce = bytes.fromhex(json.loads(challenge.text)["nonce"])
    mac = auth.client_mac(K_SIG, nonce, b"\x01" * 32, "A")
    out = relay.receive(1, Auth(peer_id="A", kind="python", name="", nonce=b"\x01" * 32, mac=mac, version=2).encode(), 0)
    code, reason = closes(out)[1]
    assert code == CloseCode.VERSION_MISMATCH and "2" in reason and "1" in reason


def test_connection_limits(relay):
    relay.max_pending_per_address = 3
    relay.max_connections = 6
    outs = [relay.connect(i, 0.0, "10.0.0.9") for i in range(1, 5)]
    assert [type(o[0]).__name__ for o in outs] == ["Send", "Send", "Send", "Close"]
    assert closes(outs[3]) == {4: (CloseCode.RATE_LIMITED, "too many connections; try again later")}
    relay.disconnect(4, 0.0)
    # another address is not held back by the first one's pending connections
    out, *_ = join(relay, 5, "A")
    assert texts(out, 5)[0]["type"] == "welcome"
    # once authenticated, a connection no longer counts as pending for its address
    (challenge,) = relay.connect(6, 0.0, "10.0.0.7")
    assert isinstance(challenge, Send)
    assert isinstance(relay.connect(7, 0.0, "10.0.0.8")[0], Send)  # 6 connections: the cap
    assert closes(relay.connect(8, 0.0, "10.0.0.8"))[8][0] == CloseCode.RATE_LIMITED


def test_a_copy_refused_by_the_hosts_own_connection_is_told_where(relay):
    join(relay, 1, "A", instance="aa" * 8, address="127.0.0.1")  # the host, on its own server
    out, *_ = join(relay, 2, "A", instance="bb" * 8, address="10.0.0.2")
    assert closes(out) == {2: (CloseCode.DUPLICATE_PEER, "peer id in use by another process on the signaling host's machine")}
    assert "at 10.0.0.2" in texts(out, 1)[0]["detail"]
