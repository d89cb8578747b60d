"""A link's protocol after the channel proof, sans-I/O: greeting, heartbeats, liveness, the jumbo probe's turn.

Theory of operation
-------------------
:class:`LinkProtocol` holds one link's state and decides; :class:`~swarm.peer.net.link.Link`
moves bytes and time in and out of it. Time is the ``now`` parameter (``time.monotonic()``
seconds), never read here. The states, in this order only::

    CONNECTING ──channel open──▶ AUTHENTICATING ──proof ok──▶ GREETING ──hello ok──▶ OPEN
         └──────────────── any failure / timeout / remote close ─────────────────▶ CLOSED

* **Greeting.** Once the channel proof (:mod:`swarm.peer.net.auth`) names the remote, both
  sides send a :class:`~swarm.peer.net.messages.Hello`. The first message must be the remote's
  Hello (an :class:`~swarm.peer.net.messages.Error` of request id 0 instead is its refusal of the
  link); :meth:`LinkProtocol.check_hello` checks it: the id the channel proved, the kind
  signaling announced, a Python peer's certificate, the protocol version. A version refusal is
  told to the remote (:meth:`LinkProtocol.refusal`) before the link closes.
* **Heartbeats.** Every :data:`HEARTBEAT_S` the adapter sends :meth:`LinkProtocol.ping`'s
  :class:`~swarm.peer.net.messages.LinkHeartbeat`; the remote echoes each unchanged, and an
  echo of one of ours is a round trip: :attr:`LinkProtocol.rtt_s` is the median of the last
  :data:`RTT_SAMPLES`.
* **Liveness.** Any inbound byte counts (:meth:`LinkProtocol.heard`); :meth:`LinkProtocol.overdue`
  names why the link must close: no OPEN within the handshake timeout, or silence for
  :data:`DEAD_AFTER_S` once open.
* **Jumbo probe.** When the link opens, :meth:`LinkProtocol.open` says whether to probe the path
  for jumbo SCTP packets and at what size (both ends offer them); the adapter probes
  (``rtc.path_carries``) after each wait of :data:`JUMBO_REPROBE_S` until one comes back.
"""

from __future__ import annotations

import collections
import enum
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from swarm.errors import AuthenticationError, IdentityError, RemoteProtocolError, VersionMismatchError
from swarm.peer.net.messages import Error, Hello, LinkHeartbeat, Message, WeightsHeld

HEARTBEAT_S = 1.0  # seconds between heartbeats on an open link
DEAD_AFTER_S = 5.0  # seconds without any inbound byte before the link is declared dead
# Seconds after a failed jumbo packet probe (rtc.path_carries) before each next one.
JUMBO_REPROBE_S = (5.0, 30.0)
HANDSHAKE_TIMEOUT_S = 10.0  # seconds from connect to OPEN (ICE + DTLS + auth + hello)
RTT_SAMPLES = 9  # heartbeat round trips kept; rtt_s is their median
PINGS_KEPT = 16  # unanswered pings remembered; the oldest is forgotten past this
MAX_ERROR_CHARS = 1000  # the longest refusal text sent to a remote


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    AUTHENTICATING = "authenticating"
    GREETING = "greeting"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True)
class Greeted:
    """The remote's Hello came first: check it (:meth:`LinkProtocol.check_hello`), then open."""

    hello: Hello


@dataclass(frozen=True)
class Echo:
    """Send ``heartbeat`` back unchanged: the remote's ping."""

    heartbeat: LinkHeartbeat


@dataclass(frozen=True)
class Deliver:
    """A message for the link's handlers."""

    message: Message


Event = Greeted | Echo | Deliver


