"""mDNS adapters over python-zeroconf's async API: advertise a signaling server, browse for them
(the coordinator API's record uses the same adapters: :mod:`.api_record`).

All share one :class:`zeroconf.asyncio.AsyncZeroconf` made by :func:`open_zeroconf`
(``InterfaceChoice.All``, IPv4: works across network namespaces and without a default route).
Records are parsed and chosen by the pure modules :mod:`.records` and :mod:`.choice`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from swarm.discovery.addresses import local_addresses
from swarm.discovery.records import SERVICE_TYPE, ServerRecord, decode_txt, encode_txt, is_ours
from swarm.errors import RemoteProtocolError

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT_MS = 3000


def open_zeroconf() -> AsyncZeroconf:
    """An AsyncZeroconf on every interface, IPv4 only. Close it with ``await zc.async_close()``."""
    return AsyncZeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)


def instance_name(host_peer_id: str, started: float) -> str:
    """A service instance name unique per server run (≤ 63 bytes, RFC 6763 §4.1.1)."""
    return f"colibri-{host_peer_id[:32]}-{int(started * 1000) % 10**9}.{SERVICE_TYPE}"


class ServiceAdvertiser:
    """Announces one service instance (``info``) on ``zc``; :meth:`close` sends the goodbye packets."""

    def __init__(self, zc: AsyncZeroconf, info: AsyncServiceInfo) -> None:
        self._zc = zc
        self._info = info

    async def start(self) -> None:
        """Register (probe + announce). zeroconf returns a task that must be awaited as well (docs/architecture.md §7)."""
        await (await self._zc.async_register_service(self._info, allow_name_change=True))

    async def close(self) -> None:
        """Withdraw the service: goodbye packets (TTL 0) so browsers drop it at once."""
        with contextlib.suppress(Exception):  # zeroconf already closed: nothing left to withdraw
            await (await self._zc.async_unregister_service(self._info))


class Advertiser(ServiceAdvertiser):
    """Announces one signaling server."""

    def __init__(self, zc: AsyncZeroconf, record: ServerRecord) -> None:
        addresses = list(record.addresses) or local_addresses()
        self.record = record
        super().__init__(zc, AsyncServiceInfo(
            SERVICE_TYPE, record.name,
            addresses=[socket.inet_aton(a) for a in addresses],
            port=record.port, properties=encode_txt(record),
            server=record.host_name,
        ))


class ServerBrowser:
    """Keeps the current set of signaling servers of one swarm; ``changed`` is set on every change.

    ``records`` maps instance name → :class:`ServerRecord` (our swarm id and protocol only).
    """

    def __init__(self, zc: AsyncZeroconf, swarm_id: str) -> None:
        self.swarm_id = swarm_id
        self.records: dict[str, ServerRecord] = {}
        self.other_swarms: set[str] = set()  # swarm ids of other swarms' servers seen on the LAN
        self.changed = asyncio.Event()
        self._zc = zc
        self._tasks: set[asyncio.Task[None]] = set()
        self._browser: AsyncServiceBrowser | None = None

    async def start(self) -> None:
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])

    async def close(self) -> None:
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            if self.records.pop(name, None) is not None:
                self.changed.set()
            return
        task = asyncio.get_running_loop().create_task(self._resolve(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self._zc.zeroconf, RESOLVE_TIMEOUT_MS):
            log.debug("mDNS: %s did not resolve", name)
            return
        try:
            record = decode_txt(name, info.properties, tuple(info.parsed_addresses(IPVersion.V4Only)))
        except RemoteProtocolError as exc:
            log.info("mDNS: ignoring %s", exc)
            return
        if record.swarm_id != self.swarm_id:
            self.other_swarms.add(record.swarm_id)  # join says so: the user may have meant that one
            return
        if not is_ours(record, self.swarm_id) or not record.addresses:
            return
        if self.records.get(name) != record:
            self.records[name] = record
            self.changed.set()
