"""Bulk slice transfer over HTTPS range requests: the shipper's server and the fetcher's client.

Why: a WebRTC data channel in aiortc costs pure-Python time per ~1.2 KB SCTP packet (tens of
MiB/s at best), so a multi-GB model would take minutes to hours to ship. The bytes of a slice
go instead over one TLS connection per fetch, at the speed of the LAN; the data channel still
carries the offer (``WeightManifest``) and stays the fallback.

Trust, with no certificate authority on a LAN:

- The server speaks TLS with the shipper's own certificate (the one its signaling server uses,
  :mod:`swarm.signaling.tls`). The offer, sent over the authenticated data channel, names the
  certificate's SHA-256; the Python client pins it (``aiohttp.Fingerprint``), so an impostor on
  the LAN gets no connection. A browser cannot pin: it must have accepted the certificate for
  that host, and it checks every byte against the manifest's hashes anyway.
- Each request carries ``Authorization: Bearer <token>``; the token is HMAC-SHA256 of the
  slice id under a sub-key of the swarm key (:attr:`~swarm.keys.swarmkey.SwarmKey.slice_token_key`),
  so it opens that one slice only and never reveals the key. Absent: 401; wrong: 403.
- Every chunk is checked against the manifest's SHA-256 before it is kept, the whole slice
  against its id (:class:`~swarm.peer.weights.shipping.SliceDownload`); a chunk that fails is fetched again.

HTTP surface (``GET``/``OPTIONS`` ``/slices/<slice id hex>``): one byte range per request
(``Range: bytes=a-b``, ``bytes=a-``, ``bytes=-n``; none: the whole slice), answered with 206 and
``Content-Range``; a range outside the slice is 416. CORS is open (``*``, the token is the
credential), because a page served by the signaling server is another origin than a shipper on
another port or host.

Resume: the client asks only for the chunks its partial download (``<id>.part`` in the
:class:`~swarm.peer.weights.shipping.SliceCache`) lacks. Memory: the server writes views of the blob it
already holds; the client reads one chunk at a time into the download's file mapping.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from swarm.errors import RemoteProtocolError, SwarmError, WeightIntegrityError
from swarm.peer.net.messages import HttpsSource
from swarm.peer.weights.shipping import Chunk, ChunkRejected, Manifest, SliceDownload, SliceSource
from swarm.peer.weights.shipping_aio import _runs

log = logging.getLogger(__name__)

PATH_PREFIX = "/slices/"
WRITE_BYTES = 1 << 20  # the server writes the blob in pieces of this size
CONNECT_TIMEOUT_S = 3.0  # per URL: an address the fetcher cannot reach is skipped after this
READ_TIMEOUT_S = 30.0  # no byte for this long: the transfer is broken off (resumable)
SHUTDOWN_S = 1.0
_SLICE_ID = re.compile(r"[0-9a-f]{64}")
CORS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "GET, OPTIONS",
    "Access-Control-Allow-Headers": "Authorization, Range",
    "Access-Control-Expose-Headers": "Content-Range, Content-Length",
    "Access-Control-Max-Age": "600",
    # A page on a LAN address fetching from another LAN address (Chromium's Private Network Access).
    "Access-Control-Allow-Private-Network": "true",
}
Progress = Callable[[int, int], None]  # (done_bytes, total_bytes)


def slice_token(token_key: bytes, slice_id: bytes) -> str:
    """The bearer token for one slice: HMAC-SHA256(``token_key``, ``b"slice " + slice_id``), 64 hex digits.

    ``token_key`` is :attr:`~swarm.keys.swarmkey.SwarmKey.slice_token_key` (32 bytes).
    """
    return hmac.new(token_key, b"slice " + slice_id, hashlib.sha256).hexdigest()


class SliceUnreachable(SwarmError):
    """The HTTPS path cannot deliver (no URL answers, wrong certificate, token refused, link broken):
    the caller may fall back to the data channel. The partial download stays."""


# ---------------------------------------------------------------------------- server


class SliceHttpServer:
    """HTTPS server of the slices in ``source`` (an aiohttp app with TLS).

    ``token_key``: the swarm key's slice-token sub-key; ``ssl_context``: a server context with
    the certificate whose DER SHA-256 is ``cert_sha256`` (32 bytes). :attr:`sent_bytes` counts
    body bytes written (for progress and tests). Start with :meth:`start`, stop with :meth:`close`.
    """

    def __init__(self, source: SliceSource, token_key: bytes, ssl_context: Any, cert_sha256: bytes, *,
                 host: str = "0.0.0.0", port: int = 0, addresses: Sequence[str] | None = None) -> None:
        if len(token_key) != 32 or len(cert_sha256) != 32:
            raise ValueError("token_key and cert_sha256 must be 32 bytes each")
        self.source, self._token_key, self._ssl = source, token_key, ssl_context
        self.cert_sha256 = cert_sha256
        self._host, self._port_wanted, self._addresses = host, port, addresses
        self.port: int | None = None
        self.sent_bytes = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Listen; returns the port (a free one when ``port`` was 0)."""
        app = web.Application()
        app.router.add_route("GET", PATH_PREFIX + "{slice_id}", self._get)
        app.router.add_route("OPTIONS", PATH_PREFIX + "{slice_id}", self._preflight)
        # On close, transfers in flight get this long to end: a fetcher resumes whatever is cut off.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port_wanted, ssl_context=self._ssl)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("slice server on https://%s:%d (certificate SHA-256 %s…)", self._host, self.port,
                 self.cert_sha256.hex()[:16])
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def source_for(self, manifest: Manifest) -> HttpsSource:
        """What an offer of ``manifest`` carries: where to fetch it, the pin and its token."""
        if self.port is None:
            raise RuntimeError("the slice server is not started")
        if self._addresses is None:
            from swarm.discovery.addresses import local_addresses

            self._addresses = [*local_addresses(), "127.0.0.1"]
        hosts = list(dict.fromkeys(self._addresses))[:16]
        return HttpsSource(urls=tuple(f"https://{h}:{self.port}" for h in hosts), cert_sha256=self.cert_sha256.hex(),
                           token=slice_token(self._token_key, manifest.slice_id))

    # ------------------------------------------------------------- handlers

    async def _preflight(self, request: web.Request) -> web.Response:
        return web.Response(status=204, headers=CORS)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["slice_id"]
        if not _SLICE_ID.fullmatch(name):
            return _refuse(404, f"{name[:70]!r} is not a slice id (64 lower-case hex digits)")
        slice_id = bytes.fromhex(name)
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return _refuse(401, "send 'Authorization: Bearer <token>' with the token from the slice's offer",
                           {"WWW-Authenticate": 'Bearer realm="colibri-swarm slices"'})
        if not hmac.compare_digest(auth[7:].strip().encode(), slice_token(self._token_key, slice_id).encode()):
            return _refuse(403, "this token does not open this slice (another swarm key, or another slice's token)")
        try:
            manifest = self.source.manifest(slice_id)
        except RemoteProtocolError as exc:
            return _refuse(404, str(exc))
        size = manifest.size
        try:
            rng = request.http_range
        except ValueError as exc:
            return _refuse(416, f"Range {request.headers.get('Range', '')[:60]!r}: {exc}; "
                                "send one range as bytes=START-END", {"Content-Range": f"bytes */{size}"})
        start, stop = _bounds(rng, size)
        if start is None:
            return _refuse(416, f"Range {request.headers['Range'][:60]!r} is outside the slice's {size} bytes",
                           {"Content-Range": f"bytes */{size}"})
        partial = "Range" in request.headers
        headers = {**CORS, "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                   "Content-Length": str(stop - start), "Cache-Control": "no-store"}
        if partial:
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}" if stop > start else f"bytes */{size}"
        resp = web.StreamResponse(status=206 if partial else 200, headers=headers)
        await resp.prepare(request)
        view = self.source.view(slice_id)
        for at in range(start, stop, WRITE_BYTES):
            piece = view[at:min(at + WRITE_BYTES, stop)]
            await resp.write(piece)
            self.sent_bytes += len(piece)
        await resp.write_eof()
        return resp


