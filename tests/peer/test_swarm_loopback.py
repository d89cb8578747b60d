"""Three peer nodes on this machine — real aiohttp signaling, real aiortc links — elect a
coordinator, and the swarm's tokens and logits equal the local engine's under the same plan;
a worker killed mid-generation and a lost coordinator change nothing in the tokens; a worker
without the model gets its slices shipped; a browser peer (headless Chromium on WebGPU) joins
the coordinator and computes its share.

All nodes run in one event loop inside a fresh network namespace (prefix ``csc-``): aioice
skips 127.0.0.1, so the namespace's loopback carries an extra /32. The token loop runs in a
thread, as in ``join``: RemoteFFN talks to the links through thread-safe hand-offs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import threading
import time

import numpy as np
import pytest

from swarm.compute.ffn import LocalFFN
from swarm.compute.model import load_model
from swarm.keys.identity import Identity
from swarm.peer.node import CLOSED_BY_PEER, Node
from swarm.peer.roles import SwarmRoles
from swarm.keys.swarmkey import SwarmKey
from swarm.signaling.server import SignalingServer
from tests.conftest import require
from tests.peer._links import run_in_netns
from tests.peer._swarm_models import PROMPT, add_char_tokenizer, build, greedy

ADDRESS = "10.214.0.1"
FAST_LINKS = {"heartbeat_s": 0.2, "dead_after_s": 2.0}

pytestmark = pytest.mark.slow


async def until(predicate, timeout_s: float, what: str) -> float:
    """Wait for ``predicate()``; returns the seconds it took."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


class Peer:
    def __init__(self, node: Node, roles: SwarmRoles):
        self.node, self.roles = node, roles

    async def stop(self):
        """Roles first, then the node, as ``join`` leaves: the links that close after the roles
        stopped must start no new plan (nothing would cancel it)."""
        if self.roles is None:
            await self.node.stop()
            return
        await self.roles.stop()
        coordinator = self.roles.coordinator
        version = coordinator.plan_version
        await self.node.stop()
        await asyncio.sleep(0.05)  # what a link-down scheduled would have run by now
        assert coordinator.ffn is None and coordinator.stages is None
        assert coordinator.plan_version == version, "re-planned after the roles stopped"


async def start_swarm(tmp_path, model_dir, gflops: list[float], with_model: list[bool] | None = None):
    key = SwarmKey(os.urandom(32))
    idents = [Identity.generate() for _ in gflops]
    server = SignalingServer(key.secret, idents[0].peer_id, config_dir=tmp_path)
    await server.start(ADDRESS, 0)
    peers = []
    for i, (ident, g) in enumerate(zip(idents, gflops)):
        has = with_model[i] if with_model else True
        model = load_model(model_dir) if has else None  # each peer its own copy, as on separate machines
        node = Node(swarm_key=key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id, name=f"peer{i}",
                    signal_url=server.url(ADDRESS), ffn_gflops=g, memory_budget=1 << 30,
                    model_hash=model.content_hash() if has else None, status_path=tmp_path / f"status{i}.json",
                    link_options=FAST_LINKS)
        await node.start(timeout=10)
        roles = SwarmRoles(node, model, serve_api=False, startup_quiet_s=1.0)
        await roles.start()
        peers.append(Peer(node, roles))
    return server, peers


async def stop_swarm(server, peers) -> None:
    for p in peers:
        await p.stop()
    await server.stop()


def agreed(peers) -> str | None:
    """The coordinator every peer follows, once it is coordinating with a plan every worker has."""
    views = {(p.roles.election.term, p.roles.election.leader) for p in peers}
    if len(views) != 1:
        return None
    (_, leader), = views
    coord = next((p for p in peers if p.node.peer_id == leader), None)
    if coord is None or coord.roles.coordinator.ffn is None:
        return None
    plan = coord.roles.coordinator.ffn.pending_plan or coord.roles.coordinator.ffn.plan
    if set(plan.workers()) != {p.node.peer_id for p in peers} - {leader}:
        return None
    if any(p.roles.worker.server is None or p.roles.worker.server.plan is None or p.roles.worker.server.plan.version != plan.version
           for p in peers if p.node.peer_id != leader):
        return None
    return leader


