"""Bulk slice shipping over HTTPS range requests (swarm/peer/weights/slice_http.py) on real sockets.

Oracles: the blob itself (what comes out equals what went in), the manifest's hashes, and the
server's count of bytes sent (a resume must not start over). TLS is real, with the shipper's
certificate pinned by its SHA-256; tokens come from a real swarm key.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import random

import aiohttp
import pytest

from swarm.errors import WeightIntegrityError
from swarm.peer.net.messages import HttpsSource
from swarm.peer.weights.shipping import MIN_CHUNK_SIZE, SliceCache, SliceSource
from swarm.peer.weights.slice_http import SliceHttpServer, SliceUnreachable, fetch_https, slice_token
from swarm.keys.swarmkey import SwarmKey
from swarm.signaling import tls

KEY = SwarmKey(bytes(range(32)))
CS = 64 << 10


def _blob(n: int, seed: int = 0) -> bytearray:
    return bytearray(random.Random(seed).randbytes(n))


@pytest.fixture
def cert(tmp_path):
    return tls.load_or_create(tmp_path)


async def _server(source: SliceSource, cert, key: SwarmKey = KEY) -> SliceHttpServer:
    server = SliceHttpServer(source, key.slice_token_key, cert.ssl_context(), cert.sha256, host="127.0.0.1",
                             addresses=["127.0.0.1"])
    await server.start()
    return server


def _at(source: HttpsSource, base: str) -> HttpsSource:
    return HttpsSource(urls=(base,), cert_sha256=source.cert_sha256, token=source.token)


def test_token_is_bound_to_the_slice_and_the_key():
    a, b = bytes(32), bytes([1]) + bytes(31)
    assert slice_token(KEY.slice_token_key, a) != slice_token(KEY.slice_token_key, b)
    assert slice_token(KEY.slice_token_key, a) != slice_token(SwarmKey(bytes(32)).slice_token_key, a)
    assert KEY.secret.hex() not in slice_token(KEY.slice_token_key, a)
    assert len(slice_token(KEY.slice_token_key, a)) == 64


@pytest.mark.parametrize("size", [1, CS - 1, CS, 5 * CS + 17])
def test_slice_ships_over_https_with_hash_checks(tmp_path, cert, size):
    blob = _blob(size, size)
    source = SliceSource()
    manifest = source.offer(blob, {"kind": "test"}, chunk_size=max(CS, MIN_CHUNK_SIZE))

    async def main():
        server = await _server(source, cert)
        try:
            offer = server.source_for(manifest)
            dl = SliceCache(tmp_path / "cache").open_download(manifest)
            progress = []
            await fetch_https(dl, offer, progress=lambda done, total: progress.append((done, total)))
            return offer, SliceCache(tmp_path / "cache").finish(dl), progress, server.sent_bytes
        finally:
            await server.close()

    offer, got, progress, sent = asyncio.run(main())
    assert bytes(got) == bytes(blob)
    assert offer.urls == (f"https://127.0.0.1:{offer.urls[0].rsplit(':', 1)[1]}",)
    assert offer.cert_sha256 == cert.sha256.hex()
    assert progress[-1] == (size, size) and sent == size


def test_server_refuses_absent_and_wrong_tokens_and_bad_ranges(cert):
    blob = _blob(3 * CS + 5)
    source = SliceSource()
    manifest = source.offer(blob, {}, chunk_size=CS)
    other = source.offer(_blob(CS, 9), {}, chunk_size=CS)

    async def main():
        server = await _server(source, cert)
        base = f"https://127.0.0.1:{server.port}/slices/"
        url = base + manifest.hex_id
        good = {"Authorization": "Bearer " + slice_token(KEY.slice_token_key, manifest.slice_id)}
        out = {}
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=aiohttp.Fingerprint(cert.sha256))) as s:
                async def get(name, u=url, **headers):
                    async with s.get(u, headers=headers) as r:
                        out[name] = (r.status, dict(r.headers), await r.read())

                await get("absent")
                await get("garbled", Authorization="Basic abc")
                await get("other slice's token", Authorization="Bearer " + slice_token(KEY.slice_token_key, other.slice_id))
                await get("other swarm", Authorization="Bearer " + slice_token(SwarmKey(bytes(32)).slice_token_key, manifest.slice_id))
                await get("whole", **good)
                await get("middle", **good, Range="bytes=10-99")
                await get("open end", **good, Range=f"bytes={3 * CS}-")
                await get("suffix", **good, Range="bytes=-7")
                await get("past end", **good, Range=f"bytes={len(blob)}-")
                await get("malformed", **good, Range="bytes=5-2")
                await get("two ranges", **good, Range="bytes=0-1,5-6")
                await get("not an id", base + "x" * 64, **good)
                unknown = bytes(range(32))
                await get("unknown", base + unknown.hex(), Authorization="Bearer " + slice_token(KEY.slice_token_key, unknown))
                async with s.options(url, headers={"Origin": "https://192.168.1.2:8443",
                                                   "Access-Control-Request-Headers": "authorization,range"}) as r:
                    out["preflight"] = (r.status, dict(r.headers), b"")
        finally:
            await server.close()
        return out, server.sent_bytes

    out, sent = asyncio.run(main())
    b = bytes(blob)
    assert out["absent"][0] == 401 and "Bearer" in out["absent"][1]["WWW-Authenticate"]
    assert out["garbled"][0] == 401
    assert out["other slice's token"][0] == 403 and b"does not open this slice" in out["other slice's token"][2]
    assert out["other swarm"][0] == 403
    assert out["whole"][0] == 200 and out["whole"][2] == b
    assert out["middle"][0] == 206 and out["middle"][2] == b[10:100]
    assert out["middle"][1]["Content-Range"] == f"bytes 10-99/{len(b)}"
    assert out["open end"][2] == b[3 * CS:] and out["suffix"][2] == b[-7:]
    for name in ("past end", "malformed", "two ranges"):
        status, headers, text = out[name]
        assert status == 416 and headers["Content-Range"] == f"bytes */{len(b)}", name
        assert b"Range" in text, name
    assert out["not an id"][0] == 404 and b"not a slice id" in out["not an id"][2]
    assert out["unknown"][0] == 404 and b"no slice" in out["unknown"][2]
    status, headers, _ = out["preflight"]
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "*"
    assert "Range" in headers["Access-Control-Allow-Headers"] and "Authorization" in headers["Access-Control-Allow-Headers"]
    assert "Content-Range" in headers["Access-Control-Expose-Headers"]
    # Refused requests sent no slice bytes.
    assert sent == len(b) + 90 + (len(b) - 3 * CS) + 7


def test_fetch_refuses_a_wrong_token_a_wrong_certificate_and_an_unreachable_server(tmp_path, cert):
    source = SliceSource()
    manifest = source.offer(_blob(2 * CS), {}, chunk_size=CS)

    async def main():
        server = await _server(source, cert)
        offer = server.source_for(manifest)
        errors = {}
        try:
            for name, bad in {
                "token": HttpsSource(offer.urls, offer.cert_sha256, slice_token(KEY.slice_token_key, bytes(32))),
                "certificate": HttpsSource(offer.urls, "00" * 32, offer.token),
            }.items():
                dl = SliceCache(tmp_path / name).open_download(manifest)
                with pytest.raises(SliceUnreachable) as info:
                    await fetch_https(dl, bad)
                errors[name] = str(info.value)
        finally:
            await server.close()
        dl = SliceCache(tmp_path / "gone").open_download(manifest)
        with pytest.raises(SliceUnreachable) as info:
            await fetch_https(dl, offer)  # the server is gone: connection refused
        errors["gone"] = str(info.value)
        return errors, server.sent_bytes

    errors, sent = asyncio.run(main())
    assert "refused the token (403" in errors["token"]
    assert "does not match the pinned SHA-256" in errors["certificate"]
    assert "no slice server URL answered" in errors["gone"] and "127.0.0.1" in errors["gone"]
    assert sent == 0


class _RestoreOnRefusal(logging.Handler):
    """Puts the server's blob right again once the fetcher logs that it refused a chunk."""

    def __init__(self, blob: bytearray, at: int, byte: int) -> None:
        super().__init__()
        self.blob, self.at, self.byte, self.refusals = blob, at, byte, []

    def emit(self, record: logging.LogRecord) -> None:
        if "refused" in record.getMessage():
            self.refusals.append(record.getMessage())
            self.blob[self.at] = self.byte


