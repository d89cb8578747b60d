"""The peer page's address, as `colibri-swarm join` prints it (text and a terminal QR code).

The page is served by the swarm's signaling server over HTTPS (a secure context: WebGPU and
WebCrypto need one). The swarm key travels in the URL **fragment** (``#CODE``), which browsers
never send to a server, so the key is not in any request or server log (docs/security.md §3).
"""

from __future__ import annotations

from typing import Any

from swarm.signaling.address import SignalAddress

MORE_ADDRESSES = 4  # other addresses listed under the QR code, for a multi-homed host


def page_url(signal: str | SignalAddress, key_code: str) -> str:
    """``https://HOST:PORT/#CODE`` for the signaling server at ``signal``.

    ``signal`` is a :class:`SignalAddress` or any form it parses (``HOST:PORT``,
    ``https://HOST:PORT``, ``wss://HOST:PORT/ws``); AddressError otherwise.
    """
    address = signal if isinstance(signal, SignalAddress) else SignalAddress.parse(signal)
    return f"{address.page_url}#{key_code}"


def page_addresses(rv: Any) -> list[SignalAddress]:
    """Where a phone on the LAN can reach the signaling server of a node's Rendezvous, best first.

    Hosting: this machine's LAN addresses (:func:`~swarm.discovery.addresses.local_addresses`:
    the default route's interface first, never 127.0.0.1 while another exists: the phone is
    another device); else the server we are on (``--signal`` or the addresses its mDNS record
    advertises). Empty when none is known.
    """
    if getattr(rv, "server", None) is not None and rv.server.port is not None:
        from swarm.discovery.addresses import local_addresses

        return [rv.server.address(a) for a in local_addresses()]
    if getattr(rv, "signal_url", None):
        return [SignalAddress.parse(rv.signal_url)]
    record = getattr(rv, "record", None)
    return [SignalAddress(a, record.port) for a in record.addresses] if record is not None else []


def page_link_text(rv: Any, key_code: str) -> str | None:
    """What `join` prints for phones: the page URL and its QR code (plus the host's other
    addresses, when it has several), or None when no address is known."""
    from swarm.terminal import render_qr

    addresses = page_addresses(rv)
    if not addresses:
        return None
    url = page_url(addresses[0], key_code)
    text = (f"open on a phone or tablet to add it to the swarm (accept the self-signed certificate):\n"
            f"  {url}\n{render_qr(url)}")
    others = addresses[1:1 + MORE_ADDRESSES]
    if others:
        text += "\nif the phone cannot open it, it may be on another network of this machine; try:\n"
        text += "\n".join(f"  {page_url(a, key_code)}" for a in others)
    return text
