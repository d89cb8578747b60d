"""Channel authentication (swarm.peer.net.auth), pumped between two sans-I/O objects."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from swarm.errors import AuthenticationError, LocalProtocolError, MessageError
from swarm.peer.net import messages as m
from swarm.peer.net.auth import ChannelAuth, Role, State, normalize_fingerprint
from swarm.keys.swarmkey import SwarmKey

FP_A = "sha-256 " + ":".join(f"{i:02X}" for i in range(32))
FP_B = "sha-256 " + ":".join(f"{255 - i:02X}" for i in range(32))
FP_EVIL = "sha-256 " + ":".join(["EE"] * 32)
PA, PB = "a" * 26, "b" * 26
KEY = SwarmKey(bytes(range(32)))


def pair(key_a: SwarmKey = KEY, key_b: SwarmKey = KEY, a_sees_remote: str = FP_B, b_sees_remote: str = FP_A):
    a = ChannelAuth(role=Role.OFFERER, auth_key=key_a.channel_auth_key, local_peer_id=PA,
                    local_fingerprint=FP_A, remote_fingerprint=a_sees_remote, now=0.0)
    b = ChannelAuth(role=Role.ANSWERER, auth_key=key_b.channel_auth_key, local_peer_id=PB,
                    local_fingerprint=FP_B, remote_fingerprint=b_sees_remote, now=0.0)
    return a, b


def transfer(a: ChannelAuth, b: ChannelAuth) -> None:
    """Deliver frames both ways until neither side has anything to send."""
    to_b, to_a = a.start(), b.start()
    while to_a or to_b:
        sent_b = [out for f in to_b for out in b.receive(f)]
        sent_a = [out for f in to_a for out in a.receive(f)]
        to_a, to_b = sent_b, sent_a


def test_handshake_completes_on_both_sides() -> None:
    a, b = pair()
    assert not a.authenticated
    transfer(a, b)
    assert a.authenticated and b.authenticated
    assert (a.remote_peer_id, b.remote_peer_id) == (PB, PA)
    assert a.get_timer() is None


def test_wrong_key_fails_the_key_check_on_both_sides() -> None:
    a, b = pair(key_b=SwarmKey(bytes(32)))
    with pytest.raises(AuthenticationError, match="swarm key check"):
        transfer(a, b)
    assert a.state is State.FAILED or b.state is State.FAILED


def test_substituted_fingerprint_fails_the_fingerprint_check() -> None:
    # A relay swapped the answerer's SDP fingerprint for its own: the offerer thinks the
    # remote certificate is FP_EVIL (it is talking to the relay), the answerer sees FP_A.
    a, b = pair(a_sees_remote=FP_EVIL)
    hello_a, hello_b = a.start()[0], b.start()[0]
    proof_b = b.receive(hello_a)[0]
    proof_a = a.receive(hello_b)[0]
    with pytest.raises(AuthenticationError, match="DTLS fingerprint check"):
        a.receive(proof_b)
    with pytest.raises(AuthenticationError, match="DTLS fingerprint check"):
        b.receive(proof_a)


def test_nothing_but_the_handshake_before_it_completes() -> None:
    a, b = pair()
    hb = m.encode(m.LinkHeartbeat(seq=1, sent_s=0.0))
    with pytest.raises(AuthenticationError, match="LinkHeartbeat arrived in state hello-sent"):
        a.receive(hb)
    a, b = pair()
    a.receive(b.start()[0])
    with pytest.raises(AuthenticationError, match="LinkHeartbeat arrived in state proof-sent"):
        a.receive(hb)


def test_out_of_order_and_repeated_handshake_frames() -> None:
    a, b = pair()
    hello_b = b.start()[0]
    proof_b = b.receive(a.start()[0])[0]
    with pytest.raises(AuthenticationError, match="AuthProof arrived in state hello-sent"):
        pair()[0].receive(proof_b)
    a.receive(hello_b)
    with pytest.raises(AuthenticationError, match="AuthHello arrived in state proof-sent"):
        a.receive(hello_b)


def test_reflected_hello_and_proof_are_refused() -> None:
    a, _ = pair()
    with pytest.raises(AuthenticationError, match="reflected"):
        a.receive(a.start()[0])
    # Reflect a's own proof back: it carries the offerer label, a expects the answerer's.
    a, b = pair()
    proof_a = a.receive(b.start()[0])[0]
    with pytest.raises(AuthenticationError, match="swarm key check"):
        a.receive(proof_a)


def test_replayed_proof_from_an_old_session_is_refused() -> None:
    a, b = pair()
    old_hello_b = b.start()[0]
    old_proof_b = b.receive(a.start()[0])[0]
    a_new, _ = pair()  # fresh nonces
    a_new.receive(old_hello_b)
    with pytest.raises(AuthenticationError, match="swarm key check"):
        a_new.receive(old_proof_b)


def test_malformed_frame_fails_the_handshake() -> None:
    a, _ = pair()
    with pytest.raises(MessageError):
        a.receive(m.wire.encode_frame(m.AuthHello.KIND, b'{"peer_id":"x","nonce":"00"}'))
    assert a.state is State.FAILED
    with pytest.raises(LocalProtocolError, match="failed"):
        a.receive(pair()[1].start()[0])


def test_deadline() -> None:
    a = ChannelAuth(role=Role.OFFERER, auth_key=KEY.channel_auth_key, local_peer_id=PA,
                    local_fingerprint=FP_A, remote_fingerprint=FP_B, now=100.0, timeout_s=5.0)
    assert a.get_timer() == 105.0
    a.handle_timer(104.9)
    with pytest.raises(AuthenticationError, match="deadline"):
        a.handle_timer(105.0)
    assert a.state is State.FAILED and a.get_timer() is None


def test_transcript_bytes_follow_the_documented_layout() -> None:
    """Recompute both MACs from docs/protocol.md with hmac/hashlib only (the browser's recipe)."""
    na, nb = bytes([1] * 32), bytes([2] * 32)
    a = ChannelAuth(role=Role.OFFERER, auth_key=KEY.channel_auth_key, local_peer_id=PA,
                    local_fingerprint=FP_A.lower(), remote_fingerprint=FP_B, now=0.0, nonce=na)
    b = ChannelAuth(role=Role.ANSWERER, auth_key=KEY.channel_auth_key, local_peer_id=PB,
                    local_fingerprint=FP_B, remote_fingerprint=FP_A, now=0.0, nonce=nb)
    proof = m.decode(b.receive(a.start()[0])[0])

    # HKDF-SHA256 (RFC 5869) with an empty salt, written out
    prk = hmac.new(b"", bytes(range(32)), hashlib.sha256).digest()
    k = hmac.new(prk, b"colibri-swarm v1 channel-auth" + b"\x01", hashlib.sha256).digest()
    assert k == KEY.channel_auth_key
    common = (
        f"protocol-version=3\noffer-peer-id={PA}\nanswer-peer-id={PB}\n"
        f"offer-nonce={na.hex()}\nanswer-nonce={nb.hex()}\n"
    )
    fps = f"offer-fingerprint={FP_A}\nanswer-fingerprint={FP_B}\n"
    head = "colibri-swarm channel-auth v1\n"
    key_mac = hmac.new(k, f"{head}proof=key\nrole=answerer\n{common}".encode(), hashlib.sha256).hexdigest()
    channel_mac = hmac.new(k, f"{head}proof=channel\nrole=answerer\n{common}{fps}".encode(), hashlib.sha256).hexdigest()
    assert (proof.key_mac, proof.channel_mac) == (key_mac, channel_mac)


def test_normalize_fingerprint() -> None:
    lower = FP_A.lower()
    assert normalize_fingerprint(lower) == FP_A
    assert normalize_fingerprint("a=fingerprint:SHA-256 " + lower.split()[1]) == FP_A
    for bad in ["sha-1 " + FP_A.split()[1], "sha-256 AB:CD", FP_A + ":00", "sha-256", FP_A.replace(":", "")]:
        with pytest.raises(AuthenticationError, match="not 'sha-256'"):
            normalize_fingerprint(bad)


def test_aiortc_certificate_fingerprint_is_in_the_transcript_form() -> None:
    from aiortc.rtcdtlstransport import RTCCertificate

    fp = next(f for f in RTCCertificate.generateCertificate().getFingerprints() if f.algorithm == "sha-256")
    assert normalize_fingerprint(f"{fp.algorithm} {fp.value}") == f"sha-256 {fp.value}"


def test_expected_peer_id_is_enforced() -> None:
    a = ChannelAuth(role=Role.OFFERER, auth_key=KEY.channel_auth_key, local_peer_id=PA,
                    local_fingerprint=FP_A, remote_fingerprint=FP_B, now=0.0, expected_peer_id="c" * 26)
    _, b = pair()
    with pytest.raises(AuthenticationError, match=f"claims peer id {PB} but should be {'c' * 26}"):
        a.receive(b.start()[0])
    a = ChannelAuth(role=Role.OFFERER, auth_key=KEY.channel_auth_key, local_peer_id=PA,
                    local_fingerprint=FP_A, remote_fingerprint=FP_B, now=0.0, expected_peer_id=PB)
    transfer(a, b)
    assert a.authenticated


def test_large_frames_are_refused_before_authentication() -> None:
    import numpy as np

    a, _ = pair()
    big = m.encode(m.WeightChunk(request_id=1, model_hash="0" * 64, name="x", offset=0, sha256="0" * 64,
                                 data=np.zeros(5000, np.uint8)))
    with pytest.raises(AuthenticationError, match="before channel authentication completed"):
        a.receive(big)