def test_swarm_over_real_links_matches_local_and_survives_losses(tmp_path, caplog):
    """… and a worker that leaves (its link closed by it, as at Ctrl-C) is said to leave, in INFO
    lines and a "link down" event closed by the peer, never warned of as a lost one."""
    model_dir = build("qwen3_moe", tmp_path)  # MoE layers 0 and 2, dense layer 1
    caplog.set_level(logging.INFO, logger="swarm")

    async def main():
        server, peers = await start_swarm(tmp_path, model_dir, [1.0, 2.0, 3.0])
        try:
            await until(lambda: agreed(peers) == peers[2].node.peer_id, 20, "the most capable peer coordinating")
            coord = peers[2]
            ffn = coord.roles.coordinator.ffn
            # 1. all three peers: the swarm's run equals the local run under the same plan
            run1 = await asyncio.to_thread(greedy, coord.roles.model, ffn)
            plan1 = ffn.plan
            served1 = {p.node.peer_id: p.roles.worker.server.served for p in peers[:2]}
            # 2. a worker leaves at decode step 5 (its link closes); the generation goes on
            loop = asyncio.get_running_loop()
            killed = asyncio.Event()

            def on_step(step):
                if step == 5:
                    loop.call_soon_threadsafe(lambda: asyncio.ensure_future(peers[0].stop()).add_done_callback(
                        lambda _: killed.set()))

            logged = len(caplog.records)
            run2 = await asyncio.to_thread(greedy, coord.roles.model, ffn, PROMPT, 12, on_step)
            await killed.wait()
            await until(lambda: peers[0].node.peer_id not in ffn.plan.workers() and ffn.pending_plan is None
                        or peers[0].node.peer_id not in (ffn.pending_plan or ffn.plan).workers(), 10, "a new plan")
            left = peers[0].node.peer_id
            leave = [r for r in caplog.records[logged:] if r.name.startswith("swarm.peer.coordinator")]
            # no warning of the peer that left (another's late answer on a loaded machine is its own matter)
            assert [r.getMessage() for r in leave if r.levelno >= logging.WARNING and left in r.getMessage()] == []
            assert any(r.getMessage().startswith(f"peer peer0 ({left}) closed its link (it is leaving") for r in leave)
            assert {"what": "link down", "peer_id": left, "name": "peer0", "detail": CLOSED_BY_PEER} in [
                {k: e[k] for k in ("what", "peer_id", "name", "detail")} for e in coord.node.activity]
            # 3. the coordinator goes: the survivor takes over within 5 s and serves
            await coord.stop()
            took = await until(lambda: peers[1].roles.coordinator.ffn is not None, 10, "a new coordinator")
            run3 = await asyncio.to_thread(greedy, peers[1].roles.model, peers[1].roles.coordinator.ffn)
            return run1, plan1, served1, run2, took, run3
        finally:
            await stop_swarm(server, peers)

    run1, plan1, served1, run2, took, run3 = run_in_netns(main, timeout_s=240, prefix="csc", address=ADDRESS)
    model = load_model(model_dir)
    ref = greedy(model, LocalFFN(model, plan1.dense_ranges()))
    assert run1[0] == ref[0]
    for a, b in zip(run1[1], ref[1], strict=True):
        assert np.array_equal(a, b)
    assert all(n > 0 for n in served1.values()), served1  # both workers computed their share
    assert run2[0] == ref[0]  # a worker lost mid-generation: same tokens
    assert took <= 5.0, f"new coordinator after {took:.2f} s"
    assert run3[0] == ref[0]  # the new coordinator's swarm of one gives the same tokens


def test_a_worker_that_missed_its_plan_is_sent_it_again_and_not_marked_down(tmp_path):
    """A peer's link is up (so the coordinator plans it in and sends it the plan) before its roles
    handle plans, as while a slow tokenizer is built: the link holds the plan until the handler
    comes. The worker then refuses that plan once (as when its slices do not come in time), so
    it serves no plan. Its first request is refused as "no plan yet"; that is not a failure: the
    coordinator recomputes those rows, sends it the same plan again, and it then computes its
    share. The tokens are the local run's."""
    from swarm.errors import RemoteProtocolError

    model_dir = build("qwen3_moe", tmp_path)

    async def main():
        server, peers = await start_swarm(tmp_path, model_dir, [2.0])
        coord = peers[0]
        try:
            await until(lambda: coord.roles.coordinator.ffn is not None, 20, "a coordinator")
            ident, model = Identity.generate(), load_model(model_dir)
            node = Node(swarm_key=coord.node.swarm_key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                        name="late-roles", signal_url=server.url(ADDRESS), ffn_gflops=1.0, memory_budget=1 << 30,
                        model_hash=model.content_hash(), status_path=tmp_path / "status-late.json",
                        link_options=FAST_LINKS)
            await node.start(timeout=10)
            late = Peer(node, None)
            peers.append(late)
            ffn = coord.roles.coordinator.ffn
            await until(lambda: ident.peer_id in (ffn.pending_plan or ffn.plan).workers(), 20, "the peer planned in")
            await asyncio.sleep(0.5)  # the plan has reached its link by now, with no handler for it
            newest = ffn.pending_plan or ffn.plan  # in use from the next step
            sent = (newest.term, newest.version)
            late.roles = SwarmRoles(node, model, serve_api=False, startup_quiet_s=1.0)
            worker = late.roles.worker.server
            accept, offered = worker.accept_plan, []

            def refuse_the_first(plan):
                offered.append((plan.term, plan.version))
                if len(offered) == 1:
                    raise RemoteProtocolError("not now")  # answered as a refused plan, as a failed slice fetch is
                accept(plan)

            worker.accept_plan = refuse_the_first
            await late.roles.start()
            await until(lambda: offered, 10, "the held plan handed to the worker")
            assert offered == [sent] and worker.plan is None  # held, not lost; then refused: no plan served
            runs, t0 = [], time.monotonic()
            while worker.served == 0:  # requests of the plan are held but for a probe now and then
                assert time.monotonic() - t0 < 30, "the peer never got its plan again"
                runs.append(await asyncio.to_thread(greedy, coord.roles.model, ffn, PROMPT, 4))
            marked = [e for e in coord.node.activity if e["what"] == "marked down"]
            return runs, ffn.plan, marked, set(ffn.failed), worker.served, offered, sent
        finally:
            await stop_swarm(server, peers)

    runs, plan, marked, failed, served, offered, sent = run_in_netns(main, timeout_s=120, prefix="csc", address=ADDRESS)
    model = load_model(model_dir)
    ref = greedy(model, LocalFFN(model, plan.dense_ranges()), PROMPT, 4)
    assert runs and all(run[0] == ref[0] for run in runs)
    assert offered[:2] == [sent, sent]  # the same plan, sent again after its request was refused
    assert not marked and not failed and served > 0


