"""Bulk slice transfer over HTTPS range requests: the shipper's server and the fetcher's client.

Why: a WebRTC data channel in aiortc costs pure-Python time per ~1.2 KB SCTP packet (tens of
MiB/s at best), so a multi-GB model would take minutes to hours to ship. The bytes of a slice
go instead over one TLS connection per fetch, at the speed of the LAN; the data channel still
carries the offer (``WeightManifest``) and stays the fallback.

Trust, with no certificate authority on a LAN:

- The server speaks TLS with the shipper's own certificate (the one its signaling server uses,
  :mod:`swarm.signaling.tls`). The offer, sent over the authenticated data channel, names the
  certificate's SHA-256; the Python client pins it (checked after the TLS handshake, before
  the token is sent), so an impostor on the LAN gets no connection and no token. A browser
  cannot pin: it must have accepted the certificate for that host, and it checks every byte
  against the manifest's hashes anyway.
- Each request carries ``Authorization: Bearer <token>``; the token is HMAC-SHA256 of the
  slice id under a sub-key of the swarm key (:attr:`~swarm.keys.swarmkey.SwarmKey.slice_token_key`),
  so it opens that one slice only and never reveals the key. Absent: 401; wrong: 403.
- The slice is checked against its id (the whole-slice SHA-256, computed as the chunks arrive
  in order); when that fails, or a transfer breaks off, each chunk is checked against its own
  SHA-256 and only those that fail are fetched again
  (:meth:`~swarm.peer.weights.shipping.SliceDownload.receive_streamed`).

HTTP surface (``GET``/``OPTIONS`` ``/slices/<slice id hex>``): one byte range per request
(``Range: bytes=a-b``, ``bytes=a-``, ``bytes=-n``; none: the whole slice), answered with 206 and
``Content-Range``; a range outside the slice is 416. CORS is open (``*``, the token is the
credential), because a page served by the signaling server is another origin than a shipper on
another port or host.

Resume: the client asks only for the chunks its partial download (``<id>.part`` in the
:class:`~swarm.peer.weights.shipping.SliceCache`) lacks. Memory: the server writes views of the blob it
already holds; the client reads into three chunk-sized buffers and writes each chunk into the
download's file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import http.client
import logging
import re
import socket
import ssl
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from swarm.errors import RemoteProtocolError, SwarmError, WeightIntegrityError
from swarm.httpserver import HttpServer
from swarm.peer.net.messages import HttpsSource
from swarm.peer.weights.shipping import ChunkRejected, Manifest, SliceDownload, SliceSource
from swarm.peer.weights.shipping_aio import _runs

log = logging.getLogger(__name__)

PATH_PREFIX = "/slices/"
WRITE_BYTES = 1 << 20  # the server writes the blob in pieces of this size
CONNECT_TIMEOUT_S = 3.0  # per URL: an address the fetcher cannot reach is skipped after this
READ_TIMEOUT_S = 30.0  # no byte for this long: the transfer is broken off (resumable)
SHUTDOWN_S = 1.0
PIPELINE = 3  # chunk buffers: one being read, up to two queued for hashing and writing
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
        self._runner: HttpServer | None = None

    async def start(self) -> int:
        """Listen; returns the port (a free one when ``port`` was 0)."""
        app = web.Application()
        app.router.add_route("GET", PATH_PREFIX + "{slice_id}", self._get)
        app.router.add_route("OPTIONS", PATH_PREFIX + "{slice_id}", self._preflight)
        # On close, transfers in flight get this long to end: a fetcher resumes whatever is cut off.
        # A fetcher may pause between the ranges of one connection while its disk catches up.
        http = HttpServer(app, name="slice server", header_timeout_s=30.0, shutdown_timeout=SHUTDOWN_S)
        self.port = await http.start(self._host, self._port_wanted, self._ssl)
        self._runner = http
        log.info("slice server on https://%s:%d (certificate SHA-256 %s…)", self._host, self.port,
                 self.cert_sha256.hex()[:16])
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.close()

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
#
# The client is the standard library's blocking HTTPS client in a worker thread, not aiohttp:
# the socket's TLS layer decrypts straight into reusable buffers (``readinto``) with the GIL
# released, where asyncio's SSL transport and aiohttp's stream reader cost about five copies and
# several Python calls per 16 KiB record (bench/results/ship.md has the CPU-seconds per GiB).
# A second thread hashes and writes each chunk while the first reads the next (both release the
# GIL), so the two overlap where a second core is free. The event loop only waits.


async def fetch_https(download: SliceDownload, source: HttpsSource, *, progress: Progress | None = None,
                      connect_timeout_s: float = CONNECT_TIMEOUT_S,
                      read_timeout_s: float = READ_TIMEOUT_S) -> str | None:
    """Complete ``download`` over HTTPS from ``source`` (the offer's bulk path).

    Asks for each run of missing chunks with one range request on one kept-alive connection and
    stores the chunks in the download's buffer as they arrive (one chunk in memory at a time),
    in order, under the running whole-slice SHA-256 (one hash per byte,
    :meth:`~swarm.peer.weights.shipping.SliceDownload.receive_streamed`); when the whole does not
    match, each chunk is checked against its own hash and those that fail are asked for again
    (the download gives up after ``MAX_CHUNK_RETRIES``). URLs are tried in order; the first that
    answers with the pinned certificate serves the rest. ``progress(done_bytes, total_bytes)``
    runs on the event loop. Returns the base URL that served (None when the download was
    already complete), to try first next time. Cancelling the call closes the connection and
    returns once the transfer thread has let go of ``download``.

    Raises:
        SliceUnreachable: no URL answered with the pinned certificate, the token was refused, or
            the connection broke (the chunks already verified stay in the download: resumable).
        RemoteProtocolError: the server answered with bytes other than those asked for.
        WeightIntegrityError: a chunk kept failing its SHA-256, or the whole slice does not match.
    """
    loop = asyncio.get_running_loop()
    report = None
    if progress is not None:
        def report(done: int, total: int) -> None:
            loop.call_soon_threadsafe(progress, done, total)
    transfer = _Transfer(download, source, report, connect_timeout_s, read_timeout_s)
    done = asyncio.ensure_future(asyncio.to_thread(transfer.run))
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        transfer.stop()
        while not done.done():  # the thread stops at once; a second cancel must not skip the wait
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([done])
        raise


class _FingerprintMismatch(OSError):
    """The server's certificate is not the pinned one."""


class _Stopped(Exception):
    """The caller cancelled the transfer."""


class _PinnedConnection(http.client.HTTPSConnection):
    """An HTTPS connection that checks the server certificate's SHA-256 against the offer's pin
    before anything (the token) is sent — also when ``http.client`` reconnects on its own."""

    def __init__(self, host: str, port: int, pin: bytes, connect_timeout_s: float, read_timeout_s: float) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False  # no CA on a LAN: the pin below is the check
        ctx.verify_mode = ssl.CERT_NONE
        super().__init__(host, port, context=ctx, timeout=connect_timeout_s)
        self._pin, self._read_timeout_s = pin, read_timeout_s

    def connect(self) -> None:
        super().connect()
        der = self.sock.getpeercert(binary_form=True) or b""
        if not hmac.compare_digest(hashlib.sha256(der).digest(), self._pin):
            self.close()
            raise _FingerprintMismatch("certificate does not match the pinned SHA-256 (another server answers there)")
        self.sock.settimeout(self._read_timeout_s)


class _Transfer:
    """One :func:`fetch_https` call, run in a worker thread."""

    def __init__(self, download: SliceDownload, source: HttpsSource, progress: Progress | None,
                 connect_timeout_s: float, read_timeout_s: float) -> None:
        self.download, self.source, self.progress = download, source, progress
        self._timeouts = (connect_timeout_s, read_timeout_s)
        self._conn: _PinnedConnection | None = None
        self._stopped = False
        self._store = ThreadPoolExecutor(1, thread_name_prefix="slice-store")
        self._stores: deque[Future] = deque()  # chunks handed to the store thread, in order
        self._buffers = [memoryview(bytearray(download.manifest.chunk_size)) for _ in range(PIPELINE)]

    def stop(self) -> None:
        """From the event loop: end the transfer (its blocking read fails at once)."""
        self._stopped = True
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def run(self) -> str | None:
        dl, m = self.download, self.download.manifest
        base: str | None = None
        try:
            while not dl.complete:
                runs = _runs(dl.missing)
                if not runs:  # a partial file whose chunks all match, yet the whole does not
                    raise WeightIntegrityError(f"slice {m.hex_id[:12]}: every chunk matches its hash but the whole "
                                               "does not; the manifest is inconsistent — refusing it")
                for first, count in runs:
                    if self._conn is None:
                        base = self._connect(base)
                    try:
                        self._fetch_run(base, first, count)
                    except (OSError, http.client.HTTPException) as exc:
                        if self._stopped:
                            raise _Stopped from None
                        # cut off, stalled past the read timeout, or reset
                        raise SliceUnreachable(f"slice server {base} broke off slice {m.hex_id[:12]}: "
                                               f"{exc!r:.200}") from None
        except _Stopped:
            return None
        finally:
            if self._conn is not None:
                self._conn.close()
            self._drain(0, raising=False)
            self._store.shutdown()
            try:  # a stream cut short: keep what matches its own hash
                self._log(dl.check_streamed())
            except WeightIntegrityError as exc:  # never hides the exception that ended the transfer
                log.warning("slice %s: %s", m.hex_id[:12], exc)
        return base

    def _connect(self, base: str | None) -> str:
        pin = bytes.fromhex(self.source.cert_sha256)
        failures = []
        for url in [base] if base else self.source.urls:
            parts = urlsplit(url)
            conn = _PinnedConnection(parts.hostname or "", parts.port or 443, pin, *self._timeouts)
            try:
                conn.connect()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if base is not None:  # it answered before: the connection broke
                    raise SliceUnreachable(f"slice server {url} broke off slice "
                                           f"{self.download.manifest.hex_id[:12]}: {exc!r:.200}") from None
                failures.append(f"{url}: {type(exc).__name__}: {exc}"[:200])
                continue
            self._conn = conn
            return url
        raise SliceUnreachable(f"no slice server URL answered for slice {self.download.manifest.hex_id[:12]}: "
                               + "; ".join(failures))

    def _fetch_run(self, base: str, first: int, count: int) -> None:
        """One range request for chunks ``first .. first+count-1``."""
        dl, m, conn = self.download, self.download.manifest, self._conn
        assert conn is not None
        if self._stopped:  # cancelled while connecting: stop() found no socket to shut
            raise _Stopped
        start, _ = m.chunk_span(first)
        _, stop = m.chunk_span(first + count - 1)
        url = f"{base}{PATH_PREFIX}{m.hex_id}"
        conn.request("GET", PATH_PREFIX + m.hex_id, headers={
            "Authorization": f"Bearer {self.source.token}", "Range": f"bytes={start}-{stop - 1}"})
        resp = conn.getresponse()
        if resp.status in (401, 403):
            why = resp.read(4096)[:200].decode(errors="replace").strip()
            raise SliceUnreachable(f"slice server {url} refused the token ({resp.status}: {why})")
        if resp.status != 206:
            raise RemoteProtocolError(f"slice server {url} answered {resp.status} to bytes {start}-{stop - 1}: "
                                      f"{resp.read(4096)[:200].decode(errors='replace').strip()}")
        want = f"bytes {start}-{stop - 1}/{m.size}"
        if resp.getheader("Content-Range") != want or resp.length != stop - start:
            raise RemoteProtocolError(f"slice server {url} sent Content-Range {resp.getheader('Content-Range')!r}, "
                                      f"length {resp.length} for {want!r}")
        for index in range(first, first + count):
            self._drain(PIPELINE - 1)  # the buffer this chunk reuses is free
            a, b = m.chunk_span(index)
            chunk = self._buffers[index % PIPELINE][: b - a]
            got = 0
            while got < len(chunk):
                if self._stopped:
                    raise _Stopped
                n = resp.readinto(chunk[got:])
                if not n:
                    raise http.client.IncompleteRead(bytes(), len(chunk) - got)
                got += n
            self._stores.append(self._store.submit(self._keep, index, chunk))
        self._drain(0)  # the next run starts from what the download then lacks

    def _keep(self, index: int, chunk: memoryview) -> None:
        """In the store thread: hash and write one chunk."""
        self._log(self.download.receive_streamed(index, chunk))
        if self.progress:
            self.progress(self.download.done_bytes, self.download.manifest.size)

    def _drain(self, keep: int, *, raising: bool = True) -> None:
        """Wait until at most ``keep`` chunks are queued for the store thread (its errors are raised)."""
        while len(self._stores) > keep:
            done = self._stores.popleft()
            if raising:
                done.result()
            else:
                wait([done])

    def _log(self, events: list) -> None:
        for event in events:
            if isinstance(event, ChunkRejected):
                log.warning("slice %s chunk %d refused (%s); fetching it again",
                            self.download.manifest.hex_id[:12], event.index, event.reason)
