"""Election under simulated time, message loss, partitions and crashes.

A tiny discrete simulator pumps :class:`Election` objects into each other: no
sockets, no sleeps. Safety (at most one coordinator per term) is checked after
every step; liveness (a coordinator within 5 s of losing the old one) is
checked on loss-free runs with crashes and healed partitions.
"""

from __future__ import annotations

import heapq
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import StaleTermError
from swarm.peer.election.core import Election, LeaderHeartbeat, LeaderChanged, RequestVote, Role, Vote

TICK_S = 0.005
LINK_BEAT_S = 1.0  # the links' own heartbeats: what tells a member its peers are alive


class Sim:
    """Peers, a lossy network with delays, partitions and crashes, driven in ticks."""

    def __init__(self, caps: dict[str, float | None], *, seed: int, loss: float = 0.0):
        self.rng = random.Random(seed)
        self.now = 0.0
        self.loss = loss
        self.peers = {
            pid: Election(pid, eligible=cap is not None, capability=cap or 0.0, now=0.0,
                          rng=random.Random(self.rng.random()))
            for pid, cap in caps.items()
        }
        for a in self.peers.values():
            for pid, cap in caps.items():
                a.add_member(pid, eligible=cap is not None, capability=cap or 0.0, now=0.0)
        self.alive = set(caps)
        self.groups: list[set[str]] | None = None  # partition: only peers in one group talk
        self.queue: list[tuple[float, int, str, str, object]] = []
        self.seq = 0
        self.leaders: dict[int, set[str]] = {}
        self.next_link_beat = {pid: self.rng.uniform(0, LINK_BEAT_S) for pid in caps}
        self.first_checked_term = 0  # safety is asserted for terms from this one on

    def connected(self, a: str, b: str) -> bool:
        if a not in self.alive or b not in self.alive:
            return False
        return self.groups is None or any(a in g and b in g for g in self.groups)

    def step(self) -> None:
        self.now += TICK_S
        while self.queue and self.queue[0][0] <= self.now:
            _, _, src, dst, msg = heapq.heappop(self.queue)
            if self.connected(src, dst):
                self.peers[dst].receive(src, msg, self.now)
        for pid in sorted(self.alive):
            if self.now >= self.next_link_beat[pid]:  # pid's link heartbeat reaches its peers
                self.next_link_beat[pid] += LINK_BEAT_S
                for d in self.peers:
                    if d != pid and self.connected(pid, d) and self.rng.random() >= self.loss:
                        self.peers[d].heard_from(pid, self.now)
        for pid in sorted(self.alive):
            e = self.peers[pid]
            if e.get_timer() <= self.now:
                e.handle_timer(self.now)
            for dest, msg in e.messages_to_send():
                for d in ([dest] if dest else [p for p in self.peers if p != pid]):
                    if self.connected(pid, d) and self.rng.random() >= self.loss:
                        self.seq += 1
                        delay = self.rng.uniform(0.001, 0.02)
                        heapq.heappush(self.queue, (self.now + delay, self.seq, pid, d, msg))
        for pid in self.alive:
            e = self.peers[pid]
            if e.role is Role.LEADER:
                self.leaders.setdefault(e.term, set()).add(pid)
                assert e.term < self.first_checked_term or len(self.leaders[e.term]) == 1, f"two coordinators in term {e.term}: {self.leaders[e.term]}"

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / TICK_S)):
            self.step()

    def run_until_leader(self, limit_s: float, among: set[str] | None = None) -> str | None:
        """Run until every live peer in ``among`` agrees on one live coordinator."""
        among = among or self.alive
        t_end = self.now + limit_s
        while self.now < t_end:
            self.step()
            views = {(self.peers[p].term, self.peers[p].leader) for p in among}
            if len(views) == 1:
                (_, leader), = views
                if leader in among and self.peers[leader].role is Role.LEADER:
                    return leader
        return None

    def crash(self, pid: str) -> None:
        self.alive.discard(pid)


def most_capable(caps: dict[str, float | None], alive: set[str]) -> str:
    return max((c, p) for p, c in caps.items() if c is not None and p in alive)[1]