def test_tampered_chunk_is_refused_and_fetched_again(tmp_path, cert):
    blob = _blob(6 * CS + 3, 4)
    original = bytes(blob)
    source = SliceSource()
    manifest = source.offer(blob, {}, chunk_size=CS)  # the server serves views of `blob`
    at = 2 * CS + 100
    blob[at] ^= 0xFF  # chunk 2 now fails its SHA-256 until the handler restores it
    handler = _RestoreOnRefusal(blob, at, original[at])
    logger = logging.getLogger("swarm.peer.weights.slice_http")
    logger.addHandler(handler)

    async def main():
        server = await _server(source, cert)
        try:
            dl = SliceCache(tmp_path).open_download(manifest)
            await fetch_https(dl, server.source_for(manifest))
            return bytes(SliceCache(tmp_path).finish(dl)), dl.corrupt_chunks, server.sent_bytes
        finally:
            await server.close()

    try:
        got, corrupt, sent = asyncio.run(main())
    finally:
        logger.removeHandler(handler)
    assert got == original
    assert corrupt == 1 and len(handler.refusals) == 1 and "chunk 2" in handler.refusals[0]
    assert sent == len(original) + CS  # chunk 2 twice, nothing else again


def test_persistently_tampered_slice_fails_with_integrity_error(tmp_path, cert):
    blob = _blob(3 * CS, 5)
    source = SliceSource()
    manifest = source.offer(blob, {}, chunk_size=CS)
    blob[CS] ^= 1

    async def main():
        server = await _server(source, cert)
        try:
            dl = SliceCache(tmp_path).open_download(manifest)
            with pytest.raises(WeightIntegrityError, match="chunk 1 .* failed verification"):
                await fetch_https(dl, server.source_for(manifest))
        finally:
            await server.close()

    asyncio.run(main())


