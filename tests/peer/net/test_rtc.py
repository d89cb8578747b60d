"""The aiortc internals swarm.peer.net.rtc relies on, checked against the installed aiortc.

An aiortc upgrade that moves one of them fails here, naming it, before any link test does.
"""

from __future__ import annotations

import asyncio
import dis
import gc
import logging
import math
import os
import re

import aiortc.rtcsctptransport as sctp
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.stats import RTCTransportStats

from swarm.errors import LocalProtocolError
from swarm.peer.net import rtc
from swarm.keys.identity import Identity
from tests.peer._links import run_in_netns


async def test_set_certificate_makes_the_connection_offer_our_certificate() -> None:
    ident = Identity.generate()
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        rtc.set_certificate(pc, ident.rtc_certificate())
        pc.createDataChannel("swarm")
        offer = await pc.createOffer()
        sdp_fps = re.findall(r"a=fingerprint:sha-256 (\S+)", offer.sdp)
        assert sdp_fps and all(f"sha-256 {v}" == ident.fingerprint for v in sdp_fps)
    finally:
        await pc.close()


def test_set_certificate_refuses_an_object_without_the_hook() -> None:
    with pytest.raises(LocalProtocolError, match="_RTCPeerConnection__certificates"):
        rtc.set_certificate(object(), Identity.generate().rtc_certificate())


def test_the_sctp_rto_minimum_is_the_global_aiortc_reads_and_is_lowered() -> None:
    read_by_transport = {
        name
        for f in vars(sctp.RTCSctpTransport).values()
        if hasattr(f, "__code__")
        for name in f.__code__.co_names
    }
    assert "SCTP_RTO_MIN" in read_by_transport, "aiortc's SCTP transport no longer reads SCTP_RTO_MIN"
    rtc.configure_aiortc()
    assert sctp.SCTP_RTO_MIN == rtc.SCTP_RTO_MIN_S


def _sent(pc: RTCPeerConnection) -> int:
    """DTLS datagrams ``pc`` has sent (its DTLS transport's stats: getStats() lists only media's)."""
    stats = [s for s in pc.sctp.transport._get_stats().values() if isinstance(s, RTCTransportStats)]
    assert len(stats) == 1, stats
    return stats[0].packetsSent


async def _connected_pair(a_id: Identity, b_id: Identity):
    """Two raw aiortc connections with our certificates and one open negotiated channel each."""
    pcs = []
    for ident in (a_id, b_id):
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        rtc.set_certificate(pc, ident.rtc_certificate())
        pcs.append(pc)
    a, b = pcs
    opened = asyncio.Event()
    ca = a.createDataChannel("x", negotiated=True, id=0)
    ca.on("open", opened.set)
    cb = b.createDataChannel("x", negotiated=True, id=0)
    await a.setLocalDescription(await a.createOffer())
    await b.setRemoteDescription(RTCSessionDescription(a.localDescription.sdp, "offer"))
    await b.setLocalDescription(await b.createAnswer())
    await a.setRemoteDescription(RTCSessionDescription(b.localDescription.sdp, "answer"))
    await asyncio.wait_for(opened.wait(), 10)
    return a, b, ca, cb


def test_remote_certificate_is_the_one_the_other_side_presented() -> None:
    """Two raw aiortc connections with our certificates: each reads the other's after DTLS."""
    a_id, b_id = Identity.generate(), Identity.generate()

    async def main():
        with pytest.raises(LocalProtocolError, match="no data channel"):
            rtc.remote_certificate(RTCPeerConnection(RTCConfiguration(iceServers=[])))
        a, b, _, _ = await _connected_pair(a_id, b_id)
        certs = rtc.remote_certificate(a), rtc.remote_certificate(b)
        await a.close()
        await b.close()
        return certs

    of_b, of_a = run_in_netns(main)
    assert (of_a, of_b) == (a_id.certificate, b_id.certificate)


def test_the_sctp_names_the_tuning_replaces_are_the_ones_aiortc_uses() -> None:
    """aiortc fragments by the module's USERDATA_MAX_LENGTH, sends through _transmit and
    acknowledges through _send_sack; configure_aiortc replaces exactly those, once."""
    reads = {
        name: set(f.__code__.co_names)
        for name, f in vars(sctp.RTCSctpTransport).items()
        if hasattr(f, "__code__")
    }
    assert "USERDATA_MAX_LENGTH" in reads["_send"], "aiortc no longer fragments by USERDATA_MAX_LENGTH"
    assert "_transmit" in reads["_send"] and "_send_sack" in reads["_handle_data"]
    read_by_aiortc = set().union(*reads.values())
    assert not set(rtc.SCTP_STATE_READ) - read_by_aiortc, set(rtc.SCTP_STATE_READ) - read_by_aiortc
    rtc.configure_aiortc()
    transmit, send_sack = sctp.RTCSctpTransport._transmit, sctp.RTCSctpTransport._send_sack
    rtc.configure_aiortc()
    assert (sctp.RTCSctpTransport._transmit, sctp.RTCSctpTransport._send_sack) == (transmit, send_sack)
    assert sctp.USERDATA_MAX_LENGTH == rtc.SCTP_USERDATA_MAX_LENGTH
    assert rtc.SCTP_MAX_PACKET_LENGTH + rtc.DTLS_OVERHEAD_MAX <= 1500 - 40 - 8  # IPv6 + UDP headers


