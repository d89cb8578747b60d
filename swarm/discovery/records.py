"""What a signaling host advertises over mDNS, and how it is read back (pure, no sockets).

Service type ``_colibri-swarm._tcp.local.``; one service instance per hosting peer. TXT keys
(all ASCII; DNS-SD, RFC 6763 §6):

=======  =================================================================
``v``    signaling protocol version (decimal)
``sid``  swarm id: 16 hex digits of a hash of the swarm key, never the key
``port`` the HTTPS/WSS port (decimal; also in the SRV record)
``fp``   SHA-256 of the server's TLS certificate, 64 lower-case hex digits
``host`` the hosting peer's id
``t``    when the server started, unix time in milliseconds (decimal)
``i``    optional: the hosting process's random instance tag (hex), so a peer can tell its own
         server from one hosted by another process with the same peer id (a copied identity)
=======  =================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from swarm.errors import RemoteProtocolError
from swarm.signaling.address import SignalAddress
from swarm.signaling.messages import INSTANCE_PATTERN, PEER_ID_PATTERN, PROTOCOL_VERSION

SERVICE_TYPE = "_colibri-swarm._tcp.local."


@dataclass(frozen=True)
class ServerRecord:
    """One advertised signaling server.

    ``started`` is unix seconds; ``fingerprint`` 32 bytes; ``addresses`` IPv4 strings, best first;
    ``name`` the mDNS service instance name (unique on the LAN).
    """

    name: str
    version: int
    swarm_id: str
    port: int
    fingerprint: bytes
    host: str
    started: float
    addresses: tuple[str, ...] = ()
    instance: str = ""  # the hosting process's Auth.instance; "" when the record carries none

    def __post_init__(self) -> None:
        # TXT carries milliseconds: keep exactly what a browser will read back, so our own
        # record and the one we see over mDNS compare equal.
        object.__setattr__(self, "started", round(self.started * 1000) / 1000)

    @property
    def key(self) -> tuple[str, float]:
        """Identity of one server run: the same name restarted later is another server."""
        return (self.name, self.started)

    @property
    def host_name(self) -> str:
        """The mDNS host name of this server run, ``colibri-<peer id>-<start ms>.local.``.

        Per run, not per peer id: two processes that share an identity (a copied config
        directory) must not claim one host name, or each would answer for the other's addresses.
        """
        return f"colibri-{self.host[:24]}-{round(self.started * 1000) % 10**9}.local."

    def is_from(self, peer_id: str, instance: str) -> bool:
        """Whether the process ``(peer_id, instance)`` hosts this server. A record without an
        instance tag counts as that process's when the peer id matches (older builds)."""
        return self.host == peer_id and self.instance in ("", instance)

    def url(self, address: str | None = None) -> str:
        """``wss://ADDRESS:PORT/ws`` for ``address`` (default: the first advertised one)."""
        return SignalAddress(address or (self.addresses[0] if self.addresses else ""), self.port).ws_url


def encode_txt(record: ServerRecord) -> dict[str, str]:
    """The TXT properties for ``record`` (zeroconf encodes them as ``key=value`` strings)."""
    return {
        "v": str(record.version),
        "sid": record.swarm_id,
        "port": str(record.port),
        "fp": record.fingerprint.hex(),
        "host": record.host,
        "t": str(round(record.started * 1000)),
        **({"i": record.instance} if record.instance else {}),
    }


def decode_txt(name: str, txt: Mapping[bytes, bytes | None], addresses: tuple[str, ...] = ()) -> ServerRecord:
    """Read a record from TXT properties as zeroconf gives them (bytes keys and values).

    Raises RemoteProtocolError naming the key when one is missing or malformed.
    """
    props = {k.decode("ascii", "replace"): (v or b"").decode("ascii", "replace") for k, v in txt.items()}

    def field(key: str) -> str:
        if key not in props:
            raise RemoteProtocolError(f"mDNS record {name!r}: TXT key {key!r} missing")
        return props[key]

    def decimal(key: str, lo: int, hi: int) -> int:
        text = field(key)
        if not text.isdigit() or not lo <= int(text) <= hi:
            raise RemoteProtocolError(f"mDNS record {name!r}: TXT {key}={text!r} is not a number in [{lo}, {hi}]")
        return int(text)

    sid = field("sid")
    if len(sid) != 16 or any(c not in "0123456789abcdef" for c in sid):
        raise RemoteProtocolError(f"mDNS record {name!r}: TXT sid={sid!r} is not 16 hex digits")
    fp = field("fp")
    try:
        fingerprint = bytes.fromhex(fp)
    except ValueError:
        fingerprint = b""
    if len(fingerprint) != 32:
        raise RemoteProtocolError(f"mDNS record {name!r}: TXT fp is not a SHA-256 fingerprint")
    host = field("host")
    if not PEER_ID_PATTERN.fullmatch(host):
        raise RemoteProtocolError(f"mDNS record {name!r}: TXT host={host!r} is not a peer id")
    instance = props.get("i", "")
    if instance and not INSTANCE_PATTERN.fullmatch(instance):
        raise RemoteProtocolError(f"mDNS record {name!r}: TXT i={instance!r} is not 8-64 lower-case hex digits")
    return ServerRecord(
        name=name, version=decimal("v", 0, 2**31), swarm_id=sid, port=decimal("port", 1, 65535),
        fingerprint=fingerprint, host=host, started=decimal("t", 0, 2**63) / 1000.0, addresses=addresses,
        instance=instance,
    )


def is_ours(record: ServerRecord, swarm_id: str) -> bool:
    """True for a server of our swarm that speaks our protocol version."""
    return record.swarm_id == swarm_id and record.version == PROTOCOL_VERSION
