"""The API over stages on other peers: one batch scheduler per stage, sharing the stages, so one
scheduler's step is at one stage peer while the other's is at the next. In process: two
StageRunners answer on other threads (tests/peer/coordinator/test_stages.py's Hand), each request
stamped when sent and when answered (test_stages_pipeline.py's Stamped).

The oracle is the local engine serving each request alone: every reply is that text. The
schedulers' steps overlap at the two stage peers; the limits (``max_batch``, ``max_queue``) hold
over both schedulers together; one user gets one scheduler."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest

from swarm.compute.model import load_model
from swarm.compute.tokenizer import tokenizer_for
from swarm.peer.coordinator.api_engine import EngineBackend, schedulers_for
from swarm.peer.net import messages as m
from swarm.peer.plan import Stage
from tests.peer._swarm_models import COORD, W1, W2, add_char_tokenizer, build
from tests.peer.coordinator.test_api_batching import HEADERS, _ask, _serve, _until
from tests.peer.coordinator.test_stages import staged
from tests.peer.coordinator.test_stages_pipeline import TWO_WORKERS, Stamped

MOE = "qwen3_moe"
PROMPTS = ["hello swarm", "tell me about a fox", "abc", "what is 2+2? " * 3, "stages", "one more"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_char_tokenizer(build(MOE, tmp_path_factory.mktemp("api-stages")))


@pytest.fixture(scope="module")
def solo(model_dir):
    """Each prompt's reply from the local engine, served alone."""
    async def run():
        model = load_model(model_dir)
        api, url = await _serve(EngineBackend(model, tokenizer_for(model), model_id="m"))
        try:
            async with aiohttp.ClientSession() as s:
                return {p: await _ask(s, url, p, stream=False) for p in PROMPTS}
        finally:
            await api.close()
    return asyncio.run(run())


def staged_backend(model_dir, **limits):
    model, ffn, hand, runners = staged(model_dir, TWO_WORKERS)
    return EngineBackend(model, tokenizer_for(model), model_id="m", ffn=ffn, **limits), ffn, hand


async def test_concurrent_requests_over_two_stage_peers_get_their_solo_text_with_the_schedulers_overlapping(
        model_dir, solo):
    backend, ffn, hand = staged_backend(model_dir, max_batch=8)
    assert ffn.schedulers == 2  # told by the backend: its steps are cut into no groups
    stamped = Stamped(hand)
    pool = backend.scheduler
    assert pool.width == 2 == len(pool.schedulers)
    api, url = await _serve(backend)
    try:
        async with aiohttp.ClientSession() as s:
            together = await asyncio.gather(*[_ask(s, url, p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)])
    finally:
        await api.close()
    hand.join()
    assert together == [solo[p] for p in PROMPTS] and all(together)
    assert all(sched.steps > 0 for sched in pool.schedulers)  # both served some of them
    assert stamped.overlaps(W1, W2)  # one scheduler's step at the second stage peer while the other's at the first
    # any overlap came from the two schedulers: no step was cut into groups
    assert not ffn.failed and ffn.pipelined_steps == 0, (ffn.failed, ffn.pipelined_steps)


class Gate:
    """Holds every stage request's answer until :meth:`open` (the stage peers busy meanwhile)."""

    def __init__(self, hand):
        self.hand, self.send, self.event = hand, hand.send, threading.Event()
        hand.send = self.held

    def held(self, peer, req):
        if not isinstance(req, m.StageRequest):
            return self.send(peer, req)
        runner, ffn = self.hand.runners[peer], self.hand.ffn

        def answer():
            self.event.wait(60)
            ffn.deliver(peer, runner.handle(req))

        t = threading.Thread(target=answer)
        self.hand.threads.append(t)
        t.start()

    def open(self):
        self.event.set()


async def test_the_limits_hold_over_both_schedulers_together(model_dir, solo):
    backend, ffn, hand = staged_backend(model_dir, max_batch=2, max_queue=1)
    gate = Gate(hand)
    pool = backend.scheduler
    assert backend.concurrency == 3
    api, url = await _serve(backend)
    try:
        async with aiohttp.ClientSession() as s:
            first = [asyncio.create_task(_ask(s, url, p, stream=True)) for p in PROMPTS[:3]]
            snap = await _until(lambda: (x := pool.snapshot())["waiting"] and len(x["running"]) == 2 and x)
            # one running on each scheduler (the least loaded takes the next), the third waits
            assert [len(sched.snapshot()["running"]) for sched in pool.schedulers] == [1, 1]
            assert len(snap["waiting"]) == 1
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with s.post(f"{url}/chat/completions", json=body, headers=HEADERS) as r:
                assert r.status == 429, await r.text()  # max_batch + max_queue over both, not per scheduler
                assert int(r.headers["Retry-After"]) >= 1
            gate.open()
            replies = await asyncio.gather(*first)
    finally:
        gate.open()
        await api.close()
    hand.join()
    assert replies == [solo[p] for p in PROMPTS[:3]]
    assert pool.peak_batch <= 2 and not ffn.failed


async def test_one_user_gets_one_scheduler(model_dir, solo):
    backend, ffn, hand = staged_backend(model_dir)
    pool = backend.scheduler
    api, url = await _serve(backend)
    try:
        async with aiohttp.ClientSession() as s:
            for p in PROMPTS[:3]:  # one after the other
                assert await _ask(s, url, p, stream=False) == solo[p]
    finally:
        await api.close()
    hand.join()
    assert pool.schedulers[0].steps > 0 and pool.schedulers[1].steps == 0


def test_one_scheduler_without_stages_on_other_peers(model_dir):
    model = load_model(model_dir)
    backend = EngineBackend(model, tokenizer_for(model), model_id="m")
    assert schedulers_for(None) == 1 and backend.scheduler.width == 1 == len(backend.scheduler.schedulers)
    _, coordinator_alone, _, _ = staged(model_dir, (Stage(COORD, 0, 3),))
    _, one_worker, _, _ = staged(model_dir, (Stage(W1, 0, 3),))
    _, three, _, _ = staged(model_dir, (Stage(COORD, 0, 1), Stage(W1, 1, 2), Stage(W2, 2, 3)))
    assert schedulers_for(coordinator_alone) == 1 and schedulers_for(one_worker) == 1 and schedulers_for(three) == 3
    backend.set_ffn(three)  # the coordinator's newest dispatch: new requests spread over three
    assert backend.scheduler.width == 3
    backend.set_ffn(coordinator_alone)
    assert backend.scheduler.width == 1 and len(backend.scheduler.schedulers) == 3  # the others idle
