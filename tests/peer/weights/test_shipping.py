"""Weight shipping core without sockets: pump a SliceSource into a SliceDownload.

The oracle is the blob itself: whatever path the transfer takes (drops, corrupt
chunks, duplicates, timeouts, a crash and restart from the cache file), the bytes
that come out must equal the bytes that went in, and a lie must be refused.
"""

from __future__ import annotations

import random

import pytest

from swarm.errors import LocalProtocolError, RemoteProtocolError, WeightIntegrityError
from swarm.keys.identity import Identity
from swarm.peer.weights.shipping import (
    MIN_CHUNK_SIZE,
    Chunk,
    ChunkAccepted,
    ChunkRejected,
    ChunkRequest,
    Manifest,
    SliceCache,
    SliceComplete,
    SliceDownload,
    SliceSource,
    build_manifest,
    sha256,
)

CS = MIN_CHUNK_SIZE  # small chunks: many of them in a small blob
# a Python peer's id is the hash of its DTLS certificate key: the linked tests use these two
COORDINATOR, WORKER = Identity.generate(), Identity.generate()


def _blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _pump(src: SliceSource, dl: SliceDownload, now: float = 0.0, *, tamper=None, drop_after: int | None = None):
    """Run the transfer; ``tamper(chunk) -> chunk | None`` models the link; returns all events."""
    events, delivered = [], 0
    for _ in range(10_000):
        if dl.complete:
            return events
        requests = dl.requests_to_send(now)
        if not requests:
            now = dl.get_timer() or now
            dl.handle_timer(now)
            continue
        for req in requests:
            for chunk in src.serve(req):
                if drop_after is not None and delivered >= drop_after:
                    return events
                chunk = tamper(chunk) if tamper else chunk
                if chunk is not None:
                    delivered += 1
                    events += dl.receive(chunk, now)
    raise AssertionError("transfer did not converge")


@pytest.mark.parametrize("size", [0, 1, CS - 1, CS, CS + 1, 5 * CS + 17])
def test_transfer_reproduces_blob_at_chunk_boundaries(size):
    blob = _blob(size)
    src = SliceSource()
    manifest = src.offer(blob, {"kind": "test"}, chunk_size=CS)
    assert manifest.slice_id == sha256(blob)
    buf = bytearray(size)
    dl = SliceDownload(manifest, buf, have=set() if size else None, window=3)
    events = _pump(src, dl)
    assert bytes(buf) == blob
    assert dl.complete and dl.missing == []
    if size:
        assert isinstance(events[-1], SliceComplete)
        assert sum(isinstance(e, ChunkAccepted) for e in events) == manifest.n_chunks


def test_window_bounds_chunks_in_flight():
    src = SliceSource()
    manifest = src.offer(_blob(10 * CS), {}, chunk_size=CS)
    dl = SliceDownload(manifest, bytearray(manifest.size), have=set(), window=4)
    (req,) = dl.requests_to_send(0.0)
    assert req.indices == (0, 1, 2, 3)
    assert dl.requests_to_send(0.0) == []  # window full
    dl.receive(src.serve(ChunkRequest(manifest.slice_id, (1,)))[0], 0.0)
    (req,) = dl.requests_to_send(0.0)
    assert req.indices == (4,)


def test_corrupt_chunk_is_refused_and_refetched():
    blob = _blob(6 * CS, seed=1)
    src = SliceSource()
    manifest = src.offer(blob, {}, chunk_size=CS)
    buf = bytearray(manifest.size)
    dl = SliceDownload(manifest, buf, have=set())
    corrupted = set()

    def flip_once(chunk: Chunk) -> Chunk:
        if chunk.index in (2, 5) and chunk.index not in corrupted:
            corrupted.add(chunk.index)
            bad = bytearray(chunk.data)
            bad[7] ^= 0x40
            return Chunk(chunk.slice_id, chunk.index, bytes(bad))
        return chunk

    events = _pump(src, dl, tamper=flip_once)
    rejected = [e for e in events if isinstance(e, ChunkRejected)]
    assert [e.index for e in rejected] == [2, 5] and "SHA-256" in rejected[0].reason
    assert bytes(buf) == blob and dl.corrupt_chunks == 2


def test_truncated_chunk_is_refused():
    src = SliceSource()
    manifest = src.offer(_blob(2 * CS), {}, chunk_size=CS)
    dl = SliceDownload(manifest, bytearray(manifest.size), have=set())
    events = dl.receive(Chunk(manifest.slice_id, 0, b"\0" * 10), 0.0)
    assert isinstance(events[0], ChunkRejected) and "length" in events[0].reason
    assert dl.missing == [0, 1]