CAPS = {"p0": 1.0, "p1": 3.0, "p2": 2.0, "p3": None, "p4": 0.5}


@given(seed=st.integers(0, 2**32 - 1))
@settings(max_examples=100, deadline=None)
def test_most_capable_is_elected_then_replaced_within_5s(seed):
    sim = Sim(CAPS, seed=seed)
    first = sim.run_until_leader(5.0)
    assert first == "p1"
    sim.run(1.0)
    t_lost = sim.now
    sim.crash(first)
    second = sim.run_until_leader(5.0)
    assert second == most_capable(CAPS, sim.alive) == "p2"
    assert sim.now - t_lost <= 5.0
    # and again: p0 remains the only eligible peer with a majority of 5 still alive (p0, p3, p4)
    sim.crash(second)
    third = sim.run_until_leader(5.0)
    assert third == "p0"


@given(seed=st.integers(0, 2**32 - 1), loss=st.sampled_from([0.05, 0.2, 0.4]))
@settings(max_examples=100, deadline=None)
def test_safety_under_loss_partitions_and_crashes(seed, loss):
    sim = Sim(CAPS, seed=seed, loss=loss)
    rng = random.Random(seed)
    ids = sorted(CAPS)
    for _ in range(8):
        r = rng.random()
        if r < 0.4:
            rng.shuffle(ids)
            cut = rng.randint(1, len(ids) - 1)
            sim.groups = [set(ids[:cut]), set(ids[cut:])]
        elif r < 0.7:
            sim.groups = None
        elif r < 0.85 and len(sim.alive) > 3:
            sim.crash(rng.choice(sorted(sim.alive)))
        sim.run(rng.uniform(0.2, 2.0))  # Sim.step asserts ≤ 1 coordinator per term
    # After healing, with loss gone, all live peers follow one eligible coordinator within 5 s
    # (a working one keeps its term even when a more capable peer comes back: Raft §6).
    sim.groups, sim.loss = None, 0.0
    leader = sim.run_until_leader(5.0)
    assert leader in sim.alive and CAPS[leader] is not None


@pytest.mark.parametrize("seed", range(5))
def test_minority_coordinator_steps_down_and_majority_elects(seed):
    sim = Sim(CAPS, seed=seed)
    assert sim.run_until_leader(5.0) == "p1"
    sim.groups = [{"p1", "p3"}, {"p0", "p2", "p4"}]
    t_cut = sim.now
    new = sim.run_until_leader(5.0, among={"p0", "p2", "p4"})
    assert new == "p2" and sim.now - t_cut <= 5.0
    sim.run(1.5)
    assert sim.peers["p1"].role is not Role.LEADER  # check-quorum: cut off, it stepped down
    # Healing: the old coordinator hears the newer term and follows, it does not depose p2.
    sim.groups = None
    sim.run(1.0)
    assert {(sim.peers[p].term, sim.peers[p].leader) for p in CAPS} == {(sim.peers["p2"].term, "p2")}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("caps, half, same_term", [({"a": 2.0, "b": 1.0}, {"a"}, True),
                                                   ({"a": 4.0, "b": 3.0, "c": 2.0, "d": 1.0}, {"a", "b"}, False)])
def test_coordinator_of_an_even_split_keeps_serving(seed, caps, half, same_term):
    """Two peers, one stalled; four split two and two: the half without the coordinator can
    never elect (no majority), so the coordinator keeps its role and term through a 10 s cut
    (it stepped down at 2.5 s, and a two-peer swarm had no API), and after it all follow it: in
    its term when the other half was one peer (standing raises no term), else in the term that
    half's votes moved to."""
    sim = Sim(caps, seed=seed)
    assert sim.run_until_leader(5.0) == "a"
    term = sim.peers["a"].term
    sim.groups = [half, set(caps) - half]
    sim.run(10.0)
    assert sim.peers["a"].role is Role.LEADER and sim.peers["a"].term == term
    assert all(sim.peers[p].role is not Role.LEADER for p in caps if p != "a")
    sim.groups = None
    assert sim.run_until_leader(5.0) == "a"
    assert (sim.peers["a"].term == term) is same_term


