"""Prefix reuse under stages, over a real link: a sequence that continues from a kept cache
(the coordinator names it by its sequence id) makes the stage peer truncate that sequence's KV
cache to the shared prefix and run only the new rows; the logits are the local run's bits. A
stage peer that lost its caches (as after a restart) answers ``cache_gap`` and the coordinator
resends the whole sequence from the rows it recorded: the same bits, never a wrong token.

Oracles: the local engine on a fresh copy of the model (whole prompts, no reuse); the batch
scheduler with reuse off.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.compute.sampling import SamplingParams
from swarm.compute.serving import BatchScheduler
from tests.peer._links import run_in_netns
from tests.peer._swarm_models import PROMPT, build
from tests.peer.coordinator.test_stages_loopback import ADDRESS, stage_pair

pytestmark = pytest.mark.slow
NEW = [12, 8, 40]  # a second turn's new tokens


def test_a_stage_peer_reuses_a_kept_prefix_and_a_lost_cache_falls_back_to_a_full_resend(tmp_path):
    model_dir = build("qwen3_moe", tmp_path)
    second = PROMPT + NEW
    other = PROMPT[:6] + [2, 9]  # shares 6 positions with the sequence so far

    async def main():
        async with stage_pair(tmp_path, model_dir) as (coord, worker):
            runner = worker.roles.worker.stage_runner
            seen: list[list[tuple[int, int]]] = []  # each request's (start, rows) per sequence
            handle = runner.handle

            def spy(msg):
                seen.append([(s.start, s.rows) for s in msg.segments])
                return handle(msg)

            runner.handle = spy
            model, ffn = coord.roles.model, coord.roles.coordinator.engine_ffn

            def turns():
                cache = model.new_cache(capacity=16)
                model.forward(PROMPT, cache, ffn=ffn)
                out = {"first": list(seen)}
                out["second"] = model.forward(NEW, cache, ffn=ffn, last_only=True)  # the kept prefix continued
                out["after_second"] = list(seen)
                cache.truncate(6)  # a prompt that diverges after 6 positions
                out["other"] = model.forward(other[6:], cache, ffn=ffn, last_only=True)
                out["after_other"] = list(seen)
                out["dropped"] = runner.forget()
                cache.truncate(6)
                out["resent"] = model.forward(other[6:], cache, ffn=ffn, last_only=True)
                out["after_resent"] = list(seen)
                # the scheduler's own reuse, under the stage dispatch
                sched = BatchScheduler(model, lambda: ffn, chunk=4, prefill_rows=8)
                params = SamplingParams(max_tokens=4, logprobs=2)
                s1 = [(s.token, s.logprob) for s in sched.submit(PROMPT, params).sampled()]
                n = len(seen)
                stream = sched.submit(PROMPT + [t for t, _ in s1] + NEW, params)
                s2 = [(s.token, s.logprob) for s in stream.sampled()]
                out["sched"] = (s1, s2, stream.reused, seen[n])
                return out

            got = await asyncio.to_thread(turns)
            got["failed"] = coord.roles.coordinator.stages.failed
            return got

    got = run_in_netns(main, timeout_s=240, prefix="cpx", address=ADDRESS)
    ref = load_model(model_dir)
    for name, prompt in (("second", second), ("other", other), ("resent", other)):
        assert np.array_equal(got[name], ref.forward(prompt, ref.new_cache(), last_only=True)), name
    assert got["first"] == [[(0, len(PROMPT))]]
    assert got["after_second"][1:] == [[(len(PROMPT), len(NEW))]]  # only the new rows crossed to the peer
    assert got["after_other"][2:] == [[(6, 2)]]  # the peer cut its cache back to the shared prefix
    assert got["dropped"] >= 1
    # the peer lost its caches: the step at position 6 is refused, then the sequence resent whole
    assert got["after_resent"][3:] == [[(6, 2)], [(0, 8)]]
    s1, s2, reused, request = got["sched"]
    # the rest of the prompt from the kept prefix on, cut at the chunk bounds (4) a whole prefill has
    assert reused == len(PROMPT) + len(s1) - 1 == 13 and request == [(13, 3)]
    fresh = BatchScheduler(ref, chunk=4, prefill_rows=8, prefix_reuse=False)
    params = SamplingParams(max_tokens=4, logprobs=2)
    assert s1 == [(s.token, s.logprob) for s in fresh.submit(PROMPT, params).sampled()]
    assert s2 == [(s.token, s.logprob) for s in fresh.submit(PROMPT + [t for t, _ in s1] + NEW, params).sampled()]
    assert not got["failed"]
