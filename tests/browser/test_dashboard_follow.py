"""The dashboard follows the swarm's coordinator, in headless Chromium: open on a coordinator's API
server, the page moves to the next coordinator's within seconds of the first stepping down
(ApiServer.hand_over: a 503 coded ``coordinator_changed`` naming the next one, found on mDNS),
keeps the key in its fragment, and reads the new coordinator's state with the same token.

Two real API servers (HTTPS with the swarm's API CA, on every address, announced on mDNS) with
the real engine behind them, on an event loop in a thread; no election runs: stepping down is
the API's part of it, which is what the page sees.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time

import pytest

from swarm.compute.model import load_model
from swarm.compute.tokenizer import load_tokenizer
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.api import ApiServer
from swarm.peer.coordinator.api_engine import EngineBackend
from swarm.peer.coordinator.dashboard import Dashboard
from tests.browser.test_page_e2e import E2E_ARGS, lan_address, smollm2_path
from tests.conftest import require

pytestmark = [pytest.mark.browser, pytest.mark.slow]

FOLLOW_S = 15.0  # the page is on the next coordinator within this after the first steps down


def _status(key: SwarmKey, peer_id: str, name: str):
    doc = {"swarm_id": key.swarm_id, "peer_id": peer_id, "name": name, "role": "coordinator", "peers": [],
           "placement": None, "events": [], "observed": {}}
    return lambda: doc


@pytest.fixture
def two_coordinators():
    require(os.path.exists("/usr/bin/chromium"), "Debian's Chromium at /usr/bin/chromium")
    key = SwarmKey(os.urandom(32))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    call = lambda coro, t=60: asyncio.run_coroutine_threadsafe(coro, loop).result(t)  # noqa: E731
    path = smollm2_path()
    model, tok = load_model(path), load_tokenizer(path)
    servers = []

    async def start(peer_id: str, name: str, term: int) -> tuple[ApiServer, int]:
        api = ApiServer.for_swarm_key(EngineBackend(model, tok, model_id="m"), key)
        Dashboard(_status(key, peer_id, name)).attach(api)
        port = await api.start("0.0.0.0", 0, tls=True, advertise=(peer_id, term))
        servers.append(api)
        return api, port

    try:
        first = call(start("peer-first", "first", 1))
        second = call(start("peer-second", "second", 2))
        yield key, call, first, second
    finally:
        for api in servers:
            call(api.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_the_dashboard_follows_a_new_coordinator(two_coordinators, playwright):
    key, call, (first, first_port), (_, second_port) = two_coordinators
    address = lan_address()
    browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=E2E_ARGS)
    try:
        page = browser.new_context(ignore_https_errors=True).new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"https://{address}:{first_port}/dashboard/#{key.code}")
        page.wait_for_function("window.colibriDashboard.state !== null", timeout=15000)
        assert page.evaluate("window.colibriDashboard.state.name") == "first"

        call(first.hand_over())
        t0 = time.monotonic()
        page.wait_for_url(re.compile(rf"https://[^/]+:{second_port}/dashboard/#"), timeout=FOLLOW_S * 1000)
        page.wait_for_function("window.colibriDashboard.state !== null && window.colibriDashboard.state.name === 'second'",
                               timeout=10000)
        followed_s = time.monotonic() - t0
        assert page.evaluate("window.location.hash") == f"#{key.code}"  # the key went along, in the fragment only
        assert page.evaluate("window.colibriDashboard.token") == key.api_token
        assert first.successor is not None and first.successor.endswith(f":{second_port}")
        assert not errors, errors
        print(f'{{"event": "dashboard followed", "seconds": {followed_s:.2f}}}')
    finally:
        browser.close()
