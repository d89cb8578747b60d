"""Multi-host: peers in separate network namespaces find each other by real mDNS, with no
address given, and re-form around a new signaling host within 10 s when the host is killed;
a peer with another swarm key on the same segment stays apart."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

SCRIPT = "tests/multihost/discovery_peer.py"
REFORM_LIMIT_S = 10.0


def sees_all(ids):
    want = sorted(ids)

    def predicate(event):
        return event.get("event") in ("connected", "presence") and event["peers"] == want

    return predicate


async def settled(procs, ids, timeout):
    """Wait until every process's latest line shows all ``ids`` on one host, exactly one hosting."""
    want = sorted(ids)
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            p.poll()
        last = [p.events[-1] if p.events else {} for p in procs]
        hosts = {e.get("host") for e in last}
        if (all(e.get("peers") == want for e in last) and len(hosts) == 1
                and sum(bool(e.get("hosting")) for e in last) == 1):
            (host,) = hosts
            assert last[ids.index(host)]["hosting"]
            return host
        assert time.monotonic() < deadline, f"no single swarm within {timeout} s: {last}"
        await asyncio.sleep(0.1)


async def test_discover_and_rehost_after_host_killed(netns_lab):
    lab = netns_lab(4)
    key = os.urandom(32).hex()
    ids = ["peer-a", "peer-b", "peer-c"]
    procs = [lab.spawn(i, [SCRIPT, "--key", key, "--peer-id", pid]) for i, pid in enumerate(ids)]
    # A stranger on the same segment with another key: it must never see, nor be seen by, the swarm.
    stranger = lab.spawn(3, [SCRIPT, "--key", os.urandom(32).hex(), "--peer-id", "peer-0-stranger"])

    # All three started together, nobody typed an address: they must settle on one server, all present.
    spawned_at = time.monotonic()
    old_host = await settled(procs, ids, timeout=30)
    print(f"one swarm {time.monotonic() - spawned_at:.2f} s after starting (includes Python start-up)")

    # Kill the host's process like a pulled plug (no goodbye, no close frames).
    victim = ids.index(old_host)
    marks = [len(p.events) for p in procs]
    killed_at = time.monotonic()
    procs[victim].kill()
    survivors = [i for i in range(3) if i != victim]
    survivor_ids = [ids[i] for i in survivors]
    new_hosts = set()
    for i in survivors:
        event = await procs[i].wait_for(sees_all(survivor_ids), timeout=REFORM_LIMIT_S + 5, since=marks[i])
        new_hosts.add(event["host"])
        elapsed = event["t"] - killed_at
        assert elapsed < REFORM_LIMIT_S, f"{ids[i]} re-formed after {elapsed:.1f} s"
    # The lowest surviving peer id hosts anew (choice.takeover_delay), and everyone follows it.
    assert new_hosts == {min(survivor_ids)}
    stranger.poll()
    assert stranger.events and all(e["peers"] == ["peer-0-stranger"] for e in stranger.events)
    assert stranger.events[-1]["hosting"]
    assert not any("peer-0-stranger" in e.get("peers", ()) for p in procs for e in p.events)
    print(f"re-formed within {max(p.events[-1]['t'] for p in (procs[i] for i in survivors)) - killed_at:.2f} s")


async def test_goodbye_on_exit_and_last_peer_hosts(netns_lab):
    """A host that exits normally withdraws its mDNS record at once (goodbye), unlike a killed
    one whose record lingers in caches; the remaining peer then hosts."""
    import signal

    lab = netns_lab(3)
    key = os.urandom(32).hex()
    watcher = lab.spawn(2, [SCRIPT, "--key", key, "--peer-id", "watcher", "--watch"])
    await watcher.wait_for(lambda e: e["event"] == "records", timeout=20)
    ids = ["peer-a", "peer-b"]
    procs = [lab.spawn(i, [SCRIPT, "--key", key, "--peer-id", pid]) for i, pid in enumerate(ids)]
    host = await settled(procs, ids, timeout=30)
    await watcher.wait_for(lambda e: e["event"] == "records" and e["hosts"] == [host], timeout=10)

    victim = ids.index(host)
    (survivor,) = (i for i in range(2) if i != victim)
    mark = len(watcher.events)
    stopped_at = time.monotonic()
    procs[victim].kill(signal.SIGINT)  # Ctrl-C: the rendezvous stops cleanly
    gone = await watcher.wait_for(lambda e: e["event"] == "records" and host not in e["hosts"], timeout=5, since=mark)
    assert gone["t"] - stopped_at < 3.0  # a record's TTL is 120 s: only a goodbye removes it this fast
    event = await procs[survivor].wait_for(lambda e: e.get("hosting") and e["peers"] == [ids[survivor]],
                                           timeout=REFORM_LIMIT_S)
    assert event["host"] == ids[survivor]
    await watcher.wait_for(lambda e: e["event"] == "records" and e["hosts"] == [ids[survivor]], timeout=10)
