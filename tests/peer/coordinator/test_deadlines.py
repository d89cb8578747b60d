"""The deadline rule both dispatchers follow (swarm/peer/coordinator/tracker.py), and the
stages under it: a stage's first pass gets a deadline for reading its layers from disk, a late
answer is timed (slow, not gone), a miss fails a peer only at its first request, at MISS_LIMIT in
a row or after SILENCE_S of silence, and a peer that missed and has not been heard since is
sent nothing (suspect) until it is heard or fails by silence. In process: StagedFFN against
StageRunners on other threads (tests/peer/coordinator/test_stages.py); the oracle is the local engine."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.peer.coordinator import tracker as D
from swarm.peer.coordinator.costmodel import LayerCosts
from swarm.peer.plan import Stage, StageLayout
from swarm.peer.net.messages import StageRequest
from tests.peer._swarm_models import COORD, PROMPT, W1, W2, build, greedy
from tests.peer.coordinator.test_stages import staged


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build("qwen3_moe", tmp_path_factory.mktemp("deadlines"))


def test_the_rule_in_time_late_missed_and_first():
    d = D.RequestTracker()
    d.of(W1).rtt_s = 0.001
    d.loading(W1, 6 * 10**9)  # a 6 GB stage, not answered yet
    first = d.sent(W1, 10, now=0.0)
    assert first.first and first.deadline == pytest.approx(D.FIRST_DEADLINE_S + 6e9 / D.COLD_READ_BYTES_S)
    d.answered(first, now=8.0)  # its pages came from disk: not its speed...
    d.answered(d.sent(W1, 10, now=8.0), now=8.011)  # ...this one is: ~1 ms per row
    quick = d.sent(W1, 1, now=9.0)
    assert not quick.first and quick.deadline - 9.0 == D.DEADLINE_MIN_S
    assert d.missed(7, quick, now=9.3, heard=9.2) is None  # one miss, link alive: kept
    assert d.of(W1).misses == 1 and d.sent(W1, 1, now=10.0).deadline - 10.0 == 2 * D.DEADLINE_MIN_S
    assert d.late(7, W1, now=9.6)  # its answer came after all: slow, not gone
    t = d.of(W1)
    assert t.misses == 0 and t.late == 1 and d.sent(W1, 1, now=10.0).deadline - 10.0 > D.DEADLINE_MIN_S
    assert not d.late(7, W1, now=9.7)  # once
    for i in range(D.MISS_LIMIT - 1):
        assert d.missed(20 + i, d.sent(W1, 1, now=11.0), now=20.0, heard=19.9) is None
    assert "misses in a row" in d.missed(30, d.sent(W1, 1, now=21.0), now=30.0, heard=29.9)
    assert "nothing heard" in D.RequestTracker().missed(1, quick, now=20.0, heard=20.0 - D.SILENCE_S - 1)
    d.loading(W1, 0)
    assert "first request" in d.missed(31, d.sent(W1, 1, now=40.0), now=80.0, heard=79.9)
    assert D.RequestTracker.gone_silent(quick, now=9.0 + D.SILENCE_S + 0.1, heard=9.0)
    assert not D.RequestTracker.gone_silent(quick, now=9.0 + D.SILENCE_S + 0.1, heard=9.0 + D.SILENCE_S)


def test_a_peer_that_missed_and_was_not_heard_since_is_suspect_until_heard():
    d = D.RequestTracker()
    d.answered(d.sent(W1, 10, now=0.0), now=0.01)  # answered once: deadlines from its speed
    s = d.sent(W1, 1, now=10.0)
    assert not s.first and s.deadline - 10.0 == D.DEADLINE_MIN_S
    assert not d.suspect(W1, heard=9.5)  # in flight, not missed yet
    assert d.missed(1, s, now=10.3, heard=9.5) is None  # silent 0.8 s: kept
    assert d.suspect(W1, heard=9.5) and d.suspect(W1, heard=10.0)  # nothing heard since it was sent
    assert not d.suspect(W2, heard=9.5)  # another peer
    assert not d.suspect(W1, heard=10.2)  # a heartbeat after the request: it is sent again
    assert not d.suspect(W1, heard=None)  # last contact unknown: never suspect
    assert d.of(W1).misses == 1  # suspect, nothing sent: no further miss
    assert D.RequestTracker.silence(now=10.3, heard=9.5) is None
    assert D.RequestTracker.silence(now=9.5 + D.SILENCE_S + 0.1, heard=9.5) == f"nothing heard for {D.SILENCE_S + 0.1:.1f} s"
    assert D.RequestTracker.silence(now=100.0, heard=None) is None
    assert d.late(1, W1, now=10.6)  # its late answer: heard, slow, not gone
    assert not d.suspect(W1, heard=9.5) and d.of(W1).misses == 0
    assert d.missed(2, d.sent(W1, 1, now=11.0), now=11.3, heard=10.9) is None
    assert d.suspect(W1, heard=10.9)
    d.forget(W1)  # its link closed: that request will never be answered
    assert not d.suspect(W1, heard=10.9)


def test_a_stage_peer_that_stops_answering_and_beating_costs_one_wait_then_fails_by_silence(moe_dir):
    """At decode step 2 W1 stops answering and nothing more is heard from it (its process
    killed, its link not closed yet). Its missed step is the one request it is sent: it is
    suspect from then on, so its stage runs here at once at the next steps (no wait, no miss
    counted), and it is marked down once its link has been silent SILENCE_S (its last contact
    set back that far at step 5). Tokens and logits are the local run's."""
    model, ffn, hand, runners = staged(moe_dir, (Stage(COORD, 0, 1), Stage(W1, 1, 3)))
    heard, sent, misses = {}, [], []  # heard: W1's last contact once it stopped (others: now)
    hand.last_heard = lambda p: heard.get(p, time.monotonic())
    send = hand.send

    def stopped(peer, req):
        if isinstance(req, StageRequest):
            sent.append((peer, peer in heard))
            if peer in heard:
                return  # nothing comes back
        send(peer, req)

    hand.send = stopped

    def on_step(step):
        hand.join()
        if step == 2:
            heard[W1] = time.monotonic()
            misses.append(ffn.misses)
        if step == 5:
            heard[W1] = time.monotonic() - D.SILENCE_S - 1.0

    run = greedy(model, ffn, PROMPT, 8, on_step)
    hand.join()
    ref = greedy(load_model(moe_dir), None, PROMPT, 8)
    assert run[0] == ref[0] and all(np.array_equal(a, b) for a, b in zip(run[1], ref[1], strict=True))
    assert sent.count((W1, True)) == 1  # the missed step; not one per doubled deadline
    assert ffn.misses - misses[0] == 1  # its stopped steps: one miss
    assert ffn.tracker.withheld == 3  # steps 3 and 4 ran here at once; at step 5 it failed
    assert [p for p, _ in hand.failed] == [W1] and "nothing heard" in hand.failed[0][1], hand.failed
    assert ffn.failed == {W1} and ffn.timing[W1].failures == 1