def test_persistently_corrupt_source_fails_with_integrity_error():
    src = SliceSource()
    manifest = src.offer(_blob(3 * CS), {}, chunk_size=CS)
    dl = SliceDownload(manifest, bytearray(manifest.size), have=set())
    with pytest.raises(WeightIntegrityError, match="chunk 1"):
        _pump(src, dl, tamper=lambda c: Chunk(c.slice_id, c.index, b"x" * len(c.data)) if c.index == 1 else c)


def test_manifest_whose_chunks_disagree_with_whole_hash_is_refused():
    blob = _blob(3 * CS)
    honest = build_manifest(blob, {}, chunk_size=CS)
    lying = Manifest(sha256(b"something else"), honest.size, CS, honest.chunk_sha256)
    dl = SliceDownload(lying, bytearray(lying.size), have=set())
    src = SliceSource()
    src._blobs[lying.slice_id] = (lying, memoryview(blob))  # a source that serves the lie
    with pytest.raises(WeightIntegrityError, match="whole blob"):
        _pump(src, dl)


def test_link_drop_resumes_with_only_missing_chunks():
    blob = _blob(9 * CS, seed=2)
    src = SliceSource()
    manifest = src.offer(blob, {}, chunk_size=CS)
    buf = bytearray(manifest.size)
    dl = SliceDownload(manifest, buf, have=set(), window=4)
    _pump(src, dl, drop_after=5)
    assert sorted(set(range(9)) - set(dl.missing)) == [0, 1, 2, 3, 4]
    dl.link_lost()
    (req,) = dl.requests_to_send(100.0)
    assert req.indices == (5, 6, 7, 8)  # nothing already verified is asked for again
    for chunk in src.serve(req):
        dl.receive(chunk, 100.0)
    assert dl.complete and bytes(buf) == blob


def test_unanswered_request_is_resent_after_timeout_and_late_duplicate_ignored():
    src = SliceSource()
    manifest = src.offer(_blob(2 * CS), {}, chunk_size=CS)
    dl = SliceDownload(manifest, bytearray(manifest.size), have=set(), timeout_s=5.0)
    (req,) = dl.requests_to_send(0.0)
    assert dl.get_timer() == 5.0
    dl.handle_timer(4.9)
    assert dl.requests_to_send(4.9) == []
    dl.handle_timer(5.0)
    (again,) = dl.requests_to_send(5.0)
    assert again.indices == req.indices
    chunks = src.serve(again)
    assert [type(e) for e in dl.receive(chunks[0], 6.0)] == [ChunkAccepted]
    assert dl.receive(chunks[0], 6.0) == []  # the first request's answer arriving late
    events = dl.receive(chunks[1], 6.0)
    assert isinstance(events[-1], SliceComplete)


class _CountingSet(set):
    """A set that counts membership probes (the work ``requests_to_send`` does per chunk)."""

    probes = 0

    def __contains__(self, item):
        type(self).probes += 1
        return super().__contains__(item)


def test_requests_cost_constant_amortised_work_per_chunk():
    """A slice of n chunks costs O(n) membership probes in all (a scan of the missing chunks per
    request would cost O(n) per request: n²/window), timeouts and a link drop included."""
    n = 4096
    blob = _blob(n * CS, seed=11)
    src = SliceSource()
    manifest = src.offer(blob, {}, chunk_size=CS)
    buf = bytearray(manifest.size)
    dl = SliceDownload(manifest, buf, have=set(), window=8, timeout_s=1.0)
    dl._have = _CountingSet()
    _CountingSet.probes = 0
    lost = {5, 6, 2000}  # answers that never come: asked for again after the timeout

    def link(chunk):
        if chunk.index in lost:
            lost.discard(chunk.index)
            return None
        return chunk

    _pump(src, dl, drop_after=1000, tamper=link)
    dl.link_lost()
    _pump(src, dl, tamper=link)
    assert bytes(buf) == blob
    assert _CountingSet.probes < 8 * n, _CountingSet.probes


