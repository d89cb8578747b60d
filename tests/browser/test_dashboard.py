"""The dashboard on the coordinator's API server, in headless Chromium: it derives the API token
from the key in the fragment exactly as Python does (shared vector), lists the peers with their
shares, streams a chat reply equal to `colibri-swarm generate --local`, and shows a killed
worker as an event.

Live: a coordinator (signaling server, Node, SwarmRoles with SmolLM2 and its API) on its own
event loop in a thread, and a worker that is a real `colibri-swarm join` process, killed with
SIGKILL. WebRTC and HTTPS on this machine's LAN address.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from swarm.compute.model import load_model
from swarm.keys.identity import Identity
from swarm.peer.node import Node
from swarm.peer.roles import SwarmRoles
from swarm.keys.swarmkey import SwarmKey
from swarm.signaling.server import SignalingServer
from tests.browser.test_page_e2e import E2E_ARGS, lan_address, smollm2_path
from tests.conftest import require

pytestmark = [pytest.mark.browser, pytest.mark.slow]

VECTORS = Path(__file__).resolve().parents[1] / "vectors"
LAPTOP = {"width": 1280, "height": 900}
PHONE = {"width": 412, "height": 915}
PROMPT, MAX_TOKENS = "Name three colours.", 12
SCREENSHOTS = os.environ.get("COLIBRI_SCREENSHOTS")  # a folder: keep screenshots (docs/screenshots/)


class Coordinator:
    """Signaling server + a Node with SwarmRoles (the most capable peer: it coordinates)."""

    def __init__(self, tmp_path: Path, key: SwarmKey, address: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.key, self.address, self.tmp = key, address, tmp_path
        self.call(self._start(), 120)

    def call(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self):
        ident = Identity.generate()
        self.server = SignalingServer(self.key.secret, ident.peer_id, config_dir=self.tmp)
        await self.server.start(self.address, 0)
        model = await asyncio.to_thread(load_model, smollm2_path())
        self.node = Node(swarm_key=self.key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                         name="coordinator", signal_url=self.server.url(self.address), ffn_gflops=1000.0,
                         memory_budget=1 << 30, status_path=self.tmp / "status.json", model_hash=model.content_hash())
        await self.node.start(timeout=10)
        self.roles = await SwarmRoles.create(self.node, model, api_host=self.address, startup_quiet_s=1.0)
        await self.roles.start()

    def stop(self):
        async def _stop():
            await self.roles.stop()
            await self.node.stop()
            await self.server.stop()
            await self.loop.shutdown_default_executor()
        self.call(_stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def _until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)
    return value


def _cli(*args: str, env: dict | None = None, **kw):
    return [sys.executable, "-m", "swarm", *args], {"env": {**os.environ, **(env or {})}, **kw}


@pytest.fixture
def swarm(tmp_path):
    require(os.path.exists("/usr/bin/chromium"), "Debian's Chromium at /usr/bin/chromium")
    coord = Coordinator(tmp_path, SwarmKey(os.urandom(32)), lan_address())
    cmd, kw = _cli("join", "--signal", f"{coord.address}:{coord.server.port}", "--key", coord.key.code,
                   "--name", "worker-linux", env={"COLIBRI_SWARM_CONFIG_DIR": str(tmp_path / "worker")})
    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **kw)
    try:
        yield coord, worker, tmp_path / "worker.log"
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait(10)
        log.close()
        coord.stop()


def test_dashboard_shows_the_swarm_chats_and_sees_a_worker_die(swarm, playwright, tmp_path):
    coord, worker, worker_log = swarm

    def planned():
        ffn = coord.roles.coordinator.ffn
        plan = ffn and (ffn.pending_plan or ffn.plan)
        workers = plan.workers() if plan else ()
        return workers[0] if len(workers) == 1 and coord.roles.coordinator.api_port else None

    # The local run's reply, computed while the worker joins and the page loads (it needs neither).
    cmd, kw = _cli("generate", "--local", "--max-tokens", str(MAX_TOKENS), PROMPT)
    reference = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    browser = None
    try:
        try:
            worker_id = _until(planned, 120, "the worker in the coordinator's plan")
        except AssertionError:
            raise AssertionError(f"no worker; its log:\n{worker_log.read_text()[-3000:]}") from None
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=E2E_ARGS)
        ctx = browser.new_context(ignore_https_errors=True, viewport=LAPTOP, device_scale_factor=1)
        page = ctx.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        scheme = getattr(coord.roles.coordinator.api, "scheme", None) or "http"  # HTTPS off loopback
        page.goto(f"{scheme}://{coord.address}:{coord.roles.coordinator.api_port}/dashboard/#{coord.key.code}")

        # The token the page derived from the fragment is Python's; and the shared vector holds.
        page.wait_for_function("window.colibriDashboard.token !== null", timeout=10000)
        assert page.evaluate("window.colibriDashboard.token") == coord.key.api_token
        v = json.loads((VECTORS / "swarm_key.json").read_text())
        got = page.evaluate("""async (keyHex) => {
            const m = await import("./dashboard.js"), a = await import("./auth.js");
            return m.apiToken(a.unhex(keyHex)); }""", v["key_hex"])
        assert got == v["api_token"] == SwarmKey(bytes.fromhex(v["key_hex"])).api_token

        # Both peers, with their kind, role and a share each; the shares add up to the model.
        page.wait_for_function("document.querySelectorAll('#peers tbody tr').length === 2 && "
                               "document.querySelector(`#peers tr[data-peer='" + worker_id + "'] .share-words`).textContent !== ''",
                               timeout=30000)
        rows = page.eval_on_selector_all("#peers tbody tr", """rows => rows.map((r) => ({
            peer: r.dataset.peer, text: r.innerText, pct: parseFloat(r.querySelector('.share-pct').textContent),
            bars: r.querySelectorAll('.share-held').length, words: r.querySelector('.share-words').textContent }))""")
        by_peer = {r["peer"]: r for r in rows}
        assert set(by_peer) == {coord.node.peer_id, worker_id}
        assert "worker-linux" in by_peer[worker_id]["text"] and "worker" in by_peer[worker_id]["text"]
        assert "coordinator" in by_peer[coord.node.peer_id]["text"]
        assert "Linux" in by_peer[worker_id]["text"]
        assert sum(r["pct"] for r in rows) == pytest.approx(100, abs=1.5)
        shape = coord.roles.coordinator.shape
        n_layers = len(set(shape.dense_layers) | set(shape.moe_layers))
        assert all(r["bars"] == n_layers for r in rows)
        from swarm.peer.status import describe_share  # the coordinator computes the shares; the page draws them

        placement = page.evaluate("window.colibriDashboard.state.placement")
        for r in rows:
            assert r["words"] == describe_share(placement, r["peer"]) != "nothing"
        # The rows in the plan's layer order, as the coordinator gave it (status lists its lines so).
        assert [r["peer"] for r in rows] == page.evaluate("window.colibriDashboard.state.shares.order")
        if SCREENSHOTS:
            (Path(SCREENSHOTS) / "dashboard-laptop.png").write_bytes(page.screenshot(full_page=True))

        # The chat box streams the greedy reply of `generate --local` (the CLI's parameters).
        out, err = reference.communicate(timeout=300)
        assert reference.returncode == 0, err
        expected = out.strip()
        assert expected
        page.click("#params summary")
        assert page.input_value("#temperature") == "0"  # greedy, as the CLI
        page.fill("#max_tokens", str(MAX_TOKENS))
        page.evaluate("""() => { window.pieces = 0; new MutationObserver(() => window.pieces++)
            .observe(document.getElementById('transcript'), {childList: true, characterData: true, subtree: true}); }""")
        page.fill("#prompt", PROMPT)
        page.click("#send")
        page.wait_for_function("document.querySelector('.msg.assistant') && !document.querySelector('.msg.streaming')",
                               timeout=120000)
        reply = page.inner_text(".msg.assistant")
        assert reply.strip() == expected
        assert page.evaluate("window.pieces") > 3  # it arrived piece by piece
        page.wait_for_function("document.querySelectorAll('#generations li').length >= 1", timeout=10000)
        assert f"{MAX_TOKENS} tokens" in page.inner_text("#generations") or "tokens in" in page.inner_text("#generations")
        if SCREENSHOTS:
            (Path(SCREENSHOTS) / "dashboard-laptop.png").write_bytes(page.screenshot(full_page=True))
            page.set_viewport_size(PHONE)
            (Path(SCREENSHOTS) / "dashboard-phone.png").write_bytes(page.screenshot())
            page.set_viewport_size(LAPTOP)

        # A worker killed outright: the dashboard's events say so.
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        replans = page.evaluate("window.colibriDashboard.state.events.filter((e) => e.what === 'replanned').length")
        assert page.locator(f"#events li[data-peer='{worker_id}'][data-what='link down']").count() == 0
        page.wait_for_selector(f"#events li[data-peer='{worker_id}'][data-what='link down']", timeout=30000)
        page.wait_for_function(f"window.colibriDashboard.state.events.filter((e) => e.what === 'replanned').length > {replans}",
                               timeout=30000)  # and its share went to the coordinator
        assert not errors, errors
        ctx.close()
    finally:
        if reference.poll() is None:  # the test failed before it needed the reply
            reference.kill()
            reference.communicate()
        if browser is not None:
            browser.close()
