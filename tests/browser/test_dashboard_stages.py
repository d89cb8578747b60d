"""The dashboard of a coordinator whose plan is a stage layout, in headless Chromium: each stage
worker's row says "worker" (not "no work"), the plan line counts the coordinator and both
workers, and the coordinator's memory is its own stage's FFN, not the whole model's.

The state is a real coordinator's: three peers over real links (aiortc, in a network namespace)
under ``--layout stages`` (:func:`tests.peer.coordinator.test_stages_loopback.stage_trio_status`);
the page and ``/dashboard/state`` are served by the real :class:`Dashboard` routes on
``http://localhost`` (a secure context: WebCrypto derives the token; no API checks it here).
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.dashboard import Dashboard
from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS
from tests.conftest import require
from tests.peer.coordinator.test_stages_loopback import stage_trio_status

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def serve_dashboard():
    """``serve(doc)`` → the port of a Dashboard serving the status document ``doc``."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers: list[TestServer] = []

    async def start(doc) -> int:
        app = web.Application()
        Dashboard(lambda: doc).add_routes(app)
        servers.append(TestServer(app, host="127.0.0.1"))
        await servers[-1].start_server()
        return servers[-1].port

    try:
        yield lambda doc: asyncio.run_coroutine_threadsafe(start(doc), loop).result(30)
    finally:
        for server in servers:
            asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_the_dashboard_names_the_stage_workers(tmp_path, serve_dashboard, playwright):
    require(os.path.exists(CHROMIUM), "Debian's Chromium at /usr/bin/chromium")
    doc, worker_docs, layout, _ = stage_trio_status(tmp_path)
    me, workers = doc["peer_id"], [w["peer_id"] for w in worker_docs]
    assert doc["placement"]["peers"] == [me]  # the per-layer plan holds the coordinator alone
    port = serve_dashboard(doc)
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    try:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"http://localhost:{port}/dashboard/#{SwarmKey(os.urandom(32)).code}")
        page.wait_for_function("document.querySelectorAll('#peers tbody tr').length === 3", timeout=20000)
        rows = page.eval_on_selector_all("#peers tbody tr", """rows => rows.map((r) => ({
            peer: r.dataset.peer, role: r.querySelector('.role').textContent,
            memory: r.children[4].textContent, words: r.querySelector('.share-words').textContent }))""")
        by_peer = {r["peer"]: r for r in rows}
        assert [r["peer"] for r in rows] == [s.peer for s in layout.stages]  # in layer order
        assert by_peer[me]["role"] == "coordinator"
        for w in workers:
            assert by_peer[w]["role"] == "worker", by_peer[w]
            assert by_peer[w]["words"].endswith("whole (attention, KV cache, MLP)")
        # Memory used: each peer's own layers' FFN, as the coordinator counted it (the coordinator
        # once showed the whole model's, its per-layer plan's count).
        plan_bytes = {p: doc["observed"]["peers"][p]["weight_bytes"] for p in (me, *workers)}
        whole = sum(plan_bytes.values())
        assert plan_bytes[me] < whole
        for p, held in plan_bytes.items():
            assert by_peer[p]["memory"].endswith(f"/ {held / 2**20:.2f} MiB"), (by_peer[p], held)
        assert "3 peers over 3 layers of whole-layer stages" in page.inner_text("#plan-summary")
        assert not errors, errors
    finally:
        browser.close()
