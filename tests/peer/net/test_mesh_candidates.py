"""A browser's `<uuid>.local` ICE candidates that nobody answers must not hold up its link.

aioice resolves such a candidate by mDNS and waits 1 s for an answer. When the mesh awaited
each candidate inside the signal pump, every signal behind it waited too: sixteen of them held
a link back by sixteen seconds. The namespace gets a multicast route, so the mDNS queries go
out and wait their full timeout, as on a LAN.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import threading
import time
import uuid

from swarm.keys.identity import Identity
from swarm.peer.net.link import Link, new_peer_connection
from swarm.peer.net.mesh import CANDIDATE_TIMEOUT_S, Mesh
from swarm.keys.swarmkey import SwarmKey
from swarm.signaling.messages import PeerInfo
from tests.peer._links import hello, run_in_netns
from tests.peer.net.test_mesh_loopback import _split_candidates

UNANSWERED = 16
# The link must open within this many seconds of the offer, however many unanswered candidates
# come with it (docs/reliability.md). Set-up itself takes well under a second on an idle machine;
# awaiting the candidates one by one would take UNANSWERED seconds.
LINK_BOUND_S = CANDIDATE_TIMEOUT_S + 6.0


def _multicast_route() -> None:
    """Give this thread's namespace (named as the thread) a multicast route over lo, so aioice's
    mDNS queries are sent and wait for answers instead of failing at once."""
    ns = threading.current_thread().name
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "multicast", "on"], check=True)
    subprocess.run(["ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", "lo"], check=True)


def test_unanswered_local_candidates_do_not_delay_the_link():
    key = SwarmKey(os.urandom(32))

    async def main():
        _multicast_route()
        python_id, browser_id = Identity.generate(), Identity.generate()
        outbox: asyncio.Queue = asyncio.Queue()

        async def send_signal(to, data):
            await outbox.put(data)

        mesh = Mesh(local_hello=hello(python_id.peer_id), certificate=python_id.rtc_certificate(),
                    auth_key=key.channel_auth_key, send_signal=send_signal, accept_browsers=lambda: True)
        mesh.sync([PeerInfo(browser_id.peer_id, "phone", "browser", 0.0)])
        pc, channel = new_peer_connection(browser_id.rtc_certificate())
        browser = Link(pc, channel, certificate=browser_id.rtc_certificate(), auth_key=key.channel_auth_key,
                       local_hello=dataclasses.replace(hello(browser_id.peer_id), peer_kind="browser"),
                       offerer=True, expected_peer_id=python_id.peer_id)
        try:
            sdp, candidates = _split_candidates(await browser.create_offer())
            flood = [f"candidate:{i} 1 udp 2122260223 {uuid.uuid4()}.local {50000 + i} typ host"
                     for i in range(UNANSWERED)]
            start = time.monotonic()
            # One pump, as the node's: each signal is handled after the one before it returns.
            signals = [{"type": "offer", "sdp": sdp}] + [{"type": "candidate", "candidate": c} for c in flood + candidates]
            for data in signals:
                await mesh.handle_signal(browser_id.peer_id, {**data, "sdpMid": "0", "sdpMLineIndex": 0, "session": "s"})
            pumped = time.monotonic() - start
            assert pumped < 1.0, f"the signal pump waited {pumped:.1f} s on {UNANSWERED} candidates"
            try:
                answer = await asyncio.wait_for(outbox.get(), LINK_BOUND_S)
            except asyncio.TimeoutError:
                raise AssertionError(f"no answer within {LINK_BOUND_S:g} s of an offer with {UNANSWERED} "
                                     "unanswered candidates") from None
            await browser.accept_answer(_split_candidates(answer["sdp"])[0])
            await asyncio.wait_for(browser.established(), 30)
            while browser_id.peer_id not in mesh.links:
                await asyncio.sleep(0.02)
            return time.monotonic() - start
        finally:
            await mesh.close()  # first: a link the mesh is still closing when it closes is left half-closed
            await browser.close()

    linked = run_in_netns(main, 90, prefix="csc", address="10.213.9.1")
    print(json.dumps({"event": "linked", "unanswered_candidates": UNANSWERED, "seconds": round(linked, 2)}))
    assert linked < LINK_BOUND_S, f"the link took {linked:.1f} s with {UNANSWERED} unanswered candidates"
