"""Stages over real links when rows are regrouped: the coordinator resends a missed decode row
together with the next one (2 rows where the worker saw 1), runs a missed step itself after
rebuilding the stage's KV cache from the whole history in one call (> SMALL_T rows where the
worker saw a prefill and single decode rows), and after a stage peer leaves rebuilds its layers'
cache the same way. Each path gives the local run's logits bit for bit, because a row's result
depends only on the row (swarm/compute/ffn.py, "Segments"). Same harness as
test_stages_loopback.py: real signaling, real aiortc links, one event loop in a network namespace.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.compute.quant import SMALL_T
from tests.peer._links import run_in_netns
from tests.peer._swarm_models import build, greedy
from tests.peer.coordinator.test_stages_loopback import ADDRESS, stage_pair

pytestmark = pytest.mark.slow

# two prompts longer than one block-kernel call (token ids < 96, the tiny models' vocabulary)
PROMPT_A = [(7 * i + 3) % 96 for i in range(SMALL_T + 6)]
PROMPT_B = [(5 * i + 11) % 96 for i in range(SMALL_T + 3)]
MISS_AT, KILL_AT, STEPS = 2, 2, 5


def test_a_missed_step_and_a_lost_stage_give_the_local_bits(tmp_path):
    model_dir = build("qwen3_moe", tmp_path)

    async def main():
        async with stage_pair(tmp_path, model_dir) as (coord, worker):
            st, wid = coord.roles.coordinator.stages, worker.node.peer_id
            model, ffn = coord.roles.model, coord.roles.coordinator.engine_ffn
            loop = asyncio.get_running_loop()

            def miss_once(step):
                """Step MISS_AT: a deadline of 0, and the worker's answer dropped as if it came
                late (the request did reach the worker, whose cache now holds that row). The
                next step waits for that answer: until it is heard from, the worker is suspect
                and would be sent nothing."""
                timing = st.timing[wid]
                if step == MISS_AT:
                    timing.deadline_s = lambda rows: 0.0

                    def late(peer, msg):
                        del st.deliver  # the next answers are delivered again
                    st.deliver = late
                elif step == MISS_AT + 1:
                    del timing.deadline_s
                    until = time.monotonic() + 10.0
                    while "deliver" in vars(st) and time.monotonic() < until:  # its late answer came
                        time.sleep(0.01)

            a = await asyncio.to_thread(greedy, model, ffn, PROMPT_A, STEPS, miss_once)
            missed = (st.misses, st.rebuilt_positions, set(st.failed), st.remote_steps)
            gone = asyncio.Event()

            def leave(step):
                if step == KILL_AT:  # the worker leaves: its process stops, its link closes
                    loop.call_soon_threadsafe(lambda: asyncio.ensure_future(worker.stop()).add_done_callback(
                        lambda _: gone.set()))

            b = await asyncio.to_thread(greedy, model, ffn, PROMPT_B, STEPS, leave)
            await gone.wait()
            return a, b, missed, st.rebuilt_positions, {p for p, t in st.timing.items() if t.failures} | st.tracker.left

    a, b, (misses, rebuilt_a, failed_a, remote_a), rebuilt, failed = run_in_netns(
        main, timeout_s=240, prefix="csr", address=ADDRESS)
    ref = load_model(model_dir)
    for run, prompt in ((a, PROMPT_A), (b, PROMPT_B)):
        want = greedy(ref, None, prompt, STEPS)
        assert run[0] == want[0]
        for step, (got, exp) in enumerate(zip(run[1], want[1], strict=True)):
            assert np.array_equal(got, exp), (prompt is PROMPT_B, step, float(np.abs(got - exp).max()))
    # the miss: run here after rebuilding > SMALL_T positions, the worker kept and resent 2 rows
    assert misses == 1 and not failed_a
    assert rebuilt_a == len(PROMPT_A) + MISS_AT > SMALL_T
    assert remote_a == STEPS  # the prefill and every decode step but the missed one
    # the loss: its layers' cache rebuilt here (> SMALL_T positions), from the coordinator's record
    assert len(failed) == 1
    assert rebuilt - rebuilt_a >= len(PROMPT_B) + KILL_AT > SMALL_T
