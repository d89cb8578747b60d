"""A peer for the multi-host discovery test: find-or-host by mDNS, print what it sees as JSON lines.

Run inside a network namespace: ``python3 tests/multihost/discovery_peer.py --key HEX --peer-id ID``.
Lines: ``{"event": "connected", "host", "hosting", "peers"}`` after each (re)connection and
``{"event": "presence", "host", "hosting", "peers"}`` after each join/leave (peers: sorted ids).
With ``--watch`` it only browses and prints ``{"event": "records", "hosts": [...]}`` whenever the
set of advertised servers of the swarm changes (to observe goodbyes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

from swarm.discovery import Connected, Rendezvous, ServerBrowser, open_zeroconf
from swarm.signaling import PeerJoined, PeerLeft, swarm_id


def emit(event: str, rv: Rendezvous, host: str) -> None:
    print(json.dumps({"event": event, "host": host, "hosting": rv.hosting, "peers": sorted(rv.peers),
                      "wall": time.time()}), flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--key", required=True, help="swarm key, 64 hex digits")
    parser.add_argument("--peer-id", required=True)
    parser.add_argument("--takeover-step", type=float, default=None)
    parser.add_argument("--watch", action="store_true", help="only browse and print the advertised servers")
    args = parser.parse_args()
    if args.watch:
        await watch(bytes.fromhex(args.key))
        return
    options = {} if args.takeover_step is None else {"takeover_step_s": args.takeover_step}
    rv = Rendezvous(bytes.fromhex(args.key), args.peer_id, name=args.peer_id, **options)
    await rv.start()
    host = ""
    try:
        async for event in rv:
            if isinstance(event, Connected):
                host = event.host
                emit("connected", rv, host)
            elif isinstance(event, (PeerJoined, PeerLeft)):
                emit("presence", rv, host)
    finally:
        await rv.stop()


async def watch(key: bytes) -> None:
    zc = open_zeroconf()
    browser = ServerBrowser(zc, swarm_id(key))
    await browser.start()
    print(json.dumps({"event": "records", "hosts": []}), flush=True)
    try:
        while True:
            await browser.changed.wait()
            browser.changed.clear()
            hosts = sorted(r.host for r in browser.records.values())
            print(json.dumps({"event": "records", "hosts": hosts}), flush=True)
    finally:
        await browser.close()
        await zc.async_close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    asyncio.run(main())
