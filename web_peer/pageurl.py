"""The peer page's address, as `colibri-swarm join` prints it (text and a terminal QR code).

The page is served by the swarm's signaling server over HTTPS (a secure context: WebGPU and
WebCrypto need one). The swarm key travels in the URL **fragment** (``#CODE``), which browsers
never send to a server, so the key is not in any request or server log (DESIGN §6).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from swarm.errors import LocalProtocolError


def page_url(signal_url: str, key_code: str) -> str:
    """``https://HOST:PORT/#CODE`` for the signaling server at ``signal_url`` (``wss://HOST:PORT/ws``).

    Raises LocalProtocolError when ``signal_url`` is not a wss:// URL with a host and a port.
    """
    parts = urlsplit(signal_url)
    if parts.scheme != "wss" or not parts.hostname or parts.port is None:
        raise LocalProtocolError(f"{signal_url!r} is not a wss://HOST:PORT signaling URL")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"https://{host}:{parts.port}/#{key_code}"


def rendezvous_signal_url(rv: Any) -> str | None:
    """The signaling URL a phone on the LAN can reach, from a node's Rendezvous, or None.

    Hosting: this machine's best LAN address (never 127.0.0.1: the phone is another device);
    else the server we are on (``--signal URL`` or the mDNS record).
    """
    if getattr(rv, "server", None) is not None and rv.server.port is not None:
        from swarm.discovery.addresses import local_addresses

        addresses = local_addresses()
        return rv.server.url(addresses[0]) if addresses else None
    if getattr(rv, "signal_url", None):
        return rv.signal_url
    record = getattr(rv, "record", None)
    return record.url() if record is not None and record.addresses else None


def page_link_text(rv: Any, key_code: str) -> str | None:
    """What `join` prints for phones: the page URL and its QR code, or None when unknown."""
    from swarm.peer.keycmd import render_qr

    signal = rendezvous_signal_url(rv)
    if signal is None:
        return None
    url = page_url(signal, key_code)
    return (f"open on a phone or tablet to add it to the swarm (accept the self-signed certificate):\n"
            f"  {url}\n{render_qr(url)}")