def test_streamed_chunks_are_vouched_for_by_the_whole_hash():
    """An in-order stream is checked once, by the whole-slice hash; when that fails, each
    streamed chunk is checked by its own hash and only the bad one is asked for again; a
    stream cut short keeps the chunks that match their own hashes."""
    blob = _blob(6 * CS + 5, seed=12)
    manifest = build_manifest(blob, {}, chunk_size=CS)
    spans = [manifest.chunk_span(i) for i in range(manifest.n_chunks)]

    buf = bytearray(manifest.size)
    dl = SliceDownload(manifest, buf, have=set())
    events = [e for i, (a, b) in enumerate(spans) for e in dl.receive_streamed(i, blob[a:b])]
    assert isinstance(events[-1], SliceComplete) and dl.complete and bytes(buf) == blob
    assert dl.corrupt_chunks == 0

    bad = bytearray(blob)
    bad[3 * CS + 7] ^= 1
    buf = bytearray(manifest.size)
    dl = SliceDownload(manifest, buf, have=set())
    events = [e for i, (a, b) in enumerate(spans) for e in dl.receive_streamed(i, bad[a:b])]
    assert [e for e in events if isinstance(e, ChunkRejected)] == [ChunkRejected(3, "SHA-256 mismatch")]
    assert not dl.complete and dl.missing == [3] and dl.done_bytes == manifest.size - CS
    (req,) = dl.requests_to_send(0.0)
    assert req.indices == (3,)
    a, b = spans[3]
    assert isinstance(dl.receive_streamed(3, blob[a:b])[-1], SliceComplete) and bytes(buf) == blob

    buf = bytearray(manifest.size)
    dl = SliceDownload(manifest, buf, have=set())
    for i in range(4):
        a, b = spans[i]
        dl.receive_streamed(i, (bad if i == 3 else blob)[a:b])
    assert [e.index for e in dl.check_streamed()] == [3]  # the stream broke off after chunk 3
    assert dl.missing == [3, 4, 5, 6] and dl.done_bytes == 3 * CS
    for i in (3, 4, 5, 6):
        a, b = spans[i]
        events = dl.receive_streamed(i, blob[a:b])
    assert isinstance(events[-1], SliceComplete) and bytes(buf) == blob


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda m: Manifest(m.slice_id[:5], m.size, m.chunk_size, m.chunk_sha256), "32-byte"),
        (lambda m: Manifest(m.slice_id, -1, m.chunk_size, m.chunk_sha256), "size"),
        (lambda m: Manifest(m.slice_id, m.size, 7, m.chunk_sha256), "chunk size"),
        (lambda m: Manifest(m.slice_id, m.size, m.chunk_size, m.chunk_sha256[:-1]), "chunk hashes"),
        (lambda m: Manifest(m.slice_id, m.size, m.chunk_size, (b"x",) * m.n_chunks), "chunk hash"),
        (lambda m: Manifest(m.slice_id, m.size, m.chunk_size, m.chunk_sha256, meta=[1]), "meta"),
    ],
)
def test_malformed_manifest_is_refused(mutate, match):
    good = build_manifest(_blob(3 * CS), {}, chunk_size=CS)
    with pytest.raises(RemoteProtocolError, match=match):
        mutate(good).validate()
    with pytest.raises(RemoteProtocolError):
        Manifest.from_json({**good.to_json(), "chunk_sha256": ["zz"]})
    assert Manifest.from_json(good.to_json()) == good


def test_source_refuses_bad_requests_and_download_refuses_foreign_chunks():
    src = SliceSource()
    manifest = src.offer(_blob(2 * CS), {}, chunk_size=CS)
    with pytest.raises(RemoteProtocolError, match="index 2"):
        src.serve(ChunkRequest(manifest.slice_id, (0, 2)))
    with pytest.raises(RemoteProtocolError, match="indices"):
        src.serve(ChunkRequest(manifest.slice_id, ()))
    with pytest.raises(RemoteProtocolError, match="no slice"):
        src.serve(ChunkRequest(sha256(b"other"), (0,)))
    dl = SliceDownload(manifest, bytearray(manifest.size), have=set())
    with pytest.raises(RemoteProtocolError, match="expected"):
        dl.receive(Chunk(sha256(b"other"), 0, b""), 0.0)
    with pytest.raises(RemoteProtocolError, match="outside"):
        dl.receive(Chunk(manifest.slice_id, -1, b""), 0.0)
    with pytest.raises(LocalProtocolError):
        SliceDownload(manifest, bytearray(5))


def test_cache_resumes_after_crash_and_rejoin_is_instant(tmp_path):
    blob = _blob(7 * CS + 3, seed=3)
    src = SliceSource()
    manifest = src.offer(blob, {"layer": 0}, chunk_size=CS)
    cache = SliceCache(tmp_path)
    assert cache.get(manifest) is None
    dl = cache.open_download(manifest, window=2)
    _pump(src, dl, drop_after=3)
    del dl  # the worker process dies: only the .part file remains

    resumed = cache.open_download(manifest, window=2)  # chunks on disk are re-verified
    assert resumed.missing == [3, 4, 5, 6, 7]
    served = []
    _pump(src, resumed, tamper=lambda c: served.append(c.index) or c)
    assert served == [3, 4, 5, 6, 7]
    assert bytes(cache.finish(resumed)) == blob

    again = cache.get(manifest)  # a rejoin: nothing to ship
    assert again is not None and bytes(again) == blob
    # A cached file damaged on disk is dropped and fetched again rather than trusted.
    path = tmp_path / f"{manifest.hex_id}.bin"
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    assert cache.get(manifest) is None and not path.exists()


