"""The signaling server's protocol core, sans-I/O: frames and time in, frames and closes out.

Theory of operation. The adapter (``swarm.signaling.server``) gives every WebSocket an integer
connection id and calls :meth:`SignalingRelay.connect`, :meth:`~SignalingRelay.receive`,
:meth:`~SignalingRelay.disconnect` and, at :meth:`~SignalingRelay.next_deadline`,
:meth:`~SignalingRelay.handle_timer`; each returns a list of :class:`Send` / :class:`Close`
outputs to carry out in order. A connection is in one of two states:

=============  ==============================================  ============================
state          accepted frame                                  anything else
=============  ==============================================  ============================
challenged     ``auth`` with a valid MAC → welcome, joined      close 4001/4000, no presence
authenticated  ``signal`` to a present peer → relayed, from     close 4000 (protocol error)
               stamped by the server
=============  ==============================================  ============================

One peer id is one connection. An ``auth`` for a peer id already present replaces the older
connection (close 4010) when it comes from the same process (same ``instance``, or either has
none: a reconnect racing the old socket's death); from another process it is refused (close
4011) and the present one is sent a ``duplicate-peer`` notice, so a copied identity is named
instead of two processes taking turns as one peer.

Every frame first passes the size limit (close 4009) and the connection's token bucket
(close 4029), so a flooding or oversized client is cut off while the others keep working.
A client that does not authenticate within ``auth_timeout_s`` is closed (4002); one address
may hold at most ``max_pending_per_address`` unauthenticated connections and the server at most
``max_connections`` in all (further ones are closed at once with 4029).
``now`` is unix time in seconds (also used as the presence "joined" time).
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.errors import AuthenticationError, RemoteProtocolError
from swarm.signaling import auth
from swarm.signaling.messages import (
    PROTOCOL_VERSION,
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
)

MAX_FRAME_CHARS = 64 * 1024  # an SDP with many candidates is a few KiB
RATE_PER_S = 50.0  # sustained frames per second per connection (trickled ICE is bursty)
BURST = 200  # token bucket depth
AUTH_TIMEOUT_S = 10.0
MAX_PENDING_PER_ADDRESS = 16  # unauthenticated connections from one remote address
MAX_CONNECTIONS = 512  # all connections; bounds the server's memory
DUPLICATE_NOTICE = "duplicate-peer"  # Notice code sent to a peer whose id another process claimed


class CloseCode(enum.IntEnum):
    """WebSocket close codes the server uses (4000-4999 are application codes, RFC 6455 §7.4.2)."""

    PROTOCOL_ERROR = 4000
    AUTH_FAILED = 4001
    AUTH_TIMEOUT = 4002
    VERSION_MISMATCH = 4003
    REPLACED = 4010
    DUPLICATE_PEER = 4011
    TOO_BIG = 4009
    RATE_LIMITED = 4029
    SERVER_STOPPING = 4050


@dataclass(frozen=True)
class Send:
    """Send ``text`` as one text frame on connection ``conn``."""

    conn: int
    text: str


@dataclass(frozen=True)
class Close:
    """Close connection ``conn`` with WebSocket close ``code`` and a reason (≤ 123 bytes)."""

    conn: int
    code: int
    reason: str


Output = Send | Close


@dataclass
class TokenBucket:
    """A token bucket: ``rate`` tokens per second, at most ``burst`` stored; one token per frame."""

    rate: float
    burst: float
    tokens: float
    updated: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


@dataclass
class _Conn:
    nonce: bytes
    deadline: float | None
    bucket: TokenBucket
    address: str = ""
    instance: str = ""  # the authenticated client's process instance (Auth.instance)
    peer: PeerInfo | None = None
    closed: bool = False


@dataclass
class SignalingRelay:
    """Presence and relay for one swarm; see the module docstring.

    ``k_sig`` is the 32-byte signaling sub-key (:func:`swarm.signaling.auth.derive_signaling_key`),
    ``host`` the hosting peer's id (sent in every challenge).
    """

    k_sig: bytes
    host: str
    max_frame_chars: int = MAX_FRAME_CHARS
    rate_per_s: float = RATE_PER_S
    burst: int = BURST
    auth_timeout_s: float = AUTH_TIMEOUT_S
    max_pending_per_address: int = MAX_PENDING_PER_ADDRESS
    max_connections: int = MAX_CONNECTIONS
    new_nonce: Callable[[], bytes] = auth.new_nonce
    _conns: dict[int, _Conn] = field(default_factory=dict)
    _by_peer: dict[str, int] = field(default_factory=dict)

    # -- inputs ----------------------------------------------------------------------------

    def connect(self, conn: int, now: float, address: str = "") -> list[Output]:
        """A new WebSocket from remote ``address`` (IP): remember it and challenge it."""
        nonce = self.new_nonce()
        bucket = TokenBucket(self.rate_per_s, self.burst, self.burst, now)
        pending = sum(1 for c in self._conns.values() if c.peer is None and not c.closed and c.address == address)
        self._conns[conn] = _Conn(nonce=nonce, deadline=now + self.auth_timeout_s, bucket=bucket, address=address)
        if pending >= self.max_pending_per_address or len(self._conns) > self.max_connections:
            return self._close(conn, CloseCode.RATE_LIMITED, "too many connections; try again later")
        return [Send(conn, Challenge(nonce=nonce, host=self.host).encode())]

    def receive(self, conn: int, frame: str | bytes, now: float) -> list[Output]:
        """One frame from connection ``conn`` (text, or bytes if the client sent binary)."""
        c = self._conns.get(conn)
        if c is None or c.closed:
            return []
        if len(frame) > self.max_frame_chars:
            return self._close(conn, CloseCode.TOO_BIG, f"frame larger than {self.max_frame_chars} bytes")
        if not c.bucket.take(now):
            return self._close(conn, CloseCode.RATE_LIMITED, f"more than {self.rate_per_s:g} frames/s")
        try:
            msg = decode_client_message(frame)
        except RemoteProtocolError as exc:
            code = CloseCode.AUTH_FAILED if c.peer is None else CloseCode.PROTOCOL_ERROR
            return self._close(conn, code, str(exc))
        match msg:
            case Auth() if c.peer is None:
                return self._authenticate(conn, c, msg, now)
            case Signal() if c.peer is not None:
                return self._relay(conn, c.peer, msg)
            case Signal():
                return self._close(conn, CloseCode.AUTH_FAILED, "authenticate before sending anything else")
            case _:
                return self._close(conn, CloseCode.PROTOCOL_ERROR, "already authenticated")

    def disconnect(self, conn: int, now: float) -> list[Output]:
        """The WebSocket is gone (closed by either side or dead): forget it, tell the others."""
        c = self._conns.pop(conn, None)
        if c is None or c.peer is None or self._by_peer.get(c.peer.peer_id) != conn:
            return []
        del self._by_peer[c.peer.peer_id]
        return self._broadcast(Left(c.peer.peer_id).encode(), exclude=conn)

    def next_deadline(self) -> float | None:
        """The earliest authentication deadline, or None."""
        deadlines = [c.deadline for c in self._conns.values() if c.deadline is not None and not c.closed]
        return min(deadlines, default=None)

    def handle_timer(self, now: float) -> list[Output]:
        """Close connections whose authentication deadline passed."""
        out: list[Output] = []
        for conn, c in list(self._conns.items()):
            if c.deadline is not None and now >= c.deadline and not c.closed:
                out += self._close(conn, CloseCode.AUTH_TIMEOUT, f"no authentication within {self.auth_timeout_s:g} s")
        return out

    # -- queries ---------------------------------------------------------------------------

    @property
    def peers(self) -> list[PeerInfo]:
        """The presence list, in joining order."""
        return [self._conns[conn].peer for conn in self._by_peer.values()]  # type: ignore[misc]

    # -- internals -------------------------------------------------------------------------

    def _authenticate(self, conn: int, c: _Conn, msg: Auth, now: float) -> list[Output]:
        if msg.version != PROTOCOL_VERSION:
            return self._close(conn, CloseCode.VERSION_MISMATCH,
                               f"signaling protocol {msg.version} not supported (server speaks {PROTOCOL_VERSION})")
        try:
            auth.verify(auth.client_mac(self.k_sig, c.nonce, msg.nonce, msg.peer_id), msg.mac, "client")
        except AuthenticationError:
            return self._close(conn, CloseCode.AUTH_FAILED, "wrong swarm key")
        out: list[Output] = []
        old = self._by_peer.get(msg.peer_id)
        if old is not None and self._conns[old].instance and msg.instance and self._conns[old].instance != msg.instance:
            # Another process with our id (copied config directory, cloned VM): both would answer
            # for one peer. The one already present keeps it and is told; the newcomer is refused.
            out.append(Send(old, Notice(DUPLICATE_NOTICE, f"another process{_where(c.address)} claimed peer id "
                                        f"{msg.peer_id} and was refused (a copied config directory?)").encode()))
            return out + self._close(conn, CloseCode.DUPLICATE_PEER,
                                     f"peer id in use by another process{_where(self._conns[old].address)}")
        if old is not None:
            # A reconnect whose previous socket is not yet known dead: the newer one wins.
            out += self._close(old, CloseCode.REPLACED, "replaced by a newer connection of the same peer")
        c.instance = msg.instance
        c.peer = PeerInfo(peer_id=msg.peer_id, name=msg.name, kind=msg.kind, joined=now)
        c.deadline = None
        self._by_peer[msg.peer_id] = conn
        mac = auth.server_mac(self.k_sig, c.nonce, msg.nonce, msg.peer_id)
        out.append(Send(conn, Welcome(mac=mac, peers=tuple(self.peers)).encode()))
        out += self._broadcast(Joined(c.peer).encode(), exclude=conn)
        return out

    def _relay(self, conn: int, sender: PeerInfo, msg: Signal) -> list[Output]:
        target = self._by_peer.get(msg.to)
        if target is None or target == conn:
            return [Send(conn, Notice("unknown-peer", f"no peer {msg.to} is present").encode())]
        return [Send(target, Relayed(sender=sender.peer_id, data=msg.data).encode())]

    def _broadcast(self, text: str, exclude: int) -> list[Output]:
        return [Send(other, text) for other in self._by_peer.values() if other != exclude]

    def _close(self, conn: int, code: int, reason: str) -> list[Output]:
        c = self._conns.get(conn)
        if c is None or c.closed:
            return []
        c.closed = True
        out: list[Output] = [Close(conn, int(code), _truncate_reason(reason))]
        if c.peer is not None and self._by_peer.get(c.peer.peer_id) == conn:
            del self._by_peer[c.peer.peer_id]
            out += self._broadcast(Left(c.peer.peer_id).encode(), exclude=conn)
        return out


def _where(address: str) -> str:
    """`` at ADDRESS`` for a message, naming the server's own machine for a loopback address."""
    if not address:
        return ""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(address).is_loopback:
            return " on the signaling host's machine"
    return f" at {address}"


def _truncate_reason(reason: str) -> str:
    # A close frame's payload is at most 125 bytes: 2 for the code, 123 for the UTF-8 reason.
    data = reason.encode()[:123]
    return data.decode(errors="ignore")
