"""A signaling server's address: every form a user may type, parsed in one place.

``colibri-swarm join`` prints the host's address and the peer page URL; users paste either
back into ``--signal``. All of these name the same server and parse to the same
:class:`SignalAddress`:

=================================  ===========================================
``HOST:PORT``                      ``192.168.1.20:8443``, ``[fe80::1]:8443``
``https://HOST:PORT[/]``           the page URL; a ``#KEY-CODE`` fragment is ignored
``wss://HOST:PORT[/ws]``           the WebSocket URL itself
=================================  ===========================================

The port is required (the server listens on a free port the host prints). Plain ``http``/``ws``
are refused: signaling runs over TLS only.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from swarm.errors import AddressError

EXAMPLE = "192.168.1.20:8443"
WS_PATH = "/ws"
SCHEMES = ("https", "wss")


@dataclass(frozen=True)
class SignalAddress:
    """One signaling server: ``host`` (IPv4, IPv6 without brackets, or a name) and TCP ``port``."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host or any(c in self.host for c in "/[]@?# "):
            raise AddressError(f"{self.host!r} is not a host name or IP address")
        if not 1 <= self.port <= 65535:
            raise AddressError(f"port {self.port} is outside 1-65535")

    @classmethod
    def parse(cls, text: str) -> SignalAddress:
        """Parse any form in the module docstring; AddressError says what was wrong and shows an example."""
        if not isinstance(text, str) or not text.strip():
            raise AddressError(f"empty signaling address; give HOST:PORT, e.g. {EXAMPLE}")
        text = text.strip()
        has_scheme = "://" in text
        if not has_scheme and text.count(":") > 1 and not text.startswith("["):
            raise AddressError(f"{text!r}: write an IPv6 address in brackets, e.g. [fe80::1]:8443")
        try:
            parts = urlsplit(text if has_scheme else f"wss://{text}")
            port = parts.port
        except ValueError as exc:
            raise AddressError(f"{text!r} is not a signaling address ({exc}); give HOST:PORT, e.g. {EXAMPLE}") from None
        if parts.scheme not in SCHEMES:
            raise AddressError(f"{text!r}: signaling runs over TLS only; give HOST:PORT, https://HOST:PORT or "
                               f"wss://HOST:PORT (e.g. {EXAMPLE})")
        if not parts.hostname:
            raise AddressError(f"{text!r} names no host; give HOST:PORT, e.g. {EXAMPLE}")
        if port is None:
            raise AddressError(f"{text!r} names no port; give HOST:PORT as `colibri-swarm join` prints it on the "
                               f"host, e.g. {EXAMPLE}")
        if parts.username is not None or parts.query:
            raise AddressError(f"{text!r}: a signaling address has no user name or query; give HOST:PORT")
        allowed = ("", "/", WS_PATH) if parts.scheme == "wss" else ("", "/")
        if parts.path not in allowed:
            raise AddressError(f"{text!r}: unexpected path {parts.path!r}; give HOST:PORT, e.g. {EXAMPLE}")
        return cls(parts.hostname, port)

    @property
    def netloc(self) -> str:
        """``HOST:PORT``, with an IPv6 host in brackets."""
        return f"[{self.host}]:{self.port}" if _is_ipv6(self.host) else f"{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        """``wss://HOST:PORT/ws``: where the signaling WebSocket is."""
        return f"wss://{self.netloc}{WS_PATH}"

    @property
    def page_url(self) -> str:
        """``https://HOST:PORT/``: the peer page (append ``#<key code>`` for phones)."""
        return f"https://{self.netloc}/"

    @property
    def status_url(self) -> str:
        """``https://HOST:PORT/api/status``: the server's public status document."""
        return f"https://{self.netloc}/api/status"

    def __str__(self) -> str:
        return self.netloc


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False
