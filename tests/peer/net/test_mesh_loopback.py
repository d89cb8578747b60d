"""Three peer nodes on this machine form a full mesh over real aiohttp signaling and aiortc.

All three run in one event loop inside a fresh network namespace (aioice skips 127.0.0.1, so
the namespace's loopback carries an extra /32), with a signaling server on that address.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os

import pytest

from swarm.keys.identity import Identity
from swarm.peer.net.messages import WeightChunk
from swarm.peer.node import Node
from swarm.keys.swarmkey import SwarmKey
from swarm.signaling.server import SignalingServer
from tests.peer._links import ADDRESS, blob, hello, run_in_netns

FAST_LINKS = {"heartbeat_s": 0.2, "dead_after_s": 2.0}


async def until(predicate, timeout_s: float, what: str):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


async def start_swarm(tmp_path, n: int, key: SwarmKey):
    identities = [Identity.generate() for _ in range(n)]
    certs = [ident.rtc_certificate() for ident in identities]
    ids = [ident.peer_id for ident in identities]
    server = SignalingServer(key.secret, ids[0], config_dir=tmp_path)
    await server.start(ADDRESS, 0)
    nodes = [
        Node(swarm_key=key, certificate=cert, peer_id=pid, name=f"node{i}", signal_url=server.url(ADDRESS),
             ffn_gflops=1.0 + i, memory_budget=(i + 1) << 30, status_path=tmp_path / f"status{i}.json",
             link_options=FAST_LINKS)
        for i, (cert, pid) in enumerate(zip(certs, ids))
    ]
    for node in nodes:
        await node.start(timeout=10)
    return server, nodes


@pytest.mark.slow
def test_three_peers_form_a_mesh_and_carry_messages_intact(tmp_path):
    key = SwarmKey(os.urandom(32))
    sizes = [1, 65535, 65537, 262145, 8 << 20]

    async def main():
        server, nodes = await start_swarm(tmp_path, 3, key)
        try:
            await until(lambda: all(len(n.links) == 2 for n in nodes), 15, "a full mesh of 3")
            mesh = {n.peer_id: {pid: (link.peer_id, link.hello.name) for pid, link in n.links.items()} for n in nodes}
            received: dict[str, asyncio.Queue] = {n.peer_id: asyncio.Queue() for n in nodes}
            for n in nodes:
                n.on(WeightChunk, lambda link, msg, q=received[n.peer_id]: q.put_nowait((link.peer_id, msg)))
            digests = []
            for i, sender in enumerate(nodes):
                receiver = nodes[(i + 1) % 3]
                for size in sizes:
                    data = os.urandom(size)
                    await sender.links[receiver.peer_id].send(blob(data, request_id=size))
                    src, msg = await asyncio.wait_for(received[receiver.peer_id].get(), 30)
                    msg.verify()
                    digests.append((src, sender.peer_id, msg.request_id, size,
                                    hashlib.sha256(msg.data).digest(), hashlib.sha256(data).digest()))
            def measured() -> bool:  # a heartbeat answered on both links, status rewritten
                peers = json.loads((tmp_path / "status0.json").read_text())["peers"]
                return len(peers) == 2 and all(p["rtt_ms"] is not None for p in peers)

            await until(measured, 10, "both links' round trip in the status")
            status = json.loads((tmp_path / "status0.json").read_text())
            # one peer leaves: the others see its link go down, and keep theirs
            await nodes[2].stop()
            await until(lambda: all(len(n.links) == 1 for n in nodes[:2]), 10, "the mesh of the 2 that stayed")
            return mesh, digests, status, [n.peer_id for n in nodes]
        finally:
            for n in nodes:
                await n.stop()
            await server.stop()

    mesh, digests, status, ids = run_in_netns(main, timeout_s=120)
    for me, links in mesh.items():
        others = set(ids) - {me}
        assert set(links) == others
        assert all(links[p][0] == p for p in others)  # each link authenticated the peer it was for
        assert {links[p][1] for p in others} == {f"node{ids.index(p)}" for p in others}
    for src, sender, rid, size, got, sent in digests:
        assert (src, rid) == (sender, size) and got == sent
    assert status["peer_id"] == ids[0] and status["swarm_id"] == key.swarm_id
    linked = {p["peer_id"]: p for p in status["peers"]}
    assert set(linked) == set(ids[1:]) and all(p["linked"] for p in linked.values())
    assert all(0 < p["rtt_ms"] < 1000 for p in linked.values())
    assert linked[ids[2]]["ffn_gflops"] == 3.0 and linked[ids[1]]["memory_budget"] == 2 << 30


def test_status_refuses_missing_stale_and_dead_peers(tmp_path):
    from swarm.errors import SwarmError
    from swarm.peer.status import STALE_AFTER_S, read_status

    path = tmp_path / "status.json"
    with pytest.raises(SwarmError, match="no peer is running"):
        read_status(path)
    path.write_text("{not json")
    with pytest.raises(SwarmError, match="cannot read the status file"):
        read_status(path)
    doc = {"pid": os.getpid(), "updated": 1000.0, "peers": []}
    path.write_text(json.dumps(doc))
    assert read_status(path, now=1000.0 + STALE_AFTER_S / 2) == doc
    with pytest.raises(SwarmError, match="no peer runs from"):
        read_status(path, now=1000.0 + STALE_AFTER_S + 1)
    path.write_text(json.dumps({**doc, "pid": 2**22 + 12345}))  # above pid_max: no such process
    with pytest.raises(SwarmError, match=r"no peer runs from .*\(pid 4206649\) stopped"):
        read_status(path, now=1000.0)


def _split_candidates(sdp: str) -> tuple[str, list[str]]:
    """An SDP without its a=candidate lines, and those candidates (as a browser trickles them)."""
    lines = sdp.splitlines()
    candidates = [ln[len("a="):] for ln in lines if ln.startswith("a=candidate:")]
    kept = [ln for ln in lines if not ln.startswith(("a=candidate:", "a=end-of-candidates"))]
    return "\r\n".join(kept) + "\r\n", candidates


def test_browser_offer_with_trickled_candidates_is_answered_only_by_the_coordinator():
    from swarm.peer.net.link import Link, new_peer_connection
    from swarm.peer.net.mesh import Mesh
    from swarm.signaling.messages import PeerInfo

    key = SwarmKey(os.urandom(32))

    async def main():
        python_id, browser_id = Identity.generate(), Identity.generate()
        outbox: asyncio.Queue = asyncio.Queue()

        async def send_signal(to, data):
            await outbox.put((to, data))

        coordinator = [False]
        mesh = Mesh(local_hello=hello(python_id.peer_id), certificate=python_id.rtc_certificate(),
                    auth_key=key.channel_auth_key, send_signal=send_signal, accept_browsers=lambda: coordinator[0])
        mesh.sync([PeerInfo(browser_id.peer_id, "phone", "browser", 0.0)])
        results = []
        for is_coordinator in (False, True):
            coordinator[0] = is_coordinator
            pc, channel = new_peer_connection(browser_id.rtc_certificate())
            browser_hello = dataclasses.replace(hello(browser_id.peer_id), peer_kind="browser")
            browser = Link(pc, channel, certificate=browser_id.rtc_certificate(), auth_key=key.channel_auth_key,
                           local_hello=browser_hello, offerer=True, expected_peer_id=python_id.peer_id)
            sdp, candidates = _split_candidates(await browser.create_offer())
            session = f"s{int(is_coordinator)}"
            await mesh.handle_signal(browser_id.peer_id, {"type": "offer", "sdp": sdp, "session": session})
            for c in candidates:  # right behind the offer, before the mesh has even answered
                await mesh.handle_signal(browser_id.peer_id, {"type": "candidate", "candidate": c, "sdpMid": "0",
                                                              "sdpMLineIndex": 0, "session": session})
            try:
                to, answer = await asyncio.wait_for(outbox.get(), 3)
            except asyncio.TimeoutError:
                results.append("no answer")
                await browser.close()
                continue
            # the answer's candidates are dropped: the link can only form through the candidates
            # the mesh took from the trickle (its checks reach us as peer-reflexive candidates)
            await browser.accept_answer(_split_candidates(answer["sdp"])[0])
            hello_seen = await browser.established()
            await until(lambda: browser_id.peer_id in mesh.links, 5, "the mesh to hold the browser's link")
            results.append((to, answer["session"], hello_seen.peer_id, mesh.links[browser_id.peer_id].peer_id))
            await browser.close()
        await mesh.close()
        return results, python_id.peer_id, browser_id.peer_id

    results, python_peer, browser_peer = run_in_netns(main)
    assert results[0] == "no answer"  # not the coordinator: browsers are not linked to workers
    assert results[1] == (browser_peer, "s1", python_peer, browser_peer)


def test_a_member_offering_under_another_python_peers_id_gets_no_link(caplog):
    """A member (it holds the swarm key) connects to signaling under the id of a Python peer and
    offers with its own certificate: the mesh refuses the link, logging both ids, and keeps none."""
    import logging

    from swarm.peer.net.link import Link, new_peer_connection
    from swarm.peer.net.mesh import Mesh
    from swarm.signaling.messages import PeerInfo

    caplog.set_level(logging.WARNING, logger="swarm.peer.net.link")
    key = SwarmKey(os.urandom(32))

    async def main():
        me, victim, impostor = Identity.generate(), Identity.generate(), Identity.generate()
        answers: asyncio.Queue = asyncio.Queue()

        async def send_signal(to, data):
            if data["type"] == "answer":  # the mesh may also dial the "victim" itself: not ours to answer
                await answers.put(data)

        mesh = Mesh(local_hello=hello(me.peer_id), certificate=me.rtc_certificate(), auth_key=key.channel_auth_key,
                    send_signal=send_signal)
        mesh.sync([PeerInfo(victim.peer_id, "laptop", "python", 0.0)])
        pc, channel = new_peer_connection(impostor.rtc_certificate())
        rogue = Link(pc, channel, certificate=impostor.rtc_certificate(), auth_key=key.channel_auth_key,
                     local_hello=hello(victim.peer_id), offerer=True, expected_peer_id=me.peer_id)
        await mesh.handle_signal(victim.peer_id, {"type": "offer", "sdp": await rogue.create_offer(), "session": "s"})
        answer = await asyncio.wait_for(answers.get(), 5)
        await rogue.accept_answer(answer["sdp"])
        await asyncio.wait_for(rogue.wait_closed(), 10)  # the mesh's side refused and closed
        links = dict(mesh.links)
        await rogue.close()
        await mesh.close()
        return links, victim.peer_id, impostor.peer_id

    links, victim, impostor = run_in_netns(main)
    assert links == {}
    assert f"peer {victim} presented the DTLS certificate of peer {impostor}" in caplog.text


def test_malformed_signals_are_logged_and_dropped(caplog):
    import logging

    from swarm.peer.net.mesh import Mesh
    from swarm.signaling.messages import PeerInfo

    caplog.set_level(logging.INFO, logger="swarm.peer")
    key = SwarmKey(os.urandom(32))

    async def main():
        me, other = Identity.generate(), Identity.generate()
        sent = []

        async def send_signal(to, data):
            sent.append((to, data))

        mesh = Mesh(local_hello=hello(me.peer_id), certificate=me.rtc_certificate(), auth_key=key.channel_auth_key,
                    send_signal=send_signal, accept_browsers=lambda: True)
        mesh.sync([PeerInfo(other.peer_id, "x", "browser", 0.0)])
        bad = [
            {"type": "offer"},
            {"type": "offer", "sdp": 42},
            {"type": "offer", "sdp": "x" * 100_000},
            {"type": "offer", "sdp": "v=0\r\nnot an sdp\r\n", "session": "a"},
            {"type": "answer", "sdp": "v=0\r\n", "session": "nope"},
            {"type": "candidate", "candidate": "candidate:garbage", "session": "a"},
            {"type": "hello"},
            {"type": "offer", "sdp": "v=0", "session": ["not", "a", "string"]},
        ]
        for data in bad:
            await mesh.handle_signal(other.peer_id, data)
        await asyncio.sleep(0.5)  # the answer task of the junk offer runs and fails
        state = (dict(mesh.links), sent)
        await mesh.close()
        return state

    links, sent = run_in_netns(main)
    assert links == {} and sent == []
    assert caplog.text.count("dropped a signal") >= 5
    assert "unknown signal type 'hello'" in caplog.text
    assert "offer from" in caplog.text  # the unparseable offer failed in its own task, logged


def test_status_command_prints_peers_roles_and_plan(tmp_path, monkeypatch, capsys):
    import argparse
    import time

    from swarm.cli.status import main_status

    monkeypatch.setenv("COLIBRI_SWARM_CONFIG_DIR", str(tmp_path))
    me, other = "m" * 26, "o" * 26
    doc = {
        "pid": os.getpid(), "updated": time.time(), "swarm_id": "0123456789abcdef", "peer_id": me, "name": "desk",
        "role": "worker", "hosting_signaling": False, "signaling_host": other, "ffn_gflops": 12.5,
        "memory_budget": 2 << 30,
        "placement": {"term": 3, "version": 7, "coordinator": other, "api_port": 8123, "peers": [other, me],
                      "experts": {}, "dense": {"0": [[other, 0, 1000], [me, 1000, 1536]],
                                               "1": [[other, 0, 1000], [me, 1000, 1536]]}},
        "peers": [{"peer_id": other, "name": "laptop", "kind": "python", "linked": True, "rtt_ms": 0.61,
                   "on_signaling": True, "memory_budget": 1 << 30, "ffn_gflops": 30.0, "model_hash": None}],
    }
    (tmp_path / "status.json").write_text(json.dumps(doc))
    assert main_status(argparse.Namespace(json=True)) == 0
    assert json.loads(capsys.readouterr().out) == doc
    monkeypatch.setenv("COLUMNS", "200")
    assert main_status(argparse.Namespace(json=False)) == 0
    out = capsys.readouterr().out
    assert "swarm 0123456789abcdef" in out and f"signaling on {other}" in out
    assert f"this peer desk ({me}), worker" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["desk"], ["laptop"])}
    assert rows["laptop"][1:] == ["Linux", "coordinator", "0.6", "30.0", "1024", "65", "%"]
    assert rows["desk"][1:] == ["Linux", "worker", "this", "12.5", "2048", "35", "%"]  # 536 of 1536 MLP rows
    assert "plan v7 of term 3, coordinator laptop, OpenAI API on port 8123" in out
    assert "desk: layers 0–1: MLP rows 1000–1536" in out and "laptop: layers 0–1: MLP rows 0–1000" in out


def test_a_dialer_survives_an_unexpected_error_and_a_peer_that_rejoins_is_dialed_again(caplog):
    """Dialing a present peer goes on through any error of one attempt (a dialer that died
    would leave that peer unlinked until one of the two restarted), and a peer that leaves and
    joins again is dialed again."""
    import logging

    from swarm.peer.net.mesh import Mesh
    from swarm.signaling.messages import PeerInfo

    caplog.set_level(logging.INFO, logger="swarm.peer")
    key = SwarmKey(os.urandom(32))

    async def main():
        me, other = sorted((Identity.generate() for _ in range(2)), key=lambda i: i.peer_id)
        offers = []

        async def send_signal(to, data):
            offers.append(to)
            if len(offers) == 1:
                raise RuntimeError("an aiortc or aiohttp error no one expected")

        mesh = Mesh(local_hello=hello(me.peer_id), certificate=me.rtc_certificate(), auth_key=key.channel_auth_key,
                    send_signal=send_signal, retry_s=0.05)
        info = PeerInfo(other.peer_id, "other", "python", 0.0)
        mesh.peer_joined(info)
        await until(lambda: len(offers) >= 2, 10, "a second offer after the first attempt's error")
        mesh.peer_left(other.peer_id)
        await asyncio.sleep(0.1)
        gone = len(offers)
        await asyncio.sleep(0.3)
        stayed_quiet = len(offers) == gone
        mesh.peer_joined(info)
        await until(lambda: len(offers) > gone, 10, "an offer to the peer that joined again")
        # left and back in one tick (a signaling reconnect's presence list): its dialer was being
        # cancelled, not yet ended, and a new one must start all the same
        mesh.peer_left(other.peer_id)
        mesh.peer_joined(info)
        again = len(offers)
        await until(lambda: len(offers) > again, 10, "an offer after leaving and joining in one tick")
        await mesh.close()
        return offers, stayed_quiet, other.peer_id

    offers, stayed_quiet, other = run_in_netns(main)
    assert set(offers) == {other}
    assert stayed_quiet, "the mesh kept dialing a peer that had left"
    assert "dialing" in caplog.text and "RuntimeError: an aiortc or aiohttp error no one expected" in caplog.text
