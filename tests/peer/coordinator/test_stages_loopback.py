"""Stages over real links: peer nodes on this machine — real aiohttp signaling, real aiortc
data channels, SwarmRoles with ``layout="stages"`` — and the oracle is the local engine: a
stage plan gives the local run's tokens and bit-identical logits, on dense SmolLM2 and on a
tiny random MoE; a stage peer that leaves at token 10 changes nothing in the tokens (its layers
move to the coordinator, their KV cache rebuilt from the rows that had entered them). Several
sequences are pipelined in groups over the stages: the same bits, groups in flight at the
worker while the coordinator computes its stage for another, and a worker lost with groups in
flight changes no sequence; two batches stepping at once (the API's schedulers) overlap on both
peers and survive the worker killed mid-flight.

One event loop inside a fresh network namespace (aioice skips 127.0.0.1); the token loop runs
in a thread, as in ``join``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import numpy as np
import pytest

from swarm.compute.default_model import default_model_path
from swarm.compute.model import load_model
from swarm.keys.identity import Identity
from swarm.peer.node import Node
from swarm.peer.roles import SwarmRoles
from swarm.peer.status import describe_share
from swarm.keys.swarmkey import SwarmKey
from swarm.signaling.server import SignalingServer
from tests.peer._links import run_in_netns
from tests.peer._swarm_models import PROMPT, build, greedy
from tests.peer.test_swarm_loopback import Peer, until

ADDRESS = "10.215.0.1"
FAST_LINKS = {"heartbeat_s": 0.2, "dead_after_s": 2.0}

pytestmark = pytest.mark.slow


async def start_stage_swarm(tmp_path, model_path, gflops: list[float], layout: str = "stages",
                            budgets: list[int] | None = None, link_options: dict = FAST_LINKS):
    key = SwarmKey(os.urandom(32))
    idents = [Identity.generate() for _ in gflops]
    server = SignalingServer(key.secret, idents[0].peer_id, config_dir=tmp_path)
    await server.start(ADDRESS, 0)
    peers = []
    for i, (ident, g) in enumerate(zip(idents, gflops)):
        model = load_model(model_path)  # each peer its own copy, as on separate machines
        node = Node(swarm_key=key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id, name=f"peer{i}",
                    signal_url=server.url(ADDRESS), ffn_gflops=g, memory_budget=budgets[i] if budgets else 1 << 30,
                    model_hash=model.content_hash(), status_path=tmp_path / f"status{i}.json",
                    link_options=link_options)
        await node.start(timeout=10)
        roles = SwarmRoles(node, model, serve_api=False, startup_quiet_s=1.0, layout=layout)
        await roles.start()
        peers.append(Peer(node, roles))
    return server, peers


def staged(coord: Peer, workers: list[Peer]) -> bool:
    """The coordinator dispatches stages to every worker, and each accepted that layout."""
    st = coord.roles.coordinator.stages
    if st is None or set(st.layout.workers()) != {w.node.peer_id for w in workers}:
        return False
    return all(w.roles.worker.stage_runner.serves(st.layout.term, st.layout.version) for w in workers)


@contextlib.asynccontextmanager
async def stage_pair(tmp_path, model_path):
    """A coordinator and one worker (speeds 2:1) whose stage plan is in force; both stopped on exit."""
    server, peers = await start_stage_swarm(tmp_path, model_path, [2.0, 1.0])
    try:
        coord, worker = peers
        await until(lambda: staged(coord, [worker]), 40, "a stage plan with the worker in it")
        yield coord, worker
    finally:
        for p in peers:
            await p.stop()
        await server.stop()


def run_stage_swarm(tmp_path, model_path, prompt, n, kill_at=None):
    async def main():
        server, peers = await start_stage_swarm(tmp_path, model_path, [2.0, 1.0])
        try:
            coord, worker = peers
            await until(lambda: staged(coord, [worker]), 40, "a stage plan with the worker in it")
            layout = coord.roles.coordinator.stages.layout
            loop = asyncio.get_running_loop()
            gone = asyncio.Event()

            def on_step(step):
                if step == kill_at:  # the worker leaves: its process stops, its link closes
                    loop.call_soon_threadsafe(lambda: asyncio.ensure_future(worker.stop()).add_done_callback(
                        lambda _: gone.set()))

            run = await asyncio.to_thread(greedy, coord.roles.model, coord.roles.coordinator.engine_ffn, prompt, n, on_step)
            if kill_at is not None:
                await gone.wait()
            st = coord.roles.coordinator.stages
            placement = coord.node.placement
            known = dict(worker.node.placement or {}, worker=worker.node.peer_id)  # what its `status` shows
            # peers whose stage was given up during the run (a re-plan after the loss clears st.failed):
            # failed, or left — the worker stopped here closes its link: it leaves, it does not fail
            failed = {peer for peer, t in st.timing.items() if t.failures}
            left = set(st.tracker.left)
            if kill_at is not None:
                assert left == {worker.node.peer_id} and failed == set(), (left, failed)
            runner = worker.roles.worker.stage_runner
            return run, layout, runner.served, st.rebuilt_positions, failed | left, runner.inline, placement, known
        finally:
            for p in peers:
                await p.stop()
            await server.stop()

    *out, placement, known = run_in_netns(main, timeout_s=240, prefix="cst", address=ADDRESS)
    # what status --json shows: the stages and the cost model's inputs and prices
    assert placement["layout"] == "stages" and placement["cost"]["mode"] == "stages"
    if kill_at is None:  # (after a loss the newest plan has the coordinator alone)
        assert [tuple(s) for s in placement["stages"]] == [(s.peer, s.start, s.stop) for s in out[1].stages]
        # the worker's own status knows the stage plan it runs, and names its layers
        assert [known[k] for k in ("term", "version", "coordinator", "stages")] == [
            placement[k] for k in ("term", "version", "coordinator", "stages")]  # the newest plan, as both know it
        share = describe_share(known, known["worker"])  # in the words the coordinator's status uses
        assert share == describe_share(placement, known["worker"]) and "whole (attention, KV cache, MLP)" in share
    assert {e["layout"] for e in placement["cost"]["estimates"]} >= {"ranges", "stages"}
    assert all(p["gflops"] > 0 for p in placement["cost"]["peers"])
    return out


def test_a_moe_stage_plan_over_real_links_gives_the_local_bits(tmp_path):
    model_dir = build("qwen3_moe", tmp_path)
    run, layout, served, rebuilt, failed, inline = run_stage_swarm(tmp_path, model_dir, PROMPT, 12)
    assert [len(s) for s in layout.stages] == [2, 1] and layout.stages[0].peer == layout.coordinator
    ref = greedy(load_model(model_dir), None, PROMPT, 12)
    assert run[0] == ref[0]
    assert all(np.array_equal(a, b) for a, b in zip(run[1], ref[1], strict=True))
    assert served == 13 and rebuilt == 0 and not failed
    # decode steps ran on the worker's event loop (the first one timed them; a prefill never does)
    assert 1 <= inline <= 11


def assert_each_solo(model_dir, tokens, logits, n):
    """Each of ``PROMPTS``' runs (tokens, logits) is its solo local run's of ``n`` decode steps."""
    from tests.peer.coordinator.test_stages import PROMPTS, greedy_alone

    ref_model = load_model(model_dir)
    for i, prompt in enumerate(PROMPTS):
        ref = greedy_alone(ref_model, prompt, n)
        assert tokens[i] == ref[0]
        assert all(np.array_equal(a, b) for a, b in zip(logits[i], ref[1], strict=True))


def test_three_sequences_batched_through_two_stages_each_give_their_solo_bits(tmp_path):
    """Continuous batching over real links: three sequences joining one step apart share every
    step, pipelined in groups over the coordinator's stage and the worker's (one StageRequest per
    group and step for the worker's stage); each gets its solo local run's bits, and a group is
    in flight at the worker while the coordinator computes its own stage for another."""
    import time

    from swarm.peer.coordinator.costmodel import pipeline_groups
    from tests.peer.coordinator.test_stages import PROMPTS, greedy_together

    model_dir = build("qwen3_moe", tmp_path)
    stamps: dict[str, list] = {"local": [], "remote": []}

    def stamped(kind, method):
        def run(group, *args):
            t0 = time.monotonic()
            out = method(group, *args)
            stamps[kind].append((t0, time.monotonic(), {p.seq.id for p in group}, out is not None))
            return out
        return run

    async def main():
        async with stage_pair(tmp_path, model_dir) as (coord, worker):
            st = coord.roles.coordinator.stages
            st._local, st._remote = stamped("local", st._local), stamped("remote", st._remote)
            run = await asyncio.to_thread(greedy_together, coord.roles.model, coord.roles.coordinator.engine_ffn,
                                          PROMPTS, 6)
            return run, worker.roles.worker.stage_runner.served, st.remote_steps, st.failed, st.misses

    (tokens, logits), served, remote, failed, misses = run_in_netns(main, timeout_s=240, prefix="cst",
                                                                    address=ADDRESS)
    assert_each_solo(model_dir, tokens, logits, 6)
    # one request per group and step, not one per sequence; a step whose deadline a stall on a
    # loaded machine outran ran here (same bits), its request still served by the worker
    active = [sum(i <= step <= i + 6 for i in range(len(PROMPTS))) for step in range(6 + len(PROMPTS))]
    requests = sum(pipeline_groups(n, 2) for n in active)
    assert requests > len(active)  # steps of several sequences were split
    assert not failed and remote + misses == requests
    assert remote <= served <= requests
    # the wavefront: the worker had one group while the coordinator ran its stage for another
    assert any(r[0] < lo[1] and lo[0] < r[1] and not r[2] & lo[2] and r[3]
               for r in stamps["remote"] for lo in stamps["local"])


def test_a_stage_peer_lost_with_groups_in_flight_changes_no_sequence(tmp_path):
    """Three sequences pipelined in groups over the coordinator's stage and the worker's; the
    worker stops while a step's groups cross the stages (its link closes under whichever group
    it holds): every sequence keeps its solo local run's tokens and bits, the worker's layers
    run on the coordinator from then on, their KV cache rebuilt from the recorded rows."""
    from tests.peer.coordinator.test_stages import PROMPTS, greedy_together

    model_dir = build("qwen3_moe", tmp_path)
    kill_at = 4  # every sequence running: the step is cut into two groups

    async def main():
        async with stage_pair(tmp_path, model_dir) as (coord, worker):
            loop = asyncio.get_running_loop()
            gone = asyncio.Event()
            st = coord.roles.coordinator.stages
            runner = worker.roles.worker.stage_runner
            handle = runner.handle

            def on_step(step):
                if step == kill_at:  # stopped as the step's first request reaches it
                    def stopping(msg):
                        runner.handle = handle
                        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(worker.stop()).add_done_callback(
                            lambda _: gone.set()))
                        return handle(msg)
                    runner.handle = stopping

            run = await asyncio.to_thread(greedy_together, coord.roles.model, coord.roles.coordinator.engine_ffn,
                                          PROMPTS, 8, on_step)
            await gone.wait()
            failed = {peer for peer, t in st.timing.items() if t.failures} | st.tracker.left  # failed, or left
            return run, failed, worker.node.peer_id, st.rebuilt_positions, st.pipelined_steps

    (tokens, logits), failed, worker_id, rebuilt, pipelined = run_in_netns(main, timeout_s=240, prefix="cst",
                                                                           address=ADDRESS)
    assert_each_solo(model_dir, tokens, logits, 8)
    assert failed == {worker_id} and rebuilt > 0 and pipelined >= kill_at


def test_two_batches_stepping_at_once_overlap_on_both_peers_and_survive_a_stage_peer_killed(tmp_path):
    """The API's way of pipelining over real links: two batches step through the same stages at
    once (one thread each, as two batch schedulers; no step cut into groups). Stamped on both
    peers, the worker computes one batch's rows while the coordinator computes its own stage for
    the other's; the worker then stops with steps in flight, and every sequence keeps its solo
    local run's tokens and logits, bit for bit (its layers rebuilt on the coordinator)."""
    import time

    from tests.peer.coordinator.test_stages import PROMPTS, greedy_together

    model_dir = build("qwen3_moe", tmp_path)
    n, kill_at = 8, 5
    SLOW_STAGE_S = 0.01  # noqa: N806
    stamps: dict[str, list] = {"coordinator": [], "worker": []}

    async def main():
        async with stage_pair(tmp_path, model_dir) as (coord, worker):
            loop = asyncio.get_running_loop()
            gone = asyncio.Event()
            st = coord.roles.coordinator.stages
            st.set_schedulers(2)  # as the API's pool tells it
            runner = worker.roles.worker.stage_runner
            handle, local = runner.handle, st._local

            def worker_stamped(msg):  # on the worker peer: the rows it computes, and for whom
                t0 = time.monotonic()
                out = handle(msg)
                time.sleep(SLOW_STAGE_S)  # a slower peer: its steps long enough to see beside the coordinator's
                stamps["worker"].append((t0, time.monotonic(), {s.sequence for s in msg.segments}))
                return out

            def coord_stamped(group, stage):  # on the coordinator: its own stage's compute
                t0 = time.monotonic()
                out = local(group, stage)
                stamps["coordinator"].append((t0, time.monotonic(), {p.seq.id for p in group}))
                return out

            def stopping(msg):  # the worker leaves as this request reaches it
                runner.handle = handle
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(worker.stop()).add_done_callback(
                    lambda _: gone.set()))
                return handle(msg)

            def on_step(step):
                if step == kill_at:
                    runner.handle = stopping

            runner.handle, st._local = worker_stamped, coord_stamped
            model, ffn = coord.roles.model, coord.roles.coordinator.engine_ffn
            (tok_a, log_a), (tok_b, log_b) = await asyncio.gather(
                asyncio.to_thread(greedy_together, model, ffn, PROMPTS[:1], n, on_step),
                asyncio.to_thread(greedy_together, model, ffn, PROMPTS[1:], n))
            await gone.wait()
            failed = {peer for peer, t in st.timing.items() if t.failures} | st.tracker.left  # failed, or left
            return (tok_a + tok_b, log_a + log_b), failed, worker.node.peer_id, st.rebuilt_positions, st.pipelined_steps

    (tokens, logits), failed, worker_id, rebuilt, pipelined = run_in_netns(main, timeout_s=240, prefix="cst",
                                                                           address=ADDRESS)
    assert_each_solo(model_dir, tokens, logits, n)
    assert failed == {worker_id} and rebuilt > 0 and pipelined == 0
    assert any(w[0] < c[1] and c[0] < w[1] and not w[2] & c[2]
               for w in stamps["worker"] for c in stamps["coordinator"])