def warm_then_relayout(moe_dir, slow_first_s: float):
    """W1 runs layers 1..2 for a run (its deadlines short from then on), then a new layout gives
    it layer 2 alone, whose first pass takes ``slow_first_s`` (pages read from disk)."""
    model, ffn, hand, runners = staged(moe_dir, (Stage(COORD, 0, 1), Stage(W1, 1, 3)))
    greedy(model, ffn, PROMPT, 4)
    hand.join()
    runner = runners[W1]
    handle, seen = runner.handle, set()

    def cold(msg):
        span = (msg.layer_start, msg.layer_stop)
        if span not in seen:
            seen.add(span)
            time.sleep(slow_first_s)
        return handle(msg)

    seen.add((1, 3))
    runner.handle = cold
    new = StageLayout(1, 2, COORD, (Stage(COORD, 0, 2), Stage(W1, 2, 3)))
    runner.accept(new)
    ffn.set_layout(new)
    return model, ffn, hand, runner


def test_a_healthy_stage_peer_on_its_first_pass_of_a_new_stage_is_not_declared_late(moe_dir):
    model, ffn, hand, runner = warm_then_relayout(moe_dir, slow_first_s=1.0)
    short = ffn.timing[W1].deadline_s(len(PROMPT))
    assert short < 1.0  # what the old rule gave the cold first pass
    sent = []
    orig = ffn.tracker.sent
    ffn.tracker.sent = lambda *a: sent.append(orig(*a)) or sent[-1]
    run = greedy(model, ffn, PROMPT, 3)
    hand.join()
    ref = greedy(load_model(moe_dir), None, PROMPT, 3)
    assert run[0] == ref[0] and all(np.array_equal(a, b) for a, b in zip(run[1], ref[1], strict=True))
    assert ffn.misses == 0 and not ffn.failed and not hand.failed and ffn.rebuilt_positions == 0
    stage_bytes = LayerCosts.from_model(model).layer_bytes(2)
    assert sent[0].first and sent[0].deadline - sent[0].sent_at == pytest.approx(D.first_deadline_s(stage_bytes))
    assert not sent[1].first and ffn.warm[W1] >= {(2, 3)}


