"""The signaling messages: JSON objects in WebSocket text frames, bytes as lower-case hex.

One frozen dataclass per message; ``encode()`` gives the frame text, ``decode_client_message``
/ ``decode_server_message`` parse and validate a frame received by the server / the client.
Every field is checked (type, length, alphabet) before use; anything else raises
RemoteProtocolError with the field named. The browser peer speaks the same JSON
(docs/protocol.md, "Signaling").
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from swarm.errors import RemoteProtocolError
from swarm.signaling.auth import MAC_BYTES, NONCE_BYTES

PROTOCOL_VERSION = 1
KINDS = ("python", "browser")
MAX_NAME_CHARS = 64
PEER_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
INSTANCE_PATTERN = re.compile(r"[0-9a-f]{8,64}")


@dataclass(frozen=True)
class PeerInfo:
    """One entry of the presence list: peer id, display name, kind (python|browser), joined (unix s)."""

    peer_id: str
    name: str
    kind: str
    joined: float

    def to_json(self) -> dict[str, Any]:
        return {"peer": self.peer_id, "name": self.name, "kind": self.kind, "joined": self.joined}

    @classmethod
    def from_json(cls, obj: Any) -> PeerInfo:
        obj = _object(obj, "peer entry")
        return cls(
            peer_id=_peer_id(obj, "peer"),
            name=_name(obj),
            kind=_kind(obj),
            joined=_number(obj, "joined"),
        )


# -- server → client ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Challenge:
    """First frame of a connection: protocol version, 32-byte server nonce, the host's peer id."""

    nonce: bytes
    host: str
    version: int = PROTOCOL_VERSION

    def encode(self) -> str:
        return _dump({"type": "challenge", "version": self.version, "nonce": self.nonce.hex(), "host": self.host})


@dataclass(frozen=True)
class Welcome:
    """Authentication accepted: the server's MAC (32 bytes) and the presence list (including you)."""

    mac: bytes
    peers: tuple[PeerInfo, ...]

    def encode(self) -> str:
        return _dump({"type": "welcome", "mac": self.mac.hex(), "peers": [p.to_json() for p in self.peers]})


@dataclass(frozen=True)
class Joined:
    """A peer authenticated and joined the presence list."""

    peer: PeerInfo

    def encode(self) -> str:
        return _dump({"type": "joined", "peer": self.peer.to_json()})


@dataclass(frozen=True)
class Left:
    """A peer left (closed, timed out, was refused, or was replaced by a newer connection)."""

    peer_id: str

    def encode(self) -> str:
        return _dump({"type": "left", "peer": self.peer_id})


@dataclass(frozen=True)
class Relayed:
    """A signal from another peer; ``sender`` was stamped by the server, never by the client."""

    sender: str
    data: dict[str, Any]

    def encode(self) -> str:
        return _dump({"type": "signal", "from": self.sender, "data": self.data})


@dataclass(frozen=True)
class Notice:
    """A non-fatal refusal (e.g. ``unknown-peer`` for a signal to a peer that is not present)."""

    code: str
    detail: str

    def encode(self) -> str:
        return _dump({"type": "error", "code": self.code, "detail": self.detail})


ServerMessage = Challenge | Welcome | Joined | Left | Relayed | Notice


# -- client → server ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Auth:
    """The client's proof: peer id, kind, name, 32-byte client nonce, 32-byte MAC.

    ``instance`` (optional, 8-64 lower-case hex digits, random per process or page load) tells a
    reconnect of the same process (it replaces its older connection) from another process
    claiming the same peer id (a copied identity: refused). Empty when the client sends none.
    """

    peer_id: str
    kind: str
    name: str
    nonce: bytes
    mac: bytes
    version: int = PROTOCOL_VERSION
    instance: str = ""

    def encode(self) -> str:
        obj = {
            "type": "auth", "version": self.version, "peer": self.peer_id, "kind": self.kind,
            "name": self.name, "nonce": self.nonce.hex(), "mac": self.mac.hex(),
        }
        if self.instance:
            obj["instance"] = self.instance
        return _dump(obj)


@dataclass(frozen=True)
class Signal:
    """A signal (SDP offer/answer, ICE candidate: any JSON object) addressed to one peer id."""

    to: str
    data: dict[str, Any]

    def encode(self) -> str:
        return _dump({"type": "signal", "to": self.to, "data": self.data})


ClientMessage = Auth | Signal


