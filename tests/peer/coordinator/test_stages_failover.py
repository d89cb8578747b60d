"""A stage failing over to the coordinator at any prompt length and batch: the coordinator's KV
cache for the moved layers is rebuilt from the rows that had entered them, whatever its capacity
(the engine's serving loop starts caches at 16 positions, and a coordinator that runs no layer of
its own never grows them), and the run goes on with the local run's bits.

In process (StageRunners answering on other threads, see tests/peer/coordinator/test_stages.py); the oracle is
the local engine, one sequence alone."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.peer.plan import Stage
from tests.peer._swarm_models import COORD, W1, W2, build
from tests.peer.coordinator.test_stages import greedy_alone, staged

MOE = "qwen3_moe"
SERVING_CAPACITY = 16  # what swarm/compute/serving.py gives each new sequence's cache
DECODE = 5


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * salt) % 96 for i in range(length)]  # token ids < 96, the tiny models' vocabulary


def greedy_batch(model, ffn, prompts, n, on_step):
    """All sequences prefill in one ``forward_batch`` step, then take ``n`` greedy decode steps
    together, each on a cache of the serving loop's first capacity; (tokens, logits) per sequence."""
    caches = [model.new_cache(capacity=SERVING_CAPACITY) for _ in prompts]
    feed = [list(p) for p in prompts]
    tokens, logits = [[] for _ in prompts], [[] for _ in prompts]
    for step in range(n + 1):
        on_step(step)
        for i, row in enumerate(model.forward_batch(list(zip(feed, caches)), ffn=ffn)):
            logits[i].append(row)
            tokens[i].append(int(np.argmax(row)))
            feed[i] = [tokens[i][-1]]
    return tokens, logits


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build(MOE, tmp_path_factory.mktemp("failover"))


@pytest.fixture(scope="module")
def reference(moe_dir):
    model, memo = load_model(moe_dir), {}

    def ref(prompt):
        key = tuple(prompt)
        if key not in memo:
            memo[key] = greedy_alone(model, prompt, DECODE)
        return memo[key]
    return ref


@pytest.mark.parametrize("stages", [(Stage(W1, 0, 3),), (Stage(W1, 0, 2), Stage(W2, 2, 3))],
                         ids=["one-remote-stage", "two-remote-stages"])
@pytest.mark.parametrize("fail_at", [0, 3], ids=["at-prefill", "at-decode-3"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 37, 100])
def test_a_stage_fails_over_at_any_prompt_length_and_batch_with_the_local_bits(moe_dir, reference, stages,
                                                                               fail_at, batch, length):
    model, ffn, hand, runners = staged(moe_dir, stages)
    prompts = [prompt_of(length, salt) for salt in range(batch)]

    def on_step(step):
        if step == fail_at:
            hand.join()
            hand.down.add(W1)  # the first stage's peer is gone: its layers move to the coordinator

    tokens, logits = greedy_batch(model, ffn, prompts, DECODE, on_step)
    hand.join()
    for i, prompt in enumerate(prompts):
        want_tokens, want_logits = reference(prompt)
        assert tokens[i] == want_tokens
        assert all(np.array_equal(a, b) for a, b in zip(logits[i], want_logits, strict=True)), (i, length)
    assert ffn.failed == {W1} and [p for p, _ in hand.failed] == [W1]
    # the moved layers' keys and values were rebuilt from every position that had entered them
    assert ffn.rebuilt_positions == batch * (length + fail_at - 1 if fail_at else 0)
