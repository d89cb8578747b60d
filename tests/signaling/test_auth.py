"""Signaling key derivation and MACs against an independent RFC 5869 / RFC 2104 computation
and the shared vector file the browser peer's tests read too."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import pytest

from swarm.errors import AuthenticationError, KeyCodeError, LocalProtocolError
from swarm.signaling import auth

VECTORS = json.loads((Path(__file__).parents[1] / "vectors" / "signaling_auth.json").read_text())


def hkdf_sha256(ikm: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869 written out: extract with an all-zero salt, then expand."""
    prk = hmac.new(b"\x00" * 32, ikm, hashlib.sha256).digest()
    okm, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        okm += block
    return okm[:length]


def test_vectors_match_independent_derivation():
    key = bytes.fromhex(VECTORS["swarm_key"])
    k_sig = hkdf_sha256(key, VECTORS["signaling_info"].encode(), 32)
    assert k_sig.hex() == VECTORS["signaling_key"] == auth.derive_signaling_key(key).hex()
    assert hkdf_sha256(key, VECTORS["swarm_id_info"].encode(), 8).hex() == VECTORS["swarm_id"] == auth.swarm_id(key)
    sn, cn, pid = bytes.fromhex(VECTORS["server_nonce"]), bytes.fromhex(VECTORS["client_nonce"]), VECTORS["peer_id"]
    client = hmac.new(k_sig, VECTORS["client_label"].encode() + b"\x00" + sn + cn + pid.encode(), hashlib.sha256)
    server = hmac.new(k_sig, VECTORS["server_label"].encode() + b"\x00" + cn + sn + pid.encode(), hashlib.sha256)
    assert client.hexdigest() == VECTORS["client_mac"] == auth.client_mac(k_sig, sn, cn, pid).hex()
    assert server.hexdigest() == VECTORS["server_mac"] == auth.server_mac(k_sig, sn, cn, pid).hex()


def test_every_input_changes_the_mac():
    k = auth.derive_signaling_key(bytes(32))
    base = auth.client_mac(k, b"\x01" * 32, b"\x02" * 32, "A")
    assert base != auth.client_mac(k, b"\x03" * 32, b"\x02" * 32, "A")
    assert base != auth.client_mac(k, b"\x01" * 32, b"\x03" * 32, "A")
    assert base != auth.client_mac(k, b"\x01" * 32, b"\x02" * 32, "B")
    assert base != auth.client_mac(auth.derive_signaling_key(b"\x01" * 32), b"\x01" * 32, b"\x02" * 32, "A")
    # the server's proof is not the client's reflected back
    assert base != auth.server_mac(k, b"\x01" * 32, b"\x02" * 32, "A")


def test_verify_and_bad_lengths():
    auth.verify(b"x" * 32, b"x" * 32, "client")
    with pytest.raises(AuthenticationError, match="client did not prove the swarm key"):
        auth.verify(b"x" * 32, b"y" * 32, "client")
    with pytest.raises(KeyCodeError, match="a swarm key is 32 bytes, got 5"):
        auth.derive_signaling_key(b"short")
    with pytest.raises(LocalProtocolError, match="server nonce"):
        auth.client_mac(b"k" * 32, b"n", b"\x00" * 32, "A")
