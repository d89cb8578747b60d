"""Deterministic rules: which server to use, who hosts after the host leaves."""

from __future__ import annotations

import itertools
from dataclasses import replace

from swarm.discovery.choice import is_better, pick_server, takeover_delay
from swarm.discovery.records import ServerRecord
from swarm.signaling.messages import PeerInfo


def rec(host, started, name=None):
    return ServerRecord(name=name or f"{host}-{started}", version=1, swarm_id="0" * 16, port=1,
                        fingerprint=b"\x00" * 32, host=host, started=started, addresses=("10.0.0.1",))


def test_oldest_then_lowest_host_whatever_the_order():
    records = [rec("b", 5.0), rec("a", 7.0), rec("c", 5.0), rec("z", 9.0)]
    for perm in itertools.permutations(records):
        assert pick_server(perm).host == "b"
    assert pick_server([]) is None


def test_dead_servers_are_skipped_but_a_restart_is_a_new_server():
    old = rec("a", 1.0, name="svc-a")
    restarted = replace(old, started=50.0)
    other = rec("b", 10.0)
    assert pick_server([old, other], dead=[old.key]) == other
    assert pick_server([restarted, other], dead=[old.key]) == other  # still younger than b
    assert pick_server([restarted], dead=[old.key]) == restarted


def test_is_better_agrees_with_pick():
    a, b = rec("a", 2.0), rec("b", 1.0)
    assert is_better(b, a) and not is_better(a, b) and not is_better(a, a)
    assert pick_server([a, b]) == b


def peers(*specs):
    return [PeerInfo(peer_id=p, name="", kind=k, joined=0.0) for p, k in specs]


def test_takeover_rank_by_peer_id_excluding_gone_host_and_browsers():
    presence = peers(("d", "python"), ("b", "python"), ("a", "python"), ("c", "browser"), ("e", "python"))
    # "a" hosted and is gone; browsers never host: order b, d, e
    delays = {me: takeover_delay(me, presence, gone_host="a", step_s=3.0) for me in ("b", "d", "e")}
    assert delays == {"b": 0.0, "d": 3.0, "e": 6.0}
    assert len(set(delays.values())) == len(delays)  # never two peers at the same moment


def test_takeover_when_unseen_in_presence():
    # A peer that joined after the last presence snapshot still gets a deterministic slot.
    assert takeover_delay("c", peers(("b", "python")), gone_host="a", step_s=2.0) == 2.0
    assert takeover_delay("a0", peers(("b", "python")), gone_host="a", step_s=2.0) == 0.0