def test_no_eligible_peer_means_no_coordinator():
    sim = Sim({"a": None, "b": None, "c": None}, seed=1)
    sim.run(5.0)
    assert not sim.leaders


def test_single_peer_elects_itself():
    sim = Sim({"solo": 1.0}, seed=1)
    assert sim.run_until_leader(2.0) == "solo"


def test_two_self_elected_coordinators_merge_into_one():
    # Two peers that started apart each lead a quorum of one; once linked, one remains.
    a = Election("a", eligible=True, capability=1.0, now=0.0, rng=random.Random(1))
    b = Election("b", eligible=True, capability=2.0, now=0.0, rng=random.Random(2))
    for e in (a, b):
        e.handle_timer(1.5)  # past their first deadline (at most 1.3 s), not so far as to look like a wake
    assert a.role is b.role is Role.LEADER and a.term == b.term == 1
    sim = Sim({"a": 1.0, "b": 2.0}, seed=3)
    sim.peers = {"a": a, "b": b}
    for x, y in ((a, b), (b, a)):
        x.add_member(y.peer_id, eligible=True, capability=y.capability, now=5.0)
    sim.now = 5.0
    sim.first_checked_term = 2  # term 1 has two by construction; later ones must not
    assert sim.run_until_leader(5.0) == "b"
    assert a.term == b.term >= 2 and a.leader == "b"


def test_voter_refuses_less_capable_candidate_and_stale_terms():
    v = Election("v", eligible=False, capability=0.0, now=0.0, rng=random.Random(0))
    v.add_member("weak", eligible=True, capability=1.0, now=0.0)
    v.add_member("strong", eligible=True, capability=9.0, now=0.0)
    v.add_member("none", eligible=False, capability=99.0, now=0.0)
    v.heard_from("strong", now=0.5)
    v.receive("weak", RequestVote(1, "weak"), now=0.6)
    assert v.messages_to_send() == [("weak", Vote(1, "v", False))]
    v.receive("none", RequestVote(2, "none"), now=0.7)  # not eligible: refused
    assert v.messages_to_send() == [("none", Vote(2, "v", False))]
    v.receive("strong", RequestVote(2, "strong"), now=0.8)
    assert v.messages_to_send() == [("strong", Vote(2, "v", True))]
    # one vote per term
    v.receive("weak", RequestVote(2, "weak"), now=0.9)
    assert v.messages_to_send() == [("weak", Vote(2, "v", False))]
    # a vote request naming someone else than its sender is ignored
    v.receive("weak", RequestVote(3, "strong"), now=0.9)
    assert v.messages_to_send() == [] and v.term == 2
    # Once "strong" is unreachable (nothing heard for REACHABLE_S), "weak" may lead.
    v.receive("weak", RequestVote(3, "weak"), now=5.0)
    assert v.messages_to_send() == [("weak", Vote(3, "v", True))]
    v.receive("weak", LeaderHeartbeat(3, "weak"), now=5.1)
    assert v.next_event() == LeaderChanged(3, "weak")
    with pytest.raises(StaleTermError, match="term 2 is stale"):
        v.check_term(2, now=5.2)
    v.check_term(3, now=5.2)
    # a live coordinator is not deposed by a vote request (Raft §6): refused with our term, which stays
    v.receive("strong", RequestVote(9, "strong"), now=5.3)
    assert v.messages_to_send() == [("strong", Vote(3, "v", False))] and v.term == 3 and v.leader == "weak"


def test_a_silent_coordinator_is_not_revived_by_its_links_old_news():
    # A link reports the time of its last inbound byte; after the coordinator's process died,
    # that time stays in the past and must not make the dead peer "reachable" again.
    v = Election("v", eligible=False, capability=0.0, now=0.0, rng=random.Random(0))
    v.add_member("lead", eligible=True, capability=9.0, now=0.0)
    v.add_member("next", eligible=True, capability=1.0, now=0.0)
    v.receive("lead", LeaderHeartbeat(1, "lead"), now=0.1)
    assert v.leader == "lead"
    last_byte = 0.1
    for t in (0.5, 1.0, 1.5, 2.0):
        v.heard_from("lead", last_byte)  # what the adapter does on every tick
        v.heard_from("next", t)
        v.handle_timer(t)
    assert v.leader is None and not v.reachable("lead", 2.0)
    v.receive("next", RequestVote(2, "next"), now=2.1)
    assert v.messages_to_send() == [("next", Vote(2, "v", True))]


