"""A step starts only while its coordinator leads with a majority heard (check-quorum).

A coordinator that wakes from a stall may have been deposed: without the check, its deadlines
all past, it computed its workers' rows itself and finished its requests under a term the swarm
had left, racing its own step-down. Oracles: the states the election reports, the requests the
workers were sent, the error the step raised.
"""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.errors import CoordinatorChangedError
from swarm.peer.coordinator import tracker
from swarm.peer.coordinator.dispatch import RemoteFFN
from swarm.peer.coordinator.planner import PeerCapacity, build_plan
from swarm.peer.election.core import REACHABLE_S, Election, Role
from swarm.peer.plan import ModelShape, Stage
from swarm.peer.worker.ffn import Worker
from tests.fakes import LoopbackNet
from tests.peer._swarm_models import COORD, W1, W2, build
from tests.peer.coordinator.test_stages import MOE, staged


class Clock:
    """A clock that moves only when the waiting code sleeps."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.slept += 1


def states(*seq):
    it = iter(seq)
    return lambda: next(it)


def test_confirm_lead_returns_at_once_waits_while_unconfirmed_and_raises_once_deposed():
    clock = Clock()
    tracker.confirm_lead(states(True), clock, clock.sleep)
    assert clock.slept == 0
    tracker.confirm_lead(states(None, None, True), clock, clock.sleep)  # heard the swarm again
    assert clock.slept == 2
    with pytest.raises(CoordinatorChangedError, match="stopped coordinating"):
        tracker.confirm_lead(states(None, False), clock, clock.sleep)  # stepped down meanwhile
    with pytest.raises(CoordinatorChangedError, match="stopped coordinating"):
        tracker.confirm_lead(states(False), clock, clock.sleep)
    start = clock.now
    with pytest.raises(CoordinatorChangedError, match="has not heard from most of the swarm"):
        tracker.confirm_lead(lambda: None, clock, clock.sleep)  # an event loop that never acts
    assert tracker.LEAD_WAIT_S <= clock.now - start <= tracker.LEAD_WAIT_S + 2 * tracker.LEAD_POLL_S


def test_holds_quorum_is_check_quorums_rule():
    """A leader of 5 holds its quorum while at most 2 others are unheard; a swarm of 2 (one
    silent) keeps its coordinator, as check-quorum does (neither half could elect)."""
    e = Election("p0", eligible=True, capability=1.0, now=0.0)
    for p in ("p1", "p2", "p3", "p4"):
        e.add_member(p, eligible=True, capability=1.0, now=0.0)
    t = 50.0
    for p in ("p1", "p2"):
        e.heard_from(p, t)
    assert e.holds_quorum(t + REACHABLE_S)  # p3, p4 unheard: 2 < 3
    assert not e.holds_quorum(t + REACHABLE_S + 0.1)  # all 4 unheard
    pair = Election("a", eligible=True, capability=1.0, now=0.0)
    pair.add_member("b", eligible=True, capability=1.0, now=0.0)
    assert pair.holds_quorum(1000.0)
    alone = Election("a", eligible=True, capability=1.0, now=0.0)
    assert alone.holds_quorum(1000.0) and alone.role is Role.FOLLOWER


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build(MOE, tmp_path_factory.mktemp("lead"))


def test_a_deposed_coordinators_step_sends_nothing_and_fails(moe_dir):
    """Expert ranges: the step of a coordinator whose lead is unconfirmed waits; once deposed it
    raises before any worker is asked (and after its plan took effect); confirmed, it runs."""
    model = load_model(moe_dir)
    shape = ModelShape.from_config(model.config)
    plan = build_plan(shape, PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 10**9, 1.0)], term=3, version=1,
                      coordinator_share=1.0)
    net = LoopbackNet()
    sent, answer = [], []
    lead = iter([None, None, False])
    dispatcher = net.dispatcher(COORD)
    dispatcher.lead_state = lambda term: (answer.append(term), next(lead, True))[1]
    ffn = RemoteFFN(model, plan, dispatcher)
    net.attach(COORD, ffn.deliver)
    worker = Worker(W1, shape, load_model(moe_dir))
    worker.accept_plan(plan)
    net.attach(W1, lambda src, msg: (sent.append(msg), net.send(W1, src, worker.handle(msg))))
    x = np.random.default_rng(0).standard_normal((2, model.config.hidden_size)).astype(np.float32)
    try:
        with pytest.raises(CoordinatorChangedError, match="stopped coordinating"):
            ffn.ffn(0, x)
        assert sent == [] and answer == [3, 3, 3]
        out = ffn.ffn(0, x)  # it leads (True from now on): the step runs, its rows asked of the worker
        assert out.shape == x.shape and sent and ffn.remote_rows > 0
    finally:
        net.close()


def test_a_deposed_coordinators_stage_step_fails_before_any_stage(moe_dir):
    model, ffn, hand, runners = staged(moe_dir, (Stage(COORD, 0, 1), Stage(W1, 1, 2), Stage(W2, 2, 3)))
    terms = []
    hand.lead_state = lambda term: (terms.append(term), False)[1]
    x = np.random.default_rng(1).standard_normal((1, model.config.hidden_size)).astype(np.float32)
    with pytest.raises(CoordinatorChangedError, match="stopped coordinating"):
        ffn.run_layers(model, x, model.new_cache(), 0)
    assert terms == [ffn.layout.term] and all(r.served == 0 for r in runners.values())
