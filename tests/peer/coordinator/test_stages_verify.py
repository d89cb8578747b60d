"""``--verify`` on stage answers: the coordinator re-runs a sampled share of each answer's rows
through the stage's layers (stage_verify.py) and stops trusting a peer whose rows differ.

In process (StageRunners answering on other threads, see tests/peer/coordinator/test_stages.py).
The oracle is the local engine: an honest peer checked at every row is never flagged, with
batching, prefill and pipelining, and the run keeps the local bits; a lying peer — every number
one ulp off, or another layer's output — is caught at its first wrong answer at 100 % and within
a bounded number of them at 10 %, marked down once with the VerificationError's text naming it
and its layers, never readmitted, and every step from the caught one on has the bits the local
engine gives the same tokens. What checking cost is counted."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.peer.coordinator.handoff import LoopDispatcher
from swarm.peer.coordinator.planner import PeerCapacity, build_plan
from swarm.peer.coordinator.stage_verify import VERIFY_FAILED
from swarm.peer.coordinator.stages import StagedFFN
from swarm.peer.coordinator.tracker import RequestTracker, VerifyCost
from swarm.peer.net import messages as m
from swarm.peer.plan import Stage, StageLayout
from swarm.peer.weights.sizes import model_shape
from swarm.peer.worker.stages import StageRunner
from tests.peer._swarm_models import COORD, PROMPT, W1, W2, build, greedy
from tests.peer.coordinator.test_stages import PROMPTS, Hand, greedy_alone, greedy_together

MOE = "qwen3_moe"  # MoE layers 0 and 2, dense layer 1
TWO = (Stage(COORD, 0, 1), Stage(W1, 1, 3))
THREE = (Stage(COORD, 0, 1), Stage(W1, 1, 2), Stage(W2, 2, 3))
LOW = 0.1  # the low share: a decode answer (one row) is checked with this probability
HONEST_FIRST = 2  # answers a liar gives right before it turns (the prefill and a decode step)
CAUGHT_WITHIN = 44  # lying answers before one is checked, at LOW: 0.9^44 < 1 % (seeded: the same draws every run)
DECODE = 60


class Liar(StageRunner):
    """A stage peer that answers every request in time and well-formed, with wrong numbers:
    ``"ulp"``: each one one ulp up; ``"other-layer"``: the rows through another layer (the one
    before its stage, or after it for a stage at layer 0), with KV caches of its own for it;
    ``"noise"``: each one times 1 + ``noise`` (an honest peer of another numeric build). Its
    answers before its ``honest_first`` + 1st are right (a peer that turns once trusted)."""

    def __init__(self, peer_id: str, model, how: str) -> None:
        super().__init__(peer_id, model)
        self.how, self.noise, self.honest_first = how, 0.0, 0
        self._other: dict[int, object] = {}  # sequence → the KV cache of the other layer

    def handle(self, msg: m.StageRequest) -> m.StageAnswer | m.Error:
        ans = super().handle(msg)
        if not isinstance(ans, m.StageAnswer):
            return ans
        if self.how == "ulp":
            x = np.nextafter(ans.x, np.float32(np.inf))
        elif self.how == "noise":
            x = (ans.x * np.float32(1 + self.noise)).astype(np.float32)
        else:
            other = msg.layer_start - 1 if msg.layer_start else msg.layer_stop
            outs, at = [], 0
            for s in msg.segments:
                cache = self._other.get(s.sequence) if s.start else None
                if cache is None:
                    cache = self._other[s.sequence] = self.model.new_cache()
                cache.length = s.start
                outs.append(self.model.layers(msg.x[at:at + s.rows], cache, s.start, other, other + 1))
                cache.length = s.start + s.rows
                at += s.rows
            x = np.concatenate(outs)  # computed from the start: its other layer's cache is whole
        return ans if self.served <= self.honest_first else dataclasses.replace(ans, x=x)


def verified(path, stages, share, liars=None, seed=0):
    """A StagedFFN checking ``share`` of the rows, its Hand and runners (``liars``: peer → how)."""
    layout = StageLayout(1, 1, COORD, stages)
    liars = liars or {}
    runners = {p: Liar(p, load_model(path), liars[p]) if p in liars else StageRunner(p, load_model(path))
               for p in layout.workers()}
    for r in runners.values():
        r.accept(layout)
    hand = Hand(runners)
    model = load_model(path)
    hand.ffn = StagedFFN(model, layout, hand, verify=share, rng=random.Random(seed))
    return model, hand.ffn, hand, runners


def assert_solo(path, prompts, n, run):
    """Each sequence of ``run`` (greedy_together's tokens and logits) has its solo local bits."""
    ref = load_model(path)
    for i, prompt in enumerate(prompts):
        want = greedy_alone(ref, prompt, n)
        assert run[0][i] == want[0], i
        assert all(np.array_equal(a, b) for a, b in zip(run[1][i], want[1], strict=True)), i


def forced(model, prompt, tokens):
    """The local engine's logits for ``prompt`` then each of ``tokens`` in turn (greedy's steps)."""
    cache = model.new_cache()
    logits = [model.forward(prompt, cache)]
    for t in tokens:
        logits.append(model.forward([t], cache))
    return logits


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build(MOE, tmp_path_factory.mktemp("verify"))


@pytest.mark.parametrize("groups", [1, None], ids=["one-group", "pipelined"])
def test_an_honest_stage_peer_checked_at_every_row_is_never_flagged_and_every_row_is_counted(moe_dir, groups):
    model, ffn, hand, runners = verified(moe_dir, THREE, 1.0)
    ffn.pipeline_groups = groups
    run = greedy_together(model, ffn, PROMPTS, 12)  # prefills beside decode rows
    hand.join()
    assert_solo(moe_dir, PROMPTS, 12, run)
    assert not ffn.failed and not hand.failed
    seen = ffn.tracker.observations()
    assert not seen.distrusted
    v = seen.verify
    rows = 2 * (sum(len(p) for p in PROMPTS) + 12 * len(PROMPTS))  # every row crosses both remote stages
    # at 100 % every row is checked, and each position is run here once per stage: the cost of the stage
    assert v.rows_answered == v.rows_checked == v.rows_computed == rows
    assert v.answers == ffn.remote_steps and v.seconds > 0


def test_an_honest_stage_peer_at_a_low_share_over_many_steps_costs_a_share_of_its_rows(moe_dir):
    model, ffn, hand, runners = verified(moe_dir, THREE, 0.2, seed=3)
    prompts = PROMPTS + [[(5 * i + 1) % 96 for i in range(40)]]
    tokens, logits = greedy_together(model, ffn, prompts, 30)
    hand.join()
    ref = load_model(moe_dir)
    for i, prompt in enumerate(prompts):
        assert tokens[i] == greedy_alone(ref, prompt, 30)[0]
    assert not ffn.failed and not hand.failed
    v = ffn.tracker.observations().verify
    # some answers checked, not all; no position run twice (rows computed ≤ rows answered)
    assert 0 < v.answers < ffn.remote_steps
    assert 0 < v.rows_checked <= v.rows_computed <= v.rows_answered


def test_a_re_run_suffix_is_checked_against_the_shadow_cut_back_to_it(moe_dir):
    model, ffn, hand, _ = verified(moe_dir, TWO, 1.0)
    cache = model.new_cache()
    model.forward(PROMPT, cache, ffn=ffn)
    cache.truncate(4)
    got = model.forward(PROMPT[4:] + [9], cache, ffn=ffn)
    hand.join()
    ref = load_model(moe_dir)
    ref_cache = ref.new_cache()
    ref.forward(PROMPT, ref_cache)
    ref_cache.truncate(4)
    assert np.array_equal(got, ref.forward(PROMPT[4:] + [9], ref_cache))
    assert not ffn.failed and ffn.tracker.observations().verify.rows_checked == len(PROMPT) + len(PROMPT) - 4 + 1


@pytest.mark.parametrize("how", ["ulp", "other-layer"])
@pytest.mark.parametrize("share", [1.0, LOW], ids=["verify-100", "verify-10"])
def test_a_lying_stage_peer_is_caught_marked_down_once_and_the_run_goes_on_with_the_local_bits(moe_dir, how, share):
    model, ffn, hand, runners = verified(moe_dir, TWO, share, liars={W1: how}, seed=1)
    runners[W1].honest_first = HONEST_FIRST
    tokens, logits = greedy(model, ffn, PROMPT, DECODE)
    hand.join()
    answers = runners[W1].served  # the last one was caught and discarded: it is asked nothing more
    lies = answers - HONEST_FIRST
    assert lies == 1 if share == 1.0 else 1 <= lies <= CAUGHT_WITHIN
    assert ffn.failed == {W1} and len(hand.failed) == 1
    peer, reason = hand.failed[0]
    assert peer == W1 and reason.startswith(f"{VERIFY_FAILED}: peer {W1} answered layers 1:3")
    assert ffn.tracker.observations().distrusted[W1] in reason
    # From the caught step on, every step ran here: the local engine's bits for the same tokens
    # (at 100 %, the whole run: the first answer was the caught one).
    want = forced(load_model(moe_dir), PROMPT, tokens)
    caught = answers - 1
    assert all(np.array_equal(a, b) for a, b in zip(logits[caught:], want[caught:], strict=True))
    if share == 1.0:
        assert tokens == greedy(load_model(moe_dir), None, PROMPT, DECODE)[0]
    # A new layout that has it again: it stays out, and the owner is told again.
    ffn.set_layout(StageLayout(1, 2, COORD, TWO))
    assert ffn.failed == {W1} and [p for p, _ in hand.failed] == [W1, W1]


@pytest.mark.parametrize("groups", [1, None], ids=["one-group", "pipelined"])
def test_a_lying_stage_peer_among_batched_sequences_is_caught_at_once_and_no_sequence_changes(moe_dir, groups):
    model, ffn, hand, runners = verified(moe_dir, THREE, 1.0, liars={W2: "other-layer"})
    ffn.pipeline_groups = groups
    run = greedy_together(model, ffn, PROMPTS, 8)
    hand.join()
    assert_solo(moe_dir, PROMPTS, 8, run)
    assert ffn.failed == {W2} and [p for p, _ in hand.failed] == [W2] and runners[W2].served == 1
    assert runners[W1].served >= 8 + len(PROMPTS)  # the honest peer kept its stage (a request per step or group)


def test_a_peer_of_another_build_is_held_to_a_bound_not_to_bits(moe_dir):
    # Within float32 reassociation's size: bits differ, the bound holds — not flagged.
    model, ffn, hand, runners = verified(moe_dir, TWO, 1.0, liars={W1: "noise"})
    runners[W1].noise = 1e-6
    ffn.set_approximate({W1})
    assert greedy(model, ffn, PROMPT, 8)[0] == greedy(load_model(moe_dir), None, PROMPT, 8)[0]
    hand.join()
    assert not ffn.failed and ffn.tracker.observations().verify.rows_checked == len(PROMPT) + 8
    # The same answers from a peer of our build: caught, bits are the rule.
    model, ffn, hand, _ = verified(moe_dir, TWO, 1.0, liars={W1: "noise"})
    hand.runners[W1].noise = 1e-6
    greedy(model, ffn, PROMPT, 2)
    hand.join()
    assert ffn.failed == {W1}
    # Another layer's output is far outside the bound.
    model, ffn, hand, _ = verified(moe_dir, TWO, 1.0, liars={W1: "other-layer"})
    ffn.set_approximate({W1})
    greedy(model, ffn, PROMPT, 2)
    hand.join()
    assert ffn.failed == {W1}


def test_without_verify_no_row_is_checked_and_no_shadow_kept(moe_dir):
    model, ffn, hand, _ = verified(moe_dir, TWO, 0.0, liars={W1: "ulp"})
    cache = model.new_cache()
    model.forward(PROMPT, cache, ffn=ffn)
    hand.join()
    assert not ffn.failed and not hand.failed and ffn.tracker.observations().verify == VerifyCost()


def test_status_shows_what_checking_cost_and_whom_it_caught(moe_dir):
    model, ffn, hand, _ = verified(moe_dir, TWO, 1.0, liars={W1: "ulp"})
    greedy(model, ffn, PROMPT, 2)
    hand.join()
    owner = LoopDispatcher()
    # the per-layer plan of a stage layout: the coordinator alone, every layer its own
    plan = build_plan(model_shape(model), PeerCapacity(COORD, 0, 1.0), [], term=1, version=1, layers=[0])
    owner.ffn = SimpleNamespace(plan=plan, tracker=RequestTracker())
    owner.shape, owner.stages = model_shape(model), ffn
    status = owner.observed()
    assert list(status["peers"]) == [COORD, W1] and status["peers"][W1]["requests"] > 0  # the stage worker too
    seen = status["stage_verify"]
    assert seen["rows_checked"] == seen["rows_computed"] == len(PROMPT) and seen["seconds"] > 0
    assert list(seen["distrusted"]) == [W1] and "layers 1:3" in seen["distrusted"][W1]


def test_a_verification_failure_is_an_event_of_its_own_in_status():
    class Node:
        links: dict = {}

        def __init__(self):
            self.events = []

        def record(self, *event):
            self.events.append(event)

    class Owner(LoopDispatcher):
        def __init__(self, loop):
            self.node, self._loop, self.downs = Node(), loop, []

        def mark_down(self, peer):
            self.downs.append(peer)

    loop = asyncio.new_event_loop()
    try:
        owner = Owner(loop)
        why = f"{VERIFY_FAILED}: peer {W1} answered layers 1:3 (layer 1 to 2) of sequence 1 at position 4 ..."
        owner.peer_failed(W1, why)
        owner.peer_failed(W2, "no link")  # any other failure: the mark-down alone
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    assert owner.node.events == [(VERIFY_FAILED, W1, "", why)] and owner.downs == [W1, W2]
