"""Links between two aiortc peer connections in one process, over real UDP and DTLS.

Each test runs its event loop inside a fresh network namespace (tests/peer/_links.py: aioice
skips 127.0.0.1, the namespace's loopback carries another address).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import os
import subprocess
import time

import pytest
from aiortc.rtcdtlstransport import RTCCertificate

from swarm.errors import AuthenticationError, PeerLostError, RemoteProtocolError, VersionMismatchError
from swarm.peer.net import rtc, wire
from swarm.keys.identity import Identity
from swarm.peer.net.link import Link, LinkState, new_peer_connection
from swarm.peer.net.messages import Error, WeightChunk
from swarm.keys.swarmkey import SwarmKey
from tests.peer._links import DROP_IP_FRAGMENTS, VERSION, blob, hello, run_in_netns

KEY = SwarmKey(bytes(range(32)))
ID_A, ID_B = Identity.generate(), Identity.generate()
PEER_A, PEER_B = ID_A.peer_id, ID_B.peer_id


def make_link(cert, peer_id, *, offerer, key=KEY, expected=None, version=VERSION, kind="python", **kw):
    pc, channel = new_peer_connection(cert)
    local_hello = dataclasses.replace(hello(peer_id, version), peer_kind=kind)
    return Link(pc, channel, certificate=cert, auth_key=key.channel_auth_key, local_hello=local_hello,
                offerer=offerer, expected_peer_id=expected, **kw)


async def connect(a: Link, b: Link, rewrite_offer=lambda sdp: sdp, rewrite_answer=lambda sdp: sdp):
    """Exchange SDP between two links as a relay would (optionally rewriting it); wait for both."""
    answer = await b.accept_offer(rewrite_offer(await a.create_offer()))
    await a.accept_answer(rewrite_answer(answer))
    return await asyncio.gather(a.established(), b.established(), return_exceptions=True)


def pair(**kw):
    a = make_link(ID_A.rtc_certificate(), PEER_A, offerer=True, expected=PEER_B, **kw.get("a", {}))
    b = make_link(ID_B.rtc_certificate(), PEER_B, offerer=False, expected=PEER_A, **kw.get("b", {}))
    return a, b


SIZES = [1, 65535, 65536, 65537, 262143, 262144, 262145, 8 << 20]


def test_messages_of_every_size_arrive_intact_both_ways():
    async def main():
        a, b = pair()
        hello_b, hello_a = await connect(a, b)
        assert (hello_b.peer_id, hello_a.peer_id) == (PEER_B, PEER_A)
        assert (a.peer_id, b.peer_id) == (PEER_B, PEER_A)
        assert a.remote_max_message_size == 262144  # aiortc advertises 256 KiB to aiortc
        received = []
        for sender, receiver in ((a, b), (b, a)):
            for size in SIZES:
                data = os.urandom(size)
                await sender.send(blob(data))
                got = await receiver.receive()
                got.verify()
                received.append((hashlib.sha256(got.data).digest(), hashlib.sha256(data).digest()))
        await a.close()
        await b.close()
        return received

    for got, sent in run_in_netns(main):
        assert got == sent


def test_backpressure_bounds_what_aiortc_buffers_and_order_is_kept():
    from swarm.peer.net import link as link_mod

    async def main():
        a, b = pair()
        await connect(a, b)
        peak = 0
        send = a.channel.send

        def spy(data):
            nonlocal peak
            send(data)
            peak = max(peak, a.channel.bufferedAmount)

        a.channel.send = spy
        blobs = [os.urandom(3 << 20) for _ in range(3)]
        await asyncio.gather(*(a.send(blob(x)) for x in blobs))
        got = [(await b.receive()).data.tobytes() for _ in blobs]
        await a.close()
        await b.close()
        return peak, got == blobs

    peak, in_order = run_in_netns(main)
    assert in_order
    assert 0 < peak <= link_mod.SEND_HIGH_WATER + 262144


def test_handlers_by_type_and_heartbeat_rtt():
    async def main():
        a, b = pair(a=dict(heartbeat_s=0.05), b=dict(heartbeat_s=0.05))
        await connect(a, b)
        seen = asyncio.Queue()

        async def on_blob(link, message):
            await seen.put((link.peer_id, message.data.tobytes()))

        b.on(WeightChunk, on_blob)
        sent_at = time.monotonic()
        await a.send(blob(b"hi"))
        got = await asyncio.wait_for(seen.get(), 5)
        heard_after_send = b.last_heard - sent_at
        await asyncio.sleep(0.5)
        rtts = (a.rtt_s, b.rtt_s)
        await a.close()
        await b.close()
        return got, rtts, heard_after_send

    got, rtts, heard_after_send = run_in_netns(main)
    assert got == (PEER_A, b"hi")
    assert heard_after_send >= 0  # last_heard moved with the message
    assert all(r is not None and 0 < r < 0.5 for r in rtts), rtts


def test_messages_that_come_before_their_handler_are_held_for_it():
    """A peer's links open while it is still starting its roles: a plan and a request that come
    first must reach the handler registered later, in order (they were once dropped, and the
    coordinator waited 30 s for an answer that could never come)."""
    async def main():
        a, b = pair()
        await connect(a, b)
        for data in (b"plan", b"request"):
            await a.send(blob(data))
        await a.send(Error(0, "model", "not held for WeightChunk's handler"))
        deadline = time.monotonic() + 5
        while b._inbox.qsize() < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        seen = []
        b.on(WeightChunk, lambda link, message: seen.append(message.data.tobytes()))
        other = await asyncio.wait_for(b.receive(), 1)  # an unclaimed type stays for receive()
        await a.close()
        await b.close()
        return seen, other

    seen, other = run_in_netns(main)
    assert seen == [b"plan", b"request"]
    assert isinstance(other, Error) and other.code == "model"


def test_unclaimed_messages_are_held_up_to_a_bound_the_newest_kept():
    """A type no handler claims must not pile up for the life of the link: at most HELD_MAX
    messages are held, the oldest dropped first, and a handler registered later gets the rest."""
    from swarm.peer.net.link import HELD_MAX

    n = HELD_MAX + 5

    async def main():
        a, b = pair()
        await connect(a, b)
        for i in range(n):
            await a.send(blob(b"%d" % i))
        await a.send(Error(0, "model", "the last one"))  # the order check: everything before it arrived
        deadline = time.monotonic() + 5
        while not any(isinstance(m, Error) for m in list(b._inbox._queue)) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        held = b._inbox.qsize()
        seen = []
        b.on(WeightChunk, lambda link, message: seen.append(message.data.tobytes()))
        await a.close()
        await b.close()
        return held, seen

    held, seen = run_in_netns(main)
    assert held == HELD_MAX
    assert seen == [b"%d" % i for i in range(n - HELD_MAX + 1, n)]  # the Error took one place


def test_silent_peer_is_declared_dead():
    async def main():
        a, b = pair(a=dict(heartbeat_s=0.05, dead_after_s=0.5))
        await connect(a, b)
        # b goes mute: it stops reading and sending, but its transport stays up
        for t in list(b._tasks):
            t.cancel()
        b.channel.remove_all_listeners("message")
        await asyncio.wait_for(a.wait_closed(), 5)
        reason = a.close_reason
        try:
            await a.send(blob(b"x"))
        except PeerLostError as exc:
            lost = str(exc)
        await b.close()
        await a.close()
        return reason, lost

    reason, lost = run_in_netns(main)
    assert "nothing heard" in reason
    assert "not open" in lost


def test_wrong_swarm_key_is_refused_by_channel_auth(caplog):
    caplog.set_level(logging.WARNING, logger="swarm.peer.net.link")

    async def main():
        a, b = pair(b=dict(key=SwarmKey(bytes(32))))
        results = await connect(a, b)
        states = (a.state, b.state)
        await a.close()
        await b.close()
        return results, states

    results, states = run_in_netns(main)
    assert all(isinstance(r, AuthenticationError) for r in results), results
    assert states == (LinkState.CLOSED, LinkState.CLOSED)
    assert "swarm key check" in caplog.text


def test_other_protocol_version_is_refused_naming_both():
    async def main():
        a, b = pair(b=dict(version=VERSION + 1))
        results = await connect(a, b)
        await a.close()
        await b.close()
        return results

    res_a, _ = run_in_netns(main)
    assert isinstance(res_a, VersionMismatchError)
    assert f"version {VERSION + 1}" in str(res_a) and f"we speak {VERSION}" in str(res_a)


def test_the_refused_side_is_told_why_with_an_error_frame():
    """b does not check versions itself (as an older peer might not): a's Error frame tells it."""

    async def main():
        a, b = pair(b=dict(version=VERSION + 1))
        b._check_hello = lambda hello: None
        res_a, _ = await connect(a, b)
        await asyncio.wait_for(b.wait_closed(), 5)
        await a.close()
        await b.close()
        return res_a, b.close_reason

    res_a, reason_b = run_in_netns(main)
    assert isinstance(res_a, VersionMismatchError)
    assert "refused the link (version)" in reason_b and f"we speak {VERSION}" in reason_b