def test_rows_travel_in_fewer_packets_and_every_packet_is_acknowledged() -> None:
    """Echo a 4-row request (4 × 576 float32 and a frame header) over real DTLS/SCTP and count the
    DTLS datagrams each side sends: the data in 1356-byte chunks, a SACK for every
    SACK_EVERY_PACKETS-th one (counted across messages) or after SACK_DELAY_S. aiortc's own
    settings send 9 data packets and 9 SACKs each way per message."""
    rtc.configure_aiortc()
    message = os.urandom(4 * 576 * 4 + 128)
    rounds = 20

    async def main():
        a, b, ca, cb = await _connected_pair(Identity.generate(), Identity.generate())
        cb.on("message", cb.send)
        replies: asyncio.Queue[bytes] = asyncio.Queue()
        ca.on("message", replies.put_nowait)
        for _ in range(3):  # open the congestion window
            ca.send(message)
            await replies.get()
        await asyncio.sleep(5 * rtc.SACK_DELAY_S)
        before = [_sent(pc) for pc in (a, b)]
        for _ in range(rounds):
            ca.send(message)
            assert await asyncio.wait_for(replies.get(), 10) == message
        await asyncio.sleep(5 * rtc.SACK_DELAY_S)
        mid = [_sent(pc) for pc in (a, b)]
        ca.send(b"x")  # one lone packet each way: each is acknowledged after SACK_DELAY_S
        assert await asyncio.wait_for(replies.get(), 10) == b"x"
        await asyncio.sleep(20 * rtc.SACK_DELAY_S)
        after = [_sent(pc) for pc in (a, b)]
        await a.close()
        await b.close()
        return [m - s for m, s in zip(mid, before)], [e - m for e, m in zip(after, mid)]

    per_message, lone = run_in_netns(main)
    data = math.ceil(len(message) / rtc.SCTP_USERDATA_MAX_LENGTH)
    least = rounds * data + rounds * data // rtc.SACK_EVERY_PACKETS  # SACKs for packets of several messages
    most = rounds * (data + math.ceil(data / rtc.SACK_EVERY_PACKETS))  # or one per message at least
    # A stall longer than SACK_DELAY_S while a message arrives (a loaded machine) adds a SACK,
    # a rare retransmission a packet: 25 % room. A SACK every second packet would add 37 %,
    # aiortc's defaults ~130 %.
    assert all(least <= n <= most * 1.25 for n in per_message), (per_message, least, most)
    assert lone == [2, 2], lone  # its data packet and the delayed SACK of the other's


def test_the_jumbo_copies_cover_every_method_that_reads_the_packet_size() -> None:
    """send_jumbo_packets gives an association copies of exactly the methods whose code reads
    USERDATA_MAX_LENGTH; a method an upgrade adds that reads it would keep the MTU size."""
    rtc.configure_aiortc()
    reads = {name for name, f in vars(sctp.RTCSctpTransport).items()
             if "USERDATA_MAX_LENGTH" in getattr(getattr(f, "original", f), "__code__", compile("", "", "exec")).co_names}
    assert reads - {"__init__"} == set(rtc.JUMBO_METHODS)
    copies = rtc._jumbo_methods(rtc.SCTP_JUMBO_USERDATA_MAX_LENGTH)
    for name, fn in copies.items():
        assert fn.__globals__["USERDATA_MAX_LENGTH"] == rtc.SCTP_JUMBO_USERDATA_MAX_LENGTH
        assert fn.__globals__["SCTP_RTO_MIN"] == rtc.SCTP_RTO_MIN_S  # the rest of the tuning holds
    assert sctp.USERDATA_MAX_LENGTH == rtc.SCTP_USERDATA_MAX_LENGTH  # other associations keep theirs


@pytest.mark.parametrize("value", ["0", "1199", "16385", "x", "1e4", "-1500"])
def test_a_bad_jumbo_attribute_is_refused_naming_it(value) -> None:
    sdp = f"v=0\r\nm=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\na={rtc.SDP_PACKET_ATTRIBUTE}:{value}\r\n"
    with pytest.raises(ValueError, match=rtc.SDP_PACKET_ATTRIBUTE):
        rtc.jumbo_packet_length(sdp)
    twice = rtc.advertise_jumbo_packets(rtc.advertise_jumbo_packets("v=0\r\na=sctp-port:5000\r\n"))
    with pytest.raises(ValueError, match="once"):
        rtc.jumbo_packet_length(twice)
    assert rtc.jumbo_packet_length("v=0\r\na=sctp-port:5000\r\n") is None
    assert rtc.jumbo_packet_length(rtc.advertise_jumbo_packets("v=0\r\na=sctp-port:5000\r\n")) == 16384


