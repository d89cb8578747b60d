"""Weight shipping over a peer link: the thin asyncio adapter of :mod:`swarm.peer.weights.shipping`.

Mapping onto the wire messages (:mod:`swarm.peer.net.messages`, docs/protocol.md "Weights"):

- ``WeightManifest``: ``name`` is the slice id (SHA-256 of the whole blob, 64 hex digits);
  ``encoding`` is ``"slice/v1 "`` followed by the slice's meta as canonical JSON (the tensors
  inside, each with its ggml type, shape and byte range — :mod:`swarm.peer.weights.slices`);
  ``total_bytes``, ``chunk_bytes``, ``chunk_sha256`` as in :class:`~swarm.peer.weights.shipping.Manifest`.
- ``WeightManifest.https``: where the same bytes can be fetched in bulk over HTTPS range
  requests (:mod:`swarm.peer.weights.slice_http`: URLs, the server certificate's SHA-256 to pin, a
  token for this slice). The fetcher takes that path first and falls back to the chunks below,
  saying so in the log, when it cannot reach it (another subnet, a firewall, a refused token).
- ``WeightChunkRequest(first, count)``: a run of consecutive chunk indices (the core's
  index lists are split into runs).
- ``WeightChunk``: chunk ``offset // chunk_bytes`` (``offset`` must be a multiple), with the
  chunk's SHA-256 from the manifest; the receiver checks it against *its* manifest, never
  against the digest the chunk carries.

The coordinator runs a :class:`SliceServer` on each link; a worker runs a :class:`SliceFetcher`
on its link to the coordinator and calls :meth:`SliceFetcher.fetch` per manifest. For a plan:
the coordinator's :class:`PlanShipper` offers each worker its slices, and the worker's
:func:`fetch_plan_slices` returns a :class:`~swarm.peer.weights.slices.ShippedWeights` to build its
:class:`~swarm.peer.worker.ffn.Worker` on (with :func:`shape_from_meta` for the model's shape). A fetch that
loses its link raises :class:`~swarm.errors.PeerLostError` and leaves the partial download in
the cache; fetching the same manifest again (over a new link) asks only for what is missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from swarm.errors import PeerLostError, RemoteProtocolError
from swarm.peer.net.messages import HttpsSource, WeightChunk, WeightChunkRequest, WeightManifest
from swarm.peer.weights.shipping import (
    MAX_REQUEST_INDICES,
    Chunk,
    ChunkAccepted,
    ChunkRejected,
    ChunkRequest,
    Manifest,
    SliceCache,
    SliceSource,
    build_manifest,
    encode_meta,
)

if TYPE_CHECKING:
    from swarm.peer.plan import ModelShape

log = logging.getLogger(__name__)

ENCODING_PREFIX = "slice/v1 "
Progress = Callable[[int, int], None]  # (done_bytes, total_bytes)


def to_wire(manifest: Manifest, model_hash: str, request_id: int = 0, https: HttpsSource | None = None) -> WeightManifest:
    """The wire message that offers ``manifest`` (``https``: its bulk path, if any)."""
    return WeightManifest(
        request_id=request_id, model_hash=model_hash, name=manifest.hex_id,
        encoding=ENCODING_PREFIX + encode_meta(manifest.meta).decode(), total_bytes=manifest.size,
        chunk_bytes=manifest.chunk_size, chunk_sha256=tuple(h.hex() for h in manifest.chunk_sha256), https=https,
    )


def from_wire(msg: WeightManifest) -> Manifest:
    """The core manifest of an offered slice. Raises RemoteProtocolError on any bad field."""
    if not msg.encoding.startswith(ENCODING_PREFIX):
        raise RemoteProtocolError(f"weight manifest {msg.name[:12]}: encoding must start with {ENCODING_PREFIX!r}")
    try:
        meta = json.loads(msg.encoding[len(ENCODING_PREFIX):])
        slice_id = bytes.fromhex(msg.name)
    except ValueError:
        raise RemoteProtocolError(f"weight manifest {msg.name[:12]}: malformed name or meta") from None
    manifest = Manifest(slice_id, msg.total_bytes, msg.chunk_bytes,
                        tuple(bytes.fromhex(h) for h in msg.chunk_sha256), meta)
    manifest.validate()
    return manifest


def _runs(indices: tuple[int, ...]) -> list[tuple[int, int]]:
    """Ascending indices as (first, count) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class SliceServer:
    """The coordinator's side on any number of links: answers chunk requests from ``source``.

    ``sent_bytes`` counts chunk bytes sent per peer id (shown as progress by the node).
    """

    def __init__(self, source: SliceSource, model_hash: str, *, on_sent: Callable[[str, int], None] | None = None):
        self.source = source
        self.model_hash = model_hash
        self.sent_bytes: dict[str, int] = {}
        self._on_sent = on_sent

    def attach(self, link: Any) -> None:
        link.on(WeightChunkRequest, self._on_request)

    async def offer(self, link: Any, manifest: Manifest, https: HttpsSource | None = None) -> None:
        await link.send(to_wire(manifest, self.model_hash, https=https))

    async def _on_request(self, link: Any, req: WeightChunkRequest) -> None:
        if req.model_hash != self.model_hash:
            raise RemoteProtocolError(f"peer {link.peer_id} asked for weights of model {req.model_hash[:12]}, "
                                      f"this coordinator serves {self.model_hash[:12]}")
        if not 1 <= req.count <= MAX_REQUEST_INDICES:
            raise RemoteProtocolError(f"peer {link.peer_id} asked for {req.count} chunks at once "
                                      f"(allowed 1..{MAX_REQUEST_INDICES})")
        try:
            slice_id = bytes.fromhex(req.name)
        except ValueError:
            raise RemoteProtocolError(f"peer {link.peer_id} asked for slice {req.name[:40]!r}, not a SHA-256") from None
        manifest = self.source.manifest(slice_id)
        chunks = self.source.serve(ChunkRequest(slice_id, tuple(range(req.first, req.first + req.count))))
        for chunk in chunks:
            await link.send(self._chunk_message(req, manifest, chunk))
            n = len(chunk.data)
            self.sent_bytes[link.peer_id] = self.sent_bytes.get(link.peer_id, 0) + n
            if self._on_sent:
                self._on_sent(link.peer_id, n)

    def _chunk_message(self, req: WeightChunkRequest, manifest: Manifest, chunk: Chunk) -> WeightChunk:
        return WeightChunk(
            request_id=req.request_id, model_hash=self.model_hash, name=req.name,
            offset=chunk.index * manifest.chunk_size, sha256=manifest.chunk_sha256[chunk.index].hex(),
            data=np.frombuffer(chunk.data, dtype=np.uint8),
        )