def decode_client_message(text: str) -> ClientMessage:
    """Parse a frame the server received. Raises RemoteProtocolError naming the bad field."""
    obj = _load(text)
    match obj.get("type"):
        case "auth":
            _exact_keys(obj, {"type", "version", "peer", "kind", "name", "nonce", "mac", "instance"})
            return Auth(
                version=_version(obj), peer_id=_peer_id(obj, "peer"), kind=_kind(obj), name=_name(obj),
                nonce=_hex(obj, "nonce", NONCE_BYTES), mac=_hex(obj, "mac", MAC_BYTES), instance=_instance(obj),
            )
        case "signal":
            # A "from" key is refused, not ignored: the server alone says who sent a signal.
            _exact_keys(obj, {"type", "to", "data"})
            return Signal(to=_peer_id(obj, "to"), data=_object(obj.get("data"), "data"))
        case other:
            raise RemoteProtocolError(f"unknown signaling message type {other!r}")


def decode_server_message(text: str) -> ServerMessage:
    """Parse a frame the client received. Raises RemoteProtocolError naming the bad field."""
    obj = _load(text)
    match obj.get("type"):
        case "challenge":
            return Challenge(version=_version(obj), nonce=_hex(obj, "nonce", NONCE_BYTES), host=_peer_id(obj, "host"))
        case "welcome":
            peers = obj.get("peers")
            if not isinstance(peers, list):
                raise RemoteProtocolError("welcome: 'peers' must be a list")
            return Welcome(mac=_hex(obj, "mac", MAC_BYTES), peers=tuple(PeerInfo.from_json(p) for p in peers))
        case "joined":
            return Joined(peer=PeerInfo.from_json(obj.get("peer")))
        case "left":
            return Left(peer_id=_peer_id(obj, "peer"))
        case "signal":
            return Relayed(sender=_peer_id(obj, "from"), data=_object(obj.get("data"), "data"))
        case "error":
            return Notice(code=_str(obj, "code", 64), detail=_str(obj, "detail", 1024))
        case other:
            raise RemoteProtocolError(f"unknown signaling message type {other!r}")


# -- field checks ------------------------------------------------------------------------------


def _dump(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


def _load(text: str) -> dict[str, Any]:
    if not isinstance(text, str):
        raise RemoteProtocolError("signaling frames must be text (JSON), not binary")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise RemoteProtocolError(f"signaling frame is not valid JSON: {exc}") from None
    return _object(obj, "frame")


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RemoteProtocolError(f"{what} must be a JSON object")
    return value


def _exact_keys(obj: dict[str, Any], allowed: set[str]) -> None:
    extra = set(obj) - allowed
    if extra:
        raise RemoteProtocolError(f"{obj['type']}: field(s) not allowed: {', '.join(sorted(extra))}")


def _str(obj: dict[str, Any], key: str, max_chars: int) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or len(value) > max_chars:
        raise RemoteProtocolError(f"'{key}' must be a string of at most {max_chars} characters")
    return value


def _peer_id(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not PEER_ID_PATTERN.fullmatch(value):
        raise RemoteProtocolError(f"'{key}' must be a peer id (1-128 characters of A-Z a-z 0-9 . _ : -)")
    return value


def _name(obj: dict[str, Any]) -> str:
    value = _str(obj, "name", MAX_NAME_CHARS)
    if not value.isprintable():
        raise RemoteProtocolError("'name' must be printable text")
    return value


def _instance(obj: dict[str, Any]) -> str:
    value = obj.get("instance", "")
    if value != "" and not (isinstance(value, str) and INSTANCE_PATTERN.fullmatch(value)):
        raise RemoteProtocolError("'instance' must be 8-64 lower-case hex digits")
    return value


def _kind(obj: dict[str, Any]) -> str:
    value = obj.get("kind")
    if value not in KINDS:
        raise RemoteProtocolError(f"'kind' must be one of {', '.join(KINDS)}")
    return value


def _version(obj: dict[str, Any]) -> int:
    value = obj.get("version")
    if not isinstance(value, int) or isinstance(value, bool):
        raise RemoteProtocolError("'version' must be an integer")
    return value


def _number(obj: dict[str, Any], key: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RemoteProtocolError(f"'{key}' must be a finite number")
    return float(value)


def _hex(obj: dict[str, Any], key: str, n_bytes: int) -> bytes:
    value = obj.get(key)
    if not isinstance(value, str) or len(value) != 2 * n_bytes:
        raise RemoteProtocolError(f"'{key}' must be {n_bytes} bytes as {2 * n_bytes} hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise RemoteProtocolError(f"'{key}' must be hex digits") from None