# ---------------------------------------------------------------------------- over a real link


def _run_in_netns(coro_factory, timeout_s: float = 90.0):
    """``asyncio.run(coro_factory())`` in a thread inside a fresh network namespace ``csd-…``."""
    from tests.peer._links import run_in_netns

    return run_in_netns(coro_factory, timeout_s, prefix="csd", address="10.214.0.1")


async def _linked_pair(coordinator_id: str, worker_id: str):
    import asyncio

    import numpy as np

    from swarm.peer.net import wire
    from swarm.peer.net.link import Link, new_peer_connection
    from swarm.peer.net.messages import Hello, NumericBuild
    from swarm.keys.swarmkey import SwarmKey

    key = SwarmKey(bytes(range(32)))

    def make(peer_id, expected, offerer):
        cert = {COORDINATOR.peer_id: COORDINATOR, WORKER.peer_id: WORKER}[peer_id].rtc_certificate()
        pc, channel = new_peer_connection(cert)
        build = NumericBuild(package="test", numpy=np.__version__, blas="?", arch="x86_64", kernel_dtype="f32")
        hello = Hello(peer_id=peer_id, protocol_version=wire.PROTOCOL_VERSION, build=build, model_hash=None,
                      memory_budget=1 << 30, ffn_gflops=1.0, peer_kind="python", adapter_limits={},
                      adapter_features=(), name=peer_id[:1])
        return Link(pc, channel, certificate=cert, auth_key=key.channel_auth_key, local_hello=hello,
                    offerer=offerer, expected_peer_id=expected)

    a, b = make(coordinator_id, worker_id, True), make(worker_id, coordinator_id, False)
    await a.accept_answer(await b.accept_offer(await a.create_offer()))
    await asyncio.gather(a.established(), b.established())
    return a, b


@pytest.mark.slow
def test_slice_ships_over_a_real_link_survives_a_drop_and_a_corrupt_chunk(tmp_path):
    """A SmolLM2 slice crosses an authenticated aiortc link; the link drops mid-transfer, a new
    link resumes with only the missing chunks; a corrupted chunk is refused and re-fetched; the
    decoded weights equal a local load of the same slice."""
    import asyncio
    import dataclasses

    import numpy as np

    from swarm.compute.default_model import default_model_path
    from swarm.errors import PeerLostError
    from swarm.peer.weights.shipping_aio import SliceFetcher, SliceServer
    from swarm.peer.weights.slices import ModelSlicer, SliceSpan, decode_slice

    slicer = ModelSlicer(default_model_path())
    spec = SliceSpan(2, "dense", 0, 1536)
    blob, meta = slicer.extract(spec)
    model_hash = "ab" * 32
    coordinator, worker = COORDINATOR.peer_id, WORKER.peer_id
    source = SliceSource()
    manifest = source.offer(blob, meta, chunk_size=64 << 10)  # ~26 chunks of 64 KiB
    cache = SliceCache(tmp_path)

    async def main():
        served: list[list[int]] = []
        progress: list[int] = []

        # First link: the coordinator corrupts chunk 1 once, and drops the link after 6 chunks.
        a, b = await _linked_pair(coordinator, worker)
        server = SliceServer(source, model_hash)
        first: list[int] = []
        served.append(first)
        original = server._chunk_message

        def tampering(req, m, chunk):
            msg = original(req, m, chunk)
            first.append(chunk.index)
            if chunk.index == 1 and first.count(1) == 1:
                msg = dataclasses.replace(msg, data=msg.data[::-1].copy())  # reversed: the SHA-256 fails
            if len(first) == 6:
                asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(a.close("drop")))
            return msg

        server._chunk_message = tampering
        server.attach(a)
        fetcher = SliceFetcher(b, model_hash, cache, window=4)
        await server.offer(a, manifest)
        offered = await asyncio.wait_for(fetcher.offers.get(), 10)
        assert offered == manifest
        try:
            await fetcher.fetch(offered, progress=lambda done, total: progress.append(done))
            raise AssertionError("the fetch should have lost its link")
        except PeerLostError:
            pass
        await b.close()

        # Second link: resume.
        a2, b2 = await _linked_pair(coordinator, worker)
        server2 = SliceServer(source, model_hash)
        second: list[int] = []
        served.append(second)
        original2 = server2._chunk_message
        server2._chunk_message = lambda req, m, chunk: (second.append(chunk.index), original2(req, m, chunk))[1]
        server2.attach(a2)
        fetcher2 = SliceFetcher(b2, model_hash, cache, window=4)
        got = await fetcher2.fetch(manifest)
        again = await fetcher2.fetch(manifest)  # a rejoin: from the cache, nothing sent
        sent_after = len(second)
        await a2.close()
        await b2.close()
        return served, bytes(got), bytes(again), sent_after, progress

    (first, second), got, again, sent_after, progress = _run_in_netns(main)
    assert got == blob == again
    assert first.count(1) == 2  # refused once, fetched again on the same link
    assert len(second) == sent_after < manifest.n_chunks  # the resume did not start over
    assert set(first) | set(second) == set(range(manifest.n_chunks))
    assert progress and progress[-1] < manifest.size
    w = decode_slice(got, manifest.meta)
    local = slicer.load(spec)
    np.testing.assert_array_equal(w.down, local.down)
    np.testing.assert_array_equal(w.gate, local.gate)