def test_a_jumbo_probe_comes_back_at_its_size_and_other_echoes_still_reach_aiortc() -> None:
    """path_carries relies on aiortc's SCTP answering a HEARTBEAT with a HEARTBEAT ACK of the same
    parameters (RFC 9260 §8.3), sent in one packet of the probe's size: on a clean path the
    probe comes back, and the association's own _receive_chunk is in place again after. A remote
    that never echoes gets ``probes`` tries and a False; meanwhile a HEARTBEAT ACK that is not
    the probe's goes on to the handler that was there before."""
    rtc.configure_aiortc()

    async def main():
        a, b, _, _ = await _connected_pair(Identity.generate(), Identity.generate())
        for pc in (a, b):
            rtc.accept_jumbo_records(pc)
        sent: list[int] = []
        send_data = a.sctp.transport._send_data

        async def counting(data: bytes) -> None:  # the SCTP packets a's association sends
            sent.append(len(data))
            await send_data(data)

        a.sctp.transport._send_data = counting
        echoed: list[int] = []
        b_send_data = b.sctp.transport._send_data

        async def b_counting(data: bytes) -> None:
            echoed.append(len(data))
            await b_send_data(data)

        b.sctp.transport._send_data = b_counting
        carried = await rtc.path_carries(a, rtc.SCTP_JUMBO_PACKET_LENGTH)
        b.sctp.transport._send_data = b_send_data
        first = list(sent)
        restored = "_receive_chunk" not in vars(a.sctp)

        b_receive, seen = b.sctp._receive_chunk, []

        async def deaf(chunk):  # b: a remote whose echoes never arrive
            if not isinstance(chunk, sctp.HeartbeatChunk):
                await b_receive(chunk)

        async def spy(chunk):
            seen.append(type(chunk).__name__)
            await own(chunk)

        b.sctp._receive_chunk = deaf
        own = a.sctp._receive_chunk
        a.sctp._receive_chunk = spy
        sent.clear()
        probing = asyncio.ensure_future(rtc.path_carries(a, 2000, probes=2, timeout_s=0.2))
        await asyncio.sleep(0.05)
        await b.sctp._send_chunk(sctp.HeartbeatAckChunk())  # an echo the probe did not ask for
        unanswered = await probing
        kept = vars(a.sctp).get("_receive_chunk") is spy
        a.sctp.transport._send_data = send_data
        await a.close()
        await b.close()
        return carried, first, echoed, restored, unanswered, list(sent), seen, kept

    carried, first, echoed, restored, unanswered, sent, seen, kept = run_in_netns(main)
    assert carried and first == [rtc.SCTP_JUMBO_PACKET_LENGTH] and echoed == first, (first, echoed)
    assert restored
    assert unanswered is False and sent.count(2000) == 2, sent
    assert seen.count("HeartbeatAckChunk") == 1 and kept, seen


def test_closing_a_link_under_traffic_leaves_no_unretrieved_task_error() -> None:
    """Both sides stream to each other and one closes mid-stream: aiortc's own send tasks (channel
    flushes, timer expiries, delayed SACKs) then meet a shut DTLS session. Each such packet is
    dropped quietly: asyncio reports no "Task exception was never retrieved"."""
    rtc.configure_aiortc()
    a_id, b_id = Identity.generate(), Identity.generate()

    async def main():
        loop = asyncio.get_running_loop()
        reported = []
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        for _ in range(3):  # a link closed, then replaced by a fresh one, three times
            a, b, ca, cb = await _connected_pair(a_id, b_id)
            for _ in range(40):
                ca.send(bytes(20_000))
                cb.send(bytes(20_000))
            await asyncio.sleep(0.005)
            a.sctp.transport._ssl.shutdown()  # the session ends under the traffic, as when a link is replaced
            await asyncio.sleep(0.3)
            await a.close()
            await b.close()
        await asyncio.sleep(0.5)
        gc.collect()  # an unretrieved task error is reported when its task is collected
        await asyncio.sleep(0.05)
        return [(c.get("message"), repr(c.get("exception"))) for c in reported]

    # Earlier tests' links, from their closed loops, are collected here, not inside this test's loop
    # (a finalizer that schedules a task there would report that loop closed, not this test's fault).
    gc.collect()
    assert run_in_netns(main) == []


