"""Several batch schedulers under one set of limits (``SchedulerPool``): a new sequence goes to
the least loaded member and stays there until finished ones leave the groups uneven; ``max_batch`` and ``max_queue`` hold over all members
together; sequences are admitted in arrival order across them; each sequence's tokens are its
solo run's; with width 1 the pool is one scheduler."""

from __future__ import annotations

import threading
import time

import pytest

from swarm.compute.model import load_model
from swarm.compute.sampling import SamplingParams
from swarm.compute.serving import BatchScheduler, QueueFullError, SchedulerPool


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny("qwen2_moe")[1])


def alone(model, prompt, params):
    return list(BatchScheduler(model, max_batch=1, chunk=4, prefill_rows=4).submit(prompt, params))


def wait_for(what, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
    return got


def test_the_limits_hold_over_every_member_and_each_sequence_keeps_its_solo_tokens(model):
    pool = SchedulerPool(model, max_batch=2, max_queue=1, chunk=4, prefill_rows=4)
    pool.set_width(2)
    jobs = [([1] * 160, SamplingParams(max_tokens=3)), ([2] * 160, SamplingParams(max_tokens=3)),
            ([3, 4], SamplingParams(max_tokens=2))]
    streams = [pool.submit(p, q) for p, q in jobs]
    with pytest.raises(QueueFullError):  # 2 running + 1 waiting over both members: full
        pool.submit([5], SamplingParams(max_tokens=1))
    wait_for(lambda: len(pool.snapshot()["running"]) == 2)
    # the first two on a member each (the least loaded), the third waits though each member has
    # room for more of its own: max_batch is the pool's
    assert [m.snapshot()["running"] for m in pool.schedulers] == [[streams[0].ident], [streams[1].ident]]
    assert pool.snapshot()["waiting"] == [streams[2].ident]
    got = [list(s) for s in streams]
    assert got == [alone(model, p, q) for p, q in jobs]
    assert all(m.steps > 0 for m in pool.schedulers) and pool.peak_batch <= 2
    assert pool.snapshot()["running"] == [] and len(pool.left) == 3


def test_width_one_is_one_scheduler_and_a_wider_pool_spreads_new_sequences(model):
    pool = SchedulerPool(model, max_batch=4, chunk=4, prefill_rows=4)
    params = SamplingParams(max_tokens=2)
    streams = [pool.submit([7, 8, 9], params) for _ in range(3)]
    assert [list(s) for s in streams] == [alone(model, [7, 8, 9], params)] * 3
    assert len(pool.schedulers) == 1 and pool.schedulers[0].steps > 0
    pool.set_width(3)
    streams = [pool.submit([1] * 40, params) for _ in range(3)]  # each to the least loaded: one apiece
    # Which scheduler took each (a sequence may already be done by the time it is asked).
    assert sorted(pool.schedulers.index(s._scheduler) for s in streams) == [0, 1, 2]
    assert [list(s) for s in streams] == [alone(model, [1] * 40, params)] * 3
    pool.set_width(1)  # the others take nothing new
    before = [m.steps for m in pool.schedulers]
    assert list(pool.submit([7, 8, 9], params)) == alone(model, [7, 8, 9], params)
    assert [m.steps for m in pool.schedulers][1:] == before[1:]


def test_a_member_with_the_oldest_waiting_sequence_is_woken_when_another_frees_a_slot(model):
    """Member 0 runs a long prompt, member 1 a short one; two more wait, one on each (member 0's
    older). When the short one ends, member 0's waiting sequence takes the slot first (arrival
    order across members) and member 1's thread ends with its own still waiting; when that one
    ends too, member 0 wakes member 1, whose sequence then runs beside the long prompt."""
    pool = SchedulerPool(model, max_batch=2, max_queue=4, chunk=4, prefill_rows=4)
    pool.set_width(2)
    params = SamplingParams(max_tokens=2)
    long = pool.submit([1] * 400, params)  # member 0: 100 prefill steps
    short = pool.submit([2, 3], params)  # member 1
    queued = [pool.submit([4, 5], params), pool.submit([6, 7], params)]  # member 0, then member 1
    wait_for(lambda: {queued[0].ident, queued[1].ident} <= {x[0] for x in pool.left})  # both ran and left
    assert [list(s) for s in (short, *queued)] == [alone(model, p, params) for p in ([2, 3], [4, 5], [6, 7])]
    assert list(long) == alone(model, [1] * 400, params)
    assert pool.snapshot() == {"running": [], "waiting": [], "prefilling": {}, "steps": pool.steps}


@pytest.mark.parametrize("max_batch", [4, 3])
def test_a_sequence_joins_its_member_while_an_older_one_waits_on_another_if_a_slot_is_left_for_that_one(
        model, max_batch):
    """Both members are held in a step; an older sequence waits on member 0, a newer on member 1.
    When member 1's step ends (it runs two, then is held again), the newer joins it at once if the pool still has a slot for the
    older one beside it (max_batch 4: 2 running + the older + the newer) — not after member 0's
    step — and waits when it would take that slot (max_batch 3). Tokens are the solo runs'."""
    pool = SchedulerPool(model, max_batch=max_batch, max_queue=4, chunk=4, prefill_rows=4)
    pool.set_width(2)
    gates = [threading.Semaphore(0), threading.Semaphore(0)]  # one release: one step
    for member, gate in zip(pool.schedulers, gates):
        def held(step, run=member._step, gate=gate):
            assert gate.acquire(timeout=60)
            run(step)
        member._step = held
    params = SamplingParams(max_tokens=4)
    jobs = [[1, 2, 3], [4, 5], [6, 7], [8, 9]]
    try:
        first, second = pool.submit(jobs[0], params), pool.submit(jobs[1], params)  # one on each member
        wait_for(lambda: len(pool.snapshot()["running"]) == 2)  # each member is held in its first step
        older, newer = pool.submit(jobs[2], params), pool.submit(jobs[3], params)  # member 0, then member 1
        assert [m.snapshot()["waiting"] for m in pool.schedulers] == [[older.ident], [newer.ident]]
        gates[1].release(2)  # member 1 ends this step and runs one more; member 0 stays in its first
        wait_for(lambda: pool.schedulers[1].steps == 2)  # sequences join between steps
        assert (newer.ident in pool.schedulers[1].snapshot()["running"]) == (max_batch == 4)
        assert older.ident in pool.schedulers[0].snapshot()["waiting"]
    finally:  # a failed assertion leaves no member held
        for gate in gates:
            gate.release(1000)
    streams = [first, second, older, newer]
    assert [list(s) for s in streams] == [alone(model, p, params) for p in jobs]


def test_a_pool_filled_a_tile_at_a_time_cuts_its_groups_on_the_tile(model):
    """With the planner's row tile (CPU stages of a model whose weights are most of a decode step:
    a group past 4 rows costs every stage a second kernel pass), sequences that arrive one after
    another fill the stages' schedulers evenly up to a tile each, then whole tiles: 16 over three
    stages go 4 + 4 + 4 + 4 — a fourth scheduler past one per stage — where the least loaded of
    three gives 6 + 5 + 5; 12 over two 4 + 4 + 4 (6 + 6); 6 over two 3 + 3, never a third on the
    way. Every sequence keeps its solo tokens. Without the price, as before."""
    from swarm.peer.coordinator.costmodel import ROW_TILE, GroupPricer, LayerCosts, PeerCost

    mb = 2**20
    costs = LayerCosts((2e6,) * 24, (2e7,) * 24, (mb,) * 24, (40 * mb,) * 24, 1e7, 1024)
    coord, workers = PeerCost("c", 10**12, 10.0), [PeerCost("w1", 10**12, 10.0, 0.002), PeerCost("w2", 10**12, 10.0, 0.002)]
    three = GroupPricer(costs, coord, workers, (("c", 0, 8), ("w1", 8, 16), ("w2", 16, 24)))
    two = GroupPricer(costs, coord, workers[:1], (("c", 0, 12), ("w1", 12, 24)))
    assert three.row_tile() == two.row_tile() == ROW_TILE
    assert three.best_groups(16) == [4, 4, 4, 4] and two.best_groups(12) == [4, 4, 4]
    params, prompt = SamplingParams(max_tokens=2), [3] * 40  # ten chunks of prefill: still running at the 16th
    for stages, tile, n, want in ((3, ROW_TILE, 16, [4, 4, 4, 4]), (3, None, 16, [6, 5, 5]),
                                  (2, ROW_TILE, 12, [4, 4, 4]), (2, None, 12, [6, 6]), (2, ROW_TILE, 6, [3, 3])):
        pool = SchedulerPool(model, max_batch=16, chunk=4, prefill_rows=4)
        pool.set_width(stages, tile)
        streams = [pool.submit(prompt, params) for _ in range(n)]
        placed = [pool.schedulers.index(s._scheduler) for s in streams]
        assert sorted((placed.count(i) for i in set(placed)), reverse=True) == want, (stages, tile, placed)
        if n == 6:
            assert placed == [0, 1, 0, 1, 0, 1]
        assert [list(s) for s in streams] == [alone(model, prompt, params)] * n


def test_a_pool_filled_a_tile_at_a_time_refills_a_scheduler_that_emptied(model):
    """Sequences stay where they are placed; when one scheduler's have finished, it is filled
    again first (the first ``width`` are filled up to a tile before any other)."""
    pool = SchedulerPool(model, max_batch=16, chunk=4, prefill_rows=4)
    pool.set_width(2, 4)
    # the long ones run until cancelled below: at 40 tokens they could all end before the second
    # scheduler's finished sequences left it (a starved thread on a loaded machine), both then empty
    short, long_ = SamplingParams(max_tokens=1), SamplingParams(max_tokens=4000)
    first = [pool.submit([3] * 8, short if i % 2 else long_) for i in range(8)]  # 4 + 4: the second's end first
    for s in first[1::2]:
        list(s)
    wait_for(lambda: pool.schedulers[1].load() == 0)
    again = pool.submit([5, 6], short)
    assert again._scheduler is pool.schedulers[1]
    for s in [*first, again]:
        s.cancel()


def test_groups_left_uneven_by_finished_sequences_are_evened_and_keep_their_tokens(model):
    """Sequences stay where they are placed until finished ones leave the groups uneven. One
    group per stage (no tile): 2 + 2 over two schedulers whose second pair ends first go on as
    1 + 1, not 2 + 0. Filled a tile at a time: 4 + 4 + 2 over two stages, two of the first
    group's ending, go on as 4 + 4 (two passes of the kernels a round), not 2 + 4 + 2 (three).
    Every moved sequence keeps its solo run's tokens (as far as it ran: the long ones, which
    leave the even cut hundreds of steps to be seen in, are cancelled once it is)."""
    prompt, long_, short = [3] * 8, SamplingParams(max_tokens=400), SamplingParams(max_tokens=1)
    want = alone(model, prompt, long_)
    for tile, n, shorts, goal in ((None, 4, {1, 3}, [1, 1]), (4, 10, {0, 2}, [0, 4, 4])):
        pool = SchedulerPool(model, max_batch=16, chunk=4, prefill_rows=4)
        pool.set_width(2, tile)
        with pool.cond:  # no step ends (nor a short sequence) while they are placed
            streams = [pool.submit(prompt, short if i in shorts else long_) for i in range(n)]
        placed = [pool.schedulers.index(s._scheduler) for s in streams]
        assert placed == ([0, 1, 0, 1] if tile is None else [0, 1, 0, 1, 0, 1, 0, 1, 2, 2])
        got: list[list[int]] = [[] for _ in streams]
        readers = [threading.Thread(target=lambda s=s, g=g: g.extend(s), daemon=True) for s, g in zip(streams, got)]
        for r in readers:
            r.start()
        try:
            wait_for(lambda: sorted(m.load() for m in pool.schedulers) == goal)
            wait_for(lambda: all(len(g) >= 4 for i, g in enumerate(got) if i not in shorts))  # steps after the move
        finally:
            for s in streams:
                s.cancel()
            for r in readers:
                r.join(60)
        kept = [g for i, g in enumerate(got) if i not in shorts]
        assert all(4 <= len(g) < len(want) and g == want[:len(g)] for g in kept), [len(g) for g in kept]


def test_sequences_waiting_for_room_never_make_a_group_move_back_and_forth(model, monkeypatch):
    """A sequence running alone on a member, and members holding only sequences that wait for
    room (``max_positions``), after a re-plan narrows the pool: the waiting ones are no group, so
    nothing moves — counted as groups, the running sequence went back and forth between two
    members without a step — and it runs to its solo tokens."""
    moves = []
    move = SchedulerPool._move
    monkeypatch.setattr(SchedulerPool, "_move", staticmethod(lambda *a: (moves.append(a), move(*a))))
    pool = SchedulerPool(model, max_batch=8, chunk=4, prefill_rows=4, max_positions=100)
    pool.set_width(3, 4)
    params, wide = SamplingParams(max_tokens=48), SamplingParams(max_tokens=90)  # 56 positions; 98 each
    with pool.cond:
        first = pool.submit([3] * 8, params)
        waiting = [pool.submit([4] * 8, wide) for _ in range(3)]  # none fits beside it: they wait
        assert [pool.schedulers.index(s._scheduler) for s in (first, *waiting)] == [0, 1, 2, 0]
        pool.set_width(2, 4)
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.extend(first), daemon=True)
    reader.start()
    reader.join(60)
    for s in waiting:
        s.cancel()
    assert not reader.is_alive(), f"no tokens after {len(moves)} moves"
    assert got == alone(model, [3] * 8, params) and moves == []