def test_a_coordinator_that_cannot_hold_its_stages_ffn_hands_it_out_as_ranges(tmp_path):
    """A mix, chosen by auto: the coordinator's budget holds no whole layer and the worker's not
    all three, so neither the coordinator alone nor whole-layer stages fit. The coordinator keeps
    layer 0 with its experts cut into ranges over both peers (the worker's within what its stage
    leaves), the worker runs layers 1..2 as a stage: the local run's tokens and bits."""
    model_dir = build("qwen3_moe", tmp_path)
    model = load_model(model_dir)
    own = model.embed.nbytes + model.head.nbytes  # embeddings and head: only the coordinator holds them
    # Allowances under the budget rule (docs/capacity.md; 256 positions of KV cache, the model's
    # context). Each layer with its KV cache takes 311 296, 151 552 and 311 296 bytes; a worker's
    # step takes 589 824 bytes of activations, the coordinator's 663 552 plus 65 536 of rows it
    # records per worker stage. The coordinator has 1 030 000 - 729 088 = 300 912 bytes left:
    # no whole layer. The worker has 1 250 000 - 589 824 = 660 176: layers 0..1 but not layer 2
    # too, so whole stages do not fit; layers 1..2 (462 848) leave it room for experts of layer 0.
    budgets = [own + 1_030_000, 1_250_000]

    async def main():
        server, peers = await start_stage_swarm(tmp_path, model_dir, [2.0, 1.0], layout="auto", budgets=budgets)
        try:
            coord, worker = peers
            me = worker.node.peer_id

            def mixed():
                c = coord.roles.coordinator
                return (staged(coord, [worker]) and c.ffn is not None and me in c.ffn.plan.workers()
                        and worker.roles.worker.server is not None
                        and worker.roles.worker.server.serves(c.ffn.plan.term, c.ffn.plan.version))

            await until(mixed, 40, "a mix: a stage and ranges for the worker")
            c = coord.roles.coordinator
            plan, layout = c.ffn.plan, c.stages.layout
            run = await asyncio.to_thread(greedy, coord.roles.model, c.engine_ffn, PROMPT, 12)
            w = worker.roles.worker
            return (run, plan, layout, w.stage_runner.served, w.server.served, set(c.stages.failed) | set(c.ffn.failed),
                    coord.node.placement)
        finally:
            for p in peers:
                await p.stop()
            await server.stop()

    run, plan, layout, stage_served, range_served, failed, placement = run_in_netns(
        main, timeout_s=240, prefix="cst", address=ADDRESS)
    assert placement["layout"] == "mix" and placement["cost"]["choice"] == "mix"
    assert placement["streamed_bytes"] == 0  # the two peers hold layer 0's experts between them
    assert [(s.start, s.stop) for s in layout.stages] == [(0, 1), (1, 3)] and layout.stages[0].peer == layout.coordinator
    worker_id = layout.stages[1].peer
    assert plan.expert_span(0, worker_id) is not None  # layer 0's experts are shared ...
    assert plan.expert_span(2, worker_id) is None and plan.dense_span(1, worker_id) is None  # ... its stage's not
    ref = greedy(load_model(model_dir), None, PROMPT, 12)
    assert run[0] == ref[0]
    assert all(np.array_equal(a, b) for a, b in zip(run[1], ref[1], strict=True))
    assert not failed and stage_served == 13 and range_served >= 1


