"""The mesh: one authenticated link to every other Python peer, and to browsers that offer.

Theory of operation
-------------------
The mesh is fed what signaling says — the presence list (:meth:`Mesh.sync`, :meth:`peer_joined`,
:meth:`peer_left`) and relayed signals (:meth:`handle_signal`) — and answers with signals of
its own through the ``send_signal`` callable it was given. It knows nothing of WebSockets or
mDNS, so any signaling path (the rendezvous, a test bus) can drive it.

* Who offers: between two Python peers, the one with the lower peer id (a deterministic rule,
  so two peers never offer to each other at once). It keeps dialing, with a pause of
  :data:`RETRY_S` between attempts, while the other peer is present and no link is open.
* Browser peers connect to the coordinator only, and always offer (Chrome forms the link
  through peer-reflexive candidates when it offers). The mesh answers them only while
  ``accept_browsers()`` says so.
* A link lives as long as its heartbeats: a peer that drops off signaling (the signaling host
  left) keeps its link. An offer from a peer we already have a link to means that peer started
  over; the old link is closed and the new one replaces it.
* Every link must prove the id signaling stamped on its signals, and the kind of peer signaling
  announced; a Python peer's id must also be the hash of its DTLS certificate key
  (:mod:`swarm.peer.net.link`), so a member cannot stand in for another.

Signals are JSON objects: ``{"type": "offer"|"answer", "sdp": str, "session": str}`` and
``{"type": "candidate", "candidate": str, "sdpMid": str, "sdpMLineIndex": int, "session": str}``
(browsers trickle; aiortc sends complete SDP). ``session`` pairs an answer with its offer so a
late answer to an abandoned attempt is ignored.

Every task the mesh starts is owned by it and cancelled by :meth:`Mesh.close`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiortc import RTCIceCandidate
from aiortc.rtcdtlstransport import RTCCertificate
from aiortc.sdp import candidate_from_sdp

from swarm.errors import RemoteProtocolError, SwarmError
from swarm.peer.net.link import Handler, Link, new_peer_connection
from swarm.peer.net.messages import Hello
from swarm.signaling.messages import PeerInfo

log = logging.getLogger(__name__)

RETRY_S = 1.0  # pause between dial attempts to a present peer with no open link
# Longest one remote ICE candidate may take to add. aioice resolves a browser's `<uuid>.local`
# candidate by mDNS and waits 1 s for an answer that may never come; candidates are added in
# tasks of their own, so that wait never holds up the signals behind them.
CANDIDATE_TIMEOUT_S = 2.0
MAX_SDP_CHARS = 32 << 10  # an aiortc or Chrome SDP with a few candidates is ~1-3 KB

SendSignal = Callable[[str, dict[str, Any]], Awaitable[None]]


class Mesh:
    """Links to the swarm's peers, kept current from signaling. See the module docstring.

    ``links``: the open links by remote peer id (a live dict: read it, do not change it).
    ``on_link_up`` / ``on_link_down``: lists of callbacks, ``cb(link)`` and ``cb(peer_id)``.
    ``link_options``: keyword arguments for every :class:`~swarm.peer.net.link.Link` (timeouts).
    """

    def __init__(
        self,
        *,
        local_hello: Hello,
        certificate: RTCCertificate,
        auth_key: bytes,
        send_signal: SendSignal,
        accept_browsers: Callable[[], bool] = lambda: False,
        link_options: dict[str, Any] | None = None,
        retry_s: float = RETRY_S,
    ) -> None:
        self.peer_id = local_hello.peer_id
        self.local_hello = local_hello
        self.links: dict[str, Link] = {}
        self.on_link_up: list[Callable[[Link], Any]] = []
        self.on_link_down: list[Callable[[str], Any]] = []
        self._certificate = certificate
        self._auth_key = auth_key
        self._send_signal = send_signal
        self._accept_browsers = accept_browsers
        self._link_options = link_options or {}
        self._retry_s = retry_s
        self._present: dict[str, PeerInfo] = {}
        self._attempts: dict[str, _Attempt] = {}  # peer id -> the link being set up with it
        self._dialers: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self._handlers: dict[type, Handler] = {}
        self._made: set[Link] = set()  # every link made and not yet released; close() waits for them
        self._closed_by_peer: set[str] = set()  # peers whose last link went down because they closed it
        self._closed = False

    def closed_by_peer(self, peer_id: str) -> bool:
        """Whether the last link to ``peer_id`` that went down was closed by that peer (as one that
        leaves closes its links) rather than lost; for ``on_link_down`` callbacks. False once a new
        link to it is up."""
        return peer_id in self._closed_by_peer

    # -- handlers -------------------------------------------------------------------------------

    def on(self, message_type: type, handler: Handler) -> None:
        """Deliver ``message_type`` from every link, current and future, to ``handler(link, msg)``."""
        self._handlers[message_type] = handler
        for link in [*self.links.values(), *(attempt.link for attempt in self._attempts.values())]:
            link.on(message_type, handler)

    # -- presence -------------------------------------------------------------------------------

    def sync(self, presence: Iterable[PeerInfo]) -> None:
        """Take a full presence list (on every (re)connection to a signaling server)."""
        present = {p.peer_id: p for p in presence if p.peer_id != self.peer_id}
        for gone in set(self._present) - set(present):
            self.peer_left(gone)
        for info in present.values():
            self.peer_joined(info)

    def peer_joined(self, info: PeerInfo) -> None:
        if info.peer_id == self.peer_id or self._closed:
            return
        self._present[info.peer_id] = info
        dialer = self._dialers.get(info.peer_id)
        # a dialer that has just ended (its peer had left) may not be forgotten yet: start anew
        if info.kind == "python" and self.peer_id < info.peer_id and (dialer is None or dialer.done()):
            task = self._spawn(self._dial(info.peer_id))
            self._dialers[info.peer_id] = task
            task.add_done_callback(self._dialer_done)

    def peer_left(self, peer_id: str) -> None:
        """A peer left signaling: stop dialing it. An open link stays while its heartbeats do."""
        self._present.pop(peer_id, None)
        dialer = self._dialers.get(peer_id)
        if dialer is not None and peer_id not in self.links:
            dialer.cancel()  # else it ends by itself when the link closes
            del self._dialers[peer_id]  # forgotten now: a rejoin in this very tick starts a new one

    def _dialer_done(self, task: asyncio.Task) -> None:
        for peer_id, t in list(self._dialers.items()):
            if t is task:
                del self._dialers[peer_id]

    # -- signals --------------------------------------------------------------------------------

    async def handle_signal(self, sender: str, data: dict[str, Any]) -> None:
        """A signal relayed from ``sender`` (stamped by the server). Bad signals are logged and dropped."""
        try:
            await self._handle_signal(sender, data)
        except SwarmError as exc:
            log.warning("dropped a signal from %s: %s", sender, exc)
        except Exception as exc:  # aiortc refusing a well-formed but unusable SDP or candidate
            log.warning("dropped a signal from %s: %s: %s", sender, type(exc).__name__, exc)

    async def _handle_signal(self, sender: str, data: dict[str, Any]) -> None:
        kind, session = data.get("type"), data.get("session", "")
        if not isinstance(session, str) or len(session) > 64:
            raise RemoteProtocolError("'session' must be a string of at most 64 characters")
        attempt: _Attempt | None
        match kind:
            case "offer":
                sdp = _sdp(data)
                info = self._present.get(sender)
                if info is not None and info.kind == "browser" and not self._accept_browsers():
                    log.info("refused an offer from browser peer %s: browsers connect to the coordinator", sender)
                    return
                old = self._attempts.pop(sender, None)
                if old is not None:
                    old.cancel_candidates()
                    self._spawn(old.link.close("superseded by a new offer"))
                # registered now, not in the task: the candidates that follow the offer find it
                attempt = self._attempts[sender] = _Attempt(session, self._new_link(sender, offerer=False), self._spawn)
                self._spawn(self._answer(sender, attempt, sdp))
            case "answer":
                attempt = self._attempts.get(sender)
                if attempt is None or attempt.session != session:
                    log.info("ignored an answer from %s to an abandoned offer", sender)
                    return
                await attempt.link.accept_answer(_sdp(data))
                attempt.remote_description_set()
            case "candidate":
                attempt = self._attempts.get(sender)
                if attempt is None or attempt.session != session or not data.get("candidate"):
                    return  # end-of-candidates, or for an attempt that is gone
                attempt.add_candidate(data)  # never waits: see CANDIDATE_TIMEOUT_S
            case _:
                raise RemoteProtocolError(f"unknown signal type {kind!r}")

    # -- dialing and answering ------------------------------------------------------------------

    def _new_link(self, peer_id: str, offerer: bool) -> Link:
        self._made = {made for made in self._made if not made.released}
        pc, channel = new_peer_connection(self._certificate)
        info = self._present.get(peer_id)
        link = Link(pc, channel, certificate=self._certificate, auth_key=self._auth_key, local_hello=self.local_hello,
                    offerer=offerer, expected_peer_id=peer_id, remote_kind=info.kind if info else None,
                    **self._link_options)
        for message_type, handler in self._handlers.items():
            link.on(message_type, handler)
        self._made.add(link)
        return link

    async def _dial(self, peer_id: str) -> None:
        """Offer to ``peer_id`` until a link is open; again whenever it closes, while present."""
        while not self._closed and peer_id in self._present:
            if peer_id not in self.links:
                try:
                    attempt = _Attempt(secrets.token_hex(8), self._new_link(peer_id, offerer=True), self._spawn)
                except Exception as exc:  # noqa: BLE001 - as below: the dialer must outlive one attempt
                    log.warning("dialing %s failed: %s: %s (trying again)", peer_id, type(exc).__name__, exc)
                    await asyncio.sleep(self._retry_s)
                    continue
                self._attempts[peer_id] = attempt
                link = attempt.link
                try:
                    offer = await link.create_offer()
                    await self._send_signal(peer_id, {"type": "offer", "sdp": offer, "session": attempt.session})
                    await self._establish(link)
                except SwarmError as exc:
                    log.info("no link to %s yet: %s", peer_id, exc)
                    await link.close(str(exc))
                except Exception as exc:  # noqa: BLE001 - a dialer that died would leave its peer unlinked for good
                    log.warning("dialing %s failed: %s: %s (trying again)", peer_id, type(exc).__name__, exc)
                    await link.close(f"{type(exc).__name__}: {exc}")
                finally:
                    self._attempt_over(peer_id, attempt)
            if peer_id in self.links:
                await self.links[peer_id].wait_closed()
            else:
                await asyncio.sleep(self._retry_s)

    async def _answer(self, peer_id: str, attempt: _Attempt, sdp: str) -> None:
        link = attempt.link
        try:
            answer = await link.accept_offer(sdp)
            attempt.remote_description_set()
            await self._send_signal(peer_id, {"type": "answer", "sdp": answer, "session": attempt.session})
            await self._establish(link)
        except SwarmError as exc:
            log.info("offer from %s failed: %s", peer_id, exc)
            await link.close(str(exc))
        finally:
            self._attempt_over(peer_id, attempt)

    def _attempt_over(self, peer_id: str, attempt: _Attempt) -> None:
        """Forget a finished attempt; a link it leaves unopened (cancelled midway) is aborted."""
        if self._attempts.get(peer_id) is attempt:
            del self._attempts[peer_id]
        attempt.cancel_candidates()
        if self.links.get(peer_id) is not attempt.link:
            attempt.link.abort("link set-up abandoned")

    async def _establish(self, link: Link) -> None:
        """Wait for ``link`` to open, then make it the link to its peer (closing any older one)."""
        await link.established()
        peer_id = link.peer_id
        assert peer_id is not None
        if self._closed:
            await link.close("mesh closed")
            return
        old = self.links.get(peer_id)
        if old is not None:
            # The new link is the link from now on: the old one is down for every observer at
            # once (what was pending on it fails now, not at a deadline), then the new one is up
            # (plans and requests go to it); the old closes in the background.
            del self.links[peer_id]
            log.info("link down: %s (replaced by a new link: the peer started over)", peer_id)
            for down in list(self.on_link_down):
                _call(down, peer_id)
            self._spawn(old.close("replaced by a new link (the peer started over)"))
        self.links[peer_id] = link
        self._closed_by_peer.discard(peer_id)
        link.on_close(self._on_link_closed)
        log.info("link up: %s (%s, %s)", peer_id, link.hello.name if link.hello else "?", "offered" if link.offerer else "answered")
        for cb in list(self.on_link_up):
            _call(cb, link)

    def _on_link_closed(self, link: Link) -> None:
        peer_id = link.peer_id
        if peer_id is None or self.links.get(peer_id) is not link:
            return
        if link.closed_by_peer:  # first: whoever finds the link gone (another thread too) may ask why
            self._closed_by_peer.add(peer_id)
        del self.links[peer_id]
        self._spawn(link.close(link.close_reason or "closed"))
        log.info("link down: %s (%s)", peer_id, link.close_reason)
        for cb in list(self.on_link_down):
            _call(cb, peer_id)

    # -- life cycle -----------------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Close every link and cancel every task; idempotent.

        Returns once every peer connection the mesh made is released, including those whose
        closing a cancelled task had started.
        """
        self._closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._attempts.clear()
        await asyncio.gather(*(link.close("peer leaving") for link in self._made), return_exceptions=True)
        self._made.clear()
        self.links.clear()