class LinkProtocol:
    """One link's protocol state (module docstring). ``local_hello``: what this peer sends once
    the channel is proved; ``expected_peer_id``: the id signaling announced for the remote (None:
    any); ``remote_kind``: ``"python"`` or ``"browser"`` when signaling said which; ``jumbo_packets``:
    the largest jumbo SCTP packet this end sends (bytes; None: it sends none).

    Attributes: ``state``, ``peer_id`` (the id the channel proved), ``hello`` (the remote's),
    ``rtt_s`` (None until measured), ``weights_held`` (the remote's last report), ``last_heard``,
    ``remote_packet_length`` (the largest SCTP packet the remote's SDP says it reads; None: none).
    """

    def __init__(self, local_hello: Hello, *, now: float, expected_peer_id: str | None = None,
                 remote_kind: str | None = None, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 dead_after_s: float = DEAD_AFTER_S, jumbo_packets: int | None = None) -> None:
        self.local_hello = local_hello
        self.expected_peer_id = expected_peer_id
        self.remote_kind = remote_kind
        self.handshake_timeout_s = handshake_timeout_s
        self.dead_after_s = dead_after_s
        self.jumbo_packets = jumbo_packets
        self.state = LinkState.CONNECTING
        self.peer_id: str | None = None
        self.hello: Hello | None = None
        self.rtt_s: float | None = None
        self.weights_held: WeightsHeld | None = None
        self.remote_packet_length: int | None = None
        self.last_heard = now
        self._handshake_deadline = now + handshake_timeout_s
        self._ping_sent: dict[int, float] = {}
        self._ping_seq = 0
        self._rtt_samples: collections.deque[float] = collections.deque(maxlen=RTT_SAMPLES)

    # -- life cycle -------------------------------------------------------------------------------

    def channel_open(self) -> bool:
        """The data channel opened: authenticate. False when the link is past CONNECTING already."""
        if self.state is not LinkState.CONNECTING:
            return False
        self.state = LinkState.AUTHENTICATING
        return True

    def authenticated(self, remote_peer_id: str) -> Hello:
        """The channel proof named ``remote_peer_id``: greet. Returns the Hello to send. Raises
        AuthenticationError when signaling announced another id."""
        if self.expected_peer_id is not None and remote_peer_id != self.expected_peer_id:
            raise AuthenticationError(
                f"the channel proved peer id {remote_peer_id}, but signaling announced {self.expected_peer_id}"
            )
        self.peer_id = remote_peer_id
        self.state = LinkState.GREETING
        return self.local_hello

    def open(self, hello: Hello) -> int | None:
        """The remote's checked ``hello``: the link is OPEN. Returns the jumbo packet length to
        probe the path with (both ends read jumbo packets), or None to keep MTU-sized ones."""
        self.hello = hello
        self.state = LinkState.OPEN
        if self.jumbo_packets is not None and self.remote_packet_length is not None:
            return min(self.remote_packet_length, self.jumbo_packets)
        return None

    def close(self) -> LinkState | None:
        """Mark the link CLOSED; returns the state it was in, or None when it was closed already."""
        if self.state is LinkState.CLOSED:
            return None
        was, self.state = self.state, LinkState.CLOSED
        return was

    # -- inbound ----------------------------------------------------------------------------------

    def heard(self, now: float) -> None:
        """Bytes came from the remote at ``now``."""
        self.last_heard = now

    def receive(self, message: Message, now: float) -> Event | None:
        """A whole message from the remote (GREETING or OPEN): what to do with it, or None when it
        is taken here (an echo of our ping, a weights report). Raises RemoteProtocolError (a
        Hello out of turn, the remote's refusal) or VersionMismatchError (its version refusal)."""
        if isinstance(message, Error) and message.request_id == 0 and (
            message.code == "version" or self.state is LinkState.GREETING
        ):  # the remote refuses the channel itself; other refusals go to the handlers (roles)
            error = VersionMismatchError if message.code == "version" else RemoteProtocolError
            raise error(f"peer {self.peer_id} refused the link ({message.code}): {message.message}")
        if self.state is LinkState.GREETING:
            if not isinstance(message, Hello):
                raise RemoteProtocolError(f"expected a Hello first, got {type(message).__name__}")
            return Greeted(message)
        if isinstance(message, LinkHeartbeat):
            if self._ping_sent.get(message.seq) != message.sent_s:
                return Echo(message)  # the remote's ping
            del self._ping_sent[message.seq]
            self._rtt_samples.append(now - message.sent_s)
            # the median of recent samples: one heartbeat queued behind a large message must not
            # skew the estimate that placement and deadlines are built on
            self.rtt_s = statistics.median(self._rtt_samples)
            return None
        if isinstance(message, WeightsHeld):
            self.weights_held = message
            return None
        if isinstance(message, Hello):
            raise RemoteProtocolError("a second Hello arrived on an open link")
        return Deliver(message)

    def check_hello(self, hello: Hello, certified_peer_id: Callable[[], str]) -> None:
        """Check the remote's Hello against what the channel proved and signaling announced.
        ``certified_peer_id()``: the peer id the remote's DTLS certificate key hashes to (read
        only for a Python peer; may raise IdentityError). Raises
        AuthenticationError or VersionMismatchError naming both sides."""
        if hello.peer_id != self.peer_id:
            raise AuthenticationError(f"Hello names peer {hello.peer_id}, but the channel proved {self.peer_id}")
        if self.remote_kind is not None and hello.peer_kind != self.remote_kind:
            raise AuthenticationError(
                f"peer {hello.peer_id} joined signaling as a {self.remote_kind} peer but its Hello says {hello.peer_kind}"
            )
        if hello.peer_kind == "python":
            try:
                certified = certified_peer_id()
            except IdentityError as exc:
                raise AuthenticationError(f"peer {hello.peer_id}'s DTLS certificate: {exc}") from None
            if certified != hello.peer_id:
                raise AuthenticationError(
                    f"peer {hello.peer_id} presented the DTLS certificate of peer {certified}: "
                    "a Python peer's id must be the hash of its certificate key (it claims another peer's id)"
                )
        ours = self.local_hello.protocol_version
        if hello.protocol_version != ours:
            raise VersionMismatchError(
                f"peer {self.peer_id} speaks protocol version {hello.protocol_version}, we speak {ours}; "
                "upgrade colibri-swarm on the older peer"
            )

    @staticmethod
    def refusal(exc: VersionMismatchError) -> Error:
        """The Error that tells the remote why its link is refused (docs/protocol.md §7)."""
        return Error(request_id=0, code="version", message=str(exc)[:MAX_ERROR_CHARS])

    # -- timers -----------------------------------------------------------------------------------

    def ping(self, now: float) -> LinkHeartbeat:
        """The heartbeat to send at ``now``; its echo measures a round trip."""
        self._ping_seq += 1
        self._ping_sent[self._ping_seq] = now
        if len(self._ping_sent) > PINGS_KEPT:  # unanswered pings: forget the oldest
            self._ping_sent.pop(min(self._ping_sent))
        return LinkHeartbeat(seq=self._ping_seq, sent_s=now)

    def overdue(self, now: float) -> str | None:
        """Why the link must close at ``now`` (no OPEN within the handshake timeout; silence past
        ``dead_after_s`` once open), or None."""
        if self.state is LinkState.OPEN:
            silence = now - self.last_heard
            if silence >= self.dead_after_s:
                return f"nothing heard for {silence:.1f} s (dead after {self.dead_after_s:g} s)"
        elif now >= self._handshake_deadline:
            return f"no authenticated link within {self.handshake_timeout_s:g} s ({self.state.value})"
        return None