def test_a_held_candidacy_waits_and_then_stands():
    """A joining peer held back (peers it sees are not linked yet) stands only once released,
    and still grants votes meanwhile."""
    e = Election("b", eligible=True, capability=1.0, now=0.0, rng=random.Random(1))
    e.hold_candidacy(10.0)
    for t in range(1, 100):
        e.handle_timer(t * 0.1)
    assert e.role is Role.FOLLOWER and e.term == 0 and not e.messages_to_send()
    e.add_member("c", eligible=True, capability=2.0, now=9.9)
    e.receive("c", RequestVote(1, "c"), 9.95)
    assert e.messages_to_send() == [("c", Vote(1, "b", True))]
    e.handle_timer(12.0)  # released, and c's term-1 round came to nothing: b stands for term 2
    assert e.role is Role.CANDIDATE and e.standing_for == 2 and e.term == 1  # its own term moves only once it wins
    assert e.messages_to_send() == [(None, RequestVote(2, "b"))]


def test_the_driver_refuses_to_send_what_is_not_an_election_message(tmp_path):
    """Only the three election messages have a wire form: anything else the core queues is a
    local bug, named, not sent with the previous message's bytes."""
    import asyncio

    from swarm.errors import LocalProtocolError

    async def main():
        driver = solo_driver(tmp_path)
        driver.core._out.append((None, LeaderChanged(1, "a")))  # an event, queued as a message
        await driver._flush()

    with pytest.raises(LocalProtocolError, match="LeaderChanged"):
        asyncio.run(main())


def solo_driver(tmp_path):
    """An ElectionDriver of a fresh peer holding the model, on a node with no links."""
    from swarm.keys.identity import Identity
    from swarm.keys.swarmkey import SwarmKey
    from swarm.peer.election.driver import ElectionDriver
    from swarm.peer.node import Node

    ident = Identity.generate()
    node = Node(swarm_key=SwarmKey(bytes(32)), certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                status_path=tmp_path / "status.json")

    async def on_leader(term, leader):
        pass

    return ElectionDriver(node, True, on_leader=on_leader, on_admitted=lambda link: None)


def fake_link(peer_id: str, **hello_fields):
    """A link class as the election driver uses one: its peer id, its Hello (``hello_fields``
    replaced) and ``send``, which records what was sent in ``sent``."""
    import dataclasses

    from tests.peer._links import hello as make_hello

    class Remote:
        hello = dataclasses.replace(make_hello(peer_id), **hello_fields)
        sent: list = []

        async def send(self, msg):
            self.sent.append(msg)

    Remote.peer_id = peer_id
    return Remote


@pytest.mark.parametrize("theirs_first", [False, True])
def test_a_peer_of_another_model_is_refused_by_name_whoever_refused_first(tmp_path, caplog, theirs_first):
    """Two peers of different models refuse each other. Each logs its own refusal by name and
    sends it once, also when the other's refusal reached it before its own link-up ran (a fast
    link: the coordinator then never said which peer it refused)."""
    import asyncio
    import logging

    from swarm.keys.identity import Identity
    from swarm.keys.swarmkey import SwarmKey
    from swarm.peer.election.driver import ElectionDriver
    from swarm.peer.net.messages import Error
    from swarm.peer.node import Node

    other = Identity.generate()

    Remote = fake_link(other.peer_id, name="stranger", model_hash="b" * 64)

    async def main():
        ident = Identity.generate()
        node = Node(swarm_key=SwarmKey(bytes(32)), certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                    status_path=tmp_path / "status.json", model_hash="a" * 64)

        async def on_leader(term, leader):
            pass

        driver = ElectionDriver(node, True, on_leader=on_leader, on_admitted=lambda link: None)
        link = Remote()
        theirs = Error(0, "model", "refused: this peer holds another model")
        if theirs_first:
            driver.refused_by(link, theirs)
        driver.link_up(link)
        if not theirs_first:
            driver.refused_by(link, theirs)
        driver.link_up(link)  # a second link-up (reconnect) says nothing new
        await asyncio.sleep(0.05)
        return link.sent, driver.is_refused(link.peer_id)

    with caplog.at_level(logging.WARNING, logger="swarm.peer.election.driver"):
        sent, refused = asyncio.run(main())
    assert refused
    assert [(m.code, "'stranger'" in m.message) for m in sent] == [("model", True)]
    assert caplog.text.count("refused peer 'stranger'") == 1


