"""Which local addresses to advertise for the signaling server and put in the peer page URL.

Advertise what other machines on the LAN can actually reach, best first: IPv4 only (zeroconf
across network namespaces works with IPv4); the address of the interface that holds the default
route before other LAN addresses (on a multi-homed host that is the network the phone is most
likely on); interfaces of virtual bridges and VPNs (docker, veth, tun, wg, tailscale, macOS
internet-sharing bridges, …) only when nothing else exists; link-local (169.254/16) after
routable ones; loopback only on a machine with no other interface.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable

import ifaddr

VIRTUAL_PREFIXES = (
    "docker", "br-", "veth", "virbr", "vmnet", "vboxnet", "lxc", "lxd", "incusbr", "cni", "flannel", "cali",
    "cilium", "weave", "kube", "podman", "tun", "tap", "wg", "tailscale", "zt", "utun", "ppp", "ipsec",
    "nordlynx", "bridge", "vnic", "vmenet", "awdl", "llw", "anpi", "dummy",
)
# TEST-NET-1 (RFC 5737): connecting a UDP socket to it picks the default route's source address
# without sending a packet.
ROUTE_PROBE = ("192.0.2.1", 9)


def choose_addresses(adapters: Iterable[tuple[str, str]], default_route: str | None = None) -> list[str]:
    """Order ``(interface name, IPv4 address)`` pairs by reachability; return the usable addresses.

    ``default_route`` is the source address of the default route (:func:`default_route_address`),
    if any: it goes first when it is a LAN address (not a VPN's or a virtual bridge's).
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
    ordered = [address for rank, address in sorted(scored, key=lambda s: (s[0], s[1] != default_route)) if rank in keep]
    return list(dict.fromkeys(ordered))  # one address on two interfaces is listed once


def default_route_address() -> str | None:
    """The IPv4 address this machine sends from towards its default route, or None without one."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(ROUTE_PROBE)
        return probe.getsockname()[0]
    return None


def local_addresses() -> list[str]:
    """This machine's IPv4 addresses to advertise, best first (see :func:`choose_addresses`)."""
    pairs = [(a.nice_name, ip.ip) for a in ifaddr.get_adapters() for ip in a.ips if isinstance(ip.ip, str)]
    return choose_addresses(pairs, default_route_address())