class _Attempt:
    """A link being set up: its signal session, and the remote ICE candidates being added.

    Candidates that come before the remote SDP is applied are held, then added with it. Each is
    added in a task of its own (started with ``spawn``, so the mesh owns it), bounded by
    :data:`CANDIDATE_TIMEOUT_S`; nothing here waits for one. The tasks end with the attempt.
    """

    MAX_EARLY_CANDIDATES = 64
    MAX_PENDING_CANDIDATES = 64  # being added at once; more are dropped (and logged)

    def __init__(self, session: str, link: Link, spawn: Callable[[Awaitable[Any]], asyncio.Task]) -> None:
        self.session = session
        self.link = link
        self._spawn = spawn
        self._early: list[RTCIceCandidate] | None = []  # None once the remote SDP is applied
        self._pending: set[asyncio.Task] = set()

    def add_candidate(self, data: dict[str, Any]) -> None:
        """Add a candidate signal's candidate; RemoteProtocolError when it is malformed."""
        candidate = _candidate(data)
        if self._early is None:
            self._start(candidate)
        elif len(self._early) < self.MAX_EARLY_CANDIDATES:
            self._early.append(candidate)

    def remote_description_set(self) -> None:
        early, self._early = self._early or [], None
        for candidate in early:
            self._start(candidate)

    def cancel_candidates(self) -> None:
        for task in self._pending:
            task.cancel()

    def _start(self, candidate: RTCIceCandidate) -> None:
        if len(self._pending) >= self.MAX_PENDING_CANDIDATES:
            log.info("dropped ICE candidate %s: %d candidates are still being added", candidate.ip, len(self._pending))
            return
        task = self._spawn(self._add(candidate))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _add(self, candidate: RTCIceCandidate) -> None:
        try:
            await asyncio.wait_for(self.link.pc.addIceCandidate(candidate), CANDIDATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.info("ICE candidate %s not added within %g s; left out", candidate.ip, CANDIDATE_TIMEOUT_S)
        except Exception as exc:  # aiortc refusing a well-formed but unusable candidate
            log.info("ICE candidate %s refused: %s: %s", candidate.ip, type(exc).__name__, exc)


def _sdp(data: dict[str, Any]) -> str:
    sdp = data.get("sdp")
    if not isinstance(sdp, str) or not 0 < len(sdp) <= MAX_SDP_CHARS:
        raise RemoteProtocolError(f"'sdp' must be a non-empty string of at most {MAX_SDP_CHARS} characters")
    return sdp


def _candidate(data: dict[str, Any]) -> RTCIceCandidate:
    """The ICE candidate of a candidate signal; RemoteProtocolError when it is malformed."""
    text = data["candidate"]
    if not isinstance(text, str) or len(text) > 1024:
        raise RemoteProtocolError("'candidate' must be a string of at most 1024 characters")
    try:
        candidate = candidate_from_sdp(text.removeprefix("candidate:"))
    except (ValueError, IndexError) as exc:
        raise RemoteProtocolError(f"malformed ICE candidate: {exc}") from None
    candidate.sdpMid = data.get("sdpMid") if isinstance(data.get("sdpMid"), str) else None
    index = data.get("sdpMLineIndex")
    candidate.sdpMLineIndex = index if isinstance(index, int) else None
    return candidate


def _call(cb: Callable[..., Any], arg: Any) -> None:
    """Run an observer; a failing one is logged and must not stop the others."""
    try:
        result = cb(arg)
        if asyncio.iscoroutine(result):
            task = asyncio.ensure_future(result)
            _observer_tasks.add(task)
            task.add_done_callback(_observer_tasks.discard)
    except Exception:
        log.exception("mesh observer %r failed", cb)


_observer_tasks: set[asyncio.Task] = set()
