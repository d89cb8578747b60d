"""``--verify 100`` against a lying stage peer over real links (aiortc data channels in a network
namespace, SwarmRoles with ``layout="stages"``): the worker answers its stage honestly, then
shifts one element of each row by half a percent of the row — far outside the bound of another
numeric build, let alone bits. The coordinator catches the first lie, records it once as an event
naming the peer, runs the stage itself from then on, and the greedy tokens and logits are the
local run's."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import numpy as np
import pytest

from swarm.compute.model import load_model
from swarm.keys.identity import Identity
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.stage_verify import VERIFY_FAILED
from swarm.peer.net.messages import StageAnswer
from swarm.peer.node import Node
from swarm.peer.roles import SwarmRoles
from swarm.signaling.server import SignalingServer
from tests.peer._links import run_in_netns
from tests.peer._swarm_models import PROMPT, build, greedy
from tests.peer.coordinator.test_stages_loopback import FAST_LINKS, staged
from tests.peer.test_swarm_loopback import Peer, until

ADDRESS = "10.216.0.1"
HONEST_ANSWERS = 2  # the prefill and the first decode step are answered honestly

pytestmark = pytest.mark.slow


def test_a_stage_peer_that_lies_over_a_real_link_is_caught_and_the_tokens_stay_local(tmp_path):
    model_dir = build("qwen3_moe", tmp_path)

    async def main():
        key = SwarmKey(os.urandom(32))
        idents = [Identity.generate(), Identity.generate()]
        server = SignalingServer(key.secret, idents[0].peer_id, config_dir=tmp_path)
        await server.start(ADDRESS, 0)
        peers = []
        try:
            for i, (ident, gflops) in enumerate(zip(idents, (2.0, 1.0))):
                model = load_model(model_dir)
                node = Node(swarm_key=key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                            name=f"peer{i}", signal_url=server.url(ADDRESS), ffn_gflops=gflops,
                            memory_budget=1 << 30, model_hash=model.content_hash(),
                            status_path=tmp_path / f"status{i}.json", link_options=FAST_LINKS)
                await node.start(timeout=10)
                roles = SwarmRoles(node, model, serve_api=False, startup_quiet_s=1.0, layout="stages", verify=1.0)
                await roles.start()
                peers.append(Peer(node, roles))
            coord, worker = peers
            await until(lambda: staged(coord, [worker]), 40, "a stage plan with the worker in it")
            runner = worker.roles.worker.stage_runner
            honest, lies = runner.handle, []

            def lying(msg):
                answer = honest(msg)
                if isinstance(answer, StageAnswer) and runner.served > HONEST_ANSWERS:
                    x = answer.x.copy()
                    x[:, 0] += np.float32(0.005) * np.abs(x).max(axis=1)
                    lies.append(msg.request_id)
                    return dataclasses.replace(answer, x=x)
                return answer

            runner.handle = lying
            run = await asyncio.to_thread(greedy, coord.roles.model, coord.roles.coordinator.engine_ffn, PROMPT, 8)
            events = [e for e in coord.node.activity if e["what"] == VERIFY_FAILED]
            return run, len(lies), events, worker.node.peer_id
        finally:
            for p in peers:
                await p.stop()
            await server.stop()

    run, lies, events, liar = run_in_netns(main, timeout_s=240, prefix="csv", address=ADDRESS)
    model = load_model(model_dir)
    ref = greedy(model, None, PROMPT, 8)
    assert run[0] == ref[0] and all(np.array_equal(a, b) for a, b in zip(run[1], ref[1], strict=True))
    assert lies >= 1  # it lied, and the lie reached no token
    assert len(events) == 1 and events[0]["peer_id"] == liar, events  # caught once, named