def test_a_late_stage_answer_is_timed_slow_not_gone(moe_dir, monkeypatch):
    monkeypatch.setattr(D, "DEADLINE_MIN_S", 0.02)
    model, ffn, hand, runners = staged(moe_dir, (Stage(COORD, 0, 1), Stage(W1, 1, 3)))
    send, n, gate = hand.send, [0], threading.Event()

    def slow_third(peer, req):
        n[0] += 1
        if n[0] == 3:  # decode step 2's answer comes 0.5 s late
            threading.Timer(0.5, lambda: (send(peer, req), gate.set())).start()
            return
        send(peer, req)

    hand.send = slow_third

    def on_step(step):
        hand.join()
        if step == 0:
            ffn.timing[W1].s_per_row = 1e-4  # as after earlier answers: a short deadline
        if step == 2:
            assert gate.wait(5)
            hand.join()

    run = greedy(model, ffn, PROMPT, 6, on_step)
    hand.join()
    ref = greedy(load_model(moe_dir), None, PROMPT, 6)
    assert run[0] == ref[0] and all(np.array_equal(a, b) for a, b in zip(run[1], ref[1], strict=True))
    t = ffn.timing[W1]
    assert ffn.misses == 1 and t.late == 1 and not ffn.failed and not hand.failed
    assert t.misses == 0 and t.deadline_s(1) > 0.4  # its deadline now covers what it took


def test_an_answer_that_comes_as_the_wait_ends_is_used_not_counted_as_a_miss():
    """The answer arrives after the wait timed out but before the miss is recorded: expire() takes
    the request out and records the miss in one step under the tracker's lock, so the answer is
    used and no miss counted (it was once dropped and counted as one)."""
    d = D.RequestTracker()
    d.answered(d.sent(W1, 1, now=0.0), now=0.01)
    req = StageRequest(7, 1, 1, (), 0, 1, np.zeros((1, 4), np.float32))
    p = d.track(7, req, W1, 1, now=1.0)
    answer = type("Answer", (), {"request_id": 7})()
    assert not d.deliver(W1, answer, now=1.0 + D.DEADLINE_MIN_S + 0.01)  # in flight still: not late
    assert d.expire(p, now=1.0 + D.DEADLINE_MIN_S + 0.02, heard=1.2) is None
    assert p.future.result(timeout=0) is answer and d.of(W1).misses == 0 and not d.suspect(W1, heard=0.5)
    clock = iter([5.0, 5.0, 5.0]).__next__  # a wait that starts past the deadline
    assert D.wait_answer(d, p, clock, lambda peer: 4.9) is answer
    q = d.track(8, StageRequest(8, 1, 1, (), 0, 1, np.zeros((1, 4), np.float32)), W1, 1, now=10.0)
    missed = D.wait_answer(d, q, iter([10.0 + D.DEADLINE_MIN_S] * 3).__next__, lambda peer: 10.1)
    assert isinstance(missed, D.Missed) and missed.misses == 1 and missed.why is None
    assert d.deliver(W1, type("Answer", (), {"request_id": 8})(), now=10.5)  # then timed: slow, not gone
    assert d.of(W1).misses == 0 and d.of(W1).late == 1


