"""One authenticated data-channel link to one peer, over an aiortc ``RTCPeerConnection``.

Theory of operation
-------------------
A link owns one peer connection and one ordered, reliable data channel on it (negotiated
stream id 0, created on both sides before the SDP offer, so neither side waits for DCEP).
This module is the asyncio adapter: the greeting, heartbeats, liveness and the states are
decided by the sans-I/O :class:`~swarm.peer.net.link_protocol.LinkProtocol`, which goes
through these states, in this order only::

    CONNECTING ──channel open──▶ AUTHENTICATING ──proof ok──▶ GREETING ──hello ok──▶ OPEN
         └──────────────── any failure / timeout / remote close ─────────────────▶ CLOSED

* AUTHENTICATING: the sans-I/O channel authenticator (:mod:`swarm.peer.net.auth`) runs over the
  channel with the local certificate's fingerprint and the fingerprint parsed from the *remote
  SDP* — the thing a malicious relay could substitute. A relay that rewrites ``a=fingerprint``
  either breaks aiortc's own DTLS check (no channel) or, if it terminates DTLS itself, cannot
  produce the HMAC that binds both fingerprints (docs/security.md §4). Nothing else is accepted
  before the proof; any other byte closes the link.
* GREETING: both sides send a :class:`~swarm.peer.net.messages.Hello`; another protocol version is
  refused with :class:`~swarm.errors.VersionMismatchError` naming both versions. A remote whose
  Hello says it is a Python peer must hold the key its peer id names: the SPKI of the certificate
  it presented in DTLS must hash to that id (:func:`~swarm.keys.identity.peer_id_of_certificate`),
  or the link closes with :class:`~swarm.errors.AuthenticationError` naming both ids. Browser
  peers cannot export their DTLS key, so their ids are bound by the channel proof only.
* OPEN: messages are wire frames (:mod:`swarm.peer.net.wire`), split to the remote's SCTP
  max-message-size and reassembled with a bounded buffer; sending waits on ``bufferedAmount``
  (backpressure); heartbeats every :data:`HEARTBEAT_S` measure RTT (the remote echoes each
  :class:`~swarm.peer.net.messages.LinkHeartbeat` unchanged; one that matches a ping we sent is its
  answer); silence for :data:`DEAD_AFTER_S` closes the link. Our SDP offers jumbo SCTP packets
  (``rtc.SDP_PACKET_ATTRIBUTE``); a remote whose SDP offers them too (a Python peer) gets them
  once a probe of that size came back from it (a network that drops IP fragments keeps
  MTU-sized ones), one datagram for a message of up to 16 KiB (docs/protocol.md §7).

Every task the link starts is owned by it and cancelled in :meth:`Link.close`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiortc import RTCConfiguration, RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.exceptions import InvalidAccessError, InvalidStateError
from aiortc.rtcdtlstransport import RTCCertificate

from swarm.errors import (
    AuthenticationError,
    LocalProtocolError,
    PeerLostError,
    RemoteProtocolError,
    SwarmError,
    VersionMismatchError,
)
from swarm.keys.identity import peer_id_of_certificate
from swarm.peer.net import auth, eager, messages, rtc, wire
from swarm.peer.net.link_protocol import (
    DEAD_AFTER_S,
    HANDSHAKE_TIMEOUT_S,
    HEARTBEAT_S,
    JUMBO_REPROBE_S,
    Deliver,
    Echo,
    Greeted,
    LinkProtocol,
    LinkState,
)
from swarm.peer.net.messages import Hello, Message, WeightsHeld

log = logging.getLogger(__name__)

HELD_MAX = 64  # unclaimed inbound messages kept for a handler yet to register; the oldest go first

CHANNEL_LABEL = "colibri-swarm"
CHANNEL_ID = 0  # negotiated stream id of the one data channel of a link

# Backpressure: send() waits while more than SEND_HIGH_WATER bytes are queued in aiortc and
# resumes at SEND_LOW_WATER (the `bufferedamountlow` event). 1 MiB keeps the SCTP queue busy
# without holding a large message twice in memory.
SEND_HIGH_WATER = 1 << 20
SEND_LOW_WATER = 256 << 10

# RFC 8841 §6: assume 64 KiB when the remote SDP names no a=max-message-size.
DEFAULT_MAX_MESSAGE_SIZE = wire.DEFAULT_REMOTE_MAX_MESSAGE_SIZE


_FINGERPRINT_RE = re.compile(r"^a=fingerprint:sha-256 ([0-9A-Fa-f:]{95})\s*$", re.MULTILINE)


def sdp_fingerprint(sdp: str) -> str:
    """The sha-256 DTLS fingerprint of an SDP (``AA:BB:…``, 32 upper-case hex pairs).

    Raises :class:`RemoteProtocolError` when the SDP has none, or two different ones (an SDP
    with several certificates is not something a peer of ours sends).
    """
    found = {m.upper() for m in _FINGERPRINT_RE.findall(sdp)}
    if len(found) != 1:
        raise RemoteProtocolError(
            f"the remote SDP carries {len(found)} distinct sha-256 fingerprints; exactly one is required"
        )
    return found.pop()


def certificate_fingerprint(certificate: RTCCertificate) -> str:
    """The sha-256 fingerprint of a DTLS certificate, in SDP form (``AA:BB:…``)."""
    for fp in certificate.getFingerprints():
        if fp.algorithm == "sha-256":
            return fp.value.upper()
    raise LocalProtocolError("the DTLS certificate has no sha-256 fingerprint")


def new_peer_connection(certificate: RTCCertificate) -> tuple[RTCPeerConnection, RTCDataChannel]:
    """A peer connection using ``certificate`` for DTLS, with the link's data channel created.

    No ICE servers: aiortc's default public STUN host stalls set-up by ~5 s on a LAN with a
    default route (docs/architecture.md, "Links"). The certificate and the SCTP tuning go
    through :mod:`swarm.peer.net.rtc`.
    """
    rtc.configure_aiortc()
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    rtc.set_certificate(pc, certificate)
    channel = pc.createDataChannel(CHANNEL_LABEL, negotiated=True, id=CHANNEL_ID, ordered=True)
    return pc, channel


Handler = Callable[["Link", Any], Awaitable[None] | None]  # Any: each handler takes the one kind it is registered for

_CLOSED = object()  # put in the inbox when the link closes: wakes receive()


class Link:
    """An authenticated link to one remote peer.

    Build it on :func:`new_peer_connection`, exchange SDP (:meth:`create_offer` on the offerer,
    :meth:`accept_offer` on the answerer, :meth:`accept_answer` back on the offerer), then
    ``await link.established()``. After that, ``await link.send(msg)``
    sends any message of :mod:`swarm.peer.net.messages`; handlers registered with :meth:`on` receive
    inbound messages by type, and messages of types with no handler go to :meth:`receive`.

    Attributes: ``peer_id`` (the authenticated remote peer id, ``str``), ``hello`` (the remote
    ``Hello``), ``rtt_s`` (median of recent heartbeat round-trip times in seconds, ``None`` until measured),
    ``weights_held`` (the remote's last :class:`~swarm.peer.net.messages.WeightsHeld`, ``None`` until
    one came: a browser peer reports the bytes its GPU buffers take), ``state`` (:class:`LinkState`),
    ``close_reason`` (``str`` once closed), ``closed_by_peer`` (the remote closed it, as a peer
    that leaves does), :attr:`last_heard`.

    ``expected_peer_id``: the id the remote must prove (the sender signaling stamped on its
    offer or answer). ``remote_kind``: ``"python"`` or ``"browser"`` when signaling said which
    the remote is; its Hello must then say the same, so a Python peer cannot pass for a browser
    to dodge the certificate check.
    """

    def __init__(
        self,
        pc: RTCPeerConnection,
        channel: RTCDataChannel,
        *,
        certificate: RTCCertificate,
        auth_key: bytes,
        local_hello: Hello,
        offerer: bool,
        expected_peer_id: str | None = None,
        remote_kind: str | None = None,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        heartbeat_s: float = HEARTBEAT_S,
        dead_after_s: float = DEAD_AFTER_S,
        jumbo_packets: bool = True,
    ) -> None:
        self.pc = pc
        self.channel = channel
        self.offerer = offerer
        self.local_peer_id = local_hello.peer_id
        self.local_hello = local_hello
        self.expected_peer_id = expected_peer_id
        self.remote_kind = remote_kind
        self.protocol = LinkProtocol(
            local_hello, now=time.monotonic(), expected_peer_id=expected_peer_id, remote_kind=remote_kind,
            handshake_timeout_s=handshake_timeout_s, dead_after_s=dead_after_s,
            jumbo_packets=rtc.SCTP_JUMBO_PACKET_LENGTH if jumbo_packets else None,
        )
        self.close_reason: str | None = None
        self.closed_by_peer = False  # the remote closed the link (as a peer that leaves does), not we
        self.remote_max_message_size = DEFAULT_MAX_MESSAGE_SIZE
        # the largest SCTP packet this link sends: jumbo once a probe to a Python peer came back (rtc.py)
        self.sctp_packet_length = rtc.SCTP_MAX_PACKET_LENGTH
        self._jumbo_packets = jumbo_packets  # False: neither offer nor send them (a LAN that drops IP fragments)
        # Benchmarks only: seconds each message waits before it is sent, standing in for a slower
        # network (Wi-Fi) where no netem is available. 0 in the product.
        self.added_delay_s = 0.0

        self._certificate = certificate
        self._auth_key = auth_key
        self._handshake_timeout_s = handshake_timeout_s
        self._heartbeat_s = heartbeat_s
        self._auth: auth.ChannelAuth | None = None
        self._reassembler = wire.Reassembler()
        self._fragmenter = wire.Fragmenter(DEFAULT_MAX_MESSAGE_SIZE)
        self._handlers: dict[type, Handler] = {}
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._established = asyncio.get_running_loop().create_future()
        self._closed = asyncio.Event()
        self._packets_settled = asyncio.Event()  # the packet size is known (jumbo or not)
        self._send_lock = asyncio.Lock()
        self._drained = asyncio.Event()
        self._drained.set()
        self.bytes_received = 0  # inbound data-channel bytes, every frame and fragment (benchmarks)
        self._tasks: set[asyncio.Task] = set()
        self._close_callbacks: list[Callable[[Link], None]] = []
        self._pc_closing: asyncio.Task | None = None

        channel.bufferedAmountLowThreshold = SEND_LOW_WATER
        channel.on("open", self._on_channel_open)
        channel.on("message", self._on_channel_message)
        channel.on("close", self._on_channel_closed)
        channel.on("bufferedamountlow", self._drained.set)
        pc.on("connectionstatechange", self._on_connection_state)
        self._spawn(self._watchdog())

    # -- SDP negotiation ------------------------------------------------------------------------

    async def create_offer(self) -> str:
        """Create the SDP offer (complete, candidates included; aiortc gathers before returning)."""
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self._local_sdp()

    async def accept_offer(self, sdp: str) -> str:
        """Apply the remote SDP offer and return our SDP answer."""
        await self._set_remote("offer", sdp)
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        return self._local_sdp()

    def _local_sdp(self) -> str:
        sdp = self.pc.localDescription.sdp
        return rtc.advertise_jumbo_packets(sdp) if self._jumbo_packets else sdp

    async def accept_answer(self, sdp: str) -> None:
        """Apply the remote SDP answer."""
        await self._set_remote("answer", sdp)

    async def _set_remote(self, kind: str, sdp: str) -> None:
        if not isinstance(sdp, str) or len(sdp) > 64 << 10:
            raise RemoteProtocolError(f"the remote SDP {kind} is not a string of at most 64 KiB")
        remote_fp = sdp_fingerprint(sdp)
        self._auth = auth.ChannelAuth(
            role=auth.Role.OFFERER if self.offerer else auth.Role.ANSWERER,
            auth_key=self._auth_key,
            local_peer_id=self.local_peer_id,
            local_fingerprint=f"sha-256 {certificate_fingerprint(self._certificate)}",
            remote_fingerprint=f"sha-256 {remote_fp}",
            now=time.monotonic(),
            timeout_s=self._handshake_timeout_s,
        )
        try:
            self._fragmenter = wire.Fragmenter(wire.max_message_size_from_sdp(sdp))
        except LocalProtocolError as exc:
            raise RemoteProtocolError(f"the remote SDP {kind} has an unusable a=max-message-size: {exc}") from None
        self.remote_max_message_size = self._fragmenter.max_message_size
        try:
            self.protocol.remote_packet_length = rtc.jumbo_packet_length(sdp)
        except ValueError as exc:
            raise RemoteProtocolError(f"the remote SDP {kind}: {exc}") from None
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type=kind))
        except (ValueError, AttributeError, InvalidStateError, InvalidAccessError) as exc:
            raise RemoteProtocolError(f"the remote SDP {kind} was rejected by WebRTC: {exc}") from exc

    # -- life cycle -----------------------------------------------------------------------------

    async def established(self) -> Hello:
        """Wait until the link is OPEN; return the remote ``Hello``.

        Raises :class:`AuthenticationError` (the remote could not prove the swarm key or a
        fingerprint was substituted), :class:`VersionMismatchError`, or :class:`PeerLostError`
        (connection failed, closed, or :data:`HANDSHAKE_TIMEOUT_S` passed).
        """
        return await asyncio.shield(self._established)

    @property
    def is_open(self) -> bool:
        return self.state is LinkState.OPEN

    @property
    def state(self) -> LinkState:
        return self.protocol.state

    @property
    def peer_id(self) -> str | None:
        """The remote peer id the channel proved (None before)."""
        return self.protocol.peer_id

    @property
    def hello(self) -> Hello | None:
        return self.protocol.hello

    @property
    def rtt_s(self) -> float | None:
        return self.protocol.rtt_s

    @property
    def weights_held(self) -> WeightsHeld | None:
        return self.protocol.weights_held

    @property
    def last_heard(self) -> float:
        """When the remote last sent anything (heartbeats included), ``time.monotonic()`` seconds."""
        return self.protocol.last_heard

    def on_close(self, callback: Callable[[Link], None]) -> None:
        """Call ``callback(link)`` once, when the link closes for any reason."""
        if self.state is LinkState.CLOSED:
            callback(self)
        else:
            self._close_callbacks.append(callback)

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def close(self, reason: str = "closed locally") -> None:
        """Close the link and its peer connection; cancel and await every task it owns.

        Idempotent: a second call waits for the peer connection's close, which a cancelled first
        call leaves running (it is never cut short: aiortc would leave its ICE tasks behind).
        """
        self._fail(reason, error=PeerLostError(f"link closed: {reason}"), expected=True)
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert self._pc_closing is not None  # started by _fail
        await asyncio.wait([self._pc_closing])  # wait() never cancels what it waits for

    @property
    def released(self) -> bool:
        """True once the link is closed and its peer connection has let go of its sockets and tasks."""
        return self._pc_closing is not None and self._pc_closing.done()

    def abort(self, reason: str) -> None:
        """Close now without waiting (from sync code or a cancelled task); idempotent.

        The peer connection is closed in the background; :meth:`close` awaits that too.
        """
        self._fail(reason, error=PeerLostError(f"link closed: {reason}"), expected=True)

    def _fail(self, reason: str, error: SwarmError | None = None, expected: bool = False) -> None:
        """Close for ``reason``; logged as a warning unless ``expected`` or the link was open."""
        was = self.protocol.close()
        if was is None:
            return
        self.close_reason = reason
        self._packets_settled.set()  # nothing more will be sent: no one waits for a probe
        unexpected = not expected and was is not LinkState.OPEN
        level = logging.WARNING if unexpected or isinstance(error, AuthenticationError) else logging.INFO
        log.log(level, "link to %s closed in state %s: %s", self.peer_id or self.expected_peer_id or "?", was.value, reason)
        if not self._established.done():
            self._established.set_exception(error or PeerLostError(f"link failed: {reason}"))
            self._established.exception()  # mark retrieved: a caller may never await it
        self._drained.set()
        self._closed.set()
        self._inbox.put_nowait(_CLOSED)
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()
        # Close the peer connection once, here, so a link that fails inside a callback releases
        # its sockets even when nobody calls close(); close() awaits this task (aiortc's
        # close() must not run twice at once: the second raises InvalidStateError).
        self._pc_closing = self._spawn(self.pc.close(), owned=False)
        for cb in self._close_callbacks:
            try:
                cb(self)
            except Exception:  # a buggy observer must not keep others from hearing about it
                log.exception("link close callback failed")
        self._close_callbacks.clear()

    def _spawn(self, coro: Awaitable[Any], owned: bool = True) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        if owned:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:  # kept by the module until done, awaited by close(); its exception is read here
            _orphans.add(task)
            task.add_done_callback(_forget)
        return task

    def _on_channel_closed(self) -> None:
        """The data channel closed before we closed the link: the remote ended it (its peer
        connection's close sends an SCTP ABORT, as a peer that leaves does at Ctrl-C or SIGTERM);
        a lost peer falls silent instead, and the watchdog closes its link."""
        if self.protocol.state is not LinkState.CLOSED:
            self.closed_by_peer = True
        self._fail("the peer closed the link")

    def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        if state == "failed" and self.state is LinkState.CONNECTING:
            # aiortc checks the remote DTLS certificate against the SDP's a=fingerprint: a relay
            # that rewrote it ends here, before any channel opens
            self._fail("ICE or DTLS failed before the channel opened (a DTLS failure can mean the "
                       "SDP's a=fingerprint was rewritten on the way)")
        elif state in ("failed", "closed"):
            self._fail(f"the peer connection is {state}")

    async def _watchdog(self) -> None:
        while self.state is not LinkState.OPEN:
            overdue = self.protocol.overdue(time.monotonic())
            if overdue is not None:
                self._fail(overdue)
                return
            await asyncio.sleep(min(0.1, self._heartbeat_s))
        while True:
            now = time.monotonic()
            for mid in self._reassembler.handle_timer(now):
                log.warning("dropped message %d from %s: no fragment for %g s", mid, self.peer_id, self._reassembler.abandon_s)
            overdue = self.protocol.overdue(now)
            if overdue is not None:
                self._fail(overdue)
                return
            self._send_now(messages.encode(self.protocol.ping(now)))
            await asyncio.sleep(self._heartbeat_s)

    # -- inbound --------------------------------------------------------------------------------

    def _on_channel_open(self) -> None:
        if self.state is not LinkState.CONNECTING:
            return
        if self._auth is None:
            self._fail("the data channel opened before the remote SDP was applied")
            return
        try:  # before our first byte: the remote sends jumbo packets only after it
            rtc.accept_jumbo_records(self.pc)
            rtc.flush_eagerly(self.pc)
        except LocalProtocolError as exc:
            self._fail(str(exc), error=exc)
            return
        self.protocol.channel_open()
        for out in self._auth.start():
            self.channel.send(out)

    def _on_channel_message(self, data: bytes | str) -> None:
        now = time.monotonic()
        self.protocol.heard(now)
        self.bytes_received += len(data)
        try:
            if isinstance(data, str):
                raise RemoteProtocolError("a text message arrived on a binary-only channel")
            if self.state is LinkState.AUTHENTICATING:
                # whole, small frames only: the reassembler (which buffers) is not for strangers
                self._on_auth_frame(data)
                return
            frame = self._reassembler.feed(data, now)
            if frame is None:
                return
            match self.state:
                case LinkState.GREETING | LinkState.OPEN:
                    self._on_message(messages.decode(frame), now)
                case _:
                    raise RemoteProtocolError(f"a message arrived in state {self.state.value}")
        except AuthenticationError as exc:
            log.warning("channel authentication with %s failed: %s", self.expected_peer_id or "?", exc)
            self._fail(f"channel authentication failed: {exc}", error=exc)
        except SwarmError as exc:
            self._fail(str(exc), error=exc)

    def _on_auth_frame(self, frame: bytes) -> None:
        assert self._auth is not None
        for out in self._auth.receive(frame):
            self.channel.send(out)
        if not self._auth.authenticated:
            return
        assert self._auth.remote_peer_id is not None  # authenticated
        self._send_now(messages.encode(self.protocol.authenticated(self._auth.remote_peer_id)))

    def _on_message(self, message: Message, now: float) -> None:
        match self.protocol.receive(message, now):
            case Greeted(hello):
                self._greeted(hello)
            case Echo(heartbeat):
                self._send_now(messages.encode(heartbeat))
            case Deliver(delivered):
                self._dispatch(delivered)

    def _greeted(self, hello: Hello) -> None:
        try:
            self._check_hello(hello)
        except VersionMismatchError as exc:
            # tell the remote why (docs/protocol.md §7); queued before the close, so it goes first
            for fragment in self._fragmenter.split(messages.encode(self.protocol.refusal(exc))):
                self.channel.send(fragment)
            raise
        jumbo = self.protocol.open(hello)
        if jumbo is not None:  # it reads jumbo records by now
            self._spawn(self._try_jumbo_packets(jumbo))
        else:
            self._packets_settled.set()
        log.info("link to %s open (version %s)", self.peer_id, hello.protocol_version)
        self._established.set_result(hello)

    def _dispatch(self, message: Message) -> None:
        handler = self._handlers.get(type(message))
        if handler is None:
            if self._inbox.qsize() >= HELD_MAX:  # a type this peer never handles must not pile up
                dropped = self._inbox.get_nowait()
                log.debug("link to %s: dropped an unclaimed %s (%d held)", self.peer_id,
                          type(dropped).__name__, HELD_MAX)
            self._inbox.put_nowait(message)
            return
        self._deliver(handler, message)

    def _deliver(self, handler: Handler, message: Any) -> None:
        try:
            result = handler(self, message)
        except SwarmError:
            raise  # the message broke a protocol rule: the link closes with that reason
        except Exception:  # a bug in a handler is logged; the link and other handlers go on
            log.exception("%s handler on link to %s failed", type(message).__name__, self.peer_id)
            return
        if asyncio.iscoroutine(result):
            # Run now, not a loop iteration later: a short stage step is computed and answered
            # within this callback (swarm/peer/net/eager.py); what suspends goes on as a task.
            # A task cancelled before its next step never resumes the handler's coroutine:
            # close it then, so it is released without a "never awaited" warning.
            task = eager.start_eagerly(self._run_handler(result))
            if task is None:
                return
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(lambda _task: result.close())

    async def _try_jumbo_packets(self, length: int) -> None:
        """Send jumbo packets of ``length`` bytes from now on if the path carries them both ways
        (rtc.path_carries); else keep MTU-sized ones, say why, and probe again after each of
        :data:`JUMBO_REPROBE_S` (a probe lost to a busy moment must not cost the link for good).
        Messages meanwhile go in MTU-sized packets."""
        try:
            for attempt, wait_s in enumerate((0.0, *JUMBO_REPROBE_S)):
                await asyncio.sleep(wait_s)
                if await rtc.path_carries(self.pc, length):
                    rtc.send_jumbo_packets(self.pc, length)
                    self.sctp_packet_length = length
                    if attempt:
                        log.info("link to %s: %d-byte packets come back now; the link uses them", self.peer_id, length)
                    return
                if not attempt:
                    log.warning("link to %s: %d-byte packets did not come back from it in %d tries: the network "
                                "between likely drops IP fragments, so this link keeps packets within the MTU "
                                "(%d bytes)", self.peer_id, length, rtc.JUMBO_PROBES, self.sctp_packet_length)
                    self._packets_settled.set()
        except LocalProtocolError as exc:
            self._fail(str(exc), error=exc)
        except ConnectionError as exc:  # the DTLS transport closed under the probe: the link is going
            log.info("link to %s: jumbo packet probe stopped: %s", self.peer_id, exc)
        finally:
            self._packets_settled.set()

    async def packets_settled(self) -> int:
        """Wait until this open link knows its packet size (a jumbo probe answered or given up);
        return the largest SCTP packet it sends, in bytes."""
        await self._packets_settled.wait()
        return self.sctp_packet_length

    async def _run_handler(self, coro: Awaitable[None]) -> None:
        try:
            await coro
        except SwarmError as exc:
            self._fail(f"handler failed: {exc}", error=exc)
        except Exception:
            log.exception("message handler on link to %s failed", self.peer_id)

    def _check_hello(self, hello: Hello) -> None:
        self.protocol.check_hello(hello, lambda: peer_id_of_certificate(rtc.remote_certificate(self.pc)))

    # -- handlers and receive ---------------------------------------------------------------------

    def on(self, message_type: type, handler: Handler) -> None:
        """Deliver inbound messages of ``message_type`` to ``handler(link, message)`` (sync or async).

        Messages of that type that came before, unclaimed (a peer's links open while it is still
        starting its roles: the coordinator's plan and first request may come first), go to the
        handler now, in the order they came; they are not lost. At most ``HELD_MAX`` unclaimed
        messages are held (the oldest are dropped first)."""
        self._handlers[message_type] = handler
        held = []
        while not self._inbox.empty():
            held.append(self._inbox.get_nowait())
        for message in held:
            if type(message) is message_type and self.state is not LinkState.CLOSED:
                try:
                    self._deliver(handler, message)
                except SwarmError as exc:  # broke a protocol rule, as on arrival: the link closes
                    self.abort(str(exc))
            else:
                self._inbox.put_nowait(message)

    async def receive(self) -> Any:
        """The next inbound message that no handler claimed. Raises :class:`PeerLostError` once closed.

        Messages that arrived before the link closed are still returned, then the error.
        """
        message = await self._inbox.get()
        if message is not _CLOSED:
            return message
        self._inbox.put_nowait(_CLOSED)  # every later receive() ends the same way
        raise PeerLostError(f"link to {self.peer_id} closed: {self.close_reason}")

    # -- outbound ---------------------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        """Send one message; wait while aiortc holds more than :data:`SEND_HIGH_WATER` bytes.

        Messages larger than the remote max-message-size are split into fragments; a message is
        never interleaved with another one (a lock orders whole messages). Raises
        :class:`PeerLostError` when the link is (or becomes) closed.
        """
        if self.state is not LinkState.OPEN:
            raise PeerLostError(f"link to {self.peer_id} is not open ({self.state.value})")
        data = messages.encode(message)
        if self.added_delay_s:
            await asyncio.sleep(self.added_delay_s)
        async with self._send_lock:
            for fragment in self._fragmenter.split(data):
                while self.channel.bufferedAmount > SEND_HIGH_WATER and self.state is LinkState.OPEN:
                    self._drained.clear()
                    await self._drained.wait()
                if self.state is not LinkState.OPEN:
                    raise PeerLostError(f"link to {self.peer_id} closed while sending: {self.close_reason}")
                self.channel.send(fragment)

    def _send_now(self, data: bytes) -> None:
        """Queue a small control message (Hello, heartbeat) behind any message being sent.

        Control messages take the send lock too, so a fragmented message is never interleaved.
        """
        if self.channel.readyState == "open" and self.state is not LinkState.CLOSED:
            self._spawn(self._send_bytes(data))

    async def _send_bytes(self, data: bytes) -> None:
        if self.added_delay_s:  # heartbeats too, so the measured RTT includes the added delay
            await asyncio.sleep(self.added_delay_s)
        async with self._send_lock:
            for fragment in self._fragmenter.split(data):
                if self.channel.readyState != "open":
                    return
                self.channel.send(fragment)


_orphans: set[asyncio.Task] = set()


def _forget(task: asyncio.Task) -> None:
    _orphans.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.debug("closing a peer connection failed: %r", task.exception())
