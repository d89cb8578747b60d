"""Prefix reuse (``swarm/compute/prefix.py`` through the batch scheduler): a prompt that starts
with an earlier sequence's tokens continues from its kept KV cache, prefills only the rest, and
gets the tokens and logprobs of a run without reuse; kept caches live only in positions the
running sequences do not claim.

Oracles: a scheduler with reuse off (the same tokens and logprob bits), a whole-prompt forward
(the same KV cache bits after a reused prefix and a chunked rest).
"""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.compute.prefix import PrefixStore
from swarm.compute.sampling import SamplingParams
from swarm.compute.serving import BatchScheduler

PARAMS = SamplingParams(max_tokens=5, logprobs=3)
FIRST = [(7 * i + 3) % 90 + 1 for i in range(37)]  # 37: a reused prefix that ends inside a chunk


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny("qwen2_moe")[1])


def run(scheduler, prompt, params=PARAMS):
    stream = scheduler.submit(prompt, params)
    got = [(s.token, s.logprob, s.top) for s in stream.sampled()]
    return got, stream.reused


def test_a_second_turn_prefills_only_its_new_tokens_and_gets_the_same_tokens(model):
    reuse = BatchScheduler(model, chunk=8, prefill_rows=16)
    fresh = BatchScheduler(model, chunk=8, prefill_rows=16, prefix_reuse=False)
    first, reused = run(reuse, FIRST)
    assert reused == 0 and reuse.prompt_tokens_prefilled == len(FIRST)
    assert first == run(fresh, FIRST)[0]
    second = FIRST + [t for t, _, _ in first] + [11, 12, 13]
    before = reuse.prompt_tokens_prefilled
    got, reused = run(reuse, second)
    # the cache held the prompt and every generated token but the last (sampled, never fed)
    assert reused == len(FIRST) + len(first) - 1
    assert reuse.prompt_tokens_prefilled - before == len(second) - reused == 4
    assert got == run(fresh, second)[0]  # tokens and logprobs, bit for bit
    assert fresh.prompt_tokens_prefilled == len(FIRST) + len(second) and len(fresh.prefixes) == 0
    # a prompt sharing less than half of the kept conversation leaves it for its next turn
    kept = reuse.prefixes.positions()
    assert run(reuse, FIRST[:5] + [9, 9])[1] == 0 and reuse.prefixes.positions() >= kept


def test_a_reused_cache_holds_the_bits_of_a_whole_prefill(model):
    """Batch invariance, which reuse relies on: a cache cut back to a prefix and fed the rest in
    chunks holds the keys/values one forward over the whole prompt writes."""
    prompt = FIRST + [5, 6, 7, 8, 9, 10]
    whole = model.new_cache()
    want = model.forward(prompt, whole, last_only=True)
    store = PrefixStore()
    cache = model.new_cache(capacity=16)
    model.forward(FIRST + [94, 93], cache)  # an earlier sequence that diverged after FIRST
    store.keep(FIRST + [94, 93], cache, None, None)
    got_cache, n = store.take(prompt, None)
    assert got_cache is cache and n == len(FIRST) and cache.length == n
    for a in range(n, len(prompt), 4):
        got = model.forward(prompt[a:a + 4], cache, last_only=True)
    assert np.array_equal(got, want)
    for layer in range(model.config.n_layers):
        assert np.array_equal(cache.k[layer][:, :len(prompt)], whole.k[layer][:, :len(prompt)])
        assert np.array_equal(cache.v[layer][:, :len(prompt)], whole.v[layer][:, :len(prompt)])


def test_kept_caches_are_evicted_least_recently_used_when_a_request_needs_their_room(model):
    params = SamplingParams(max_tokens=4)
    sched = BatchScheduler(model, chunk=8, prefill_rows=16, max_positions=64)
    a, b = [1, 2, 3] * 6, [4, 5, 6] * 6  # 18 tokens each: kept, 21 positions each
    out_a = [t for t, _, _ in run(sched, a, params)[0]]
    run(sched, b, params)
    assert sched.prefixes.positions() == 2 * (18 + 3) and sched.prefixes.evicted == 0
    # a request claiming 30 positions leaves 34 beside it: the least recently used (a) goes
    run(sched, [9] * 26, params)
    assert sched.prefixes.evicted >= 1
    assert run(sched, a + out_a + [7], params)[1] == 0  # a's cache is gone: a full prefill
    # a request claiming the whole context is admitted at once, every kept cache evicted
    held, evicted = len(sched.prefixes), sched.prefixes.evicted
    assert held >= 1
    got, reused = run(sched, [8] * 60, params)
    assert reused == 0 and len(got) == 4 and sched.prefixes.evicted == evicted + held
    fresh = BatchScheduler(model, chunk=8, prefill_rows=16, prefix_reuse=False)
    assert got == run(fresh, [8] * 60, params)[0]


def test_a_cache_is_reused_under_the_backend_that_filled_it_only(model):
    store = PrefixStore()
    cache = model.new_cache(capacity=16)
    model.forward(FIRST, cache)
    stages = object()  # a layer backend holding part of the keys/values elsewhere
    store.keep(FIRST, cache, stages, None)
    assert store.take(FIRST + [1], stages) == (cache, len(FIRST))
    store.keep(FIRST, cache, stages, None)
    assert store.take(FIRST + [1], None) == (None, 0)  # the keys/values here are not all of them
    assert len(store) == 0 and store.evicted == 1  # its backend was replaced: dropped
