"""The one parser of a signaling address: every documented form names the same server."""

from __future__ import annotations

import pytest

from swarm.errors import AddressError
from swarm.signaling.address import SignalAddress
from swarm.signaling.client import signaling_url


@pytest.mark.parametrize("text", [
    "192.168.1.20:8443",
    " 192.168.1.20:8443 ",
    "https://192.168.1.20:8443",
    "https://192.168.1.20:8443/",
    "https://192.168.1.20:8443/#ABCD-EFGH",  # the page URL, pasted with its key fragment
    "wss://192.168.1.20:8443",
    "wss://192.168.1.20:8443/ws",
    "WSS://192.168.1.20:8443/ws",
])
def test_every_documented_form_parses_to_one_address(text):
    address = SignalAddress.parse(text)
    assert address == SignalAddress("192.168.1.20", 8443)
    assert address.ws_url == "wss://192.168.1.20:8443/ws"
    assert address.page_url == "https://192.168.1.20:8443/"
    assert address.status_url == "https://192.168.1.20:8443/api/status"
    assert signaling_url(text) == address.ws_url


def test_names_and_ipv6_hosts():
    assert SignalAddress.parse("laptop.local:9000").ws_url == "wss://laptop.local:9000/ws"
    v6 = SignalAddress.parse("[fe80::1]:9000")
    assert v6.host == "fe80::1" and v6.ws_url == "wss://[fe80::1]:9000/ws" and str(v6) == "[fe80::1]:9000"
    assert SignalAddress.parse("https://[fe80::1]:9000/") == v6
    assert SignalAddress("fe80::1", 9000).netloc == "[fe80::1]:9000"


@pytest.mark.parametrize("text, needle", [
    ("", "empty signaling address"),
    ("192.168.1.20", "names no port"),
    ("https://192.168.1.20/", "names no port"),
    ("192.168.1.20:0", "outside 1-65535"),
    ("192.168.1.20:99999", "not a signaling address"),
    ("192.168.1.20:http", "not a signaling address"),
    ("http://192.168.1.20:8443", "TLS only"),
    ("ws://192.168.1.20:8443/ws", "TLS only"),
    ("ftp://host:1", "TLS only"),
    ("fe80::1:8443", "IPv6 address in brackets"),
    ("https://192.168.1.20:8443/api/status", "unexpected path"),
    ("https://192.168.1.20:8443/ws", "unexpected path"),
    ("wss://192.168.1.20:8443/ws?x=1", "no user name or query"),
    ("wss://user@192.168.1.20:8443/ws", "no user name or query"),
    (":8443", "names no host"),
])
def test_bad_addresses_say_what_is_wrong_and_show_a_form(text, needle):
    with pytest.raises(AddressError) as exc:
        SignalAddress.parse(text)
    assert needle in str(exc.value)
