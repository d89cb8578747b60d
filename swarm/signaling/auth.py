"""Signaling authentication: prove the swarm key in both directions with HMAC-SHA256.

Theory of operation (docs/protocol.md, "Signaling"):

1. On connect the server sends a 32-byte random ``server_nonce``.
2. The client answers with its peer id, a 32-byte random ``client_nonce`` and
   ``client_mac = HMAC(K_sig, CLIENT_LABEL || 0x00 || server_nonce || client_nonce || peer_id)``.
3. The server checks it (constant time) and answers with
   ``server_mac = HMAC(K_sig, SERVER_LABEL || 0x00 || client_nonce || server_nonce || peer_id)``,
   so a stranger's server that does not hold the key cannot collect peers.

``K_sig`` is the swarm key's ``signaling`` sub-key (:attr:`swarm.keys.swarmkey.SwarmKey.signaling_key`,
HKDF-SHA256 with its own label), so the signaling MAC never shares a key with channel
authentication. The sub-keys are derived in swarmkey.py only; the two functions below name
them for the signaling code, which holds the key as bytes.
Fixed-size fields come first and the variable-length peer id last, so the transcript is
unambiguous without length prefixes. Everything here is pure: bytes in, bytes out.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from swarm.errors import AuthenticationError, LocalProtocolError
from swarm.keys.swarmkey import SwarmKey

NONCE_BYTES = 32
MAC_BYTES = 32
CLIENT_LABEL = b"colibri-swarm signaling client v1"
SERVER_LABEL = b"colibri-swarm signaling server v1"


def derive_signaling_key(swarm_key: bytes) -> bytes:
    """The 32-byte signaling sub-key ``K_sig`` of a 32-byte swarm key (``SwarmKey.signaling_key``).

    Raises KeyCodeError when ``swarm_key`` is not 32 bytes.
    """
    return SwarmKey(swarm_key).signaling_key


def swarm_id(swarm_key: bytes) -> str:
    """The public name of a swarm: 16 hex digits (``SwarmKey.swarm_id``).

    Never the key, and it cannot be turned back into it. Advertised in mDNS TXT and
    /api/status so peers pick the server of their own swarm. Raises KeyCodeError when
    ``swarm_key`` is not 32 bytes.
    """
    return SwarmKey(swarm_key).swarm_id


def new_nonce() -> bytes:
    """32 fresh random bytes from the OS CSPRNG."""
    return secrets.token_bytes(NONCE_BYTES)


def client_mac(k_sig: bytes, server_nonce: bytes, client_nonce: bytes, peer_id: str) -> bytes:
    """The client's proof of the key: 32 bytes of HMAC-SHA256 over the transcript above."""
    _check_len("server nonce", server_nonce, NONCE_BYTES)
    _check_len("client nonce", client_nonce, NONCE_BYTES)
    msg = CLIENT_LABEL + b"\x00" + server_nonce + client_nonce + peer_id.encode()
    return hmac.new(k_sig, msg, hashlib.sha256).digest()


def server_mac(k_sig: bytes, server_nonce: bytes, client_nonce: bytes, peer_id: str) -> bytes:
    """The server's proof of the key back to the client (nonces in the other order, other label)."""
    _check_len("server nonce", server_nonce, NONCE_BYTES)
    _check_len("client nonce", client_nonce, NONCE_BYTES)
    msg = SERVER_LABEL + b"\x00" + client_nonce + server_nonce + peer_id.encode()
    return hmac.new(k_sig, msg, hashlib.sha256).digest()


def verify(expected: bytes, received: bytes, who: str) -> None:
    """Compare two MACs in constant time; raise AuthenticationError naming ``who`` on mismatch."""
    if not hmac.compare_digest(expected, received):
        raise AuthenticationError(
            f"{who} did not prove the swarm key: check that both sides use the same key "
            "(`colibri-swarm key` shows it)"
        )


def _check_len(what: str, value: bytes, n: int) -> None:
    if not isinstance(value, (bytes, bytearray)) or len(value) != n:
        raise LocalProtocolError(f"{what} must be {n} bytes, got {len(value) if isinstance(value, (bytes, bytearray)) else type(value).__name__}")
