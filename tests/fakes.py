"""Test fakes shared by the tests.

:class:`LoopbackNet`: an in-process message network, real wire encoding, no sockets.

Each peer attaches a handler; :meth:`LoopbackNet.send` encodes the message with
:func:`swarm.peer.net.messages.encode`, lets an optional ``tamper`` hook drop, delay
or rewrite the bytes (loss, corruption, a lying peer), decodes them with
:func:`swarm.peer.net.messages.decode` — so a tampered frame meets the same checks as
one from the network — and hands the message to the destination's handler on
that destination's own thread, in order, like one reliable ordered data channel.
Frames that fail to decode are dropped and counted, as a link would drop them.

Real links (:mod:`swarm.peer.net.link`) take its place in the loopback and multi-host
tests; the coordinator and worker only see ``send(peer, msg)`` and handlers.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from swarm.errors import RemoteProtocolError
from swarm.peer.net import messages

log = logging.getLogger(__name__)

Handler = Callable[[str, Any], None]
Tamper = Callable[[str, str, bytes], bytes | None]  # (src, dst, frame) → frame to deliver, or None to drop


class LoopbackNet:
    """Peers by id, each with a handler run on its own single thread (ordered delivery)."""

    def __init__(self, tamper: Tamper | None = None) -> None:
        self.tamper = tamper
        self.rejected = 0  # frames that failed to decode at the receiver
        self._handlers: dict[str, Handler] = {}
        self._threads: dict[str, cf.ThreadPoolExecutor] = {}
        self._down: set[str] = set()
        self._on_down: list[Callable[..., None]] = []

    def attach(self, peer: str, handler: Handler) -> None:
        self._handlers[peer] = handler
        self._threads[peer] = cf.ThreadPoolExecutor(1, thread_name_prefix=f"net-{peer[:6]}")

    def on_peer_down(self, callback: Callable[..., None]) -> None:
        """``callback(peer)`` when :meth:`kill` takes a peer away (a link's close event);
        ``callback(peer, reason, left=True)`` when the peer closed its link (it leaves)."""
        self._on_down.append(callback)

    def dispatcher(self, src: str, *, on_peer_failed: Callable[[str, str], None] | None = None) -> LoopbackDispatcher:
        """``src``'s side of this net in the shape RemoteFFN and StagedFFN take."""
        return LoopbackDispatcher(self, src, on_peer_failed=on_peer_failed)

    def send(self, src: str, dst: str, msg: Any) -> None:
        if src in self._down or dst in self._down or dst not in self._handlers:
            raise ConnectionError(f"no link from {src} to {dst}")
        data = messages.encode(msg)
        if self.tamper is not None:
            data = self.tamper(src, dst, data)
            if data is None:
                return
        self._threads[dst].submit(self._deliver, src, dst, data)

    def _deliver(self, src: str, dst: str, data: bytes) -> None:
        if dst in self._down:
            return
        try:
            msg = messages.decode(data)
        except RemoteProtocolError as exc:
            self.rejected += 1
            log.info("dropped a frame from %s to %s: %s", src, dst, exc)
            return
        try:
            self._handlers[dst](src, msg)
        except Exception:  # a handler bug must not kill the delivery thread silently
            log.exception("handler of %s failed on %s", dst, type(msg).__name__)

    def kill(self, peer: str, *, left: bool = False) -> None:
        """Take ``peer`` away as if its process died (``left``: as if it left, closing its link):
        nothing more to or from it."""
        self._down.add(peer)
        for cb in self._on_down:
            if left:
                cb(peer, "it closed its link (leaving)", left=True)
            else:
                cb(peer)

    def close(self) -> None:
        for t in self._threads.values():
            t.shutdown(wait=True, cancel_futures=True)


@dataclass
class LoopbackDispatcher:
    """A coordinator's links over a :class:`LoopbackNet`, as a
    :class:`~swarm.peer.coordinator.dispatch.Dispatcher`: requests go out through the net
    (non-blocking, thread-safe); failures and refusals go to the callbacks set here, liveness
    comes from ``heard`` (None: unknown)."""

    net: LoopbackNet
    src: str
    on_peer_failed: Callable[[str, str], None] | None = None
    on_peer_not_ready: Callable[[str, str], None] | None = None
    heard: Callable[[str], float | None] | None = None

    def send(self, peer: str, msg: Any) -> None:
        self.net.send(self.src, peer, msg)

    def last_heard(self, peer: str) -> float | None:
        return self.heard(peer) if self.heard is not None else None

    def peer_failed(self, peer: str, reason: str) -> None:
        if self.on_peer_failed is not None:
            self.on_peer_failed(peer, reason)

    def peer_not_ready(self, peer: str, reason: str) -> None:
        if self.on_peer_not_ready is not None:
            self.on_peer_not_ready(peer, reason)

    def lead_state(self, term: int) -> bool | None:
        return True
