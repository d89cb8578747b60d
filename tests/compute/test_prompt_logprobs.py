"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the batch scheduler scores each prompt
token under the logits of the row before it, chunk after chunk, beside other sequences.

Oracle: one forward over the whole prompt and a float64 log-softmax of its logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.compute.sampling import SamplingParams
from swarm.compute.serving import BatchScheduler

PROMPT = [(5 * i + 2) % 90 + 1 for i in range(21)]  # three chunks of 8, the last one short


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny("qwen2")[1])


def test_each_prompt_token_is_scored_by_the_row_before_it(model):
    sched = BatchScheduler(model, chunk=8, prefill_rows=16)
    beside = sched.submit([3, 4, 5] * 5, SamplingParams(max_tokens=3))  # another sequence shares the steps
    params = SamplingParams(max_tokens=2, logprobs=3, prompt_logprobs=True)
    stream = sched.submit(PROMPT, params)
    generated = list(stream.sampled())
    list(beside)
    got = stream.prompt_sampled
    logits = model.forward(PROMPT, model.new_cache()).astype(np.float64)  # [T, V]
    z = logits - logits.max(axis=1, keepdims=True)
    want = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    assert [s.token for s in got] == PROMPT and got[0].logprob is None and got[0].top == ()
    for i in range(1, len(PROMPT)):
        assert got[i].logprob == pytest.approx(want[i - 1, PROMPT[i]], abs=1e-5)
        assert [t for t, _ in got[i].top] == list(np.argsort(-want[i - 1], kind="stable")[:3])
    # the generated tokens are those of a run without prompt logprobs
    plain = BatchScheduler(model, chunk=8, prefill_rows=16).submit(PROMPT, SamplingParams(max_tokens=2, logprobs=3))
    assert generated == list(plain.sampled())


def test_prompt_logprobs_need_logprobs():
    with pytest.raises(ValueError, match="prompt_logprobs needs logprobs"):
        SamplingParams(prompt_logprobs=True)
