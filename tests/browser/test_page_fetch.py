"""The peer page fetches its weight slices over HTTPS range requests (web_peer/storage.js
fetchSliceHttps) from a slice server on another port than the page's own origin (CORS), with the
bearer token from the offer; the data channel carries no chunk. A chunk tampered with on the
server is refused and fetched again. A refused token makes the page
say so and pull the slice over the data channel instead; a reload takes the slice from Cache
Storage. Oracles: the numpy twins of the page's kernels on the decoded slice, and the servers'
counts of bytes sent on each path.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from swarm.peer.net.messages import DenseAnswer, DenseRequest, ExpertAnswer, ExpertRequest, HttpsSource
from swarm.peer.weights.slice_http import SliceHttpServer
from swarm.peer.weights.slices import ModelSlicer, SliceSpan, decode_slice
from swarm.signaling import tls
from tests.browser.test_page_e2e import (  # noqa: F401 - fixtures
    _page_url, _rel, _wait_state, e2e_browser, expert_slice, smollm2_path, swarm,
)
from web_peer import kernels as K

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def start_slice_server(swarm) -> SliceHttpServer:
    """An HTTPS slice server of the swarm's slices, in its loop, with the signaling host's certificate."""
    cert = tls.load_or_create(swarm.tmp)

    async def start():
        http = SliceHttpServer(swarm.source, swarm.key.slice_token_key, cert.ssl_context(), cert.sha256,
                               host=swarm.address, addresses=[swarm.address])
        await http.start()
        return http

    return swarm.call(start())


def browser_link(swarm, other_than=None, timeout_s: float = 20.0):
    """The page's link once this side has it too (the page may say "authenticated" first)."""
    deadline = time.monotonic() + timeout_s
    while (link := swarm.browser_link()) is None or link is other_than:
        assert time.monotonic() < deadline, "the coordinator never saw the page's link"
        time.sleep(0.05)
    return link


def test_page_fetches_slices_over_https_and_falls_back_to_the_channel(swarm, e2e_browser):
    ctx = e2e_browser.new_context(ignore_https_errors=True)  # the slice server's self-signed certificate
    page = ctx.new_page()
    errors, console = [], []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda msg: console.append(msg.text))
    page.goto(_page_url(swarm, swarm.key.code))
    _wait_state(page, "authenticated")
    link = browser_link(swarm)
    http = start_slice_server(swarm)
    try:
        assert http.port != swarm.server.port  # another origin than the page's

        # A real SmolLM2 dense slice (Q4_1 blocks) over HTTPS: the data channel carries none of it.
        slicer = ModelSlicer(smollm2_path())
        blob, meta = slicer.extract(SliceSpan(layer=3, kind="dense", start=256, stop=768))
        manifest = swarm.source.offer(blob, meta, chunk_size=64 << 10)
        offer = http.source_for(manifest)
        assert offer.urls == (f"https://{swarm.address}:{http.port}",)
        swarm.call(swarm.slices.offer(link, manifest, offer))
        _wait_state(page, "serving")
        # the server counts a piece once its write has drained, which may be after the page has it
        deadline = time.monotonic() + 10
        while http.sent_bytes < len(blob) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert http.sent_bytes == len(blob)
        assert swarm.slices.sent_bytes.get(link.peer_id, 0) == 0
        stats = page.evaluate("window.colibri.worker.stats")
        assert stats["httpsBytes"] == len(blob) and stats["fetchedBytes"] == 0 and stats["channelFallbacks"] == 0
        w = decode_slice(blob, meta)
        x = np.random.default_rng(1).standard_normal((3, 576)).astype(np.float32)
        ans = swarm.request(DenseRequest(request_id=7, term=0, plan_version=0, layer=3, ranges=((256, 768),), x=x))
        assert isinstance(ans, DenseAnswer), ans
        assert _rel(ans.partials[0], K.dense_range(x, w.gate, w.up, w.down)) <= 1e-5

        # A token for another slice is refused (403): the page says so and takes the data channel.
        rng = np.random.default_rng(2)
        eblob, emeta, eg, eu, ed = expert_slice(rng, layer=1, start=4, n=2, h=64, f=96)
        emanifest = swarm.source.offer(eblob, emeta, chunk_size=64 << 10)
        wrong = HttpsSource(offer.urls, offer.cert_sha256, offer.token)  # the dense slice's token
        swarm.call(swarm.slices.offer(link, emanifest, wrong))
        page.wait_for_function("window.colibri.worker.blocks.size === 3", timeout=30000)
        assert http.sent_bytes == len(blob)
        assert swarm.slices.sent_bytes[link.peer_id] == len(eblob)
        assert page.evaluate("window.colibri.worker.stats.channelFallbacks") == 1
        assert any("refused the token (403" in c and "over the data channel" in c for c in console), console
        rows = rng.standard_normal((2, 64)).astype(np.float32)
        ans = swarm.request(ExpertRequest(request_id=8, term=0, plan_version=0, layer=1, expert_ids=np.array([5], np.int32),
                                          row_counts=np.array([2], np.int32), rows=rows))
        assert isinstance(ans, ExpertAnswer), ans
        assert _rel(ans.outputs, K.swiglu_ffn(rows, eg[1], eu[1], ed[1])) <= 1e-5

        # A chunk tampered with once on the server is refused by the page and fetched again.
        tblob, tmeta, tg, tu, td = expert_slice(rng, layer=2, start=0, n=2, h=64, f=96)
        tmanifest = swarm.source.offer(tblob, tmeta, chunk_size=16 << 10)
        served_views = []
        real_view = swarm.source.view

        def tampered_once(slice_id):  # the first answer for this slice carries a flipped byte in chunk 1
            view = real_view(slice_id)
            served_views.append(slice_id)
            if slice_id == tmanifest.slice_id and served_views.count(slice_id) == 1:
                bad = bytearray(view)
                bad[(16 << 10) + 5] ^= 0xFF
                return memoryview(bad)
            return view

        swarm.source.view = tampered_once
        before = http.sent_bytes
        swarm.call(swarm.slices.offer(link, tmanifest, http.source_for(tmanifest)))
        page.wait_for_function("window.colibri.worker.blocks.size === 5", timeout=30000)
        assert http.sent_bytes - before == len(tblob) + (16 << 10)  # chunk 1 twice, nothing else again
        assert any("chunk 1 refused (SHA-256 mismatch)" in c for c in console), console
        assert page.evaluate("window.colibri.worker.stats.channelFallbacks") == 1  # still only the 403 one
        ans = swarm.request(ExpertRequest(request_id=9, term=0, plan_version=0, layer=2, expert_ids=np.array([1], np.int32),
                                          row_counts=np.array([2], np.int32), rows=rows))
        assert isinstance(ans, ExpertAnswer), ans
        assert _rel(ans.outputs, K.swiglu_ffn(rows, tg[1], tu[1], td[1])) <= 1e-5

        # Reload: the HTTPS-fetched slice comes from Cache Storage; nothing is fetched again.
        page.reload()
        _wait_state(page, "authenticated")
        link2 = browser_link(swarm, other_than=link)
        swarm.call(swarm.slices.offer(link2, manifest, offer))
        _wait_state(page, "serving")
        assert page.evaluate("window.colibri.worker.stats.cachedSlices") == 1
        assert http.sent_bytes == len(blob) + len(tblob) + (16 << 10)
        assert not errors, errors
    finally:
        swarm.call(http.close())
        ctx.close()