def _rewrite_fingerprints(sdp: str, cert: RTCCertificate) -> str:
    lines = [ln for ln in sdp.splitlines() if not ln.startswith("a=fingerprint:")]
    at = next(i for i, ln in enumerate(lines) if ln.startswith("a=setup:"))
    fps = [f"a=fingerprint:{fp.algorithm} {fp.value}" for fp in cert.getFingerprints()]
    return "\r\n".join(lines[:at] + fps + lines[at:]) + "\r\n"


def test_relay_rewriting_fingerprint_opens_no_channel_and_is_logged(caplog):
    """The relay swaps a=fingerprint but cannot present that certificate: aiortc's DTLS check fails."""
    caplog.set_level(logging.WARNING, logger="swarm.peer.net.link")
    relay_cert = RTCCertificate.generateCertificate()

    async def main():
        a, b = pair(a=dict(handshake_timeout_s=5), b=dict(handshake_timeout_s=5))
        results = await connect(a, b, rewrite_offer=lambda s: _rewrite_fingerprints(s, relay_cert))
        opened = (a.channel.readyState, b.channel.readyState, a.peer_id, b.peer_id)
        await a.close()
        await b.close()
        return results, opened

    results, opened = run_in_netns(main)
    assert all(isinstance(r, (AuthenticationError, PeerLostError)) for r in results), results
    assert opened[2:] == (None, None)  # no side ever authenticated anyone
    assert "closed in state connecting" in caplog.text and "a=fingerprint" in caplog.text