def _bounds(rng: slice, size: int) -> tuple[int | None, int]:
    """``[start, stop)`` of a parsed Range inside ``size`` bytes, or (None, 0) when it lies outside."""
    if rng.start is None and rng.stop is None:
        return 0, size
    start = rng.start if rng.start >= 0 else max(size + rng.start, 0)
    stop = size if rng.stop is None else min(rng.stop, size)
    if start >= size or start >= stop:
        return None, 0
    return start, stop


def _refuse(status: int, why: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=why + "\n", headers={**CORS, **(headers or {})})


# ---------------------------------------------------------------------------- client


async def fetch_https(download: SliceDownload, source: HttpsSource, *, progress: Progress | None = None,
                      connect_timeout_s: float = CONNECT_TIMEOUT_S,
                      read_timeout_s: float = READ_TIMEOUT_S) -> str | None:
    """Complete ``download`` over HTTPS from ``source`` (the offer's bulk path).

    Asks for each run of missing chunks with one range request, checks every chunk against the
    manifest as it arrives and stores it in the download's buffer (one chunk in memory at a
    time); chunks that fail are asked for again (the download gives up after
    ``MAX_CHUNK_RETRIES``). URLs are tried in order; the first that answers serves the rest.
    Returns that base URL (None when the download was already complete), to try first next time.

    Raises:
        SliceUnreachable: no URL answered with the pinned certificate, the token was refused, or
            the connection broke (the chunks already verified stay in the download: resumable).
        RemoteProtocolError: the server answered with bytes other than those asked for.
        WeightIntegrityError: a chunk kept failing its SHA-256, or the whole slice does not match.
    """
    m = download.manifest
    pin = aiohttp.Fingerprint(bytes.fromhex(source.cert_sha256))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
    headers = {"Authorization": f"Bearer {source.token}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=pin, limit=1), timeout=timeout,
                                     headers=headers, auto_decompress=False) as session:
        base: str | None = None
        failures: list[str] = []
        while not download.complete:
            runs = _runs(download.missing)
            if not runs:  # a partial file whose chunks all match, yet the whole does not
                raise WeightIntegrityError(f"slice {m.hex_id[:12]}: every chunk matches its hash but the whole "
                                           "does not; the manifest is inconsistent — refusing it")
            for first, count in runs:
                start, _ = m.chunk_span(first)
                _, stop = m.chunk_span(first + count - 1)
                for url in ([base] if base else source.urls):
                    try:
                        await _fetch_run(session, f"{url}{PATH_PREFIX}{m.hex_id}", download, first, count,
                                         start, stop, progress)
                        base = url
                        break
                    except _NOT_THERE as exc:
                        if base is not None:  # it answered before: the connection broke
                            raise _broke(url, m, exc) from None
                        failures.append(f"{url}: {_why(exc)}")
                    except (aiohttp.ClientError, asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
                        raise _broke(url, m, exc) from None  # cut off, stalled past the read timeout, or reset
                else:
                    raise SliceUnreachable(f"no slice server URL answered for slice {m.hex_id[:12]}: "
                                           + "; ".join(failures))
    return base


# Errors that mean "not this URL" (try the next one), before any byte came.
_NOT_THERE = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, aiohttp.ServerFingerprintMismatch)