class SliceFetcher:
    """The worker's side on its link to the coordinator.

    Offered manifests arrive in :attr:`offers` (an ``asyncio.Queue`` of :class:`Manifest`);
    :meth:`fetch` downloads one into ``cache`` (or finds it there) and returns the blob: over
    HTTPS when the offer names a slice server (``use_https``), else or on failure over the link.
    :attr:`paths` records which path delivered each slice (``"cache"``, ``"https"``, ``"channel"``).
    """

    def __init__(self, link: Any, model_hash: str, cache: SliceCache, *, window: int = 8,
                 timeout_s: float = 30.0, use_https: bool = True) -> None:
        self.link, self.model_hash, self.cache = link, model_hash, cache
        self.offers: asyncio.Queue[Manifest] = asyncio.Queue()
        self.paths: dict[str, str] = {}
        self._https: dict[str, HttpsSource] = {}  # slice id (hex) → its bulk path, from the offer
        self.preferred_url: str | None = None  # the slice server URL that answered last: tried first
        self._use_https = use_https
        self._window, self._timeout_s = window, timeout_s
        self._inboxes: dict[str, asyncio.Queue[WeightChunk | None]] = {}
        self._request_id = 0
        link.on(WeightChunk, self._on_chunk)
        link.on(WeightManifest, self._on_manifest)
        link.on_close(self._on_close)

    def _on_manifest(self, link: Any, msg: WeightManifest) -> None:
        if msg.model_hash != self.model_hash:
            raise RemoteProtocolError(f"offered weights of model {msg.model_hash[:12]}, we run {self.model_hash[:12]}")
        manifest = from_wire(msg)
        if msg.https is not None:
            self._https[manifest.hex_id] = msg.https
        self.offers.put_nowait(manifest)

    def _on_chunk(self, link: Any, msg: WeightChunk) -> None:
        inbox = self._inboxes.get(msg.name)
        if inbox is not None:  # else: a late chunk of a finished slice — ignore it
            inbox.put_nowait(msg)

    def _on_close(self, link: Any) -> None:
        for inbox in self._inboxes.values():
            inbox.put_nowait(None)

    async def fetch(self, manifest: Manifest, progress: Progress | None = None) -> memoryview:
        """The verified blob of ``manifest``: from the cache, or shipped over the link.

        Raises:
            PeerLostError: the link closed first (the partial download stays; fetch again to resume).
            WeightIntegrityError: the source kept sending chunks that fail their SHA-256.
        """
        # Hashing a cached or partial slice takes ~1 s per GB: off the event loop.
        cached = await asyncio.to_thread(self.cache.get, manifest)
        if cached is not None:
            self.paths[manifest.hex_id] = "cache"
            if progress:
                progress(manifest.size, manifest.size)
            return cached
        dl = await asyncio.to_thread(self.cache.open_download, manifest, window=self._window, timeout_s=self._timeout_s)
        if progress:
            progress(dl.done_bytes, manifest.size)
        https = self._https.get(manifest.hex_id) if self._use_https else None
        if https is not None:
            from swarm.peer.weights.slice_http import SliceUnreachable, fetch_https

            if self.preferred_url in https.urls:
                https = dataclasses.replace(https, urls=(self.preferred_url, *(u for u in https.urls if u != self.preferred_url)))
            try:
                self.preferred_url = await fetch_https(dl, https, progress=progress) or self.preferred_url
                self.paths[manifest.hex_id] = "https"
                return self.cache.finish(dl)
            except SliceUnreachable as exc:
                log.warning("slice %s: %s; fetching the rest over the data channel (slower)", manifest.hex_id[:12], exc)
        self.paths[manifest.hex_id] = "channel"
        inbox: asyncio.Queue[WeightChunk | None] = asyncio.Queue()
        self._inboxes[manifest.hex_id] = inbox
        try:
            while not dl.complete:
                if not self.link.is_open:
                    raise PeerLostError(f"link to {self.link.peer_id} closed while fetching slice {manifest.hex_id[:12]}")
                for req in dl.requests_to_send(time.monotonic()):
                    for first, count in _runs(req.indices):
                        self._request_id += 1
                        await self.link.send(WeightChunkRequest(
                            request_id=self._request_id, model_hash=self.model_hash, name=manifest.hex_id,
                            first=first, count=count))
                deadline = dl.get_timer()
                try:
                    msg = await asyncio.wait_for(inbox.get(), max(0.0, (deadline or 0) - time.monotonic()))
                except TimeoutError:
                    dl.handle_timer(time.monotonic())
                    continue
                if msg is None:
                    dl.link_lost()
                    raise PeerLostError(f"link to {self.link.peer_id} closed while fetching slice {manifest.hex_id[:12]}")
                index, rem = divmod(msg.offset, manifest.chunk_size)
                if rem:
                    raise RemoteProtocolError(f"weight chunk offset {msg.offset} is not a multiple of {manifest.chunk_size}")
                for event in dl.receive(Chunk(manifest.slice_id, index, msg.data), time.monotonic()):
                    match event:
                        case ChunkAccepted(done_bytes=done, total_bytes=total) if progress:
                            progress(done, total)
                        case ChunkRejected(index=i, reason=why):
                            log.warning("slice %s chunk %d refused (%s); fetching it again", manifest.hex_id[:12], i, why)
            return self.cache.finish(dl)
        finally:
            del self._inboxes[manifest.hex_id]