def test_every_aiortc_internal_the_module_touches_is_listed_and_exists() -> None:
    """Each private aiortc name swarm/peer/net/rtc.py reads, replaces or copies is in one of its
    lists, and the installed aiortc has each: an upgrade that drops one fails here, naming it."""
    code = open(rtc.__file__, encoding="utf-8").read().split('"""', 2)[2]  # past the module docstring
    touched = set(re.findall(r"\b(?:_sctp|RTCSctpTransport|sctp|self)\.(_[a-z]\w*)", code))
    touched |= set(re.findall(r'"(_[a-z]\w*)"', code))
    ours = {name for name in touched if name.startswith("_colibri")}
    elsewhere = {"_ssl"}  # RTCDtlsTransport's, checked by remote_certificate and accept_jumbo_records
    listed = set(rtc.SCTP_METHODS_USED) | set(rtc.SCTP_STATE_READ)
    assert touched - ours - elsewhere - listed == set()
    globals_read = set(re.findall(r"\b_sctp\.([A-Z]\w*)", code)) - {"RTCSctpTransport"}
    assert globals_read <= set(rtc.SCTP_GLOBALS_USED), globals_read - set(rtc.SCTP_GLOBALS_USED)
    assert [name for name in rtc.SCTP_GLOBALS_USED if not hasattr(sctp, name)] == []
    assert [name for name in rtc.SCTP_METHODS_USED if not hasattr(sctp.RTCSctpTransport, name)] == []
    rtc.configure_aiortc()
    assert all(getattr(getattr(sctp.RTCSctpTransport, name), rtc._PATCHED, False) for name in rtc.SCTP_METHODS_WRAPPED)


def test_the_eager_send_is_aiortcs_method_with_only_its_flush_started_at_once() -> None:
    """flush_eagerly runs aiortc's own _data_channel_send with another ``asyncio`` global: that
    is right only while the method's one use of asyncio is ``ensure_future`` of the flush."""
    fn = sctp.RTCSctpTransport._data_channel_send
    ins = list(dis.get_instructions(fn))
    asyncio_uses = [after.argval for load, after in zip(ins, ins[1:])
                    if load.opname == "LOAD_GLOBAL" and load.argval == "asyncio"]
    assert asyncio_uses == ["ensure_future"], asyncio_uses
    assert "_data_channel_flush" in fn.__code__.co_names and fn.__closure__ is None
    copy = rtc._eager_send_method()
    assert copy.__code__ is fn.__code__
    changed = {k for k, v in copy.__globals__.items() if vars(sctp).get(k, object()) is not v}
    assert changed == {"asyncio"}, changed


def test_flush_eagerly_refuses_an_aiortc_that_flushes_otherwise(monkeypatch) -> None:
    def send_without_a_task(self, channel, data) -> None:
        self._data_channel_queue.append((channel, 51, data))

    monkeypatch.setattr(sctp.RTCSctpTransport, "_data_channel_send", send_without_a_task)
    with pytest.raises(LocalProtocolError, match="_data_channel_send"):
        rtc.flush_eagerly(RTCPeerConnection(RTCConfiguration(iceServers=[])))


def test_a_flush_that_fails_is_logged_and_not_raised(caplog) -> None:
    async def failing() -> None:
        raise ConnectionError("Cannot send encrypted data, not connected")

    with caplog.at_level(logging.INFO, logger=rtc.__name__):
        assert rtc._EagerAsyncio.ensure_future(failing()) is None
    assert "an SCTP flush failed" in caplog.text


def test_with_flush_eagerly_a_message_leaves_within_send_and_messages_keep_their_order() -> None:
    """aiortc leaves a message queued until its flush task runs; after flush_eagerly the message
    is handed to the SCTP association (and its packets sent) before ``send`` returns."""
    rtc.configure_aiortc()

    async def main():
        a, b, ca, cb = await _connected_pair(Identity.generate(), Identity.generate())
        got: asyncio.Queue[bytes] = asyncio.Queue()
        cb.on("message", got.put_nowait)
        ca.send(b"lazy")
        queued_lazily = len(a.sctp._data_channel_queue)
        assert await asyncio.wait_for(got.get(), 10) == b"lazy"
        rtc.flush_eagerly(a)
        before = _sent(a)
        messages = [bytes([i]) * 1000 for i in range(3)]  # one packet each, within the window
        left = []
        for message in messages:
            ca.send(message)
            left.append(len(a.sctp._data_channel_queue))
        sent_within = _sent(a) - before
        received = [await asyncio.wait_for(got.get(), 10) for _ in messages]
        await a.close()
        await b.close()
        return queued_lazily, left, sent_within, received == messages

    queued_lazily, left, sent_within, in_order = run_in_netns(main)
    assert queued_lazily == 1 and left == [0] * 3 and sent_within > 0 and in_order, (queued_lazily, left, sent_within)