def test_smollm2_over_two_stages_and_real_links_gives_the_local_bits(tmp_path):
    path = default_model_path()
    prompt = [1, 504, 3458, 314, 253, 1345, 30]
    run, layout, served, _, failed, _ = run_stage_swarm(tmp_path, path, prompt, 6)
    assert len(layout.stages) == 2 and layout.stages[1].start == 20  # 2:1 by speed over 30 layers
    ref = greedy(load_model(path), None, prompt, 6)
    assert run[0] == ref[0]
    assert all(np.array_equal(a, b) for a, b in zip(run[1], ref[1], strict=True))
    assert served == 7 and not failed


def test_a_stage_peer_lost_at_token_10_changes_no_token(tmp_path):
    model_dir = build("qwen3_moe", tmp_path)
    run, layout, served, rebuilt, failed, _ = run_stage_swarm(tmp_path, model_dir, PROMPT, 16, kill_at=10)
    ref = greedy(load_model(model_dir), None, PROMPT, 16)
    assert run[0] == ref[0]
    assert failed == {layout.stages[1].peer}
    assert served >= 10 and rebuilt >= len(PROMPT) + 10  # its layers' cache rebuilt on the coordinator


def test_auto_prices_the_worker_by_its_observed_speed(tmp_path):
    """After a run under stages, the planner's inputs carry the worker's speed as observed from
    its answers, not the figure of its hello."""
    model_dir = build("qwen3_moe", tmp_path)

    async def main():
        async with stage_pair(tmp_path, model_dir) as (coord, worker):
            await asyncio.to_thread(greedy, coord.roles.model, coord.roles.coordinator.engine_ffn, PROMPT, 4)
            version = coord.roles.coordinator.ffn.plan.version
            coord.roles.coordinator.set_layout("auto")
            await until(lambda: (coord.roles.node.placement or {}).get("cost", {}).get("mode") == "auto"
                        and coord.roles.coordinator.plan_version > version, 20, "a plan priced in auto mode")
            return coord.roles.node.placement["cost"], worker.node.peer_id

    cost, worker_id = run_in_netns(main, timeout_s=120, prefix="cst", address=ADDRESS)
    (seen,) = [p for p in cost["peers"] if p["peer_id"] == worker_id]
    assert seen["observed"] and seen["gflops"] != 1.0, cost["peers"]
    assert cost["choice"] in ("local", "ranges", "stages")