def test_relay_in_the_middle_with_its_own_certificate_fails_channel_auth(caplog):
    """A relay that rewrites a=fingerprint AND terminates DTLS itself, forwarding the channel
    bytes both ways: DTLS succeeds on each side, but the transcripts name different
    fingerprints, so neither HMAC verifies and no link opens."""
    caplog.set_level(logging.WARNING, logger="swarm.peer.net.link")

    async def main():
        a, b = pair()
        from aiortc import RTCSessionDescription

        relay_a, chan_ra = new_peer_connection(RTCCertificate.generateCertificate())  # faces a
        relay_b, chan_rb = new_peer_connection(RTCCertificate.generateCertificate())  # faces b
        opened = []
        pending = {id(chan_ra): [], id(chan_rb): []}

        def forward(src, dst):
            def on_message(m):
                pending[id(dst)].append(m)
                if dst.readyState == "open":
                    for x in pending[id(dst)]:
                        dst.send(x)
                    pending[id(dst)].clear()

            def on_open():
                opened.append(src)
                for x in pending[id(src)]:
                    src.send(x)
                pending[id(src)].clear()

            src.on("message", on_message)
            src.on("open", on_open)

        forward(chan_ra, chan_rb)
        forward(chan_rb, chan_ra)
        # a offers to the relay; the relay offers to b; answers go back likewise
        await relay_a.setRemoteDescription(RTCSessionDescription(await a.create_offer(), "offer"))
        await relay_a.setLocalDescription(await relay_a.createAnswer())
        await relay_b.setLocalDescription(await relay_b.createOffer())
        answer_b = await b.accept_offer(relay_b.localDescription.sdp)
        await relay_b.setRemoteDescription(RTCSessionDescription(answer_b, "answer"))
        await a.accept_answer(relay_a.localDescription.sdp)
        results = await asyncio.gather(a.established(), b.established(), return_exceptions=True)
        channel_states = len(opened)
        for x in (a, b):
            await x.close()
        await relay_a.close()
        await relay_b.close()
        return results, channel_states

    results, channel_states = run_in_netns(main)
    assert channel_states == 2  # DTLS with the relay succeeded on both sides
    assert all(isinstance(r, AuthenticationError) for r in results), results
    assert "DTLS fingerprint check" in caplog.text


