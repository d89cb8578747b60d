"""Which addresses a host advertises: reachable LAN first, virtual/VPN only as a fallback."""

from __future__ import annotations

import ipaddress

import ifaddr

from swarm.discovery.addresses import choose_addresses, default_route_address, local_addresses


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


def test_the_default_routes_lan_address_goes_first_on_a_multi_homed_host():
    pairs = [("eth0", "10.0.0.5"), ("wlan0", "192.168.1.20"), ("docker0", "172.17.0.1"), ("eth1", "169.254.9.9")]
    assert choose_addresses(pairs) == ["10.0.0.5", "192.168.1.20", "169.254.9.9"]
    assert choose_addresses(pairs, default_route="192.168.1.20") == ["192.168.1.20", "10.0.0.5", "169.254.9.9"]
    # a VPN that holds the default route is not the LAN: its address stays out
    vpn = [("wg0", "10.8.0.2"), ("wlan0", "192.168.1.20")]
    assert choose_addresses(vpn, default_route="10.8.0.2") == ["192.168.1.20"]
    # macOS internet sharing / VM bridges are virtual too
    assert choose_addresses([("bridge100", "192.168.2.1"), ("en0", "192.168.1.20")]) == ["192.168.1.20"]
    assert choose_addresses([("eth0", "10.0.0.5"), ("eth0:1", "10.0.0.5")]) == ["10.0.0.5"]


def test_default_route_address_is_one_of_this_machines_or_none():
    found = default_route_address()
    if found is not None:  # a machine without a default route has none
        assert found in {ip.ip for a in ifaddr.get_adapters() for ip in a.ips if isinstance(ip.ip, str)}


def test_default_route_address_inside_a_namespace_without_routes():
    from tests.peer._links import run_in_netns

    async def probe():
        return default_route_address(), local_addresses()

    assert run_in_netns(probe, 30, prefix="csd", address="10.213.7.1") == (None, ["10.213.7.1"])


def test_the_page_url_lists_the_hosts_other_addresses(monkeypatch):
    from types import SimpleNamespace

    from swarm.discovery import addresses
    from swarm.signaling.address import SignalAddress
    from web_peer.pageurl import page_addresses, page_link_text

    monkeypatch.setattr(addresses, "local_addresses", lambda: ["192.168.1.20", "10.0.0.5"])
    server = SimpleNamespace(port=8443, address=lambda host: SignalAddress(host, 8443))
    rv = SimpleNamespace(server=server, signal_url=None, record=None)
    assert page_addresses(rv) == [SignalAddress("192.168.1.20", 8443), SignalAddress("10.0.0.5", 8443)]
    text = page_link_text(rv, "CODE")
    first, other = text.index("https://192.168.1.20:8443/#CODE"), text.index("https://10.0.0.5:8443/#CODE")
    assert first < other and "another network" in text
    record = SimpleNamespace(port=9000, addresses=("10.0.0.7", "10.0.1.7"))
    assert page_addresses(SimpleNamespace(server=None, signal_url=None, record=record))[1] == SignalAddress("10.0.1.7", 9000)
    assert page_addresses(SimpleNamespace(server=None, signal_url="10.0.0.9:1", record=None)) == [SignalAddress("10.0.0.9", 1)]
