"""The protocol pieces a link needs, behind one small seam.

:mod:`swarm.peer.link` speaks only to the names here: the channel authenticator, the message
codec (Hello, Heartbeat, everything else) and fragmentation. Keeping them behind this seam lets
the link follow the protocol core without touching its asyncio logic.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

from swarm.errors import AuthenticationError, LocalProtocolError, RemoteProtocolError

PROTOCOL_VERSION = 1


# -- channel authentication (sans-I/O) ---------------------------------------------------------

_AUTH_LABEL = b"colibri-swarm channel auth v1"
_NONCE_BYTES = 32


class ChannelAuthenticator:
    """Mutual proof of the swarm key bound to both DTLS fingerprints (DESIGN §6).

    Each side sends ``nonce | peer id``, then ``HMAC(key, role | transcript)``; the transcript is
    ordered by offer/answer role: both fingerprints, both peer ids, both nonces. ``start()`` and
    ``receive(data)`` return bytes to send; ``peer_id`` is set once the remote proof checks out.
    Raises :class:`AuthenticationError` on a wrong proof, :class:`RemoteProtocolError` on junk.
    """

    def __init__(self, *, swarm_key: bytes, offerer: bool, local_peer_id: str,
                 local_fingerprint: str, remote_fingerprint: str) -> None:
        self._key = hmac.new(swarm_key, b"channel-auth", hashlib.sha256).digest()
        self._offerer = offerer
        self._local_id = local_peer_id
        self._local_fp = local_fingerprint
        self._remote_fp = remote_fingerprint
        self._nonce = os.urandom(_NONCE_BYTES)
        self._remote_nonce: bytes | None = None
        self._remote_id: str | None = None
        self.peer_id: str | None = None

    def start(self) -> list[bytes]:
        return [b"N" + self._nonce + self._local_id.encode()]

    def _transcript(self) -> bytes:
        assert self._remote_nonce is not None and self._remote_id is not None
        pairs = [(self._local_fp, self._local_id, self._nonce), (self._remote_fp, self._remote_id, self._remote_nonce)]
        if not self._offerer:
            pairs.reverse()
        (ofp, oid, on), (afp, aid, an) = pairs
        return b"|".join([_AUTH_LABEL, ofp.encode(), afp.encode(), oid.encode(), aid.encode(), on, an])

    def _mac(self, offerer: bool) -> bytes:
        role = b"offerer" if offerer else b"answerer"
        return hmac.new(self._key, role + self._transcript(), hashlib.sha256).digest()

    def receive(self, data: bytes) -> list[bytes]:
        if self._remote_nonce is None:
            if data[:1] != b"N" or not (1 + _NONCE_BYTES < len(data) <= 1 + _NONCE_BYTES + 128):
                raise RemoteProtocolError("expected the channel-auth nonce as the first message")
            self._remote_nonce = data[1 : 1 + _NONCE_BYTES]
            self._remote_id = data[1 + _NONCE_BYTES :].decode("ascii", "replace")
            return [b"M" + self._mac(self._offerer)]
        if self.peer_id is not None or data[:1] != b"M" or len(data) != 33:
            raise RemoteProtocolError("expected the channel-auth proof")
        if not hmac.compare_digest(data[1:], self._mac(not self._offerer)):
            raise AuthenticationError(
                "the remote proof does not match: it holds another swarm key, or a relay substituted a DTLS fingerprint"
            )
        self.peer_id = self._remote_id
        return []


# -- messages -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hello:
    peer_id: str
    protocol_version: int = PROTOCOL_VERSION
    build: str = ""
    model_hash: str = ""
    memory_budget: int = 0
    ffn_speed: float = 0.0
    name: str = ""
    kind: str = "python"


@dataclass(frozen=True)
class Heartbeat:
    seq: int
    reply: bool


@dataclass(frozen=True)
class Blob:
    """Opaque bytes (tests and benchmarks)."""

    data: bytes


def encode_message(message: object) -> bytes:
    match message:
        case Hello():
            import json
            return b"H" + json.dumps(message.__dict__).encode()
        case Heartbeat(seq=seq, reply=reply):
            return b"B" + struct.pack("<QB", seq, reply)
        case Blob(data=data):
            return b"X" + data
    raise LocalProtocolError(f"no wire encoding for {type(message).__name__}")


def decode_message(data: bytes) -> object:
    tag, body = data[:1], data[1:]
    if tag == b"H":
        import json
        try:
            return Hello(**json.loads(body))
        except (ValueError, TypeError) as exc:
            raise RemoteProtocolError(f"malformed Hello: {exc}") from exc
    if tag == b"B" and len(body) == 9:
        seq, reply = struct.unpack("<QB", body)
        return Heartbeat(seq, bool(reply))
    if tag == b"X":
        return Blob(bytes(body))
    raise RemoteProtocolError(f"unknown message tag {tag!r}")


# -- fragmentation ------------------------------------------------------------------------------

_MORE, _LAST = b"\x00", b"\x01"


def fragments(data: bytes, max_size: int) -> list[bytes]:
    step = max_size - 1
    chunks = [data[i : i + step] for i in range(0, len(data), step)] or [b""]
    return [_MORE + c for c in chunks[:-1]] + [_LAST + chunks[-1]]


class Reassembler:
    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._parts: list[bytes] = []
        self._size = 0

    def feed(self, fragment: bytes) -> bytes | None:
        if not fragment or fragment[:1] not in (_MORE, _LAST):
            raise RemoteProtocolError("malformed fragment header")
        self._size += len(fragment) - 1
        if self._size > self._max:
            raise RemoteProtocolError(f"message exceeds {self._max} bytes")
        self._parts.append(fragment[1:])
        if fragment[:1] == _LAST:
            data = b"".join(self._parts)
            self._parts, self._size = [], 0
            return data
        return None