# ---------------------------------------------------------------------------- plans


class PlanShipper:
    """The coordinator ships each worker the slices a plan gives it (workers without the model).

    Slices are cut from ``model_path`` in the file's own encoding (:mod:`swarm.peer.weights.slices`);
    each manifest's meta also carries the model's :class:`~swarm.peer.plan.ModelShape`
    (``meta["shape"]``), so a worker without the file can check requests against it. A browser
    peer gets tensors its kernels cannot read (Q5_x, IQ, ..., K-quants for a page that does not
    announce their kernels) repacked once to Q8_0 (:mod:`swarm.peer.weights.repack`); Q4_0/Q4_1/Q8_0,
    float tensors and announced K-quants ship as in the file.

    With ``token_key`` (the swarm key's :attr:`~swarm.keys.swarmkey.SwarmKey.slice_token_key`)
    the shipper also serves its slices over HTTPS (:class:`~swarm.peer.weights.slice_http.SliceHttpServer`,
    started with the first offer, on ``https_port``, 0: any free port) with ``certificate`` (a
    :class:`~swarm.signaling.tls.ServerCertificate`; default: this host's signaling certificate),
    and every offer names that path. :meth:`close` stops the server.

    Each slice is cut once, hashed, and kept on disk in ``store`` (a
    :class:`~swarm.peer.weights.shipping.SliceCache`; default: the user cache), from where it is served
    through a read-only mapping: the shipper's memory does not grow with what it ships.
    """

    def __init__(self, model_path: Any, model_hash: str, shape: Any, *, chunk_size: int | None = None,
                 token_key: bytes | None = None, certificate: Any = None, https_port: int = 0,
                 https_addresses: list[str] | None = None, store: SliceCache | None = None) -> None:
        from swarm.peer.weights.shipping import CHUNK_SIZE
        from swarm.peer.weights.slices import ModelSlicer

        self.slicer = ModelSlicer(model_path)
        self.source = SliceSource()
        self.server = SliceServer(self.source, model_hash)
        self.shape = shape
        self._chunk_size = chunk_size or CHUNK_SIZE
        self._manifests: dict[Any, Manifest] = {}
        self._store = store
        self._token_key, self._certificate = token_key, certificate
        self._https_port, self._https_addresses = https_port, https_addresses
        self.http: Any = None  # the SliceHttpServer, once started
        self._http_lock = asyncio.Lock()

    async def https_server(self) -> Any:
        """The started HTTPS slice server, or None without a token key."""
        if self._token_key is None:
            return None
        async with self._http_lock:
            if self.http is None:
                from swarm.peer.weights.slice_http import SliceHttpServer

                cert = self._certificate
                if cert is None:
                    from swarm import paths
                    from swarm.signaling import tls

                    cert = await asyncio.to_thread(tls.load_or_create, paths.config_dir())
                server = SliceHttpServer(self.source, self._token_key, cert.ssl_context(), cert.sha256,
                                         port=self._https_port, addresses=self._https_addresses)
                await server.start()
                self.http = server
        return self.http

    async def close(self) -> None:
        """Stop the HTTPS slice server, if it runs."""
        if self.http is not None:
            http, self.http = self.http, None
            await http.close()

    def attach(self, link: Any) -> None:
        self.server.attach(link)

    async def offer_plan(self, link: Any, plan: Any) -> list[Manifest]:
        """Offer ``link``'s peer every slice ``plan`` gives it; returns the manifests sent."""
        from swarm.peer.weights.slices import specs_for

        from swarm.peer.weights.repack import page_encodings

        sent = []
        hello = getattr(link, "hello", None)
        browser = getattr(hello, "peer_kind", None) == "browser"
        encodings = page_encodings(getattr(hello, "build", None)) if browser else None
        http = await self.https_server()
        for spec in specs_for(plan, link.peer_id):
            manifest = await self.manifest_for(spec, browser, encodings)
            await self.server.offer(link, manifest, http.source_for(manifest) if http else None)
            sent.append(manifest)
        return sent

    async def manifest_for(self, spec: Any, browser: bool = False, encodings: frozenset[str] | None = None) -> Manifest:
        """The manifest of ``spec``'s slice (cut, and for a browser peer repacked, once per set of
        ``encodings`` it reads: :func:`~swarm.peer.weights.repack.page_encodings`; default the oldest page's)."""
        from swarm.peer.weights.repack import PAGE_ENCODINGS, repack_for_page

        encodings = (encodings or PAGE_ENCODINGS) if browser else None
        manifest = self._manifests.get((spec, encodings))
        if manifest is None:
            blob, meta = await asyncio.to_thread(self.slicer.extract, spec)
            if browser:
                blob, meta = await asyncio.to_thread(repack_for_page, blob, meta, encodings)
            meta["shape"] = dataclasses.asdict(self.shape)
            manifest = self._manifests[(spec, encodings)] = await asyncio.to_thread(self._keep, blob, meta)
        return manifest

    def _keep(self, blob: bytes, meta: dict[str, Any]) -> Manifest:
        """Hash ``blob``, put it on disk and offer it from there (a worker thread)."""
        manifest = build_manifest(blob, meta, self._chunk_size)
        if self._store is None:
            self._store = SliceCache()
        return self.source.offer(self._store.put(manifest, blob), meta, manifest=manifest)


