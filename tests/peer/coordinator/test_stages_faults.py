"""Stage faults over real links (real signaling, real aiortc data channels, SwarmRoles with
``layout="stages"``; the harness of test_stages_loopback.py): a stage peer lost mid-generation
at a prompt longer than the serving loop's first cache capacity, the coordinator holding no
layer of its own; and a stage peer that stops sending for 8 s, which is marked down once, not
at every step, while the healthy stage peer keeps its stage. The oracle is the local engine:
same tokens, bit-identical logits."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.peer.coordinator.role import READMIT_S
from swarm.peer.plan import Stage, StageLayout
from tests.peer._links import run_in_netns
from tests.peer._swarm_models import build
from tests.peer.coordinator.test_stages_failover import SERVING_CAPACITY, prompt_of
from tests.peer.coordinator.test_stages_loopback import ADDRESS, FAST_LINKS, stage_pair, staged, start_stage_swarm

pytestmark = pytest.mark.slow

LONG = 40  # prompt tokens: past the serving loop's first cache capacity


def greedy_serving(model, ffn, prompt, n, on_step=None):
    """:func:`tests.peer._swarm_models.greedy` on a cache of the serving loop's first capacity."""
    cache = model.new_cache(capacity=SERVING_CAPACITY)
    logits, tokens = [model.forward(prompt, cache, ffn=ffn, last_only=True)], []
    for step in range(n):
        tokens.append(int(np.argmax(logits[-1][-1])))
        if on_step:
            on_step(step)
        logits.append(model.forward([tokens[-1]], cache, ffn=ffn, last_only=True))
    return tokens, logits


def assert_local_bits(model_dir, prompt, n, run):
    want = greedy_serving(load_model(model_dir), None, prompt, n)
    assert run[0] == want[0]
    for step, (got, exp) in enumerate(zip(run[1], want[1], strict=True)):
        assert np.array_equal(got, exp), (step, float(np.abs(got - exp).max()))


def test_a_stage_of_every_layer_lost_at_a_long_prompt_moves_to_the_coordinator_with_the_local_bits(tmp_path):
    model_dir = build("qwen3_moe", tmp_path)
    prompt, steps, kill_at = prompt_of(LONG), 8, 3

    async def main():
        async with stage_pair(tmp_path, model_dir) as (coord, worker):
            role, wid = coord.roles.coordinator, worker.node.peer_id
            st = role.stages
            # the worker runs every layer: the coordinator's cache grows only when a stage moves to it
            alone = StageLayout(st.layout.term, st.layout.version + 100, role.node.peer_id,
                                (Stage(wid, 0, role.model.config.n_layers),))
            worker.roles.worker.stage_runner.accept(alone)
            st.set_layout(alone)
            loop, gone = asyncio.get_running_loop(), asyncio.Event()

            def leave(step):
                if step == kill_at:  # the worker leaves: its process stops, its link closes
                    loop.call_soon_threadsafe(lambda: asyncio.ensure_future(worker.stop()).add_done_callback(
                        lambda _: gone.set()))

            run = await asyncio.to_thread(greedy_serving, role.model, role.engine_ffn, prompt, steps, leave)
            await gone.wait()
            return run, st.rebuilt_positions, {p for p, t in st.timing.items() if t.failures}, set(st.tracker.left), wid

    run, rebuilt, failed, left, wid = run_in_netns(main, timeout_s=240, prefix="csf", address=ADDRESS)
    assert_local_bits(model_dir, prompt, steps, run)
    assert rebuilt >= LONG + kill_at  # every layer's cache rebuilt here
    assert left == {wid} and failed == set()  # it closed its link: it left, it did not fail


PAUSE_S = 8.0


def test_a_stage_peer_silent_for_8_s_is_marked_down_once_and_the_healthy_one_keeps_its_stage(tmp_path):
    """The last stage's peer stops sending for PAUSE_S (what a stopped process looks like from
    the coordinator: nothing arrives, then everything it had queued); its link outlives the
    pause. It misses one step and is marked down once (one plan), stays out of every plan for
    READMIT_S and comes back after the pause (one more plan); the other worker keeps its stage
    throughout, and the tokens and logits are the local run's."""
    model_dir = build("qwen3_moe", tmp_path)
    prompt, steps, pause_at = prompt_of(LONG), 48, 2

    async def main():
        server, peers = await start_stage_swarm(tmp_path, model_dir, [2.0, 1.0, 1.0],
                                                link_options={**FAST_LINKS, "dead_after_s": 60.0})
        try:
            coord, *workers = peers
            await until_staged(coord, workers)
            role = coord.roles.coordinator
            first = role.stages.layout
            victim = first.stages[-1].peer
            healthy = next(w for w in first.workers() if w != victim)
            (paused,) = [w for w in workers if w.node.peer_id == victim]
            link = paused.node.links[coord.node.peer_id]
            version, downs, held = role.plan_version, [], []
            mark_down = role.peer_failed
            role.peer_failed = lambda peer, reason: (downs.append((peer, reason)), mark_down(peer, reason))
            loop = asyncio.get_running_loop()

            def pause():
                send = link.channel.send
                link.channel.send = held.append
                loop.call_later(PAUSE_S, resume, send)

            def resume(send):
                link.channel.send = send
                for data in held:
                    send(data)

            def on_step(step):
                if step == pause_at:
                    loop.call_soon_threadsafe(pause)
                time.sleep(0.3)  # the generation outlasts the pause and the re-admission

            run = await asyncio.to_thread(greedy_serving, role.model, role.engine_ffn, prompt, steps, on_step)
            st = role.stages
            return (run, role.plan_version - version, downs, victim, healthy, first,
                    [lay.workers() for lay in [st.layout]], st.timing[healthy].failures, dict(st.not_ready), len(held))
        finally:
            for p in peers:
                await p.stop()
            await server.stop()

    run, plans, downs, victim, healthy, first, (now_workers,), healthy_failures, not_ready, held = run_in_netns(
        main, timeout_s=300, prefix="csf", address=ADDRESS)
    assert_local_bits(model_dir, prompt, steps, run)
    assert held > 0  # the pause did hold back what it sent
    assert [p for p, _ in downs] == [victim], downs  # marked down once, not at every step
    assert 1 <= plans <= 3, f"{plans} new plans while one peer was silent for {PAUSE_S:g} s (READMIT_S {READMIT_S:g})"
    assert healthy in now_workers and healthy_failures == 0 and healthy not in not_ready


async def until_staged(coord, workers):
    from tests.peer.test_swarm_loopback import until

    await until(lambda: staged(coord, workers), 60, "a stage plan with every worker in it")