def test_a_stage_peer_that_lost_its_stage_plan_is_sent_it_again(tmp_path):
    """A worker that restarts its stage runner (no layout, no caches) refuses the next step as
    not serving its plan: the coordinator runs that stage's layers itself, sends the worker the
    sequence's stage plan again (a re-plan under load may have made a newer one the newest) and,
    once a probe is answered, hands the layers back; no token changes."""
    import time

    from swarm.peer.worker.stages import StageRunner

    model_dir = build("qwen3_moe", tmp_path)

    async def main():
        async with stage_pair(tmp_path, model_dir) as (coord, worker):
            fresh = StageRunner(worker.node.peer_id, worker.roles.model)

            def on_step(step):
                if step == 3:
                    worker.roles.worker.stage_runner = fresh  # as after a restart: no layout, no caches
                if step >= 3:
                    time.sleep(0.15)  # a probe goes out every 0.5 s

            run = await asyncio.to_thread(greedy, coord.roles.model, coord.roles.coordinator.engine_ffn, PROMPT, 16, on_step)
            st = coord.roles.coordinator.stages
            return run, fresh.served, dict(st.not_ready), {p for p, t in st.timing.items() if t.failures}, st.failed

    run, served, not_ready, failures, failed = run_in_netns(main, timeout_s=180, prefix="cst", address=ADDRESS)
    ref = greedy(load_model(model_dir), None, PROMPT, 16)
    assert run[0] == ref[0]
    assert not failures and not failed and not not_ready  # not ready for a while, never failed
    assert 1 <= served <= 12  # the layers went back to it (the whole sequence resent, then steps)


