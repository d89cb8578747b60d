"""A token stream's listener (what the API's event loop uses instead of a thread per request):
one call per listener per step for every stream the step fed, each stream's tokens drained
without blocking equal to its blocking iteration (its solo run), in order, then its end; a
failure comes after the tokens before it; a listener that comes late is told at once."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.compute.sampling import SamplingParams
from swarm.compute.serving import BatchScheduler, TokenStream


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny("qwen2_moe")[1])


class _Recorder:
    """A listener: drains the streams it is told of (on the scheduler's thread), keeps each
    one's tokens and end, and every call's keys."""

    def __init__(self, streams: dict[int, TokenStream]) -> None:
        self.streams, self.calls = streams, []
        self.tokens: dict[int, list[int]] = {k: [] for k in streams}
        self.ends: dict[int, list] = {k: [] for k in streams}
        self.lock = threading.Lock()  # the scheduler's thread and a late listen() may both drain

    def __call__(self, keys: list[int]) -> None:
        with self.lock:
            self.calls.append(list(keys))
            for k in keys:
                items, end = self.streams[k].drain()
                self.tokens[k] += [s.token for s in items]
                if end is not False:
                    self.ends[k].append(end)


def test_a_listener_is_told_once_a_step_and_drains_every_token_in_order(model):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (13, 2, 7, 1)]
    params = [SamplingParams(max_tokens=n) for n in (6, 9, 4, 7)]

    def solo(p, q):
        return list(BatchScheduler(model, max_batch=1, max_queue=0, chunk=8).submit(p, q))

    expected = [solo(p, q) for p, q in zip(prompts, params)]
    s = BatchScheduler(model, max_batch=4, max_queue=0, chunk=8, prefill_rows=32)
    with s._cond:  # no step starts before every stream listens
        streams = {i: s.submit(p, q) for i, (p, q) in enumerate(zip(prompts, params))}
        rec = _Recorder(streams)
        for i, stream in streams.items():
            stream.listen(rec, i)
    deadline = time.monotonic() + 60
    while not all(rec.ends.values()):
        assert time.monotonic() < deadline, f"streams did not end: {rec.ends}"
        time.sleep(0.005)
    assert [rec.tokens[i] for i in range(4)] == expected
    assert all(ends == [True] for ends in rec.ends.values())  # ended once, no error
    # one call per step that fed any stream, naming each fed stream once
    assert len(rec.calls) <= s.steps
    assert all(len(set(keys)) == len(keys) for keys in rec.calls)
    assert max(map(len, rec.calls)) == 4  # one call for the four streams of a decode step
    assert sum(map(len, rec.calls)) == sum(map(len, expected))
    for i in range(4):  # fed in every call that named it: one token each, the end with the last
        assert sum(i in keys for keys in rec.calls) == len(expected[i])


def test_a_late_listener_is_told_at_once_and_drain_keeps_ending(model):
    s = BatchScheduler(model, max_batch=1, max_queue=0)
    stream = s.submit([1, 2, 3], SamplingParams(max_tokens=3))
    expected = list(BatchScheduler(model, max_batch=1, max_queue=0).submit([1, 2, 3], SamplingParams(max_tokens=3)))
    while s.snapshot()["running"]:  # every token queued before anyone listens
        time.sleep(0.005)
    rec = _Recorder({7: stream})
    stream.listen(rec, 7)
    assert rec.calls == [[7]] and rec.tokens[7] == expected and rec.ends[7] == [True]
    assert stream.drain() == ([], True)  # ended for good
    stream.listen(None)
    empty = s.submit([4], SamplingParams(max_tokens=0))  # ends at once
    rec0 = _Recorder({0: empty})
    empty.listen(rec0, 0)
    assert rec0.calls == [[0]] and rec0.tokens[0] == [] and rec0.ends[0] == [True]


def test_a_failure_is_drained_after_the_tokens_before_it(model):
    reached, release = threading.Event(), threading.Event()

    def ffn():  # the step thread asks for its backend first thing in a step: the third one waits
        if s.steps >= 2:  # until the failure is in, so no step can slip between the check and it
            reached.set()
            release.wait(30)
        return None

    s = BatchScheduler(model, ffn, max_batch=2, max_queue=1, chunk=4, prefill_rows=4)
    decoding = s.submit([5, 6], SamplingParams(max_tokens=200))
    long = s.submit([1] * 240, SamplingParams(max_tokens=10))  # 60 prefill steps
    waiting = s.submit([2, 3], SamplingParams(max_tokens=2))
    # Two steps done: the first gave `decoding` its first token (`long` was admitted before any step, so
    # its being in "prefilling" alone does not say a token came); `long` has 58 prefill steps left.
    try:
        assert reached.wait(30)
        assert s.snapshot()["steps"] == 2 and long.ident in s.snapshot()["prefilling"]
        rec = _Recorder({0: decoding, 1: long, 2: waiting})
        for k, stream in rec.streams.items():
            stream.listen(rec, k)
        error = RuntimeError("stepped down")
        assert s.fail_all(error) == 3
    finally:
        release.set()
    with rec.lock:
        assert [rec.ends[k] for k in range(3)] == [[error]] * 3  # the error once, after the tokens
        assert rec.tokens[1] == rec.tokens[2] == [] and 0 < len(rec.tokens[0]) < 200
    solo = list(BatchScheduler(model, max_batch=1, max_queue=0).submit(
        [5, 6], SamplingParams(max_tokens=len(rec.tokens[0]))))
    assert rec.tokens[0] == solo
    assert decoding.drain() == ([], True)