@pytest.mark.parametrize("first", ["heartbeat", "fragment"])
def test_nothing_but_the_handshake_is_accepted_before_authentication(first):
    """A stranger's peer connection (no swarm key) that sends anything else first is refused:
    a frame of another kind, or the first fragment of a large message (never buffered)."""
    from swarm.peer.net import messages
    from swarm.peer.net.messages import LinkHeartbeat

    payload = {
        "heartbeat": messages.encode(LinkHeartbeat(seq=1, sent_s=0.0)),
        "fragment": wire.Fragmenter(65536).split(bytes(wire.HEADER_BYTES) + bytes(200_000))[0],
    }[first]

    async def main():
        a, unused = pair()
        await unused.close()
        stranger, channel = new_peer_connection(RTCCertificate.generateCertificate())
        channel.on("open", lambda: channel.send(payload))
        from aiortc import RTCSessionDescription

        await stranger.setRemoteDescription(RTCSessionDescription(await a.create_offer(), "offer"))
        await stranger.setLocalDescription(await stranger.createAnswer())
        await a.accept_answer(stranger.localDescription.sdp)
        result = (await asyncio.gather(a.established(), return_exceptions=True))[0]
        state, peer = a.state, a.peer_id
        await a.close()
        await stranger.close()
        return result, state, peer

    result, state, peer = run_in_netns(main)
    assert isinstance(result, AuthenticationError), result
    assert ("LinkHeartbeat" if first == "heartbeat" else "handshake frames are at most") in str(result)
    assert state is LinkState.CLOSED and peer is None


def test_malformed_frame_on_an_open_link_closes_it_and_a_buggy_handler_does_not(caplog):
    caplog.set_level(logging.INFO, logger="swarm.peer.net.link")

    async def main():
        a, b = pair()
        await connect(a, b)

        def buggy(link, message):
            raise ZeroDivisionError("handler bug")

        b.on(WeightChunk, buggy)
        await a.send(blob(b"first"))
        await asyncio.sleep(0.3)
        open_after_bug = b.is_open
        a.channel.send(b"CLSW" + bytes(20))  # a frame header with a wrong version and lengths
        await asyncio.wait_for(b.wait_closed(), 5)
        reason = b.close_reason
        await a.close()
        await b.close()
        return open_after_bug, reason

    open_after_bug, reason = run_in_netns(main)
    assert open_after_bug
    assert "handler bug" in caplog.text
    assert "protocol version 0" in reason, reason


