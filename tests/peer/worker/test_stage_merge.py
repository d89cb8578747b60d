"""A stage peer's merged requests (swarm/peer/worker/stages.py, "Merged requests"): requests
queued at a StageRunner's compute thread for the same stage are computed in one call. The
oracle is another StageRunner, on its own copy of the model, answering the same requests one
at a time in arrival order: every merged answer has its bits, its request id and segments."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.compute.serving import MAX_BATCH_LIMIT
from swarm.peer.net import messages as m
from swarm.peer.plan import Stage, StageLayout
from swarm.peer.worker.stages import StageRunner
from tests.peer._swarm_models import COORD, W1, build

LAYOUT = StageLayout(1, 1, COORD, (Stage(COORD, 0, 1), Stage(W1, 1, 3)))
PREFILL = 5  # rows of each sequence's first request


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build("qwen3_moe", tmp_path_factory.mktemp("merge"))


def runner(moe_dir) -> tuple[StageRunner, list[int]]:
    """A StageRunner of W1's stage on its own model copy, and the requests each call of its
    compute computed (appended as it runs)."""
    r = StageRunner(W1, load_model(moe_dir))
    r.accept(LAYOUT)
    calls: list[int] = []
    compute = r._compute
    r._compute = lambda admitted: calls.append(len(admitted)) or compute(admitted)  # type: ignore[method-assign]
    return r, calls


_rid = iter(range(1, 10**6))


def request(*segments: tuple[int, int, int], version: int = 1) -> m.StageRequest:
    """A request of W1's stage for ``(sequence, start, rows)`` segments, its rows random [T, 64]."""
    rid = next(_rid)
    x = np.random.default_rng(rid).standard_normal((sum(n for _, _, n in segments), 64)).astype(np.float32)
    return m.StageRequest(rid, 1, version, tuple(m.StageSegment(*s) for s in segments), 1, 3, x)


def queued(r: StageRunner, reqs: list[m.StageRequest]) -> list[m.StageAnswer | m.Error]:
    """Submit ``reqs`` while the compute thread is held busy, so they all wait in its queue; their answers."""
    gate = threading.Event()
    with ThreadPoolExecutor(1) as compute:
        compute.submit(gate.wait, 10)
        futures = [r.submit(compute, q) for q in reqs]
        gate.set()
        return [f.result(30) for f in futures]


def assert_same(got: m.StageAnswer | m.Error, alone: m.StageAnswer | m.Error) -> None:
    assert type(got) is type(alone) and got.request_id == alone.request_id
    if isinstance(got, m.Error):
        assert got.code == alone.code
        return
    assert got.segments == alone.segments and np.array_equal(got.x, alone.x)


def test_requests_queued_for_a_stage_are_computed_in_one_call_with_the_bits_of_each_alone(moe_dir):
    merged, calls = runner(moe_dir)
    solo, _ = runner(moe_dir)
    prefill = [request((1, 0, PREFILL), (2, 0, PREFILL - 2)), request((3, 0, PREFILL)), request((4, 0, 2))]
    decode = [request((1, PREFILL, 1), (2, PREFILL - 2, 1)), request((3, PREFILL, 1)), request((4, 2, 1))]
    for round_ in (prefill, decode):
        got = queued(merged, round_)
        for q, a in zip(round_, got, strict=True):
            alone = solo.handle(q)
            assert isinstance(alone, m.StageAnswer)
            assert_same(a, alone)
    assert calls == [3, 3] and merged.merged == 6 and merged.served == 6 and merged._busy == 0
    # each answer's seconds: the call's, shared by rows
    shares = [a.compute_s / a.x.shape[0] for a in got]
    assert shares == pytest.approx([shares[0]] * 3)


def test_a_refused_request_gets_its_own_error_and_the_others_are_merged(moe_dir):
    merged, calls = runner(moe_dir)
    solo, _ = runner(moe_dir)
    reqs = [request((1, 0, 3)),
            request((2, 0, 2), version=9),  # a plan this peer does not serve: stale_term
            request((3, 4, 1)),  # a sequence it holds no positions of: cache_gap
            request((4, 0, 4))]
    got = queued(merged, reqs)
    alone = [solo.handle(q) for q in reqs]
    for a, b in zip(got, alone, strict=True):
        assert_same(a, b)
    assert [getattr(a, "code", None) for a in got] == [None, "stale_term", "cache_gap", None]
    assert calls == [2] and merged.merged == 2 and merged.served == 2


def test_requests_sharing_a_sequence_keep_its_order_and_are_not_merged(moe_dir):
    merged, calls = runner(moe_dir)
    solo, _ = runner(moe_dir)
    first = [request((1, 0, 3)), request((2, 0, 2))]
    for q in first:
        merged.handle(q), solo.handle(q)
    reqs = [request((1, 3, 1)),
            request((1, 4, 1), (2, 2, 1)),  # sequence 1 again: after the first, alone
            request((2, 3, 1)),  # disjoint from the first, but sequence 2's step before it waits
            request((3, 0, 2))]  # merged with the first
    got = queued(merged, reqs)
    for q, a in zip(reqs, got, strict=True):
        assert_same(a, solo.handle(q))
    assert calls == [1, 1, 2, 1, 1] and merged.merged == 2


def test_a_merge_stays_within_the_sequences_of_a_step(moe_dir):
    merged, calls = runner(moe_dir)
    half = MAX_BATCH_LIMIT // 2
    reqs = [request(*((s, 0, 1) for s in range(k * 100, k * 100 + half + 1))) for k in range(2)]
    assert all(isinstance(a, m.StageAnswer) for a in queued(merged, reqs))
    assert calls == [1, 1] and merged.merged == 0


def test_requests_queued_when_the_compute_thread_stops_are_cancelled(moe_dir):
    r, calls = runner(moe_dir)
    gate = threading.Event()
    compute = ThreadPoolExecutor(1)
    compute.submit(gate.wait, 10)
    futures = [r.submit(compute, request((s, 0, 1))) for s in (1, 2)]
    compute.shutdown(wait=False, cancel_futures=True)
    gate.set()
    compute.shutdown(wait=True)
    assert all(f.cancelled() for f in futures) and r._busy == 0 and not r._queue and calls == []


@pytest.mark.parametrize("groups", [2, 3])
def test_short_steps_run_inline_unless_more_groups_take_turns_than_there_are_stages(moe_dir, groups):
    """Two stages: with two groups (schedulers) in turn a decode step runs on the receiving
    thread; with three, it goes to the compute thread, where it can be merged."""
    r, _ = runner(moe_dir)
    for seq in range(groups):
        assert isinstance(r.handle(request((seq, 0, 2))), m.StageAnswer)
    for pos in (2, 3):  # each sequence a group of its own, stepped in turn
        for seq in range(groups):
            assert isinstance(r.handle(request((seq, pos, 1))), m.StageAnswer)
    assert r.take_inline(request((0, 4, 1))) == (groups <= len(LAYOUT.stages))
