"""Continuous batching does not change a sequence's numbers: a row computed in a batch equals the
row computed alone, bit for bit, across segment mixes (decode rows, prefill chunks above and
below SMALL_T, the rows of one block-kernel call) and weight encodings (Q8_0 block kernels, F32);
and the scheduler's tokens for concurrent sequences equal each one's solo run."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.compute.quant import SMALL_T
from swarm.compute.sampling import PREFILL_CHUNK, SamplingParams, generate
from swarm.compute.serving import BatchScheduler, QueueFullError
from tests.compute.tiny_gguf import write_gguf_from_hf

# (prompt length, the step its prefill starts): chunks above SMALL_T, below it, and a single token
PROMPTS = [(SMALL_T + 8, 0), (3, 0), (SMALL_T // 2 + 4, 1), (1, 1), (25, 2)]
DECODE = 4  # decode steps after each prompt


@pytest.fixture(scope="module", params=[("qwen2_moe", "F32"), ("qwen2_moe", "Q8_0"), ("llama", "Q8_0")],
                ids=lambda p: "-".join(p))
def model(request, tiny, tmp_path_factory):
    """Qwen2-MoE (experts, a gated shared expert) and Llama (dense): F32 weights (the float32
    kernel) and Q8_0 (block kernels; the odd-width matrices stay F32)."""
    family, qtype = request.param
    hf, path = tiny(family)
    if qtype != "F32":
        path = write_gguf_from_hf(hf, family, tmp_path_factory.mktemp("gguf") / f"{family}.gguf",
                                  qtype=gguf.GGMLQuantizationType[qtype])
    return load_model(path)


def test_a_row_in_a_batch_equals_it_alone(model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n, _ in PROMPTS]
    follow = [[int(t) for t in rng.integers(0, model.config.vocab_size, DECODE)] for _ in PROMPTS]
    solo = []
    for p, f in zip(prompts, follow):
        cache = model.new_cache()
        solo.append([model.forward(p, cache, last_only=True)[0]]
                    + [model.forward([t], cache, last_only=True)[0] for t in f])
    caches = [model.new_cache() for _ in PROMPTS]
    got: list[list[np.ndarray]] = [[] for _ in PROMPTS]
    for step in range(max(s for _, s in PROMPTS) + DECODE + 1):
        parts = [(i, prompts[i] if step == s else [follow[i][step - s - 1]])
                 for i, (_, s) in enumerate(PROMPTS) if s <= step <= s + DECODE]
        logits = model.forward_batch([(rows, caches[i]) for i, rows in parts])
        assert logits.shape == (len(parts), model.config.vocab_size)
        for (i, _), row in zip(parts, logits):
            got[i].append(row)
    for i in range(len(PROMPTS)):
        for k, (a, b) in enumerate(zip(solo[i], got[i])):
            assert np.array_equal(a, b), (i, k, float(np.abs(a - b).max()))


def test_concurrent_sequences_get_their_solo_tokens(model):
    """Greedy and seeded sampling; prompts cut into chunks of 8 (several steps), joining at once."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (21, 5, 9, 1)]
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=9),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=7), SamplingParams(max_tokens=5)]

    def run(batch):
        s = BatchScheduler(model, max_batch=4, max_queue=0, chunk=8, prefill_rows=16)
        streams = [s.submit(p, q) for p, q in batch]
        return [list(t) for t in streams], s

    solo = [run([pq])[0][0] for pq in zip(prompts, params)]
    together, s = run(list(zip(prompts, params)))
    assert together == solo
    assert [len(t) for t in solo] == [q.max_tokens for q in params]
    assert s.snapshot()["running"] == [] and len(s.left) == 4