def test_a_lost_packet_is_resent_after_the_lowered_sctp_rto_not_after_a_second():
    """Loss emulated in-process (no netem here): drop the one SCTP packet carrying a small message.

    With no later packet, no duplicate SACKs come back, so only the retransmission timer brings
    it back: stock aiortc waits SCTP_RTO_MIN = 1 s; the link lowers it to rtc.SCTP_RTO_MIN_S.
    """
    async def main():
        a, b = pair(a=dict(heartbeat_s=30), b=dict(heartbeat_s=30))
        await connect(a, b)
        for _ in range(20):  # RTT samples for SCTP's RTO estimate
            await a.send(blob(b"warm-up"))
            await b.receive()
        await asyncio.sleep(0.3)  # let SACKs settle: the next packet a sends is the message below
        dtls = a.pc.sctp.transport
        send_data, dropped = dtls._send_data, []

        async def lossy(data: bytes) -> None:
            if not dropped and data[12] == 0:  # SCTP chunk type 0: DATA
                dropped.append(len(data))
                return
            await send_data(data)

        dtls._send_data = lossy
        t = time.perf_counter()
        await a.send(blob(b"x" * 100))
        await b.receive()
        took = time.perf_counter() - t
        await a.close()
        await b.close()
        return took, dropped

    took, dropped = run_in_netns(main)
    assert len(dropped) == 1
    assert rtc.SCTP_RTO_MIN_S <= took < 0.8, took


def test_a_python_peer_claiming_another_peers_id_gets_no_channel(caplog):
    """A member (it holds the swarm key, so channel authentication passes) presents its own DTLS
    certificate but claims another peer's id in AuthHello and Hello: the certificate's key hashes
    to another id, so the honest side refuses the link and logs both ids."""
    caplog.set_level(logging.WARNING, logger="swarm.peer.net.link")
    impostor = Identity.generate()

    async def main():
        a = make_link(ID_A.rtc_certificate(), PEER_A, offerer=True, expected=PEER_B)
        b = make_link(impostor.rtc_certificate(), PEER_B, offerer=False, expected=PEER_A)
        res_a, _ = await connect(a, b)
        await a.close()
        await b.close()
        return res_a, a.hello

    res_a, hello_a = run_in_netns(main)
    assert isinstance(res_a, AuthenticationError), res_a
    assert hello_a is None  # the link never opened
    expected = f"peer {PEER_B} presented the DTLS certificate of peer {impostor.peer_id}"
    assert expected in str(res_a) and expected in caplog.text


def test_the_peer_kind_must_match_signaling_and_only_browsers_go_uncertified():
    """A Python peer announced by signaling cannot call itself a browser in its Hello (to dodge the
    certificate check); a browser's id is not its certificate's hash and is accepted as such."""
    browser = Identity.generate()  # its peer id stands for the page's WebCrypto key, not this certificate

    async def main():
        results = []
        for announced in ("python", "browser"):
            a = make_link(ID_A.rtc_certificate(), PEER_A, offerer=False, expected=PEER_B, remote_kind=announced)
            b = make_link(browser.rtc_certificate(), PEER_B, offerer=True, expected=PEER_A, kind="browser")
            results.append(await connect(b, a))
            await a.close()
            await b.close()
        return results

    (_, as_python), (_, as_browser) = run_in_netns(main)
    assert isinstance(as_python, AuthenticationError), as_python
    assert f"peer {PEER_B} joined signaling as a python peer but its Hello says browser" in str(as_python)
    assert as_browser.peer_id == PEER_B and as_browser.peer_kind == "browser"


def test_a_cancelled_close_leaves_the_peer_connection_closing_and_a_second_close_waits_for_it():
    """An owner cancelled while closing a link (the mesh cancels its tasks when it closes) must not
    cut aiortc's close short: its ICE tasks would be left pending (the suite's leak fixture fails
    the test then). The second close() waits for the first one's peer connection close."""

    async def main():
        a, b = pair()
        await connect(a, b)
        closing = asyncio.ensure_future(a.close())
        for _ in range(5):  # close() is now waiting for the peer connection to close
            await asyncio.sleep(0)
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        released_early = a.released
        await a.close()
        await b.close()
        return released_early, a.released, b.released

    assert run_in_netns(main) == (False, True, True)


def _datagrams(link: Link) -> int:
    """DTLS datagrams the link's peer connection has sent."""
    stats = [s for s in link.pc.sctp.transport._get_stats().values() if type(s).__name__ == "RTCTransportStats"]
    return stats[0].packetsSent


