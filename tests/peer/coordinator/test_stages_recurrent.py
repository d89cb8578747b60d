"""Stages of a model whose linear-attention layers keep a recurrent state per sequence (tiny
random Qwen3.5-MoE: Gated DeltaNet layers 0 and 2, gated full attention layer 1): the state
moves with the stage as KV rows do, a stage lost mid-generation has its state rebuilt on the
coordinator from the rows that had entered it, a stage peer that lost it is sent the sequence
again, and a re-sent step is served from the state before it; expert ranges on workers as for
any MoE. The oracle is the local engine, each sequence alone; in process (StageRunners on other
threads) and over a real link."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.peer.net import messages as m
from swarm.peer.plan import Stage, StageLayout
from swarm.peer.worker.stages import StageRunner
from tests.compute.tiny_qwen3_5_moe import build
from tests.peer._swarm_models import COORD, PROMPT, W1, W2, greedy
from tests.peer.coordinator.test_stages import greedy_alone, staged
from tests.peer.coordinator.test_stages_failover import greedy_batch

DECODE = 5
PROMPTS = [PROMPT, [9, 2, 77, 5, 31, 60, 12]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build(tmp_path_factory.mktemp("qwen3_5_moe"))[1]


@pytest.fixture(scope="module")
def reference(model_dir):
    model = load_model(model_dir)
    return [greedy_alone(model, p, DECODE) for p in PROMPTS]


def assert_solo(reference, tokens, logits):
    for i, (want_tokens, want_logits) in enumerate(reference):
        assert tokens[i] == want_tokens, i
        assert all(np.array_equal(a, b) for a, b in zip(logits[i], want_logits, strict=True)), i


@pytest.mark.parametrize("stages", [(Stage(W1, 0, 2), Stage(W2, 2, 3)), (Stage(COORD, 0, 1), Stage(W1, 1, 3))],
                         ids=["two-remote-stages", "coordinator-first"])
@pytest.mark.parametrize("fail_at", [None, 0, 3], ids=["no-failure", "lost-at-prefill", "lost-at-decode-3"])
def test_states_move_with_stages_and_are_rebuilt_on_failover(model_dir, reference, stages, fail_at):
    model, ffn, hand, _ = staged(model_dir, stages)

    def on_step(step):
        if step == fail_at:
            hand.join()
            hand.down.add(W1)  # W1's layers, states included, move to the coordinator

    tokens, logits = greedy_batch(model, ffn, PROMPTS, DECODE, on_step)
    hand.join()
    assert_solo(reference, tokens, logits)
    if fail_at is not None:
        assert ffn.rebuilt_positions >= (fail_at > 0) * sum(len(p) for p in PROMPTS)


def test_a_stage_peer_that_lost_its_states_is_sent_the_sequences_again(model_dir, reference):
    model, ffn, hand, runners = staged(model_dir, (Stage(W1, 0, 2), Stage(COORD, 2, 3)))

    def on_step(step):
        if step == 2:
            hand.join()
            assert runners[W1].forget() == len(PROMPTS)  # as a restart does

    tokens, logits = greedy_batch(model, ffn, PROMPTS, DECODE, on_step)
    hand.join()
    assert_solo(reference, tokens, logits)


def test_a_resent_step_is_served_and_an_earlier_start_is_a_cache_gap(model_dir):
    """A step sent again (its answer was late) runs from the state before it: the same bits; rows
    from any earlier position but 0 are refused with ``cache_gap`` (the coordinator then resends
    the sequence from position 0)."""
    model = load_model(model_dir)
    runner = StageRunner(W1, load_model(model_dir))
    runner.accept(StageLayout(1, 1, COORD, (Stage(W1, 0, 3),)))
    x = model.embed.take(np.array(PROMPT))

    def request(rid, start, rows):
        return m.StageRequest(rid, 1, 1, (m.StageSegment(7, start, rows.shape[0]),), 0, 3, rows)

    runner.handle(request(1, 0, x[:6]))
    first = runner.handle(request(2, 6, x[6:8]))
    again = runner.handle(request(3, 6, x[6:8]))
    assert isinstance(again, m.StageAnswer)
    np.testing.assert_array_equal(again.x, first.x)
    refused = runner.handle(request(4, 3, x[3:8]))
    assert isinstance(refused, m.Error) and refused.code == "cache_gap"
    assert "recurrent state cannot run on from position 3" in refused.message
    whole = runner.handle(request(5, 0, x))
    np.testing.assert_array_equal(whole.x[6:8], first.x)


@pytest.mark.parametrize("resend", [0, 1, 2], ids=["in-order", "last-step-sent-again", "two-steps-sent-again"])
def test_verify_checks_recurrent_stages_on_shadow_states(model_dir, reference, resend):
    """``--verify 100``: every stage answer re-run here on a shadow state per sequence, the answers
    found right; the last step sent again runs from the states before it (peer and shadow), two
    steps back are a cache_gap and the sequence is sent from position 0."""
    import random

    from swarm.peer.coordinator.stages import StagedFFN

    model, _, hand, _ = staged(model_dir, (Stage(W1, 0, 2), Stage(COORD, 2, 3)))
    ffn = hand.ffn = StagedFFN(model, StageLayout(1, 1, COORD, (Stage(W1, 0, 2), Stage(COORD, 2, 3))), hand,
                               verify=1.0, rng=random.Random(0))

    def on_step(step):
        if resend and step == 3:  # as after missed deadlines: the stage gets the last steps' rows again
            hand.join()
            for seq in list(ffn._sequences.values()):
                key = next(iter(seq.remote))
                seq.remote[key] -= resend

    firsts, send = [], hand.send  # every segment's first position, as sent

    def recording(peer, req):
        if isinstance(req, m.StageRequest):
            firsts.extend(s.start for s in req.segments)
        send(peer, req)

    hand.send = recording
    tokens, logits = greedy_batch(model, ffn, PROMPTS, DECODE, on_step)
    hand.join()
    assert_solo(reference, tokens, logits)
    assert not hand.failed
    step3 = [len(p) + 2 for p in PROMPTS]  # the positions step 3 starts at
    assert all(n - resend in firsts for n in step3)
    assert firsts.count(0) == len(PROMPTS) * (2 if resend == 2 else 1)  # a cache_gap: sent from 0 again


def test_expert_ranges_on_two_workers_give_the_local_bits(model_dir):
    """Per-layer ranges: the routed experts of every layer on two workers, the linear layers'
    states and the gated shared expert on the coordinator."""
    from tests.peer.coordinator.test_coordinator import InProcSwarm, assert_same, local_reference

    swarm = InProcSwarm(model_dir, 2)
    try:
        assert_same(greedy(swarm.model, swarm.ffn), local_reference(swarm))
        assert not swarm.failed and swarm.ffn.local_fallbacks == 0
        assert all(worker.served > 0 for worker in swarm.workers.values())
    finally:
        swarm.close()


@pytest.mark.slow
def test_a_stage_plan_over_a_real_link_gives_the_local_bits_and_survives_its_peer(model_dir, tmp_path):
    """Two peers over real aiortc links: the worker's stage holds a linear-attention layer's state;
    it leaves at token 5, its layers and their state move to the coordinator: the same tokens and
    logits bits as the local run."""
    from tests.peer.coordinator.test_stages_loopback import run_stage_swarm

    run, layout, served, rebuilt, failed, _ = run_stage_swarm(tmp_path, model_dir, PROMPT, 10, kill_at=5)
    assert [(s.start, s.stop) for s in layout.stages] == [(0, 2), (2, 3)]
    ref = greedy(load_model(model_dir), None, PROMPT, 10)
    assert run[0] == ref[0]
    assert all(np.array_equal(a, b) for a, b in zip(run[1], ref[1], strict=True))
    assert failed == {layout.stages[1].peer} and served >= 5 and rebuilt >= len(PROMPT) + 5
