"""Swarm events name the peer they are about: a peer that left is shown by the name of its
hello and presence, which the node remembers after the signaling server has dropped it.

Two nodes on a real signaling server over real aiortc links, in a fresh network namespace
(aioice skips 127.0.0.1, so the namespace's loopback carries an extra /32).
"""

from __future__ import annotations

import asyncio
import os

import pytest

from swarm.keys.identity import Identity
from swarm.peer.node import Node
from swarm.keys.swarmkey import SwarmKey
from swarm.signaling.server import SignalingServer
from tests.peer._links import run_in_netns

ADDRESS = "10.214.0.3"
FAST_LINKS = {"heartbeat_s": 0.2, "dead_after_s": 2.0}

pytestmark = pytest.mark.slow


async def events(node: Node, *what: str, timeout_s: float = 20.0) -> dict[str, dict]:
    """The first recorded event of each kind in ``what``, in whatever order they come."""
    seen: dict[str, dict] = {}
    async with asyncio.timeout(timeout_s):
        while set(what) - set(seen):
            for ev in node.activity:
                if ev["what"] in what:
                    seen.setdefault(ev["what"], ev)
            await asyncio.sleep(0.05)
    return seen


def test_a_peer_that_leaves_is_named_in_the_events(tmp_path):
    async def main():
        key = SwarmKey(os.urandom(32))
        idents = [Identity.generate() for _ in range(2)]
        server = SignalingServer(key.secret, idents[0].peer_id, config_dir=tmp_path)
        await server.start(ADDRESS, 0)
        nodes = [Node(swarm_key=key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id, name=name,
                      signal_url=server.url(ADDRESS), ffn_gflops=1.0, memory_budget=1 << 30,
                      status_path=tmp_path / f"status-{name}.json", link_options=FAST_LINKS)
                 for ident, name in zip(idents, ["stays", "leaves"])]
        try:
            for node in nodes:
                await node.start(timeout=10)
            await events(nodes[0], "link up")
            await nodes[1].stop()
            seen = await events(nodes[0], "link down", "left")
            return seen["link down"], seen["left"], [e for e in nodes[0].activity if e["what"] in ("left", "link down")]
        finally:
            await nodes[0].stop()
            await server.stop()

    down, left, recorded = run_in_netns(main, timeout_s=60, prefix="csn", address=ADDRESS)
    assert (left["name"], left["detail"]) == ("leaves", "python"), left
    assert down["name"] == "leaves", down
    assert {e["name"] for e in recorded} == {"leaves"}, recorded
