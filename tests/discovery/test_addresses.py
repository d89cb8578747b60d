"""Which addresses a host advertises: reachable LAN first, virtual/VPN only as a fallback."""

from __future__ import annotations

import ipaddress

from swarm.discovery.addresses import choose_addresses, local_addresses


def test_lan_beats_docker_vpn_and_loopback():
    pairs = [("lo", "127.0.0.1"), ("docker0", "172.17.0.1"), ("wg0", "10.8.0.2"), ("eth0", "192.168.1.20"),
             ("tailscale0", "100.64.0.3"), ("wlan0", "192.168.2.7"), ("eth0", "fe80::1")]
    assert choose_addresses(pairs) == ["192.168.1.20", "192.168.2.7"]


def test_link_local_rides_along_but_after():
    assert choose_addresses([("en0", "169.254.3.4"), ("en1", "10.0.0.5")]) == ["10.0.0.5", "169.254.3.4"]
    assert choose_addresses([("en0", "169.254.3.4"), ("docker0", "172.17.0.1")]) == ["169.254.3.4"]


def test_virtual_only_then_loopback_only():
    assert choose_addresses([("lo", "127.0.0.1"), ("docker0", "172.17.0.1")]) == ["172.17.0.1"]
    assert choose_addresses([("lo", "127.0.0.1")]) == ["127.0.0.1"]
    assert choose_addresses([]) == []
    assert choose_addresses([("eth0", "0.0.0.0"), ("eth0", "not an ip")]) == []


def test_this_machine():
    found = local_addresses()
    assert found, "every machine has at least loopback"
    assert all(ipaddress.ip_address(a).version == 4 for a in found)