def test_the_scheduler_and_generate_cut_a_long_prompt_alike(model):
    """A prompt of two and a half chunks: generate() (the CLI's and the swarm's token loop)
    prefills it in the scheduler's chunks, so the API gives the CLI's tokens."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, model.config.vocab_size, 2 * PREFILL_CHUNK + PREFILL_CHUNK // 2).tolist()
    params = SamplingParams(max_tokens=5)
    rows_per_call = []

    class Recording:  # the real model; records how many rows each forward call runs
        config = model.config

        def new_cache(self):
            return model.new_cache()

        def forward(self, tokens, cache, **kw):
            rows_per_call.append(len(tokens))
            return model.forward(tokens, cache, **kw)

    cli = list(generate(Recording(), prompt, params))
    assert rows_per_call[:3] == [PREFILL_CHUNK, PREFILL_CHUNK, PREFILL_CHUNK // 2]
    scheduler = BatchScheduler(model, max_batch=2, max_queue=0)
    assert list(scheduler.submit(prompt, params)) == cli


def test_beyond_the_queue_a_request_is_refused_and_a_cancelled_one_leaves(model):
    s = BatchScheduler(model, max_batch=1, max_queue=1, chunk=4, prefill_rows=4)
    a = s.submit([1] * 240, SamplingParams(max_tokens=10))  # 60 prefill steps
    b = s.submit([2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError) as refused:
        s.submit([4], SamplingParams(max_tokens=1))
    assert refused.value.retry_after_s >= 1 and "retry later" in str(refused.value)
    b.cancel()  # leaves the queue at once
    assert b.ident not in s.snapshot()["waiting"] and list(b) == []
    while a.ident not in s.snapshot()["prefilling"]:
        time.sleep(0.001)
    a.cancel()  # mid-prefill: leaves at the end of the step in flight
    assert list(a) == []
    c = s.submit([4], SamplingParams(max_tokens=1))  # its slot is free
    assert len(list(c)) == 1
    ident, fed, prompt_len, generated = next(x for x in s.left if x[0] == a.ident)
    assert 0 < fed < prompt_len == 240 and generated == 0
    assert s.snapshot()["running"] == []


def test_fail_all_ends_running_and_waiting_sequences_and_later_ones_run(model):
    """What a coordinator that steps down does to its API's requests: each ends with the error
    given, the one mid-prefill within its step, and the scheduler serves the next as before."""
    s = BatchScheduler(model, max_batch=1, max_queue=1, chunk=4, prefill_rows=4)
    running = s.submit([1] * 240, SamplingParams(max_tokens=10))
    waiting = s.submit([2, 3], SamplingParams(max_tokens=2))
    while running.ident not in s.snapshot()["prefilling"]:
        time.sleep(0.001)
    error = RuntimeError("stepped down")
    assert s.fail_all(error) == 2
    for stream in (running, waiting):
        with pytest.raises(RuntimeError, match="stepped down"):
            list(stream)
        assert list(stream) == []  # ended for good
    assert s.snapshot()["waiting"] == [] and s.fail_all(error) == 0
    params = SamplingParams(max_tokens=3)
    assert list(s.submit([4, 5], params)) == list(generate(model, [4, 5], params))


def test_sequences_wait_until_their_positions_fit_the_reserved_context(smollm2_model):
    """With ``max_positions`` (the KV cache a swarm's memory plan reserves), a sequence whose
    prompt + max_tokens would take the running ones past it waits in the queue until they end,
    then runs to the same tokens as alone; a lone sequence always runs."""
    from swarm.compute import SamplingParams
    from swarm.compute.serving import BatchScheduler

    prompts = [[1, 504, 3], [1, 2025, 9, 11], [1, 77]]
    params = SamplingParams(max_tokens=6)
    alone = [list(BatchScheduler(smollm2_model, max_batch=1).submit(p, params)) for p in prompts]
    # 20 positions: the first two (3+6 and 4+6 = 19) run together, the third (2+6) waits.
    sched = BatchScheduler(smollm2_model, max_batch=4, max_positions=20)
    streams = [sched.submit(p, params) for p in prompts]
    assert [list(s) for s in streams] == alone
    assert sched._fits(type("S", (), {"prompt": [0] * 2, "params": params})())  # nothing runs now: fits
    sched._running = [type("S", (), {"prompt": [0] * 4, "params": params})()] * 2
    assert not sched._fits(type("S", (), {"prompt": [0] * 2, "params": params})())  # 20 + 8 > 20
    sched._running = []