def shape_from_meta(meta: Any) -> Any:
    """The :class:`~swarm.peer.plan.ModelShape` a shipped manifest carries. RemoteProtocolError if malformed."""
    from swarm.peer.plan import ModelShape

    shape = meta.get("shape") if isinstance(meta, dict) else None
    try:
        out = ModelShape(**shape)
    except TypeError:
        raise RemoteProtocolError(f"weight manifest: no valid model shape in its meta ({shape!r:.80})") from None
    ints = (out.hidden_size, out.n_experts, out.moe_intermediate_size, out.intermediate_size,
            *(out.moe_layers if isinstance(out.moe_layers, (list, tuple)) else [None]),
            *(out.dense_layers if isinstance(out.dense_layers, (list, tuple)) else [None]),
            *(out.kv_bytes if isinstance(out.kv_bytes, (list, tuple)) else [None]))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints) or out.hidden_size == 0:
        raise RemoteProtocolError(f"weight manifest: model shape {shape!r:.80} has bad sizes")
    # JSON gives lists; the shape's per-layer fields are tuples.
    return dataclasses.replace(out, moe_layers=tuple(out.moe_layers), dense_layers=tuple(out.dense_layers),
                               kv_bytes=tuple(out.kv_bytes))


async def fetch_plan_slices(fetcher: SliceFetcher, specs: Iterable[Any],
                            progress: Progress | None = None) -> tuple[Any, ModelShape | None]:
    """Take offers from the coordinator until every slice in ``specs`` is fetched, verified and
    decoded; returns a :class:`~swarm.peer.weights.slices.ShippedWeights` (a worker's slice source)
    and the model's shape as the manifests give it (None when ``specs`` is empty).

    Offers for other slices (of an older plan) are ignored. Raises PeerLostError /
    WeightIntegrityError as :meth:`SliceFetcher.fetch` does, RemoteProtocolError for a malformed slice.
    """
    from swarm.peer.weights.slices import ShippedWeights, SliceSpan, decode_slice

    need = set(specs)
    shipped, shape = ShippedWeights(), None
    while need:
        manifest = await fetcher.offers.get()
        spec = SliceSpan.from_json(manifest.meta.get("spec", {}))
        if spec not in need:
            continue
        shape = shape_from_meta(manifest.meta)
        blob = await fetcher.fetch(manifest, progress)
        shipped.add(await asyncio.to_thread(decode_slice, blob, manifest.meta))
        need.discard(spec)
    return shipped, shape