@pytest.mark.slow
def test_worker_without_the_model_gets_its_plan_slices_and_answers_like_one_with_it(tmp_path):
    """The coordinator ships a plan's slices over a real link to a worker that has no model file;
    the worker, built on what it received, answers requests bit-identically to a worker that
    loaded the model itself."""
    import asyncio

    import numpy as np

    from swarm.compute.model import load_model
    from swarm.peer.net import messages as M
    from swarm.peer.coordinator.planner import PeerCapacity, build_plan
    from swarm.peer.plan import ModelShape
    from swarm.peer.weights.shipping_aio import PlanShipper, SliceFetcher, fetch_plan_slices, shape_from_meta
    from swarm.peer.weights.slices import specs_for
    from swarm.peer.worker.ffn import Worker
    from tests.peer._swarm_models import build

    path = build("qwen3_moe", tmp_path)  # MoE layers 0 and 2, dense layer 1
    model = load_model(path)
    shape = ModelShape.from_config(model.config)
    coordinator, worker_id = COORDINATOR.peer_id, WORKER.peer_id
    plan = build_plan(shape, PeerCapacity(coordinator, 0, 1.0), [PeerCapacity(worker_id, 10**9, 1.0)], term=3, version=1)
    specs = specs_for(plan, worker_id)

    async def main():
        a, b = await _linked_pair(coordinator, worker_id)
        shipper = PlanShipper(path, model.content_hash(), shape, chunk_size=MIN_CHUNK_SIZE,
                              store=SliceCache(tmp_path / "coordinator-cache"))
        shipper.attach(a)
        fetcher = SliceFetcher(b, model.content_hash(), SliceCache(tmp_path / "worker-cache"))
        sent, (shipped, received_shape) = await asyncio.gather(shipper.offer_plan(a, plan),
                                                               fetch_plan_slices(fetcher, specs))
        await a.close()
        await b.close()
        return sent, shipped, received_shape

    sent, shipped, received_shape = _run_in_netns(main)
    assert len(sent) == len(specs)
    assert received_shape == shape_from_meta(sent[0].meta) == shape
    ours, reference = Worker(worker_id, received_shape, shipped), Worker(worker_id, shape, model)
    for w in (ours, reference):
        w.accept_plan(plan)
    x = np.random.default_rng(5).standard_normal((4, shape.hidden_size)).astype(np.float32)
    for spec in specs:
        if spec.kind == "experts":
            ids = np.arange(spec.start, spec.stop, dtype=np.int32)
            counts = np.zeros(len(ids), np.int32)
            counts[0] = 4
            req = M.ExpertRequest(9, 3, 1, spec.layer, ids, counts, x)
        else:
            req = M.DenseRequest(9, 3, 1, spec.layer, ((spec.start, spec.stop),), x)
        got, want = ours.handle(req), reference.handle(req)
        assert not isinstance(got, M.Error), got
        np.testing.assert_array_equal(getattr(got, "outputs", None) if spec.kind == "experts" else got.partials,
                                      getattr(want, "outputs", None) if spec.kind == "experts" else want.partials)
    with pytest.raises(RemoteProtocolError, match="shape"):
        shape_from_meta({"shape": {**sent[0].meta["shape"], "hidden_size": "big"}})
