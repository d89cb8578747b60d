"""The aiortc internals this package relies on, in one place.

aiortc (1.14–1.16) offers no public way to do eight things a swarm link needs, so this module
reaches into its private names, and nothing else in the package does:

* **Our own DTLS certificate.** ``RTCPeerConnection`` makes a fresh certificate in ``__init__``
  and keeps it in the name-mangled list ``_RTCPeerConnection__certificates``, read when it
  creates its DTLS transport (first ``createOffer``/``setRemoteDescription``). A peer's id is the
  hash of its long-term certificate key, so :func:`set_certificate` replaces that list right after
  construction.
* **The remote DTLS certificate.** aiortc checks it against the SDP's ``a=fingerprint`` but
  does not expose it; :func:`remote_certificate` reads it from the DTLS transport's OpenSSL
  connection (``RTCDtlsTransport._ssl``) so a Python peer's claimed id can be checked against
  the key it really holds (docs/security.md, "Peer ids").
* **The SCTP minimum retransmission timeout.** aiortc uses the module constant
  ``aiortc.rtcsctptransport.SCTP_RTO_MIN`` (1 s, RFC 4960's default for the Internet). On a LAN
  the round trip is ~1 ms, so one lost packet stalls a small exchange for a full second;
  :func:`configure_aiortc` lowers it to :data:`SCTP_RTO_MIN_S` for the whole process (it is a
  module global: there is no per-connection setting).
* **Fewer SCTP packets per message.** aiortc's SCTP is pure Python: every packet (one DTLS
  record, one datagram) costs ~0.1 ms of CPU on each side, so the packets a row needs set the
  per-row cost of a swarm step. :func:`configure_aiortc` (a) raises the module's
  ``USERDATA_MAX_LENGTH`` from 1160 to :data:`SCTP_USERDATA_MAX_LENGTH` bytes, so a datagram
  fills a LAN's 1500-byte MTU without IP fragmentation (a 576-float32 row: 2 packets, not 3);
  (b) wraps ``RTCSctpTransport._send_sack`` to acknowledge every :data:`SACK_EVERY_PACKETS`-th
  packet, within :data:`SACK_DELAY_S` for fewer and at once on a gap or a duplicate, instead of
  every one (RFC 4960 §6.2 recommends at least every second packet and allows up to 200 ms of
  delay); (c) wraps ``RTCSctpTransport._transmit`` so a message of up to
  :data:`SCTP_BURST_PACKETS` packets goes out at once, not four packets per SACK received. Rows
  are not altered, only how they travel. Chromium (the page) receives these packets as they are: they fit
  the MTU, and its SCTP acknowledges on its own schedule.

* **Jumbo packets between Python peers.** A DTLS record holds up to 16 KiB, and a UDP datagram
  that large crosses a LAN as IP fragments, reassembled by the kernel: one pure-Python packet
  instead of twelve. Chromium reads at most an MTU's worth of a record, so only links whose
  remote SDP carries :data:`SDP_PACKET_ATTRIBUTE` (every Python peer's does; a browser's does
  not) use them, once a probe (next item) came back: :func:`accept_jumbo_records` lets our DTLS
  read whole records (before the channel authenticates, so it is in place before the remote may
  send one), and :func:`send_jumbo_packets` gives that one association copies of the four
  ``RTCSctpTransport`` methods that read ``USERDATA_MAX_LENGTH``, whose globals hold the larger
  size. Browser links keep MTU-sized packets.
* **Whether the path carries jumbo packets.** Some networks drop IP fragments (a firewall, a
  VPN, some Wi-Fi gear); a jumbo DATA packet lost there is retransmitted at the same size for
  ever (a DATA chunk keeps its size once sent), and the link stalls. :func:`path_carries`
  probes first, as RFC 8899 §4.1 does for SCTP: a HEARTBEAT chunk padded to the jumbo size,
  which the remote's SCTP echoes in a HEARTBEAT ACK of the same size (RFC 9260 §8.3), sent
  through ``RTCSctpTransport._send_chunk`` and caught in ``_receive_chunk``. A link sends
  jumbo packets only when one came back.
* **Sends after the DTLS session ended.** aiortc sends from tasks nobody awaits (timer expiries,
  channel flushes, stream resets); once a link is closed or replaced such a send raises OpenSSL's
  ``protocol is shutdown``, which asyncio logs as "Task exception was never retrieved".
  :func:`configure_aiortc` wraps ``RTCSctpTransport._send_chunk`` to drop such a packet with a
  DEBUG line.
* **A message leaves within ``send``.** aiortc's ``RTCSctpTransport._data_channel_send`` queues
  a message and flushes the queue in a task, a loop iteration later. :func:`flush_eagerly`
  gives a link's association a copy of that method whose module global ``asyncio`` is one whose
  ``ensure_future`` runs the flush at once (:mod:`swarm.peer.net.eager`).

Every internal named here is in :data:`SCTP_GLOBALS_USED`, :data:`SCTP_METHODS_USED` or
:data:`SCTP_STATE_READ` (the certificate list and ``RTCDtlsTransport._ssl`` are an instance's,
checked where they are used).

Each function raises :class:`~swarm.errors.LocalProtocolError` naming the missing internal when an
aiortc upgrade moves it, and ``tests/peer/net/test_rtc.py`` checks each against the installed
aiortc, so an upgrade fails there first and loudly.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import types
from typing import Any, cast

import aiortc
import aiortc.rtcsctptransport as _sctp
from aiortc import RTCPeerConnection
from aiortc.rtcdtlstransport import RTCCertificate
from cryptography import x509
from OpenSSL import SSL

from swarm.errors import LocalProtocolError
from swarm.peer.net import eager

log = logging.getLogger(__name__)

SCTP_RTO_MIN_S = 0.1  # seconds; keeps retransmits rare on loopback while removing 1 s stalls

# SCTP packet size. aiortc keeps every packet within the IPv6 minimum MTU (1280: 1160 bytes of
# user data a packet), so a 576-float32 row with its frame header (~2.4 KB) takes three packets.
# A LAN's MTU is 1500: a UDP payload of at most 1452 bytes (1500 less the IPv6 and UDP headers)
# is never IP-fragmented there, over IPv4 or IPv6. DTLS adds at most 65 bytes to a record with
# the ciphers aiortc offers (AES-CBC with SHA-1 is the largest: 13 header, 16 IV, 20 MAC, up to 16
# padding), which leaves an SCTP packet of 1387 bytes: 1356 bytes of user data, two packets a row.
UDP_PAYLOAD_MAX = 1452
DTLS_OVERHEAD_MAX = 65
SCTP_MAX_PACKET_LENGTH = UDP_PAYLOAD_MAX - DTLS_OVERHEAD_MAX


def userdata_length(packet_length: int) -> int:
    """User data bytes in one SCTP packet of ``packet_length`` bytes: less the 12-byte common and
    16-byte DATA chunk headers, rounded down to the 4-byte chunk padding (RFC 4960 §3)."""
    return (packet_length - 12 - 16) // 4 * 4


SCTP_USERDATA_MAX_LENGTH = userdata_length(SCTP_MAX_PACKET_LENGTH)

# DATA packets one send or SACK may release: a message of 8 rows (~19 KB) goes out at once.
SCTP_BURST_PACKETS = 16
# ... and bytes: a burst of jumbo packets stays well inside a receiver's default UDP buffer (~200 KiB).
SCTP_BURST_BYTES = 64 << 10

# Jumbo packets (module docstring). A DTLS record's plaintext is at most 2**14 bytes (RFC 6347
# §4.1 via RFC 5246 §6.2.1), and one SCTP packet travels in one record.
SCTP_JUMBO_PACKET_LENGTH = 1 << 14
SCTP_JUMBO_USERDATA_MAX_LENGTH = userdata_length(SCTP_JUMBO_PACKET_LENGTH)
SDP_PACKET_ATTRIBUTE = "x-colibri-swarm-sctp-packet"  # a=<this>:<largest SCTP packet, bytes> in our SDP
DTLS_RECORD_READ_BYTES = 1 << 15  # what our DTLS reads at once: a whole jumbo record and its overhead
# A jumbo packet holds what 12 MTU-sized ones do: acknowledge every second one (RFC 4960 §6.2's
# rule), or a message of a few of them waits SACK_DELAY_S for the window to open.
JUMBO_SACK_EVERY_PACKETS = 2
# The RTCSctpTransport methods that read USERDATA_MAX_LENGTH (tests/peer/net/test_rtc.py checks the list).
JUMBO_METHODS = ("_send", "_transmit", "_receive_sack_chunk", "_t3_expired")
# Probing the path for jumbo packets (path_carries): each probe waits this long for its echo (a
# LAN's round trip is ~1 ms; a loaded peer's event loop can hold it for tens of ms), and a lost
# probe is sent again so that one dropped datagram does not keep a link on MTU-sized packets.
JUMBO_PROBE_TIMEOUT_S = 0.5
JUMBO_PROBES = 3
HEARTBEAT_INFO = 1  # the Heartbeat Information parameter's type (RFC 9260 §3.3.5)

# Delayed acknowledgement (RFC 4960 §6.2): a SACK for every 8th packet received, and within
# SACK_DELAY_S for fewer. A swarm step's request or answer (1-8 rows: 2-13 packets) then costs
# about one SACK instead of one per two packets: every SACK is a datagram with the same
# pure-Python cost as a DATA packet on both sides, so SACKs were a third of a step's packets.
# A bulk sender (weight shipping, cwnd of tens of packets) still gets a SACK per 8 packets, and
# one whose window is below 8 packets (a new association) waits at most SACK_DELAY_S for one.
# Far below SCTP_RTO_MIN_S, so it never triggers a retransmit.
SACK_EVERY_PACKETS = 8
SACK_DELAY_S = 0.01

# The RTCSctpTransport attributes the two wrappers below read (its own methods read them too,
# which tests/peer/net/test_rtc.py checks).
SCTP_STATE_READ = ("_outbound_queue", "_flight_size", "_cwnd", "_fast_recovery_exit",
                   "_sack_needed", "_sack_misordered", "_sack_duplicates", "_association_state")
_PATCHED = "_colibri_swarm_patch"
# The aiortc.rtcsctptransport globals this module replaces process-wide (configure_aiortc) or reads.
SCTP_GLOBALS_REPLACED = ("SCTP_RTO_MIN", "SCTP_MAX_PACKET_LENGTH", "USERDATA_MAX_LENGTH")
SCTP_GLOBALS_USED = SCTP_GLOBALS_REPLACED + ("HeartbeatChunk", "HeartbeatAckChunk")
# The RTCSctpTransport methods this module wraps process-wide (configure_aiortc), replaces on one
# association (path_carries) or runs copies of with other module globals (flush_eagerly, the jumbo
# copies). tests/peer/net/test_rtc.py checks that each exists and that each copy reads what it expects.
SCTP_METHODS_WRAPPED = ("_transmit", "_send_sack", "_send_chunk")
SCTP_METHODS_USED = SCTP_METHODS_WRAPPED + ("_receive_chunk", "_data_channel_send") + JUMBO_METHODS


def _transmit_whole_window(original):
    """Wrap ``RTCSctpTransport._transmit`` so one call sends up to :data:`SCTP_BURST_PACKETS`.

    aiortc sends at most 4 DATA chunks past the bytes in flight per call (its Max.Burst) and the
    rest only as SACKs come back, so a message of more than four packets waits for the other
    process to receive and acknowledge before the sender goes on. Calling it again while it makes
    progress sends a message of a few rows in one go. Congestion control stays as it is (the
    window still bounds the bytes in flight, and fast recovery keeps aiortc's own burst), and
    the cap keeps SACKs pacing a bulk transfer: a burst of the whole window (up to 1 MiB) would
    overflow the receiver's UDP buffer.
    """
    async def transmit(self) -> None:
        own = self.__dict__.get("_colibri_transmit", original)  # a jumbo association's own copy
        burst = self.__dict__.get("_colibri_burst_packets", SCTP_BURST_PACKETS)
        sent = 0
        while True:
            queued = len(self._outbound_queue)
            await own(self)
            sent += queued - len(self._outbound_queue)
            if (not self._outbound_queue or len(self._outbound_queue) == queued or sent >= burst
                    or self._fast_recovery_exit is not None or self._flight_size >= self._cwnd):
                return

    setattr(transmit, _PATCHED, True)
    setattr(transmit, "original", original)
    return transmit



def _delayed_sack(original):
    """Wrap ``RTCSctpTransport._send_sack`` (called after every packet that needs one) to delay it.

    aiortc acknowledges every packet: half the packets of a one-way transfer are SACKs, each a
    DTLS record and a datagram with a fixed Python cost on both sides. Acknowledging every
    :data:`SACK_EVERY_PACKETS`-th packet (at once on a gap or a duplicate, which drive fast
    retransmit; within :data:`SACK_DELAY_S` otherwise) leaves one in nine.
    """
    async def send_now(self) -> None:
        timer = self.__dict__.pop("_colibri_sack_timer", None)
        if timer is not None:
            timer.cancel()
        self._colibri_sack_pending = 0
        await original(self)

    async def flush(self) -> None:
        self.__dict__.pop("_colibri_sack_timer", None)
        if self._sack_needed and self._association_state == self.State.ESTABLISHED:
            await send_now(self)

    def on_timer(self) -> None:
        task = asyncio.ensure_future(flush(self))
        self._colibri_sack_task = task  # keeps the task referenced until it ends

    async def send_sack(self) -> None:
        pending = self.__dict__.get("_colibri_sack_pending", 0) + 1
        every = self.__dict__.get("_colibri_sack_every", SACK_EVERY_PACKETS)  # 2 on a jumbo association
        if (pending >= every or self._sack_misordered or self._sack_duplicates
                or self._association_state != self.State.ESTABLISHED):
            await send_now(self)
            return
        self._colibri_sack_pending = pending
        if "_colibri_sack_timer" not in self.__dict__:
            self._colibri_sack_timer = asyncio.get_running_loop().call_later(SACK_DELAY_S, on_timer, self)

    setattr(send_sack, _PATCHED, True)
    return send_sack


def _dropped_once_dtls_ended(original):
    """Wrap ``RTCSctpTransport._send_chunk`` (every SCTP packet goes through it) so a packet sent
    after the DTLS session ended is dropped with a DEBUG line instead of raising.

    aiortc sends from tasks nobody awaits (a retransmission timer's expiry, a data channel's
    flush, a stream reset when a channel closes, our delayed SACK): when a link is closed or
    replaced, such a task finds the session shut and OpenSSL raises ``protocol is shutdown``
    (or aiortc ``Cannot send encrypted data, not connected``), which asyncio then logs as "Task
    exception was never retrieved" with a traceback. Nothing can be sent on that association any
    more, and its closing is handled by the link, so the packet is dropped.
    """
    async def send_chunk(self, chunk) -> None:
        try:
            await original(self, chunk)
        except (ConnectionError, SSL.Error) as exc:
            log.debug("SCTP %s not sent: the DTLS session has ended (%r)", type(chunk).__name__, exc)

    setattr(send_chunk, _PATCHED, True)
    setattr(send_chunk, "original", original)
    return send_chunk


_CERTIFICATES_ATTR = "_RTCPeerConnection__certificates"


def _association(pc: RTCPeerConnection) -> Any:
    """``pc``'s SCTP transport, typed Any: this module reads and replaces its private names.
    Raises LocalProtocolError before the connection has one."""
    if pc.sctp is None:
        raise LocalProtocolError("the peer connection has no data channel transport yet")
    return pc.sctp


def _moved(what: str) -> LocalProtocolError:
    return LocalProtocolError(
        f"aiortc {aiortc.__version__} has no {what}, which colibri-swarm relies on (see swarm/peer/net/rtc.py); "
        "install an aiortc version within the range pyproject.toml names"
    )


def configure_aiortc() -> None:
    """Apply the process-wide aiortc tuning this package relies on (idempotent): the SCTP minimum
    retransmission timeout, packet size, delayed SACK and whole-window transmit (module docstring).

    Also: a packet sent after the DTLS session ended is dropped quietly (``_send_chunk``, see
    :func:`_dropped_once_dtls_ended`).

    Raises LocalProtocolError naming the name when aiortc no longer has one of
    ``rtcsctptransport.SCTP_RTO_MIN``, ``SCTP_MAX_PACKET_LENGTH``, ``USERDATA_MAX_LENGTH``,
    ``RTCSctpTransport._transmit``, ``_send_sack`` or ``_send_chunk``.
    """
    for name in SCTP_GLOBALS_REPLACED:
        if not hasattr(_sctp, name):
            raise _moved(f"aiortc.rtcsctptransport.{name}")
    _sctp.SCTP_RTO_MIN = SCTP_RTO_MIN_S  # type: ignore[assignment]  # aiortc's is an int of seconds
    _sctp.SCTP_MAX_PACKET_LENGTH = SCTP_MAX_PACKET_LENGTH
    _sctp.USERDATA_MAX_LENGTH = SCTP_USERDATA_MAX_LENGTH
    transport = _sctp.RTCSctpTransport
    for name, wrap in (("_transmit", _transmit_whole_window), ("_send_sack", _delayed_sack),
                       ("_send_chunk", _dropped_once_dtls_ended)):
        if not hasattr(transport, name):
            raise _moved(f"aiortc.rtcsctptransport.RTCSctpTransport.{name}")
        if not getattr(getattr(transport, name), _PATCHED, False):
            setattr(transport, name, wrap(getattr(transport, name)))


def set_certificate(pc: RTCPeerConnection, certificate: RTCCertificate) -> None:
    """Make a fresh ``pc`` use ``certificate`` for DTLS.

    Call before ``createOffer``/``setRemoteDescription``. Raises LocalProtocolError when aiortc
    no longer keeps its certificates where this module expects them.
    """
    if not isinstance(getattr(pc, _CERTIFICATES_ATTR, None), list):
        raise _moved(f"RTCPeerConnection.{_CERTIFICATES_ATTR} (the certificate hook)")
    setattr(pc, _CERTIFICATES_ATTR, [certificate])


def remote_certificate(pc: RTCPeerConnection) -> x509.Certificate:
    """The certificate the remote presented in the DTLS handshake of ``pc``'s data channel.

    Valid once the data channel is open (DTLS done). Raises LocalProtocolError when there is no
    completed DTLS session, or when aiortc no longer keeps the OpenSSL connection where expected.
    """
    sctp = pc.sctp
    if sctp is None:
        raise LocalProtocolError("the peer connection has no data channel transport yet")
    if not hasattr(sctp.transport, "_ssl"):
        raise _moved("RTCDtlsTransport._ssl (the DTLS session)")
    ssl = sctp.transport._ssl
    certificate = ssl.get_peer_certificate(as_cryptography=True) if ssl is not None else None
    if certificate is None:
        raise LocalProtocolError("the DTLS handshake has not completed: there is no remote certificate yet")
    return certificate


def advertise_jumbo_packets(sdp: str) -> str:
    """``sdp`` (our offer or answer) with :data:`SDP_PACKET_ATTRIBUTE` after its ``a=sctp-port``
    line: the remote may send us SCTP packets of up to :data:`SCTP_JUMBO_PACKET_LENGTH` bytes.
    An SDP without a data section is returned as it is."""
    line = f"a={SDP_PACKET_ATTRIBUTE}:{SCTP_JUMBO_PACKET_LENGTH}"
    out, done = [], False
    for existing in sdp.split("\r\n"):
        out.append(existing)
        if not done and existing.startswith("a=sctp-port:"):
            out.append(line)
            done = True
    return "\r\n".join(out)


_PACKET_ATTRIBUTE_RE = re.compile(rf"^a={re.escape(SDP_PACKET_ATTRIBUTE)}:(.*?)\s*$", re.MULTILINE)


def jumbo_packet_length(sdp: str) -> int | None:
    """The largest SCTP packet (bytes) the remote's SDP says it reads, or None when it says nothing
    (a browser, or a peer before jumbo packets). Raises ValueError naming the value when it is
    not an integer within [1200, :data:`SCTP_JUMBO_PACKET_LENGTH`] or the attribute repeats."""
    found = _PACKET_ATTRIBUTE_RE.findall(sdp)
    if not found:
        return None
    if len(found) > 1 or not found[0].isdigit() or not 1200 <= int(found[0]) <= SCTP_JUMBO_PACKET_LENGTH:
        raise ValueError(f"a={SDP_PACKET_ATTRIBUTE} must appear once with an integer in "
                         f"[1200, {SCTP_JUMBO_PACKET_LENGTH}], got {found!r:.80}")
    return int(found[0])


def _recv_whole_record(conn: SSL.Connection, bufsiz: int, flags: int | None = None) -> bytes:
    return SSL.Connection.recv(conn, max(bufsiz, DTLS_RECORD_READ_BYTES), flags)


def _bio_read_whole_record(conn: SSL.Connection, bufsiz: int) -> bytes:
    return SSL.Connection.bio_read(conn, max(bufsiz, DTLS_RECORD_READ_BYTES))


def accept_jumbo_records(pc: RTCPeerConnection) -> None:
    """Let ``pc``'s DTLS read and write whole records of any size (aiortc reads 1500 bytes of
    each, which would cut a jumbo packet in two). Call once its data channel is open; harmless
    where no record exceeds 1500 bytes. Raises LocalProtocolError when aiortc keeps its DTLS
    session elsewhere."""
    sctp = pc.sctp
    conn = getattr(getattr(sctp, "transport", None), "_ssl", None)
    if not isinstance(conn, SSL.Connection):
        raise _moved("RTCDtlsTransport._ssl (the DTLS session)")
    conn.recv = functools.partial(_recv_whole_record, conn)  # type: ignore[method-assign]
    conn.bio_read = functools.partial(_bio_read_whole_record, conn)  # type: ignore[method-assign]


class _EagerAsyncio:
    """``asyncio`` as :func:`flush_eagerly`'s copy of ``_data_channel_send`` sees it: its one
    ``ensure_future`` (of the SCTP flush) starts the flush at once."""

    def __getattr__(self, name: str):
        return getattr(asyncio, name)

    @staticmethod
    def ensure_future(coro):
        try:
            return eager.start_eagerly(coro)
        except Exception as exc:  # as in aiortc's own flush task: the association's state says the rest
            log.info("an SCTP flush failed: %r", exc)
            return None


def _with_globals(fn: types.FunctionType, scope: dict) -> types.FunctionType:
    """A copy of ``fn`` that reads its module globals from ``scope``."""
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


@functools.cache
def _eager_send_method() -> types.FunctionType:
    fn = cast(types.FunctionType, _sctp.RTCSctpTransport._data_channel_send)
    return _with_globals(fn, dict(vars(_sctp), asyncio=_EagerAsyncio()))


def flush_eagerly(pc: RTCPeerConnection) -> None:
    """Make a message sent on ``pc``'s data channels leave within ``send``: aiortc queues it and
    flushes the queue in a task, a loop iteration later (~30-70 µs of a round trip on a busy
    loop); here the flush runs at once (:mod:`swarm.peer.net.eager`; a flush that suspended
    would go on as a task, but nothing on aiortc's path to ``sendto`` suspends today, and a
    full congestion window leaves the message queued for the next SACK as before). Messages
    keep their order: the flush takes the queue front first. A flush that raises (the DTLS
    transport already closed) is logged, as aiortc's own task would have it, and the link's
    close handling does the rest. Raises LocalProtocolError when aiortc no longer has the
    method, or no longer flushes through ``asyncio.ensure_future``."""
    fn = getattr(_sctp.RTCSctpTransport, "_data_channel_send", None)
    if fn is None or "ensure_future" not in fn.__code__.co_names:
        raise _moved("aiortc.rtcsctptransport.RTCSctpTransport._data_channel_send (its asyncio.ensure_future flush)")
    sctp = _association(pc)
    sctp._data_channel_send = types.MethodType(_eager_send_method(), sctp)


@functools.cache
def _jumbo_methods(userdata: int) -> dict[str, types.FunctionType]:
    """Copies of :data:`JUMBO_METHODS` whose module globals say ``USERDATA_MAX_LENGTH = userdata``."""
    scope = dict(vars(_sctp), USERDATA_MAX_LENGTH=userdata, SCTP_MAX_PACKET_LENGTH=userdata + 12 + 16)
    out = {}
    for name in JUMBO_METHODS:
        fn = getattr(_sctp.RTCSctpTransport, name)
        out[name] = _with_globals(getattr(fn, "original", fn), scope)  # _transmit: aiortc's, under our burst wrapper
    return out


async def path_carries(pc: RTCPeerConnection, packet_length: int, *, probes: int = JUMBO_PROBES,
                       timeout_s: float = JUMBO_PROBE_TIMEOUT_S) -> bool:
    """Whether SCTP packets of ``packet_length`` bytes cross to the remote and back (module
    docstring): up to ``probes`` HEARTBEAT chunks of that size, each given ``timeout_s`` seconds
    for its HEARTBEAT ACK. Both ends must read records that large (:func:`accept_jumbo_records`;
    the remote's SDP says it does). Chunks other than our probes' echoes go to aiortc as before.
    Raises LocalProtocolError when aiortc no longer has the methods this relies on."""
    sctp = _association(pc)
    for name in ("_send_chunk", "_receive_chunk"):
        if not hasattr(_sctp.RTCSctpTransport, name):
            raise _moved(f"aiortc.rtcsctptransport.RTCSctpTransport.{name}")
    for name in ("HeartbeatChunk", "HeartbeatAckChunk"):
        if not hasattr(_sctp, name):
            raise _moved(f"aiortc.rtcsctptransport.{name}")
    padding = packet_length - 12 - 4 - 4 - 16  # less the common, chunk and parameter headers and the nonce
    if padding < 0:
        raise ValueError(f"a {packet_length}-byte packet cannot hold a probe")
    info = os.urandom(16) + bytes(padding)  # a random nonce, padded: the echo must bring it back whole
    echoed = asyncio.get_running_loop().create_future()
    receive = sctp._receive_chunk
    replaced = vars(sctp).get("_receive_chunk")  # an instance's own, put back after

    async def catch_echo(chunk) -> None:
        if isinstance(chunk, _sctp.HeartbeatAckChunk) and (HEARTBEAT_INFO, info) in chunk.params:
            if not echoed.done():
                echoed.set_result(None)
            return
        await receive(chunk)

    probe = _sctp.HeartbeatChunk()
    probe.params = [(HEARTBEAT_INFO, info)]
    # aiortc's own send: a probe on an ended DTLS session raises to our caller, not dropped quietly
    send_chunk = getattr(_sctp.RTCSctpTransport._send_chunk, "original", _sctp.RTCSctpTransport._send_chunk)
    sctp._receive_chunk = catch_echo
    try:
        for _ in range(probes):
            await send_chunk(sctp, probe)
            try:
                await asyncio.wait_for(asyncio.shield(echoed), timeout_s)
                return True
            except asyncio.TimeoutError:
                continue
        return False
    finally:
        if replaced is None:
            del sctp._receive_chunk  # aiortc's own method again
        else:
            sctp._receive_chunk = replaced


def send_jumbo_packets(pc: RTCPeerConnection, packet_length: int) -> None:
    """Make ``pc``'s SCTP association send packets of up to ``packet_length`` bytes (what both
    ends' SDP allow; the remote has called :func:`accept_jumbo_records`). Its congestion window
    and bursts are counted in those packets, as aiortc counts them in its own. Raises
    LocalProtocolError when aiortc no longer has a method this relies on."""
    sctp = _association(pc)
    for name in JUMBO_METHODS:
        if not hasattr(_sctp.RTCSctpTransport, name):
            raise _moved(f"aiortc.rtcsctptransport.RTCSctpTransport.{name}")
    userdata = userdata_length(packet_length)
    methods = _jumbo_methods(userdata)
    for name, fn in methods.items():
        if name == "_transmit":
            sctp._colibri_transmit = fn  # called by the burst wrapper, which stays in front
        else:
            setattr(sctp, name, types.MethodType(fn, sctp))
    sctp._colibri_burst_packets = max(1, min(SCTP_BURST_PACKETS, SCTP_BURST_BYTES // userdata))
    sctp._colibri_sack_every = JUMBO_SACK_EVERY_PACKETS
    sctp._cwnd = max(sctp._cwnd, 4 * userdata)  # RFC 4960 §7.2.1's initial window: 4 packets