def stage_trio_status(tmp_path):
    """A coordinator and two workers (speeds 3:1:1) over real links under ``--layout stages`` on
    the tiny MoE (3 layers: one stage each): (the coordinator's status document, each worker's,
    the stage layout, the model's shape). The per-layer plan of such a layout holds the
    coordinator alone; status, events and the dashboard must name the stage workers all the same."""
    from swarm.peer.weights.sizes import model_shape

    model_dir = build("qwen3_moe", tmp_path)

    async def main():
        server, peers = await start_stage_swarm(tmp_path, model_dir, [3.0, 1.0, 1.0])
        try:
            coord, *workers = peers
            await until(lambda: staged(coord, workers), 40, "a stage plan with both workers in it")
            await until(lambda: all((w.node.placement or {}).get("stages") == coord.node.placement["stages"]
                                    for w in workers), 20, "the workers knowing the stage plan")
            await asyncio.to_thread(greedy, coord.roles.model, coord.roles.coordinator.engine_ffn, PROMPT, 3)
            return (coord.node.status(), [w.node.status() for w in workers], coord.roles.coordinator.stages.layout,
                    model_shape(coord.roles.model))
        finally:
            for p in peers:
                await p.stop()
            await server.stop()

    return run_in_netns(main, timeout_s=180, prefix="cst", address=ADDRESS)


