"""A GPU peer (``join --gpu on``, lavapipe in CI) whose GPU is too small for one layer with its KV
cache (``--gpu-memory``), in a real swarm of two over loopback links whose coordinator cannot hold
the model (SmolLM2-135M, Q4_1): the planner gives it the layers the coordinator cannot hold,
counted against its host memory, and it computes them on its CPU — nothing uploaded to the GPU —
so the greedy tokens and logits are the local run's bits (docs/planner.md, "GPU memory")."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from swarm.compute.default_model import default_model_path
from swarm.compute.model import load_model
from swarm.keys.identity import Identity
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.costmodel import LayerCosts
from swarm.peer.worker.gpu import GpuFfn
from swarm.signaling.server import SignalingServer
from tests.peer._links import run_in_netns
from tests.peer._swarm_models import greedy
from tests.peer.coordinator.test_stages_loopback import staged
from tests.peer.test_swarm_gpu_stages import PROMPTS, STEPS, start_pair
from tests.peer.test_swarm_loopback import ADDRESS, stop_swarm, until

pytestmark = [pytest.mark.slow, pytest.mark.browser]

HELD = 10  # layers the coordinator's memory holds (of 30)


def test_a_gpu_peer_too_small_for_a_layer_runs_its_stage_on_its_cpu_with_the_local_runs_bits(tmp_path):
    path = default_model_path()
    model = load_model(path)
    c = LayerCosts.from_model(model)
    own = model.embed.nbytes + (0 if model.head is model.embed else model.head.nbytes)
    coord_budget = own + c.coordinator_reserve(1, kv_layers=range(0)) + sum(c.stage_bytes(i) for i in range(HELD))
    gpu_memory = c.step_bytes + c.stage_bytes(0) // 2  # not one layer with its KV cache

    async def main():
        key = SwarmKey(os.urandom(32))
        cpu, gpu_ident = Identity.generate(), Identity.generate()
        server = SignalingServer(key.secret, cpu.peer_id, config_dir=tmp_path)
        await server.start(ADDRESS, 0)
        gpu = await asyncio.to_thread(GpuFfn.open, "on")
        peers = []
        try:
            # the faster announced speed leads (the election's rule): the CPU peer coordinates
            await start_pair(peers, tmp_path, key, server, (cpu, gpu_ident), gpu, (2.0, 1.0),
                             (coord_budget, 1 << 30), gpu_memory)
            coord, worker = peers
            await until(lambda: staged(coord, [worker]), 60, "a stage plan with the GPU peer in it")
            runs = [await asyncio.to_thread(greedy, coord.roles.model, coord.roles.coordinator.engine_ffn, prompt, STEPS)
                    for prompt in PROMPTS]
            st = coord.roles.coordinator.stages
            runner = worker.roles.worker.stage_runner
            mine = st.layout.stages[-1]
            return (runs, st.layout, runner.served, runner.on_device(mine.start, mine.stop), runner.device.held(),
                    coord.node.placement.get("on_cpu"), set(st.failed))
        finally:
            await stop_swarm(server, peers)
            await asyncio.to_thread(gpu.close)

    runs, layout, served, on_device, held, on_cpu, failed = run_in_netns(main, timeout_s=300, prefix="csgc",
                                                                         address=ADDRESS)
    assert [(s.start, s.stop) for s in layout.stages] == [(0, HELD), (HELD, 30)]
    assert layout.stages[-1].peer != layout.coordinator and on_cpu == [layout.stages[-1].peer]
    assert not on_device and held == {"gpu": 0, "cpu": 0, "formats": set()}  # the GPU untouched
    assert served == len(PROMPTS) * (STEPS + 1) and not failed
    for prompt, run in zip(PROMPTS, runs, strict=True):
        ref = greedy(model, None, prompt, STEPS)
        assert run[0] == ref[0]
        assert all(np.array_equal(a, b) for a, b in zip(run[1], ref[1], strict=True))  # the CPU peer's bits
