"""One way to serve an aiohttp app: bounded request heads, bounded waiting connections.

aiohttp's server waits for a request head as long as the client keeps the connection open
and logs every malformed head (a header over ``max_field_size``, 8190 bytes) as an ERROR with
a traceback. :class:`HttpServer` serves an app through aiohttp's public API with:

- **a head deadline**: a connection has ``header_timeout_s`` to deliver a whole request head,
  counted from when it opened (after the TLS handshake) and again from the end of each
  response (so an idle keep-alive connection is closed after as long). A connection trickling
  its head byte by byte is closed at the deadline. Checked every ``header_timeout_s / 8``
  (at most 1 s) from :attr:`aiohttp.web.Server.connections`; a connection counts as busy from
  the moment its request reaches the app (the first middleware) until its handler returns —
  a long stream or WebSocket, written within its handler, is never cut by the deadline (a large
  body returned whole is written after the handler: such a response to a slow client could be;
  every large body here is streamed);
- **a cap on waiting connections**: at most ``max_waiting`` connections may be waiting for a
  head at once; past that the longest-waiting ones are closed first (a client that means to
  send a request sends its head within milliseconds, so the oldest waiting are the stalled);
- **client errors logged as such**: a malformed request (aiohttp's ``HttpProcessingError``:
  a line or header too long, a bad request line) is answered by aiohttp (400) and logged as
  one INFO line naming the client and what was wrong — no traceback. Errors of the app keep
  their ERROR line and traceback.

The TLS handshake itself is bounded by asyncio (60 s). The bound port is read from the
runner's public :attr:`~aiohttp.web.BaseRunner.addresses`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0  # a connection's time to send a whole request head (and a keep-alive's idle time)
MAX_WAITING = 128  # connections waiting for a request head at once; the oldest are closed past this
CLOSED_LOG_EVERY_S = 60.0  # closed stalled connections are summed into one INFO line at most this often


class _ClientErrorsQuiet(logging.LoggerAdapter):
    """aiohttp's server logger, with a client's malformed request logged as one INFO line."""

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1] if exc_info is True else None
        if isinstance(exc, HttpProcessingError):
            detail = " ".join(str(exc.message).split())[:160]
            self.info("%s: refused a malformed request (%d, %s: %s)", msg % args if args else msg, exc.code,
                      type(exc).__name__, detail)
            return
        self.error(msg, *args, exc_info=exc_info, **kwargs)


class HttpServer:
    """Serves ``app`` (see the module docstring). ``name`` names the server in log lines;
    ``runner_options`` go to :class:`aiohttp.web.AppRunner` (e.g. ``shutdown_timeout``,
    ``handler_cancellation``).

    ``header_timeout_s`` and ``max_waiting`` default to :data:`HEADER_TIMEOUT_S` and
    :data:`MAX_WAITING`. Use ``port = await server.start(host, port, ssl_context)`` (port 0: a free port) and
    ``await server.close()``. :attr:`closed_stalled` counts connections closed for sending no
    request head in time or for waiting past the cap.
    """

    def __init__(self, app: web.Application, *, name: str = "HTTP", header_timeout_s: float | None = None,
                 max_waiting: int | None = None, **runner_options: Any) -> None:
        header_timeout_s = HEADER_TIMEOUT_S if header_timeout_s is None else header_timeout_s
        max_waiting = MAX_WAITING if max_waiting is None else max_waiting
        if header_timeout_s <= 0 or max_waiting < 1:
            raise ValueError(f"header_timeout_s must be > 0 and max_waiting ≥ 1, got {header_timeout_s}, {max_waiting}")
        self.name, self.header_timeout_s, self.max_waiting = name, header_timeout_s, max_waiting
        app.middlewares.insert(0, self._busy_while_handled)
        options = {"access_log": None, "handle_signals": False, "keepalive_timeout": header_timeout_s,
                   "logger": _ClientErrorsQuiet(logging.getLogger("aiohttp.server"), {}), **runner_options}
        self.runner = web.AppRunner(app, **options)
        self.port: int | None = None
        self.closed_stalled = 0
        self._waiting: dict[Any, float] = {}  # connection (aiohttp RequestHandler) -> waiting since (monotonic)
        self._busy: dict[Any, int] = {}  # connection -> requests of it in the app now
        self._sweeper: asyncio.Task | None = None
        self._unlogged, self._logged_at = 0, 0.0

    async def start(self, host: str, port: int, ssl_context: Any = None) -> int:
        """Listen on ``host:port``; returns the bound port. Raises OSError when it cannot be bound."""
        await self.runner.setup()
        try:
            await web.TCPSite(self.runner, host, port, ssl_context=ssl_context).start()
        except BaseException:
            await self.runner.cleanup()
            raise
        self.port = self.runner.addresses[0][1]
        self._sweeper = asyncio.create_task(self._sweep(), name=f"{self.name} head deadline")
        return self.port

    async def close(self) -> None:
        """Stop listening and close every connection (as :meth:`aiohttp.web.BaseRunner.cleanup`). Safe twice."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await self.runner.cleanup()

    @web.middleware
    async def _busy_while_handled(self, request: web.Request, handler: Any) -> web.StreamResponse:
        conn = request.protocol
        self._busy[conn] = self._busy.get(conn, 0) + 1
        self._waiting.pop(conn, None)
        try:
            return await handler(request)
        finally:
            left = self._busy.pop(conn) - 1
            if left:
                self._busy[conn] = left
            else:  # its next request head is due within the deadline, from now
                self._waiting[conn] = time.monotonic()

    async def _sweep(self) -> None:
        period = min(1.0, self.header_timeout_s / 8)
        while True:
            await asyncio.sleep(period)
            self.sweep()

    def sweep(self) -> int:
        """Close connections past their head deadline, then the oldest waiting past the cap;
        returns how many were closed (runs every ``header_timeout_s / 8`` while started)."""
        server = self.runner.server
        if server is None:
            return 0
        now = time.monotonic()
        open_now = server.connections
        alive = set(open_now)
        for conn in [c for c in self._waiting if c not in alive]:
            del self._waiting[conn]
        for conn in [c for c in self._busy if c not in alive]:
            del self._busy[conn]
        for conn in open_now:
            if conn not in self._busy:
                self._waiting.setdefault(conn, now)
        by_age = sorted(self._waiting.items(), key=lambda item: item[1])
        late = [c for c, since in by_age if now - since >= self.header_timeout_s]
        over = max(0, len(by_age) - len(late) - self.max_waiting)
        doomed = late + [c for c, _ in by_age[len(late):len(late) + over]]
        for conn in doomed:
            del self._waiting[conn]
            conn.force_close()
        if doomed:
            self.closed_stalled += len(doomed)
            self._unlogged += len(doomed)
            log.debug("%s: closed %d connection(s): %d sent no request head within %.1f s, %d past the cap of %d "
                      "waiting", self.name, len(doomed), len(late), self.header_timeout_s, over, self.max_waiting)
        if self._unlogged and now - self._logged_at >= CLOSED_LOG_EVERY_S:
            log.info("%s: closed %d connection(s) that sent no request head within %.1f s or waited past the cap "
                     "of %d (a client too slow, or one holding connections open)", self.name, self._unlogged,
                     self.header_timeout_s, self.max_waiting)
            self._unlogged, self._logged_at = 0, now
        return len(doomed)