def test_a_worker_without_the_model_gets_its_slices_shipped(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_SWARM_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = build("qwen3_moe", tmp_path)

    async def main():
        server, peers = await start_swarm(tmp_path, model_dir, [2.0, 1.0], with_model=[True, False])
        try:
            await until(lambda: agreed(peers) == peers[0].node.peer_id, 30, "the peer with the model coordinating")
            ffn = peers[0].roles.coordinator.ffn
            run = await asyncio.to_thread(greedy, peers[0].roles.model, ffn)
            worker = peers[1].roles.worker.server
            return run, ffn.plan, worker.served, type(worker.source).__name__, ffn.local_fallbacks
        finally:
            await stop_swarm(server, peers)

    run, plan, served, source, fallbacks = run_in_netns(main, timeout_s=120, prefix="csc", address=ADDRESS)
    model = load_model(model_dir)
    ref = greedy(model, LocalFFN(model, plan.dense_ranges()))
    assert run[0] == ref[0] and all(np.array_equal(a, b) for a, b in zip(run[1], ref[1], strict=True))
    assert served > 0 and fallbacks == 0 and source == "ShippedWeights"
    assert list((tmp_path / "cache" / "slices").glob("*.bin"))  # verified slices, cached by hash


class PageSwarm:
    """A coordinator run by SwarmRoles (``layout``) and its signaling server,
    on an event loop in a thread; :meth:`drive` opens its peer page in headless Chromium."""

    def __init__(self, tmp_path, model_dir, layout: str = "ranges", serve_api: bool = False):
        from tests.browser.conftest import CHROMIUM

        require(os.path.exists(CHROMIUM), "Debian's Chromium at /usr/bin/chromium (apt install chromium)")
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
        lan = [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]
        require(bool(lan), "a non-loopback IPv4 address (WebRTC between Chromium and aiortc on this machine)")
        self.address, self.key = lan[0], SwarmKey(os.urandom(32))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, self.node, self.roles = self.call(self._start(tmp_path, model_dir, layout, serve_api))

    def call(self, coro, timeout_s: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self, tmp_path, model_dir, layout, serve_api):
        ident = Identity.generate()
        server = SignalingServer(self.key.secret, ident.peer_id, config_dir=tmp_path)
        await server.start(self.address, 0)
        model = load_model(model_dir)
        node = Node(swarm_key=self.key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id, name="coordinator",
                    signal_url=server.url(self.address), ffn_gflops=1.0, memory_budget=1 << 30,
                    model_hash=model.content_hash(), status_path=tmp_path / "status.json")
        await node.start(timeout=10)
        roles = SwarmRoles(node, model, serve_api=serve_api, startup_quiet_s=0.2, layout=layout)
        await roles.start()
        return server, node, roles

    def drive(self, steps, result: dict) -> threading.Thread:
        """Run ``steps(page)`` on the peer page in a thread of its own (the sync driver must not
        share the test's); what it raises goes to ``result["error"]`` with the page's states."""
        from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS

        def run():
            from playwright.sync_api import sync_playwright

            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM,
                                            args=CHROMIUM_ARGS + ["--disable-features=WebRtcHideLocalIpsWithMdns"])
                page = browser.new_context(ignore_https_errors=True).new_page()
                page.goto(f"https://{self.address}:{self.server.port}/?name=phone#{self.key.code}")
                try:
                    steps(page)
                except Exception as exc:
                    result["error"] = f"{exc}: " + page.evaluate("JSON.stringify(window.colibri?.events)")
                browser.close()

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    def close(self):
        self.call(self.roles.stop())
        self.call(self.node.stop())
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.run_until_complete(self.loop.shutdown_default_executor())  # its worker threads end here
        self.loop.close()