def test_cancelled_fetch_lets_go_of_the_download_and_resumes(tmp_path, cert):
    """Cancelling fetch_https (at its first progress report) returns only after the transfer
    threads have stopped; the chunks stored so far are verified and kept, and the same download
    then completes."""
    import threading

    size = 480 * CS + 9  # ~30 MiB: more than the socket buffers hold, so the cancel lands mid-slice
    blob = _blob(size, 9)
    source = SliceSource()
    manifest = source.offer(blob, {}, chunk_size=CS)

    async def main():
        server = await _server(source, cert)
        try:
            dl = SliceCache(tmp_path).open_download(manifest)
            task = asyncio.ensure_future(fetch_https(dl, server.source_for(manifest),
                                                     progress=lambda done, total: task.cancel()))
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not any(t.name.startswith("slice-store") for t in threading.enumerate())
            kept, missing = dl.done_bytes, dl.missing
            assert 0 < kept < size and not dl.complete
            assert missing == list(range(missing[0], manifest.n_chunks))  # a verified prefix stays
            await fetch_https(dl, server.source_for(manifest))
            return bytes(SliceCache(tmp_path).finish(dl))
        finally:
            await server.close()

    assert asyncio.run(main()) == bytes(blob)


async def _cutting_proxy(target_port: int, cut_after: int) -> tuple[asyncio.Server, list[int]]:
    """A TCP relay to ``target_port`` that breaks each connection off after ``cut_after`` bytes
    from the server (``cut_after`` < 0: never). TLS passes through it untouched."""
    relayed = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", target_port)

        async def pipe(src, dst, count):
            try:
                while data := await src.read(1 << 16):
                    if count and 0 <= cut_after <= relayed[0] + len(data):
                        break
                    dst.write(data)
                    await dst.drain()
                    if count:
                        relayed[0] += len(data)
            except ConnectionError:
                pass
            finally:
                for w in (writer, up_w):
                    w.transport.abort()

        await asyncio.gather(pipe(reader, up_w, False), pipe(up_r, writer, True))

    return await asyncio.start_server(handle, "127.0.0.1", 0), relayed


