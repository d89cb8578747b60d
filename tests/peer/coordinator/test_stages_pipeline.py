"""Micro-batch pipelining over stages: a step of several sequences is cut into groups that cross
the stages as a wavefront (group g at stage s while group g+1 is at stage s-1). In process:
StageRunners answer on other threads after a short delay (a real link's hand-off and a peer's
compute time), and every request is stamped when it is sent and when its answer arrives.

The oracle is the local engine, each sequence alone: the tokens and the logits of every
sequence are its solo bits, with the groups in flight at two stage peers at once, and with a
stage peer killed while a group is in flight there. One sequence is not split."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.peer.coordinator.costmodel import pipeline_groups
from swarm.peer.coordinator.stages import micro_groups
from swarm.peer.net import messages as m
from swarm.peer.plan import Stage
from tests.peer._swarm_models import COORD, W1, W2, build
from tests.peer.coordinator.test_stages import greedy_alone, greedy_together, staged

MOE = "qwen3_moe"
DECODE = 5
ANSWER_DELAY_S = 0.02  # each stage peer answers this long after a request arrives
TWO_WORKERS = (Stage(W1, 0, 2), Stage(W2, 2, 3))
WITH_COORDINATOR = (Stage(COORD, 0, 1), Stage(W1, 1, 2), Stage(W2, 2, 3))


def prompts(n: int) -> list[list[int]]:
    return [[(5 * i + 7 * k + 1) % 96 for i in range(3 + 2 * k)] for k in range(n)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build(MOE, tmp_path_factory.mktemp("pipeline"))


@pytest.fixture(scope="module")
def reference(moe_dir):
    model, memo = load_model(moe_dir), {}

    def ref(prompt, n):
        key = (tuple(prompt), n)
        if key not in memo:
            memo[key] = greedy_alone(model, prompt, n)
        return memo[key]
    return ref


class Stamped:
    """The test Hand's requests answered ``ANSWER_DELAY_S`` after they are sent, each stamped:
    (peer, request id, sequences, sent at, answered at). ``kill_at``: peer → the number of its
    request whose answer never comes — its link closes while that group is in flight."""

    def __init__(self, hand, kill_at: dict[str, int] | None = None):
        self.hand, self.kill_at = hand, dict(kill_at or {})
        self.log: list[list] = []
        self.sent: dict[str, int] = {}
        self.lock = threading.Lock()
        self.killed: list[str] = []
        self.send = hand.send
        hand.send = self.stamp

    def stamp(self, peer: str, req) -> None:
        if not isinstance(req, m.StageRequest) or peer in self.hand.down:
            return self.send(peer, req)
        with self.lock:
            n = self.sent[peer] = self.sent.get(peer, 0) + 1
            entry = [peer, req.request_id, tuple(s.sequence for s in req.segments), time.monotonic(), None]
            self.log.append(entry)
        runner, ffn = self.hand.runners[peer], self.hand.ffn

        def answer():
            time.sleep(ANSWER_DELAY_S)
            msg = runner.handle(req)
            if self.kill_at.get(peer) == n:  # gone with the group in flight: its link closes
                self.hand.down.add(peer)
                self.killed.append(peer)
                ffn.peer_down(peer, "link closed")
                return
            entry[4] = time.monotonic()
            ffn.deliver(peer, msg)

        t = threading.Thread(target=answer)
        self.hand.threads.append(t)
        t.start()

    def overlaps(self, a: str, b: str) -> list[tuple[list, list]]:
        """Pairs of answered requests, one at ``a`` and one at ``b`` for other sequences, in flight
        at the same time."""
        done = [e for e in self.log if e[4] is not None]
        return [(x, y) for x in done if x[0] == a for y in done if y[0] == b
                if not set(x[2]) & set(y[2]) and x[3] < y[4] and y[3] < x[4]]


def check_solo(reference, ps, tokens, logits, n=DECODE):
    for i, prompt in enumerate(ps):
        want_tokens, want_logits = reference(prompt, n)
        assert tokens[i] == want_tokens, i
        assert all(np.array_equal(a, b) for a, b in zip(logits[i], want_logits, strict=True)), i


def greedy_steps(model, ffn, ps, n):
    """Every sequence prefills in the first step, then ``n`` greedy decode steps together."""
    caches = [model.new_cache() for _ in ps]
    feed = [list(p) for p in ps]
    tokens, logits = [[] for _ in ps], [[] for _ in ps]
    for _ in range(n + 1):
        for i, row in enumerate(model.forward_batch(list(zip(feed, caches)), ffn=ffn)):
            logits[i].append(row)
            tokens[i].append(int(np.argmax(row)))
            feed[i] = [tokens[i][-1]]
    return tokens, logits


def test_groups_split_by_rows_in_order_and_none_empty():
    class P:
        def __init__(self, rows):
            self.x = np.zeros((rows, 1))

    parts = [P(r) for r in (1, 1, 1, 1, 1, 1, 1, 1)]
    assert [len(g) for g in micro_groups(parts, 4)] == [2, 2, 2, 2]
    assert [x for g in micro_groups(parts, 3) for x in g] == parts
    prefill = [P(12), P(1), P(1), P(1), P(1)]  # a prompt weighs its rows
    assert [len(g) for g in micro_groups(prefill, 2)] == [1, 4]
    assert [len(g) for g in micro_groups(parts[:3], 8)] == [1, 1, 1]
    assert micro_groups(parts[:1], 4) == [parts[:1]]
    assert pipeline_groups(1, 3) == 1 and pipeline_groups(8, 1) == 1
    assert pipeline_groups(8, 2) == 2 and pipeline_groups(8, 3) == 3 and pipeline_groups(2, 3) == 2


@pytest.mark.parametrize("stages", [TWO_WORKERS, WITH_COORDINATOR], ids=["two-workers", "coordinator-and-two"])
@pytest.mark.parametrize("n_seq", [4, 8])
def test_pipelined_groups_overlap_at_two_stage_peers_with_each_sequence_solo_bits(moe_dir, reference, stages, n_seq):
    model, ffn, hand, runners = staged(moe_dir, stages)
    stamped = Stamped(hand)
    ps = prompts(n_seq)
    tokens, logits = greedy_steps(model, ffn, ps, DECODE)
    hand.join()
    check_solo(reference, ps, tokens, logits)
    groups = pipeline_groups(n_seq, len(stages))
    assert groups > 1 and not ffn.failed and ffn.misses == 0
    # one request per stage peer per group and step, each carrying its group's sequences only
    assert all(r.served == groups * (DECODE + 1) for r in runners.values())
    assert max(len(e[2]) for e in stamped.log) < n_seq
    # a group was at the second stage peer while another was at the first
    assert stamped.overlaps(W1, W2)
    # the wavefront: a step takes about groups + stages - 1 answer delays, not groups × stages
    steps = [e for e in stamped.log if e[0] in (W1, W2)]
    span = max(e[4] for e in steps) - min(e[3] for e in steps)
    assert span < (DECODE + 1) * groups * 2 * ANSWER_DELAY_S


def test_sequences_joining_step_by_step_keep_their_solo_bits(moe_dir, reference):
    model, ffn, hand, runners = staged(moe_dir, TWO_WORKERS)
    Stamped(hand)
    ps = prompts(6)
    tokens, logits = greedy_together(model, ffn, ps, DECODE)  # prefills beside the others' decode rows
    hand.join()
    check_solo(reference, ps, tokens, logits)
    assert not ffn.failed


def test_one_sequence_is_not_split(moe_dir, reference):
    model, ffn, hand, runners = staged(moe_dir, TWO_WORKERS)
    stamped = Stamped(hand)
    (p,) = ps = prompts(1)
    tokens, logits = greedy_steps(model, ffn, ps, DECODE)
    hand.join()
    check_solo(reference, ps, tokens, logits)
    assert all(r.served == DECODE + 1 for r in runners.values()) and ffn.pipelined_steps == 0
    assert not stamped.overlaps(W1, W2)  # one after the other


def test_groups_off_runs_the_stages_one_after_the_other(moe_dir, reference):
    model, ffn, hand, runners = staged(moe_dir, TWO_WORKERS)
    ffn.pipeline_groups = 1
    stamped = Stamped(hand)
    ps = prompts(4)
    tokens, logits = greedy_steps(model, ffn, ps, DECODE)
    hand.join()
    check_solo(reference, ps, tokens, logits)
    assert all(r.served == DECODE + 1 for r in runners.values()) and not stamped.overlaps(W1, W2)


@pytest.mark.parametrize("victim,nth", [(W1, 2), (W2, 1), (W2, 6), (W1, 9)],
                         ids=["first-at-prefill", "second-at-prefill", "second-mid-decode", "first-mid-decode"])
@pytest.mark.parametrize("stages", [TWO_WORKERS, WITH_COORDINATOR], ids=["two-workers", "coordinator-and-two"])
def test_a_stage_peer_killed_with_groups_in_flight_keeps_every_token(moe_dir, reference, stages, victim, nth):
    model, ffn, hand, runners = staged(moe_dir, stages)
    stamped = Stamped(hand, kill_at={victim: nth})
    ps = prompts(8)
    tokens, logits = greedy_steps(model, ffn, ps, DECODE)
    hand.join()
    check_solo(reference, ps, tokens, logits)
    assert stamped.killed == [victim] and ffn.failed == {victim} and [p for p, _ in hand.failed] == [victim]
    assert stamped.sent[victim] == nth  # nothing sent to it after its link closed
    other = W2 if victim == W1 else W1
    assert other not in ffn.failed and runners[other].served == pipeline_groups(8, len(stages)) * (DECODE + 1)
    # its layers' KV cache rebuilt here, for the sequences it had answered, from the rows that
    # had entered them (none when its very first request was the one lost)
    assert (ffn.rebuilt_positions > 0) == (nth > 1)


def test_steps_of_two_batches_at_once_pipeline_across_steps_with_solo_bits(moe_dir, reference):
    """Two token loops (two batch schedulers' worth) share the StagedFFN, each stepping its own
    sequences: while one batch is at the second stage peer the other is at the first, step after
    step, with no drain between steps."""
    model, ffn, hand, runners = staged(moe_dir, TWO_WORKERS)
    ffn.pipeline_groups = 1  # each batch one group: the overlap comes from the two loops
    stamped = Stamped(hand)
    ps = prompts(6)
    halves = [ps[0::2], ps[1::2]]
    results: list = [None, None]

    def loop(k):
        results[k] = greedy_steps(model, ffn, halves[k], DECODE)

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    hand.join()
    for half, (tokens, logits) in zip(halves, results):
        check_solo(reference, half, tokens, logits)
    assert not ffn.failed and ffn.pipelined_steps == 0
    assert all(r.served == 2 * (DECODE + 1) for r in runners.values())
    assert stamped.overlaps(W1, W2)
