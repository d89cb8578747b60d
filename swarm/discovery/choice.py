"""Deterministic rules: which signaling server to use, and who hosts when the host leaves.

Pure functions of what a peer has seen, so every peer that saw the same things decides the same.

* :func:`pick_server` — among the live servers of our swarm, the one started first, ties broken
  by the lower host peer id. Two servers can exist for a moment (peers that started together
  both found none); everyone converges on the older one and the younger host stops its own.
* :func:`takeover_delay` — when the host is gone, the Python peers of the last presence list
  (minus the old host) are ranked by peer id; rank r hosts after ``r * TAKEOVER_STEP_S`` seconds
  unless a live server of the swarm has appeared by then. Rank 0 hosts at once; if it is gone
  too, rank 1 takes over a step later, and so on. Browser peers never host.
"""

from __future__ import annotations

from collections.abc import Iterable

from swarm.discovery.records import ServerRecord
from swarm.signaling.messages import PeerInfo

TAKEOVER_STEP_S = 3.0  # long enough for rank 0 to start a server and announce it by mDNS
DISCOVERY_WINDOW_S = 2.0  # how long a fresh peer looks for a server before hosting one


def pick_server(records: Iterable[ServerRecord], dead: Iterable[tuple[str, float]] = ()) -> ServerRecord | None:
    """The server to use: oldest ``started``, then lowest ``host``, among records not in ``dead``.

    ``records`` should already be filtered to our swarm id and protocol (records.is_ours);
    ``dead`` holds ``ServerRecord.key`` values of servers that refused or dropped us.
    """
    dead = set(dead)
    live = [r for r in records if r.key not in dead]
    return min(live, key=lambda r: (r.started, r.host, r.name), default=None)


def takeover_delay(me: str, last_presence: Iterable[PeerInfo], gone_host: str | None,
                   step_s: float = TAKEOVER_STEP_S) -> float:
    """Seconds this peer waits for another server before hosting one itself (see module doc)."""
    candidates = {p.peer_id for p in last_presence if p.kind == "python" and p.peer_id != gone_host}
    candidates.add(me)
    return sorted(candidates).index(me) * step_s


def is_better(candidate: ServerRecord, current: ServerRecord) -> bool:
    """True when ``candidate`` wins over ``current`` by the :func:`pick_server` rule."""
    return (candidate.started, candidate.host, candidate.name) < (current.started, current.host, current.name)
