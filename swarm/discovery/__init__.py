"""Discovery: find the swarm's signaling server on the LAN by mDNS, or host one.

:class:`Rendezvous` is the entry point (find-or-host, follow, re-host when the host leaves);
:mod:`.records` (TXT format), :mod:`.choice` (deterministic rules) and :mod:`.addresses`
are pure; :mod:`.mdns` adapts python-zeroconf.
"""

from swarm.discovery.addresses import choose_addresses, local_addresses
from swarm.discovery.choice import is_better, pick_server, takeover_delay
from swarm.discovery.mdns import Advertiser, ServerBrowser, open_zeroconf
from swarm.discovery.records import SERVICE_TYPE, ServerRecord, decode_txt, encode_txt
from swarm.discovery.rendezvous import Connected, Rendezvous

__all__ = [
    "SERVICE_TYPE",
    "Advertiser",
    "Connected",
    "Rendezvous",
    "ServerBrowser",
    "ServerRecord",
    "choose_addresses",
    "decode_txt",
    "encode_txt",
    "is_better",
    "local_addresses",
    "open_zeroconf",
    "pick_server",
    "takeover_delay",
]