# --- stable leadership: a peer that wakes, restarts or comes back does not depose a live coordinator


def settled_sim(seed: int) -> tuple[Sim, str, int]:
    sim = Sim(CAPS, seed=seed)
    leader = sim.run_until_leader(5.0)
    sim.run(1.0)
    return sim, leader, sim.peers[leader].term


def assert_leader_kept(sim: Sim, leader: str, term: int) -> None:
    """Every peer follows ``leader`` in ``term``, which never changed, and no peer's term passed it."""
    assert sim.peers[leader].role is Role.LEADER
    assert {(sim.peers[p].term, sim.peers[p].leader) for p in sim.alive} == {(term, leader)}
    assert set(sim.leaders) == {term}


@pytest.mark.parametrize("seed", range(8))
def test_a_woken_peer_listens_before_it_stands(seed):
    """SIGSTOP/SIGCONT in simulated time: a worker's clock jumps 2-5 s; it must not stand at once
    (which once raised terms 7 -> 9 -> 10 and deposed the coordinator)."""
    sim, leader, term = settled_sim(seed)
    sleeper = "p2"
    sim.crash(sleeper)  # stopped: it neither runs nor hears anything
    sim.run(2.0 + seed * 0.4)
    sim.alive.add(sleeper)  # woken: its first handle_timer is seconds past its deadline
    sim.step()
    assert sim.peers[sleeper].role is Role.FOLLOWER and sim.peers[sleeper].standing_for is None
    sim.run(3.0)
    assert_leader_kept(sim, leader, term)


@pytest.mark.parametrize("seed", range(8))
def test_a_partitioned_and_healed_peer_does_not_raise_the_term(seed):
    """A worker cut off alone stands again and again (PreVote: without raising its term); healed,
    it follows the coordinator it left, in the same term."""
    sim, leader, term = settled_sim(seed)
    sim.groups = [{"p2"}, set(CAPS) - {"p2"}]
    sim.run(6.0)
    assert sim.peers["p2"].term == term and sim.peers["p2"].standing_for == term + 1
    sim.groups = None
    sim.run(1.5)
    assert_leader_kept(sim, leader, term)


@pytest.mark.parametrize("seed", range(8))
def test_a_restarted_peer_learns_the_term_and_does_not_depose(seed):
    """A worker restarts (term 0, two quiet seconds) and hears nothing from the coordinator for 6 s
    (its heartbeats lost, as before its handlers were set): the voters refuse it with their term,
    which it takes; when the heartbeats reach it, it follows. The coordinator keeps its term."""
    sim, leader, term = settled_sim(seed)
    fresh = Election("p2", eligible=True, capability=CAPS["p2"], now=sim.now, rng=random.Random(seed),
                     startup_quiet_s=2.0)
    for pid, cap in CAPS.items():
        fresh.add_member(pid, eligible=cap is not None, capability=cap or 0.0, now=sim.now)
    sim.peers["p2"] = fresh
    sim.groups = [{"p2"} | (set(CAPS) - {leader}), set(CAPS) - {"p2"}]  # p2 hears all but the coordinator
    sim.run(6.0)
    assert fresh.term == term and fresh.role is not Role.LEADER  # learned from the voters' refusals
    sim.groups = None
    sim.run(1.5)
    assert_leader_kept(sim, leader, term)