def test_interrupted_transfer_resumes_with_only_the_missing_chunks(tmp_path, cert):
    """The connection breaks mid-slice (a relay cuts it): the fetch fails with SliceUnreachable,
    the verified chunks stay in the cache's partial file, and the next fetch (a new process
    would do the same: the .part file is rescanned) asks only for the rest."""
    size = 40 * CS + 11
    blob = _blob(size, 7)
    source = SliceSource()
    manifest = source.offer(blob, {}, chunk_size=CS)

    async def main():
        server = await _server(source, cert)
        proxy, relayed = await _cutting_proxy(server.port, cut_after=size // 3)
        try:
            offer = server.source_for(manifest)
            via = _at(offer, f"https://127.0.0.1:{proxy.sockets[0].getsockname()[1]}")
            dl = SliceCache(tmp_path).open_download(manifest)
            with pytest.raises(SliceUnreachable, match="broke off"):
                await fetch_https(dl, via)
            kept = dl.done_bytes
            sent_first = server.sent_bytes
            dl2 = SliceCache(tmp_path).open_download(manifest)  # rescans the .part file
            assert dl2.done_bytes == kept
            await fetch_https(dl2, offer)
            return kept, sent_first, server.sent_bytes - sent_first, bytes(SliceCache(tmp_path).finish(dl2))
        finally:
            proxy.close()
            await proxy.wait_closed()
            await server.close()

    kept, sent_first, sent_second, got = asyncio.run(main())
    assert got == bytes(blob)
    assert 0 < kept < size
    assert sent_second == size - kept  # the resume asked only for what was missing


@pytest.mark.slow
def test_plan_slices_ship_over_https_and_fall_back_to_the_data_channel(tmp_path, cert, caplog):
    """Over a real authenticated aiortc link, the coordinator's offers name its HTTPS slice
    server: the worker fetches every slice there (the data channel carries no chunk). When the
    HTTPS server cannot be reached, the worker says so and takes the data channel; both give
    the bytes a local cut of the model gives."""
    from swarm.compute.model import load_model
    from swarm.peer.coordinator.planner import PeerCapacity, build_plan
    from swarm.peer.plan import ModelShape
    from swarm.peer.weights.shipping_aio import PlanShipper, SliceFetcher, fetch_plan_slices
    from swarm.peer.weights.slices import ModelSlicer, SliceSpan, specs_for
    from tests.peer._swarm_models import build
    from tests.peer.weights.test_shipping import COORDINATOR, WORKER, _linked_pair, _run_in_netns

    path = build("qwen3_moe", tmp_path)
    model = load_model(path)
    shape = ModelShape.from_config(model.config)
    plan = build_plan(shape, PeerCapacity(COORDINATOR.peer_id, 0, 1.0), [PeerCapacity(WORKER.peer_id, 10**9, 1.0)],
                      term=3, version=1)
    specs = specs_for(plan, WORKER.peer_id)
    caplog.set_level(logging.WARNING, logger="swarm.peer.weights.shipping_aio")

    async def ship(cache_dir, reachable: bool):
        a, b = await _linked_pair(COORDINATOR.peer_id, WORKER.peer_id)
        # The first address has no route from the worker: it moves on to the next, and keeps that.
        shipper = PlanShipper(path, model.content_hash(), shape, chunk_size=MIN_CHUNK_SIZE,
                              token_key=KEY.slice_token_key, certificate=cert,
                              https_addresses=["192.0.2.1", "10.214.0.1"], store=SliceCache(cache_dir / "kept"))
        shipper.attach(a)
        fetcher = SliceFetcher(b, model.content_hash(), SliceCache(cache_dir))
        try:
            sent = await shipper.offer_plan(a, plan)
            https_sent = shipper.http.sent_bytes
            if not reachable:
                await shipper.close()
            shipped, _ = await fetch_plan_slices(fetcher, specs)
            https_sent = shipper.http.sent_bytes if shipper.http else https_sent
            # The shipper serves what it cut from its disk store, mapped, not from its own memory.
            assert all(isinstance(shipper.source.view(m.slice_id).obj, mmap.mmap) for m in sent)
            assert len(list((cache_dir / "kept").glob("*.bin"))) == len(sent)
            return (sent, shipped, dict(fetcher.paths), https_sent, sum(shipper.server.sent_bytes.values()),
                    fetcher.preferred_url)
        finally:
            await shipper.close()
            await a.close()
            await b.close()

    async def main():
        return await ship(tmp_path / "w1", True), await ship(tmp_path / "w2", False)

    fast, slow = _run_in_netns(main)
    total = sum(m.size for m in fast[0])
    sent, shipped, paths, https_bytes, channel_bytes, good_url = fast
    assert set(paths.values()) == {"https"} and len(paths) == len(specs)
    assert good_url.startswith("https://10.214.0.1:")
    assert https_bytes == total and channel_bytes == 0
    sent2, shipped2, paths2, https_bytes2, channel_bytes2, _ = slow
    assert set(paths2.values()) == {"channel"} and https_bytes2 == 0 and channel_bytes2 == total
    assert any("over the data channel" in r.getMessage() and "no slice server URL answered" in r.getMessage()
               for r in caplog.records)
    slicer = ModelSlicer(path)
    for manifest in sent:
        want = slicer.extract(SliceSpan.from_json(manifest.meta["spec"]))[0]
        for cache_dir in ("w1", "w2"):
            assert bytes(SliceCache(tmp_path / cache_dir).get(manifest)) == bytes(want)


def test_partial_file_whose_chunks_match_but_whole_does_not_is_refused(tmp_path):
    """A manifest that lies about the whole (chunk hashes right, slice id wrong), with every
    chunk already in the partial file: refused by name before any request is sent."""
    import dataclasses

    from swarm.peer.weights.shipping import build_manifest

    blob = bytes(_blob(2 * CS, 8))
    lying = dataclasses.replace(build_manifest(blob, {}, CS), slice_id=bytes(32))
    cache = SliceCache(tmp_path)
    cache.open_download(lying)  # creates the .part file
    (tmp_path / f"{lying.hex_id}.part").write_bytes(blob)
    dl = cache.open_download(lying)  # rescans: every chunk matches
    assert dl.missing == [] and not dl.complete
    unreachable = HttpsSource(("https://127.0.0.1:9",), "00" * 32, "00" * 32)
    with pytest.raises(WeightIntegrityError, match="the manifest is inconsistent"):
        asyncio.run(fetch_https(dl, unreachable))
