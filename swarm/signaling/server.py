"""The signaling server: an aiohttp app over HTTPS that a Python peer hosts in-process.

Routes:
  ``GET /``            the peer page (``web_peer/index.html``), ``GET /<file>`` its static files
                       (only page assets: .html .js .css .wgsl .json; never the package's Python)
  ``GET /ws``          the WebSocket signaling protocol (docs/protocol.md, "Signaling")
  ``GET /api/status``  public facts as JSON: service, protocol, swarm id, host peer id, started,
                       fingerprint, number of peers (presence itself only goes to authenticated peers)

Usage (interface for ``colibri-swarm join``)::

    server = SignalingServer(swarm_key, host_peer_id)
    await server.start("0.0.0.0", 0)        # port 0: any free port; see server.port
    print(server.certificate.fingerprint)   # people compare this; mDNS advertises it
    url = server.url("127.0.0.1")           # wss://127.0.0.1:PORT/ws
    ...
    await server.stop()

The protocol itself lives in the sans-I/O :class:`~swarm.signaling.relay.SignalingRelay`;
this module only moves its outputs onto sockets. Each connection has a bounded outbox drained
by its own writer task, so one slow reader cannot stall relay to the others (it is closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import itertools
import logging
import time
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

from swarm import __version__, paths
from swarm.errors import LocalProtocolError
from swarm.httpserver import HttpServer
from swarm.signaling import auth, tls
from swarm.signaling.address import SignalAddress
from swarm.signaling.messages import PROTOCOL_VERSION
from swarm.signaling.relay import Close, CloseCode, Output, Send, SignalingRelay

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # WebSocket ping interval; no pong within half of it → connection dropped
OUTBOX_FRAMES = 256  # frames queued for one slow reader before it is closed
TIMER_POLL_S = 1.0  # longest sleep of the authentication-deadline task
SERVICE = "colibri-swarm"


class SignalingServer:
    """Hosts signaling for one swarm. See the module docstring for the lifecycle."""

    def __init__(self, swarm_key: bytes, host_peer_id: str, *, config_dir: Path | None = None,
                 heartbeat_s: float = HEARTBEAT_S, **relay_options: Any) -> None:
        self.swarm_id = auth.swarm_id(swarm_key)
        self.host_peer_id = host_peer_id
        self.certificate = tls.load_or_create(config_dir or paths.config_dir())
        self.relay = SignalingRelay(k_sig=auth.derive_signaling_key(swarm_key), host=host_peer_id, **relay_options)
        self.heartbeat_s = heartbeat_s
        self.started: float | None = None  # unix seconds, set by start()
        self.port: int | None = None
        self._runner: HttpServer | None = None
        self._outboxes: dict[int, asyncio.Queue[Output | None]] = {}
        self._ids = itertools.count(1)
        self._timer_wake = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str = "0.0.0.0", port: int = 0) -> None:
        """Listen on ``host:port`` over HTTPS (port 0 picks a free one, then read ``self.port``).

        Raises LocalProtocolError when already started; OSError when the port cannot be bound.
        """
        if self._runner is not None:
            raise LocalProtocolError("signaling server already started")
        app = web.Application()
        app.router.add_get("/", self._index)
        app.router.add_get("/ws", self._websocket)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/{path:.+}", self._asset)
        app.cleanup_ctx.append(self._timer_ctx)
        http = HttpServer(app, name="signaling server", shutdown_timeout=1.0)
        self.port = await http.start(host, port, self.certificate.ssl_context())
        self._runner = http
        self.started = time.time()
        log.info("signaling server on port %d, certificate SHA-256 %s", self.port, self.certificate.fingerprint)

    async def stop(self) -> None:
        """Close every WebSocket (code 4050) and stop listening. Safe to call twice."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        for conn in list(self._outboxes):
            self._enqueue(Close(conn, CloseCode.SERVER_STOPPING, "signaling server stopping"))
        await runner.close()

    def url(self, address: str) -> str:
        """The WebSocket URL at ``address`` (an IP or host name reachable by the client)."""
        return self.address(address).ws_url

    def page_url(self, address: str) -> str:
        """The peer page's HTTPS URL at ``address`` (append ``#<key code>`` for the QR code)."""
        return self.address(address).page_url

    def address(self, host: str) -> SignalAddress:
        """This server at ``host`` (an IP or host name reachable by the client)."""
        if self.port is None:
            raise LocalProtocolError("signaling server not started")
        return SignalAddress(host, self.port)

    def status(self) -> dict[str, Any]:
        """The public status document served at /api/status."""
        return {
            "service": SERVICE, "protocol": PROTOCOL_VERSION, "version": __version__,
            "swarm_id": self.swarm_id, "host": self.host_peer_id, "started": self.started,
            "fingerprint": self.certificate.fingerprint, "peers": len(self.relay.peers),
        }

    # -- HTTP ------------------------------------------------------------------------------

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return _asset_response("index.html")

    async def _asset(self, request: web.Request) -> web.StreamResponse:
        return _asset_response(request.match_info["path"])

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        # aiohttp's own limit is a backstop above ours, so the relay can give the precise reason.
        ws = web.WebSocketResponse(heartbeat=self.heartbeat_s, max_msg_size=2 * self.relay.max_frame_chars + 16,
                                   compress=False)
        await ws.prepare(request)
        conn = next(self._ids)
        outbox: asyncio.Queue[Output | None] = asyncio.Queue(OUTBOX_FRAMES)
        self._outboxes[conn] = outbox
        writer = asyncio.create_task(self._writer(ws, outbox), name=f"signaling-writer-{conn}")
        try:
            self._apply(self.relay.connect(conn, time.time(), request.remote or ""))
            self._timer_wake.set()
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    self._apply(self.relay.receive(conn, msg.data, time.time()))
                elif msg.type == WSMsgType.BINARY:
                    self._apply(self.relay.receive(conn, bytes(msg.data), time.time()))
                else:
                    break
        except ConnectionError as exc:  # the client's socket reset under us: it is gone
            log.info("signaling connection %d reset: %s", conn, exc)
        finally:
            del self._outboxes[conn]
            self._apply(self.relay.disconnect(conn, time.time()))
            with contextlib.suppress(asyncio.QueueFull):
                outbox.put_nowait(None)
            try:
                await asyncio.wait_for(writer, 1.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the socket is gone either way
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writer
            # A client that stalled (SIGSTOP) and came back finds its socket already reset:
            # closing it again is no news, not an error.
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.close()
        return ws

    # -- output ----------------------------------------------------------------------------

    def _apply(self, outputs: list[Output]) -> None:
        for out in outputs:
            self._enqueue(out)

    def _enqueue(self, out: Output) -> None:
        outbox = self._outboxes.get(out.conn)
        if outbox is None:
            return
        try:
            outbox.put_nowait(out)
        except asyncio.QueueFull:
            log.warning("signaling connection %d reads too slowly; closing it", out.conn)
            self._apply(self.relay.disconnect(out.conn, time.time()))
            while not outbox.empty():
                outbox.get_nowait()
            outbox.put_nowait(Close(out.conn, CloseCode.RATE_LIMITED, "reading too slowly"))

    @staticmethod
    async def _writer(ws: web.WebSocketResponse, outbox: asyncio.Queue[Output | None]) -> None:
        while (out := await outbox.get()) is not None:
            try:
                match out:
                    case Send(text=text):
                        await ws.send_str(text)
                    case Close(code=code, reason=reason):
                        log.info("closing signaling connection %d: %d %s", out.conn, code, reason)
                        await ws.close(code=code, message=reason.encode())
                        return
            except (ConnectionError, RuntimeError):
                return

    async def _timer_ctx(self, app: web.Application):  # cleanup_ctx: owns the deadline task
        task = asyncio.create_task(self._timer_loop(), name="signaling-auth-deadlines")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _timer_loop(self) -> None:
        while True:
            deadline = self.relay.next_deadline()
            wait = TIMER_POLL_S if deadline is None else min(TIMER_POLL_S, max(0.0, deadline - time.time()))
            self._timer_wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._timer_wake.wait(), wait)
            self._apply(self.relay.handle_timer(time.time()))


ASSET_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css",
               ".wgsl": "text/wgsl", ".json": "application/json"}


def _asset_response(path: str) -> web.StreamResponse:
    """A file of the peer page, or 404 naming what is missing; nothing outside web_peer/."""
    root = _web_peer_dir()
    if root is None:
        return web.Response(status=404, text="the peer page is not installed (package web_peer missing)\n")
    target = (root / path).resolve()
    kind = ASSET_TYPES.get(target.suffix)
    if kind is None or not target.is_relative_to(root.resolve()) or not target.is_file():
        return web.Response(status=404, text=f"no such page asset: /{path}\n")
    return web.FileResponse(target, headers={"Content-Type": kind, "Cache-Control": "no-cache"})


def _web_peer_dir() -> Path | None:
    """The folder of the installed ``web_peer`` package, or None when it is not a plain folder."""
    try:
        root = importlib.resources.files("web_peer")
    except ModuleNotFoundError:
        return None
    path = Path(str(root))
    return path if path.is_dir() else None