def _broke(url: str, m: Manifest, exc: BaseException) -> SliceUnreachable:
    return SliceUnreachable(f"slice server {url} broke off slice {m.hex_id[:12]}: {exc!r:.200}")


def _why(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ServerFingerprintMismatch):
        return "certificate does not match the pinned SHA-256 (another server answers there)"
    return f"{type(exc).__name__}: {exc}"[:200]


async def _fetch_run(session: aiohttp.ClientSession, url: str, download: SliceDownload, first: int, count: int,
                     start: int, stop: int, progress: Progress | None) -> None:
    """One range request for chunks ``first .. first+count-1`` (bytes ``[start, stop)``)."""
    m = download.manifest
    async with session.get(url, headers={"Range": f"bytes={start}-{stop - 1}"}) as resp:
        if resp.status in (401, 403):
            why = (await resp.text())[:200].strip()
            raise SliceUnreachable(f"slice server {url} refused the token ({resp.status}: {why})")
        if resp.status != 206:
            raise RemoteProtocolError(f"slice server {url} answered {resp.status} to bytes {start}-{stop - 1}: "
                                      f"{(await resp.text())[:200].strip()}")
        want = f"bytes {start}-{stop - 1}/{m.size}"
        if resp.headers.get("Content-Range") != want or resp.content_length != stop - start:
            raise RemoteProtocolError(f"slice server {url} sent Content-Range {resp.headers.get('Content-Range')!r}, "
                                      f"length {resp.content_length} for {want!r}")
        for index in range(first, first + count):
            a, b = m.chunk_span(index)
            data = await resp.content.readexactly(b - a)
            # Hashing (and the final whole-slice hash) off the event loop: links keep their heartbeats.
            events = await asyncio.to_thread(download.receive, Chunk(m.slice_id, index, data), time.monotonic())
            for event in events:
                if isinstance(event, ChunkRejected):
                    log.warning("slice %s chunk %d from %s refused (%s); fetching it again",
                                m.hex_id[:12], index, url, event.reason)
            if progress:
                progress(download.done_bytes, m.size)