def test_a_wait_after_this_process_stalled_reads_what_came_meanwhile_before_judging():
    """The coordinator stopped (SIGSTOP, a laptop's sleep) 3 s right after sending: on waking, its
    wait finds the deadline long past and the link silent for 3 s — but the answer was sent in
    time and is read by the event loop a moment later. The wait takes it: no miss, no silence
    (it once marked every worker down at each wake: "no answer within 3.0 s; nothing heard for
    3.0 s"). Its control: a wait looked at all along misses the same late answer."""
    def waited(stalled_s: float) -> object:
        d = D.RequestTracker()
        d.answered(d.sent(W1, 1, now=0.0), now=0.01)  # answered before: not its first request
        offset = [0.0]
        clock = lambda: time.monotonic() + offset[0]  # noqa: E731
        sent = clock()
        p = d.track(9, StageRequest(9, 1, 1, (), 0, 1, np.zeros((1, 4), np.float32)), W1, 1, now=sent)
        offset[0] += stalled_s  # the process slept this long after sending
        answer = type("Answer", (), {"request_id": 9})()
        if not stalled_s:  # the control: nothing comes while it waits
            return D.wait_answer(d, p, clock, lambda peer: sent)
        # the event loop reads it 0.1 s after the wait starts, its deadline long past by then
        timer = threading.Timer(0.1, lambda: d.deliver(W1, answer, now=clock()))
        timer.start()
        try:
            return D.wait_answer(d, p, clock, lambda peer: sent)  # last byte: before the stall
        finally:
            timer.join()

    assert type(waited(3.0)).__name__ == "Answer"
    missed = waited(0.0)
    assert isinstance(missed, D.Missed) and missed.why is None


def test_a_wait_begun_late_after_the_coordinators_own_share_still_waits_until_its_deadline():
    """The coordinator computes its own share (2 s of a long prompt) before it waits for a
    worker's first request under its share, whose deadline allows loading (30 s and more): the
    wait, begun more than a second after sending, looks like one after a stall, but its grace
    only lengthens it — the answer coming 0.8 s into the wait is taken, no miss (a grace that
    ended the wait marked a healthy worker down for missing its first request)."""
    d = D.RequestTracker()
    offset = [0.0]
    clock = lambda: time.monotonic() + offset[0]  # noqa: E731
    sent = clock()
    p = d.track(11, StageRequest(11, 1, 1, (), 0, 1, np.zeros((1, 4), np.float32)), W1, 1, now=sent)
    assert p.sent.first and p.deadline - sent > 5.0
    offset[0] += 2.0  # its own share, before it waits
    answer = type("Answer", (), {"request_id": 11})()
    timer = threading.Timer(0.8, lambda: d.deliver(W1, answer, now=clock()))
    timer.start()
    try:
        assert D.wait_answer(d, p, clock, lambda peer: clock()) is answer
    finally:
        timer.join()


def test_a_distrusted_peer_that_leaves_is_still_shown_failed_and_one_that_leaves_is_not():
    """A peer that closed its link is no failure, but one a wrong answer distrusted stays failed in
    what status and the dashboard show, whether or not it then left."""
    d = D.RequestTracker()
    d.answered(d.sent(W1, 1, now=0.0), now=0.01)
    d.answered(d.sent(W2, 1, now=0.0), now=0.01)
    d.distrust(W1, "its rows differ")
    d.peer_down(W1, "it closed its link (leaving)", left=True)
    d.peer_down(W2, "it closed its link (leaving)", left=True)
    assert d.observations().failed == frozenset({W1})
    d.readmit()
    assert d.observations().failed == frozenset({W1})