def test_status_and_events_name_the_stage_workers_with_their_role(tmp_path):
    import io
    import re

    from rich.console import Console

    from swarm.peer.status import render, shares

    doc, worker_docs, layout, shape = stage_trio_status(tmp_path)
    me, workers = doc["peer_id"], [w["peer_id"] for w in worker_docs]
    placement = doc["placement"]
    assert placement["layout"] == "stages" and placement["peers"] == [me]  # the per-layer plan: the coordinator alone
    assert [s[0] for s in placement["stages"]] == [me, *workers] == [s.peer for s in layout.stages]
    # the coordinator counts its stage workers: the "replanned" event, its measurements, the shares
    replanned = [e["detail"] for e in doc["events"] if e["what"] == "replanned"]
    assert replanned and replanned[-1] == f"plan v{placement['version']} of term {placement['term']}: 2 worker(s)"
    observed = doc["observed"]["peers"]
    assert set(observed) == {me, *workers}
    ffn = {i: shape.n_experts * shape.unit_bytes()[0] if i in shape.moe_layers else
           shape.intermediate_size * shape.unit_bytes()[1] for i in range(3)}  # a layer's whole FFN, bytes
    assert sum(ffn.values()) > ffn[0] > 0
    for s in layout.stages:  # each holds its own layers' FFN: the coordinator no longer the whole model's
        assert observed[s.peer]["weight_bytes"] == sum(ffn[i] for i in range(s.start, s.stop)), s
    for w in workers:
        assert observed[w]["requests"] >= 4 and observed[w]["ms_per_row_layer"] > 0 and not observed[w]["failed"]
    assert shares(placement, [me, *workers])["workers"] == workers
    # `status`, on the coordinator and on a worker: each stage worker's role is "worker"
    for d in (doc, *worker_docs):
        out = io.StringIO()
        Console(file=out, width=200, color_system=None).print(render(d))
        rows = {m[1]: line for line in out.getvalue().splitlines() if (m := re.match(r"\s*(peer\d) ", line))}
        assert rows.keys() == {"peer0", "peer1", "peer2"}, out.getvalue()
        for i, w in enumerate(workers, 1):
            role = "worker" if w != d["peer_id"] else d["role"]
            assert rows[f"peer{i}"].split()[2] == role == "worker", rows[f"peer{i}"]
        assert rows["peer0"].split()[2] == "coordinator"
