"""Signaling JSON messages: exact wire text, round trips, and a defined error for each bad field."""

from __future__ import annotations

import json

import pytest

from swarm.errors import RemoteProtocolError
from swarm.signaling.messages import (
    Auth,
    Challenge,
    Joined,
    Left,
    Notice,
    PeerInfo,
    Relayed,
    Signal,
    Welcome,
    decode_client_message,
    decode_server_message,
)

PEER = PeerInfo(peer_id="p1", name="laptop", kind="python", joined=1700000000.5)


def test_wire_text_is_compact_json_with_hex_bytes():
    assert Challenge(nonce=b"\xab" * 32, host="h").encode() == (
        '{"type":"challenge","version":1,"nonce":"' + "ab" * 32 + '","host":"h"}'
    )
    assert Signal(to="p2", data={"type": "offer"}).encode() == '{"type":"signal","to":"p2","data":{"type":"offer"}}'


@pytest.mark.parametrize("msg", [
    Challenge(nonce=b"\x01" * 32, host="host:1"),
    Welcome(mac=b"\x02" * 32, peers=(PEER, PeerInfo("b-2", "phone", "browser", 3.0))),
    Joined(PEER),
    Left("p1"),
    Relayed(sender="p1", data={"candidate": "candidate:1 1 udp 1 10.0.0.1 9 typ host", "sdpMid": "0"}),
    Notice("unknown-peer", "no peer x is present"),
])
def test_server_messages_round_trip(msg):
    assert decode_server_message(msg.encode()) == msg


@pytest.mark.parametrize("msg", [
    Auth(peer_id="p1", kind="browser", name="phone", nonce=b"\x03" * 32, mac=b"\x04" * 32),
    Signal(to="p2", data={"type": "answer", "sdp": "v=0\r\n"}),
])
def test_client_messages_round_trip(msg):
    assert decode_client_message(msg.encode()) == msg


def _auth(**override):
    obj = {"type": "auth", "version": 1, "peer": "p1", "kind": "python", "name": "n",
           "nonce": "00" * 32, "mac": "00" * 32}
    obj.update(override)
    return json.dumps({k: v for k, v in obj.items() if v is not ...})


@pytest.mark.parametrize("frame, field", [
    (b"{}", "text"),
    ("", "JSON"),
    ("[]", "object"),
    ('{"type":"hello"}', "type"),
    (_auth(peer=""), "peer"),
    (_auth(peer="a" * 129), "peer"),
    (_auth(peer="a b"), "peer"),
    (_auth(peer=7), "peer"),
    (_auth(kind="robot"), "kind"),
    (_auth(name="x" * 65), "name"),
    (_auth(name="a\nb"), "name"),
    (_auth(nonce="00" * 31), "nonce"),
    (_auth(nonce="zz" * 32), "nonce"),
    (_auth(mac=None), "mac"),
    (_auth(version="1"), "version"),
    (_auth(version=True), "version"),
    (_auth(extra=1), "extra"),
    ('{"type":"signal","to":"p","data":[]}', "data"),
    ('{"type":"signal","to":"p","data":{},"from":"x"}', "from"),
    ('{"type":"signal","data":{}}', "to"),
])
def test_bad_client_frames_name_the_field(frame, field):
    with pytest.raises(RemoteProtocolError, match=field):
        decode_client_message(frame)


@pytest.mark.parametrize("frame, field", [
    ('{"type":"welcome","mac":"' + "00" * 32 + '","peers":{}}', "peers"),
    ('{"type":"joined","peer":{"peer":"p","name":"n","kind":"python","joined":NaN}}', "joined"),
    ('{"type":"joined","peer":{"peer":"p","name":"n","kind":"python","joined":"1"}}', "joined"),
    ('{"type":"signal","data":{}}', "from"),
    ('{"type":"error","code":7,"detail":""}', "code"),
])
def test_bad_server_frames_name_the_field(frame, field):
    with pytest.raises(RemoteProtocolError, match=field):
        decode_server_message(frame)


def test_deep_nesting_is_an_error_not_a_crash():
    with pytest.raises(RemoteProtocolError):
        decode_client_message('{"type":"signal","to":"p","data":' + "[" * 100_000 + "]" * 100_000 + "}")
