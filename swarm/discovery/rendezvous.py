"""Find-or-host: one object that keeps a peer connected to its swarm's signaling server.

Interface for ``colibri-swarm join`` (swarm.peer.node)::

    rv = Rendezvous(swarm_key, peer_id, name="laptop")      # kind="python"
    await rv.start()             # returns once connected (found by mDNS, or hosting one itself)
    rv.peers                     # {peer_id: PeerInfo} of the current server, including us
    rv.hosting, rv.server        # whether we host, and our SignalingServer (for its URL, fingerprint)
    await rv.send_signal(peer_id, {...})     # SDP offer/answer, ICE candidates
    async for event in rv:       # Connected, PeerJoined, PeerLeft, SignalReceived, SignalRefused
        ...
    await rv.stop()              # goodbye on mDNS, server stopped, connection closed

Theory of operation. A :class:`~swarm.discovery.mdns.ServerBrowser` runs for the whole life of
the peer. To connect, the peer tries the server :func:`~swarm.discovery.choice.pick_server`
names (oldest live one); a server that refuses or drops it is set aside for ``DEAD_RETRY_S``
while it has been failing for less than ``DEAD_PATIENCE_S`` (its host may be a laptop with its lid
closed: once it wakes, its swarm must find it again within seconds, or the two sides of a split
signaling elect apart), then doubling with each failure up to ``DEAD_RETRY_MAX_S`` (a record mDNS
keeps listing after its host died costs one attempt every 5 minutes, not one every few seconds).
With none found before a deadline, the peer hosts one: the deadline is the discovery window
for a fresh peer, and :func:`~swarm.discovery.choice.takeover_delay` after losing a server,
so the lowest surviving Python peer id hosts anew and the others find it by mDNS. While
connected, a better server (two were started at once) makes the peer move to it; a host that
moves stops its own server and its clients follow. Every (re)connection is announced by a
:class:`Connected` event carrying the full presence list; diff it against what you knew.
With ``signal_url`` (``--signal URL``) mDNS is skipped and the peer reconnects to that URL, never
giving it up: after ``RECONNECT_S``, doubling up to ``RECONNECT_MAX_S``, one log line per attempt.

Liveness is re-decided on timers, not only on mDNS news: a lost connection is first retried
on the same server (the stall may have been ours), a server set aside is tried again when its
pause ends, and while connected the peer looks for a better server every ``RECHECK_S``,
so two sides of a healed split converge on the older server. Whatever exception ends a
connection, the loop logs it once and reconnects (or hosts); only a key or protocol version
refused at a ``--signal`` URL ends it, and then the event stream ends with that error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from swarm.discovery.addresses import local_addresses
from swarm.discovery.choice import DISCOVERY_WINDOW_S, TAKEOVER_STEP_S, is_better, pick_server, takeover_delay
from swarm.discovery.mdns import Advertiser, ServerBrowser, instance_name, open_zeroconf
from swarm.discovery.records import ServerRecord
from swarm.errors import (
    AuthenticationError,
    DuplicatePeerError,
    LocalProtocolError,
    SignalingUnavailableError,
    SwarmError,
    VersionMismatchError,
)
from swarm.signaling.auth import swarm_id as swarm_id_of
from swarm.signaling.client import (
    PROCESS_INSTANCE,
    Disconnected,
    PeerJoined,
    PeerLeft,
    SignalingClient,
    SignalReceived,
    SignalRefused,
)
from swarm.signaling.messages import PROTOCOL_VERSION, PeerInfo
from swarm.signaling.server import SignalingServer

log = logging.getLogger(__name__)

DEAD_RETRY_S = 5.0  # a server that refused or dropped us is tried again after this long …
DEAD_PATIENCE_S = 60.0  # … for as long as it has failed for less than this (a sleeping host wakes) …
DEAD_RETRY_MAX_S = 300.0  # … then doubling at each failure, up to this: a dead record mDNS still lists
# (its host gone without a goodbye) costs a connection attempt every 5 minutes, not every 6 s
RECHECK_S = 2.0  # while connected, look this often for a better server even without mDNS news
CONNECT_TIMEOUT_S = 3.0  # per address; a LAN answers in milliseconds
RECONNECT_S = 1.0  # pause between attempts at a fixed --signal URL …
RECONNECT_MAX_S = 30.0  # … doubling at each failure in a row, up to this


@dataclass(frozen=True)
class Connected:
    """Connected (again) to a signaling server: who hosts it, whether we do, the full presence."""

    host: str
    hosting: bool
    url: str
    peers: tuple[PeerInfo, ...]


Event = Connected | PeerJoined | PeerLeft | SignalReceived | SignalRefused


class HostPortError(SwarmError):
    """The signaling port the user fixed (``join --port``) cannot be bound: retrying would not
    free it, so the rendezvous ends with this."""


class Rendezvous:
    """Keeps one peer connected to its swarm's signaling server (see the module docstring)."""

    def __init__(self, swarm_key: bytes, peer_id: str, *, name: str = "", kind: str = "python",
                 signal_url: str | None = None, fingerprint: bytes | str | None = None,
                 config_dir: Path | None = None, bind_host: str = "0.0.0.0", bind_port: int = 0,
                 discovery_window_s: float = DISCOVERY_WINDOW_S, takeover_step_s: float = TAKEOVER_STEP_S) -> None:
        self.swarm_key = swarm_key
        self.swarm_id = swarm_id_of(swarm_key)
        self.peer_id = peer_id
        self.name = name
        self.kind = kind
        self.signal_url = signal_url
        self.fingerprint = fingerprint
        self.config_dir = config_dir
        self.bind_host = bind_host
        self.bind_port = bind_port  # the signaling server's port when this peer hosts it (0: a free one)
        self.discovery_window_s = discovery_window_s
        self.takeover_step_s = takeover_step_s
        self.server: SignalingServer | None = None
        self.client: SignalingClient | None = None
        self.record: ServerRecord | None = None  # the server we are connected to, when found by mDNS
        self._zc = None
        self._browser: ServerBrowser | None = None
        self._advertiser: Advertiser | None = None
        self._dead: dict[tuple[str, float], float] = {}  # server key -> when it may be tried again (monotonic)
        self._failures_of: dict[tuple[str, float], int] = {}  # server key -> failed attempts in a row
        self._failing_since: dict[tuple[str, float], float] = {}  # server key -> its first failure in a row
        self._events: asyncio.Queue[Event | None] = asyncio.Queue()
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._announce: asyncio.Task[None] | None = None
        self._error: SwarmError | None = None
        self._found_none = False
        self._failures = 0  # unexpected errors in a row (the first is logged with its traceback)

    # -- public ----------------------------------------------------------------------------

    @property
    def hosting(self) -> bool:
        return self.server is not None

    @property
    def found_none(self) -> bool:
        """True when mDNS found no server of our swarm at start, so this peer hosts a new one."""
        return self._found_none

    @property
    def other_swarms(self) -> set[str]:
        """Swarm ids of other swarms' signaling servers seen by mDNS (empty with ``--signal``)."""
        return set(self._browser.other_swarms) if self._browser is not None else set()

    @property
    def peers(self) -> dict[str, PeerInfo]:
        return dict(self.client.peers) if self.client is not None else {}

    async def start(self, timeout: float | None = None) -> None:
        """Start discovery and return once connected to a server (or hosting one).

        Raises AuthenticationError when the server refuses our key (the URL was given by hand).
        """
        if self._task is not None:
            raise LocalProtocolError("rendezvous already started")
        if self.signal_url is None:
            self._zc = open_zeroconf()
            self._browser = ServerBrowser(self._zc, self.swarm_id)
            await self._browser.start()
        self._task = asyncio.create_task(self._main(), name=f"rendezvous-{self.peer_id[:8]}")
        waiter = asyncio.create_task(self._connected.wait())
        done, _ = await asyncio.wait({waiter, self._task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self._task in done:
            self._task.result()  # re-raises what ended the loop
        if not done:
            raise SignalingUnavailableError(f"no signaling server within {timeout:g} s")

    async def send_signal(self, to: str, data: dict[str, Any]) -> None:
        """Relay ``data`` to peer ``to`` through the current server.

        Raises SignalingUnavailableError while between servers (retry after the next Connected).
        """
        if self.client is None:
            raise SignalingUnavailableError("not connected to a signaling server right now")
        await self.client.send_signal(to, data)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        """The next event; StopAsyncIteration after stop(), or the error that ended the rendezvous."""
        event = await self._events.get()
        if event is None:
            self._events.put_nowait(None)
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        return event

    async def stop(self) -> None:
        """Close the connection, withdraw our mDNS record (goodbye) and stop our server."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, SwarmError):
                await self._task
        await self._drop_client()
        await self._stop_hosting()
        if self._browser is not None:
            await self._browser.close()
        if self._zc is not None:
            await self._zc.async_close()
        self._events.put_nowait(None)

    # -- the loop --------------------------------------------------------------------------

    async def _main(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the loop only ends on an error it cannot recover from: say so, end the stream
            if not isinstance(exc, SwarmError):
                log.exception("rendezvous failed")
                exc = SwarmError(f"signaling stopped after an unexpected error: {exc!r}")
            log.error("rendezvous ended: %s", exc)
            self._error = exc
            self._events.put_nowait(None)
            raise exc from None

    async def _run(self) -> None:
        """Connect, follow, and after every loss reconnect (or host). Only a refused key or
        protocol version at a ``--signal`` URL ends it: anything else is logged and retried."""
        delay = self.discovery_window_s
        client: SignalingClient | None = None
        while True:
            try:
                if client is None:
                    client = await (self._connect_fixed() if self.signal_url else self._find_or_host(delay))
                while True:
                    self._set_client(client)
                    moved = await self._follow(client)
                    if moved is None:
                        break
                    client = moved
            except (AuthenticationError, VersionMismatchError, DuplicatePeerError, HostPortError):
                raise
            except Exception as exc:  # the boundary no connection error may cross: log, reconnect
                self._failures += 1
                log.log(logging.WARNING if self._failures == 1 else logging.INFO,
                        "signaling failed (%r); reconnecting", exc, exc_info=self._failures == 1)
                await asyncio.sleep(RECONNECT_S)
            client, delay = await self._after_loss(client, delay)

    async def _after_loss(self, lost: SignalingClient | None, delay: float) -> tuple[SignalingClient | None, float]:
        """Close ``lost``; reconnect to its server at once if it still answers (the stall was
        ours), else set it aside and return how long to look for another before hosting."""
        await self._drop_client()
        if lost is None:
            return None, delay
        if self.record is not None and not self.hosting:
            again = await self._try(self.record)
            if again is not None:
                log.info("reconnected to the signaling server of %s", again.host)
                return again, delay
        delay = takeover_delay(self.peer_id, tuple(lost.peers.values()), lost.host, self.takeover_step_s)
        log.info("signaling server of %s lost; hosting after %.1f s unless another appears", lost.host, delay)
        return None, delay

    async def _connect_fixed(self) -> SignalingClient:
        """Connect to the ``--signal`` URL, which the user typed: never given up, retried after
        RECONNECT_S, doubling up to RECONNECT_MAX_S."""
        attempt = 0
        while True:
            try:
                client = await SignalingClient.connect(self.signal_url, self.swarm_key, self.peer_id, kind=self.kind,
                                                       name=self.name, fingerprint=self.fingerprint)
                if attempt:
                    log.info("reached the signaling server at %s after %d failed attempt(s)", self.signal_url, attempt)
                return client
            except SignalingUnavailableError as exc:
                pause = min(RECONNECT_S * 2 ** min(attempt, 32), RECONNECT_MAX_S)  # capped: no float overflow
                # The first failure is shown to the user (a wrong --signal would otherwise look like a hang).
                log.log(logging.WARNING if attempt == 0 else logging.INFO,
                        "%s; attempt %d failed, retrying in %g s (check the --signal URL and that its server "
                        "runs)", exc, attempt + 1, pause)
                attempt += 1
                await asyncio.sleep(pause)

    async def _find_or_host(self, delay: float) -> SignalingClient:
        assert self._browser is not None
        deadline = time.monotonic() + delay
        while True:
            if self.server is not None:
                try:
                    return await self._connect_own()
                except SignalingUnavailableError as exc:
                    log.warning("cannot reach our own signaling server (%s); giving it up", exc)
                    await self._stop_hosting()
                    continue
            record = pick_server(self._browser.records.values(), self._dead_keys())
            if record is not None:
                client = await self._try(record)
                if client is not None:
                    self.record = record
                    return client
                continue
            if time.monotonic() >= deadline:
                try:
                    await self._host()
                except OSError as exc:
                    if self.bind_port:  # a port the user fixed: waiting would not free it
                        raise HostPortError(f"cannot host the signaling server on port {self.bind_port}: "
                                         f"{exc.strerror or exc}; pick another with join --port N") from None
                    log.warning("cannot host a signaling server (%s); looking again in %g s", exc, RECONNECT_S)
                    deadline = time.monotonic() + RECONNECT_S
                continue
            self._browser.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._browser.changed.wait(),
                                       max(0.0, min(deadline, self._next_dead_expiry()) - time.monotonic()))

    async def _follow(self, client: SignalingClient) -> SignalingClient | None:
        """Forward events until the connection ends (None) or we moved to a better server (its client).

        Trying a better server runs beside the forwarding, so a candidate that does not answer
        (a vanished host whose mDNS record lingers) never holds up signals on the current one.
        """
        next_event = asyncio.ensure_future(client.__anext__())
        probe: asyncio.Task[tuple[ServerRecord, SignalingClient] | None] | None = None
        try:
            while True:
                waiters: set[asyncio.Future[Any]] = {next_event}
                changed = None
                if probe is not None:
                    waiters.add(probe)
                elif self._browser is not None:
                    # Not cleared on entry: a change seen while we were connecting is checked now.
                    changed = asyncio.ensure_future(self._browser.changed.wait())
                    waiters.add(changed)
                done, _ = await asyncio.wait(waiters, timeout=RECHECK_S, return_when=asyncio.FIRST_COMPLETED)
                if changed is not None and not changed.done():
                    changed.cancel()
                    if not done:  # no news for RECHECK_S: servers set aside may be back (a healed split)
                        done = {changed}
                if next_event in done:
                    try:
                        event = next_event.result()
                    except StopAsyncIteration:
                        return None
                    if isinstance(event, Disconnected):
                        log.info("signaling connection to %s ended: %s %s", client.host, event.code, event.reason)
                        return None
                    self._events.put_nowait(event)
                    next_event = asyncio.ensure_future(client.__anext__())
                if changed is not None and changed in done:
                    assert self._browser is not None
                    self._browser.changed.clear()
                    probe = asyncio.create_task(self._connect_better(), name="rendezvous-probe")
                if probe is not None and probe in done:
                    found, probe = probe.result(), None
                    if found is not None:
                        record, better = found
                        log.info("moving to the older signaling server of %s", record.host)
                        await self._drop_client()
                        await self._stop_hosting()
                        self.record = record
                        return better
        finally:
            next_event.cancel()
            if probe is not None:
                await _discard(probe)

    async def _connect_better(self) -> tuple[ServerRecord, SignalingClient] | None:
        """A connection to a server that wins over ours by the pick rule, or None."""
        assert self._browser is not None
        current = self._advertiser.record if self._advertiser is not None else self.record
        best = pick_server(self._browser.records.values(), self._dead_keys())
        if best is None or current is None or best.key == current.key or not is_better(best, current):
            return None
        if self.hosting and best.is_from(self.peer_id, PROCESS_INSTANCE):
            # our own record (or a stale one of ours): never move to ourselves. One of another
            # process with our peer id (a copied identity) is tried: its server refuses us by name.
            return None
        client = await self._try(best)
        return None if client is None else (best, client)

    # -- helpers ---------------------------------------------------------------------------

    def _set_client(self, client: SignalingClient) -> None:
        self.client = client
        self._failures = 0
        if self.server is not None and self.record is None:
            url = self.server.url("127.0.0.1")
        else:
            url = self.signal_url or (self.record.url() if self.record is not None else "")
        self._events.put_nowait(Connected(host=client.host, hosting=self.hosting, url=url,
                                          peers=tuple(client.peers.values())))
        self._connected.set()

    async def _try(self, record: ServerRecord) -> SignalingClient | None:
        for address in record.addresses:
            try:
                client = await SignalingClient.connect(record.url(address), self.swarm_key, self.peer_id,
                                                       kind=self.kind, name=self.name, fingerprint=record.fingerprint,
                                                       timeout=CONNECT_TIMEOUT_S)
            except DuplicatePeerError:
                raise  # another process holds our peer id there: hosting our own would split the swarm
            except Exception as exc:  # an advertised server is untrusted input: whatever fails, try the next
                log.info("signaling server %s at %s: %s", record.host, address, exc)
            else:
                self._failures_of.pop(record.key, None)
                self._failing_since.pop(record.key, None)
                self._dead.pop(record.key, None)
                return client
        self._set_aside(record)
        return None

    def _set_aside(self, record: ServerRecord) -> None:
        """A learned server that failed: tried again after DEAD_RETRY_S while it has failed for
        less than DEAD_PATIENCE_S, then after a pause doubling with each failure up to
        DEAD_RETRY_MAX_S (a restarted server is a new record, tried at once)."""
        now = time.monotonic()
        failures = self._failures_of.get(record.key, 0) + 1
        self._failures_of[record.key] = failures
        since = self._failing_since.setdefault(record.key, now)
        pause = dead_retry_pause(now - since, failures)
        self._dead[record.key] = now + pause
        if pause == DEAD_RETRY_MAX_S > dead_retry_pause(now - since, failures - 1):  # the first pause at the cap
            log.info("signaling server of %s failed %d times in a row: set aside, tried again every %g s until "
                     "it announces a restart", record.host, failures, DEAD_RETRY_MAX_S)

    async def _host(self) -> None:
        if not self._connected.is_set():
            self._found_none = True
        server = SignalingServer(self.swarm_key, self.peer_id, config_dir=self.config_dir)
        await server.start(self.bind_host, self.bind_port)
        self.server = server
        assert self._zc is not None and server.started is not None and server.port is not None
        record = ServerRecord(
            name=instance_name(self.peer_id, server.started), version=PROTOCOL_VERSION, swarm_id=self.swarm_id,
            port=server.port, fingerprint=server.certificate.sha256, host=self.peer_id, started=server.started,
            addresses=tuple(local_addresses()), instance=PROCESS_INSTANCE,
        )
        self._advertiser = Advertiser(self._zc, record)
        # Announce in the background: probing takes ~1 s and our own connection need not wait.
        self._announce = asyncio.create_task(self._advertiser.start(), name="mdns-announce")
        self._announce.add_done_callback(_log_failure)
        log.info("hosting the signaling server on port %d (certificate %s)", server.port, server.certificate.fingerprint)

    async def _connect_own(self) -> SignalingClient:
        assert self.server is not None
        self.record = None
        return await SignalingClient.connect(self.server.url("127.0.0.1"), self.swarm_key, self.peer_id,
                                             kind=self.kind, name=self.name, fingerprint=self.server.certificate.sha256)

    async def _stop_hosting(self) -> None:
        advertiser, self._advertiser = self._advertiser, None
        if advertiser is not None:
            announce, self._announce = self._announce, None
            if announce is not None and not announce.done():
                announce.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await announce
            await advertiser.close()
        server, self.server = self.server, None
        if server is not None:
            await server.stop()

    async def _drop_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.close()

    def _dead_keys(self) -> set[tuple[str, float]]:
        now = time.monotonic()
        self._dead = {k: t for k, t in self._dead.items() if now < t}
        listed = {r.key for r in self._browser.records.values()} if self._browser is not None else set()
        self._failures_of = {k: n for k, n in self._failures_of.items() if k in listed or k in self._dead}
        self._failing_since = {k: t for k, t in self._failing_since.items() if k in self._failures_of}
        return set(self._dead)

    def _next_dead_expiry(self) -> float:
        return min(self._dead.values(), default=float("inf"))


def dead_retry_pause(failing_s: float, failures: int) -> float:
    """Seconds before a signaling server that has failed ``failures`` times in a row, the first
    ``failing_s`` seconds ago, is tried again: ``DEAD_RETRY_S`` within ``DEAD_PATIENCE_S``, then
    doubling per failure past that window, capped at ``DEAD_RETRY_MAX_S``."""
    if failing_s < DEAD_PATIENCE_S:
        return DEAD_RETRY_S
    past = max(failures - int(DEAD_PATIENCE_S // DEAD_RETRY_S), 1)  # failures after the patient window
    return min(DEAD_RETRY_S * 2 ** min(past, 32), DEAD_RETRY_MAX_S)  # capped: no float overflow


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("mDNS announcement failed: %s (peers can still use --signal URL)", task.exception())


async def _discard(probe: asyncio.Task[tuple[ServerRecord, SignalingClient] | None]) -> None:
    """Cancel a probe; close the connection it made if it finished first."""
    probe.cancel()
    try:
        found = await probe
    except (asyncio.CancelledError, SwarmError, OSError):
        return
    if found is not None:
        await found[1].close()