@pytest.mark.browser
def test_a_browser_peer_joins_the_coordinator_and_computes_its_share(tmp_path):
    """Headless Chromium opens the peer page of a coordinator run by SwarmRoles: the coordinator
    plans the page in, ships it its slices, recomputes while it installs them (warm-up), then the
    page computes on WebGPU and the greedy tokens equal the local run's."""
    model_dir = build("qwen3_moe", tmp_path)
    swarm = PageSwarm(tmp_path, model_dir)
    node, roles = swarm.node, swarm.roles
    result: dict = {"done": threading.Event()}

    def steps(page):
        page.wait_for_function("window.colibri && window.colibri.state === 'serving'", timeout=90_000)
        result["ready"] = True
        result["done"].wait(180)
        result["served"] = page.evaluate("window.colibri.worker.stats.served")

    driver = swarm.drive(steps, result)
    try:
        def planned_in() -> bool:
            ffn = roles.coordinator.ffn
            browser = [p for p, link in node.links.items() if link.hello.peer_kind == "browser"]
            return bool(browser and ffn is not None and browser[0] in (ffn.pending_plan or ffn.plan).workers())

        t0 = time.monotonic()
        while not (planned_in() and result.get("ready")) and "error" not in result:
            assert time.monotonic() - t0 < 120, "the page was never planned in and serving"
            time.sleep(0.1)
        assert "error" not in result, result["error"]
        ffn = roles.coordinator.ffn
        tokens, logits = greedy(roles.model, ffn)
        plan = ffn.plan
        model = load_model(model_dir)
        ref_tokens, ref_logits = greedy(model, LocalFFN(model, plan.dense_ranges()))
        remote = ffn.remote_rows
    finally:
        result["done"].set()
        driver.join(60)
        swarm.close()
    assert tokens == ref_tokens
    assert max(float(np.abs(a - b).max()) for a, b in zip(logits, ref_logits)) <= 1e-3  # WebGPU f32 rounding
    assert remote > 0 and result["served"] > 0, (remote, result)


@pytest.mark.browser
def test_a_page_stands_by_while_the_model_fits_the_python_peers_and_serves_once_given_work(tmp_path):
    """Under ``--layout auto`` a coordinator that holds the model computes alone (a round trip per
    layer to the page costs more than its share saves): the page says on its status line that it
    stands by and why; ``--layout ranges`` then gives it work, and it loads its slices and serves."""
    # the API (for the dashboard) needs a tokenizer
    swarm = PageSwarm(tmp_path, add_char_tokenizer(build("qwen3_moe", tmp_path)), layout="auto", serve_api=True)
    result: dict = {}

    def steps(page):
        page.wait_for_function("window.colibri && window.colibri.state === 'standby'", timeout=90_000)
        result["standby"] = page.inner_text("#state")
        result["reason"] = page.evaluate("window.colibri.worker.standby.reason")
        # the coordinator's dashboard says it too, on the page's row
        coord = swarm.roles.coordinator
        board = page.context.new_page()
        board.goto(f"{getattr(coord.api, 'scheme', None) or 'http'}://{swarm.address}:{coord.api_port}"
                   f"/dashboard/#{swarm.key.code}")
        words = "[...document.querySelectorAll('tr[data-peer] .share-words')].map((e) => e.textContent)"
        board.wait_for_function(f"{words}.some((t) => t.includes('standing by'))", timeout=30_000)
        result["dashboard"] = board.evaluate(words)
        swarm.loop.call_soon_threadsafe(swarm.roles.coordinator.set_layout, "ranges")
        page.wait_for_function("window.colibri.state === 'serving'", timeout=90_000)
        result["serving"] = page.inner_text("#state")

    try:
        swarm.drive(steps, result).join(200)
    finally:
        swarm.close()
    assert "error" not in result, result["error"]
    assert result["reason"] == "fits_python_peers"
    assert result["standby"] == ("Standing by — the model fits the Python peers (1 peer, 1.0 GiB offered); "
                                 "this page would be used if they ran short")
    assert result["serving"] == "Serving"
    assert result["dashboard"] == ["layers 0–2: whole (attention, KV cache, MLP)",  # the coordinator's row
                                   "standing by — the model fits the Python peers (1 peer, 1.0 GiB offered); "
                                   "this page would be used if they ran short"]
