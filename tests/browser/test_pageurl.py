"""The page URL `join` prints: HTTPS at the signaling server, the key only in the fragment."""

from __future__ import annotations

from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest

from swarm.errors import AddressError
from swarm.keys.swarmkey import SwarmKey
from web_peer.pageurl import page_link_text, page_url

CODE = SwarmKey(bytes(range(32))).code


def test_page_url_keeps_the_key_in_the_fragment():
    url = page_url("wss://192.168.1.20:8443/ws", CODE)
    parts = urlsplit(url)
    assert (parts.scheme, parts.hostname, parts.port, parts.path, parts.fragment) == ("https", "192.168.1.20", 8443, "/", CODE)
    assert CODE not in url.split("#")[0]  # never in what a browser sends to the server
    assert page_url("wss://[fe80::1]:9/ws", "K") == "https://[fe80::1]:9/#K"
    # every form --signal takes gives the same page (join --signal HOST:PORT printed nothing but an error)
    for form in ("192.168.1.20:8443", "https://192.168.1.20:8443", "wss://192.168.1.20:8443/ws"):
        assert page_url(form, "K") == "https://192.168.1.20:8443/#K"
    for bad in ("ws://1.2.3.4:5/ws", "wss://host/ws", ""):
        with pytest.raises(AddressError):
            page_url(bad, CODE)


def test_page_link_text_for_a_peer_on_a_server_has_url_and_qr():
    rv = SimpleNamespace(server=None, signal_url="wss://10.0.0.7:4443/ws", record=None)
    text = page_link_text(rv, CODE)
    assert f"https://10.0.0.7:4443/#{CODE}" in text
    assert "█" in text or "▀" in text or "▄" in text  # the QR code's half blocks
    assert page_link_text(SimpleNamespace(server=None, signal_url=None, record=None), CODE) is None


def test_join_header_prints_the_page_link():
    from rich.console import Console

    from swarm.cli.join import _print_header

    rv = SimpleNamespace(server=None, client=SimpleNamespace(host="hostpeer"), signal_url="wss://10.0.0.7:4443/ws", record=None)
    node = SimpleNamespace(rendezvous=rv, swarm_id="59a5996c7f649f5e", peer_id="p" * 26, name="laptop", role="worker",
                           swarm_key=SwarmKey(bytes(range(32))))
    console = Console(record=True, width=200)
    _print_header(console, node)
    assert f"https://10.0.0.7:4443/#{CODE}" in console.export_text()