def _without_jumbo(sdp: str) -> str:
    """The SDP as a browser (or a peer before jumbo packets) writes it."""
    return "\r\n".join(line for line in sdp.split("\r\n") if rtc.SDP_PACKET_ATTRIBUTE not in line)


@pytest.mark.parametrize("browser_side", [None, "offer", "answer"])
def test_python_links_send_a_four_row_message_in_one_packet_and_others_keep_the_mtu(browser_side):
    """Between Python peers a 4 x 576-float32 request is one jumbo datagram (IP fragments on the
    wire). A side whose remote SDP lacks the attribute (a browser's, which reads at most an MTU
    of a record) keeps packets that fit a 1500-byte MTU; messages of every size arrive intact."""
    message = os.urandom(4 * 576 * 4 + 200)
    strip = {"offer": {"rewrite_offer": _without_jumbo}, "answer": {"rewrite_answer": _without_jumbo}}

    async def main():
        a, b = pair()
        await connect(a, b, **strip.get(browser_side, {}))
        await asyncio.gather(a.packets_settled(), b.packets_settled())  # jumbo packets probed
        # the side that read the stripped SDP sends
        sender, receiver = (b, a) if browser_side == "offer" else (a, b)
        counts = []
        for _ in range(4):  # after the first, the congestion window is open
            await asyncio.sleep(5 * rtc.SACK_DELAY_S)  # no SACK left pending
            before = _datagrams(sender)
            await sender.send(blob(message))
            got = await receiver.receive()
            got.verify()
            counts.append(_datagrams(sender) - before)
        for size in (1, 20000, 300000):
            for one, other in ((a, b), (b, a)):
                data = os.urandom(size)
                await one.send(blob(data))
                got = await other.receive()
                got.verify()
                assert bytes(got.data) == data
        length = sender.sctp_packet_length
        await a.close()
        await b.close()
        return counts, length

    counts, length = run_in_netns(main)
    # the fewest of three sends: a heartbeat (one a second) may share one window
    if browser_side is None:
        assert length == rtc.SCTP_JUMBO_PACKET_LENGTH
        assert min(counts[1:]) == 1, counts
    else:
        assert length == rtc.SCTP_MAX_PACKET_LENGTH
        assert min(counts[1:]) >= math.ceil(len(message) / rtc.SCTP_USERDATA_MAX_LENGTH), counts


def test_a_network_that_drops_ip_fragments_keeps_mtu_packets_and_carries_every_message(caplog):
    """Jumbo packets cross a LAN as IP fragments; where the network drops those, a jumbo DATA
    packet would be retransmitted at its size for ever and the link stall. Each side probes the
    path first (a HEARTBEAT of the jumbo size, echoed back), finds it does not carry them, says
    so and keeps MTU-sized packets; messages of every size then arrive intact."""
    async def main():
        a, b = pair()
        await connect(a, b)
        lengths = await asyncio.gather(a.packets_settled(), b.packets_settled())
        for size in (1, 5000, 20000, 300000):
            for one, other in ((a, b), (b, a)):
                data = os.urandom(size)
                await one.send(blob(data))
                got = await asyncio.wait_for(other.receive(), 10)
                got.verify()
                assert bytes(got.data) == data
        await a.close()
        await b.close()
        return lengths

    with caplog.at_level("WARNING", logger="swarm.peer.net.link"):
        lengths = run_in_netns(main, configure=DROP_IP_FRAGMENTS)
    assert lengths == [rtc.SCTP_MAX_PACKET_LENGTH] * 2
    assert caplog.text.count("drops IP fragments, so this link keeps packets within the MTU") == 2, caplog.text


