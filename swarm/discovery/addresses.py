"""Which local addresses to advertise for the signaling server.

Advertise what other machines can actually reach: IPv4 first (DESIGN §9: zeroconf across
namespaces works with IPv4), interfaces of virtual bridges and VPNs (docker, veth, tun, wg,
tailscale, …) only when nothing else exists, link-local (169.254/16) after routable ones,
loopback only on a machine with no other interface.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

import ifaddr

VIRTUAL_PREFIXES = (
    "docker", "br-", "veth", "virbr", "vmnet", "vboxnet", "lxc", "lxd", "cni", "flannel", "cali",
    "podman", "tun", "tap", "wg", "tailscale", "zt", "utun", "ppp", "ipsec", "nordlynx",
)


def choose_addresses(adapters: Iterable[tuple[str, str]]) -> list[str]:
    """Order ``(interface name, IPv4 address)`` pairs by reachability; return the usable addresses.

    Pure: tests pass pairs; :func:`local_addresses` passes the machine's.
    """
    scored: list[tuple[int, str]] = []
    for name, address in adapters:
        try:
            ip = ipaddress.IPv4Address(address)
        except ValueError:
            continue
        if ip.is_unspecified or ip.is_multicast:
            continue
        if ip.is_loopback:
            rank = 3
        elif name.lower().startswith(VIRTUAL_PREFIXES):
            rank = 2
        elif ip.is_link_local:
            rank = 1
        else:
            rank = 0
        scored.append((rank, address))
    if not scored:
        return []
    best = min(rank for rank, _ in scored)
    # Link-local addresses ride along with routable ones (same LAN, no DHCP); the rest only as a fallback.
    keep = {0, 1} if best <= 1 else {best}
    return [address for rank, address in sorted(scored, key=lambda s: s[0]) if rank in keep]


def local_addresses() -> list[str]:
    """This machine's IPv4 addresses to advertise, best first (see :func:`choose_addresses`)."""
    pairs = [(a.nice_name, ip.ip) for a in ifaddr.get_adapters() for ip in a.ips if isinstance(ip.ip, str)]
    return choose_addresses(pairs)
