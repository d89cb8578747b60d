"""Finding the coordinator's API on the LAN: an mDNS record the coordinator advertises.

Service type ``_colibri-api._tcp.local.``; one instance per coordinator term. TXT keys:

========  ============================================================
``v``     record version (``1``)
``sid``   swarm id (16 hex digits; :attr:`SwarmKey.swarm_id`, never the key)
``term``  the coordinator's election term (decimal); the highest live term wins
``host``  the coordinator's peer id
``path``  the API's base path (``/v1``)
``tls``   ``1`` when the API serves HTTPS (absent or ``0``: plain HTTP)
========  ============================================================

The record says where to knock, not whom to trust: every request still carries the swarm's
bearer token, which only key holders can compute, so a stranger's fake record earns a 401.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

import ifaddr
from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from swarm.discovery.mdns import ServiceAdvertiser, open_zeroconf
from swarm.errors import SwarmError

log = logging.getLogger(__name__)

API_SERVICE_TYPE = "_colibri-api._tcp.local."
RECORD_VERSION = "1"
RESOLVE_TIMEOUT_MS = 2000
FIND_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class ApiRecord:
    """One advertised coordinator API: ``url`` is the OpenAI base URL (``https://A:P/v1``)."""

    swarm_id: str
    term: int
    host: str
    url: str


def local_ipv4_addresses() -> list[str]:
    """This machine's IPv4 addresses, non-loopback first (loopback only when nothing else)."""
    found = [ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips if isinstance(ip.ip, str)]
    outside = [a for a in found if not a.startswith("127.")]
    return outside or found


class ApiAdvertiser(ServiceAdvertiser):
    """Announces this coordinator's API for one term; :meth:`close` sends the goodbye."""

    def __init__(self, zc: AsyncZeroconf, *, swarm_id: str, host: str, term: int, port: int,
                 addresses: list[str] | None = None, path: str = "/v1", scheme: str | None = "https") -> None:
        addresses = addresses or local_ipv4_addresses()
        super().__init__(zc, AsyncServiceInfo(
            API_SERVICE_TYPE, f"colibri-api-{host[:24]}-{term}.{API_SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in addresses], port=port,
            properties={"v": RECORD_VERSION, "sid": swarm_id, "term": str(term), "host": host, "path": path,
                        "tls": "1" if scheme == "https" else "0"},
            server=f"colibri-api-{host[:40]}.local.",
        ))


def parse_record(properties: dict, addresses: list[str], port: int, swarm_id: str) -> ApiRecord | None:
    """The record if it is a well-formed one of our swarm, else None (strangers' records are ignored)."""
    props = {k.decode() if isinstance(k, bytes) else k: (v.decode() if isinstance(v, bytes) else v)
             for k, v in properties.items()}
    term, path = props.get("term") or "", props.get("path") or ""
    if props.get("v") != RECORD_VERSION or props.get("sid") != swarm_id or not term.isdigit() \
            or not path.startswith("/") or not addresses or not 0 < port < 65536:
        return None
    scheme = "https" if props.get("tls") == "1" else "http"
    return ApiRecord(swarm_id, int(term), props.get("host") or "", f"{scheme}://{addresses[0]}:{port}{path}")


async def find_api(swarm_id: str, timeout_s: float = FIND_TIMEOUT_S, zc: AsyncZeroconf | None = None) -> ApiRecord:
    """Browse mDNS for ``timeout_s`` and return the API record of the highest term.

    Raises:
        SwarmError: no coordinator of this swarm advertised an API in time.
    """
    own = zc is None
    zc = zc or open_zeroconf()
    found: dict[str, ApiRecord] = {}
    tasks: set[asyncio.Task] = set()

    async def resolve(name: str) -> None:
        info = AsyncServiceInfo(API_SERVICE_TYPE, name)
        if await info.async_request(zc.zeroconf, RESOLVE_TIMEOUT_MS):
            record = parse_record(info.properties, info.parsed_addresses(IPVersion.V4Only), info.port or 0, swarm_id)
            if record is not None:
                found[name] = record

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            found.pop(name, None)
        else:
            task = asyncio.get_running_loop().create_task(resolve(name))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    browser = AsyncServiceBrowser(zc.zeroconf, API_SERVICE_TYPE, handlers=[on_change])
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not found and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if found:
            await asyncio.sleep(0.2)  # let records of other terms that answer in the same burst arrive
    finally:
        await browser.async_cancel()
        for task in list(tasks):
            task.cancel()
        if own:
            await zc.async_close()
    if not found:
        raise SwarmError(f"no coordinator API of swarm {swarm_id} answered on mDNS within {timeout_s:.0f} s; "
                         "is `colibri-swarm join` running on this LAN? (or pass --api URL)")
    return max(found.values(), key=lambda r: (r.term, r.host))