def _driver_alone_on_signaling(tmp_path):
    """An election driver whose signaling server lists only itself, and one linked member's
    fake link (its ``peer_id`` names the member)."""
    from types import SimpleNamespace

    from swarm.keys.identity import Identity
    from swarm.keys.swarmkey import SwarmKey
    from swarm.peer.election.driver import ElectionDriver
    from swarm.peer.node import Node

    ident, other = Identity.generate(), Identity.generate()
    node = Node(swarm_key=SwarmKey(bytes(32)), certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                status_path=tmp_path / "status.json", model_hash="a" * 64)
    node.rendezvous = SimpleNamespace(peers={ident.peer_id: SimpleNamespace(kind="python")})  # only us listed
    driver = ElectionDriver(node, True, on_leader=None, on_admitted=lambda link: None)
    link = fake_link(other.peer_id, model_hash="a" * 64)()
    node.mesh.links[link.peer_id] = link
    return driver, link


def test_a_woken_peer_forgets_nobody_who_left_its_signaling_server_while_it_slept(tmp_path):
    """A member that left our signaling server and whose link went silent has left the swarm,
    unless this process slept: then the others left our server because it stopped answering, and
    for WAKE_GRACE_S it forgets nobody (a stalled stage peer hosting signaling once forgot its
    coordinator on waking and led alone, in a new term on another API port)."""
    from swarm.peer.election.driver import LEFT_SILENCE_S, WAKE_GRACE_S

    driver, link = _driver_alone_on_signaling(tmp_path)

    def member_after(now: float) -> bool:
        driver.core.add_member(link.peer_id, eligible=True, capability=1.0, now=0.0)
        link.last_heard = now - LEFT_SILENCE_S - 1.0
        driver._forget_departed(now)
        return link.peer_id in driver.core.members

    for t in (10.0, 10.05, 10.1):  # ticks with no gap
        driver._note_tick(t)
    assert not member_after(10.1)
    driver._note_tick(20.0)  # ten seconds with no tick: this process slept
    assert member_after(20.0) and member_after(20.0 + WAKE_GRACE_S - 0.1)
    assert not member_after(20.0 + WAKE_GRACE_S + 0.1)


def test_a_peer_stalled_briefly_forgets_the_departed_soon_after(tmp_path):
    """A stall shorter than the links' dead time (a busy machine's event loop) is no sleep: a
    member off our signaling server whose link stays silent is forgotten LEFT_SILENCE_S after the
    stall ends (silence counted from there), not WAKE_GRACE_S later: a 2-core CI machine once kept
    a killed coordinator in its survivor's quorum that long, and no coordinator came in 15 s."""
    from swarm.peer.election.driver import LEFT_SILENCE_S, SLEPT_GAP_S

    driver, link = _driver_alone_on_signaling(tmp_path)
    heard = 9.0  # the departed peer's last byte, before the stall

    def member_at(now: float) -> bool:
        driver.core.add_member(link.peer_id, eligible=True, capability=1.0, now=0.0)
        link.last_heard = heard
        driver._forget_departed(now)
        return link.peer_id in driver.core.members

    for t in (10.0, 10.05):
        driver._note_tick(t)
    resumed = 10.05 + SLEPT_GAP_S - 0.5  # a stall just short of the links' dead time
    driver._note_tick(resumed)
    # silent since 9.0, but we heard nothing while stalled: not yet judged
    assert member_at(resumed) and member_at(resumed + LEFT_SILENCE_S - 0.1)
    assert not member_at(resumed + LEFT_SILENCE_S + 0.1)


