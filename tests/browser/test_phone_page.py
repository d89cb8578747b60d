"""The peer page as a phone shows it (412×915): state and share fit one screen, the share is
compressed ("layers 0–29: MLP rows 1280–1536") with its percentage, the state list grows only on
changes, loading counts finished slices too, nothing 404s on load, and Stop leaves the swarm.

Live: a Python coordinator Node and its signaling server (tests/browser/test_page_e2e.py's
PythonSwarm) with headless Chromium on this machine's LAN address.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from swarm.peer.net import messages as M
from swarm.peer.coordinator.planner import PeerCapacity, build_plan
from swarm.peer.plan import ModelShape
from swarm.peer.weights.slices import ModelSlicer, SliceSpan
from swarm.keys.swarmkey import SwarmKey
from tests.browser.test_page_e2e import PythonSwarm, _page_url, _wait_state, e2e_browser, lan_address, smollm2_path  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]

PHONE = {"width": 412, "height": 915}
# Set to a folder to keep screenshots of the page (docs/screenshots/ holds the ones the README shows).
SCREENSHOTS = os.environ.get("COLIBRI_SCREENSHOTS")


@pytest.fixture
def swarm(tmp_path):
    s = PythonSwarm(tmp_path, SwarmKey(os.urandom(32)), lan_address())
    yield s
    s.stop()


def _shot(page, name):
    if SCREENSHOTS:
        # bytes, not path=: Playwright would write the file from its loop's executor threads
        (Path(SCREENSHOTS) / name).write_bytes(page.screenshot())


def test_phone_page_fits_one_screen_and_says_what_it_holds(swarm, e2e_browser):
    from swarm.compute.model import load_model

    ctx = e2e_browser.new_context(ignore_https_errors=True, viewport=PHONE, device_scale_factor=1)
    page = ctx.new_page()
    failed, errors = [], []
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(_page_url(swarm, swarm.key.code, name="pixel"))
    _wait_state(page, "authenticated")
    link = swarm.browser_link()
    assert page.inner_text("#assigned") == "nothing yet"

    # A plan giving the page the same MLP rows of every SmolLM2 layer, and no weights yet:
    # the page says what it holds, and does not claim to serve.
    path = smollm2_path()
    shape = ModelShape.from_config(load_model(path).config)
    plan = build_plan(shape, PeerCapacity(swarm.node.peer_id, 0, 1.0),
                      [PeerCapacity(link.peer_id, link.hello.memory_budget, 0.2)], term=1, version=1)
    spans = {plan.dense_span(layer, link.peer_id) for layer in shape.dense_layers}
    assert len(spans) == 1, spans  # the same rows of every layer: one group in words
    (span,) = spans
    swarm.call(link.send(plan.to_message()))
    last = max(shape.dense_layers)
    page.wait_for_function("document.getElementById('assigned').textContent.startsWith('layers')", timeout=10000)
    assert page.inner_text("#assigned") == f"layers 0–{last}: MLP rows {span.start}–{span.stop}"
    pct = 100 * (span.stop - span.start) / shape.intermediate_size
    assert page.inner_text("#share-pct") == f"{round(pct)} %"
    held = page.eval_on_selector_all("#share-picture .share-held", "els => els.map((e) => +e.getAttribute('height'))")
    assert len(held) == last + 1 and all(h == pytest.approx(held[0]) and h > 0 for h in held)
    assert page.evaluate("window.colibri.state") == "authenticated"
    page.wait_for_timeout(2500)  # the page re-renders every second: no new state entries from that
    assert page.evaluate("window.colibri.events") == ["connecting", "authenticated"]

    # Two slices loading at once: the percentage counts the finished one too, so it never falls back.
    page.evaluate("""() => { window.seen = [];
      new MutationObserver(() => window.seen.push(document.getElementById('state').textContent))
        .observe(document.getElementById('state'), {childList: true, characterData: true, subtree: true}); }""")
    slicer = ModelSlicer(path)
    for layer in (0, 1):
        swarm.offer(*slicer.extract(SliceSpan(layer=layer, kind="dense", start=span.start, stop=span.stop)), chunk_size=16 << 10)
    _wait_state(page, "serving", 120)
    seen = [int(m.group(1)) for t in page.evaluate("window.seen") if (m := re.search(r"Loading weights (\d+) %", t))]
    assert seen and max(seen) > 0 and seen == sorted(seen), seen
    assert page.evaluate("window.colibri.events") == ["connecting", "authenticated", "loading", "serving"]

    # One screen: state, share and facts without scrolling.
    assert page.evaluate("document.documentElement.scrollHeight <= window.innerHeight"), \
        page.evaluate("[document.documentElement.scrollHeight, window.innerHeight]")
    for sel in ("#state", "#share-pct", "#share-picture", "#assigned", "#served", "#tps", "#gpu", "#stop"):
        box = page.locator(sel).bounding_box()
        assert box is not None and box["y"] + box["height"] <= PHONE["height"], (sel, box)
    _shot(page, "phone-page-phone.png")
    page.set_viewport_size({"width": 1280, "height": 800})
    _shot(page, "phone-page-laptop.png")

    # Stop leaves cleanly: the coordinator loses the link and the page stays out.
    page.click("#stop")
    _wait_state(page, "stopped", 10)
    swarm.call(_until(lambda: swarm.browser_link() is None))
    page.wait_for_timeout(3000)  # past the page's retry delay: it must not come back
    assert swarm.browser_link() is None and page.evaluate("window.colibri.state") == "stopped"
    assert not failed, failed  # no 404 on load (the icon is inline)
    assert not errors, errors
    ctx.close()


async def _until(predicate, timeout_s=15):
    import asyncio

    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")