def test_a_link_probes_again_and_takes_jumbo_packets_once_the_network_carries_them(monkeypatch):
    """A probe lost to a passing fault must not keep a link on MTU-sized packets for good: after
    the first probes fail, the link probes again (JUMBO_REPROBE_S) and, once the network
    reassembles fragments again, sends jumbo packets."""
    import swarm.peer.net.link as link_module

    monkeypatch.setattr(link_module, "JUMBO_REPROBE_S", (0.5, 0.5))

    async def main():
        a, b = pair()
        await connect(a, b)
        first = await asyncio.gather(a.packets_settled(), b.packets_settled())
        # the thread runs in the namespace: so does this command
        subprocess.run(["sysctl", "-q", "-w", "net.ipv4.ipfrag_high_thresh=4194304",
                        "net.ipv4.ipfrag_low_thresh=3145728"], check=True)
        for _ in range(40):
            if a.sctp_packet_length == b.sctp_packet_length == rtc.SCTP_JUMBO_PACKET_LENGTH:
                break
            await asyncio.sleep(0.1)
        later = (a.sctp_packet_length, b.sctp_packet_length)
        data = os.urandom(20000)
        await a.send(blob(data))
        (await asyncio.wait_for(b.receive(), 10)).verify()
        await a.close()
        await b.close()
        return first, later

    first, later = run_in_netns(main, configure=DROP_IP_FRAGMENTS)
    assert first == [rtc.SCTP_MAX_PACKET_LENGTH] * 2
    assert later == (rtc.SCTP_JUMBO_PACKET_LENGTH,) * 2


def test_a_bad_jumbo_attribute_in_the_remote_sdp_is_a_clear_refusal():
    async def main():
        a, b = pair()
        bad = lambda sdp: sdp.replace(f"a={rtc.SDP_PACKET_ATTRIBUTE}:16384", f"a={rtc.SDP_PACKET_ATTRIBUTE}:99999")
        with pytest.raises(RemoteProtocolError, match=rtc.SDP_PACKET_ATTRIBUTE):
            await b.accept_offer(bad(await a.create_offer()))
        await a.close()
        await b.close()

    run_in_netns(main)


def test_a_peer_told_to_keep_mtu_packets_neither_offers_nor_sends_jumbo_ones():
    """join --mtu-packets (a network that drops IP fragments): that side's SDP has no attribute and
    it sends MTU-sized packets even to a remote that offers jumbo ones; the remote then keeps them too."""
    async def main():
        a, b = pair(a={"jumbo_packets": False})
        offer = await a.create_offer()
        answer = await b.accept_offer(offer)
        await a.accept_answer(answer)
        await asyncio.gather(a.established(), b.established())
        data = os.urandom(20000)
        await a.send(blob(data))
        (await b.receive()).verify()
        lengths = (a.sctp_packet_length, b.sctp_packet_length)
        await a.close()
        await b.close()
        return offer, answer, lengths

    offer, answer, lengths = run_in_netns(main)
    assert rtc.SDP_PACKET_ATTRIBUTE not in offer and rtc.SDP_PACKET_ATTRIBUTE in answer
    assert lengths == (rtc.SCTP_MAX_PACKET_LENGTH,) * 2


def test_a_message_leaves_within_send_and_a_handler_runs_within_the_receive_callback():
    """No loop iteration between a send and its datagram (aiortc flushes in a task of its own),
    nor between a message's arrival and its handler's first part (it ran in a task before): a
    stage step's round trip is all such hops."""
    async def main():
        a, b = pair()
        await connect(a, b)
        ran = asyncio.Queue()

        async def on_blob(link, message):
            # the handler's own task, if it were given one, is among the link's tasks now
            await ran.put((message.data.tobytes(), asyncio.current_task() in link._tasks))

        b.on(WeightChunk, on_blob)
        queued = []
        for size in (10, 40_000):  # one packet, and a message of several
            await a.send(blob(b"x" * size))
            queued.append(len(a.pc.sctp._data_channel_queue))  # before this coroutine yields to the loop
        got = [await asyncio.wait_for(ran.get(), 5) for _ in range(2)]
        await a.close()
        await b.close()
        return queued, got

    queued, got = run_in_netns(main)
    assert queued == [0, 0]
    assert [(len(data), own_task) for data, own_task in got] == [(10, False), (40_000, False)]