def test_a_stale_coordinator_is_told_the_term_and_steps_down_at_once(tmp_path):
    """A worker in term 5 refuses a request of term 3 with its term (a refused Vote), not only an
    Error without one: the deposed coordinator, on that Vote, leaves its role at once (it once
    kept its API for 30 s, until its request's deadline)."""
    import asyncio

    from swarm.keys.identity import Identity
    from swarm.keys.swarmkey import SwarmKey
    from swarm.peer.election.driver import ElectionDriver
    from swarm.peer.net.messages import Vote as WireVote
    from swarm.peer.node import Node

    old = Identity.generate()

    Remote = fake_link(old.peer_id, model_hash="a" * 64)

    async def main():
        ident = Identity.generate()
        node = Node(swarm_key=SwarmKey(bytes(32)), certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                    status_path=tmp_path / "status.json", model_hash="a" * 64, memory_budget=1, ffn_gflops=1.0)

        async def on_leader(term, leader):
            pass

        driver = ElectionDriver(node, True, on_leader=on_leader, on_admitted=lambda link: None)
        link = Remote()
        node.mesh.links[link.peer_id] = link
        driver.core.check_term(5, now=0.0)
        with pytest.raises(StaleTermError, match="term 3 is stale"):
            driver.check_term(3, link.peer_id)
        with pytest.raises(StaleTermError):
            driver.check_sender(link.peer_id, 4, "plan")
        await asyncio.sleep(0.05)
        await driver.stop()
        return link.sent

    assert asyncio.run(main()) == [WireVote(5, False), WireVote(5, False)]

    # The deposed coordinator's side: that Vote moves it to term 5 with no coordinator.
    c = Election("c", eligible=True, capability=1.0, now=0.0, rng=random.Random(0))
    c.add_member("w", eligible=True, capability=0.5, now=0.0)
    c.handle_timer(1.5)
    c.receive("w", Vote(1, "w", True), now=1.51)
    assert c.role is Role.LEADER and c.term == 1
    while c.next_event():
        pass
    c.receive("w", Vote(5, "w", False), now=1.6)
    assert c.role is Role.FOLLOWER and c.term == 5 and c.next_event() == LeaderChanged(5, None)


def test_a_coordinator_that_stalled_does_not_step_until_its_election_has_heard_the_swarm_again(tmp_path, monkeypatch):
    """lead_state after SIGSTOP/SIGCONT: while the election's ticks have stopped for WAKE_GAP_S
    (the token loop runs before the event loop has read what the members sent), and for
    RESUME_CONFIRM_S after they resume, a coordinator that holds quorum on paper says None (wait):
    the links' buffered bytes count as hearing members that may have elected another coordinator
    meanwhile. Without a stall it says True at once; deposed, False."""
    from swarm.peer.election import driver as driver_module
    from swarm.peer.election.driver import RESUME_CONFIRM_S

    clock = [1000.0]
    monkeypatch.setattr(driver_module.time, "monotonic", lambda: clock[0])
    driver = solo_driver(tmp_path)
    for peer in ("b", "c"):  # a swarm of three
        driver.core.add_member(peer, eligible=True, capability=1.0, now=clock[0])

    def links_read():  # what the links read on waking: bytes the members sent meanwhile
        for peer in ("b", "c"):
            driver.core.heard_from(peer, clock[0])
    driver.core.role, driver.core.term = Role.LEADER, 4
    driver._note_tick(clock[0])
    assert driver.lead_state(4) is True and driver.lead_state(3) is False
    clock[0] += 0.3  # the next tick is due: not a stall
    assert driver.lead_state(4) is True
    clock[0] += 5.0  # SIGSTOP for 5 s, SIGCONT: the token loop asks before the loop has ticked
    links_read()
    assert driver.lead_state(4) is None
    driver._note_tick(clock[0])  # the loop's first tick after the stall
    assert driver.core.holds_quorum(clock[0]) and driver.lead_state(4) is None
    clock[0] += RESUME_CONFIRM_S / 2
    driver._note_tick(clock[0])
    links_read()
    assert driver.lead_state(4) is None  # still within the window a newer term would arrive in
    clock[0] += RESUME_CONFIRM_S / 2 + 0.01
    driver._note_tick(clock[0])
    links_read()
    assert driver.lead_state(4) is True
    driver.core.role = Role.FOLLOWER  # deposed meanwhile
    assert driver.lead_state(4) is False


def test_a_coordinator_alone_in_its_swarm_steps_on_after_a_stall(tmp_path, monkeypatch):
    """With no other member no one else can have been elected while it stalled: no wait."""
    from swarm.peer.election import driver as driver_module

    clock = [1000.0]
    monkeypatch.setattr(driver_module.time, "monotonic", lambda: clock[0])
    driver = solo_driver(tmp_path)
    driver.core.role, driver.core.term = Role.LEADER, 2
    driver._note_tick(clock[0])
    clock[0] += 5.0
    assert driver.lead_state(2) is True
    driver._note_tick(clock[0])
    assert driver.lead_state(2) is True
