"""The aiortc internals swarm.peer.net.rtc relies on, checked against the installed aiortc.

An aiortc upgrade that moves one of them fails here, naming it, before any link test does.
"""

from __future__ import annotations

import asyncio
import re

import aiortc.rtcsctptransport as sctp
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

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


def test_remote_certificate_is_the_one_the_other_side_presented() -> None:
    """Two raw aiortc connections with our certificates: each reads the other's after DTLS."""
    a_id, b_id = Identity.generate(), Identity.generate()

    async def main():
        pcs = []
        for ident in (a_id, b_id):
            pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
            rtc.set_certificate(pc, ident.rtc_certificate())
            pcs.append(pc)
        a, b = pcs
        with pytest.raises(LocalProtocolError, match="no data channel"):
            rtc.remote_certificate(a)
        opened = asyncio.Event()
        a.createDataChannel("x", negotiated=True, id=0).on("open", opened.set)
        b.createDataChannel("x", negotiated=True, id=0)
        await a.setLocalDescription(await a.createOffer())
        await b.setRemoteDescription(RTCSessionDescription(a.localDescription.sdp, "offer"))
        await b.setLocalDescription(await b.createAnswer())
        await a.setRemoteDescription(RTCSessionDescription(b.localDescription.sdp, "answer"))
        await asyncio.wait_for(opened.wait(), 10)
        certs = rtc.remote_certificate(a), rtc.remote_certificate(b)
        await a.close()
        await b.close()
        return certs

    of_b, of_a = run_in_netns(main)
    assert (of_a, of_b) == (a_id.certificate, b_id.certificate)
